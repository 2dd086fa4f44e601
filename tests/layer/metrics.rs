//! What the layer counts on its own (feature `metrics`): requests admitted by its
//! `on_error(FailOpen)` and rejections it lets through in shadow mode, beside the engine's
//! metrics; and one warning per failed check, not two, whichever handler failed (the engine,
//! the rate-limit service's `RemoteHandler`, the local engine of a `FallbackHandler` deciding
//! in its place).

use fluxgate::core::limiter::{AcquireOutcome, AcquireRequest};
use fluxgate::core::metrics::MetricsRecorder;
use std::time::Duration;

use fluxgate::core::{BoxError, Engine, FallbackHandler, MaybeReady, RateLimiter};
use fluxgate::tower::remote::RemoteHandler;
use fluxgate::tower::RateLimitLayer;
use http::StatusCode;
use tracing::Level;

use crate::support::app::{app, get_from, request, rules, send};
use crate::support::telemetry::{metrics_async, trace_async, Trace};

const RULES: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: users
        match: { paths: ["/api/users"] }
        bands: [{ capacity: 1, window: 1h }]
  - id: tenant-a
    rules:
      - id: per-tenant
        bands: [{ capacity: 1, window: 1h }]
"#;

/// A backend that always fails.
#[derive(Debug)]
struct Down;

impl RateLimiter for Down {
    fn acquire(&self, _: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        MaybeReady::ready(Err("backend down".into()))
    }
}

fn failing_engine() -> Engine {
    Engine::builder(rules(RULES))
        .limiter(Down)
        .recorder(MetricsRecorder::new())
        .build()
        .expect("valid")
}

/// Asserts that `trace` holds one warning (or worse), and that it says `says`.
fn one_warning(trace: &Trace, says: &str) {
    let warnings = trace.events_at_least(Level::WARN);
    assert_eq!(warnings.len(), 1, "{:?}", trace.events);
    assert!(warnings[0].message.contains(says), "{:?}", warnings[0]);
}

#[tokio::test]
async fn the_layers_fail_open_admissions_are_counted() {
    let app = app(RateLimitLayer::new(failing_engine()));
    let (reply, metrics) = metrics_async(get_from(&app, "/api/users", "203.0.113.5")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(
        metrics.counters(),
        [
            "fluxgate_backend_errors_total{backend=custom} = 1",
            "fluxgate_errors_total{kind=backend,rule_set=default} = 1",
            "fluxgate_fail_open_total{rule_set=default} = 1",
        ]
    );
}

/// A layer of `engine` whose customizer takes the rule set from the `x-tenant` header, as
/// an application that chooses it per tenant does.
fn by_tenant(engine: Engine) -> RateLimitLayer {
    RateLimitLayer::builder(engine)
        .customizer(|ctx, parts| {
            if let Some(tenant) = parts.headers.get("x-tenant").and_then(|v| v.to_str().ok()) {
                ctx.set_rule_set_id(tenant);
            }
        })
        .build()
        .expect("valid")
}

/// A `RemoteHandler` for a rate-limit service that is down: nothing listens on its port.
fn service_down() -> RemoteHandler {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port();
    RemoteHandler::builder(&format!("http://127.0.0.1:{port}"))
        .expect("a valid URL")
        .timeout(Duration::from_secs(2))
        .build()
}

/// The service down, the layer's `on_error` admits: one warning, the layer's. The handler
/// warned as well before, two per request during an outage.
#[tokio::test]
async fn a_failed_remote_check_is_one_warning() {
    let app = app(RateLimitLayer::new(service_down()));
    let (reply, trace) = trace_async(get_from(&app, "/api/users", "203.0.113.5")).await;
    assert_eq!(reply.status, StatusCode::OK);
    one_warning(&trace, "admitting the request");
}

/// The service down and a gateway's local engine deciding in its place: one warning, saying
/// so. Before, the handler warned and the local engine's decision was logged at debug level.
#[tokio::test]
async fn a_remote_check_decided_by_the_local_engine_is_one_warning() {
    let handler = FallbackHandler::new(service_down(), Engine::in_memory(rules(RULES)));
    let app = app(RateLimitLayer::new(handler));
    let (reply, trace) = trace_async(get_from(&app, "/api/users", "203.0.113.5")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(
        reply.header("x-ratelimit-remaining"),
        Some("0"),
        "decided by the local engine"
    );
    one_warning(&trace, "decided by the local engine");
}

/// A handler that stays down fails every request: the layer warns of the first failure,
/// then of at most one per `LogThrottle::EVERY`, the others at debug level; the same for a
/// `FallbackHandler` whose local engine decides in its place.
#[tokio::test]
async fn failed_checks_in_a_row_are_one_warning() {
    let handler = FallbackHandler::new(service_down(), Engine::in_memory(rules(RULES)));
    for (app, says) in [
        (app(RateLimitLayer::new(failing_engine())), "admitting the request"),
        (app(RateLimitLayer::new(handler)), "decided by the local engine"),
    ] {
        let ((), trace) = trace_async(async {
            // A client each: the local engine's rule admits one request per client.
            for client in ["203.0.113.5", "203.0.113.6", "203.0.113.7", "203.0.113.8"] {
                assert_eq!(get_from(&app, "/api/users", client).await.status, StatusCode::OK);
            }
        })
        .await;
        one_warning(&trace, says);
        let held_back: Vec<_> = trace
            .events
            .iter()
            .filter(|e| e.level == Level::DEBUG && e.message.contains(says))
            .collect();
        assert_eq!(held_back.len(), 3, "{:?}", trace.events);
    }
}

#[tokio::test]
async fn a_rule_set_chosen_per_request_is_not_a_fail_open_label() {
    let layer = by_tenant(failing_engine());
    let app = app(layer);
    let ((), metrics) = metrics_async(async {
        for tenant in ["tenant-a", "tenant-zz-9"] {
            let reply = send(
                &app,
                request("GET", "/api/orders", "203.0.113.5", &[("x-tenant", tenant)]),
            )
            .await;
            assert_eq!(reply.status, StatusCode::OK);
        }
        // Without the header: the layer's own rule set.
        assert_eq!(get_from(&app, "/api/users", "203.0.113.5").await.status, StatusCode::OK);
    })
    .await;
    assert_eq!(
        metrics.counters(),
        [
            "fluxgate_backend_errors_total{backend=custom} = 2",
            "fluxgate_decisions_total{outcome=unknown_rule_set_allowed,rule=(none),rule_set=(unknown)} = 1",
            "fluxgate_errors_total{kind=backend,rule_set=default} = 1",
            "fluxgate_errors_total{kind=backend,rule_set=tenant-a} = 1",
            "fluxgate_fail_open_total{rule_set=(unknown)} = 1",
            "fluxgate_fail_open_total{rule_set=default} = 1",
        ]
    );
    assert!(!metrics.label_values().iter().any(|v| v.contains("zz")));
}

#[tokio::test]
async fn a_failed_check_is_one_warning() {
    let app = app(RateLimitLayer::new(failing_engine()));
    let (reply, trace) = trace_async(get_from(&app, "/api/users", "203.0.113.5")).await;
    assert_eq!(reply.status, StatusCode::OK);
    one_warning(&trace, "admitting the request");
    assert!(
        !trace.events.iter().any(|e| e.level == Level::INFO),
        "{:?}",
        trace.events
    );
    assert_eq!(trace.spans("fluxgate.decision").len(), 1);
}

#[tokio::test]
async fn rejections_let_through_in_shadow_mode_are_counted() {
    let engine = Engine::builder(rules(RULES))
        .recorder(MetricsRecorder::new())
        .build()
        .expect("valid");
    let layer = RateLimitLayer::builder(engine).shadow(true).build().expect("valid");
    let app = app(layer);
    let ((), metrics) = metrics_async(async {
        for _ in 0..3 {
            assert_eq!(get_from(&app, "/api/users", "203.0.113.5").await.status, StatusCode::OK);
        }
    })
    .await;
    assert_eq!(
        metrics.counters(),
        [
            "fluxgate_decisions_total{outcome=allowed,rule=users,rule_set=default} = 1",
            "fluxgate_decisions_total{outcome=rejected,rule=users,rule_set=default} = 2",
            "fluxgate_shadow_rejections_total{rule=users,rule_set=default} = 2",
        ]
    );
}

/// The bytes of `text` with each `%XX` decoded: what a customizer reading a percent-encoded
/// header (or a claim of a token) hands the layer.
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match (bytes[i], bytes.get(i + 1..i + 3)) {
            (b'%', Some(hex)) => {
                let hex = std::str::from_utf8(hex).expect("ASCII");
                out.push(u8::from_str_radix(hex, 16).expect("two hexadecimal digits"));
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8(out).expect("UTF-8")
}

/// A rule set id the request chose is written into the log with its control characters
/// escaped: the warning for an unknown rule set wrote it as it was, and an id holding a line
/// break and a terminal escape wrote a second, forged line (`acme\n2025-01-01T00:00:00Z
/// ERROR forged\u{1b}[2K` in the event's `rule_set` field).
#[tokio::test]
async fn a_rule_set_id_from_the_request_forges_no_log_line() {
    let engine = Engine::builder(rules(RULES)).build().expect("valid");
    let layer = RateLimitLayer::builder(engine)
        .customizer(|ctx, parts| {
            if let Some(tenant) = parts.headers.get("x-tenant").and_then(|v| v.to_str().ok()) {
                ctx.set_rule_set_id(percent_decoded(tenant));
            }
        })
        .build()
        .expect("valid");
    let app = app(layer);
    let forged = "acme%0A2025-01-01T00:00:00Z%20ERROR%20forged%1B[2K";
    let (reply, trace) = trace_async(send(
        &app,
        request("GET", "/api/orders", "203.0.113.5", &[("x-tenant", forged)]),
    ))
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let warnings = trace.events_at_least(Level::WARN);
    assert_eq!(warnings.len(), 1, "{:?}", trace.events);
    let shown = &warnings[0].fields["rule_set"];
    assert!(shown.contains("acme"), "{shown}");
    assert!(!shown.chars().any(char::is_control), "{shown:?}");
}

/// The decision span names the rule set asked for as the warning does, cut to 64
/// characters: a rule set id a customizer took from a header of 60,000 characters was a
/// span field of 60,000 characters, on every request and every event of its decision.
#[tokio::test]
async fn a_rule_set_id_from_the_request_is_cut_in_the_decision_span() {
    let layer = by_tenant(Engine::builder(rules(RULES)).build().expect("valid"));
    let app = app(layer);
    let long = "t".repeat(60_000);
    let (reply, trace) = trace_async(send(
        &app,
        request("GET", "/api/orders", "203.0.113.5", &[("x-tenant", &long)]),
    ))
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let spans = trace.spans("fluxgate.decision");
    assert_eq!(spans.len(), 1);
    let shown = &spans[0].fields["rule_set"];
    assert!(shown.chars().count() <= 65, "{} characters", shown.chars().count());
    assert!(shown.starts_with("tttt") && shown.ends_with('…'), "{shown}");
}
