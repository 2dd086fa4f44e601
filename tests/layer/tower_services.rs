//! The layer around plain tower services (no axum router): a `Service` of its own and a
//! `service_fn`, the inner service called once per admitted request and its errors passed
//! through, and a handler whose decision is not ready at once.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use fluxgate::core::{Decision, Engine};
use fluxgate::tower::RateLimitLayer;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, Service, ServiceBuilder, ServiceExt};

use crate::support::app::request;
use crate::{engine, LayerService};

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
