//! Redis under memory pressure: a client that makes many keys (rotating IPv6 /64s, user
//! ids) on a Redis with `maxmemory`. With an eviction policy its spent counter is evicted
//! and starts over full, so the limiter warns of such a Redis when it connects; under
//! `noeviction` a full Redis still refuses what it would refuse, and only the requests it
//! would admit go to the failure policy, reported as a full store, with no circuit opened.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fluxgate::core::limiter::is_store_full;
use fluxgate::core::metrics::MetricsRecorder;
use fluxgate::core::{CircuitBreaker, Engine, Error, FailurePolicy, MemoryLimiter, RequestContext};
use fluxgate::redis::RedisLimiter;
use tracing::Level;

use crate::support::app::rules;
use crate::support::servers::{RedisCluster, RedisServer};
use crate::support::telemetry::{metrics_async, trace_async};

fn ip_ctx(ip: &str) -> RequestContext {
    RequestContext::builder()
        .client_ip(ip.parse().expect("an address"))
        .build()
}

async fn limiter(server: &RedisServer, deny_cache: bool) -> RedisLimiter {
    RedisLimiter::builder(server.url())
        .timeout(Duration::from_secs(2))
        .deny_cache(deny_cache)
        .connect()
        .await
        .expect("connect")
}

const PER_IP_5: &str =
    "rule_sets:\n  - id: default\n    rules:\n      - id: per-ip\n        bands: [{ capacity: 5, window: 1h }]\n";

async fn admitted(engine: &Engine, ctx: &RequestContext, tries: u32) -> u32 {
    let mut n = 0;
    for _ in 0..tries {
        if engine.check(ctx).await.expect("a decision").allowed() {
            n += 1;
        }
    }
    n
}

/// The warnings (and notes) the limiter logs when it connects to `server`.
async fn connect_and_catch(url: String) -> (RedisLimiter, crate::support::telemetry::Trace) {
    trace_async(async move {
        RedisLimiter::builder(url)
            .timeout(Duration::from_secs(2))
            .connect()
            .await
            .expect("the limiter connects whatever the memory policy")
    })
    .await
}

/// Every key the limiter writes has an expiry, so under `volatile-lru` (the default of
/// managed Redis services) as under `allkeys-lru` a client that floods keys has its own
/// spent counter evicted: a per-IP limit of 5 per hour admitted 25 (`volatile-lru`) and 30
/// (`allkeys-lru`) of 60 requests, each 10 followed by 30,000 requests from fresh /64s, on
/// a Redis of 3 MB (`probe_eviction_policies`). Connecting to such a Redis warns, naming
/// the policy; a `noeviction` Redis with `maxmemory` is noted at info level, one without
/// `maxmemory` not at all. Old behaviour: nothing was logged.
#[tokio::test]
async fn connecting_to_a_redis_that_evicts_keys_warns_that_counters_can_be_evicted() {
    for (policy, warned) in [("volatile-lru", true), ("allkeys-lru", true), ("noeviction", false)] {
        let server = RedisServer::start_with(&["--maxmemory", "64mb", "--maxmemory-policy", policy]);
        let (limiter, trace) = connect_and_catch(server.url()).await;
        let warnings = trace.events_at_least(Level::WARN);
        if warned {
            assert_eq!(warnings.len(), 1, "{policy}: {:?}", trace.events);
            assert!(
                warnings[0].message.contains(&format!("maxmemory-policy {policy}"))
                    && warnings[0]
                        .message
                        .contains("evicted rate-limit counter starts over full"),
                "{policy}: {}",
                warnings[0].message
            );
        } else {
            assert!(warnings.is_empty(), "{policy}: {warnings:?}");
            let notes = trace.events_at_least(Level::INFO);
            assert!(
                notes.iter().any(|e| e.message.contains("refuses writes")),
                "{policy}: {:?}",
                trace.events
            );
        }
        let policies = limiter.memory_policies().await.expect("CONFIG GET is allowed");
        assert_eq!(policies.len(), 1);
        assert_eq!(
            (
                policies[0].maxmemory,
                policies[0].policy.as_str(),
                policies[0].evicts_counters()
            ),
            (64 << 20, policy, warned)
        );
    }
    let unbounded = RedisServer::start();
    let (_, trace) = connect_and_catch(unbounded.url()).await;
    assert!(trace.events_at_least(Level::INFO).is_empty(), "{:?}", trace.events);
}

/// On a cluster the policy is read on each primary, where the limiter's keys live: one
/// reading per primary, each naming its node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_reports_the_policy_of_each_primary() {
    let cluster = RedisCluster::start();
    for node in &cluster.nodes {
        assert_eq!(node.cli(&["CONFIG", "SET", "maxmemory", "64mb"]).trim(), "OK");
    }
    let limiter = RedisLimiter::builder(cluster.url())
        .prefix("memory-cluster")
        .connect()
        .await
        .expect("the test cluster takes connections");
    let policies = limiter.memory_policies().await.expect("CONFIG GET is allowed");
    assert_eq!(policies.len(), cluster.nodes.len(), "{policies:?}");
    let mut servers: Vec<&str> = policies.iter().map(|p| p.server.as_str()).collect();
    servers.sort_unstable();
    servers.dedup();
    assert_eq!(servers.len(), policies.len(), "one reading per primary: {policies:?}");
    for p in &policies {
        assert_eq!((p.maxmemory, p.policy.as_str()), (64 << 20, "noeviction"), "{p:?}");
        assert!(p.refuses_writes_when_full() && !p.evicts_counters(), "{p:?}");
    }
}

/// A Redis user that may not read the configuration (`-@admin`, as managed services rename
/// `CONFIG`) connects all the same: the policy it cannot read is noted at info level, and
/// decisions go on.
#[tokio::test]
async fn a_redis_user_without_config_rights_connects_with_a_note() {
    let server = RedisServer::start_with(&["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]);
    let created = server.cli(&[
        "ACL",
        "SETUSER",
        "app",
        "on",
        ">app-password",
        "~*",
        "&*",
        "+@all",
        "-@admin",
    ]);
    assert_eq!(created.trim(), "OK");
    let url = format!("redis://app:app-password@127.0.0.1:{}", server.port());
    let (limiter, trace) = connect_and_catch(url).await;
    assert!(trace.events_at_least(Level::WARN).is_empty(), "{:?}", trace.events);
    assert!(
        trace
            .events_at_least(Level::INFO)
            .iter()
            .any(|e| e.message.contains("cannot read Redis's maxmemory-policy")),
        "{:?}",
        trace.events
    );
    assert!(limiter.memory_policies().await.is_err());
    let engine = Engine::builder(rules(PER_IP_5))
        .limiter(limiter)
        .build()
        .expect("engine");
    assert_eq!(admitted(&engine, &ip_ctx("192.0.2.80"), 6).await, 5);
}

/// A client fills Redis (`noeviction`, its `maxmemory` reached: every write refused with
/// `OOM`). Redis still decides: a client whose limit of 5 is spent is refused, 0 of 20,
/// and the requests it would admit fail as a full store ([`is_store_full`], "out of
/// memory"), which the failure policy answers (`fail_open`: admitted, counted as backend
/// errors and fail-open admissions, warned of once). The circuit breaker stays closed: the
/// full store answered. Old behaviour: the OOM errors opened the circuit, and `fail_open`
/// then admitted the spent client too, 20 of 20 (50 of 50 after a flood of 30,000 /64s in
/// `probe_noeviction`).
#[tokio::test]
async fn a_full_redis_still_refuses_spent_clients_and_leaves_only_admissions_to_the_failure_policy() {
    let server = RedisServer::start_with(&["--maxmemory-policy", "noeviction"]);
    let breaker = Arc::new(CircuitBreaker::new(limiter(&server, false).await).failure_threshold(1));
    let engine = Engine::builder(rules(PER_IP_5))
        .limiter(breaker.clone())
        .on_backend_failure(FailurePolicy::FailOpen)
        .recorder(MetricsRecorder::new())
        .build()
        .expect("engine");
    let spent = ip_ctx("203.0.113.9");
    assert_eq!(admitted(&engine, &spent, 6).await, 5);
    // Full: the least memory bound there is.
    assert_eq!(server.cli(&["CONFIG", "SET", "maxmemory", "1"]).trim(), "OK");
    let ((refused, trace), metrics) = metrics_async(trace_async(async {
        for i in 0..3 {
            let d = engine
                .check(&ip_ctx(&format!("2001:db8:{i}::1")))
                .await
                .expect("fail open");
            assert!(d.allowed() && d.failed_open && d.degraded, "{d:?}");
        }
        let mut refused = 0;
        for _ in 0..20 {
            let d = engine.check(&spent).await.expect("a decision");
            refused += u32::from(!d.allowed() && !d.degraded);
        }
        refused
    }))
    .await;
    assert_eq!(refused, 20, "the spent client was admitted while Redis was full");
    assert!(!breaker.is_tripped(), "a full Redis opened the circuit");
    assert_eq!(
        metrics.counter("fluxgate_backend_errors_total", &[("backend", "redis")]),
        3
    );
    assert_eq!(
        metrics.counter("fluxgate_fail_open_total", &[("rule_set", "default")]),
        3
    );
    let warnings = trace.events_at_least(Level::WARN);
    assert_eq!(warnings.len(), 1, "{:?}", trace.events);
    assert!(warnings[0].message.contains("rate-limit store full"), "{warnings:?}");
    // Without a failure policy, the error reaches the caller as a full store.
    let engine = Engine::builder(rules(PER_IP_5))
        .limiter(limiter(&server, false).await)
        .build()
        .expect("engine");
    match engine.check(&ip_ctx("198.51.100.4")).await {
        Err(Error::Backend(e)) => {
            assert!(is_store_full(&*e), "{e}");
            assert!(e.to_string().contains("out of memory"), "{e}");
        }
        other => panic!("a backend failure, not {other:?}"),
    }
    assert_eq!(admitted(&engine, &spent, 3).await, 0);
}

/// `n` requests, each from a /64 of its own, 64 at once.
async fn flood(engine: &Engine, round: u32, n: u32) {
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..64 {
        let engine = engine.clone();
        tasks.spawn(async move {
            for i in (worker..n).step_by(64) {
                let ip = format!("2001:db8:{:x}:{:x}::1", (round << 8) | (i >> 16), i & 0xffff);
                let _ = engine.check(&ip_ctx(&ip)).await;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a probe: minutes on two cores; numbers quoted in docs/redis.md"]
async fn probe_eviction_policies() {
    for policy in [
        "allkeys-lru",
        "allkeys-lfu",
        "allkeys-random",
        "volatile-lru",
        "volatile-lfu",
        "volatile-ttl",
        "volatile-random",
    ] {
        let server = RedisServer::start_with(&["--maxmemory", "3mb", "--maxmemory-policy", policy]);
        let engine = Engine::builder(rules(PER_IP_5))
            .limiter(limiter(&server, false).await)
            .on_backend_failure(FailurePolicy::FailOpen)
            .build()
            .expect("engine");
        let me = ip_ctx("203.0.113.9");
        let start = Instant::now();
        let mut total = 0;
        let rounds = 5;
        for round in 0..rounds {
            total += admitted(&engine, &me, 10).await;
            flood(&engine, round, 30_000).await;
        }
        total += admitted(&engine, &me, 10).await;
        let keys = server.cli(&["DBSIZE"]);
        let evicted = server.info_number("stats", "evicted_keys");
        println!(
            "{policy}: limit 5 per hour, {total} admitted of {} tries over {rounds} floods of 30,000 /64s; dbsize {} evicted {evicted} ({:?})",
            10 * (rounds + 1),
            keys.trim(),
            start.elapsed()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a probe: minutes on two cores; numbers quoted in docs/redis.md"]
async fn probe_noeviction() {
    for (name, policy, breaker) in [
        ("fail_open", FailurePolicy::FailOpen, false),
        ("fail_open+breaker", FailurePolicy::FailOpen, true),
        ("fail_closed", FailurePolicy::FailClosed, false),
        ("fallback_local", FailurePolicy::FallbackLocal, false),
        ("fallback_local+breaker", FailurePolicy::FallbackLocal, true),
    ] {
        let server = RedisServer::start_with(&["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]);
        let limiter = limiter(&server, false).await;
        let builder = Engine::builder(rules(PER_IP_5)).on_backend_failure(policy);
        let builder = if breaker {
            builder.limiter(CircuitBreaker::new(limiter))
        } else {
            builder.limiter(limiter)
        };
        let engine = builder.fallback(MemoryLimiter::default()).build().expect("engine");
        let me = ip_ctx("203.0.113.9");
        let spent = admitted(&engine, &me, 10).await;
        flood(&engine, 0, 30_000).await;
        let (mut ok, mut failed_open, mut degraded) = (0, 0, 0);
        for _ in 0..50 {
            let d = engine.check(&me).await.expect("a decision");
            ok += u32::from(d.allowed());
            failed_open += u32::from(d.failed_open);
            degraded += u32::from(d.degraded);
        }
        let fresh = ip_ctx("198.51.100.1");
        let fresh_ok = admitted(&engine, &fresh, 50).await;
        let err = engine.check(&ip_ctx("198.51.100.2")).await;
        println!(
            "{name}: before flood {spent}/10; spent key after flood {ok}/50 admitted (failed_open {failed_open}, degraded {degraded}); fresh key {fresh_ok}/50; dbsize {}; rejected_calls {:?}; sample {:?}",
            server.cli(&["DBSIZE"]).trim(),
            server.cli(&["INFO", "errorstats"]).trim(),
            err.map(|d| (d.allowed(), d.failed_open, d.degraded)),
        );
    }
}
