//! The five algorithms in memory: cost per decision, memory per active key, and the
//! accuracy of the sliding window counter against the exact sliding window log.
//!
//! Run with: `cargo bench --bench algorithms` (`-- accuracy` for the accuracy alone).
//!
//! - Decisions (criterion): the engine with one rule of one band (1,000,000,000 per
//!   second, all admitted) per algorithm, over 10,000 client addresses.
//! - Memory: 1,000,000 distinct keys decided once each (each stays active: 100 per hour)
//!   in a child process per algorithm; the growth of its resident set per key.
//! - Accuracy: two seeded traces of about 1,200,000 requests over 1,000 keys each (every
//!   run replays the same traces; `ACCURACY_TRACE=dir` also writes them as CSV), decided
//!   by a sliding window counter and by a sliding window log of the same limit, each a
//!   real in-memory limiter on a controlled clock. Printed: the requests the counter
//!   admits and the log rejects, and the reverse, as shares of all requests.

#![allow(missing_docs, clippy::unwrap_used)]

#[path = "support/rss.rs"]
mod rss;

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use criterion::{black_box, criterion_group, Criterion};
use fluxgate::core::limiter::AcquireRequest;
use fluxgate::core::ManualClock;
use fluxgate::{Algorithm, Engine, MemoryLimiter, RequestContext, RuleSet, RuleSets};

fn rules(algorithm: Algorithm, band: &str) -> RuleSets {
    RuleSets::from_yaml_str(&format!(
        "rule_sets:\n  - id: default\n    rules:\n      - {{ id: per-ip, algorithm: {}, bands: [{band}] }}\n",
        algorithm.as_str()
    ))
    .unwrap()
}

fn engine(algorithm: Algorithm, band: &str) -> Engine {
    Engine::builder(rules(algorithm, band))
        .limiter(MemoryLimiter::builder().max_keys(2_000_000).build())
        .build()
        .expect("the backend decides every rule")
}

fn ctx(i: u32) -> RequestContext {
    RequestContext::builder()
        .path("/api/items")
        .client_ip(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)))
        .build()
}

fn decisions(c: &mut Criterion) {
    let ctxs: Vec<RequestContext> = (0..10_000).map(ctx).collect();
    let mut group = c.benchmark_group("algorithm_decision_1x1");
    for algorithm in Algorithm::ALL {
        let engine = engine(algorithm, "{ capacity: 1000000000, window: 1s }");
        let mut i = 0;
        group.bench_function(algorithm.as_str(), |b| {
            b.iter(|| {
                i = (i + 1) % ctxs.len();
                let d = engine
                    .check(&ctxs[i])
                    .into_ready()
                    .expect("in memory")
                    .expect("decision");
                assert!(d.allowed());
                black_box(d)
            })
        });
    }
    group.finish();
}

/// In the child process: decides 1,000,000 keys once and prints the growth per key.
fn memory_child(algorithm: Algorithm) {
    const KEYS: u32 = 1_000_000;
    let engine = engine(algorithm, "{ capacity: 100, window: 1h }");
    let before = rss::rss_bytes();
    for i in 0..KEYS {
        let ctx = RequestContext::builder()
            .client_ip(IpAddr::V4(Ipv4Addr::from(0x0b00_0000 + i)))
            .build();
        let d = engine.check(&ctx).into_ready().expect("in memory").expect("decision");
        assert!(d.allowed());
    }
    let grown = rss::rss_bytes().saturating_sub(before);
    println!(
        "memory: {:<24} {KEYS} active keys: {:>6.1} MiB, {:>6.1} bytes per key",
        algorithm.as_str(),
        grown as f64 / (1024.0 * 1024.0),
        grown as f64 / f64::from(KEYS)
    );
    black_box(engine);
}

fn memory_per_key() {
    let exe = std::env::current_exe().unwrap();
    for algorithm in Algorithm::ALL {
        let out = Command::new(&exe)
            .env("FLUXGATE_MEMORY_CHILD", algorithm.as_str())
            .output()
            .unwrap();
        print!("{}", String::from_utf8_lossy(&out.stdout));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
}

/// xorshift64*: a small, seeded generator, so that the trace is the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A trace: `(nanoseconds from the start, key)`, in time order. Each key has its own
/// mean rate, `rate(rng)` times the limit, and sends in bursts: on for 1 to 3 seconds, off
/// for 2 to 6, at three times its mean rate while on.
fn trace(requests: usize, keys: u32, limit_per_sec: f64, seed: u64, rate: impl Fn(&mut Rng) -> f64) -> Vec<(u64, u32)> {
    let mut rng = Rng(seed);
    let rates: Vec<f64> = (0..keys).map(|_| limit_per_sec * rate(&mut rng)).collect();
    let total: f64 = rates.iter().sum();
    let seconds = requests as f64 / total;
    let mut out = Vec::with_capacity(requests + requests / 10);
    for (k, &rate) in rates.iter().enumerate() {
        let mut t = 0.0;
        let mut on = rng.unit() < 1.0 / 3.0;
        let mut switch = rng.unit() * 4.0;
        while t < seconds {
            if t >= switch {
                on = !on;
                switch = t + if on { 2.0 } else { 4.0 } * (0.5 + rng.unit());
            }
            if on {
                t += -(1.0 - rng.unit()).ln() / (rate * 3.0);
                if t < switch && t < seconds {
                    out.push(((t * 1e9) as u64, k as u32));
                }
            } else {
                t = switch;
            }
        }
    }
    out.sort_unstable();
    out
}

/// Replays `events` through a sliding window counter and a sliding window log of
/// 100 per 10 s per key (real in-memory limiters on one controlled clock) and prints how
/// often they disagree.
fn compare(name: &str, events: &[(u64, u32)], keys: u32) {
    const CAPACITY: u64 = 100;
    if let Ok(dir) = std::env::var("ACCURACY_TRACE") {
        let path = format!("{dir}/{name}.csv");
        let csv: String = events.iter().map(|(t, k)| format!("{t},{k}\n")).collect();
        std::fs::write(&path, csv).unwrap();
        println!("accuracy: trace written to {path}");
    }
    let clock = ManualClock::new(1_764_000_000_000_000_000);
    let limiter = || MemoryLimiter::builder().clock(clock.clone()).max_keys(10_000).build();
    let rule = |algorithm: Algorithm| -> Arc<RuleSet> {
        let sets = rules(algorithm, &format!("{{ capacity: {CAPACITY}, window: 10s }}"));
        sets.get("default").unwrap().clone()
    };
    let (counter_rule, log_rule) = (rule(Algorithm::SlidingWindowCounter), rule(Algorithm::SlidingWindowLog));
    let (counter, log) = (limiter(), limiter());
    let decide = |limiter: &MemoryLimiter, set: &Arc<RuleSet>, key: &str| {
        let mut request = AcquireRequest::new(set.clone());
        request.push(0, key.into());
        limiter.acquire_now(&request).allowed
    };
    let names: Vec<String> = (0..keys).map(|k| format!("k{k}")).collect();
    let (mut counter_only, mut log_only, mut by_counter, mut by_log) = (0u64, 0u64, 0u64, 0u64);
    let mut now = 0;
    for &(t, k) in events {
        clock.advance(Duration::from_nanos(t - now));
        now = t;
        let key = &names[k as usize];
        let (c, l) = (decide(&counter, &counter_rule, key), decide(&log, &log_rule, key));
        by_counter += u64::from(c);
        by_log += u64::from(l);
        counter_only += u64::from(c && !l);
        log_only += u64::from(l && !c);
    }
    let n = events.len() as f64;
    println!(
        "accuracy: {name}: {} requests over {keys} keys in {:.0} s, {CAPACITY} per 10 s per key; admitted: \
         counter {by_counter}, log {by_log} ({:+.3}%); rejected by the log: {:.2}%",
        events.len(),
        events.last().map_or(0.0, |e| e.0 as f64 / 1e9),
        100.0 * (by_counter as f64 - by_log as f64) / by_log as f64,
        100.0 - 100.0 * by_log as f64 / n
    );
    println!(
        "accuracy: {name}: counter admits, log rejects: {counter_only} = {:.4}% of requests ({:.4}% of the counter's \
         admissions); counter rejects, log admits: {log_only} = {:.4}% of requests",
        100.0 * counter_only as f64 / n,
        100.0 * counter_only as f64 / by_counter as f64,
        100.0 * log_only as f64 / n
    );
    let (counter_only, exact_only) = estimators_on_all_requests(events, keys, CAPACITY, 10_000_000_000);
    println!(
        "accuracy: {name}: counting every request, admitted or not (Cloudflare's method): the counter alone \
         admits {counter_only} = {:.4}%, the exact count alone {exact_only} = {:.4}% of requests",
        100.0 * counter_only as f64 / n,
        100.0 * exact_only as f64 / n
    );
}

/// Cloudflare's method: both estimators count every request, admitted or not, so they see
/// the same data; a request is "admitted" when its estimate plus one stays within the
/// capacity. Returns the requests only the counter admits and only the exact count admits.
fn estimators_on_all_requests(events: &[(u64, u32)], keys: u32, capacity: u64, window: u64) -> (u64, u64) {
    use std::collections::VecDeque;
    let base = 1_764_000_000_000_000_000u64;
    let mut recent: Vec<VecDeque<u64>> = vec![VecDeque::new(); keys as usize];
    // Per key: (window index, previous count, current count).
    let mut windows: Vec<(u64, u64, u64)> = vec![(0, 0, 0); keys as usize];
    let (mut counter_only, mut exact_only) = (0, 0);
    for &(t, k) in events {
        let now = base + t;
        let log = &mut recent[k as usize];
        while log.front().is_some_and(|&x| x + window <= now) {
            log.pop_front();
        }
        let exact = log.len() as u64;
        let (index, elapsed) = (now / window, now % window);
        let (w, previous, current) = &mut windows[k as usize];
        if *w != index {
            *previous = if *w + 1 == index { *current } else { 0 };
            *current = 0;
            *w = index;
        }
        // previous × (window − elapsed) / window + current + 1 <= capacity, in integers.
        let weighted =
            u128::from(*previous) * u128::from(window - elapsed) + u128::from(*current + 1) * u128::from(window);
        let by_counter = weighted <= u128::from(capacity) * u128::from(window);
        let by_exact = exact < capacity;
        counter_only += u64::from(by_counter && !by_exact);
        exact_only += u64::from(by_exact && !by_counter);
        log.push_back(now);
        *current += 1;
    }
    (counter_only, exact_only)
}

fn accuracy() {
    const KEYS: u32 = 1_000;
    // 99 keys in 100 well within 10 per second (a mean of 2% to 30% of it, bursts at three
    // times the mean), one in 100 sending one to three times the limit.
    let within = trace(1_200_000, KEYS, 10.0, 0x9e37_79b9_7f4a_7c15, |rng| {
        if rng.unit() < 0.99 {
            0.02 + 0.28 * rng.unit()
        } else {
            1.0 + 2.0 * rng.unit()
        }
    });
    compare("mostly-within-the-limit", &within, KEYS);
    // Every key between a tenth and ten times the limit (log-uniform): most traffic is over it.
    let over = trace(1_200_000, KEYS, 10.0, 0x2545_f491_4f6c_dd1d, |rng| {
        10f64.powf(rng.unit() * 2.0 - 1.0)
    });
    compare("mostly-over-the-limit", &over, KEYS);
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = decisions
}

fn main() {
    if let Ok(name) = std::env::var("FLUXGATE_MEMORY_CHILD") {
        let algorithm = Algorithm::ALL.into_iter().find(|a| a.as_str() == name).unwrap();
        memory_child(algorithm);
        return;
    }
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    accuracy();
    if std::env::args().any(|a| a == "accuracy") {
        return;
    }
    memory_per_key();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
