//! Request targets as a real hyper HTTP/1.1 server parses them (`axum::serve` on a loopback
//! port, requests written as bytes): the absolute form (`GET http://host/path`) routes and
//! is limited by its path; the asterisk and authority forms reach no route.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::serve;
use crate::support::app::layer;

/// Writes a request line (with `Host` and the end of the head added) on a new
/// connection and returns the status code of the answer.
#[allow(clippy::unwrap_used)]
async fn status_of(addr: SocketAddr, request_line: &str) -> u16 {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!("{request_line}\r\nHost: example.com\r\nConnection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    answer.split(' ').nth(1).and_then(|code| code.parse().ok()).unwrap()
}

#[tokio::test]
async fn request_targets_in_absolute_form_are_limited_by_their_path() {
    let rules = "rule_sets: [{id: default, rules: [{id: login, match: {paths: [\"/api/*/login\"], methods: [GET]}, \
        bands: [{capacity: 1, window: 1h}]}]}]";
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let app = axum::Router::new()
        .route(
            "/api/{version}/login",
            axum::routing::get(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                async { "login" }
            }),
        )
        .layer(layer(super::engine(rules)).build().unwrap());
    let addr = serve(app).await;
    assert_eq!(
        status_of(addr, "GET http://example.com/api/v1/login HTTP/1.1").await,
        200
    );
    // Every form of the target is the same client's second request of the rule.
    for line in [
        "GET /api/v1/login HTTP/1.1",
        "GET http://example.com/api/v1/login HTTP/1.1",
        "GET https://other.example:8443/api/v2/login?x=1 HTTP/1.1",
        "GET http://example.com/api/../login HTTP/1.1",
        "GET http://example.com/api/%2e%2e/login HTTP/1.1",
        "HEAD http://example.com/api/v1/login HTTP/1.1",
    ] {
        assert_eq!(status_of(addr, line).await, 429, "{line} escaped the rule");
    }
    // The asterisk and authority forms have the path `*` and the empty path: no route
    // matches them, and the fallback (404 here) answers.
    for line in ["OPTIONS * HTTP/1.1", "GET * HTTP/1.1", "GET example.com:80 HTTP/1.1"] {
        assert_eq!(status_of(addr, line).await, 404, "{line}");
    }
    // Lower-case `get` is another method (tokens are case-sensitive): axum answers 405.
    assert_eq!(status_of(addr, "get /api/v1/login HTTP/1.1").await, 405);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The asterisk and authority forms reach the fallback, as an unknown top-level path does:
/// an exclusion of `/` (whose normalized form they share) does not let them through it.
#[tokio::test]
async fn an_excluded_root_lets_no_other_request_target_through() {
    let rules = "rule_sets: [{id: default, rules: [{id: all, bands: [{capacity: 1, window: 1h}]}]}]";
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "home" }))
        .fallback(move || {
            counted.fetch_add(1, Ordering::SeqCst);
            async { "fallback" }
        })
        .layer(layer(super::engine(rules)).exclude(["/"]).build().unwrap());
    let addr = serve(app).await;
    assert_eq!(status_of(addr, "GET /unknown HTTP/1.1").await, 200);
    for line in [
        "GET /unknown HTTP/1.1",
        "GET example.com:80 HTTP/1.1",
        "GET * HTTP/1.1",
        "OPTIONS * HTTP/1.1",
    ] {
        assert_eq!(
            status_of(addr, line).await,
            429,
            "{line} reached the fallback uncounted"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // The excluded root itself stays unlimited.
    for _ in 0..3 {
        assert_eq!(status_of(addr, "GET / HTTP/1.1").await, 200);
        assert_eq!(status_of(addr, "GET http://example.com HTTP/1.1").await, 200);
    }
}

/// An HTTP/2 request of `method` whose `:path` is `*`, the one path without a leading `/`
/// that `http` accepts.
#[allow(clippy::unwrap_used)]
fn h2_asterisk(addr: SocketAddr, method: http::Method) -> http::Request<http_body_util::Empty<bytes::Bytes>> {
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(http::uri::Scheme::HTTP);
    parts.authority = Some(addr.to_string().parse().unwrap());
    parts.path_and_query = Some(http::uri::PathAndQuery::from_static("*"));
    http::Request::builder()
        .method(method)
        .uri(http::Uri::from_parts(parts).unwrap())
        .body(http_body_util::Empty::new())
        .unwrap()
}

/// Behind a middleware that appends a trailing `/` (tower-http's `NormalizePathLayer`), `*`
/// becomes `/*/` and runs a `/{page}/` route: the asterisk form, over HTTP/1.1 and HTTP/2,
/// is counted by that route's rule, with and without `include` naming it.
#[tokio::test]
#[allow(clippy::unwrap_used)]
async fn the_asterisk_form_is_counted_behind_a_middleware_that_appends_a_slash() {
    use tower_http::normalize_path::NormalizePathLayer;
    let rules = "rule_sets: [{id: default, rules: [{id: page, match: {paths: [\"/*/\"]}, \
        bands: [{capacity: 1, window: 1h}]}]}]";
    for include in [false, true] {
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = runs.clone();
        let mut builder = layer(super::engine(rules));
        if include {
            builder = builder.include(["/*/"]);
        }
        let router = axum::Router::new().route(
            "/{page}/",
            axum::routing::any(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                async { "page" }
            }),
        );
        let service = tower::ServiceBuilder::new()
            .layer(builder.build().unwrap())
            .layer(NormalizePathLayer::append_trailing_slash())
            .service(router);
        let addr = serve(axum::Router::new().fallback_service(service)).await;
        let mut h2 = crate::protocol::h2(addr).await;
        let mut statuses = Vec::new();
        for method in [http::Method::GET, http::Method::OPTIONS] {
            h2.ready().await.unwrap();
            statuses.push(
                h2.send_request(h2_asterisk(addr, method))
                    .await
                    .unwrap()
                    .status()
                    .as_u16(),
            );
        }
        for line in ["GET * HTTP/1.1", "OPTIONS * HTTP/1.1"] {
            statuses.push(status_of(addr, line).await);
        }
        assert_eq!(statuses, [200, 429, 429, 429], "include: {include}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "include: {include}");
    }
}
