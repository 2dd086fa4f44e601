//! The layer among other middleware and with clients that follow its figures.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use fluxgate::tower::RateLimit;
use http::StatusCode;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};

use super::*;

/// A concurrency limit as `tower::limit::ConcurrencyLimit` makes it: `poll_ready` takes a
/// permit, the response future holds it; a service polled ready and dropped gives it back.
#[derive(Clone)]
struct Limit(Arc<Semaphore>);

impl<S> Layer<S> for Limit {
    type Service = Limited<S>;
    fn layer(&self, inner: S) -> Limited<S> {
        Limited {
            inner,
            semaphore: self.0.clone(),
            acquiring: None,
            permit: None,
        }
    }
}

type Acquiring = Pin<Box<dyn Future<Output = OwnedSemaphorePermit> + Send + Sync>>;

struct Limited<S> {
    inner: S,
    semaphore: Arc<Semaphore>,
    acquiring: Option<Acquiring>,
    permit: Option<OwnedSemaphorePermit>,
}

impl<S: Clone> Clone for Limited<S> {
    fn clone(&self) -> Self {
        // As tower's: a clone is not ready.
        Self {
            inner: self.inner.clone(),
            semaphore: self.semaphore.clone(),
            acquiring: None,
            permit: None,
        }
    }
}

impl<S, R> Service<R> for Limited<S>
where
    S: Service<R>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        if self.permit.is_none() {
            let semaphore = self.semaphore.clone();
            let acquiring = self.acquiring.get_or_insert_with(|| {
                Box::pin(async move { semaphore.acquire_owned().await.expect("open semaphore") })
            });
            let permit = std::task::ready!(acquiring.as_mut().poll(cx));
            self.acquiring = None;
            self.permit = Some(permit);
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> Self::Future {
        let permit = self.permit.take().expect("called before poll_ready");
        let future = self.inner.call(req);
        Box::pin(async move {
            let response = future.await;
            drop(permit);
            response
        })
    }
}

const EXPORT_WAITS: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: exports
        scope: ip
        bands: [{ capacity: 1, window: 10s }]
        on_limit: { wait: { max_wait: 10s, max_waiters: 10 } }
"#;

/// The limiter around a concurrency limit around the whole router, as a
/// `ServiceBuilder` makes it (axum's `Router::layer` would give each route a limit of its
/// own, and axum's routes are always ready: their readiness is polled in their call).
type Stack = RateLimit<Limited<Router>>;

fn stack(engine: Engine, semaphore: Arc<Semaphore>) -> Stack {
    ServiceBuilder::new()
        .layer(RateLimitLayer::new(engine))
        .layer(Limit(semaphore))
        .service(Router::new().route("/export", get(|| async { "export" })))
}

async fn get_through(app: &Stack, path: &str, peer: &str) -> Reply {
    let resp = app
        .clone()
        .oneshot(request("GET", path, peer, &[]))
        .await
        .expect("infallible");
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .expect("the body");
    Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// A request waiting for the refill is not running the handler: it must not hold what
/// the inner service gave when it was polled ready (a concurrency limit's permit), or a
/// client's waiting requests keep every other client out of the handler for as long as
/// they wait.
#[tokio::test(start_paused = true)]
async fn a_waiting_request_holds_no_permit_of_the_inner_service() {
    let app = stack(engine(EXPORT_WAITS), Arc::new(Semaphore::new(1)));
    let r = get_through(&app, "/export", "192.0.2.90").await;
    assert_eq!(r.status, StatusCode::OK);
    // The same client's second request waits 10 s for its band.
    let waiting = tokio::spawn({
        let app = app.clone();
        async move { get_through(&app, "/export", "192.0.2.90").await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished(), "the second request waits");
    // Another client, whose band is full, is served at once.
    let start = Instant::now();
    let r = get_through(&app, "/export", "192.0.2.91").await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "another client's request waited {:?} for the waiting one's permit",
        start.elapsed()
    );
    let r = waiting.await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
}

/// The concurrency limit still holds for the requests the layer admits after a pending
/// decision: the inner service is polled ready again before it is called.
#[tokio::test(start_paused = true)]
async fn the_inner_service_is_ready_when_a_waiting_request_proceeds() {
    let semaphore = Arc::new(Semaphore::new(1));
    let app = stack(engine(EXPORT_WAITS), semaphore.clone());
    assert_eq!(get_through(&app, "/export", "192.0.2.92").await.status, StatusCode::OK);
    let waiting = tokio::spawn({
        let app = app.clone();
        async move { get_through(&app, "/export", "192.0.2.92").await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Someone else holds the only permit when the wait ends: the request waits for it.
    let held = semaphore.clone().acquire_owned().await.unwrap();
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert!(!waiting.is_finished(), "the handler ran without a permit");
    drop(held);
    assert_eq!(waiting.await.unwrap().status, StatusCode::OK);
}

/// The layer's shadow mode never changes what a request gets: a rule that waits for the
/// refill does not delay it either.
#[tokio::test(start_paused = true)]
async fn a_shadow_layer_never_makes_a_request_wait() {
    let app = Router::new().route("/export", get(|| async { "export" })).layer(
        RateLimitLayer::builder(engine(EXPORT_WAITS))
            .shadow(true)
            .build()
            .unwrap(),
    );
    for i in 0..3 {
        let start = Instant::now();
        let r = get_from(&app, "/export", "192.0.2.93").await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(
            start.elapsed(),
            Duration::ZERO,
            "request {i} was delayed by a shadow layer"
        );
        assert!(r.header("retry-after").is_none());
    }
}

/// A client that waits for the reset the headers name when nothing is left, and then
/// sends its next request, is admitted: with two bands empty at once, the reset is the
/// later one's.
#[tokio::test(start_paused = true)]
async fn the_reset_of_an_empty_band_is_the_latest_of_the_empty_ones() {
    for algorithm in fluxgate::core::Algorithm::ALL.map(fluxgate::core::Algorithm::as_str) {
        let rules = format!(
            r#"
rule_sets:
  - id: default
    rules:
      - id: burst
        priority: 1
        algorithm: {algorithm}
        bands: [{{ capacity: 2, window: 1s }}]
      - id: hourly
        algorithm: {algorithm}
        bands: [{{ capacity: 2, window: 1h }}]
"#
        );
        let app = app(layer(engine(&rules)).build().unwrap());
        let mut last = get_from(&app, "/api/users", "192.0.2.94").await;
        let last = loop {
            assert_eq!(last.status, StatusCode::OK, "{algorithm}");
            if last.num("x-ratelimit-remaining") == 0 {
                break last;
            }
            last = get_from(&app, "/api/users", "192.0.2.94").await;
        };
        let ietf = last.header("ratelimit").unwrap().to_owned();
        let t: u64 = ietf.rsplit("t=").next().unwrap().parse().unwrap();
        tokio::time::advance(Duration::from_secs(t)).await;
        let r = get_from(&app, "/api/users", "192.0.2.94").await;
        assert_eq!(
            r.status,
            StatusCode::OK,
            "{algorithm}: refused after waiting the reset of {ietf} (X-RateLimit-Reset {})",
            last.num("x-ratelimit-reset")
        );
    }
}

/// Two layers, one on a route and one on the router: the route's refusal keeps its own
/// figures, which the outer layer's (of a rule that admitted the request) would contradict.
#[tokio::test]
async fn an_inner_refusal_keeps_its_figures_through_an_outer_layer() {
    let strict = r#"
rule_sets:
  - id: default
    rules:
      - id: login
        bands: [{ capacity: 1, window: 1h }]
"#;
    let global = r#"
rule_sets:
  - id: default
    rules:
      - id: global
        bands: [{ capacity: 100, window: 1h }]
"#;
    let app = Router::new()
        .route(
            "/login",
            get(|| async { "login" }).route_layer(RateLimitLayer::new(engine(strict))),
        )
        .layer(RateLimitLayer::new(engine(global)));
    let r = get_from(&app, "/login", "192.0.2.95").await;
    assert_eq!(r.status, StatusCode::OK);
    let r = get_from(&app, "/login", "192.0.2.95").await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        (r.header("x-ratelimit-remaining"), r.header("ratelimit")),
        (Some("0"), Some("\"login\";r=0;t=3600")),
        "{:?}",
        r.headers
    );
    assert_eq!(r.num("retry-after"), 3600);
}

/// The status of a `GET` of `path` from one client through `app`, a stack of services.
async fn status_through<S>(app: &S, path: &str) -> StatusCode
where
    S: Service<http::Request<axum::body::Body>, Response = axum::response::Response, Error = Infallible> + Clone,
{
    app.clone()
        .oneshot(request("GET", path, "192.0.2.80", &[]))
        .await
        .map_or_else(|never| match never {}, |resp| resp.status())
}

/// A `GET /api/{version}/login` route counting its runs.
fn login_router(runs: Arc<std::sync::atomic::AtomicUsize>) -> Router {
    Router::new().route(
        "/api/{version}/login",
        get(move || {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { "login" }
        }),
    )
}

/// Spellings of `/api/{version}/login` that tower-http's `NormalizePathLayer` (trimming
/// every leading and trailing `/` run) turns into a path the router sends to the handler.
const TRIMMED_TO_LOGIN: &[&str] = &["//api/../login", "/api/../login//", "/api/./login//", "//api/v2/login/"];

/// A middleware that trims the runs of `/` at both ends of the path (tower-http's
/// `NormalizePathLayer`) counts every spelling wherever it stands: around the router (as
/// tower-http documents it), before the limiter, or between the limiter and the router,
/// where the limiter sees `//api/../login` and the router routes `/api/../login`.
#[tokio::test]
async fn a_path_trimming_middleware_lets_no_spelling_through_in_any_order() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tower_http::normalize_path::NormalizePathLayer;

    async fn check<S>(app: S, runs: &AtomicUsize, order: &str)
    where
        S: Service<http::Request<axum::body::Body>, Response = axum::response::Response, Error = Infallible> + Clone,
    {
        assert_eq!(status_through(&app, "/api/v1/login").await, StatusCode::OK, "{order}");
        for path in TRIMMED_TO_LOGIN {
            assert_eq!(
                status_through(&app, path).await,
                StatusCode::TOO_MANY_REQUESTS,
                "{order}: {path} escaped the rule"
            );
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{order}");
    }
    let limiter = || RateLimitLayer::new(super::engine(LOGIN_GET_ONE_PER_HOUR));

    let runs = Arc::new(AtomicUsize::new(0));
    let around_the_router =
        NormalizePathLayer::trim_trailing_slash().layer(login_router(runs.clone()).layer(limiter()));
    check(around_the_router, &runs, "around the router").await;

    let runs = Arc::new(AtomicUsize::new(0));
    let before_the_limiter = ServiceBuilder::new()
        .layer(NormalizePathLayer::trim_trailing_slash())
        .layer(limiter())
        .service(login_router(runs.clone()));
    check(before_the_limiter, &runs, "before the limiter").await;

    let runs = Arc::new(AtomicUsize::new(0));
    let after_the_limiter = ServiceBuilder::new()
        .layer(limiter())
        .layer(NormalizePathLayer::trim_trailing_slash())
        .service(login_router(runs.clone()));
    check(after_the_limiter, &runs, "between the limiter and the router").await;
}

/// The layer's `include` sees the path as a trimming middleware behind it hands it to the
/// router: `//api/../x` is `/api/../x` to the router, which runs its `/api/{*rest}` route.
#[tokio::test]
async fn an_included_route_is_limited_behind_a_path_trimming_middleware() {
    use tower_http::normalize_path::NormalizePathLayer;
    let rules = r#"
rule_sets:
  - id: default
    rules:
      - id: api
        bands: [{ capacity: 1, window: 1h }]
"#;
    let app = ServiceBuilder::new()
        .layer(
            RateLimitLayer::builder(super::engine(rules))
                .include(["/api/**"])
                .build()
                .unwrap(),
        )
        .layer(NormalizePathLayer::trim_trailing_slash())
        .service(Router::new().route("/api/{*rest}", get(|| async { "api" })));
    assert_eq!(status_through(&app, "/api/users").await, StatusCode::OK);
    for path in ["//api/../x", "/api/../x/", "//api/./users//"] {
        assert_eq!(
            status_through(&app, path).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{path} was not limited"
        );
    }
}
