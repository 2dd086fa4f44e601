//! The engine's cost per decision, and the in-memory limiter's memory per active key.
//!
//! Run with: `cargo bench --bench engine`
//!
//! Decisions: 1 rule × 1 band and 3 rules × 2 bands, over 10,000 client addresses, all
//! admitted, in memory; and the floor of the first (`support/floor.rs`): the least such a
//! decision can cost once everything a rule set settles when it loads is taken out. Then
//! (`long_paths`) what a client makes a decision cost with a path of 4,096 bytes, the
//! longest rules are matched against, built of dot segments, empty segments and escapes
//! (each adds views of the path to match), against five rules with path patterns. Memory: before the timing runs, 1,000,000 distinct keys are
//! decided (each stays active: 100 per hour) and the growth of the process's resident set
//! is divided by the key count.

#![allow(missing_docs)]

#[path = "support/rss.rs"]
mod rss;

#[path = "support/apps.rs"]
mod apps;

#[path = "support/floor.rs"]
mod floor;

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use apps::{contexts, engine, ACTIVE_KEYS, ONE_RULE, THREE_RULES};
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use fluxgate::RequestContext;

fn memory_per_key() {
    const KEYS: u32 = 1_000_000;
    let engine = engine(ACTIVE_KEYS, 2_000_000);
    // Build contexts in batches so their own memory is not counted.
    let before = rss::rss_bytes();
    for chunk in 0..(KEYS / 10_000) {
        for i in 0..10_000 {
            let ip = IpAddr::V4(Ipv4Addr::from(0x0b00_0000 + chunk * 10_000 + i));
            let ctx = RequestContext::builder().client_ip(ip).build();
            let d = engine.check(&ctx).into_ready().expect("in memory").expect("decision");
            assert!(d.allowed());
        }
    }
    let after = rss::rss_bytes();
    let per_key = (after.saturating_sub(before)) as f64 / f64::from(KEYS);
    println!(
        "memory: {KEYS} active keys in the in-memory limiter: resident set grew {:.1} MiB = {per_key:.1} bytes per key",
        (after - before) as f64 / (1024.0 * 1024.0)
    );
    black_box(engine);
}

fn decisions(c: &mut Criterion) {
    memory_per_key();
    let ctxs = contexts(10_000);
    let mut group = c.benchmark_group("engine_decision");
    for (name, yaml) in [("1_rule_x_1_band", ONE_RULE), ("3_rules_x_2_bands", THREE_RULES)] {
        let engine = engine(yaml, 1_000_000);
        for ctx in &ctxs {
            engine.check(ctx).into_ready().expect("in memory").expect("decision");
        }
        let mut i = 0;
        group.bench_function(name, |b| {
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
    // The least a decision of the first rule set can cost (`support/floor.rs`), in the
    // same run, over the same contexts.
    let floor = floor::Floor::new(1_000_000_000, 3_600_000_000_000);
    for ctx in &ctxs {
        floor.decide(ctx);
    }
    let mut i = 0;
    group.bench_function("floor_1_rule_x_1_band", |b| {
        b.iter(|| {
            i = (i + 1) % ctxs.len();
            let figures = floor.decide(&ctxs[i]);
            assert!(figures.allowed);
            black_box(figures)
        })
    });
    group.finish();
}

/// Five rules with path patterns, wildcards and globs among them.
const PATH_RULES: &str = r#"rule_sets: [{id: default, rules: [
  {id: a, match: {paths: ["/files/private/**"]}, bands: [{capacity: 1000000000, window: 1h}]},
  {id: b, match: {paths: ["/api/*/files/private/**"]}, bands: [{capacity: 1000000000, window: 1h}]},
  {id: c, match: {paths: ["/**/*.secret"]}, bands: [{capacity: 1000000000, window: 1h}]},
  {id: d, match: {paths: ["/wiki/?"]}, bands: [{capacity: 1000000000, window: 1h}]},
  {id: e, match: {paths: ["/a/**/b/**/c"]}, bands: [{capacity: 1000000000, window: 1h}]}]}]"#;

/// A path of `start` and then `unit` repeated, cut to the longest matched path.
fn long_path(start: &str, unit: &str) -> String {
    let mut path = String::from(start);
    while path.len() + unit.len() <= fluxgate::core::path::LONGEST_MATCHED_PATH {
        path.push_str(unit);
    }
    path
}

fn long_paths(c: &mut Criterion) {
    let engine = apps::engine(PATH_RULES, 1_000_000);
    let mut group = c.benchmark_group("long_paths");
    for (name, path) in [
        ("plain_segments", long_path("/files", "/a")),
        ("empty_segments", long_path("/files", "/")),
        ("dot_segments", long_path("/files", "/.")),
        ("escaped_slashes", long_path("/files/", "%2F")),
        ("dots_and_escapes", long_path("/files", "/a/../%2e%2E/%2F/x")),
        ("parameter_slashes_and_dots", long_path("/api/x/files", "/a%2Fb/./..")),
    ] {
        let ctx = RequestContext::builder()
            .path(&path)
            .client_ip(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)))
            .build();
        group.bench_function(name, |b| {
            b.iter(|| {
                let d = engine.check(&ctx).into_ready().expect("in memory").expect("decision");
                black_box(d)
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    targets = decisions
}
criterion_group! {
    name = paths;
    config = Criterion::default().measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500)).sample_size(20);
    targets = long_paths
}
criterion_main!(benches, paths);
