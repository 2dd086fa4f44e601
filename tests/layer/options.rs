//! The layer's options and the headers it writes: shadow mode and shadow rules, the header
//! switches and a custom rejection, the IETF `RateLimit` names, bad options named and
//! options that would turn the limiter off refused, and what a shared band's headers tell one
//! client of the others.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use fluxgate::core::{Decision, RateLimitMetricsRecorder};
use fluxgate::tower::{ConfigError, RateLimitLayer};
use http::{Response, StatusCode};

use crate::support::app::{app, get_from, layer, request, send};
use crate::{builder, engine, support};

#[derive(Debug, Default)]
struct Counting {
    decisions: AtomicUsize,
    rejections: AtomicUsize,
    shadow_rejections: AtomicUsize,
}

impl RateLimitMetricsRecorder for Counting {
    fn record_decision(&self, decision: &Decision) {
        self.decisions.fetch_add(1, Ordering::SeqCst);
        if !decision.allowed() {
            self.rejections.fetch_add(1, Ordering::SeqCst);
        }
        if decision.shadow_rejected_by.is_some() {
            self.shadow_rejections.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[tokio::test]
async fn shadow_mode_never_blocks_but_reports() {
    let rules = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 2, window: 1h }]
"#;
    let counting = Arc::new(Counting::default());
    let handler = builder(rules).recorder(counting.clone()).build().unwrap();
    let app = app(RateLimitLayer::builder(handler).shadow(true).build().unwrap());
    for i in 0..5u64 {
        let r = get_from(&app, "/api/users", "192.0.2.30").await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.num("x-ratelimit-remaining"), 1u64.saturating_sub(i));
        assert!(r.header("retry-after").is_none());
    }
    assert_eq!(counting.decisions.load(Ordering::SeqCst), 5);
    assert_eq!(counting.rejections.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn shadow_rules_report_without_blocking() {
    let rules = r#"
rule_sets:
  - id: default
    rules:
      - id: trial
        mode: shadow
        bands: [{ capacity: 2, window: 1h }]
      - id: real
        bands: [{ capacity: 4, window: 1h }]
"#;
    let counting = Arc::new(Counting::default());
    let handler = builder(rules).recorder(counting.clone()).build().unwrap();
    let app = app(RateLimitLayer::new(handler));
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(get_from(&app, "/api/users", "192.0.2.31").await.status.as_u16());
    }
    // Only the enforced rule (4 per hour) blocks; the shadow rule would have from the 3rd.
    assert_eq!(statuses, [200, 200, 200, 200, 429]);
    assert_eq!(counting.shadow_rejections.load(Ordering::SeqCst), 3);
    assert_eq!(counting.rejections.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn header_switches_and_custom_rejection() {
    let rules = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands:
          - { capacity: 1, window: 1s, label: burst }
          - { capacity: 100, window: 1m, label: sustained }
"#;
    let app = app(layer(engine(rules)).build().unwrap());
    let r = get_from(&app, "/api/users", "192.0.2.60").await;
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"burst\";q=1;w=1, \"sustained\";q=100;w=60")
    );
    assert_eq!(r.header("ratelimit"), Some("\"burst\";r=0;t=1"));
    assert_eq!(r.num("x-ratelimit-limit"), 1);

    let app = support::app::app(
        layer(engine(rules))
            .legacy_headers(false)
            .ietf_headers(false)
            .on_rejection(|d| {
                let mut resp = Response::new(Bytes::from(format!("slow down ({})", d.rule().unwrap())));
                *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                resp
            })
            .build()
            .unwrap(),
    );
    let r = get_from(&app, "/api/users", "192.0.2.61").await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(
        r.headers.keys().all(|k| !k.as_str().contains("ratelimit")),
        "{:?}",
        r.headers
    );
    let r = get_from(&app, "/api/users", "192.0.2.61").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.body, "slow down (per-ip)");
    assert_eq!(r.num("retry-after"), 1);
}

#[tokio::test]
async fn ietf_names_stay_distinct() {
    let rules = r#"
rule_sets:
  - id: default
    rules:
      - id: burst
        priority: 1
        bands: [{ capacity: 5, window: 1s }]
      - id: other
        bands:
          - { capacity: 9, window: 1m, label: burst }
          - { capacity: 99, window: 1h }
"#;
    let app = app(layer(engine(rules)).build().unwrap());
    let r = get_from(&app, "/api/users", "192.0.2.62").await;
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"burst:b0\";q=5;w=1, \"other:burst\";q=9;w=60, \"other:b1\";q=99;w=3600")
    );
    assert_eq!(r.header("ratelimit"), Some("\"burst:b0\";r=4;t=1"));
}

#[tokio::test]
async fn bad_layer_options_are_named() {
    let engine = engine("rule_sets: []");
    let err = RateLimitLayer::builder(engine.clone())
        .trusted_proxies(["10.0.0.0/40"])
        .build()
        .unwrap_err();
    assert!(
        err.to_string().contains("trusted_proxies") && err.to_string().contains("10.0.0.0/40"),
        "{err}"
    );
    let err = RateLimitLayer::builder(engine.clone())
        .exclude(["health"])
        .build()
        .unwrap_err();
    assert!(
        err.to_string().contains("exclude") && err.to_string().contains("`health`"),
        "{err}"
    );
    let err = RateLimitLayer::builder(engine)
        .user_header("bad header")
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("user_header"), "{err}");
}

/// Options that can only turn the limiter off are refused, naming the option and the value:
/// an exclusion of every path (the layer would limit nothing), and a trusted proxy that is
/// every address (every client would name its own address in `X-Forwarded-For`, a fresh
/// per-IP counter with each request).
#[tokio::test]
async fn options_that_turn_the_limiter_off_are_refused() {
    let engine = engine("rule_sets: [{id: default, rules: [{id: per-ip, bands: [{capacity: 1, window: 1h}]}]}]");
    for every in ["/**", "/**/**", "//**/"] {
        let err = RateLimitLayer::builder(engine.clone())
            .exclude(["/health", every])
            .build()
            .unwrap_err();
        assert!(
            matches!(&err, ConfigError::Pattern { option: "exclude", .. })
                && err.to_string().contains(&format!("`{every}` matches every path")),
            "{err}"
        );
    }
    for everything in ["0.0.0.0/0", "::/0", " 0.0.0.0 / 0 "] {
        let err = RateLimitLayer::builder(engine.clone())
            .trusted_proxies(["10.0.0.0/8", everything])
            .build()
            .unwrap_err();
        assert!(
            matches!(&err, ConfigError::TrustedProxy { value, .. } if value == everything)
                && err.to_string().contains("trusts every address"),
            "{err}"
        );
    }
    // What was refused would have let every request through: with `0.0.0.0/0` trusted, a
    // client behind any peer picks its address, and its counter, with each request. A
    // real network of proxies still keeps the client's own address.
    let app = app(layer(engine).trusted_proxies(["10.0.0.0/8"]).build().unwrap());
    let forged = |xff: &'static str| request("GET", "/api/users", "203.0.113.50", &[("x-forwarded-for", xff)]);
    assert_eq!(send(&app, forged("198.51.100.1")).await.status, StatusCode::OK);
    assert_eq!(
        send(&app, forged("198.51.100.2")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Patterns that match much but not everything stay allowed.
    for pattern in ["/*", "/", "/api/**", "/**/*.css"] {
        assert!(
            layer(self::engine("rule_sets: []")).exclude([pattern]).build().is_ok(),
            "{pattern}"
        );
    }
}

const SHARED_LIMIT: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        match: { paths: ["/api/**"] }
        bands: [{ capacity: 100, window: 1h }]
      - id: partner-acme-cap
        match: { paths: ["/api/**"] }
        scope: global
        bands: [{ capacity: 50, window: 1h }]
"#;

/// What one client reads from the headers about the others: every enforced band's rule id
/// and quota (`RateLimit-Policy`), and a shared band's remaining count once it is the
/// least, which falls with every other client's request. One client's 30 requests are read
/// exactly by another from its next response. With the headers off, a refusal by the
/// shared band still says when it ends and names the rule; the `on_rejection` closure
/// decides what the body says.
#[tokio::test]
async fn a_shared_band_reports_the_other_clients_traffic() {
    let shared = app_with(layer(engine(SHARED_LIMIT)));
    let first = get_from(&shared, "/api/users", "198.51.100.2").await;
    assert_eq!(first.num("x-ratelimit-remaining"), 49);
    assert_eq!(
        first.header("ratelimit-policy"),
        Some("\"per-ip\";q=100;w=3600, \"partner-acme-cap\";q=50;w=3600")
    );
    for _ in 0..30 {
        assert_eq!(
            get_from(&shared, "/api/users", "203.0.113.7").await.status,
            StatusCode::OK
        );
    }
    let next = get_from(&shared, "/api/users", "198.51.100.2").await;
    assert_eq!(
        next.num("x-ratelimit-remaining"),
        49 - 30 - 1,
        "the other client's 30 requests"
    );
    // And `t`, the time until the shared band is full again, is the 32 requests' refill
    // (72 s each at 50 per hour).
    assert_eq!(next.header("ratelimit"), Some("\"partner-acme-cap\";r=18;t=2304"));

    // Headers off: an admitted response says nothing; a refusal says when, and the default
    // body names the rule, which `on_rejection` can leave out.
    let quiet = app_with(
        layer(engine(SHARED_LIMIT))
            .legacy_headers(false)
            .ietf_headers(false)
            .on_rejection(|_| {
                let mut response = Response::new(Bytes::from_static(b"{\"error\":\"Rate limit exceeded\"}"));
                *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                response
            }),
    );
    for _ in 0..50 {
        let r = get_from(&quiet, "/api/users", "203.0.113.7").await;
        assert_eq!(r.status, StatusCode::OK);
        assert!(r.header("x-ratelimit-remaining").is_none() && r.header("ratelimit-policy").is_none());
    }
    let refused = get_from(&quiet, "/api/users", "198.51.100.2").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.header("retry-after").is_some());
    assert!(refused.header("x-ratelimit-remaining").is_none() && refused.header("ratelimit").is_none());
    assert!(!refused.body.contains("partner-acme-cap"), "{}", refused.body);
    let named = app_with(layer(engine(SHARED_LIMIT)).legacy_headers(false).ietf_headers(false));
    for _ in 0..50 {
        get_from(&named, "/api/users", "203.0.113.7").await;
    }
    let refused = get_from(&named, "/api/users", "198.51.100.2").await;
    assert!(
        refused.body.contains("\"rule\":\"partner-acme-cap\""),
        "{}",
        refused.body
    );
}

fn app_with(builder: fluxgate::tower::RateLimitLayerBuilder) -> axum::Router {
    app(builder.build().expect("a valid layer"))
}
