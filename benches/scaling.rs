//! How the in-memory engine's cost grows with threads and keys, and its memory per
//! active key.
//!
//! Run with: `cargo bench --bench scaling` (about 75 s; `BENCH_SECS=<n>` times each run
//! for n seconds instead of 3).
//!
//! Decisions: `Engine::check` with the in-memory limiter, from 1 and 2 threads
//! (`std::thread::scope`), each deciding in a loop for `BENCH_SECS`, over 1, 10,000 and
//! 1,000,000 client addresses. Each thread has its own contexts (`apps::contexts`) and
//! starts at its own offset in them, so that with many keys the threads rarely meet on
//! one; with one key every thread decides for the same key. Before each run one pass
//! over the keys inserts every bucket. Every decision must be admitted (the run panics
//! otherwise). Three rule sets:
//!
//! - `apps::ONE_RULE`, one per-IP rule of one band (10^9 per hour);
//! - `apps::THREE_RULES`, 3 rules × 2 bands (per IP, per user over 997 users, global);
//! - [`ACTIVE_ONE_RULE`], one per-IP band of 3 × 10^8 per 3,650 days. With the quotas
//!   of the first two a bucket has refilled completely a few microseconds after its
//!   request, so sweeps drop it and at 1,000,000 keys nearly every decision inserts its
//!   bucket again. Here a bucket stays active about 1 s after each request, longer than
//!   a pass over 1,000,000 keys takes, so the table holds all of them.
//!
//! The table gives decisions per second in total and per thread, the ratio of the
//! 2-thread total to the 1-thread one, the share of the run the threads were on a CPU
//! (`/proc/thread-self/schedstat`; below 100% when other processes took the cores), the
//! decisions per second of CPU time, and the buckets the limiter held after the run.
//!
//! Memory: in a child process, 1,000,000 client addresses are decided once each against
//! rules whose buckets all stay active, and the growth of the resident set
//! (`rss::rss_bytes`) is divided by the key count and by the bucket count
//! (`MemoryLimiter::len`), as `benches/engine.rs` does; three child processes per rule
//! set, the smallest growth counts (see [`memory`]). One rule of one band must stay
//! within 70 bytes per key.

#![allow(missing_docs)]

#[path = "support/rss.rs"]
mod rss;

#[path = "support/apps.rs"]
mod apps;

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use fluxgate::{Engine, MemoryLimiter, RequestContext};

/// One per-IP band whose buckets stay active about 1.05 s after each request
/// (3,650 days / 3 × 10^8), and which admits 3 × 10^8 requests of one key.
const ACTIVE_ONE_RULE: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 300000000, window: 3650d }]
"#;

/// For the memory of 3 × 2: the shape of `apps::THREE_RULES`, with capacities under
/// which every bucket stays active over 1,000,000 requests and every request is admitted
/// (each user gets about 1,000 of them, the global rule all).
const MEMORY_THREE_RULES: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        match: { paths: ["/api/**"] }
        bands:
          - { capacity: 100, window: 1h, label: burst }
          - { capacity: 1000, window: 1d, label: sustained }
      - id: per-user
        scope: user
        match: { paths: ["/api/**"], methods: [GET, POST] }
        bands:
          - { capacity: 100000, window: 1h, label: burst }
          - { capacity: 1000000, window: 1d, label: sustained }
      - id: global
        scope: global
        bands:
          - { capacity: 10000000, window: 1h, label: burst }
          - { capacity: 100000000, window: 1d, label: sustained }
"#;

const KEY_COUNTS: [u32; 3] = [1, 10_000, 1_000_000];
const MEMORY_KEYS: u32 = 1_000_000;
/// Child processes per memory figure.
const MEMORY_RUNS: usize = 3;
/// Headroom over the buckets of the largest run, so that no shard evicts.
const MAX_KEYS: usize = 4_000_000;
/// Decisions between two looks at the clock.
const BATCH: usize = 1024;

/// One run: `threads` threads deciding over `keys` keys.
struct Run {
    /// The rule set's position in the table.
    order: usize,
    rule_set: &'static str,
    keys: u32,
    threads: usize,
    /// What each thread did.
    per_thread: Vec<Thread>,
    /// Buckets held after the run.
    buckets: usize,
}

impl Run {
    fn total(&self) -> f64 {
        self.per_thread.iter().map(|t| t.rate).sum()
    }

    /// The mean share of the wall-clock time the threads were on a CPU.
    fn on_cpu(&self) -> Option<f64> {
        let shares: Option<Vec<f64>> = self.per_thread.iter().map(|t| t.on_cpu).collect();
        shares.map(|s| s.iter().sum::<f64>() / s.len() as f64)
    }
}

/// The time the calling thread has run on a CPU (`/proc/thread-self/schedstat`), or
/// `None` where unknown.
fn thread_cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let nanos = stat.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(nanos))
}

/// What one thread did in a run.
struct Thread {
    /// Decisions per second of wall-clock time.
    rate: f64,
    /// The share of the run's wall-clock time the thread was on a CPU, if known: below 1
    /// when other processes took its core.
    on_cpu: Option<f64>,
}

/// Decides in a loop from `threads` threads for `secs`.
fn decide(engine: &Engine, contexts: &[Vec<RequestContext>], threads: usize, secs: Duration) -> Vec<Thread> {
    let start = Barrier::new(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = contexts[..threads]
            .iter()
            .enumerate()
            .map(|(t, ctxs)| {
                let start = &start;
                s.spawn(move || {
                    let n = ctxs.len();
                    let mut i = t * n / threads;
                    let (mut decided, mut admitted) = (0u64, 0u64);
                    start.wait();
                    let began = Instant::now();
                    let cpu_began = thread_cpu_time();
                    let elapsed = loop {
                        for _ in 0..BATCH {
                            let d = engine
                                .check(&ctxs[i])
                                .into_ready()
                                .expect("in memory")
                                .expect("decision");
                            admitted += u64::from(d.allowed());
                            black_box(d);
                            i += 1;
                            if i == n {
                                i = 0;
                            }
                        }
                        decided += BATCH as u64;
                        let elapsed = began.elapsed();
                        if elapsed >= secs {
                            break elapsed;
                        }
                    };
                    let on_cpu = thread_cpu_time()
                        .zip(cpu_began)
                        .map(|(end, start)| (end - start).as_secs_f64() / elapsed.as_secs_f64());
                    assert_eq!(
                        admitted, decided,
                        "a decision was refused: the quota is too small for the run"
                    );
                    Thread {
                        rate: decided as f64 / elapsed.as_secs_f64(),
                        on_cpu,
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("thread")).collect()
    })
}

fn decisions(secs: Duration) -> Vec<Run> {
    let mut runs = Vec::new();
    for keys in KEY_COUNTS {
        let contexts: Vec<Vec<RequestContext>> = (0..2).map(|_| apps::contexts(keys)).collect();
        for (order, (rule_set, yaml)) in [
            ("1 rule × 1 band", apps::ONE_RULE),
            ("3 rules × 2 bands", apps::THREE_RULES),
            ("1 × 1, buckets kept active", ACTIVE_ONE_RULE),
        ]
        .into_iter()
        .enumerate()
        {
            for threads in [1, 2] {
                let limiter = MemoryLimiter::builder().max_keys(MAX_KEYS).build();
                let engine = apps::engine_on(yaml, limiter.clone());
                for ctx in &contexts[0] {
                    let d = engine.check(ctx).into_ready().expect("in memory").expect("decision");
                    assert!(d.allowed());
                }
                let per_thread = decide(&engine, &contexts, threads, secs);
                let run = Run {
                    order,
                    rule_set,
                    keys,
                    threads,
                    per_thread,
                    buckets: limiter.len(),
                };
                eprintln!(
                    "{rule_set}, {keys} keys, {threads} thread(s): {:.0} decisions/s, {:.0}% on a CPU, {} buckets held",
                    run.total(),
                    run.on_cpu().unwrap_or(f64::NAN) * 100.0,
                    run.buckets
                );
                runs.push(run);
            }
        }
    }
    // By rule set; the keys and threads are in order already.
    runs.sort_by_key(|r| r.order);
    runs
}

/// In the child process: decides 1,000,000 keys once each and prints
/// `memory <buckets> <bytes grown>`.
fn memory_child(yaml: &str, with_user: bool) {
    let limiter = MemoryLimiter::builder().max_keys(MAX_KEYS).build();
    let engine = apps::engine_on(yaml, limiter.clone());
    let before = rss::rss_bytes();
    for i in 0..MEMORY_KEYS {
        // Built one at a time, so that the contexts' own memory is not counted.
        let ip = IpAddr::V4(Ipv4Addr::from(0x0b00_0000 + i));
        let ctx = if with_user {
            RequestContext::builder()
                .path("/api/items")
                .client_ip(ip)
                .user_id(format!("user-{}", i % 997))
                .build()
        } else {
            RequestContext::builder().client_ip(ip).build()
        };
        let d = engine.check(&ctx).into_ready().expect("in memory").expect("decision");
        assert!(d.allowed());
    }
    let grown = rss::rss_bytes().saturating_sub(before);
    println!("memory {} {grown}", limiter.len());
    black_box(engine);
}

/// The memory of one rule set, measured in a child process: (buckets, bytes grown).
fn memory_once(name: &str) -> (usize, u64) {
    let exe = std::env::current_exe().expect("the benchmark's path");
    let out = Command::new(exe)
        .env("FLUXGATE_SCALING_MEMORY_CHILD", name)
        .output()
        .expect("child process");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let fields: Vec<&str> = stdout
        .lines()
        .find_map(|l| l.strip_prefix("memory "))
        .expect("the child's figures")
        .split(' ')
        .collect();
    (fields[0].parse().expect("buckets"), fields[1].parse().expect("bytes"))
}

/// The memory of one rule set in [`MEMORY_RUNS`] child processes: the buckets, the
/// smallest growth and the largest.
///
/// The tables take the same memory in every run, but how much of the memory freed as
/// they grow stays resident depends on the order in which the shards grow (their hash
/// keys are random): the growth varies by up to about 2 bytes per key from run to run,
/// and that noise only adds, so the smallest growth is the figure.
fn memory(name: &str) -> (usize, u64, u64) {
    let runs: Vec<(usize, u64)> = (0..MEMORY_RUNS).map(|_| memory_once(name)).collect();
    let buckets = runs[0].0;
    assert!(
        runs.iter().all(|r| r.0 == buckets),
        "the bucket counts differ: {runs:?}"
    );
    let grown = runs.iter().map(|r| r.1);
    (buckets, grown.clone().min().unwrap_or(0), grown.max().unwrap_or(0))
}

fn thousands(n: f64) -> String {
    let digits = format!("{:.0}", n);
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn main() {
    if let Ok(name) = std::env::var("FLUXGATE_SCALING_MEMORY_CHILD") {
        if name == "3x2" {
            memory_child(MEMORY_THREE_RULES, true);
        } else {
            memory_child(apps::ACTIVE_KEYS, false);
        }
        return;
    }
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let secs = std::env::var("BENCH_SECS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .map_or(Duration::from_secs(3), Duration::from_secs_f64);
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZeroUsize::get);
    let began = Instant::now();

    let (one_buckets, one_grown, one_most) = memory("1x1");
    let one_per_key = one_grown as f64 / f64::from(MEMORY_KEYS);
    let (three_buckets, three_grown, three_most) = memory("3x2");
    let runs = decisions(secs);

    println!();
    println!(
        "In-memory engine, {cores} cores, {:.0} s per run ({:.0} s in all)",
        secs.as_secs_f64(),
        began.elapsed().as_secs_f64()
    );
    println!();
    println!(
        "| rule set | keys | threads | decisions/s | per thread | 2 threads / 1 thread | on a CPU | per CPU-second | buckets held |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for run in &runs {
        let ratio = if run.threads == 1 {
            String::new()
        } else {
            runs.iter()
                .find(|r| r.threads == 1 && r.keys == run.keys && r.rule_set == run.rule_set)
                .map_or(String::new(), |one| format!("{:.2}", run.total() / one.total()))
        };
        let (on_cpu, per_cpu) = run.on_cpu().map_or((String::from("?"), String::from("?")), |share| {
            (
                format!("{:.0}%", share * 100.0),
                thousands(run.total() / (share * run.threads as f64)),
            )
        });
        println!(
            "| {} | {} | {} | {} | {} | {ratio} | {on_cpu} | {per_cpu} | {} |",
            run.rule_set,
            thousands(f64::from(run.keys)),
            run.threads,
            thousands(run.total()),
            thousands(run.total() / run.threads as f64),
            thousands(run.buckets as f64),
        );
    }
    println!();
    println!(
        "| memory, {} active keys (smallest of {MEMORY_RUNS} runs) | resident set growth | per key | buckets | per bucket | per key, largest run |",
        thousands(f64::from(MEMORY_KEYS))
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for (name, buckets, grown, most) in [
        ("1 rule × 1 band", one_buckets, one_grown, one_most),
        ("3 rules × 2 bands", three_buckets, three_grown, three_most),
    ] {
        println!(
            "| {name} | {:.1} MiB | {:.1} B | {} | {:.1} B | {:.1} B |",
            grown as f64 / (1024.0 * 1024.0),
            grown as f64 / f64::from(MEMORY_KEYS),
            thousands(buckets as f64),
            grown as f64 / buckets.max(1) as f64,
            most as f64 / f64::from(MEMORY_KEYS),
        );
    }
    assert!(
        one_per_key <= 70.0,
        "one rule of one band takes {one_per_key:.1} bytes per active key, more than 70"
    );
}
