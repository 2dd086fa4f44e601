//! The tower layer: context extraction, path handling, headers, shadow mode and the
//! service contract, driven with `oneshot` (no sockets).

/// The shared test support: the modules of `tests/support/` this binary uses. Like the tests,
/// it panics on what it does not expect.
#[path = "../support"]
#[allow(clippy::unwrap_used)]
mod support {
    pub(crate) mod app;
    pub(crate) mod rng;
    pub(crate) mod telemetry;
}

mod by_address;
mod composition;
mod escapes;
mod metrics;
mod param_values;
mod protocol;
mod routes;
mod rule_sets;
mod targets;
mod wildcards;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::response::IntoResponse;
use bytes::Bytes;
use fluxgate::core::{Decision, Engine, EngineBuilder, MemoryLimiter, RateLimitMetricsRecorder, TokioClock};
use fluxgate::tower::{ApiKey, ClientIp, ConfigError, RateLimitLayer, UserId};
use fluxgate::FailurePolicy;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use support::app::*;
use tower::{service_fn, Service, ServiceBuilder, ServiceExt};

/// An engine over the rules of `yaml` and a fresh in-memory limiter on tokio's clock (the
/// engine's own: a layer decides rule sets of one address rule of one band without a
/// context, `Engine::check_address`).
fn builder(yaml: &str) -> EngineBuilder {
    Engine::builder(rules(yaml)).limiter(MemoryLimiter::builder().clock(TokioClock::new()).build())
}

fn engine(yaml: &str) -> Engine {
    builder(yaml).build().expect("the in-memory limiter decides every rule")
}

const API_ONE_PER_HOUR: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: users
        match: { paths: ["/api/users"] }
        bands: [{ capacity: 1, window: 1h }]
      - id: all
        bands: [{ capacity: 1000, window: 1h }]
"#;

#[tokio::test]
async fn dot_segments_and_double_slashes_hit_the_same_rule() {
    let app = app(layer(engine(API_ONE_PER_HOUR)).build().unwrap());
    let r = get_from(&app, "/api/users", "192.0.2.10").await;
    assert_eq!(r.status, StatusCode::OK);
    for path in [
        "/api//users",
        "/api/./users",
        "/api/x/../users",
        "/api/%75sers",
        "/api/users?x=1",
    ] {
        let r = get_from(&app, path, "192.0.2.10").await;
        assert_eq!(
            r.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{path} escaped the /api/users rule"
        );
        assert_eq!(r.header("x-ratelimit-limit"), Some("1"), "{path}");
    }
}

/// An app with a `GET` handler behind a path parameter, counting the handler's runs.
fn login_app(rules: &str, runs: Arc<AtomicUsize>) -> axum::Router {
    axum::Router::new()
        .route(
            "/api/{version}/login",
            axum::routing::get(move |axum::extract::Path(_version): axum::extract::Path<String>| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    "login"
                }
            }),
        )
        .layer(RateLimitLayer::new(engine(rules)))
}

const LOGIN_GET_ONE_PER_HOUR: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: login
        match: { paths: ["/api/*/login"], methods: [GET] }
        bands: [{ capacity: 1, window: 1h }]
"#;

/// axum runs `GET` handlers for `HEAD`: a `GET` rule limits `HEAD` too.
#[tokio::test]
async fn head_requests_are_limited_by_get_rules() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = login_app(LOGIN_GET_ONE_PER_HOUR, runs.clone());
    // GET, then HEAD on the same client: the HEAD is the second request of the rule.
    assert_eq!(
        send(&app, request("GET", "/api/v1/login", "192.0.2.30", &[]))
            .await
            .status,
        StatusCode::OK
    );
    let r = send(&app, request("HEAD", "/api/v1/login", "192.0.2.30", &[])).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "HEAD escaped the GET rule");
    // HEAD alone is limited like GET.
    let r = send(&app, request("HEAD", "/api/v1/login", "192.0.2.31", &[])).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-ratelimit-limit"), Some("1"));
    for _ in 0..5 {
        let r = send(&app, request("HEAD", "/api/v1/login", "192.0.2.31", &[])).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the handler ran for a rejected request");
    // Methods the rule does not name stay outside it (axum answers 405 for them here).
    let r = send(&app, request("POST", "/api/v1/login", "192.0.2.31", &[])).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.header("x-ratelimit-limit"), None);
}

/// A WebSocket route is an `any` route in axum (a handshake over HTTP/2 is a `CONNECT`,
/// RFC 8441): a `GET` rule on it limits the `CONNECT` handshake too.
#[tokio::test]
async fn a_get_rule_on_an_any_route_limits_connect() {
    let rules = "rule_sets: [{id: default, rules: [{id: ws, match: {paths: [\"/ws\"], methods: [GET]}, \
        bands: [{capacity: 1, window: 1h}]}]}]";
    let app = axum::Router::new()
        .route("/ws", axum::routing::any(|| async { "ws" }))
        .layer(layer(engine(rules)).build().unwrap());
    assert_eq!(
        send(&app, request("GET", "/ws", "192.0.2.70", &[])).await.status,
        StatusCode::OK
    );
    let r = send(&app, request("CONNECT", "/ws", "192.0.2.70", &[])).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "CONNECT escaped the GET rule");
}

/// axum routes the raw path: `/api/../login` and its kin reach `/api/{version}/login`
/// with `version` set to `..`, `.` or the empty string. The rule `/api/*/login` applies
/// to each of them, though their normalized paths (`/login`, `/api/login`) do not match it.
#[tokio::test]
async fn dot_segments_cannot_walk_around_a_rule_on_a_parameter_route() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = login_app(LOGIN_GET_ONE_PER_HOUR, runs.clone());
    let variants = [
        "/api/../login",
        "/api/./login",
        "/api/%2e%2e/login",
        "/api/%2E/login",
        "/api/%2e/login",
        "/api//login",
        "/api/../login?x=1",
    ];
    for (i, path) in variants.iter().enumerate() {
        let peer = format!("192.0.2.{}", 40 + i);
        let r = send(&app, request("GET", path, &peer, &[])).await;
        assert_eq!(r.status, StatusCode::OK, "{path}: the handler is reached");
        assert_eq!(r.header("x-ratelimit-limit"), Some("1"), "{path}: no rule applied");
        for _ in 0..3 {
            let r = send(&app, request("GET", path, &peer, &[])).await;
            assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{path} got around the rule");
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), variants.len());
    // One client mixing the forms shares one bucket.
    assert_eq!(
        send(&app, request("GET", "/api/v2/login", "192.0.2.60", &[]))
            .await
            .status,
        StatusCode::OK
    );
    for path in variants {
        let r = send(&app, request("GET", path, "192.0.2.60", &[])).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{path}");
    }
}

/// A route that ends in `/` after a parameter (`/items/{id}/`) runs for `/items//`,
/// `/items/./` and `/items/../` (`id` empty, `.` and `..`), whose normalized paths (`/items`,
/// `/`) its rule does not match. Found by the differential test (`routes.rs`): the routed view
/// counts them, the request's trailing `/` ignored as the pattern's own is (`/items/*/` and
/// `/items/*` are one pattern).
#[tokio::test]
async fn a_parameter_before_a_trailing_slash_cannot_walk_around_its_rule() {
    for pattern in ["/items/*/", "/items/*"] {
        let rules = format!(
            "rule_sets: [{{id: default, rules: [{{id: item, match: {{paths: [\"{pattern}\"], methods: [GET]}}, \
             bands: [{{capacity: 1, window: 1h}}]}}]}}]"
        );
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = runs.clone();
        let app = axum::Router::new()
            .route(
                "/items/{id}/",
                axum::routing::get(move || {
                    counted.fetch_add(1, Ordering::SeqCst);
                    async { "item" }
                }),
            )
            .layer(RateLimitLayer::new(engine(&rules)));
        assert_eq!(get_from(&app, "/items/5/", "192.0.2.80").await.status, StatusCode::OK);
        let variants = [
            "/items//",
            "/items/./",
            "/items/../",
            "/items/%2e%2e/",
            "/items/.%2E/?x=1",
        ];
        for (i, path) in variants.iter().enumerate() {
            let r = get_from(&app, path, "192.0.2.80").await;
            assert_eq!(
                r.status,
                StatusCode::TOO_MANY_REQUESTS,
                "{path} reached /items/{{id}}/ past the rule `{pattern}`"
            );
            // A client that starts with it is counted by the rule from its first request.
            let peer = format!("192.0.2.{}", 90 + i);
            let r = get_from(&app, path, &peer).await;
            assert_eq!(r.status, StatusCode::OK, "{path}: the handler is reached");
            assert_eq!(r.header("x-ratelimit-limit"), Some("1"), "{path}: no rule applied");
            let r = get_from(&app, "/items/5/", &peer).await;
            assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{path}");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 6, "{pattern}");
    }
}

/// IPv6 clients that share a /64 without being one client are counted apart: the clients
/// of one Teredo relay server (its address fills their first 64 bits) are their public
/// IPv4 addresses, and the IPv4 clients of a NAT64 prefix of the network's own, once the
/// engine is told it, their IPv4 addresses. Before, each group shared one counter, so one
/// client spent the others' limit. Link-local clients stay cut to their /64, whatever
/// their link: a client on the server's link that takes a new address for each request
/// gets no new counter.
#[tokio::test]
async fn ipv6_clients_that_share_a_64_are_counted_apart() {
    use std::net::{Ipv6Addr, SocketAddrV6};
    const PER_IP: &str = "rule_sets: [{id: default, rules: [{id: per-ip, bands: [{capacity: 2, window: 1h}]}]}]";
    let nat64: Ipv6Addr = "2001:db8:64::".parse().expect("a prefix");
    let app = app(layer(builder(PER_IP).nat64_prefix(nat64).build().unwrap())
        .build()
        .unwrap());
    let from = |ip: &str, zone: u32| {
        let mut req = request("GET", "/health", "192.0.2.1", &[]);
        let ip: Ipv6Addr = ip.parse().expect("an address");
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo(SocketAddr::V6(SocketAddrV6::new(
                ip, 40_000, 0, zone,
            ))));
        req
    };
    for (a, b) in [
        // Two clients of the Teredo server 65.54.227.120.
        (
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
            "2001:0:4136:e378:8000:ec77:cecc:9bf8",
        ),
        // Two IPv4 clients of the network's NAT64 prefix.
        ("2001:db8:64::192.0.2.1", "2001:db8:64::198.51.100.7"),
    ] {
        for _ in 0..2 {
            assert_eq!(send(&app, from(a, 2)).await.status, StatusCode::OK, "{a}");
        }
        assert_eq!(
            send(&app, from(a, 2)).await.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{a}"
        );
        let other = send(&app, from(b, 3)).await;
        assert_eq!(other.status, StatusCode::OK, "{b} after {a} spent its limit");
        assert_eq!(other.num("x-ratelimit-remaining"), 1, "{b}");
    }
    // A link-local client rotating its address, one a request: one counter.
    let statuses: Vec<StatusCode> = {
        let mut out = Vec::new();
        for i in 1..=5 {
            out.push(send(&app, from(&format!("fe80::{i:x}"), 2)).await.status);
        }
        out
    };
    use StatusCode as S;
    assert_eq!(
        statuses,
        [
            S::OK,
            S::OK,
            S::TOO_MANY_REQUESTS,
            S::TOO_MANY_REQUESTS,
            S::TOO_MANY_REQUESTS
        ]
    );
}

#[tokio::test]
async fn forwarded_for_is_only_believed_from_trusted_proxies() {
    let rules = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 1, window: 1h }]
"#;
    let app = app(layer(engine(rules)).trusted_proxies(["10.0.0.0/8"]).build().unwrap());
    // From an untrusted peer, X-Forwarded-For is ignored: the two requests share the peer's bucket.
    let from_untrusted = |xff: &'static str| request("GET", "/api/users", "203.0.113.50", &[("x-forwarded-for", xff)]);
    assert_eq!(send(&app, from_untrusted("198.51.100.1")).await.status, StatusCode::OK);
    assert_eq!(
        send(&app, from_untrusted("198.51.100.2")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // From the trusted proxy, each forwarded client has its own bucket.
    let via_proxy = |xff: &'static str| request("GET", "/api/users", "10.0.0.1", &[("x-forwarded-for", xff)]);
    assert_eq!(
        send(&app, via_proxy("198.51.100.1, 10.0.0.7")).await.status,
        StatusCode::OK
    );
    assert_eq!(send(&app, via_proxy("198.51.100.2")).await.status, StatusCode::OK);
    assert_eq!(
        send(&app, via_proxy("198.51.100.1")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Only X-Forwarded-For, the header the proxy maintains, is read: a `Forwarded` header
    // is the client's own, passed through untouched, and cannot pick a bucket.
    for (i, client) in ["198.51.100.3", "198.51.100.4", "198.51.100.5"].into_iter().enumerate() {
        let forwarded = format!("for={client};proto=https");
        let req = request(
            "GET",
            "/api/users",
            "10.0.0.1",
            &[("forwarded", &forwarded), ("x-forwarded-for", "198.51.100.9")],
        );
        let expected = if i == 0 {
            StatusCode::OK
        } else {
            StatusCode::TOO_MANY_REQUESTS
        };
        assert_eq!(send(&app, req).await.status, expected, "Forwarded: {forwarded}");
    }
    // With `Forwarded` configured instead, it is read, and X-Forwarded-For ignored.
    let app_rfc = support::app::app(
        layer(engine(rules))
            .trusted_proxies(["10.0.0.0/8"])
            .forwarded_for_header("forwarded")
            .build()
            .unwrap(),
    );
    let fwd = |client: &str, xff: &str| {
        let forwarded = format!("for={client};proto=https");
        request(
            "GET",
            "/api/users",
            "10.0.0.1",
            &[("forwarded", &forwarded), ("x-forwarded-for", xff)],
        )
    };
    assert_eq!(
        send(&app_rfc, fwd("198.51.100.3", "1.1.1.1")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(&app_rfc, fwd("198.51.100.4", "1.1.1.1")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(&app_rfc, fwd("198.51.100.3", "2.2.2.2")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // No trusted proxies configured: never believed.
    let app = app_default(rules);
    assert_eq!(send(&app, via_proxy("198.51.100.4")).await.status, StatusCode::OK);
    assert_eq!(
        send(&app, via_proxy("198.51.100.5")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

fn app_default(rules: &str) -> axum::Router {
    app(RateLimitLayer::new(engine(rules)))
}

#[tokio::test]
async fn excluded_paths_bypass_the_limiter_and_include_narrows_it() {
    let rules = r#"
rule_sets:
  - id: default
    rules:
      - id: everything
        bands: [{ capacity: 1, window: 1h }]
"#;
    let app = app(layer(engine(rules))
        .exclude(["/health", "/metrics/**"])
        .build()
        .unwrap());
    for _ in 0..5 {
        let r = get_from(&app, "/health", "192.0.2.20").await;
        assert_eq!(r.status, StatusCode::OK);
        assert!(r.header("x-ratelimit-limit").is_none());
        assert_eq!(
            get_from(&app, "/metrics/a/b", "192.0.2.20").await.status,
            StatusCode::OK
        );
    }
    // An exclusion holds only when the path as routed is excluded too: normalization never
    // takes a request out of the limiter. `/api/x/../../health` normalizes to `/health`
    // but axum routes it to `/api/{*rest}`.
    for (path, status) in [
        ("/api/x/../../health", StatusCode::OK),
        ("//health/", StatusCode::NOT_FOUND),
    ] {
        let peer = if status == StatusCode::OK {
            "192.0.2.22"
        } else {
            "192.0.2.23"
        };
        let r = get_from(&app, path, peer).await;
        assert_eq!(r.status, status, "{path}");
        assert_eq!(r.header("x-ratelimit-limit"), Some("1"), "{path} bypassed the limiter");
        let r = get_from(&app, path, peer).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{path}");
    }
    assert_eq!(get_from(&app, "/api/users", "192.0.2.20").await.status, StatusCode::OK);
    assert_eq!(
        get_from(&app, "/api/users", "192.0.2.20").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );

    let app = support::app::app(layer(engine(rules)).include(["/api/orders"]).build().unwrap());
    for _ in 0..3 {
        assert_eq!(get_from(&app, "/api/users", "192.0.2.21").await.status, StatusCode::OK);
    }
    assert_eq!(get_from(&app, "/api/orders", "192.0.2.21").await.status, StatusCode::OK);
    assert_eq!(
        get_from(&app, "/api/orders", "192.0.2.21").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// `include` matches the routed path without its trailing `/`, as rules do: an
/// `/items/{id}/` route runs for `/items//` and `/items/../` (normalized to `/items` and `/`),
/// which an inclusion of `/items/*/` must not leave alone. Found by the differential test
/// (`routes.rs`). An exclusion does not widen so: `/items/x/` stays limited under an
/// exclusion of `/items/*`, by its routed path.
#[tokio::test]
async fn an_included_route_ending_in_a_slash_is_limited_for_every_parameter() {
    let rules = "rule_sets: [{id: default, rules: [{id: everything, bands: [{capacity: 1, window: 1h}]}]}]";
    let items = || {
        axum::Router::new()
            .route("/items/{id}/", axum::routing::get(|| async { "item" }))
            .route("/other", axum::routing::get(|| async { "other" }))
    };
    let app = items().layer(layer(engine(rules)).include(["/items/*/"]).build().unwrap());
    for _ in 0..3 {
        assert_eq!(get_from(&app, "/other", "192.0.2.100").await.status, StatusCode::OK);
    }
    let variants = ["/items/5/", "/items//", "/items/./", "/items/../", "/items/%2e%2e/"];
    for (i, path) in variants.iter().enumerate() {
        let peer = format!("192.0.2.{}", 101 + i);
        let r = get_from(&app, path, &peer).await;
        assert_eq!(r.status, StatusCode::OK, "{path}: the handler is reached");
        assert_eq!(r.header("x-ratelimit-limit"), Some("1"), "{path} was not included");
        let r = get_from(&app, path, &peer).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{path}");
    }

    let app = items().layer(layer(engine(rules)).exclude(["/items/*"]).build().unwrap());
    for _ in 0..3 {
        let r = get_from(&app, "/items/5", "192.0.2.110").await;
        assert!(r.header("x-ratelimit-limit").is_none(), "excluded");
    }
    assert_eq!(get_from(&app, "/items/5/", "192.0.2.111").await.status, StatusCode::OK);
    assert_eq!(
        get_from(&app, "/items/5/", "192.0.2.111").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

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
async fn customizer_user_and_api_key_sources() {
    let rules = r#"
rule_sets:
  - id: default
    rules:
      - id: per-tenant
        scope: attribute
        attribute: tenant
        on_missing_key: skip
        bands: [{ capacity: 1, window: 1h }]
      - id: per-key
        scope: api_key
        on_missing_key: skip
        bands: [{ capacity: 1, window: 1h }]
  - id: partners
    rules:
      - id: per-user
        scope: user
        on_missing_key: skip
        bands: [{ capacity: 1, window: 1h }]
"#;
    let app = app(layer(engine(rules))
        .customizer(|ctx, parts| {
            if let Some(t) = parts.headers.get("x-tenant-id").and_then(|v| v.to_str().ok()) {
                ctx.set_attribute("tenant", t);
            }
            if parts.headers.contains_key("x-partner") {
                ctx.set_rule_set_id("partners");
            }
        })
        .build()
        .unwrap());
    let tenant = |t: &'static str| request("GET", "/api/users", "192.0.2.40", &[("x-tenant-id", t)]);
    assert_eq!(send(&app, tenant("acme")).await.status, StatusCode::OK);
    assert_eq!(send(&app, tenant("acme")).await.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(send(&app, tenant("globex")).await.status, StatusCode::OK);

    // API key from the header, then from an extension, which wins.
    let keyed = request("GET", "/api/users", "192.0.2.41", &[("x-api-key", "k1")]);
    assert_eq!(send(&app, keyed).await.status, StatusCode::OK);
    let mut ext = request("GET", "/api/users", "192.0.2.41", &[("x-api-key", "k2")]);
    ext.extensions_mut().insert(ApiKey("k1".into()));
    assert_eq!(send(&app, ext).await.status, StatusCode::TOO_MANY_REQUESTS);

    // The customizer picks the partners rule set; the user comes from an extension.
    let partner = |user: &str| {
        let mut r = request(
            "GET",
            "/api/users",
            "192.0.2.42",
            &[("x-partner", "1"), ("x-user-id", "ignored")],
        );
        r.extensions_mut().insert(UserId(user.into()));
        r
    };
    assert_eq!(send(&app, partner("p1")).await.status, StatusCode::OK);
    assert_eq!(send(&app, partner("p1")).await.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(send(&app, partner("p2")).await.status, StatusCode::OK);
}

#[tokio::test]
async fn client_ip_extension_and_cf_connecting_ip() {
    let rules = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 1, window: 1h }]
"#;
    let app = app(layer(engine(rules))
        .customizer(|ctx, parts| {
            if let Some(ip) = parts
                .headers
                .get("cf-connecting-ip")
                .and_then(|v| v.to_str().ok()?.parse().ok())
            {
                ctx.set_client_ip(Some(ip));
            }
        })
        .build()
        .unwrap());
    let cf = |ip: &'static str| request("GET", "/api/users", "192.0.2.50", &[("cf-connecting-ip", ip)]);
    assert_eq!(send(&app, cf("198.51.100.60")).await.status, StatusCode::OK);
    assert_eq!(send(&app, cf("198.51.100.61")).await.status, StatusCode::OK);
    assert_eq!(
        send(&app, cf("198.51.100.60")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    let mut req = request("GET", "/api/users", "192.0.2.50", &[]);
    req.extensions_mut().insert(ClientIp("198.51.100.62".parse().unwrap()));
    assert_eq!(send(&app, req).await.status, StatusCode::OK);
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

/// Exclude patterns that between them match every path leave the layer limiting nothing,
/// as `/**` alone does: refused, naming them. Patterns that leave paths out stay allowed.
#[tokio::test]
async fn exclude_patterns_that_together_match_every_path_are_refused() {
    let engine = engine("rule_sets: [{id: default, rules: [{id: per-ip, bands: [{capacity: 1, window: 1h}]}]}]");
    for every in [
        &["/", "/*/**"][..],
        &["/health", "/", "/**/*"][..],
        &["/", "/*", "/?*/*/**"][..],
    ] {
        let err = RateLimitLayer::builder(engine.clone())
            .exclude(every.iter().copied())
            .build()
            .unwrap_err();
        assert!(
            matches!(&err, ConfigError::Pattern { option: "exclude", .. })
                && err.to_string().contains("together match every path"),
            "{every:?}: {err}"
        );
    }
    // What was refused lets every request through: `/` and `/*/**` leave no path limited.
    for partial in [
        &["/*/**"][..],
        &["/", "/*"][..],
        &["/", "/?/**"][..],
        &["/", "/api/**", "/*/*/**"][..],
    ] {
        assert!(
            layer(engine.clone()).exclude(partial.iter().copied()).build().is_ok(),
            "{partial:?}"
        );
    }
}

/// Trusted networks that together hold every address of a family trust every peer of
/// it, as `0.0.0.0/0` alone does: refused, naming them. Networks that leave an address of
/// each family out stay allowed.
#[tokio::test]
async fn trusted_networks_that_together_hold_every_address_are_refused() {
    let engine = engine("rule_sets: [{id: default, rules: [{id: per-ip, bands: [{capacity: 1, window: 1h}]}]}]");
    for (covering, named) in [
        (
            &["0.0.0.0/1", "10.0.0.0/8", "128.0.0.0/1"][..],
            "0.0.0.0/1, 128.0.0.0/1",
        ),
        (
            &["128.0.0.0/2", "0.0.0.0/1", "192.0.0.0/2"][..],
            "128.0.0.0/2, 0.0.0.0/1, 192.0.0.0/2",
        ),
        // An address with host bits names its whole network.
        (&["0.0.0.0/1", "128.0.0.1/1"][..], "0.0.0.0/1, 128.0.0.1/1"),
        (&["::/1", "8000::/1"][..], "::/1, 8000::/1"),
        (
            &["::ffff:0.0.0.0/1", "128.0.0.0/1"][..],
            "::ffff:0.0.0.0/1, 128.0.0.0/1",
        ),
    ] {
        let err = RateLimitLayer::builder(engine.clone())
            .trusted_proxies(covering.iter().copied())
            .build()
            .unwrap_err();
        assert!(
            matches!(&err, ConfigError::TrustedProxy { value, .. } if value == named)
                && err.to_string().contains("trust every address"),
            "{covering:?}: {err}"
        );
    }
    for partial in [
        &["0.0.0.0/1", "128.0.0.0/2"][..],
        &["0.0.0.0/1", "8000::/1"][..],
        &["10.0.0.0/8", "192.168.0.0/16", "fd00::/8"][..],
    ] {
        assert!(
            layer(engine.clone())
                .trusted_proxies(partial.iter().copied())
                .build()
                .is_ok(),
            "{partial:?}"
        );
    }
}

/// A plain tower service (no axum): counts its calls and fails on `/boom`.
#[derive(Clone)]
struct Plain {
    calls: Arc<AtomicUsize>,
}

impl Service<Request<Full<Bytes>>> for Plain {
    type Response = Response<Full<Bytes>>;
    type Error = &'static str;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Full<Bytes>>) -> Self::Future {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if req.uri().path() == "/boom" {
            return std::future::ready(Err("inner failure"));
        }
        std::future::ready(Ok(Response::new(Full::new(Bytes::from_static(b"plain")))))
    }
}

fn plain_request(path: &str) -> Request<Full<Bytes>> {
    let mut req = Request::builder()
        .uri(path)
        .body(Full::new(Bytes::new()))
        .expect("request");
    req.extensions_mut()
        .insert(std::net::SocketAddr::from(([192, 0, 2, 70], 1234)));
    req
}

#[tokio::test]
async fn plain_tower_service_inner_called_once_and_errors_pass_through() {
    let rules = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 3, window: 1h }]
"#;
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = ServiceBuilder::new()
        .layer(RateLimitLayer::new(engine(rules)))
        .service(Plain { calls: calls.clone() });
    // The service is Clone; clones share the limiter.
    let resp = svc.clone().oneshot(plain_request("/a")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["x-ratelimit-remaining"], "2");
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "plain");
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    let err = svc.clone().oneshot(plain_request("/boom")).await.unwrap_err();
    assert_eq!(err, "inner failure");
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    assert_eq!(
        svc.clone().oneshot(plain_request("/b")).await.unwrap().status(),
        StatusCode::OK
    );
    let resp = svc.clone().oneshot(plain_request("/c")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "a rejected request must not reach the inner service"
    );
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(std::str::from_utf8(&body).unwrap().contains("\"rule\":\"per-ip\""));
}

#[tokio::test]
async fn service_fn_and_async_handler() {
    // An async handler: the decision is not ready at once, so the layer takes the
    // checking path with the inner service it polled ready.
    #[derive(Debug)]
    struct Slow(Engine);
    impl fluxgate::core::RateLimitHandler for Slow {
        fn check(
            &self,
            ctx: &fluxgate::core::RequestContext,
        ) -> fluxgate::core::MaybeReady<Result<Decision, fluxgate::core::Error>> {
            let engine = self.0.clone();
            let ctx = ctx.clone();
            fluxgate::core::MaybeReady::boxed(async move {
                tokio::task::yield_now().await;
                engine.check(&ctx).await
            })
        }
    }
    let rules = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 2, window: 1h }]
"#;
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let inner = service_fn(move |_req: Request<Body>| {
        counter.fetch_add(1, Ordering::SeqCst);
        async move { Ok::<_, Infallible>(Response::new(Body::from("fn"))) }
    });
    let mut svc = RateLimitLayer::new(Slow(engine(rules))).layer_service(inner);
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let resp = svc
            .ready()
            .await
            .unwrap()
            .call(request("GET", "/x", "192.0.2.80", &[]))
            .await
            .unwrap();
        statuses.push(resp.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 429, 429]);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[derive(Debug)]
struct Broken;

impl fluxgate::core::RateLimitHandler for Broken {
    fn check(
        &self,
        _: &fluxgate::core::RequestContext,
    ) -> fluxgate::core::MaybeReady<Result<Decision, fluxgate::core::Error>> {
        fluxgate::core::MaybeReady::ready(Err(fluxgate::core::Error::Backend("backend down".into())))
    }
}

#[tokio::test]
async fn failure_policy_open_or_closed() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let inner = service_fn(move |_req: Request<Body>| {
        counter.fetch_add(1, Ordering::SeqCst);
        async move { Ok::<_, Infallible>(Response::new(Body::from("fn"))) }
    });
    let open = RateLimitLayer::new(Broken).layer_service(inner.clone());
    let resp = open.oneshot(request("GET", "/x", "192.0.2.90", &[])).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp.headers().get("x-ratelimit-limit").is_none());
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    let closed = RateLimitLayer::builder(Broken)
        .on_error(FailurePolicy::FailClosed)
        .build()
        .unwrap()
        .layer_service(inner.clone());
    let resp = closed.oneshot(request("GET", "/x", "192.0.2.90", &[])).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], br#"{"error":"Rate limiter unavailable"}"#);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "a refused request does not reach the inner service"
    );

    let other_status = RateLimitLayer::builder(Broken)
        .on_error(FailurePolicy::FailClosed)
        .unavailable_status(StatusCode::BAD_GATEWAY)
        .build()
        .unwrap()
        .layer_service(inner);
    let resp = other_status
        .oneshot(request("GET", "/x", "192.0.2.90", &[]))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[test]
fn failure_options_the_layer_cannot_apply_are_refused() {
    let local = RateLimitLayer::builder(Broken)
        .on_error(FailurePolicy::FallbackLocal)
        .build()
        .unwrap_err();
    assert!(matches!(local, ConfigError::FailurePolicy { .. }), "{local:?}");
    assert!(local.to_string().contains("EngineBuilder::fallback"), "{local}");
    let ok = RateLimitLayer::builder(Broken)
        .unavailable_status(StatusCode::OK)
        .build()
        .unwrap_err();
    assert!(matches!(ok, ConfigError::UnavailableStatus { .. }), "{ok:?}");
    assert!(ok.to_string().contains("200"), "{ok}");
}

/// A backend that always fails.
#[derive(Debug)]
struct Down;

impl fluxgate::core::RateLimiter for Down {
    fn acquire(
        &self,
        _: &fluxgate::core::limiter::AcquireRequest,
    ) -> fluxgate::core::MaybeReady<Result<fluxgate::core::limiter::AcquireOutcome, fluxgate::core::BoxError>> {
        fluxgate::core::MaybeReady::ready(Err("backend down".into()))
    }
}

#[tokio::test]
async fn failure_policies_per_rule() {
    let with_rules = |yaml: &str| {
        let engine = fluxgate::core::Engine::builder(rules(yaml))
            .limiter(Down)
            .build()
            .expect("the backend decides every rule");
        app(RateLimitLayer::new(engine))
    };
    // fallback_local decides in memory; fail_open skips its rule.
    let app = with_rules(
        r#"
rule_sets:
  - id: default
    rules:
      - id: local
        on_backend_failure: fallback_local
        bands: [{ capacity: 2, window: 1h }]
      - id: open
        on_backend_failure: fail_open
        bands: [{ capacity: 1, window: 1h }]
"#,
    );
    let statuses: Vec<u16> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(get_from(&app, "/api/users", "192.0.2.91").await.status.as_u16());
        }
        v
    };
    assert_eq!(
        statuses,
        [200, 200, 429],
        "decided in memory by the fallback_local rule alone"
    );
    let r = get_from(&app, "/api/users", "192.0.2.92").await;
    assert_eq!(r.header("x-ratelimit-limit"), Some("2"));

    // fail_closed wins over the others: 503.
    let app = with_rules(
        r#"
rule_sets:
  - id: default
    rules:
      - id: local
        on_backend_failure: fallback_local
        bands: [{ capacity: 2, window: 1h }]
      - id: strict
        on_backend_failure: fail_closed
        bands: [{ capacity: 100, window: 1h }]
"#,
    );
    assert_eq!(
        get_from(&app, "/api/users", "192.0.2.93").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );

    // A rule without a policy, and an engine without one: the layer's (fail open).
    let app = with_rules(
        r#"
rule_sets:
  - id: default
    rules:
      - id: plain
        bands: [{ capacity: 1, window: 1h }]
"#,
    );
    for _ in 0..3 {
        let r = get_from(&app, "/api/users", "192.0.2.94").await;
        assert_eq!(r.status, StatusCode::OK);
        assert!(r.header("x-ratelimit-limit").is_none());
    }
}

#[test]
fn unknown_failure_policy_is_named() {
    let err = fluxgate::core::RuleSets::from_yaml_str(
        "rule_sets:\n  - id: s\n    rules:\n      - {id: r, on_backend_failure: maybe, bands: [{capacity: 1, window: 1s}]}\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("rule `r`, field `on_backend_failure`") && err.contains("unknown variant `maybe`"),
        "{err}"
    );
}

trait LayerService {
    fn layer_service<S>(&self, inner: S) -> fluxgate::tower::RateLimit<S>;
}

impl LayerService for RateLimitLayer {
    fn layer_service<S>(&self, inner: S) -> fluxgate::tower::RateLimit<S> {
        tower::Layer::layer(self, inner)
    }
}

/// The user header is the client's to write: with the header turned off, as when an
/// authentication layer provides the user, a client's own `X-User-Id` chooses no counter
/// and the rule falls back to the address.
#[tokio::test]
async fn a_forged_user_header_chooses_no_counter_when_the_header_is_off() {
    const PER_USER: &str = "rule_sets: [{id: default, rules: [{id: per-user, scope: user, \
        on_missing_key: fallback_ip, bands: [{capacity: 2, window: 1h}]}]}]";
    let app_with = |on: bool| {
        let builder = layer(engine(PER_USER));
        app((if on { builder } else { builder.no_user_header() }).build().unwrap())
    };
    let open = app_with(true);
    let req = request("GET", "/api/users", "192.0.2.92", &[("x-user-id", "alice")]);
    assert_eq!(
        send(&open, req).await.num("x-ratelimit-remaining"),
        1,
        "alice's counter"
    );
    // Turned off: ten forged ids are one client, its address.
    let closed = app_with(false);
    let mut admitted = 0;
    for i in 0..10 {
        let user = format!("forged-{i}");
        let r = send(
            &closed,
            request("GET", "/api/users", "192.0.2.90", &[("x-user-id", &user)]),
        )
        .await;
        admitted += usize::from(r.status == StatusCode::OK);
    }
    assert_eq!(admitted, 2, "ten forged X-User-Id values counted as one address");
}

/// An identity header sent several times with different values names no counter: an
/// application reads the first instance (`HeaderMap::get`, as the API-key check below does)
/// and a proxy that appends writes the last, so whichever the layer read, the client would
/// choose its counter with the other; and a counter all such requests shared would be a
/// second quota for every client. An enforced rule keyed by the header refuses such a
/// request (`400`), and the handler never runs for it.
#[tokio::test]
async fn a_repeated_identity_header_is_refused_by_the_rules_that_count_by_it() {
    const RULES: &str = "rule_sets: [{id: default, rules: [\
        {id: per-key, match: {paths: [\"/api/**\"]}, scope: api_key, bands: [{capacity: 2, window: 1h}]}, \
        {id: per-user, match: {paths: [\"/user\"]}, scope: user, bands: [{capacity: 2, window: 1h}]}, \
        {id: per-ip-user, match: {paths: [\"/both\"]}, scope: composite, fields: [ip, user], bands: [{capacity: 2, window: 1h}]}, \
        {id: watched, mode: shadow, match: {paths: [\"/watched\"]}, scope: api_key, bands: [{capacity: 1, window: 1h}]}, \
        {id: per-ip, match: {paths: [\"/open\", \"/watched\"]}, bands: [{capacity: 100, window: 1h}]}]}]";
    // One rule alone: the engine's path for a rule set of one rule of one band.
    const ONE_RULE: &str =
        "rule_sets: [{id: default, rules: [{id: per-key, scope: api_key, bands: [{capacity: 2, window: 1h}]}]}]";
    let runs = Arc::new(AtomicUsize::new(0));
    let app_of = |rules: &str| {
        let counted = runs.clone();
        axum::Router::new()
            .route(
                "/api/data",
                axum::routing::get(move || {
                    counted.fetch_add(1, Ordering::SeqCst);
                    async { "data" }
                }),
            )
            .route("/user", axum::routing::get(|| async { "user" }))
            .route("/both", axum::routing::get(|| async { "both" }))
            .route("/open", axum::routing::get(|| async { "open" }))
            .route("/watched", axum::routing::get(|| async { "watched" }))
            // The application's own API-key check: the first instance, as `HeaderMap::get`
            // reads.
            .layer(axum::middleware::from_fn(
                |req: axum::extract::Request, next: axum::middleware::Next| async move {
                    match req.headers().get("x-api-key").map(|v| v.as_bytes()) {
                        Some(b"valid-key") | None => next.run(req).await,
                        Some(_) => StatusCode::UNAUTHORIZED.into_response(),
                    }
                },
            ))
            .layer(layer(engine(rules)).build().unwrap())
    };
    let with = |path: &str, peer: &str, name: &'static str, values: &[&str]| {
        let mut req = request("GET", path, peer, &[]);
        for v in values {
            req.headers_mut().append(name, v.parse().expect("a header value"));
        }
        req
    };
    for (rules, peer) in [(RULES, "192.0.2.95"), (ONE_RULE, "192.0.2.105")] {
        runs.store(0, Ordering::SeqCst);
        let app = app_of(rules);
        // The key's own quota: two, then refused.
        let mut statuses = Vec::new();
        for _ in 0..3 {
            statuses.push(
                send(&app, with("/api/data", peer, "x-api-key", &["valid-key"]))
                    .await
                    .status,
            );
        }
        // A fresh second `X-API-Key` with each request: refused, not a second quota.
        for i in 0..3 {
            let fresh = format!("fresh-{i}");
            let r = send(&app, with("/api/data", peer, "x-api-key", &["valid-key", &fresh])).await;
            statuses.push(r.status);
        }
        use StatusCode as S;
        assert_eq!(
            statuses,
            [
                S::OK,
                S::OK,
                S::TOO_MANY_REQUESTS,
                S::BAD_REQUEST,
                S::BAD_REQUEST,
                S::BAD_REQUEST
            ],
            "{rules}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{rules}");
        // The same value repeated is that value: another key's counter, spent by one.
        let other = "192.0.2.200";
        let once = send(&app, with("/api/data", other, "x-api-key", &["valid-key"])).await;
        assert_eq!(
            once.status,
            S::TOO_MANY_REQUESTS,
            "the key's counter is spent, whatever the address"
        );
        let twice = send(&app, with("/api/data", other, "x-api-key", &["valid-key", "valid-key"])).await;
        assert_eq!(twice.status, S::TOO_MANY_REQUESTS, "a repeated value is that value");
    }
    let app = app_of(RULES);
    // The user header likewise, alone and in a composite key: a forged first `X-User-Id`
    // before alice's (a proxy that appends) neither spends alice's counter nor opens a new
    // one.
    for path in ["/user", "/both"] {
        for i in 0..3 {
            let forged = format!("forged-{i}");
            let r = send(&app, with(path, "192.0.2.98", "x-user-id", &[&forged, "alice"])).await;
            assert_eq!(
                r.status,
                StatusCode::BAD_REQUEST,
                "{path}: request {i} with a forged X-User-Id"
            );
        }
        let alice = send(&app, with(path, "192.0.2.98", "x-user-id", &["alice"])).await;
        assert_eq!(alice.num("x-ratelimit-remaining"), 1, "{path}: alice's counter");
    }
    // A rule that does not count by the header, and a shadow rule that does, leave such a
    // request alone.
    for path in ["/open", "/watched"] {
        for _ in 0..3 {
            let r = send(&app, with(path, "192.0.2.99", "x-api-key", &["valid-key", "other"])).await;
            assert_eq!(r.status, StatusCode::OK, "{path}");
        }
    }
}

/// A customizer that picks the rule set from the request lets the client name one that
/// does not exist: with the engine's default (`UnknownRuleSet::Allow`) such a request is
/// admitted by no rule at all, so a client escapes every limit by sending a new tenant id;
/// `UnknownRuleSet::Deny` refuses it.
#[tokio::test]
async fn a_rule_set_chosen_from_the_request_must_exist() {
    const TENANTS: &str = "rule_sets: [{id: acme, rules: [{id: per-ip, bands: [{capacity: 1, window: 1h}]}]}]";
    let app_with = |unknown: fluxgate::UnknownRuleSet| {
        let engine = builder(TENANTS).unknown_rule_set(unknown).build().unwrap();
        app(layer(engine)
            .customizer(|ctx, parts| {
                if let Some(tenant) = parts.headers.get("x-tenant").and_then(|v| v.to_str().ok()) {
                    ctx.set_rule_set_id(tenant);
                }
            })
            .build()
            .unwrap())
    };
    let tenant = |app: &axum::Router, name: &'static str| {
        send_owned(
            app.clone(),
            request("GET", "/api/users", "192.0.2.99", &[("x-tenant", name)]),
        )
    };
    let allow = app_with(fluxgate::UnknownRuleSet::Allow);
    assert_eq!(tenant(&allow, "acme").await.status, StatusCode::OK);
    assert_eq!(tenant(&allow, "acme").await.status, StatusCode::TOO_MANY_REQUESTS);
    for _ in 0..5 {
        let r = tenant(&allow, "no-such-tenant").await;
        assert_eq!(r.status, StatusCode::OK, "admitted: no rule set, no rule");
        assert_eq!(r.header("x-ratelimit-limit"), None);
    }
    let deny = app_with(fluxgate::UnknownRuleSet::Deny);
    assert_eq!(tenant(&deny, "acme").await.status, StatusCode::OK);
    assert_eq!(
        tenant(&deny, "no-such-tenant").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// `UnknownRuleSet::Deny` needs the rule source to answer. With a provider that looks rule
/// sets up when asked (a store, here behind `CachingRuleSetProvider`, which serves the rule
/// sets it found while the store fails), a rule set id chosen from the request that was not
/// found before fails while the store is unreachable, and the failure follows the layer's
/// `on_error`: `fail_open` (the default) admits each request naming a new id uncounted,
/// `fail_closed` refuses it. A customizer that keeps to a fixed list, and sends the other
/// ids to a rule set of the list, counts them whatever the store does.
#[tokio::test]
async fn a_rule_set_chosen_from_the_request_follows_on_error_while_its_store_is_down() {
    use std::sync::atomic::AtomicBool;
    /// A store of rule sets that can be cut off.
    #[derive(Debug)]
    struct Store {
        rules: fluxgate::core::RuleSets,
        down: Arc<AtomicBool>,
    }
    impl fluxgate::core::RuleSetProvider for Store {
        fn rule_set(&self, id: &str) -> fluxgate::core::MaybeReady<fluxgate::core::RuleSetLookup> {
            if self.down.load(Ordering::SeqCst) {
                return fluxgate::core::MaybeReady::ready(Err("the store is unreachable".into()));
            }
            self.rules.rule_set(id)
        }
    }
    const TENANTS: &str = "rule_sets: [{id: acme, rules: [{id: per-ip, bands: [{capacity: 2, window: 1h}]}]}]";
    let down = Arc::new(AtomicBool::new(false));
    let store = Store {
        rules: fluxgate::core::RuleSets::from_yaml_str(TENANTS).expect("rules"),
        down: down.clone(),
    };
    let engine = Engine::builder(fluxgate::core::CachingRuleSetProvider::builder(store).build())
        .unknown_rule_set(fluxgate::UnknownRuleSet::Deny)
        .build()
        .expect("an engine");
    let app_with = |on_error: FailurePolicy, fixed_list: bool| {
        app(layer(engine.clone())
            .on_error(on_error)
            .customizer(move |ctx, parts| {
                if let Some(tenant) = parts.headers.get("x-tenant").and_then(|v| v.to_str().ok()) {
                    ctx.set_rule_set_id(if fixed_list && tenant != "acme" { "acme" } else { tenant });
                }
            })
            .build()
            .expect("a layer"))
    };
    let tenant = |app: &axum::Router, name: String, peer: &str| {
        send_owned(
            app.clone(),
            request("GET", "/api/users", peer, &[("x-tenant", name.as_str())]),
        )
    };
    let (open, closed, listed) = (
        app_with(FailurePolicy::FailOpen, false),
        app_with(FailurePolicy::FailClosed, false),
        app_with(FailurePolicy::FailOpen, true),
    );
    // The store answers: an unknown id is refused, a known one found (and kept).
    assert_eq!(
        tenant(&open, "new".into(), "192.0.2.97").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(tenant(&open, "acme".into(), "192.0.2.97").await.status, StatusCode::OK);
    down.store(true, Ordering::SeqCst);
    for i in 0..3 {
        let r = tenant(&open, format!("new-{i}"), "192.0.2.98").await;
        assert_eq!(r.status, StatusCode::OK, "fail_open: admitted, counted by no rule");
        assert_eq!(r.header("x-ratelimit-limit"), None);
        let r = tenant(&closed, format!("new-{i}"), "192.0.2.98").await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "fail_closed");
    }
    // The fixed list sends every other id to `acme`, found before: counted there.
    let statuses: Vec<StatusCode> = {
        let mut out = Vec::new();
        for i in 0..3 {
            out.push(tenant(&listed, format!("new-{i}"), "192.0.2.99").await.status);
        }
        out
    };
    use StatusCode as S;
    assert_eq!(statuses, [S::OK, S::OK, S::TOO_MANY_REQUESTS]);
}

/// A layer whose rule set its engine does not have (a misspelt `rule_set`) admits every
/// request: each layer warns once, on its first such request, even when the engine, shared
/// with another layer, warned already; later requests add no warning.
#[tokio::test]
async fn a_layer_whose_rule_set_is_unknown_warns_once() {
    use support::telemetry::trace_async;
    use tracing::Level;
    let engine = engine("rule_sets: [{id: api, rules: [{id: per-ip, bands: [{capacity: 1, window: 1h}]}]}]");
    let typo = app(layer(engine.clone()).rule_set("apii").build().unwrap());
    let other = app(layer(engine.clone()).rule_set("admn").build().unwrap());
    let warnings = |app: axum::Router| async move {
        let (reply, trace) = trace_async(send_owned(app, request("GET", "/api/users", "192.0.2.7", &[]))).await;
        assert_eq!(reply.status, StatusCode::OK);
        trace
            .events_at_least(Level::WARN)
            .iter()
            .map(|e| e.message.clone())
            .collect::<Vec<_>>()
    };
    let first = warnings(typo.clone()).await;
    assert_eq!(first.len(), 2, "the engine's and the layer's: {first:?}");
    assert!(
        first
            .iter()
            .any(|m| m.contains("the layer's rule set is not one of the handler's")),
        "{first:?}"
    );
    assert_eq!(warnings(typo.clone()).await, Vec::<String>::new());
    // Admitted, and no rule counts it.
    for _ in 0..3 {
        let reply = send(&typo, request("GET", "/api/users", "192.0.2.7", &[])).await;
        assert_eq!(
            (reply.status, reply.header("x-ratelimit-limit")),
            (StatusCode::OK, None)
        );
    }
    // The engine warned once already; the second layer still says so, once.
    let second = warnings(other.clone()).await;
    assert_eq!(second.len(), 1, "{second:?}");
    assert!(
        second[0].contains("the layer's rule set is not one of the handler's"),
        "{second:?}"
    );
    assert_eq!(warnings(other).await, Vec::<String>::new());
    // A layer whose rule set exists never says it.
    let right = app(layer(engine).rule_set("api").build().unwrap());
    assert_eq!(warnings(right).await, Vec::<String>::new());
}

async fn send_owned(app: axum::Router, req: Request<Body>) -> Reply {
    send(&app, req).await
}

/// Serves `app` on a loopback port (HTTP/1.1, and HTTP/2 with prior knowledge), with the
/// peer address as `ConnectInfo`.
async fn serve(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let addr = listener.local_addr().expect("a bound address");
    tokio::spawn(async move {
        let app = app.into_make_service_with_connect_info::<SocketAddr>();
        axum::serve(listener, app).await.expect("the server runs");
    });
    addr
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
