//! Waiting for the refill (`on_limit: { wait: { max_wait, max_waiters } }`) against a real
//! `redis-server`: a waiting request's place is taken in the same script call as the
//! decision, for the exact instant its bands admit it (Redis time, in µs), and kept for
//! it; every algorithm decides as the in-memory limiter does at the same instants; a
//! dropped waiter gives it back; waiting requests proceed no faster than the rate; and a
//! wait the scripts cannot compute exactly is refused when the rules load.
//!
//! Redis reads its own clock, so these tests run in real time. The exact figures they check
//! come from Redis's answers (the decision's instant and the wait), not from the test's
//! clock; where a step took so long that a bucket refilled in between, the test says so
//! instead of asserting.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fluxgate::core::limiter::Wait;
use fluxgate::core::limiter::{AcquireOutcome, AcquireRequest};
use fluxgate::core::{
    Clock, Engine, ManualClock, MemoryLimiter, RateLimiter, RequestContext, RuleSet, Text, WaitPolicy,
};
use fluxgate::redis::{Batching, RedisLimiter};

use crate::support::app::rules;
use crate::support::backend::{at_once, shortest_wait};
use crate::support::redis::{Redis, Servers};

/// A limiter on `redis` with keys under `prefix`, batching its calls when `batching`.
async fn limiter(redis: &Redis, prefix: &str, batching: Option<Batching>) -> RedisLimiter {
    RedisLimiter::builder(redis.url())
        .prefix(prefix)
        .timeout(Duration::from_secs(20))
        .batching(batching)
        .connect()
        .await
        .expect("connect to the test Redis")
}

/// The rule set `default` of `yaml`.
fn rule_set(yaml: &str) -> Arc<RuleSet> {
    rules(yaml).get("default").expect("a rule set `default`").clone()
}

/// A request of the rules at `indexes` of `set`, each keyed `global`, that may wait
/// `max_wait` for each.
fn request(set: &Arc<RuleSet>, indexes: &[usize], max_wait: Duration) -> AcquireRequest {
    let mut request = AcquireRequest::new(set.clone());
    for (at, &rule) in indexes.iter().enumerate() {
        request.push(rule, Text::from("global"));
        request.set_max_wait(at, max_wait);
    }
    request
}

async fn acquire(limiter: &RedisLimiter, request: &AcquireRequest) -> AcquireOutcome {
    limiter.acquire(request).await.expect("Redis decides")
}

/// The decision's Redis time, in µs.
fn at_us(outcome: &AcquireOutcome) -> i64 {
    i64::try_from(outcome.now_unix_nanos / 1_000).expect("a recent instant")
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).expect("a short wait")
}

/// A rule set of one global token-bucket rule, `global`, of `capacity` per `window`,
/// letting its requests wait up to 10 s when `waits`.
fn global(capacity: u64, window: &str, waits: bool) -> String {
    global_of("token_bucket", capacity, window, waits)
}

/// [`global`], of `algorithm`.
fn global_of(algorithm: &str, capacity: u64, window: &str, waits: bool) -> String {
    let on_limit = if waits {
        "\n        on_limit: { wait: { max_wait: 10s, max_waiters: 100 } }"
    } else {
        ""
    };
    format!(
        "rule_sets:\n  - id: default\n    rules:\n      - id: global\n        scope: global\n        \
         algorithm: {algorithm}\n        bands: [{{ capacity: {capacity}, window: {window} }}]{on_limit}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_takes_the_next_free_instant() {
    let redis = Redis::start(Servers::standalone()).await;
    next_free_instants(Some(&redis), limiter(&redis, "next", None).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_takes_the_next_free_instant_in_a_batch() {
    let redis = Redis::start(Servers::standalone()).await;
    next_free_instants(None, limiter(&redis, "next-batched", Some(Batching::new())).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_takes_the_next_free_instant_on_a_cluster() {
    let redis = Redis::start(Servers::shared_cluster()).await;
    next_free_instants(None, limiter(&redis, "next-cluster", None).await).await;
}

/// Two per 10 s: two requests pass at once; each next one that may wait 20 s takes the next
/// permit, 5 s after the one before, exactly as Redis counts it; the one that would wait
/// 25 s is refused and takes nothing. With `standalone` (the limiter's server, its prefix
/// `next`), the key's expiry is checked too.
async fn next_free_instants(standalone: Option<&Redis>, limiter: RedisLimiter) {
    // Two per 10 s: a permit every 5 s.
    let set = rule_set(&global(2, "10s", false));
    let patient = request(&set, &[0], Duration::from_secs(20));
    let first = acquire(&limiter, &patient).await;
    assert!(first.allowed && first.admitted_after.is_zero());
    let t1 = at_us(&first);
    let mut outcomes = vec![acquire(&limiter, &patient).await];
    for _ in 0..5 {
        outcomes.push(acquire(&limiter, &patient).await);
    }
    let last = at_us(outcomes.last().expect("six outcomes"));
    if last - t1 >= 5_000_000 {
        eprintln!(
            "the requests took {} ms, past the first permit's refill: not checked",
            (last - t1) / 1_000
        );
        return;
    }
    // The second passes at once; the n-th (from 3) waits until t1 + (n - 2) × 5 s.
    assert!(outcomes[0].allowed && outcomes[0].admitted_after.is_zero());
    for (n, outcome) in (3..).zip(&outcomes[1..5]) {
        assert!(outcome.allowed, "request {n} waits");
        let expected = t1 + (n - 2) * 5_000_000 - at_us(outcome);
        assert_eq!(micros(outcome.admitted_after), expected, "request {n}");
        let band = &outcome.bands[0];
        assert_eq!(band.remaining, 0);
        // The band is full again once every place taken has passed.
        assert_eq!(
            micros(band.reset_after),
            t1 + n * 5_000_000 - at_us(outcome),
            "request {n}"
        );
    }
    // The seventh would wait 25 s: refused, and told when it could pass.
    let refused = &outcomes[5];
    assert!(!refused.allowed && refused.admitted_after.is_zero());
    let Wait::After(wait) = refused.bands[0].wait else {
        panic!("a refusal with a wait: {:?}", refused.bands[0].wait);
    };
    assert_eq!(micros(wait), t1 + 25_000_000 - at_us(refused));
    // It took no place: one that may wait 30 s gets the same instant.
    let longer = acquire(&limiter, &request(&set, &[0], Duration::from_secs(30))).await;
    assert!(longer.allowed);
    assert_eq!(micros(longer.admitted_after), t1 + 25_000_000 - at_us(&longer));
    // The key outlives the last place taken (35 s after t1), its window and its wait.
    if let Some(redis) = standalone {
        let ttl_ms: i64 = redis
            .server()
            .cli(&["PTTL", "next:{default:global:global}"])
            .trim()
            .parse()
            .expect("a key with an expiry");
        assert!(ttl_ms * 1_000 >= t1 + 35_000_000 - at_us(&longer), "{ttl_ms} ms");
    }
}

/// Two global token-bucket rules: `slow`, 1 per 4 s, and `wide`, 10 per 10 s (a permit a
/// second).
const TWO_RULES: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: slow
        scope: global
        bands: [{ capacity: 1, window: 4s }]
      - id: wide
        scope: global
        bands: [{ capacity: 10, window: 10s }]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_several_rules_waits_for_the_slowest_without_moving_the_others() {
    let redis = Redis::start(Servers::standalone()).await;
    for batching in [None, Some(Batching::new())] {
        let prefix = format!("rules-{}", batching.is_some());
        let limiter = limiter(&redis, &prefix, batching).await;
        several_rules(&limiter).await;
    }
}

async fn several_rules(limiter: &RedisLimiter) {
    let set = rule_set(TWO_RULES);
    let wait = Duration::from_secs(10);
    // `wide` six permits ahead (its instant 6 s ahead), `slow` one (4 s ahead).
    for _ in 0..6 {
        assert!(acquire(limiter, &request(&set, &[1], wait)).await.allowed);
    }
    let slow = acquire(limiter, &request(&set, &[0], wait)).await;
    assert!(slow.allowed);
    let t_slow = at_us(&slow);
    // Both: `slow` admits it 4 s after its request; `wide`'s instant lies past that, so
    // taking its place then is taking it now.
    let both = acquire(limiter, &request(&set, &[0, 1], wait)).await;
    if at_us(&both) - t_slow >= 1_000_000 {
        eprintln!("the requests took over a second: not checked");
        return;
    }
    assert!(both.allowed);
    assert_eq!(micros(both.admitted_after), t_slow + 4_000_000 - at_us(&both));
    // Again: `slow` would admit it 8 s after its first request, past `wide`'s instant
    // (7 s): `wide` would have to jump ahead, holding back its other requests. Refused at
    // once, and neither rule moves.
    let again = acquire(limiter, &request(&set, &[0, 1], wait)).await;
    assert!(!again.allowed && again.admitted_after.is_zero());
    let wide_alone = acquire(limiter, &request(&set, &[1], Duration::ZERO)).await;
    assert!(wide_alone.allowed, "wide kept its three free permits");
    assert_eq!(wide_alone.bands[0].remaining, 2);
}

async fn engine(redis: &Redis, prefix: &str, yaml: &str, batching: Option<Batching>) -> Engine {
    Engine::builder(rules(yaml))
        .limiter(limiter(redis, prefix, batching).await)
        .build()
        .expect("Redis takes the place of these rules' waiting requests")
}

/// The refund script, as the limiter sends it, giving back one permit decided at
/// `decided_us` of a one-band token-bucket rule of 1 per 10 s stored at `key`, with the
/// refund's `expect` (`''`, a state, or `~` and a state); Redis's answer.
fn refund_one_permit(redis: &Redis, key: &str, decided_us: u64, expect: &str) -> String {
    let decided = decided_us.to_string();
    let made = redis.server().time_us().to_string();
    let mark = refund_mark();
    // KEYS: the rule's key, the call's mark; ARGV: decided_us, made_us (the server running),
    // then the band: token bucket (0), 1 permit, capacity 1, scale 1, interval 10,000,000,
    // its layout, position 1 of 1, expect; the mark's ms.
    let args = [
        "EVAL",
        fluxgate::redis::REFUND_LUA,
        "2",
        key,
        &mark,
        &decided,
        &made,
        "0",
        "1",
        "1",
        "1",
        "10000000",
        "b0:1/10s|",
        "1",
        "1",
        expect,
        "10000",
    ];
    redis.server().cli(&args)
}

/// A refund call's mark (the refund script's last key), another for each call.
fn refund_mark() -> String {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    format!("mark:{}", CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// The instant, in µs, at which the global rule's bucket of `key` is full again.
fn stored_instant(redis: &Redis, key: &str) -> i64 {
    redis
        .stored_instant_us(key)
        .unwrap_or_else(|| panic!("a stored instant in {key}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_waiter_gives_its_place_back() {
    let redis = Redis::start(Servers::standalone()).await;
    let engine = engine(&redis, "dropped", &global(1, "2s", true), None).await;
    let ctx = RequestContext::builder().build();
    waiter_dropped(&redis, &engine, &ctx, "dropped:{default:global:global}").await;
}

/// A rule set with a leased rule on other paths: a request of its waiting rule still waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_beside_a_leased_rule_of_its_rule_set() {
    let redis = Redis::start(Servers::standalone()).await;
    let yaml = r#"
rule_sets:
  - id: default
    rules:
      - id: everyone
        match: { paths: ["/api/**"] }
        scope: global
        bands: [{ capacity: 1000, window: 1s }]
        lease: { max: 50, ttl: 1s }
      - id: reports
        match: { paths: ["/reports"] }
        scope: global
        bands: [{ capacity: 1, window: 2s }]
        on_limit: { wait: { max_wait: 10s, max_waiters: 100 } }
"#;
    let engine = engine(&redis, "leased", yaml, None).await;
    let ctx = RequestContext::builder().path("/reports").build();
    waiter_dropped(&redis, &engine, &ctx, "leased:{default:reports:global}").await;
}

/// One request for `ctx` passes; the next waits 2 s for its permit, its place taken in
/// `key`; dropped, it gives the place back.
async fn waiter_dropped(redis: &Redis, engine: &Engine, ctx: &RequestContext, key: &str) {
    assert!(engine.check(ctx).await.expect("a decision").allowed());
    let first = stored_instant(redis, key);
    // A second request waits for the next permit: its place is taken, 2 s further.
    let waiter = tokio::spawn({
        let (engine, ctx) = (engine.clone(), ctx.clone());
        async move { engine.check(&ctx).await }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while stored_instant(redis, key) == first && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(stored_instant(redis, key), first + 2_000_000, "the waiter's place");
    // The client goes away: its place goes back.
    waiter.abort();
    while stored_instant(redis, key) != first && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(stored_instant(redis, key), first, "the place given back");
}

/// A waiting request dropped while its call is out (its client resets the request as soon
/// as it is sent) gives back the place Redis takes for it once the call returns, and holds
/// its waiter's place until then: a request meanwhile may not wait, as when a waiter holds
/// it. Before, the place Redis took was kept for nobody (the next request waited 3.7 s
/// instead of 1.7 s for a permit every 2 s), and the waiter's place was free at once, so
/// that a client dropping its requests had a call out for each, beyond `max_waiters`. On a
/// runtime of one thread, the call goes out only once the test awaits.
#[tokio::test]
async fn a_waiter_dropped_during_its_call_gives_its_place_back() {
    let redis = Redis::start(Servers::standalone()).await;
    let yaml = "rule_sets:\n  - id: default\n    rules:\n      - id: global\n        scope: global\n        \
                bands: [{ capacity: 1, window: 2s }]\n        on_limit: { wait: { max_wait: 10s, max_waiters: 1 } }\n";
    let engine = engine(&redis, "dropped-out", yaml, None).await;
    let key = "dropped-out:{default:global:global}";
    let ctx = RequestContext::builder().build();
    assert!(engine.check(&ctx).await.expect("a decision").allowed());
    let first = stored_instant(&redis, key);
    let calls = redis.server().evalsha_calls();
    let mut waiter = engine.check(&ctx);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(
        std::pin::Pin::new(&mut waiter).poll(&mut cx).is_pending(),
        "the call is out"
    );
    drop(waiter);
    // Its waiter's place is still held: this request may not wait, and is refused at once.
    let meanwhile = engine.check(&ctx).await.expect("a decision");
    assert!(!meanwhile.allowed(), "{meanwhile:?}");
    // Redis has decided the dropped request (and the refused one); its place goes back.
    let deadline = Instant::now() + Duration::from_secs(5);
    while redis.server().evalsha_calls() < calls + 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut stored = redis.stored_instant_us(key);
    while stored != Some(first) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
        stored = redis.stored_instant_us(key);
    }
    let stored = stored.map(|at| at - first);
    assert_eq!(
        stored,
        Some(0),
        "the place given back (the instant stored, from the first's)"
    );
}

/// A place given back only while it is the last one taken: a place taken after it was
/// counted behind it, and giving the earlier one back would let a new request share the
/// later place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_waiter_with_another_behind_it_keeps_its_place() {
    let redis = Redis::start(Servers::standalone()).await;
    let limiter = limiter(&redis, "behind", None).await;
    let set = rule_set(&global(1, "2s", false));
    let key = "behind:{default:global:global}";
    let patient = request(&set, &[0], Duration::from_secs(10));
    assert!(acquire(&limiter, &patient).await.allowed);
    let first = acquire(&limiter, &patient).await;
    let second = acquire(&limiter, &patient).await;
    if first.admitted_after.is_zero() || second.admitted_after.is_zero() {
        eprintln!("the requests took over 2 s: not checked");
        return;
    }
    let at = |o: &AcquireOutcome| o.now_unix_nanos + u64::try_from(o.admitted_after.as_nanos()).unwrap_or(0);
    let last = stored_instant(&redis, key);
    // The first waiter goes: the second is behind it, so nothing moves.
    let give_back = |o: &AcquireOutcome| limiter.give_back_place(&patient, at(o), &o.marks);
    give_back(&first).await.expect("Redis answers");
    assert_eq!(stored_instant(&redis, key), last, "a place behind it: kept");
    // The second, the last place, goes back; then the first, the last one now.
    give_back(&second).await.expect("Redis answers");
    assert_eq!(stored_instant(&redis, key), last - 2_000_000);
    give_back(&first).await.expect("Redis answers");
    assert_eq!(stored_instant(&redis, key), last - 4_000_000);
}

/// A refund across cluster slots (`~` and the state the refunded request left) gives back
/// the part of its permits still ahead of now, and nothing while a waiting request's place
/// lies behind them: the waiter would share its place with the next request. The refund
/// script is run as the limiter would send it, on a standalone server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_across_slots_leaves_a_waiting_place_behind_it_alone() {
    let redis = Redis::start(Servers::standalone()).await;
    let limiter = limiter(&redis, "tilde", None).await;
    // 1 per 10 s: scale 1, a permit 10,000,000 units (µs).
    let set = rule_set(&global(1, "10s", false));
    let key = "tilde:{default:global:global}";
    let refund = |left: &AcquireOutcome| {
        let mark = left.marks[0];
        let state = match (mark >> 64, mark as u64) {
            (tat, 0) => format!("~{tat:x}"),
            (tat, frac) => format!("~{tat:x}:{frac:x}"),
        };
        refund_one_permit(&redis, key, left.now_unix_nanos / 1_000, &state)
    };
    let mut marked = request(&set, &[0], Duration::ZERO);
    marked.mark_places();
    let first = acquire(&limiter, &marked).await;
    assert!(first.allowed && first.marks.len() == 1);
    // Nobody behind: the refund gives the permit back.
    let taken = stored_instant(&redis, key);
    refund(&first);
    assert!(stored_instant(&redis, key) <= taken - 9_000_000, "given back");

    let first = acquire(&limiter, &marked).await;
    let before = stored_instant(&redis, key);
    // A waiting request takes the next place, 10 s after the first.
    let waiter = acquire(&limiter, &request(&set, &[0], Duration::from_secs(20))).await;
    assert!(waiter.allowed && !waiter.admitted_after.is_zero());
    let behind = stored_instant(&redis, key);
    assert_eq!(behind, before + 10_000_000);
    refund(&first);
    assert_eq!(
        stored_instant(&redis, key),
        behind,
        "the waiter's place stays where it was"
    );
}

/// A token bucket's refund across cluster slots whose state has moved since for another
/// reason than requests behind it (a refund of permits taken before it) gives back no more
/// than what has not refilled since the decision: 1 per 10 s, a permit decided 8 s ago
/// whose state said it ends 20 s ahead gives back 2 s at most.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_refund_across_slots_gives_back_no_more_than_has_not_refilled() {
    let redis = Redis::start(Servers::standalone()).await;
    let key = "stale:{default:global:global}";
    let now = i64::try_from(redis.server().time_us()).expect("a recent instant");
    redis
        .server()
        .cli(&["SET", key, &format!("b0:1/10s|{:x}", now + 5_000_000)]);
    let decided = u64::try_from(now - 8_000_000).expect("a recent instant");
    refund_one_permit(&redis, key, decided, &format!("~{:x}", now + 20_000_000));
    let after = stored_instant(&redis, key);
    assert!(
        after >= now + 3_000_000,
        "{} µs ahead: given back more than had not refilled since the decision",
        after - now
    );
}

/// A token-bucket refund on a key that also holds another version of the rule's bands
/// (a rolling change): the request's band is given back, the other version's band is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_refund_keeps_the_bands_of_another_version() {
    let redis = Redis::start(Servers::standalone()).await;
    let key = "versions-refund:{default:global:global}";
    let now = i64::try_from(redis.server().time_us()).expect("a recent instant");
    let other = format!("{:x}", now + 3_000_000_000);
    redis
        .server()
        .cli(&["SET", key, &format!("b0:2/1h,b0:1/10s|{other}|{:x}", now + 9_000_000)]);
    let decided = u64::try_from(now).expect("a recent instant");
    refund_one_permit(&redis, key, decided, "");
    let value = redis.server().cli(&["GET", key]);
    let value = value.trim();
    assert!(value.starts_with("b0:1/10s,b0:2/1h|"), "{value}");
    assert!(
        value.ends_with(&format!("|{other}")),
        "the other version's band kept: {value}"
    );
    // The request's band: 9 s from full, one permit of 10 s given back: full now.
    let ours = value.split('|').nth(1).and_then(|s| i64::from_str_radix(s, 16).ok());
    assert!(ours.is_some_and(|t| t < now + 1_000_000), "given back: {value}");
}

/// A leaky bucket's refund across cluster slots (`~` and the state the refunded request
/// left) gives back only its permits still to leak after now, by that state and by the
/// grid from its decision on: the permits another request took since move back no earlier than
/// they would have come had the refunded request never been there, even when a refund of
/// permits taken before it moved its own earlier than its state says. And nothing while
/// the band holds more than its capacity (a waiting request's place behind). The refund
/// script is run as the limiter would send it, on a standalone server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaky_refund_across_slots_gives_back_only_what_is_still_ahead() {
    let redis = Redis::start(Servers::standalone()).await;
    let key = "leaky-tilde:{default:queue:global}:b0:10/1s:lb";
    let now_us = || i64::try_from(redis.server().time_us()).expect("a recent instant");
    // 10 per second: scale 1, a leak every 100,000 µs. Refunds a request of 5 permits
    // decided at `decided_us` whose own state ended at `end_us`, the band now holding
    // `stored_us`.
    let refund = |stored_us: i64, end_us: i64, decided_us: i64| {
        redis.server().cli(&["SET", key, &stored_us.to_string()]);
        let (decided, expect, mark) = (decided_us.to_string(), format!("~{end_us}:0"), refund_mark());
        let made = redis.server().time_us().to_string();
        let args = [
            "EVAL",
            fluxgate::redis::REFUND_LUA,
            "2",
            key,
            &mark,
            &decided,
            &made,
            "1",
            "5",
            "10",
            "1",
            "100000",
            &expect,
            "10000",
        ];
        redis.server().cli(&args);
        redis
            .server()
            .cli(&["GET", key])
            .trim()
            .split(':')
            .next()
            .and_then(|t| t.parse::<i64>().ok())
            .expect("a stored instant")
    };
    // Nothing came since: the whole cost goes back, five leak intervals, when the refund
    // runs within 50 ms of `now` (before the first of them leaks). Each step is a
    // `redis-cli` process: on a busy machine the refund can run later, and then less goes
    // back; such a run says so and is made again.
    let mut timely = false;
    for _ in 0..5 {
        let now = now_us();
        let after = refund(now + 450_000, now + 450_000, now);
        let late = now_us() - now;
        if late < 50_000 {
            assert_eq!(after, now - 50_000, "the whole cost given back");
            timely = true;
            break;
        }
        eprintln!("the refund ran up to {late} µs after its decision (50,000 at most for this check): again");
        assert!(
            (now - 50_000..=now + 450_000).contains(&after),
            "{} µs ahead",
            after - now
        );
    }
    assert!(
        timely,
        "no refund ran within 50 ms of its decision in 5 tries: the machine is too busy for this test"
    );
    // Cases of a band whose state has changed since the request, in µs from now: the
    // stored instant, the request's end state, its decision, and the least the stored
    // instant may fall to (what may go back is no more than what is still to leak).
    let cases = [
        // The request's permits end 150 ms ahead; another's 5 lie behind them, to 650 ms:
        // at most two of the request's permits still leak after now (at 50 and 150 ms).
        (
            650_000,
            150_000,
            0,
            450_000,
            "given back more than what was still ahead",
        ),
        // Decided 400 ms ago, its state said its permits end 600 ms ahead, but a refund of
        // permits before them has moved them since: of its 500 ms of leaks, at most
        // 100 ms are still to come, one permit.
        (
            300_000,
            600_000,
            -400_000,
            200_000,
            "given back more than had not leaked since the decision",
        ),
        // Decided 300 ms ago, the band holding just the state it left: that state may have
        // come back with other permits behind it, so it proves nothing. Its five permits
        // leak one interval apart from the first grid point after its decision at the
        // earliest (the grid runs through the stored instant): at -250, -150, -50, 50 and
        // 150 ms. Two are still to leak, and only those go back.
        (
            450_000,
            450_000,
            -300_000,
            250_000,
            "given back permits that may have leaked since the decision",
        ),
    ];
    for (stored, end, decided, least, what) in cases {
        let now = now_us();
        let after = refund(now + stored, now + end, now + decided);
        assert!(after >= now + least, "{} µs ahead: {what}", after - now);
        assert!(after <= now + stored, "{} µs ahead: moved forward", after - now);
    }
    // The band holds more than its capacity (1 s of leaks): a waiting place behind, nothing moves.
    let now = now_us();
    assert_eq!(refund(now + 1_500_000, now + 900_000, now), now + 1_500_000);
}

/// A refund for a rule that changed since the request (the stored layout is not the
/// request's) gives back the request's band, matched by name, and leaves the new bands'
/// states as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_under_a_changed_rule_leaves_the_new_bands_alone() {
    let redis = Redis::start(Servers::standalone()).await;
    let key = "changed:{default:global:global}";
    // The rule now has two bands, both ahead of now.
    let ahead = |secs: u64| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970");
        format!("{:x}", (now + Duration::from_secs(secs)).as_micros())
    };
    let stored = format!("b0:1/10s,b1:5/1m|{}|{}", ahead(10), ahead(30));
    redis.server().cli(&["SET", key, &stored]);
    // A refund of the rule's old, one-band layout.
    let decided = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_micros();
    refund_one_permit(&redis, key, u64::try_from(decided).expect("µs fit"), "");
    let value = redis.server().cli(&["GET", key]);
    let value = value.trim();
    // The request's band first (its own layout), then the new band, its state unchanged.
    assert!(value.starts_with("b0:1/10s,b1:5/1m|"), "{value}");
    let states: Vec<&str> = value.split('|').skip(1).collect();
    assert_eq!(states.len(), 2, "{value}");
    assert_eq!(
        states[1],
        stored.split('|').nth(2).expect("b1's state"),
        "b1 untouched: {value}"
    );
    // b0 was 10 s ahead, one permit of 10 s: given back, no later than the refund's now.
    let b0 = u128::from_str_radix(states[0], 16).expect("b0's instant");
    assert!(b0 < decided + 1_000_000, "b0 given back: {value}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_requests_proceed_no_faster_than_the_rate() {
    let redis = Redis::start(Servers::standalone()).await;
    no_faster(&redis, "token_bucket", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_requests_proceed_no_faster_than_the_rate_in_batches() {
    let redis = Redis::start(Servers::standalone()).await;
    no_faster(&redis, "token_bucket", Some(Batching::new())).await;
}

/// The same through a leaky bucket, which the general script decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_requests_of_a_leaky_bucket_proceed_no_faster_than_the_rate() {
    let redis = Redis::start(Servers::standalone()).await;
    no_faster(&redis, "leaky_bucket", None).await;
    no_faster(&redis, "leaky_bucket", Some(Batching::new())).await;
}

/// 5 per second of `algorithm` (a token or leaky bucket), 30 requests at once, each may
/// wait 10 s: all pass, the first five at once and then one every 200 ms, never sooner.
async fn no_faster(redis: &Redis, algorithm: &str, batching: Option<Batching>) {
    let prefix = format!("rate-{algorithm}-{}", batching.is_some());
    let engine = engine(redis, &prefix, &global_of(algorithm, 5, "1s", true), batching).await;
    let answers = at_once(&engine, 30, tokio::time::Instant::now()).await;
    assert!(
        answers.iter().all(|a| a.0),
        "every request waits for its permit: {answers:?}"
    );
    let passed: Vec<Duration> = answers.iter().map(|a| a.1).collect();
    // The k-th to pass (from 0) passes no sooner than (k − 4) × 200 ms after the start
    // (1 ms for Redis's µs against the test's clock).
    for (k, at) in passed.iter().enumerate().skip(5) {
        let earliest = Duration::from_millis(200 * (k as u64 - 4)).saturating_sub(Duration::from_millis(1));
        assert!(*at >= earliest, "request {k} passed at {at:?}, before {earliest:?}");
    }
    let last = passed.last().copied().unwrap_or_default();
    let late = last.saturating_sub(Duration::from_millis(200 * 25));
    eprintln!("the last request passed {late:?} after its instant (the machine's lateness)");
}

/// On a cluster, a waiting rule set has one rule: a request of several rules may span hash
/// slots, and a refund across slots could free a waiting request's place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_only_a_rule_set_of_one_rule_waits() {
    let redis = Redis::start(Servers::shared_cluster()).await;
    let two = format!(
        "{}      - id: other\n        scope: user\n        bands: [{{ capacity: 5, window: 1s }}]\n",
        global(1, "1s", true)
    );
    let error = Engine::builder(rules(&two))
        .limiter(limiter(&redis, "two", None).await)
        .build()
        .expect_err("refused when the rules load")
        .to_string();
    assert!(error.contains("rule `global`") && error.contains("one rule"), "{error}");
    Engine::builder(rules(&global(1, "1s", true)))
        .limiter(limiter(&redis, "one", None).await)
        .build()
        .expect("one rule waits on a cluster");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_backend_refuses_waits_its_scripts_cannot_take() {
    let redis = Redis::start(Servers::standalone()).await;
    // A wait that takes a band's state past the scripts' exact range, in a token bucket
    // and in a leaky bucket.
    for algorithm in ["token_bucket", "leaky_bucket"] {
        let yaml = format!(
            "rule_sets:\n  - id: default\n    rules:\n      - id: huge\n        algorithm: {algorithm}\n        \
             bands: [{{ capacity: 2000003, window: 1s }}]\n        \
             on_limit: {{ wait: {{ max_wait: 1h, max_waiters: 10 }} }}\n"
        );
        let far = Engine::builder(rules(&yaml))
            .limiter(limiter(&redis, algorithm, None).await)
            .build()
            .expect_err("refused when the rules load")
            .to_string();
        assert!(far.contains("rule `huge`") && far.contains("2^52"), "{far}");
    }
}

/// Every algorithm waits on Redis, beside rules of other algorithms, and under the engine's
/// default wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_backend_lets_every_algorithm_wait() {
    let redis = Redis::start(Servers::standalone()).await;
    let mixed = r#"
rule_sets:
  - id: default
    rules:
      - id: patient
        bands: [{ capacity: 1, window: 1s }]
        on_limit: { wait: { max_wait: 1s, max_waiters: 10 } }
      - id: queue
        algorithm: leaky_bucket
        bands: [{ capacity: 1, window: 1s }]
        on_limit: { wait: { max_wait: 1s, max_waiters: 10 } }
      - id: windowed
        algorithm: fixed_window
        bands: [{ capacity: 10, window: 1m }]
      - id: logged
        algorithm: sliding_window_log
        bands: [{ capacity: 10, window: 1m }]
        on_limit: { wait: { max_wait: 1s, max_waiters: 10 } }
      - id: counted
        algorithm: sliding_window_counter
        bands: [{ capacity: 10, window: 1m }]
        on_limit: { wait: { max_wait: 1s, max_waiters: 10 } }
"#;
    Engine::builder(rules(mixed))
        .limiter(limiter(&redis, "mixed", None).await)
        .build()
        .expect("every algorithm waits on Redis");
    Engine::builder(rules(mixed))
        .limiter(limiter(&redis, "defaulted", None).await)
        .wait_on_limit(WaitPolicy::new(Duration::from_secs(1), 10).expect("a valid policy"))
        .build()
        .expect("the engine's default wait applies to every algorithm on Redis");
}

/// Rules of each algorithm, one global key each, for [`every_algorithm_waits_as_in_memory`].
/// The numbers keep every figure a whole number of µs (Redis's unit) in both backends.
const ALGORITHMS: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: leaky
        scope: global
        algorithm: leaky_bucket
        bands: [{ capacity: 2, window: 1s }]
      - id: fixed
        scope: global
        algorithm: fixed_window
        bands: [{ capacity: 3, window: 1s }]
      - id: log
        scope: global
        algorithm: sliding_window_log
        bands: [{ capacity: 3, window: 1s }]
      - id: counter
        scope: global
        algorithm: sliding_window_counter
        bands: [{ capacity: 2, window: 1s }]
      - id: token
        scope: global
        bands: [{ capacity: 4, window: 1s }]
      - id: two_bands
        scope: global
        algorithm: fixed_window
        bands: [{ capacity: 2, window: 500ms }, { capacity: 5, window: 2s }]
      - id: fast_leaky
        scope: global
        algorithm: leaky_bucket
        bands: [{ capacity: 10, window: 1s }]
      - id: long_window
        scope: global
        algorithm: fixed_window
        bands: [{ capacity: 1, window: 10s }]
      - id: shadow_window
        scope: global
        mode: shadow
        algorithm: fixed_window
        bands: [{ capacity: 1, window: 1s }]
"#;

/// Waiting requests of each algorithm, and of a token bucket beside a fixed window, decided
/// by Redis (the general script, alone and in batches) as the in-memory limiter decides
/// them at the same instants (Redis's, to the µs): which are admitted at once, which wait
/// and how long, which are refused and told when to come back, and every band's figures.
/// Then a waiter gives its place back, the last one first and then the first one (kept in
/// a token or leaky bucket while a place lies behind it, given back in a window), on both,
/// and the next requests still agree; then again once the first waiter's instant has come
/// (the places taken in the next window now count in the present one) and, in batches,
/// once a quiet window more has passed (they count as the previous one). A leaky bucket
/// beside a long window is refused rather than made to jump ahead to the window's end
/// (unless its instant already lies there). Beside a shadow window, a request that waits
/// while the shadow rule would refuse it then reports that rule's refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_waits_as_in_memory() {
    let redis = Redis::start(Servers::standalone()).await;
    let mut waited = 0;
    for (batching, quiet) in [(None, false), (Some(Batching::new()), true)] {
        waited += all_alike(&redis, batching, quiet, &ALIKE).await;
    }
    assert!(waited >= 12, "only {waited} requests waited");
}

/// The same on a cluster, where a waiting rule set has one rule: the cases of one rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_waits_as_in_memory_on_a_cluster() {
    let redis = Redis::start(Servers::shared_cluster()).await;
    let one_rule: Vec<_> = ALIKE.iter().filter(|(_, rules, _)| rules.len() == 1).copied().collect();
    let waited = all_alike(&redis, None, false, &one_rule).await;
    assert!(waited >= 5, "only {waited} requests waited");
}

/// The cases of [`every_algorithm_waits_as_in_memory`]: a name, the rules of
/// [`ALGORITHMS`] a request is of, and how long it may wait, in ms.
const ALIKE: [(&str, &[usize], u64); 8] = [
    ("leaky", &[0], 1_500),
    ("fixed", &[1], 1_500),
    ("log", &[2], 1_500),
    ("counter", &[3], 1_500),
    ("token beside fixed", &[4, 1], 1_500),
    ("two bands", &[5], 1_500),
    ("leaky beside a long window", &[6, 7], 15_000),
    ("fixed beside a shadow window", &[1, 8], 1_500),
];

/// [`alike`] for each of `cases`, on `redis`, batching when `batching`, `quiet` or not;
/// the number of requests that waited.
async fn all_alike(redis: &Redis, batching: Option<Batching>, quiet: bool, cases: &[(&str, &[usize], u64)]) -> usize {
    let set = rule_set(ALGORITHMS);
    let mut waited = 0;
    for &(name, indexes, max_wait) in cases {
        let prefix = format!("alike-{}-{}", batching.is_some(), name.replace(' ', "-"));
        let redis_limiter = limiter(redis, &prefix, batching).await;
        let case = format!("{name}, batched: {}", batching.is_some());
        let patient = request(&set, indexes, Duration::from_millis(max_wait));
        waited += alike(&redis_limiter, &patient, &case, quiet).await;
    }
    waited
}

/// Decides `request` on `limiter` and on an in-memory limiter at Redis's instants, step by
/// step, and checks that they agree; the number of requests that waited. The last steps
/// come once the first waiter's instant has passed, and with `quiet` a window later.
async fn alike(limiter: &RedisLimiter, request: &AcquireRequest, case: &str, quiet: bool) -> usize {
    // Moved to each of Redis's instants in turn.
    let clock = ManualClock::new(0);
    let memory = MemoryLimiter::builder().clock(clock.clone()).build();
    let both = async |step: &str| {
        let on_redis = acquire(limiter, request).await;
        let ahead = on_redis.now_unix_nanos.checked_sub(clock.now_nanos());
        clock.advance(Duration::from_nanos(ahead.expect("Redis time goes forward")));
        let in_memory = memory.acquire_now(request);
        assert_eq!(show(&on_redis), show(&in_memory), "{case}, {step}");
        (on_redis, in_memory)
    };
    let mut waiters = Vec::new();
    let mut first_place = None;
    for n in 0..8 {
        let (on_redis, in_memory) = both(&format!("request {n}")).await;
        if on_redis.allowed && !on_redis.admitted_after.is_zero() {
            first_place.get_or_insert(Instant::now() + on_redis.admitted_after);
            waiters.push((on_redis, in_memory));
        }
    }
    let count = waiters.len();
    // The last waiter, then the first, give their places back, on both backends.
    let give_back = async |(on_redis, in_memory): &(AcquireOutcome, AcquireOutcome)| {
        let at = |o: &AcquireOutcome| o.now_unix_nanos + u64::try_from(o.admitted_after.as_nanos()).unwrap_or(0);
        limiter
            .give_back_place(request, at(on_redis), &on_redis.marks)
            .await
            .expect("Redis answers");
        memory.give_back_now(request, at(in_memory), Some(&in_memory.marks));
    };
    if let Some(last) = waiters.last() {
        give_back(last).await;
    }
    if count > 1 {
        give_back(&waiters[0]).await;
    }
    for n in 0..3 {
        both(&format!("request {n} after the give-backs")).await;
    }
    // Once the first place's instant has come (a window's places taken in the next window
    // now count in the present one), or, `quiet`, a window of 1 s later with no request in
    // between (they count as the previous window's), the next requests still agree.
    if let Some(first_place) = first_place {
        let quiet_for = if quiet { Duration::from_secs(1) } else { Duration::ZERO };
        tokio::time::sleep_until((first_place + quiet_for + Duration::from_millis(2)).into()).await;
        for n in 0..3 {
            both(&format!("request {n} after the first place's instant, quiet: {quiet}")).await;
        }
    }
    count
}

/// A request waits only as long as every rule that refuses it allows (the in-memory test
/// of the same name): on Redis, through the token-bucket scripts (`quick` a token bucket)
/// and the general one (`quick` a leaky bucket).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_no_longer_than_every_refusing_rule_allows() {
    let redis = Redis::start(Servers::standalone()).await;
    for algorithm in ["token_bucket", "leaky_bucket"] {
        let yaml = shortest_wait(algorithm);
        let engine = engine(&redis, &format!("shortest-{algorithm}"), &yaml, None).await;
        let check_on = async |path: &str| {
            engine
                .check(&RequestContext::builder().path(path).build())
                .await
                .expect("a decision")
        };
        let start = Instant::now();
        assert!(check_on("/slow").await.allowed());
        for _ in 0..9 {
            assert!(check_on("/fast").await.allowed());
        }
        if start.elapsed() >= Duration::from_secs(1) {
            eprintln!("{algorithm}: the requests took over a second, quick refilled: not checked");
            continue;
        }
        let prefix = format!("shortest-{algorithm}");
        let quick = match algorithm {
            "leaky_bucket" => format!("{prefix}:{{default:quick:global}}:b0:10/10s:lb"),
            _ => format!("{prefix}:{{default:quick:global}}"),
        };
        let keys = [quick, format!("{prefix}:{{default:slow:global}}")];
        let stored = || {
            keys.iter()
                .map(|key| redis.server().cli(&["GET", key]))
                .collect::<Vec<_>>()
        };
        let before = stored();
        let asked = Instant::now();
        let refused = check_on("/slow").await;
        assert!(!refused.allowed(), "{algorithm}: a wait of 4 s past quick's 1.5 s");
        assert!(asked.elapsed() < Duration::from_secs(1), "{algorithm}: refused at once");
        assert_eq!(stored(), before, "{algorithm}: the refused request took no place");
    }
}

/// A key outlives every place a waiting request took in it, by the second every key keeps
/// past its last instant: a leaky bucket its instant, a fixed window the end of the place's
/// window, a sliding window counter the end of the window after it (where the place still
/// counts as the previous window), a sliding window log the place's entry leaving the
/// window. Checked from Redis's own clock and the key's `PTTL`, read together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_outlives_the_places_waiting_requests_take() {
    const W: i64 = 1_000_000;
    let redis = Redis::start(Servers::standalone()).await;
    let set = rule_set(ALGORITHMS);
    // The instant a key must outlive, from its place's instant and the band's reset.
    type Last = fn(i64, i64) -> i64;
    let cases: [(usize, &str, Last); 4] = [
        (0, "leaky:global}:b0:2/1s:lb", |_, reset_end| reset_end),
        (1, "fixed:global}:b0:1s:fw", |at, _| at - at % W + W),
        (2, "log:global}:b0:1s:swl", |at, _| at + W),
        (3, "counter:global}:b0:1s:swc", |at, _| at - at % W + 2 * W),
    ];
    for (rule, key, last) in cases {
        let prefix = format!("ttl-{rule}");
        let limiter = limiter(&redis, &prefix, None).await;
        let patient = request(&set, &[rule], Duration::from_secs(15));
        let mut waiter = None;
        for _ in 0..10 {
            let outcome = acquire(&limiter, &patient).await;
            if outcome.allowed && !outcome.admitted_after.is_zero() {
                waiter = Some(outcome);
                break;
            }
        }
        let waiter = waiter.unwrap_or_else(|| panic!("{key}: no request waited"));
        let at = at_us(&waiter) + micros(waiter.admitted_after);
        let reset_end = at_us(&waiter) + micros(waiter.bands[0].reset_after);
        let key = format!("{prefix}:{{default:{key}");
        let read = redis.server().cli(&[
            "EVAL",
            "local t = redis.call('TIME') return {t[1], t[2], redis.call('PTTL', KEYS[1])}",
            "1",
            &key,
        ]);
        let numbers: Vec<i64> = read.split_whitespace().filter_map(|n| n.parse().ok()).collect();
        let [secs, us, ttl_ms] = numbers[..] else {
            panic!("{key}: TIME and PTTL, not {read:?}");
        };
        let expires = secs * W + us + ttl_ms * 1_000;
        // PTTL counts whole ms: 1 ms of slack.
        assert!(
            expires >= last(at, reset_end) + W - 1_000,
            "{key} expires at {expires}, before {} and its second",
            last(at, reset_end)
        );
    }
}

/// What a decision says, for comparing two: the verdicts, the wait before admission, and
/// each band's verdict, figures and wait.
fn show(outcome: &AcquireOutcome) -> String {
    let mut text = format!(
        "allowed {} shadow {} after {:?}",
        outcome.allowed, outcome.shadow_allowed, outcome.admitted_after
    );
    for band in outcome.bands.iter() {
        text.push_str(&format!(
            " | {}/{} {} rem {} reset {:?} wait {:?}",
            band.rule, band.band, band.allowed, band.remaining, band.reset_after, band.wait
        ));
    }
    text
}

/// Redis restarted with an empty dataset while a request waited for the next window: its
/// place was counted in the counters that were lost, so when the waiter is dropped,
/// nothing of the fresh count goes back (old behaviour: the next window, whose places
/// were all taken after the restart, took one more than its capacity).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_place_taken_before_redis_restarted_gives_nothing_back_into_the_fresh_count() {
    let mut redis = Redis::start(Servers::standalone()).await;
    for batching in [None, Some(Batching::new())] {
        let algorithm = "fixed_window";
        let prefix = format!("restart-{}", batching.is_some());
        let limiter = limiter(&redis, &prefix, batching).await;
        // 2 an hour, each request may wait for the next hour.
        let set = rule_set(&global_of(algorithm, 2, "1h", false));
        let wait = request(&set, &[0], Duration::from_secs(7_200));
        let hour = 3_600_000_000;
        let window = redis.server().time_us() / hour;
        let admitted = |o: &AcquireOutcome| o.allowed && o.admitted_after.is_zero();
        let later = |o: &AcquireOutcome| o.allowed && !o.admitted_after.is_zero();
        for _ in 0..2 {
            assert!(admitted(&acquire(&limiter, &wait).await), "{algorithm}: the window's 2");
        }
        let waiter = acquire(&limiter, &wait).await;
        assert!(later(&waiter), "{algorithm}: a place in the next window");
        // Its data gone, the server starts again on the same port; the limiter reconnects.
        redis.server_mut().restart();
        tokio::time::sleep(Duration::from_millis(300)).await;
        // The restarted server counts afresh: 2 now, then both places of the next window.
        let mut fresh = Vec::new();
        for _ in 0..5 {
            fresh.push(acquire(&limiter, &wait).await);
        }
        assert_eq!(fresh.iter().filter(|o| admitted(o)).count(), 2, "{algorithm}");
        assert_eq!(fresh.iter().filter(|o| later(o)).count(), 2, "{algorithm}");
        // The first waiter is dropped: its place, taken before the restart, is not in the
        // next window's count.
        let at = waiter.now_unix_nanos + u64::try_from(waiter.admitted_after.as_nanos()).expect("short");
        limiter
            .give_back_place(&wait, at, &waiter.marks)
            .await
            .expect("answered");
        let another = acquire(&limiter, &wait).await;
        if redis.server().time_us() / hour != window {
            eprintln!("{algorithm}: the hour ended during the test: not checked");
            continue;
        }
        assert!(
            !another.allowed,
            "{algorithm}: a third place in the next window of 2, all taken after the restart: {}",
            show(&another)
        );
    }
}
