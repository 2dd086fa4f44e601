//! FluxGate around a plain hyper/tower service, without axum.
//!
//! Run with: `cargo run --example tower` (add `--demo` to send a few requests and exit).

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use fluxgate::tower::ClientIp;
use fluxgate::{Engine, RateLimitLayer, RuleSets};
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tower::{service_fn, ServiceBuilder, ServiceExt};

const RULES: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 3, window: 30s }]
"#;

async fn hello<B>(_req: Request<B>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from_static(b"hello from tower\n"))))
}

#[tokio::main]
async fn main() {
    let rules = RuleSets::from_yaml_str(RULES).expect("valid rules");
    let limiter = RateLimitLayer::new(Engine::in_memory(rules));

    if std::env::args().any(|a| a == "--demo") {
        let svc = ServiceBuilder::new()
            .layer(limiter)
            .service(service_fn(hello::<Full<Bytes>>));
        for i in 1..=5 {
            let mut req = Request::new(Full::new(Bytes::new()));
            req.extensions_mut()
                .insert(ClientIp("192.0.2.9".parse().expect("address")));
            let resp = svc.clone().oneshot(req).await.expect("infallible");
            println!(
                "request {i}: {} remaining={:?}",
                resp.status(),
                resp.headers().get("x-ratelimit-remaining")
            );
        }
        return;
    }

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000")
        .await
        .expect("listen on 127.0.0.1:3000");
    println!("listening on http://127.0.0.1:3000 — try: curl -i http://127.0.0.1:3000/");
    loop {
        let (stream, peer): (_, SocketAddr) = listener.accept().await.expect("accept");
        // Tell the limiter who the peer is, then rate-limit the plain service.
        let svc = ServiceBuilder::new()
            .map_request(move |mut req: Request<Incoming>| {
                req.extensions_mut().insert(ClientIp(peer.ip()));
                req
            })
            .layer(limiter.clone())
            .service(service_fn(hello::<Incoming>));
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(svc));
            if let Err(e) = conn.await {
                eprintln!("connection error: {e}");
            }
        });
    }
}
