//! Decisions per second and latency against one local `redis-server`, next to the ceiling
//! (`redis-benchmark` running `EVALSHA` of the same script) and the peer crate
//! `tower-rate-limit-fred`.
//!
//! Run with: `cargo bench --bench redis` (needs `redis-server` and `redis-benchmark`,
//! Debian's `redis-server` and `redis-tools`; `BENCH_SECS` sets the seconds per
//! measurement, default 5).
//!
//! One process, 64 requests in flight, keys drawn from 100,000 distinct clients, every
//! request admitted (quotas far above the rate). Measured, each on a fresh server:
//! - `fluxgate engine 1x1` / `3x2`: `Engine::check` with `RedisLimiter` (pool of 8);
//! - `fluxgate layer 1x1`: the same through `RateLimitLayer` around a trivial service;
//! - `tower-rate-limit-fred layer`: the peer's layer (single-band GCRA, 65,535 per
//!   65.5 s, its largest capacity) around the same;
//! - `redis-benchmark EVALSHA 1x1` / `3x2`: the script alone, 64 clients (the ceiling).
//!
//! - `fluxgate <algorithm> 1x1`: the engine with one rule of each algorithm (1,000,000
//!   per hour), to compare the algorithms' scripts.
//!
//! The `EVALSHA` calls counted by `INFO commandstats` are printed next to the decisions,
//! with the microseconds Redis spent per call. `cargo bench --bench redis -- algorithms`
//! runs only the comparison of the algorithms.

#![allow(missing_docs, clippy::unwrap_used)]

/// The test support's `redis-server` processes; the benchmark starts standalone servers only.
#[path = "../tests/support/servers.rs"]
#[allow(dead_code)]
mod servers;

use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fluxgate::redis::RedisLimiter;
use fluxgate::tower::{ClientIp, RateLimitLayer};
use fluxgate::{Engine, RequestContext, RuleSets};
use fred::interfaces::ClientLike as _;
use http::{Request, Response};
use servers::RedisServer;
use tower::{service_fn, Layer, ServiceExt};

const IN_FLIGHT: usize = 64;
const KEYS: u64 = 100_000;

const ONE_BY_ONE: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 10000000, window: 1h }]
"#;

const THREE_BY_TWO: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 10000000, window: 1h, label: hour }, { capacity: 10000000, window: 1m, label: minute }]
      - id: per-user
        scope: user
        bands: [{ capacity: 10000000, window: 1h, label: hour }, { capacity: 10000000, window: 1m, label: minute }]
      - id: global
        scope: global
        bands: [{ capacity: 10000000, window: 1h, label: hour }, { capacity: 10000000, window: 1m, label: minute }]
"#;

/// One rule of `algorithm`, 1,000,000 per hour (within every algorithm's exact range).
fn one_rule_of(algorithm: &str) -> &'static str {
    let yaml = format!(
        "rule_sets:\n  - id: default\n    rules:\n      - id: per-ip\n        algorithm: {algorithm}\n        \
         bands: [{{ capacity: 1000000, window: 1h }}]\n"
    );
    Box::leak(yaml.into_boxed_str())
}

fn secs() -> Duration {
    Duration::from_secs(
        std::env::var("BENCH_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(5),
    )
}

fn ip(n: u64) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + (n % KEYS) as u32))
}

struct Report {
    name: String,
    decisions: u64,
    elapsed: Duration,
    latencies: Vec<u32>,
    evalsha: Option<u64>,
    server_us: f64,
}

impl Report {
    fn print(&mut self) {
        self.latencies.sort_unstable();
        let pct = |p: f64| {
            let i = ((self.latencies.len() as f64 * p) as usize).min(self.latencies.len().saturating_sub(1));
            f64::from(self.latencies.get(i).copied().unwrap_or(0)) / 1000.0
        };
        let rate = self.decisions as f64 / self.elapsed.as_secs_f64();
        let calls = self.evalsha.map_or_else(String::new, |c| {
            format!(
                "  evalsha calls {c} for {} decisions, {:.2} µs each in Redis",
                self.decisions, self.server_us
            )
        });
        println!(
            "{:<34} {:>9.0} decisions/s  p50 {:>6.3} ms  p99 {:>6.3} ms{calls}",
            self.name,
            rate,
            pct(0.50),
            pct(0.99)
        );
    }
}

/// Runs `IN_FLIGHT` loops of `op(n)` for the measurement time.
async fn drive<F, Fut>(name: &str, op: F) -> Report
where
    F: Fn(u64) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let stop = Arc::new(AtomicBool::new(false));
    let counter = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..IN_FLIGHT {
        let (stop, counter, op) = (stop.clone(), counter.clone(), op.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(1 << 16);
            while !stop.load(Ordering::Relaxed) {
                let n = counter.fetch_add(1, Ordering::Relaxed).wrapping_mul(2_654_435_761);
                let t = Instant::now();
                op(n).await;
                latencies.push(u32::try_from(t.elapsed().as_micros()).unwrap_or(u32::MAX));
            }
            latencies
        }));
    }
    tokio::time::sleep(secs()).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap());
    }
    Report {
        name: name.to_owned(),
        decisions: latencies.len() as u64,
        elapsed: start.elapsed(),
        latencies,
        evalsha: None,
        server_us: 0.0,
    }
}

async fn engine(server: &RedisServer, yaml: &str) -> Engine {
    let limiter = RedisLimiter::builder(server.url())
        .pool_size(8)
        .connect()
        .await
        .unwrap();
    let rules = RuleSets::from_yaml_str(yaml).unwrap();
    Engine::builder(rules)
        .limiter(limiter)
        .build()
        .expect("the backend decides every rule")
}

async fn fluxgate_engine(name: &str, yaml: &'static str) -> Report {
    let server = RedisServer::start();
    let engine = engine(&server, yaml).await;
    let before = server.evalsha_calls();
    let mut report = drive(name, move |n| {
        let engine = engine.clone();
        async move {
            let ctx = RequestContext::builder()
                .client_ip(ip(n))
                .user_id(format!("u{}", n % KEYS))
                .build();
            let d = engine.check(&ctx).await.unwrap();
            assert!(d.allowed());
        }
    })
    .await;
    report.evalsha = Some(server.evalsha_calls() - before);
    report.server_us = server.evalsha_stat("usec_per_call");
    report
}

async fn fluxgate_layer() -> Report {
    let server = RedisServer::start();
    let engine = engine(&server, ONE_BY_ONE).await;
    let svc = RateLimitLayer::new(engine).layer(service_fn(|_req: Request<axum::body::Body>| async {
        Ok::<_, Infallible>(Response::new(axum::body::Body::empty()))
    }));
    let before = server.evalsha_calls();
    let mut report = drive("fluxgate layer 1x1", move |n| {
        let svc = svc.clone();
        async move {
            let mut req = Request::new(axum::body::Body::empty());
            req.extensions_mut().insert(ClientIp(ip(n)));
            let resp = svc.oneshot(req).await.unwrap();
            assert!(resp.status().is_success());
        }
    })
    .await;
    report.evalsha = Some(server.evalsha_calls() - before);
    report.server_us = server.evalsha_stat("usec_per_call");
    report
}

#[derive(Clone)]
struct PeerKey;

impl tower_rate_limit_fred::KeyResolver for PeerKey {
    type ErrorBody = axum::body::Body;

    fn key<T>(&self, req: &Request<T>) -> Result<Option<fred::types::Key>, Response<Self::ErrorBody>> {
        Ok(req
            .extensions()
            .get::<ClientIp>()
            .map(|ip| fred::types::Key::from(ip.0.to_string())))
    }
}

async fn peer_layer() -> Report {
    let server = RedisServer::start();
    let pool = fred::types::Builder::from_config(fred::types::config::Config::from_url(&server.url()).unwrap())
        .with_performance_config(|c| c.default_command_timeout = Duration::from_millis(300))
        .build_pool(8)
        .unwrap();
    pool.init().await.unwrap();
    let layer = tower_rate_limit_fred::RateLimitLayer::builder()
        .conn(pool)
        .key_resolver(PeerKey)
        .capacity(u16::MAX)
        .emission_interval(Duration::from_millis(1))
        .build();
    let svc = layer.layer(service_fn(|_req: Request<axum::body::Body>| async {
        Ok::<_, Infallible>(Response::new(axum::body::Body::empty()))
    }));
    let before = server.evalsha_calls();
    let mut report = drive("tower-rate-limit-fred layer", move |n| {
        let svc = svc.clone();
        async move {
            let mut req = Request::new(axum::body::Body::empty());
            req.extensions_mut().insert(ClientIp(ip(n)));
            let resp = svc.oneshot(req).await.unwrap();
            assert!(resp.status().is_success(), "{}", resp.status());
        }
    })
    .await;
    report.evalsha = Some(server.evalsha_calls() - before);
    report.server_us = server.evalsha_stat("usec_per_call");
    report
}

/// `redis-benchmark` running `EVALSHA` of the decision script on random keys.
fn ceiling(name: &str, bands: usize) {
    let server = RedisServer::start();
    let sha = server
        .cli(&["SCRIPT", "LOAD", fluxgate::redis::DECIDE_LUA])
        .trim()
        .to_owned();
    // The arguments the limiter sends for bands of 10,000,000 per hour: g = 10,000,000,
    // scale 1, interval 360 (see lua/token_bucket.lua and lua/decide.lua).
    let mut args: Vec<String> = vec!["EVALSHA".into(), sha, bands.to_string()];
    for b in 0..bands {
        args.push(format!(
            "fluxgate:{{default:rule{}:ip=__rand_int__}}:b{}:10000000/1h",
            b / 2,
            b % 2
        ));
    }
    let per_bucket = if bands == 1 { 1 } else { 2 };
    args.push((bands / per_bucket).to_string());
    for _ in 0..(bands / per_bucket) {
        args.extend(["1".into(), (per_bucket * 16).to_string()]);
        for _ in 0..per_bucket {
            args.extend(["10000000".into(), "1".into(), "360".into()]);
        }
    }
    let requests = (secs().as_secs() * 40_000).to_string();
    let out = Command::new("redis-benchmark")
        .args([
            "-p",
            server.url().rsplit(':').next().unwrap(),
            "-c",
            "64",
            "-n",
            &requests,
        ])
        .args(["-r", "100000", "-q", "--csv"])
        .args(&args)
        .output()
        .expect("redis-benchmark (Debian package redis-tools)");
    let text = String::from_utf8_lossy(&out.stdout);
    let stats = server.cli(&["INFO", "commandstats"]);
    assert!(
        !stats.contains("failed_calls=") || stats.contains("failed_calls=0"),
        "the script failed: {stats}"
    );
    let line = text.lines().last().unwrap_or_default();
    let fields: Vec<String> = line.split(',').map(|f| f.trim_matches('"').to_owned()).collect();
    // "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
    if fields.len() >= 7 {
        println!(
            "{:<34} {:>9.0} decisions/s  p50 {:>6.3} ms  p99 {:>6.3} ms",
            name,
            fields[1].parse::<f64>().unwrap_or(0.0),
            fields[4].parse::<f64>().unwrap_or(0.0),
            fields[6].parse::<f64>().unwrap_or(0.0)
        );
    } else {
        println!("{name}: unexpected redis-benchmark output: {text}");
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo test --benches` lists; nothing to list here.
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    println!("{IN_FLIGHT} in flight, {KEYS} keys, {:?} per measurement", secs());
    let only_algorithms = std::env::args().any(|a| a == "algorithms");
    if !only_algorithms {
        everything_but_the_algorithms(&rt);
    }
    for algorithm in fluxgate::Algorithm::ALL {
        let name = format!("fluxgate {} 1x1", algorithm.as_str());
        rt.block_on(fluxgate_engine(&name, one_rule_of(algorithm.as_str())))
            .print();
    }
}

fn everything_but_the_algorithms(rt: &tokio::runtime::Runtime) {
    ceiling("redis-benchmark EVALSHA 1x1", 1);
    rt.block_on(fluxgate_engine("fluxgate engine 1x1", ONE_BY_ONE)).print();
    rt.block_on(fluxgate_layer()).print();
    rt.block_on(peer_layer()).print();
    ceiling("redis-benchmark EVALSHA 3x2", 6);
    rt.block_on(fluxgate_engine("fluxgate engine 3x2", THREE_BY_TWO))
        .print();
}
