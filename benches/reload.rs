//! How fast rule changes reach a running instance, and what a reload costs.
//!
//! Run with: `cargo bench --bench reload` (needs `redis-server`; `CHANGES` sets the number
//! of changes per propagation figure, default 20; `BENCH_SECS` the seconds of each
//! decision-rate measurement, default 3). `cargo bench --bench reload -- pubsub` (or
//! `polling`, `quickstart`, `cost`, `storm`) runs one part.
//!
//! - `pubsub`: `RuleAdmin::put` of a new capacity on one instance, then requests on a
//!   second instance (its own engine, provider and `RuleChangeListener`) until a decision
//!   carries the new limit: p50 / p99 / max over the changes.
//! - `polling`: the same with the second instance polling the store every
//!   `DEFAULT_POLL_INTERVAL` (5 s) instead of listening.
//! - `quickstart`: the quickstart example (`target/release/examples/quickstart`, built by
//!   `cargo bench`) serving HTTP; its rules file is rewritten with a new capacity, then
//!   requests until the `X-RateLimit-Limit` header carries it.
//! - `cost`: reloading 1,000 rule sets from the Redis store and from one rule file, when
//!   nothing changed and when one rule set changed.
//! - `storm`: in-memory decisions per second on two threads over 1,000 rule sets, without
//!   reloads, then while one rule set changes every 100 ms (`RuleAdmin::put`, then every
//!   listener reloads the 1,000 rule sets).

#![allow(missing_docs, clippy::unwrap_used)]

/// The test support's `redis-server` processes.
#[path = "../tests/support/servers.rs"]
#[allow(dead_code)]
mod servers;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fluxgate::core::reload::{spawn_polling, ReloadingRuleSetProvider, DEFAULT_POLL_INTERVAL};
use fluxgate::core::{FileRuleSource, RuleSetSpec};
use fluxgate::redis::{RedisRuleSetStore, RuleAdmin, RuleChangeListener};
use fluxgate::{Engine, RequestContext};
use servers::RedisServer;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn spec(id: &str, capacity: u64) -> RuleSetSpec {
    serde_json::from_str(&format!(
        r#"{{"id": "{id}", "rules": [{{"id": "per-ip", "bands": [{{"capacity": {capacity}, "window": "1h"}}]}}]}}"#
    ))
    .unwrap()
}

fn ctx(rule_set: &str, i: u64) -> RequestContext {
    let ip = std::net::Ipv4Addr::from(0x0a00_0000 + (i as u32 % 1_000_000));
    RequestContext::builder()
        .rule_set_id(rule_set)
        .client_ip(ip.into())
        .build()
}

/// The p50, p99 and max of `delays`, in milliseconds.
fn summary(delays: &mut [Duration]) -> String {
    delays.sort();
    let at = |q: f64| delays[((delays.len() as f64 - 1.0) * q).round() as usize];
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    format!(
        "p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms over {} changes",
        ms(at(0.5)),
        ms(at(0.99)),
        ms(at(1.0)),
        delays.len()
    )
}

/// An instance: provider and in-memory engine over the store's rule sets.
async fn instance(store: &RedisRuleSetStore) -> (Arc<ReloadingRuleSetProvider>, Engine) {
    let provider = Arc::new(ReloadingRuleSetProvider::new(store.load_rule_sets().await.unwrap()));
    let engine = Engine::builder(provider.clone()).build().unwrap();
    (provider, engine)
}

/// Requests on `engine` until a decision carries limit `capacity`; answers the time since
/// `since`.
async fn until_limit(engine: &Engine, capacity: u64, since: Instant) -> Duration {
    let mut i = 0;
    loop {
        i += 1;
        let decision = engine.check(&ctx("api", i)).await.unwrap();
        if decision.limit() == Some(capacity) {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < Duration::from_secs(60),
            "change not seen after a minute"
        );
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
}

async fn propagation(server: &RedisServer, changes: u64, polling: bool) -> String {
    let store = RedisRuleSetStore::connect(&server.url()).await.unwrap();
    let admin = RuleAdmin::new(store.clone()).channel(if polling { "unused" } else { "fluxgate:rule-changes" });
    admin.put(&spec("api", 1_000_000)).await.unwrap();
    let (provider, engine) = instance(&store).await;
    let store = Arc::new(store);
    let _listener;
    let _poll;
    if polling {
        _poll = Some(spawn_polling(provider.clone(), store.clone(), DEFAULT_POLL_INTERVAL));
    } else {
        _listener = RuleChangeListener::builder(provider.clone(), store.clone())
            .subscribe(&server.url())
            .await
            .unwrap();
    }
    let mut delays = Vec::new();
    for n in 0..changes {
        let capacity = 1_000_001 + n;
        let put = Instant::now();
        admin.put(&spec("api", capacity)).await.unwrap();
        delays.push(until_limit(&engine, capacity, put).await);
        // Changes apart from each other and, when polling, spread over the phases of the
        // period: a change seen at a poll is followed by the next one after a pause drawn
        // across the period (a golden-ratio sequence), not always right after the poll.
        let pause = if polling {
            DEFAULT_POLL_INTERVAL.mul_f64(((n + 1) as f64 * 0.618_034).fract())
        } else {
            Duration::from_millis(50 + 37 * (n % 7))
        };
        tokio::time::sleep(pause).await;
    }
    summary(&mut delays)
}

/// The quickstart binary next to this benchmark's (`target/<profile>/examples/quickstart`).
fn quickstart_binary() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let profile_dir = exe.parent()?.parent()?;
    let binary = profile_dir.join("examples").join("quickstart");
    binary.exists().then_some(binary)
}

fn quickstart_rules(capacity: u64) -> String {
    format!(
        "rule_sets:\n  - id: default\n    rules:\n      - {{id: per-ip, match: {{paths: [\"/api/**\"]}}, bands: [{{capacity: {capacity}, window: 1h}}]}}\n"
    )
}

/// `GET /api/hello` on `port`; answers the `x-ratelimit-limit` header's value.
fn limit_header(port: u16) -> Option<u64> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .write_all(b"GET /api/hello HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response
        .lines()
        .find_map(|line| {
            line.to_ascii_lowercase()
                .strip_prefix("x-ratelimit-limit: ")
                .map(str::to_owned)
        })
        .and_then(|v| v.trim().parse().ok())
}

fn quickstart(changes: u64) -> String {
    let Some(binary) = quickstart_binary() else {
        return "skipped: build it first with `cargo build --release --example quickstart`".into();
    };
    let dir = std::env::temp_dir().join(format!("fluxgate-reload-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rules = dir.join("rules.yaml");
    std::fs::write(&rules, quickstart_rules(1_000_000)).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child: Child = Command::new(binary)
        .args(["--listen", &format!("127.0.0.1:{port}"), "--rules"])
        .arg(&rules)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while limit_header(port).is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the quickstart did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut delays = Vec::new();
    for n in 0..changes {
        let capacity = 1_000_001 + n;
        // Saved as editors do: a temporary file renamed over the rules file.
        let temporary = dir.join(".rules.yaml.tmp");
        std::fs::write(&temporary, quickstart_rules(capacity)).unwrap();
        let edited = Instant::now();
        std::fs::rename(&temporary, &rules).unwrap();
        while limit_header(port) != Some(capacity) {
            assert!(edited.elapsed() < Duration::from_secs(10), "the edit was not enforced");
            std::thread::sleep(Duration::from_micros(500));
        }
        delays.push(edited.elapsed());
        std::thread::sleep(Duration::from_millis(150));
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    summary(&mut delays)
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

async fn timed<F: std::future::Future>(runs: usize, mut f: impl FnMut(usize) -> F) -> Duration {
    let mut times = Vec::new();
    for i in 0..runs {
        let start = Instant::now();
        f(i).await;
        times.push(start.elapsed());
    }
    median(times)
}

const SETS: u64 = 1_000;

async fn cost(server: &RedisServer) -> Vec<String> {
    let store = RedisRuleSetStore::connect(&server.url()).await.unwrap();
    for i in 0..SETS {
        store.put(&spec(&format!("set{i}"), 100 + i)).await.unwrap();
    }
    let (provider, _engine) = instance(&store).await;
    let (store, provider) = (&store, &provider);
    let unchanged = timed(20, move |_| async move { provider.reload_from(store).await.unwrap() }).await;
    let changed = timed(20, move |i| async move {
        store.put(&spec("set0", 1_000 + i as u64)).await.unwrap();
        let report = provider.reload_from(store).await.unwrap();
        assert_eq!(report.changed.len(), 1);
    })
    .await;
    let load_only = timed(20, move |_| async move { store.load_rule_sets().await.unwrap() }).await;

    let dir = std::env::temp_dir().join(format!("fluxgate-reload-cost-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("rules.yaml");
    let yaml = |first: u64| {
        let mut text = String::from("rule_sets:\n");
        for i in 0..SETS {
            let capacity = if i == 0 { first } else { 100 + i };
            text.push_str(&format!(
                "  - {{id: set{i}, rules: [{{id: per-ip, bands: [{{capacity: {capacity}, window: 1h}}]}}]}}\n"
            ));
        }
        text
    };
    std::fs::write(&file, yaml(100)).unwrap();
    let source = FileRuleSource::new(&file);
    let file_provider = ReloadingRuleSetProvider::new(source.read().unwrap());
    let (source, file_provider) = (&source, &file_provider);
    let file_unchanged = timed(
        20,
        move |_| async move { file_provider.reload_from(source).await.unwrap() },
    )
    .await;
    let file_changed = timed(20, |i| {
        std::fs::write(&file, yaml(1_000 + i as u64)).unwrap();
        async move { assert_eq!(file_provider.reload_from(source).await.unwrap().changed.len(), 1) }
    })
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    let ms = |d: Duration| format!("{:.2} ms", d.as_secs_f64() * 1e3);
    vec![
        format!(
            "Redis store, {SETS} rule sets: reload unchanged {} (of which the load {}), one changed {} (median of 20)",
            ms(unchanged),
            ms(load_only),
            ms(changed)
        ),
        format!(
            "one YAML file, {SETS} rule sets: reload unchanged {}, one changed {} (median of 20)",
            ms(file_unchanged),
            ms(file_changed)
        ),
    ]
}

/// In-memory decisions per second over `secs` on two worker tasks, across the 1,000 rule
/// sets.
async fn decisions_per_second(engine: &Engine, secs: u64) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for w in 0..2u64 {
        let (engine, stop, count) = (engine.clone(), stop.clone(), count.clone());
        workers.push(tokio::spawn(async move {
            let ids: Vec<String> = (0..SETS).map(|i| format!("set{i}")).collect();
            let mut i = w;
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..256 {
                    i += 2;
                    let ctx = ctx(&ids[(i % SETS) as usize], i);
                    let _ = engine.check(&ctx).into_ready().unwrap().unwrap();
                }
                count.fetch_add(256, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }
    count.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

async fn storm(server: &RedisServer, secs: u64) -> Vec<String> {
    let store = RedisRuleSetStore::connect(&server.url()).await.unwrap();
    for i in 0..SETS {
        store.put(&spec(&format!("set{i}"), 1_000_000 + i)).await.unwrap();
    }
    let (provider, engine) = instance(&store).await;
    let store = Arc::new(store);
    let listener = RuleChangeListener::builder(provider.clone(), store.clone())
        .subscribe(&server.url())
        .await
        .unwrap();
    let admin = Arc::new(RuleAdmin::new((*store).clone()).reset_on_change(false));
    // Quiet and stormy phases alternate, so that both see the same machine.
    let (mut quiet, mut stormy, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut changes, mut reloads) = (0, 0);
    for round in 0..secs.max(1) * 2 {
        let calm = decisions_per_second(&engine, 1).await;
        let storming = Arc::new(AtomicBool::new(true));
        let changer = {
            let (storming, admin) = (storming.clone(), admin.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                let mut ticks = tokio::time::interval(Duration::from_millis(100));
                while storming.load(Ordering::Relaxed) {
                    ticks.tick().await;
                    n += 1;
                    let id = format!("set{}", (round * 100 + n) % SETS);
                    admin.put(&spec(&id, 2_000_000 + round * 100 + n)).await.unwrap();
                }
                n
            })
        };
        let events = listener.stats().events;
        let during = decisions_per_second(&engine, 1).await;
        storming.store(false, Ordering::Relaxed);
        changes += changer.await.unwrap();
        reloads += listener.stats().events - events;
        quiet.push(calm);
        stormy.push(during);
        ratios.push(during / calm);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    vec![
        format!(
            "in-memory decisions/s on 2 tasks over {SETS} rule sets: quiet {:.0}, during a reload storm {:.0} (medians of {} alternating 1 s phases)",
            median(&mut quiet),
            median(&mut stormy),
            ratios.len()
        ),
        format!(
            "storm/quiet ratio per pair of phases: median {:.2}, lowest {:.2} ({changes} changes, {reloads} reloads of {SETS} rule sets, one change per 100 ms)",
            median(&mut ratios.clone()),
            ratios.iter().copied().fold(f64::INFINITY, f64::min)
        ),
    ]
}

fn main() {
    let filter: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let wants = |part: &str| filter.is_empty() || filter.iter().any(|f| part.contains(f.as_str()));
    let changes = env_u64("CHANGES", 20);
    let secs = env_u64("BENCH_SECS", 3);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let fresh = || RedisServer::start();
    if wants("pubsub") {
        let server = fresh();
        let line = runtime.block_on(propagation(&server, changes, false));
        println!("pub/sub: RuleAdmin::put to enforcement on a second instance: {line}");
    }
    if wants("polling") {
        let server = fresh();
        let line = runtime.block_on(propagation(&server, changes, true));
        println!(
            "polling every {:?}: RuleAdmin::put to enforcement on a second instance: {line}",
            DEFAULT_POLL_INTERVAL
        );
    }
    if wants("quickstart") {
        println!(
            "quickstart: rules file saved to enforcement over HTTP: {}",
            quickstart(changes)
        );
    }
    if wants("cost") {
        let server = fresh();
        for line in runtime.block_on(cost(&server)) {
            println!("reload cost: {line}");
        }
    }
    if wants("storm") {
        let server = fresh();
        for line in runtime.block_on(storm(&server, secs)) {
            println!("storm: {line}");
        }
    }
}
