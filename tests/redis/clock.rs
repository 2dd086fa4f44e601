//! Redis servers whose clocks are not the application's: every instant of a decision is
//! Redis `TIME`, and what the limiter answers without a call (the deny cache, a lease)
//! keeps counting on Redis's instants, never on the application host's wall clock.

use std::time::Duration;

use crate::support::backend::{check, ctx, engine};
use crate::support::redis::{Redis, Servers};
use crate::support::servers::RedisServer;

/// An hour, the offset of the servers' clocks, in ms.
const HOUR_MS: i64 = 3_600_000;

/// A per-IP token bucket of 2 per minute, as a client sees it refused: by Redis, then by the
/// deny cache of its instance. The deny cache repeats Redis's reset instant and counts
/// down the time to it on the process's monotonic clock, however far Redis's clock lies
/// from the application host's.
async fn refused_by_redis_then_locally(offset_ms: i64) {
    let redis = Redis::start(Servers::Standalone(RedisServer::start_with_clock(&[], offset_ms))).await;
    let engine = engine(
        &redis,
        "rule_sets:\n  - id: default\n    rules:\n      - { id: per-ip, bands: [{ capacity: 2, window: 1m }] }\n",
    );
    let client = ctx("192.0.2.40");
    for _ in 0..2 {
        assert!(check(&engine, &client).await.allowed());
    }
    let from_redis = check(&engine, &client).await;
    assert!(!from_redis.allowed());
    let calls = redis.server().evalsha_calls();
    let local = check(&engine, &client).await;
    assert!(!local.allowed());
    assert_eq!(redis.server().evalsha_calls(), calls, "answered by the deny cache");
    let (redis_band, local_band) = (from_redis.binding().expect("a band"), local.binding().expect("a band"));
    // Redis: the bucket is full again a minute after the first request.
    assert!(
        redis_band.reset_after > Duration::from_secs(59),
        "{:?}",
        redis_band.reset_after
    );
    assert!(
        redis_band.reset_after <= Duration::from_secs(60),
        "{:?}",
        redis_band.reset_after
    );
    assert!(
        local_band.reset_after <= redis_band.reset_after && local_band.reset_after > Duration::from_secs(58),
        "Redis's clock {offset_ms} ms off: Redis said the bucket is full in {:?}, the deny cache {:?}",
        redis_band.reset_after,
        local_band.reset_after
    );
    assert_eq!(local.reset_unix_secs(), from_redis.reset_unix_secs());
}

/// Redis's clock an hour behind the application host's: the deny cache's refusals said the
/// bucket was full again at once (`RateLimit: …;t=0`, `X-RateLimit-Reset` now), where Redis's
/// said 60 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deny_cache_counts_the_reset_on_redis_clock_when_it_is_behind() {
    refused_by_redis_then_locally(-HOUR_MS).await;
}

/// Redis's clock an hour ahead of the application host's: the deny cache's refusals said the
/// bucket was full again in an hour and a minute, where Redis's said 60 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deny_cache_counts_the_reset_on_redis_clock_when_it_is_ahead() {
    refused_by_redis_then_locally(HOUR_MS).await;
}

/// A leased token bucket of 100 per minute (leases of 10): the first request's call takes
/// 10 permits, which fill again in 6 s; the next request, admitted from the lease without a
/// call, reports the same reset instant and the time until it counted down since the call,
/// however far Redis's clock lies from the application host's.
async fn admitted_by_redis_then_from_the_lease(offset_ms: i64) {
    let redis = Redis::start(Servers::Standalone(RedisServer::start_with_clock(&[], offset_ms))).await;
    let engine = engine(
        &redis,
        "rule_sets:\n  - id: default\n    rules:\n      - { id: everyone, scope: global, bands: [{ capacity: 100, window: 1m }], lease: { max: 10, ttl: 1h } }\n",
    );
    let client = ctx("192.0.2.41");
    let from_redis = check(&engine, &client).await;
    assert!(from_redis.allowed());
    let calls = redis.server().evalsha_calls();
    let leased = check(&engine, &client).await;
    assert!(leased.allowed());
    assert_eq!(redis.server().evalsha_calls(), calls, "admitted from the lease");
    let (redis_band, leased_band) = (from_redis.binding().expect("a band"), leased.binding().expect("a band"));
    assert!(
        redis_band.reset_after > Duration::from_millis(5_900),
        "{:?}",
        redis_band.reset_after
    );
    assert!(
        redis_band.reset_after <= Duration::from_secs(6),
        "{:?}",
        redis_band.reset_after
    );
    assert!(
        leased_band.reset_after <= redis_band.reset_after && leased_band.reset_after > Duration::from_secs(5),
        "Redis's clock {offset_ms} ms off: Redis said the bucket is full in {:?}, the lease {:?}",
        redis_band.reset_after,
        leased_band.reset_after
    );
    assert_eq!(leased.reset_unix_secs(), from_redis.reset_unix_secs());
}

/// Redis's clock an hour behind: requests admitted from a lease said the bucket was full at
/// once (`t=0`), where Redis said 6 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_counts_the_reset_on_redis_clock_when_it_is_behind() {
    admitted_by_redis_then_from_the_lease(-HOUR_MS).await;
}

/// Redis's clock an hour ahead: requests admitted from a lease said the bucket was full in an
/// hour and 6 s, where Redis said 6 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_counts_the_reset_on_redis_clock_when_it_is_ahead() {
    admitted_by_redis_then_from_the_lease(HOUR_MS).await;
}
