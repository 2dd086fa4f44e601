//! The HTTP protocol around the layer, through real sockets (`axum::serve`, HTTP/1.1 and
//! HTTP/2 cleartext): every request that reaches a handler is counted once, whatever the
//! connection carries it with, and the identity headers are read as the application reads
//! them over both versions.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::{any, delete, get};
use bytes::Bytes;
use fluxgate::core::{Decision, Engine, Error, MaybeReady, RateLimitHandler, RequestContext};
use fluxgate::tower::RateLimitLayer;
use http::{HeaderValue, Method, Request, StatusCode};
use http_body_util::Empty;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceBuilder;

use crate::serve;
use crate::support::app::{layer, request};

/// A handler counting its runs.
fn counting(runs: &Arc<AtomicUsize>) -> impl Fn() -> std::future::Ready<&'static str> + Clone + Send + Sync + 'static {
    let runs = runs.clone();
    move || {
        runs.fetch_add(1, Ordering::SeqCst);
        std::future::ready("ran")
    }
}

/// One rule on `path` (an Ant pattern), keyed by `scope`, with `capacity` per hour.
fn one_rule(path: &str, methods: &str, scope: &str, capacity: u32) -> Engine {
    let methods = if methods.is_empty() {
        String::new()
    } else {
        format!(", methods: [{methods}]")
    };
    super::engine(&format!(
        "rule_sets: [{{id: default, rules: [{{id: r, scope: {scope}, match: {{paths: [\"{path}\"]{methods}}}, \
         bands: [{{capacity: {capacity}, window: 1h}}]}}]}}]"
    ))
}

/// Writes `raw` on a new connection and returns the status codes of every answer read
/// until the server closes it.
#[allow(clippy::unwrap_used)]
async fn statuses(addr: SocketAddr, raw: &str) -> Vec<u16> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(raw.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    answer
        .match_indices("HTTP/1.1 ")
        .filter_map(|(i, _)| answer.get(i + 9..i + 12)?.parse().ok())
        .collect()
}

/// An HTTP/2 connection (prior knowledge) to `addr`.
#[allow(clippy::unwrap_used)]
pub(crate) async fn h2(addr: SocketAddr) -> SendRequest<Empty<Bytes>> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    send
}

/// An HTTP/2 request to `path` of `addr`.
#[allow(clippy::unwrap_used)]
fn h2_request(addr: SocketAddr, method: Method, path: &str) -> Request<Empty<Bytes>> {
    Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .body(Empty::new())
        .unwrap()
}

#[tokio::test]
async fn pipelined_requests_are_each_counted_once() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = axum::Router::new()
        .route("/api/{version}/login", get(counting(&runs)))
        .layer(layer(one_rule("/api/*/login", "GET", "ip", 3)).build().unwrap());
    let addr = serve(app).await;
    // Ten requests in one write, GET and HEAD, keep-alive; the last closes.
    let mut raw = String::new();
    for i in 0..10 {
        let method = if i % 3 == 1 { "HEAD" } else { "GET" };
        let close = if i == 9 { "Connection: close\r\n" } else { "" };
        raw.push_str(&format!("{method} /api/v{i}/login HTTP/1.1\r\nHost: x\r\n{close}\r\n"));
    }
    let got = statuses(addr, &raw).await;
    assert_eq!(got.len(), 10, "{got:?}");
    assert_eq!(got.iter().filter(|&&s| s == 200).count(), 3, "{got:?}");
    assert_eq!(got.iter().filter(|&&s| s == 429).count(), 7, "{got:?}");
    // HEAD runs the GET handler: the three admitted requests ran it, no other did.
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn http2_streams_on_one_connection_are_each_counted_once() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = axum::Router::new()
        .route("/api/{version}/login", get(counting(&runs)))
        .layer(layer(one_rule("/api/*/login", "GET", "ip", 5)).build().unwrap());
    let addr = serve(app).await;
    let send = h2(addr).await;
    let mut tasks = Vec::new();
    for i in 0..60 {
        let mut send = send.clone();
        let method = if i % 2 == 0 { Method::GET } else { Method::HEAD };
        let path = ["/api/v1/login", "/api/../login", "/api//login", "/api/%2e/login"][i % 4];
        let req = h2_request(addr, method, path);
        tasks.push(tokio::spawn(async move {
            send.ready().await.unwrap();
            send.send_request(req).await.unwrap().status()
        }));
    }
    let mut ok = 0;
    let mut refused = 0;
    for task in tasks {
        match task.await.unwrap() {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!((ok, refused), (5, 55));
    assert_eq!(runs.load(Ordering::SeqCst), 5);
}

/// A WebSocket handshake over HTTP/2 is an extended `CONNECT` (RFC 8441), which
/// `axum::serve` accepts: a `GET` rule on the `any` route counts it.
#[tokio::test]
async fn an_extended_connect_over_http2_is_counted_by_the_get_rule() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = axum::Router::new()
        .route("/ws", any(counting(&runs)))
        .layer(layer(one_rule("/ws", "GET", "ip", 2)).build().unwrap());
    let addr = serve(app).await;
    let mut send = h2(addr).await;
    // The first answer brings the server's SETTINGS (with ENABLE_CONNECT_PROTOCOL).
    let r = send.send_request(h2_request(addr, Method::GET, "/ws")).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let connect = || {
        let mut req = h2_request(addr, Method::CONNECT, "/ws");
        req.headers_mut()
            .insert("sec-websocket-version", HeaderValue::from_static("13"));
        req.extensions_mut()
            .insert(hyper::ext::Protocol::from_static("websocket"));
        req
    };
    let r = send.send_request(connect()).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = send.send_request(connect()).await.unwrap();
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A handler that decides after a delay, as a remote backend does, counting the decisions
/// it made.
#[derive(Debug)]
struct Slow {
    engine: Engine,
    decided: Arc<AtomicUsize>,
}

impl RateLimitHandler for Slow {
    fn check(&self, ctx: &RequestContext) -> MaybeReady<Result<Decision, Error>> {
        let (engine, ctx, decided) = (self.engine.clone(), ctx.clone(), self.decided.clone());
        MaybeReady::boxed(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            decided.fetch_add(1, Ordering::SeqCst);
            engine.check(&ctx).await
        })
    }
}

/// A request abandoned while its decision is out (an HTTP/2 `RST_STREAM`, a closed
/// HTTP/1.1 connection) never reaches the handler: the inner service is called only with a
/// decision in hand.
#[tokio::test]
async fn a_request_abandoned_during_its_decision_never_runs_the_handler() {
    let runs = Arc::new(AtomicUsize::new(0));
    let decided = Arc::new(AtomicUsize::new(0));
    let slow = Slow {
        engine: one_rule("/api/*/login", "GET", "ip", 1),
        decided: decided.clone(),
    };
    let app = axum::Router::new()
        .route("/api/{version}/login", get(counting(&runs)))
        .layer(RateLimitLayer::builder(slow).build().unwrap());
    let addr = serve(app).await;
    // HTTP/2: the response future dropped after 50 ms resets the stream.
    let mut send = h2(addr).await;
    for _ in 0..5 {
        let pending = send.send_request(h2_request(addr, Method::GET, "/api/v1/login"));
        assert!(tokio::time::timeout(Duration::from_millis(50), pending).await.is_err());
    }
    // HTTP/1.1: the connection closed after 50 ms.
    for _ in 0..5 {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET /api/v1/login HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(stream);
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 0, "a handler ran for an abandoned request");
    assert_eq!(decided.load(Ordering::SeqCst), 0, "an abandoned decision went on");
    // The limit is intact: one admitted, the next refused.
    let r = send
        .send_request(h2_request(addr, Method::GET, "/api/v1/login"))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = send
        .send_request(h2_request(addr, Method::GET, "/api/v1/login"))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// `Expect: 100-continue` and `Upgrade` (WebSocket, h2c) requests are requests like the
/// others: counted once, and a refused one never gets the body read or the upgrade.
#[tokio::test]
async fn expect_continue_and_upgrade_requests_are_counted() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = axum::Router::new()
        .route("/api/{version}/login", any(counting(&runs)))
        .layer(layer(one_rule("/api/*/login", "", "ip", 2)).build().unwrap());
    let addr = serve(app).await;
    let heads = [
        "POST /api/v1/login HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n",
        "GET /api/v1/login HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        "GET /api/v1/login HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n\
         HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
    ];
    let mut got = Vec::new();
    for _ in 0..2 {
        for head in heads {
            let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            stream.write_all(head.as_bytes()).await.unwrap();
            let mut buf = [0u8; 512];
            let n = stream.read(&mut buf).await.unwrap();
            let answer = String::from_utf8_lossy(&buf[..n]).into_owned();
            let status: u16 = answer.get(9..12).and_then(|s| s.parse().ok()).unwrap();
            if status == 100 {
                stream.write_all(b"hello").await.unwrap();
                let n = stream.read(&mut buf).await.unwrap();
                let answer = String::from_utf8_lossy(&buf[..n]).into_owned();
                got.push(answer.get(9..12).and_then(|s| s.parse().ok()).unwrap());
            } else {
                got.push(status);
            }
        }
    }
    assert_eq!(got, [200, 200, 429, 429, 429, 429]);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// An `any` route runs its handler for every method token, extension methods and
/// lower-case spellings included (`post` is not `POST`: tokens are case-sensitive). A rule
/// naming methods counts only those, so on such a route it leaves every other token
/// uncounted: leave `methods` out of a rule for an `any` route (or a method router's
/// fallback).
#[tokio::test]
async fn a_method_rule_on_an_any_route_counts_only_its_methods() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = axum::Router::new()
        .route("/webhook", any(counting(&runs)))
        .layer(layer(one_rule("/webhook", "POST", "ip", 1)).build().unwrap());
    let addr = serve(app).await;
    let mut got = Vec::new();
    for method in ["POST", "POST", "post", "Post", "FOO", "PUT", "post"] {
        let raw = format!("{method} /webhook HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        got.extend(statuses(addr, &raw).await);
    }
    assert_eq!(got, [200, 429, 200, 200, 200, 200, 200]);
    // One POST counted, five other tokens ran the handler uncounted.
    assert_eq!(runs.load(Ordering::SeqCst), 6);
    // Without `methods`, the rule counts every one of them.
    let runs = Arc::new(AtomicUsize::new(0));
    let app = axum::Router::new()
        .route("/webhook", any(counting(&runs)))
        .layer(layer(one_rule("/webhook", "", "ip", 1)).build().unwrap());
    let addr = serve(app).await;
    let mut got = Vec::new();
    for method in ["POST", "post", "FOO"] {
        let raw = format!("{method} /webhook HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        got.extend(statuses(addr, &raw).await);
    }
    assert_eq!(got, [200, 429, 429]);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A method override (`X-HTTP-Method-Override`, `_method`) between the layer and the
/// router makes the router route a method the layer never saw; before the layer (or with
/// the layer applied by `Router::layer`, after routing), the rules see the method routed.
#[tokio::test]
async fn a_method_override_behind_the_layer_walks_around_a_method_rule() {
    fn method_override<B>(mut req: Request<B>) -> Request<B> {
        if req.method() == Method::POST {
            let named = req
                .headers()
                .get("x-http-method-override")
                .and_then(|v| Method::from_bytes(v.as_bytes()).ok());
            if let Some(method) = named {
                *req.method_mut() = method;
            }
        }
        req
    }
    let engine = || one_rule("/items/*", "DELETE", "ip", 1);
    let router = |runs: &Arc<AtomicUsize>| axum::Router::new().route("/items/{id}", delete(counting(runs)));
    let overriding = |i: usize| {
        request(
            "POST",
            &format!("/items/{i}"),
            "192.0.2.90",
            &[("x-http-method-override", "DELETE")],
        )
    };

    // The override behind the layer: the layer sees POST, the router routes DELETE.
    let runs = Arc::new(AtomicUsize::new(0));
    let svc = ServiceBuilder::new()
        .layer(layer(engine()).build().unwrap())
        .map_request(method_override)
        .service(router(&runs));
    for i in 0..5 {
        use tower::ServiceExt;
        let r = svc.clone().oneshot(overriding(i)).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 5, "every overridden DELETE ran uncounted");

    // The override before the layer: counted as DELETE.
    let runs = Arc::new(AtomicUsize::new(0));
    let svc = ServiceBuilder::new()
        .map_request(method_override)
        .layer(layer(engine()).build().unwrap())
        .service(router(&runs));
    let mut statuses = Vec::new();
    for i in 0..5 {
        use tower::ServiceExt;
        statuses.push(svc.clone().oneshot(overriding(i)).await.unwrap().status().as_u16());
    }
    assert_eq!(statuses, [200, 429, 429, 429, 429]);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // The layer applied with `Router::layer` (after routing) and the override around the
    // router: counted as DELETE.
    let runs = Arc::new(AtomicUsize::new(0));
    let app = ServiceBuilder::new()
        .map_request(method_override)
        .service(router(&runs).layer(layer(engine()).build().unwrap()));
    let mut statuses = Vec::new();
    for i in 0..5 {
        use tower::ServiceExt;
        statuses.push(app.clone().oneshot(overriding(i)).await.unwrap().status().as_u16());
    }
    assert_eq!(statuses, [200, 429, 429, 429, 429]);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The API key as an application checks it: trimmed, as an HTTP/1.1 parser hands it over
/// (and as SQL compares it under a `PAD SPACE` collation). Counts the runs it accepted.
fn checking_key(runs: &Arc<AtomicUsize>) -> axum::routing::MethodRouter {
    let runs = runs.clone();
    get(move |headers: http::HeaderMap| {
        let valid = headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|key| key.trim() == "k1");
        if valid {
            runs.fetch_add(1, Ordering::SeqCst);
        }
        std::future::ready(if valid {
            StatusCode::OK
        } else {
            StatusCode::UNAUTHORIZED
        })
    })
}

/// Whitespace around a header value is not part of it (RFC 9110 5.5): an HTTP/1.1 parser
/// drops it, and HTTP/2 forbids it (RFC 9113 8.2.1), though hyper's HTTP/2 server passes it
/// on. Read with it, one API key would name a new counter with each spelling over HTTP/2.
#[tokio::test]
async fn whitespace_around_an_identity_header_names_no_new_counter() {
    let spellings = ["k1", "k1 ", " k1", "\tk1", "k1\t", " k1 ", "k1  ", "\t k1\t "];
    // HTTP/1.1.
    let runs = Arc::new(AtomicUsize::new(0));
    let app = axum::Router::new()
        .route("/api/data", checking_key(&runs))
        .layer(layer(one_rule("/api/**", "", "api_key", 1)).build().unwrap());
    let addr = serve(app).await;
    let mut got = Vec::new();
    for key in spellings {
        let raw = format!("GET /api/data HTTP/1.1\r\nHost: x\r\nX-API-Key: {key}\r\nConnection: close\r\n\r\n");
        got.extend(statuses(addr, &raw).await);
    }
    assert_eq!(got, [200, 429, 429, 429, 429, 429, 429, 429], "HTTP/1.1");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // HTTP/2.
    let runs = Arc::new(AtomicUsize::new(0));
    let app = axum::Router::new()
        .route("/api/data", checking_key(&runs))
        .layer(layer(one_rule("/api/**", "", "api_key", 1)).build().unwrap());
    let addr = serve(app).await;
    let mut send = h2(addr).await;
    let mut got = Vec::new();
    for key in spellings {
        let mut req = h2_request(addr, Method::GET, "/api/data");
        req.headers_mut()
            .insert("x-api-key", HeaderValue::from_str(key).unwrap());
        got.push(send.send_request(req).await.unwrap().status().as_u16());
    }
    assert_eq!(got, [200, 429, 429, 429, 429, 429, 429, 429], "HTTP/2");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // Sent twice, the same key with and without spaces is the one key.
    let mut req = h2_request(addr, Method::GET, "/api/data");
    req.headers_mut().append("x-api-key", HeaderValue::from_static("k2"));
    req.headers_mut().append("x-api-key", HeaderValue::from_static(" k2 "));
    assert_eq!(send.send_request(req).await.unwrap().status(), StatusCode::UNAUTHORIZED);
    let mut req = h2_request(addr, Method::GET, "/api/data");
    req.headers_mut().insert("x-api-key", HeaderValue::from_static("k2"));
    assert_eq!(
        send.send_request(req).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}
