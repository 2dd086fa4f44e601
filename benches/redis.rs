//! Decisions per second and latency against one local `redis-server`, next to the ceiling
//! (`redis-benchmark` running `EVALSHA` of the same script) and the peer crate
//! `tower-rate-limit-fred`.
//!
//! Run with: `cargo bench --bench redis` (needs `redis-server` and `redis-benchmark`,
//! Debian's `redis-server` and `redis-tools`; `BENCH_SECS` sets the seconds per
//! measurement, default 5, `BENCH_POOL` the connections of FluxGate's limiter, default the
//! limiter's own (3), `BENCH_PEER_POOL` those of the peer's pool, default 8, its fastest,
//! `BENCH_WORKERS` the runtime's worker threads, default one per core, and
//! `BENCH_EVENT_INTERVAL` the scheduler ticks between the runtime's polls of its I/O
//! driver, default tokio's 61).
//!
//! One process, 64 requests in flight, keys drawn from 100,000 distinct clients, every
//! request admitted (quotas far above the rate). Measured, each on a fresh server:
//! - `fluxgate engine 1x1` / `3x2`: `Engine::check` with `RedisLimiter` (its default pool);
//! - `fluxgate layer 1x1`: the same through `RateLimitLayer` around a trivial service;
//! - `tower-rate-limit-fred layer`: the peer's layer (single-band GCRA, 65,535 per
//!   65.5 s, its largest capacity) around the same;
//! - `redis-benchmark EVALSHA 1x1` / `3x2`: the script the engine runs for that shape
//!   (`ONE_TOKEN_BUCKET_LUA`, `TOKEN_BUCKETS_LUA`) alone, 64 clients (the ceiling).
//!
//! - `fluxgate <algorithm> 1x1`: the engine with one rule of each algorithm (1,000,000
//!   per hour), to compare the algorithms' scripts.
//! - the cost of bands and rules: the engine with one token-bucket rule of 1, 2, 4 and 8
//!   bands, then 1, 3 and 6 rules of 2 bands each, printed as a table.
//!
//! The `EVALSHA` calls counted by `INFO commandstats` are printed next to the decisions,
//! with the microseconds Redis spent per call, the CPU time of this process (client,
//! engine and runtime; through `/proc/self/stat`) and of the whole `redis-server` process
//! (its commands, event loop and expiry of keys) per decision, and both processes'
//! reading and writing system calls per decision (`/proc/<pid>/io`).
//! `cargo bench --bench redis -- algorithms` runs only the comparison of the algorithms,
//! `-- bands` only the table of bands and rules, `-- peer` only FluxGate's engine and layer
//! 1x1, the peer's layer and the engine 3x2, twice each in turn; `-- 1x1`, `-- 3x2`,
//! `-- layer` or `-- peer-layer` only that one measurement, once (to profile it).
//! `-- batched` runs batched decisions (`Batching`'s defaults) next to the peer and to one
//! call per request, twice in turn; `-- batched-1x1` and `-- batched-3x2` one measurement.
//! With batches, a call decides several requests: the line gives the calls and Redis's
//! time per call, and the decisions per call. `BENCH_BATCH_CALLS` sets the batch calls in
//! flight (`Batching::max_calls`, default 2). `-- leased` runs a global rule with leases of
//! 100 and of 1,000 (`lease: { max: 100, ttl: 1s }`) next to the same rule without a lease
//! and to the peer, twice in turn: with leases, most decisions make no call.
//! `-- acquisition` runs both, and one call per request, side by side in one command.
//! `-- fred-pool` runs the peer's script alone (`tower_rate_limit_fred::rate_limit`), sent
//! on the pool's next client and then through fred's `Pool` as the peer's layer sends it,
//! twice in turn: how the connections a pool's commands take change Redis's reads.

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

use fluxgate::core::KeyField;
use fluxgate::redis::{Batching, RedisLimiter};
use fluxgate::tower::{ClientIp, RateLimitLayer};
use fluxgate::{Engine, RequestContext, RuleSets, Scope};
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

/// One global rule, 10^12 per hour (every request admitted), with leases of `lease`
/// permits (none for 0).
fn global(lease: u64) -> &'static str {
    let mut yaml = "rule_sets:\n  - id: default\n    rules:\n      - id: global\n        scope: global\n        \
                    bands: [{ capacity: 1000000000000, window: 1h }]\n"
        .to_owned();
    if lease > 0 {
        yaml.push_str(&format!("        lease: {{ max: {lease}, ttl: 1s }}\n"));
    }
    Box::leak(yaml.into_boxed_str())
}

/// One rule of `algorithm`, 1,000,000 per hour (within every algorithm's range on Redis
/// but the log's: 60,000 per hour for it).
fn one_rule_of(algorithm: &str) -> &'static str {
    let capacity = if algorithm == "sliding_window_log" {
        60_000
    } else {
        1_000_000
    };
    let yaml = format!(
        "rule_sets:\n  - id: default\n    rules:\n      - id: per-ip\n        algorithm: {algorithm}\n        \
         bands: [{{ capacity: {capacity}, window: 1h }}]\n"
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

/// The connections of FluxGate's limiter: `BENCH_POOL`, or the limiter's default
/// ([`fluxgate::redis::RedisLimiterBuilder::pool_size`]) when unset.
fn pool_size() -> Option<usize> {
    std::env::var("BENCH_POOL").ok().and_then(|s| s.parse().ok())
}

/// The connections of the peer's pool: `BENCH_PEER_POOL`, default 8, its fastest on this
/// benchmark (see `docs/benchmarks.md`, "Connections").
fn peer_pool_size() -> usize {
    std::env::var("BENCH_PEER_POOL")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8)
}

/// The batching of the batched measurements: `Batching`'s defaults, or `BENCH_BATCH_CALLS`
/// calls in flight at most.
fn batching() -> Option<Batching> {
    let batching = Batching::new();
    Some(
        match std::env::var("BENCH_BATCH_CALLS").ok().and_then(|v| v.parse().ok()) {
            Some(calls) => batching.max_calls(calls),
            None => batching,
        },
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
    /// CPU time of this process per decision, in µs.
    client_us: f64,
    /// This process's reading and writing system calls per decision.
    client_syscalls: (f64, f64),
    /// CPU time of `redis-server` per decision, in µs: its commands, and what it does
    /// besides (expiring keys, its event loop).
    server_cpu_us: Option<f64>,
    /// `redis-server`'s reading and writing system calls per decision.
    server_syscalls: Option<(f64, f64)>,
}

/// The CPU time (user and system) of this process so far, in seconds.
fn process_cpu() -> f64 {
    cpu_of("/proc/self/stat")
}

/// The CPU time (user and system) of `server` so far, in seconds.
fn server_cpu(server: &RedisServer) -> f64 {
    cpu_of(&format!("/proc/{}/stat", server.pid()))
}

/// The CPU time of the process whose `stat` file is `path`, in seconds.
fn cpu_of(path: &str) -> f64 {
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    // The fields after the command name (which may hold spaces) in parentheses.
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or_default().split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime, fields 14 and 15 of proc(5), in clock ticks of 1/100 s.
    (ticks(11) + ticks(12)) / 100.0
}

/// The reading and writing system calls of `server` so far.
fn server_syscalls(server: &RedisServer) -> (u64, u64) {
    syscalls_of(&format!("/proc/{}/io", server.pid()))
}

/// The reading and writing system calls so far (`syscr`, `syscw`) of the process whose
/// `io` file is `path`.
fn syscalls_of(path: &str) -> (u64, u64) {
    let io = std::fs::read_to_string(path).unwrap_or_default();
    let field = |name: &str| {
        io.lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    };
    (field("syscr:"), field("syscw:"))
}

/// What a measurement on `server` starts from: its `EVALSHA` calls, its CPU time and its
/// system calls.
type Before = (u64, f64, (u64, u64));

fn server_before(server: &RedisServer) -> Before {
    (server.evalsha_calls(), server_cpu(server), server_syscalls(server))
}

impl Report {
    /// Adds `server`'s figures since `before` ([`server_before`]).
    fn of_server(mut self, server: &RedisServer, before: Before) -> Self {
        let decisions = self.decisions.max(1) as f64;
        self.evalsha = Some(server.evalsha_calls() - before.0);
        self.server_us = server.evalsha_stat("usec_per_call");
        self.server_cpu_us = Some((server_cpu(server) - before.1) * 1e6 / decisions);
        let (reads, writes) = server_syscalls(server);
        self.server_syscalls = Some((
            (reads - before.2 .0) as f64 / decisions,
            (writes - before.2 .1) as f64 / decisions,
        ));
        self
    }

    fn print(&mut self) {
        self.latencies.sort_unstable();
        let pct = |p: f64| {
            let i = ((self.latencies.len() as f64 * p) as usize).min(self.latencies.len().saturating_sub(1));
            f64::from(self.latencies.get(i).copied().unwrap_or(0)) / 1000.0
        };
        let rate = self.decisions as f64 / self.elapsed.as_secs_f64();
        let calls = self.evalsha.map_or_else(String::new, |c| {
            format!(
                "  evalsha calls {c} for {} decisions ({:.1} per call), {:.2} µs each in Redis",
                self.decisions,
                self.decisions as f64 / c.max(1) as f64,
                self.server_us
            )
        });
        let server_cpu = self
            .server_cpu_us
            .map_or_else(String::new, |us| format!(", Redis CPU {us:.2} µs/decision"));
        let server_syscalls = self.server_syscalls.map_or_else(String::new, |(reads, writes)| {
            format!(" ({reads:.2} reads, {writes:.2} writes)")
        });
        println!(
            "{:<34} {:>9.0} decisions/s  p50 {:>6.3} ms  p99 {:>6.3} ms  client CPU {:>5.2} µs/decision ({:.2} reads, {:.2} writes){calls}{server_cpu}{server_syscalls}",
            self.name,
            rate,
            pct(0.50),
            pct(0.99),
            self.client_us,
            self.client_syscalls.0,
            self.client_syscalls.1,
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
    let cpu = process_cpu();
    let syscalls = syscalls_of("/proc/self/io");
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
    let decisions = latencies.len() as u64;
    Report {
        name: name.to_owned(),
        decisions,
        elapsed: start.elapsed(),
        latencies,
        evalsha: None,
        server_us: 0.0,
        server_cpu_us: None,
        server_syscalls: None,
        client_us: (process_cpu() - cpu) * 1e6 / decisions.max(1) as f64,
        client_syscalls: {
            let (reads, writes) = syscalls_of("/proc/self/io");
            let per = |n: u64| n as f64 / decisions.max(1) as f64;
            (per(reads - syscalls.0), per(writes - syscalls.1))
        },
    }
}

async fn engine(server: &RedisServer, yaml: &str, batching: Option<Batching>) -> Engine {
    // A deadline far above any latency: a busy machine must not fail the benchmark.
    let mut limiter = RedisLimiter::builder(server.url());
    if let Some(size) = pool_size() {
        limiter = limiter.pool_size(size);
    }
    let limiter = limiter
        .timeout(Duration::from_secs(2))
        .batching(batching)
        .connect()
        .await
        .unwrap();
    let rules = RuleSets::from_yaml_str(yaml).unwrap();
    Engine::builder(rules)
        .limiter(limiter)
        .build()
        .expect("the backend decides every rule")
}

/// Whether a rule of `yaml` keys by the user, alone or with other fields.
fn keys_by_user(yaml: &str) -> bool {
    let rules = RuleSets::from_yaml_str(yaml).unwrap();
    let by_user = rules.iter().flat_map(|set| set.rules()).any(|rule| match rule.scope() {
        Scope::User => true,
        Scope::Composite(fields) => fields.contains(&KeyField::User),
        _ => false,
    });
    by_user
}

async fn fluxgate_engine(name: &str, yaml: &'static str) -> Report {
    fluxgate_engine_with(name, yaml, None).await
}

async fn fluxgate_engine_with(name: &str, yaml: &'static str, batching: Option<Batching>) -> Report {
    let server = RedisServer::start();
    let engine = engine(&server, yaml, batching).await;
    // A user id only for rule sets that key by it: the text costs the driver, not the engine.
    let by_user = keys_by_user(yaml);
    let before = server_before(&server);
    let report = drive(name, move |n| {
        let engine = engine.clone();
        async move {
            let mut ctx = RequestContext::builder().client_ip(ip(n));
            if by_user {
                ctx = ctx.user_id(format!("u{}", n % KEYS));
            }
            let ctx = ctx.build();
            let d = engine.check(&ctx).await.unwrap();
            assert!(d.allowed());
        }
    })
    .await;
    report.of_server(&server, before)
}

async fn fluxgate_layer() -> Report {
    fluxgate_layer_with("fluxgate layer 1x1", None).await
}

async fn fluxgate_layer_with(name: &str, batching: Option<Batching>) -> Report {
    let server = RedisServer::start();
    let engine = engine(&server, ONE_BY_ONE, batching).await;
    let svc = RateLimitLayer::new(engine).layer(service_fn(|_req: Request<axum::body::Body>| async {
        Ok::<_, Infallible>(Response::new(axum::body::Body::empty()))
    }));
    let before = server_before(&server);
    let report = drive(name, move |n| {
        let svc = svc.clone();
        async move {
            let mut req = Request::new(axum::body::Body::empty());
            req.extensions_mut().insert(ClientIp(ip(n)));
            let resp = svc.oneshot(req).await.unwrap();
            assert!(resp.status().is_success());
        }
    })
    .await;
    report.of_server(&server, before)
}

/// The peer's script through `tower_rate_limit_fred::rate_limit`, each call sent either on
/// the pool's next client (`Pool::next`, one connection after the other) or through the
/// pool itself, as the peer's layer sends it: fred's `Pool` picks a client each time a
/// command asks for one, several times per command, so that its commands crowd onto a few
/// of its connections (`docs/benchmarks.md`, "Connections").
async fn peer_script(name: &str, through_the_pool: bool) -> Report {
    let server = RedisServer::start();
    let pool = peer_pool(&server).await;
    let before = server_before(&server);
    let report = drive(name, move |n| {
        let pool = pool.clone();
        async move {
            let key = ip(n).to_string();
            let every = Duration::from_millis(1);
            let refused = if through_the_pool {
                tower_rate_limit_fred::rate_limit(&pool, key, u16::MAX, every).await
            } else {
                tower_rate_limit_fred::rate_limit(pool.next(), key, u16::MAX, every).await
            };
            assert_eq!(refused.unwrap(), None);
        }
    })
    .await;
    report.of_server(&server, before)
}

/// The peer's connections to `server`: a fred pool of [`peer_pool_size`], with the same
/// deadline as FluxGate's limiter.
async fn peer_pool(server: &RedisServer) -> fred::clients::Pool {
    let pool = fred::types::Builder::from_config(fred::types::config::Config::from_url(&server.url()).unwrap())
        .with_performance_config(|c| c.default_command_timeout = Duration::from_secs(2))
        .build_pool(peer_pool_size())
        .unwrap();
    pool.init().await.unwrap();
    pool
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
    let pool = peer_pool(&server).await;
    let layer = tower_rate_limit_fred::RateLimitLayer::builder()
        .conn(pool)
        .key_resolver(PeerKey)
        .capacity(u16::MAX)
        .emission_interval(Duration::from_millis(1))
        .build();
    let svc = layer.layer(service_fn(|_req: Request<axum::body::Body>| async {
        Ok::<_, Infallible>(Response::new(axum::body::Body::empty()))
    }));
    let before = server_before(&server);
    let report = drive("tower-rate-limit-fred layer", move |n| {
        let svc = svc.clone();
        async move {
            let mut req = Request::new(axum::body::Body::empty());
            req.extensions_mut().insert(ClientIp(ip(n)));
            let resp = svc.oneshot(req).await.unwrap();
            assert!(resp.status().is_success(), "{}", resp.status());
        }
    })
    .await;
    report.of_server(&server, before)
}

/// `redis-benchmark` running `EVALSHA` of the script the engine runs for `bands` bands of
/// token buckets (two per rule beyond one band, one key per rule) on random keys.
fn ceiling(name: &str, bands: usize) {
    let server = RedisServer::start();
    let script = if bands == 1 {
        fluxgate::redis::ONE_TOKEN_BUCKET_LUA
    } else {
        fluxgate::redis::TOKEN_BUCKETS_LUA
    };
    let sha = server.cli(&["SCRIPT", "LOAD", script]).trim().to_owned();
    // The arguments the limiter sends for bands of 10,000,000 per hour: g = 10,000,000,
    // scale 1, interval 360, so a capacity of 3,600,000,000 units and a cost of 360, in
    // hexadecimal (see lua/token_bucket.lua and lua/README.md, "Protocol"); one key per
    // rule of two bands.
    let mut args: Vec<String> = vec!["EVALSHA".into(), sha];
    let rules = bands.div_ceil(2);
    args.push(rules.to_string());
    for r in 0..rules {
        args.push(format!("fluxgate:{{default:rule{r}:ip=__rand_int__}}"));
    }
    if bands == 1 {
        // layout, capacity and cost in units, expiry in ms (a scale of 1 left out).
        args.extend(["b0:10000000/1h|", "d693a400", "168", "3601001"].map(String::from));
    } else {
        for _ in 0..rules {
            // flags (2 bands × 8, unscaled), layout, expiry in ms, then each band's capacity
            // and cost.
            args.extend(["10", "b0:10000000/1h,b1:10000000/1h|", "3601001"].map(String::from));
            for _ in 0..2 {
                args.extend(["d693a400", "168"].map(String::from));
            }
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
    assert!(
        keys_by_user(THREE_BY_TWO) && !keys_by_user(ONE_BY_ONE),
        "the drivers' user ids"
    );
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(workers) = std::env::var("BENCH_WORKERS").ok().and_then(|s| s.parse().ok()) {
        rt.worker_threads(workers);
    }
    if let Some(ticks) = std::env::var("BENCH_EVENT_INTERVAL").ok().and_then(|s| s.parse().ok()) {
        rt.event_interval(ticks);
    }
    let rt = rt.enable_all().build().unwrap();
    println!(
        "{IN_FLIGHT} in flight, {KEYS} keys, {:?} per measurement; FluxGate's pool {}, the peer's {}",
        secs(),
        pool_size().map_or_else(|| "the limiter's default".to_owned(), |n| n.to_string()),
        peer_pool_size()
    );
    let groups = [
        "algorithms",
        "bands",
        "peer",
        "1x1",
        "3x2",
        "layer",
        "peer-layer",
        "batched",
        "batched-1x1",
        "batched-3x2",
        "leased",
        "acquisition",
        "fred-pool",
    ];
    let only: Vec<String> = std::env::args().filter(|a| groups.contains(&a.as_str())).collect();
    let run = |group: &str| only.is_empty() || only.iter().any(|a| a == group);
    if only.is_empty() {
        everything_but_the_groups(&rt);
    }
    if !only.is_empty() && run("peer") {
        against_the_peer(&rt);
    }
    if !only.is_empty() && run("fred-pool") {
        for _ in 0..2 {
            rt.block_on(peer_script("peer script, Pool::next", false)).print();
            rt.block_on(peer_script("peer script, through the Pool", true)).print();
        }
    }
    if !only.is_empty() && run("1x1") {
        rt.block_on(fluxgate_engine("fluxgate engine 1x1", ONE_BY_ONE)).print();
    }
    if !only.is_empty() && run("layer") {
        rt.block_on(fluxgate_layer()).print();
    }
    if !only.is_empty() && run("peer-layer") {
        rt.block_on(peer_layer()).print();
    }
    if !only.is_empty() && run("batched") {
        batched_against_the_peer(&rt);
    }
    if !only.is_empty() && run("batched-1x1") {
        rt.block_on(fluxgate_engine_with(
            "fluxgate engine 1x1 batched",
            ONE_BY_ONE,
            batching(),
        ))
        .print();
    }
    if !only.is_empty() && run("batched-3x2") {
        rt.block_on(fluxgate_engine_with(
            "fluxgate engine 3x2 batched",
            THREE_BY_TWO,
            batching(),
        ))
        .print();
    }
    if !only.is_empty() && run("3x2") {
        rt.block_on(fluxgate_engine("fluxgate engine 3x2", THREE_BY_TWO))
            .print();
    }
    if !only.is_empty() && run("leased") {
        leased_against_the_peer(&rt);
    }
    if !only.is_empty() && run("acquisition") {
        acquisition_modes(&rt);
    }
    if run("algorithms") {
        for algorithm in fluxgate::Algorithm::ALL {
            let name = format!("fluxgate {} 1x1", algorithm.as_str());
            rt.block_on(fluxgate_engine(&name, one_rule_of(algorithm.as_str())))
                .print();
        }
    }
    if run("bands") {
        bands_and_rules(&rt);
    }
}

/// `rules` token-bucket rules of `bands` bands each, 10,000,000 per hour (every request
/// admitted), each rule with a key of its own.
fn rules_of_bands(rules: usize, bands: usize) -> &'static str {
    let mut yaml = String::from("rule_sets:\n  - id: default\n    rules:\n");
    for r in 0..rules {
        let list: Vec<String> = (0..bands)
            .map(|b| format!("{{ capacity: 10000000, window: 1h, label: b{b} }}"))
            .collect();
        yaml.push_str(&format!("      - id: rule{r}\n        bands: [{}]\n", list.join(", ")));
    }
    Box::leak(yaml.into_boxed_str())
}

/// Decisions per second and Redis time per call against the number of bands of one rule,
/// then against the number of rules (of 2 bands), as a table: what one more band costs
/// next to what a call costs.
fn bands_and_rules(rt: &tokio::runtime::Runtime) {
    let shapes = [(1, 1), (1, 2), (1, 4), (1, 8), (1, 2), (3, 2), (6, 2)];
    let mut rows = Vec::new();
    for (rules, bands) in shapes {
        let name = format!("fluxgate {rules} rule(s) x {bands} band(s)");
        let mut report = rt.block_on(fluxgate_engine(&name, rules_of_bands(rules, bands)));
        report.print();
        rows.push((rules, bands, report));
    }
    println!();
    println!(
        "| rules × bands | keys | decisions/s | Redis µs per call | Redis µs per band | client CPU µs per decision |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for (rules, bands, r) in &rows {
        println!(
            "| {rules} × {bands} | {rules} | {:.0} | {:.2} | {:.2} | {:.2} |",
            r.decisions as f64 / r.elapsed.as_secs_f64(),
            r.server_us,
            r.server_us / (rules * bands) as f64,
            r.client_us
        );
    }
    // One band has a script of its own; 2 to 8 bands share the token buckets' script.
    let (one, two, eight) = (rows[0].2.server_us, rows[1].2.server_us, rows[3].2.server_us);
    println!(
        "\none rule: from 2 to 8 bands, each band adds {:.2} µs in Redis to a call (1 band: {one:.2} µs, 2 bands: \
         {two:.2} µs)",
        (eight - two) / 6.0
    );
}

/// FluxGate 1x1 and the peer, then FluxGate 3x2, in turn, twice: on a shared machine the
/// load moves between measurements.
fn against_the_peer(rt: &tokio::runtime::Runtime) {
    for _ in 0..2 {
        rt.block_on(fluxgate_engine("fluxgate engine 1x1", ONE_BY_ONE)).print();
        rt.block_on(fluxgate_layer()).print();
        rt.block_on(peer_layer()).print();
        rt.block_on(fluxgate_engine("fluxgate engine 3x2", THREE_BY_TWO))
            .print();
    }
}

/// Batched decisions (`Batching`'s defaults) next to the peer and to one call per request,
/// in turn, twice: the peer's layer, the engine and the layer 1x1 with and without batches,
/// then the engine 3x2 without and with.
fn batched_against_the_peer(rt: &tokio::runtime::Runtime) {
    for _ in 0..2 {
        rt.block_on(peer_layer()).print();
        one_call_and_batched(rt, true);
    }
}

/// A global rule with leases of 100 and of 1,000 next to the same rule without a lease
/// and to the peer, in turn, twice: the decisions per second of one instance, and its
/// calls per decision.
fn leased_against_the_peer(rt: &tokio::runtime::Runtime) {
    for _ in 0..2 {
        rt.block_on(peer_layer()).print();
        global_leased(rt);
    }
}

/// Every acquisition mode on Redis next to the peer and to one call per request, in turn,
/// twice: the peer's layer; the engine 1x1 and 3x2 with one call per request and batched;
/// a global rule without a lease and with leases of 100 and 1,000.
fn acquisition_modes(rt: &tokio::runtime::Runtime) {
    for _ in 0..2 {
        rt.block_on(peer_layer()).print();
        one_call_and_batched(rt, false);
        global_leased(rt);
    }
}

/// The engine 1x1 with one call per request and batched (and the layer batched, with
/// `layer`), then the engine 3x2 without and with batches.
fn one_call_and_batched(rt: &tokio::runtime::Runtime, layer: bool) {
    let batched = batching();
    rt.block_on(fluxgate_engine("fluxgate engine 1x1", ONE_BY_ONE)).print();
    rt.block_on(fluxgate_engine_with("fluxgate engine 1x1 batched", ONE_BY_ONE, batched))
        .print();
    if layer {
        rt.block_on(fluxgate_layer_with("fluxgate layer 1x1 batched", batched))
            .print();
    }
    rt.block_on(fluxgate_engine("fluxgate engine 3x2", THREE_BY_TWO))
        .print();
    rt.block_on(fluxgate_engine_with(
        "fluxgate engine 3x2 batched",
        THREE_BY_TWO,
        batched,
    ))
    .print();
}

/// A global rule without a lease, then with leases of 100 and of 1,000.
fn global_leased(rt: &tokio::runtime::Runtime) {
    rt.block_on(fluxgate_engine("fluxgate engine global", global(0)))
        .print();
    for max in [100, 1000] {
        let name = format!("fluxgate engine global leased {max}");
        rt.block_on(fluxgate_engine(&name, global(max))).print();
    }
}

fn everything_but_the_groups(rt: &tokio::runtime::Runtime) {
    ceiling("redis-benchmark EVALSHA 1x1", 1);
    rt.block_on(fluxgate_engine("fluxgate engine 1x1", ONE_BY_ONE)).print();
    rt.block_on(fluxgate_layer()).print();
    rt.block_on(peer_layer()).print();
    ceiling("redis-benchmark EVALSHA 3x2", 6);
    rt.block_on(fluxgate_engine("fluxgate engine 3x2", THREE_BY_TWO))
        .print();
}
