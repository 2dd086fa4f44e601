//! Two instances of one app sharing one limit through Redis.
//!
//! Run with: `cargo run --example redis -- --redis redis://127.0.0.1:6379` (add `--demo` to
//! send requests to both instances in turn, print what each answers, and exit; add
//! `--batched` for batched decisions, `Batching`, which decide alike).
//!
//! Both instances run in this process on their own ports, each with its own connections
//! to Redis, exactly as two replicas behind a load balancer would: the 5-per-minute limit
//! holds across them.

use std::net::SocketAddr;

use axum::routing::get;
use axum::Router;
use fluxgate::redis::{Batching, RedisLimiter};
use fluxgate::{Engine, RateLimitLayer, RuleSets};

const RULES: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 5, window: 1m }]
"#;

async fn instance(name: &'static str, redis: &str, batched: bool) -> SocketAddr {
    let limiter = RedisLimiter::builder(redis)
        .prefix("fluxgate-example")
        .batching(batched.then(Batching::new))
        .connect()
        .await
        .unwrap_or_else(|e| {
            eprintln!("error: {e} (start one with `redis-server`)");
            std::process::exit(1);
        });
    let rules = RuleSets::from_yaml_str(RULES).expect("valid rules");
    let engine = Engine::builder(rules)
        .limiter(limiter)
        .build()
        .expect("the example's rules fit Redis");
    let app = Router::new()
        .route("/", get(move || async move { format!("hello from {name}\n") }))
        .layer(RateLimitLayer::new(engine));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("listen");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
            .await
            .expect("server");
    });
    addr
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let redis = args
        .iter()
        .position(|a| a == "--redis")
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| "redis://127.0.0.1:6379".to_owned());
    let batched = args.iter().any(|a| a == "--batched");
    let a = instance("instance A", &redis, batched).await;
    let b = instance("instance B", &redis, batched).await;
    if !args.iter().any(|a| a == "--demo") {
        println!("instance A on http://{a}, instance B on http://{b}, sharing 5 per minute per IP through {redis}");
        println!("  for u in http://{a}/ http://{b}/ http://{a}/ http://{b}/ http://{a}/ http://{b}/; do curl -s -o /dev/null -w '%{{http_code}}\\n' $u; done");
        std::future::pending::<()>().await;
    }
    demo(a, b).await;
}

async fn demo(a: SocketAddr, b: SocketAddr) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for i in 0..8 {
        let (name, addr) = if i % 2 == 0 { ("A", a) } else { ("B", b) };
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let request = format!("GET / HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.expect("send");
        let mut response = String::new();
        stream.read_to_string(&mut response).await.expect("read");
        let status = response
            .lines()
            .next()
            .unwrap_or("")
            .trim_start_matches("HTTP/1.1 ")
            .to_owned();
        let remaining = response
            .lines()
            .find_map(|l| l.strip_prefix("x-ratelimit-remaining: "))
            .unwrap_or("-")
            .to_owned();
        println!(
            "request {} to instance {name}: {status:<22} remaining={remaining}",
            i + 1
        );
    }
}
