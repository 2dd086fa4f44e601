//! The engine's metrics (`MetricsRecorder`) and the reload counters, caught by a debugging
//! recorder: exact names, labels and values, and never a path, an address, a key or a rule
//! set id taken from the request as a label.

use std::time::Duration;

use fluxgate::core::limiter::{AcquireOutcome, AcquireRequest};
use fluxgate::core::metrics::MetricsRecorder;
use fluxgate::core::reload::RuleSource;
use fluxgate::core::{
    BoxError, BoxFuture, Decision, Engine, EngineBuilder, Error, FailurePolicy, MaybeReady, MemoryLimiter, RateLimiter,
    ReloadingRuleSetProvider, RequestContext, RuleSetLookup, RuleSetProvider, RuleSets, UnknownRuleSet,
};

use crate::support::app::rules;
use crate::support::telemetry::{metrics, metrics_async, Metrics};

const API: &str = r#"
rule_sets:
  - id: api
    rules:
      - id: per-ip
        match: { paths: ["/api/**"] }
        bands: [{ capacity: 2, window: 1h }]
"#;

fn engine(builder: EngineBuilder) -> Engine {
    builder
        .recorder(MetricsRecorder::new())
        .build()
        .expect("the backend decides every rule")
}

fn ctx(rule_set: &str, path: &str, ip: &str) -> RequestContext {
    RequestContext::builder()
        .rule_set_id(rule_set)
        .path(path)
        .client_ip(ip.parse().expect("an address"))
        .user_id("user-7f3a")
        .api_key("key-c0ffee")
        .build()
}

fn check(engine: &Engine, ctx: &RequestContext) -> Result<Decision, Error> {
    engine.check(ctx).into_ready().expect("decided synchronously")
}

/// No label value holds anything the request brought.
fn assert_no_request_values(metrics: &Metrics, request_values: &[&str]) {
    for value in metrics.label_values() {
        for bad in request_values {
            assert!(!value.contains(bad), "label value {value:?} holds {bad:?}");
        }
    }
}

#[test]
fn decisions_are_counted_by_rule_set_rule_and_outcome() {
    let engine = engine(Engine::builder(rules(API)));
    let ((), metrics) = metrics(|| {
        for _ in 0..3 {
            check(&engine, &ctx("api", "/api/users/42", "203.0.113.9")).unwrap();
        }
        check(&engine, &ctx("api", "/api/orders", "198.51.100.4")).unwrap();
        check(&engine, &ctx("api", "/static/logo.png", "198.51.100.4")).unwrap();
    });
    assert_eq!(
        metrics.counters(),
        [
            "fluxgate_decisions_total{outcome=allowed,rule=per-ip,rule_set=api} = 3",
            "fluxgate_decisions_total{outcome=no_matching_rule,rule=(none),rule_set=api} = 1",
            "fluxgate_decisions_total{outcome=rejected,rule=per-ip,rule_set=api} = 1",
        ]
    );
    // One limiter call per decision that had a rule to apply.
    let seconds = metrics.histogram("fluxgate_backend_seconds", &[("backend", "memory")]);
    assert_eq!(seconds.len(), 4);
    assert!(seconds.iter().all(|s| (0.0..1.0).contains(s)), "{seconds:?}");
    assert_no_request_values(
        &metrics,
        &["203.0.113", "198.51.100", "/api", "users", "42", "user-7f3a", "c0ffee"],
    );
}

#[test]
fn shadow_rules_count_their_would_be_rejections() {
    let engine = engine(Engine::builder(rules(
        r#"
rule_sets:
  - id: api
    rules:
      - id: enforced
        bands: [{ capacity: 10, window: 1h }]
      - id: trial
        mode: shadow
        bands: [{ capacity: 1, window: 1h }]
"#,
    )));
    let ((), metrics) = metrics(|| {
        for _ in 0..3 {
            assert!(check(&engine, &ctx("api", "/", "192.0.2.1")).unwrap().allowed());
        }
    });
    assert_eq!(
        metrics.counters(),
        [
            "fluxgate_decisions_total{outcome=allowed,rule=enforced,rule_set=api} = 1",
            "fluxgate_decisions_total{outcome=shadow_rejected,rule=enforced,rule_set=api} = 2",
            "fluxgate_shadow_rejections_total{rule=trial,rule_set=api} = 2",
        ]
    );
}

#[test]
fn an_unknown_rule_set_id_is_never_a_label() {
    let allow = engine(Engine::builder(rules(API)));
    let deny = engine(Engine::builder(rules(API)).unknown_rule_set(UnknownRuleSet::Deny));
    let ((), metrics) = metrics(|| {
        assert!(check(&allow, &ctx("tenant-4711", "/api/x", "192.0.2.1"))
            .unwrap()
            .allowed());
        assert!(!check(&deny, &ctx("tenant-4712", "/api/x", "192.0.2.1"))
            .unwrap()
            .allowed());
    });
    assert_eq!(
        metrics.counters(),
        [
            "fluxgate_decisions_total{outcome=unknown_rule_set_allowed,rule=(none),rule_set=(unknown)} = 1",
            "fluxgate_decisions_total{outcome=unknown_rule_set_denied,rule=(none),rule_set=(unknown)} = 1",
        ]
    );
    assert_no_request_values(&metrics, &["tenant", "471"]);
}

#[test]
fn a_missing_key_names_the_rule_that_denied() {
    let engine = engine(Engine::builder(rules(
        r#"
rule_sets:
  - id: api
    rules:
      - id: per-tenant
        scope: attribute
        attribute: tenant
        on_missing_key: deny
        bands: [{ capacity: 5, window: 1h }]
"#,
    )));
    let ((), metrics) = metrics(|| {
        let ctx = RequestContext::builder().rule_set_id("api").build();
        assert!(!check(&engine, &ctx).unwrap().allowed());
    });
    assert_eq!(
        metrics.counters(),
        ["fluxgate_decisions_total{outcome=missing_key,rule=per-tenant,rule_set=api} = 1"]
    );
}

/// A backend that always fails.
#[derive(Debug)]
struct Down;

impl RateLimiter for Down {
    fn acquire(&self, _: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        MaybeReady::ready(Err("backend down".into()))
    }
}

#[test]
fn fail_open_admissions_are_counted() {
    let engine = engine(
        Engine::builder(rules(API))
            .limiter(Down)
            .on_backend_failure(FailurePolicy::FailOpen),
    );
    let ((), metrics) = metrics(|| {
        for _ in 0..2 {
            let decision = check(&engine, &ctx("api", "/api/x", "192.0.2.1")).unwrap();
            assert!(decision.allowed() && decision.degraded && decision.failed_open);
        }
    });
    assert_eq!(
        metrics.counters(),
        [
            "fluxgate_backend_errors_total{backend=custom} = 2",
            "fluxgate_decisions_total{outcome=allowed,rule=(none),rule_set=api} = 2",
            "fluxgate_degraded_decisions_total{rule_set=api} = 2",
            "fluxgate_fail_open_total{rule_set=api} = 2",
        ]
    );
    assert_eq!(
        metrics
            .histogram("fluxgate_backend_seconds", &[("backend", "custom")])
            .len(),
        2
    );
}

#[test]
fn fallback_decisions_are_degraded_not_failed_open() {
    let engine = engine(
        Engine::builder(rules(API))
            .limiter(Down)
            .fallback(MemoryLimiter::default()),
    );
    let ((), metrics) = metrics(|| {
        for _ in 0..3 {
            check(&engine, &ctx("api", "/api/x", "192.0.2.1")).unwrap();
        }
    });
    assert_eq!(
        metrics.counters(),
        [
            "fluxgate_backend_errors_total{backend=custom} = 3",
            "fluxgate_decisions_total{outcome=allowed,rule=per-ip,rule_set=api} = 2",
            "fluxgate_decisions_total{outcome=rejected,rule=per-ip,rule_set=api} = 1",
            "fluxgate_degraded_decisions_total{rule_set=api} = 3",
        ]
    );
}

#[test]
fn a_request_rejected_beside_a_fail_open_rule_is_no_fail_open_admission() {
    let engine = engine(
        Engine::builder(rules(
            r#"
rule_sets:
  - id: api
    rules:
      - id: local
        on_backend_failure: fallback_local
        bands: [{ capacity: 1, window: 1h }]
      - id: open
        on_backend_failure: fail_open
        bands: [{ capacity: 1, window: 1h }]
"#,
        ))
        .limiter(Down),
    );
    let ((), metrics) = metrics(|| {
        assert!(check(&engine, &ctx("api", "/", "192.0.2.1")).unwrap().allowed());
        assert!(!check(&engine, &ctx("api", "/", "192.0.2.1")).unwrap().allowed());
    });
    assert_eq!(metrics.counter("fluxgate_fail_open_total", &[("rule_set", "api")]), 1);
    assert_eq!(
        metrics.counter("fluxgate_degraded_decisions_total", &[("rule_set", "api")]),
        2
    );
}

#[test]
fn fail_closed_refusals_are_unavailable() {
    let engine = engine(
        Engine::builder(rules(API))
            .limiter(Down)
            .on_backend_failure(FailurePolicy::FailClosed),
    );
    let ((), metrics) = metrics(|| {
        assert!(!check(&engine, &ctx("api", "/api/x", "192.0.2.1")).unwrap().allowed());
    });
    assert_eq!(
        metrics.counter(
            "fluxgate_decisions_total",
            &[("rule_set", "api"), ("rule", "per-ip"), ("outcome", "unavailable")]
        ),
        1
    );
    assert_eq!(metrics.counter("fluxgate_fail_open_total", &[("rule_set", "api")]), 0);
}

#[test]
fn a_failure_no_policy_covers_is_an_error() {
    let engine = engine(Engine::builder(rules(API)).limiter(Down));
    let ((), metrics) = metrics(|| {
        let error = check(&engine, &ctx("api", "/api/x", "192.0.2.1")).unwrap_err();
        assert!(matches!(error, Error::Backend(_)), "{error:?}");
    });
    assert_eq!(
        metrics.counters(),
        [
            "fluxgate_backend_errors_total{backend=custom} = 1",
            "fluxgate_errors_total{kind=backend,rule_set=api} = 1",
        ]
    );
}

/// A provider whose every lookup fails.
#[derive(Debug)]
struct Unreachable;

impl RuleSetProvider for Unreachable {
    fn rule_set(&self, _: &str) -> MaybeReady<RuleSetLookup> {
        MaybeReady::ready(Err("rule store unreachable".into()))
    }
}

#[test]
fn a_provider_failure_is_labelled_unknown() {
    let engine = engine(Engine::builder(Unreachable));
    let ((), metrics) = metrics(|| {
        let error = check(&engine, &ctx("tenant-4711", "/", "192.0.2.1")).unwrap_err();
        assert!(matches!(error, Error::Provider { .. }), "{error:?}");
    });
    assert_eq!(
        metrics.counters(),
        ["fluxgate_errors_total{kind=provider,rule_set=(unknown)} = 1"]
    );
}

#[test]
fn an_engine_without_recorder_records_nothing() {
    let engine = Engine::in_memory(rules(API));
    let ((), metrics) = metrics(|| {
        check(&engine, &ctx("api", "/api/x", "192.0.2.1")).unwrap();
        check(&engine, &ctx("elsewhere", "/api/x", "192.0.2.1")).unwrap();
    });
    assert!(metrics.0.is_empty(), "{metrics:?}");
}

/// A backend that answers after a short wait (an asynchronous one, as Redis is).
#[derive(Debug, Default)]
struct Later(MemoryLimiter);

impl RateLimiter for Later {
    fn acquire(&self, request: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        let outcome = self.0.acquire_now(request);
        MaybeReady::boxed(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok(outcome)
        })
    }
}

#[tokio::test]
async fn an_asynchronous_backend_is_timed_until_it_answers() {
    let engine = engine(Engine::builder(rules(API)).limiter(Later::default()));
    let ((), metrics) = metrics_async(async {
        for _ in 0..3 {
            engine.check(&ctx("api", "/api/x", "192.0.2.1")).await.unwrap();
        }
    })
    .await;
    assert_eq!(
        metrics.counters(),
        [
            "fluxgate_decisions_total{outcome=allowed,rule=per-ip,rule_set=api} = 2",
            "fluxgate_decisions_total{outcome=rejected,rule=per-ip,rule_set=api} = 1",
        ]
    );
    let seconds = metrics.histogram("fluxgate_backend_seconds", &[("backend", "custom")]);
    assert_eq!(seconds.len(), 3);
    assert!(seconds.iter().all(|&s| s >= 0.020), "{seconds:?}");
}

/// A rule source that fails every load.
#[derive(Debug)]
struct Unreadable;

impl RuleSource for Unreadable {
    fn load(&self) -> BoxFuture<Result<RuleSets, BoxError>> {
        Box::pin(async { Err("rule file unreadable".into()) })
    }
}

#[tokio::test]
async fn reloads_are_counted_by_result() {
    let provider = ReloadingRuleSetProvider::new(rules(API));
    let ((), metrics) = metrics_async(async {
        provider.replace(rules(API)).expect("same rules");
        provider
            .replace(rules(&API.replace("capacity: 2", "capacity: 3")))
            .expect("new rules");
        provider.reload_from(&Unreadable).await.unwrap_err();
    })
    .await;
    assert_eq!(
        metrics.counters(),
        [
            "fluxgate_reloads_total{result=failed} = 1",
            "fluxgate_reloads_total{result=ok} = 2",
        ]
    );
    assert_eq!((provider.reloads(), provider.failures()), (2, 1));
}

#[test]
fn every_name_is_described() {
    use fluxgate::core::metrics as m;
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    ::metrics::with_local_recorder(&recorder, || {
        m::describe();
        for name in [
            m::DECISIONS_TOTAL,
            m::SHADOW_REJECTIONS_TOTAL,
            m::ERRORS_TOTAL,
            m::FAIL_OPEN_TOTAL,
            m::DEGRADED_DECISIONS_TOTAL,
            m::BACKEND_ERRORS_TOTAL,
            m::RELOADS_TOTAL,
            m::DENY_CACHE_HITS_TOTAL,
        ] {
            ::metrics::counter!(name).increment(1);
        }
        ::metrics::histogram!(m::BACKEND_SECONDS).record(0.001);
    });
    let described = snapshotter.snapshot().into_vec();
    assert_eq!(described.len(), 9);
    for (key, unit, description, _) in described {
        let name = key.key().name().to_owned();
        assert!(name.starts_with("fluxgate_"), "{name}");
        assert!(description.is_some_and(|d| !d.is_empty()), "{name} has no description");
        if name == m::BACKEND_SECONDS {
            assert_eq!(unit, Some(::metrics::Unit::Seconds));
        }
    }
}
