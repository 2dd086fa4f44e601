//! What the layer does when its handler or the backend fails: `on_error` open or closed and
//! the status it answers with, each rule's `on_backend_failure`, and failure options the
//! layer cannot apply refused, an unknown policy named.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use fluxgate::core::Decision;
use fluxgate::tower::{ConfigError, RateLimitLayer};
use fluxgate::FailurePolicy;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tower::{service_fn, ServiceExt};

use crate::support::app::{app, get_from, request, rules};
use crate::{Down, LayerService};

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
