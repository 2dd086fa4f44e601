//! The metrics of an engine on the Redis backend, against a real `redis-server`: every
//! call timed as `backend="redis"`, deny-cache hits, and fail-open admissions while Redis
//! is down, with one warning per failed call. Each test runs on tokio's current-thread
//! runtime, where the recorder installed for the test's thread sees every metric.

use std::time::Duration;

use fluxgate::core::metrics::MetricsRecorder;
use fluxgate::core::{Engine, FailurePolicy, RequestContext};
use fluxgate::redis::RedisLimiter;
use tracing::Level;

use crate::support::app::rules;
use crate::support::servers::RedisServer;
use crate::support::telemetry::{metrics_async, trace_async};

const ONE_PER_HOUR: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 1, window: 1h }]
"#;

async fn limiter(server: &RedisServer, deny_cache: bool) -> RedisLimiter {
    RedisLimiter::builder(server.url())
        .prefix(format!("metrics-{deny_cache}"))
        .deny_cache(deny_cache)
        .timeout(Duration::from_millis(500))
        .reconnect_delay(Duration::from_millis(50))
        .connect()
        .await
        .expect("connect")
}

fn ctx() -> RequestContext {
    RequestContext::builder()
        .client_ip("192.0.2.61".parse().expect("an address"))
        .build()
}

#[tokio::test]
async fn deny_cache_hits_and_every_call_are_counted() {
    let server = RedisServer::start();
    let engine = Engine::builder(rules(ONE_PER_HOUR))
        .limiter(limiter(&server, true).await)
        .recorder(MetricsRecorder::new())
        .build()
        .expect("the backend decides every rule");
    let before = server.evalsha_calls();
    let ((), metrics) = metrics_async(async {
        for _ in 0..5 {
            engine.check(&ctx()).await.expect("decided");
        }
    })
    .await;
    // Redis admitted the first request and rejected the second; the deny cache the rest.
    assert_eq!(server.evalsha_calls() - before, 2);
    assert_eq!(
        metrics.counters(),
        [
            "fluxgate_decisions_total{outcome=allowed,rule=per-ip,rule_set=default} = 1",
            "fluxgate_decisions_total{outcome=rejected,rule=per-ip,rule_set=default} = 4",
            "fluxgate_deny_cache_hits_total = 3",
        ]
    );
    let seconds = metrics.histogram("fluxgate_backend_seconds", &[("backend", "redis")]);
    assert_eq!(seconds.len(), 5, "one per limiter call, deny-cache hits included");
    assert!(seconds.iter().all(|s| (0.0..0.5).contains(s)), "{seconds:?}");
    assert!(!metrics.label_values().iter().any(|v| v.contains("192.0.2")));
}

#[tokio::test]
async fn without_a_deny_cache_every_request_goes_to_redis() {
    let server = RedisServer::start();
    let engine = Engine::builder(rules(ONE_PER_HOUR))
        .limiter(limiter(&server, false).await)
        .recorder(MetricsRecorder::new())
        .build()
        .expect("the backend decides every rule");
    let ((), metrics) = metrics_async(async {
        for _ in 0..3 {
            engine.check(&ctx()).await.expect("decided");
        }
    })
    .await;
    assert_eq!(metrics.counter("fluxgate_deny_cache_hits_total", &[]), 0);
    assert_eq!(
        metrics
            .histogram("fluxgate_backend_seconds", &[("backend", "redis")])
            .len(),
        3
    );
}

#[tokio::test]
async fn requests_admitted_while_redis_is_down_are_counted() {
    let mut server = RedisServer::start();
    let engine = Engine::builder(rules(ONE_PER_HOUR))
        .limiter(limiter(&server, true).await)
        .on_backend_failure(FailurePolicy::FailOpen)
        .recorder(MetricsRecorder::new())
        .build()
        .expect("the backend decides every rule");
    server.kill();
    let (((), trace), metrics) = metrics_async(trace_async(async {
        for _ in 0..2 {
            let decision = engine.check(&ctx()).await.expect("fail open");
            assert!(decision.allowed() && decision.degraded && decision.failed_open);
        }
    }))
    .await;
    assert_eq!(
        metrics.counters(),
        [
            "fluxgate_backend_errors_total{backend=redis} = 2",
            "fluxgate_decisions_total{outcome=allowed,rule=(none),rule_set=default} = 2",
            "fluxgate_degraded_decisions_total{rule_set=default} = 2",
            "fluxgate_fail_open_total{rule_set=default} = 2",
        ]
    );
    assert_eq!(
        metrics
            .histogram("fluxgate_backend_seconds", &[("backend", "redis")])
            .len(),
        2
    );
    // Each failure logged in its decision's span: the first as a warning, the second, within
    // `LogThrottle::EVERY`, at debug level.
    let failures: Vec<_> = trace
        .events
        .iter()
        .filter(|e| e.message.contains("rate-limit backend failed"))
        .collect();
    assert_eq!(
        failures.iter().map(|e| e.level).collect::<Vec<_>>(),
        [Level::WARN, Level::DEBUG],
        "{:?}",
        trace.events
    );
    assert!(
        failures.iter().all(|w| w.span == Some("fluxgate.decision")),
        "{failures:?}"
    );
    assert_eq!(trace.events_at_least(Level::WARN).len(), 1, "{:?}", trace.events);
    assert!(
        !trace.events.iter().any(|e| e.level == Level::INFO),
        "{:?}",
        trace.events
    );
}
