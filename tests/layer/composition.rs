//! The layer among other middleware and with clients that follow its figures.

use std::time::Duration;

use axum::routing::get;
use axum::Router;
use http::StatusCode;
use tokio::time::Instant;

use super::*;

const EXPORT_WAITS: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: exports
        scope: ip
        bands: [{ capacity: 1, window: 10s }]
        on_limit: { wait: { max_wait: 10s, max_waiters: 10 } }
"#;

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
    for algorithm in [
        "token_bucket",
        "leaky_bucket",
        "fixed_window",
        "sliding_window_log",
        "sliding_window_counter",
    ] {
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
