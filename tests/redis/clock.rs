//! Redis servers whose clocks are not the application's: every instant of a decision is
//! Redis `TIME`, and what the limiter answers without a call (the deny cache, a lease)
//! keeps counting on Redis's instants, never on the application host's wall clock.

use std::time::Duration;

use fluxgate::core::Decision;

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
    // Redis: the bucket is full again a minute after the first request.
    same_reset(
        offset_ms,
        "the deny cache",
        &from_redis,
        &local,
        Duration::from_secs(60),
    );
}

/// `answer`, made without a call after `from_redis`, reports the same reset instant as
/// Redis's answer, which said the bucket is full in `full_in` (within a sixtieth of it), and
/// the time until it counted down since (by at most a second and a sixtieth): however far
/// Redis's clock (`offset_ms` off the host's) lies from the host's.
fn same_reset(offset_ms: i64, what: &str, from_redis: &Decision, answer: &Decision, full_in: Duration) {
    let (redis_band, band) = (from_redis.binding().expect("a band"), answer.binding().expect("a band"));
    assert!(
        redis_band.reset_after > full_in - full_in / 60 && redis_band.reset_after <= full_in,
        "Redis said the bucket is full in {:?}, not about {full_in:?}",
        redis_band.reset_after
    );
    assert!(
        band.reset_after <= redis_band.reset_after
            && band.reset_after
                > redis_band
                    .reset_after
                    .saturating_sub(Duration::from_secs(1) + full_in / 60),
        "Redis's clock {offset_ms} ms off: Redis said the bucket is full in {:?}, {what} {:?}",
        redis_band.reset_after,
        band.reset_after
    );
    assert_eq!(answer.reset_unix_secs(), from_redis.reset_unix_secs());
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
    // Redis: the lease's 10 permits fill again in 6 s.
    same_reset(offset_ms, "the lease", &from_redis, &leased, Duration::from_secs(6));
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

/// A client's bucket of 10 per minute of `algorithm`, spent on a primary whose clock is the
/// machine's, then decided by its replica, promoted (as a Sentinel failover or a cluster's
/// replica taking over does), whose clock lies `offset_ms` ahead: how many of 20 requests
/// the replica admits at once, the retry-after it then gives, and what the replica held
/// after its promotion (its keys, their values and expiries, its clock), for the message of
/// a failed assertion.
async fn after_a_failover(algorithm: &str, offset_ms: i64) -> (usize, Duration, String) {
    for _ in 0..3 {
        if let Some(run) = failover_in_one_window(algorithm, offset_ms).await {
            return run;
        }
        println!("{algorithm}, offset {offset_ms} ms: the primary's minute ended during the run; again");
    }
    panic!("{algorithm}: three runs in a row crossed the end of the primary's minute")
}

/// The minute of `server`'s clock (`TIME`), counted from the Unix epoch.
fn minute(server: &RedisServer) -> u64 {
    let seconds: u64 = server
        .cli(&["TIME"])
        .split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
        .expect("TIME's seconds");
    seconds / 60
}

/// One run of [`after_a_failover`], or `None` when the primary's minute ended before the
/// replica was promoted. The windows of a minute are aligned on the epoch: a fixed window's
/// key then expires on the primary a second after the minute ends, and the deletion reaches
/// the replica, whose bucket is then new and rightly full, as it would be on a clock
/// that is right.
async fn failover_in_one_window(algorithm: &str, offset_ms: i64) -> Option<(usize, Duration, String)> {
    let primary = RedisServer::start();
    let port = primary.port().to_string();
    let replica = RedisServer::start_with_clock(&["--replicaof", "127.0.0.1", &port], offset_ms);
    let yaml = format!(
        "rule_sets:\n  - id: default\n    rules:\n      - {{ id: per-ip, algorithm: {algorithm}, bands: [{{ capacity: 10, window: 1m }}] }}\n"
    );
    let engine_on = |url: String| {
        let yaml = yaml.clone();
        async move {
            let limiter = fluxgate::redis::RedisLimiter::builder(url)
                .prefix("clock")
                .deny_cache(false)
                // Not a test of the deadline: a busy machine must not hand a call to the
                // failure policy.
                .timeout(Duration::from_secs(5))
                .connect()
                .await
                .expect("connect to the test Redis");
            fluxgate::core::Engine::builder(crate::support::app::rules(&yaml))
                .limiter(limiter)
                .build()
                .expect("Redis decides the rule")
        }
    };
    let client = ctx("192.0.2.42");
    let on_primary = engine_on(primary.url()).await;
    let first_minute = minute(&primary);
    for _ in 0..10 {
        assert!(check(&on_primary, &client).await.allowed());
    }
    assert!(!check(&on_primary, &client).await.allowed());
    assert_eq!(
        primary.cli(&["WAIT", "1", "5000"]).trim(),
        "1",
        "the replica has the writes"
    );
    assert_eq!(replica.cli(&["REPLICAOF", "NO", "ONE"]).trim(), "OK");
    if minute(&primary) != first_minute {
        return None;
    }
    let mut held = format!(
        "the replica's TIME {} against the machine's {:?}; ",
        replica.cli(&["TIME"]).split_whitespace().next().unwrap_or(""),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default(),
    );
    for key in replica.cli(&["KEYS", "*"]).split_whitespace() {
        held.push_str(&format!(
            "{key} = {:?} (PTTL {}); ",
            replica.cli(&["GET", key]).trim(),
            replica.cli(&["PTTL", key]).trim()
        ));
    }
    let on_replica = engine_on(replica.url()).await;
    let mut admitted = 0;
    let mut retry_after = Duration::ZERO;
    for _ in 0..20 {
        let d = check(&on_replica, &client).await;
        if d.allowed() {
            admitted += 1;
        } else {
            retry_after = d.retry_after.expect("a refusal's retry-after");
        }
    }
    Some((admitted, retry_after, held))
}

/// A failover to a replica whose clock is ahead gives every bucket what that much time
/// refills: a whole capacity once the step reaches the window, never more; to a replica
/// whose clock is behind, refuses a client who spent the capacity for the step and up to two
/// windows (documented in docs/redis.md, "Redis's clock").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_replica_whose_clock_is_off_moves_time_for_every_bucket() {
    for algorithm in [
        "token_bucket",
        "leaky_bucket",
        "fixed_window",
        "sliding_window_log",
        "sliding_window_counter",
    ] {
        let (admitted, _, held) = after_a_failover(algorithm, HOUR_MS).await;
        assert_eq!(
            admitted, 10,
            "{algorithm}, a replica an hour ahead: one capacity more, no more ({held})"
        );
        let (admitted, retry_after, held) = after_a_failover(algorithm, -HOUR_MS).await;
        assert_eq!(admitted, 0, "{algorithm}, a replica an hour behind ({held})");
        assert!(
            retry_after > Duration::from_secs(3_600) && retry_after <= Duration::from_secs(3_720),
            "{algorithm}, a replica an hour behind: retry after {retry_after:?}"
        );
    }
}

/// The one-band script writes a whole instant's 13 hexadecimal digits as its high 5 and low
/// 8 (`bit.tohex`) for the instants of 1978 to 2112, and with `%x` for any other: whatever
/// the instant, the stored value is the text `%x` writes, and the script reads it back. Run
/// on a server whose clock stands a day before 2^48 µs (November 1978), the request's cost
/// moving the written instant (now plus the cost, at scale 1) across each edge: below 2^48
/// (12 digits), a low part of 2^31 and more (the sign bit of `bit.tohex`'s 32-bit integers),
/// and the high part's 16 and 20 bits.
#[test]
fn the_one_band_script_writes_every_instant_as_hex_does() {
    use std::time::{SystemTime, UNIX_EPOCH};
    const LOW: i64 = 1 << 32;
    let machine_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64;
    let start_us: i64 = (1 << 48) - 86_400_000_000;
    let server = RedisServer::start_with_clock(&[], start_us / 1_000 - machine_ms);
    let layout = "b0:1/1s|";
    // Each case writes at the instant `target` (a few ms later: the time the call takes).
    let targets = [
        (1 << 48) - 5_000_000,           // 65,535 high: `%x`, 12 digits
        1 << 48,                         // the first instant of 13 digits
        (1 << 48) + (1 << 31) - 500_000, // a low part just below 2^31
        (1 << 48) + (1 << 31),           // and from 2^31
        (1 << 48) + LOW - 500_000,       // a low part of 32 bits
        (1 << 48) + LOW,                 // high 65,537, low 0
        (1 << 52) - 1_000_000_000,       // high 1,048,575
        1 << 52,                         // 2112: `%x`, 14 digits
    ];
    for (i, target) in targets.into_iter().enumerate() {
        let key = format!("hex:{i}");
        let now = server.time_us() as i64;
        let cost = target - now;
        assert!(cost > 0, "case {i}: the server's clock passed {target:x} ({now:x})");
        let eval = |cost: i64| {
            let out = server.cli(&[
                "EVAL",
                fluxgate::redis::ONE_TOKEN_BUCKET_LUA,
                "1",
                &key,
                layout,
                &format!("{:x}", 1_i64 << 53),
                &format!("{cost:x}"),
                "60000",
            ]);
            let numbers: Vec<i64> = out
                .lines()
                .map(|l| {
                    l.trim()
                        .parse()
                        .unwrap_or_else(|_| panic!("case {i}: a reply of numbers: {out}"))
                })
                .collect();
            assert_eq!(numbers.len(), 2, "case {i}: now and the debt: {out}");
            (numbers[0], numbers[1])
        };
        let (now, debt) = eval(cost);
        assert_eq!(debt, 0, "case {i}: a new key owes nothing");
        let at = now + cost;
        let stored = server.cli(&["GET", &key]);
        assert_eq!(
            stored.trim_end(),
            format!("{layout}{at:x}"),
            "case {i}: the instant {at} ({now} + {cost})"
        );
        // Read back: the next call owes what lies between its instant and the one written.
        let (later, debt) = eval(0);
        assert_eq!(debt, at - later, "case {i}: {stored} read back at {later}");
    }
}
