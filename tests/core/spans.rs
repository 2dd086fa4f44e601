//! The engine's tracing: one `fluxgate.decision` span at debug level per decision, with
//! its outcome; a warning per backend failure a failure policy covers (at debug level
//! while a circuit breaker is open); one warning for the first request an engine admits
//! for an unknown rule set; nothing at info level per request.

use std::time::Duration;

use fluxgate::core::limiter::{AcquireOutcome, AcquireRequest};
use fluxgate::core::{
    BoxError, CircuitBreaker, Engine, FailurePolicy, MaybeReady, MemoryLimiter, RateLimiter, RequestContext,
};
use tracing::Level;

use crate::support::app::rules;
use crate::support::telemetry::{trace, trace_async};

const API: &str = r#"
rule_sets:
  - id: api
    rules:
      - id: per-ip
        bands: [{ capacity: 2, window: 1h }]
"#;

fn ctx(rule_set: &str) -> RequestContext {
    RequestContext::builder()
        .rule_set_id(rule_set)
        .path("/api/x")
        .client_ip("192.0.2.1".parse().expect("an address"))
        .build()
}

#[test]
fn one_debug_span_per_decision_with_its_outcome() {
    let engine = Engine::in_memory(rules(API));
    let ((), trace) = trace(|| {
        for rule_set in ["api", "api", "api", "other", "other", "another"] {
            engine
                .check(&ctx(rule_set))
                .into_ready()
                .expect("in memory")
                .expect("decided");
        }
    });
    let spans = trace.spans("fluxgate.decision");
    let seen: Vec<(&str, &str)> = spans
        .iter()
        .map(|s| (s.fields["rule_set"].as_str(), s.fields["outcome"].as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            ("api", "allowed"),
            ("api", "allowed"),
            ("api", "rejected"),
            ("other", "unknown_rule_set_allowed"),
            ("other", "unknown_rule_set_allowed"),
            ("another", "unknown_rule_set_allowed")
        ]
    );
    assert!(spans.iter().all(|s| s.level == Level::DEBUG));
    assert_eq!(trace.spans.len(), 6, "no other span: {:?}", trace.spans);
    // One warning for the engine's first request admitted for an unknown rule set (a rule
    // set removed while a layer still names it goes unlimited: it must show), and none per
    // request: the id may come from the request.
    let loud = trace.events_at_least(Level::INFO);
    assert_eq!(loud.len(), 1, "{:?}", trace.events);
    assert_eq!(loud[0].level, Level::WARN);
    assert!(loud[0].message.contains("no rule counts it"), "{:?}", loud[0]);
}

/// A backend that always fails.
#[derive(Debug)]
struct Down;

impl RateLimiter for Down {
    fn acquire(&self, _: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        MaybeReady::ready(Err("backend down".into()))
    }
}

/// A backend that fails after a short wait, as a remote one does.
#[derive(Debug)]
struct DownLater;

impl RateLimiter for DownLater {
    fn acquire(&self, _: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        MaybeReady::boxed(async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            Err("backend down".into())
        })
    }
}

/// Each failure is logged in its decision's span; the first as a warning, the others,
/// within `LogThrottle::EVERY`, at debug level: a backend down without a circuit breaker
/// writes one warning per period, not one per request.
#[tokio::test]
async fn an_asynchronous_decision_runs_in_its_span_and_a_failing_backend_warns_once() {
    let engine = Engine::builder(rules(API))
        .limiter(DownLater)
        .on_backend_failure(FailurePolicy::FailOpen)
        .build()
        .expect("valid");
    let ((), trace) = trace_async(async {
        for _ in 0..3 {
            let decision = engine.check(&ctx("api")).await.expect("fail open");
            assert!(decision.failed_open);
        }
    })
    .await;
    let spans = trace.spans("fluxgate.decision");
    assert_eq!(spans.len(), 3);
    assert!(spans.iter().all(|s| s.fields["outcome"] == "allowed"), "{spans:?}");
    let failures: Vec<_> = trace
        .events
        .iter()
        .filter(|e| e.message.contains("rate-limit backend failed"))
        .collect();
    assert_eq!(failures.len(), 3, "one per failure: {:?}", trace.events);
    assert!(
        failures.iter().all(|e| e.span == Some("fluxgate.decision")),
        "{failures:?}"
    );
    assert_eq!(failures[0].level, Level::WARN);
    assert_eq!(failures[0].fields["held_back"], "0");
    assert!(failures[0].message.contains("warned again in 10s"), "{:?}", failures[0]);
    assert!(failures[1..].iter().all(|e| e.level == Level::DEBUG), "{failures:?}");
    assert_eq!(trace.events_at_least(Level::WARN).len(), 1, "{:?}", trace.events);
    assert!(
        !trace.events.iter().any(|e| e.level == Level::INFO),
        "{:?}",
        trace.events
    );
}

/// A refusal by a `fail_closed` rule is warned of even right after admissions by the
/// engine's `fail_open`: each kind of answer has its throttle, and neither hides the other.
#[tokio::test]
async fn a_fail_closed_refusal_is_warned_of_beside_admissions() {
    const TWO: &str = r#"
rule_sets:
  - id: api
    rules:
      - id: per-ip
        bands: [{ capacity: 2, window: 1h }]
  - id: login
    rules:
      - id: per-ip
        on_backend_failure: fail_closed
        bands: [{ capacity: 2, window: 1h }]
"#;
    let engine = Engine::builder(rules(TWO))
        .limiter(DownLater)
        .on_backend_failure(FailurePolicy::FailOpen)
        .build()
        .expect("valid");
    let ((), trace) = trace_async(async {
        for rule_set in ["api", "api", "login", "login", "api"] {
            engine.check(&ctx(rule_set)).await.expect("a decision");
        }
    })
    .await;
    let warnings: Vec<_> = trace
        .events_at_least(Level::WARN)
        .iter()
        .map(|e| e.message.clone())
        .collect();
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings[0].contains("failure policies"), "{warnings:?}");
    assert!(
        warnings[1].contains("refusing the request (fail_closed)"),
        "{warnings:?}"
    );
}

#[test]
fn an_open_circuit_does_not_warn_per_request() {
    let breaker = CircuitBreaker::new(Down)
        .failure_threshold(1)
        .cool_down(Duration::from_secs(3600));
    let engine = Engine::builder(rules(API))
        .limiter(breaker)
        .fallback(MemoryLimiter::default())
        .build()
        .expect("valid");
    let ((), trace) = trace(|| {
        for _ in 0..10 {
            let decision = engine.check(&ctx("api")).into_ready().expect("sync").expect("fallback");
            assert!(decision.degraded);
        }
    });
    // The failure that opened the circuit, and the breaker's own notice that it opened.
    let warnings: Vec<&str> = trace
        .events_at_least(Level::WARN)
        .iter()
        .map(|e| e.message.as_str())
        .collect();
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings.iter().any(|m| m.contains("circuit open")), "{warnings:?}");
    assert_eq!(trace.spans("fluxgate.decision").len(), 10);
}
