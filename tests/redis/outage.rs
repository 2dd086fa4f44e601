//! Redis going away and coming back: the failure policy answers within the deadline, the
//! circuit breaker stops paying the deadline, and decisions come from Redis again soon
//! after it returns. Every limit on a duration allows for how late the machine's own timers
//! fired in the same stretch, so the other tests of this binary running at the same time
//! are not mistaken for a slow limiter.

use std::future::Future;
use std::pin::Pin;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::support::app::rules;
use crate::support::lateness::with_lateness;
use crate::support::proxy::{proxy, Side, Step, Twist};
use crate::support::servers::{RedisCluster, RedisServer};
use fluxgate::core::reload::ReloadingRuleSetProvider;
use fluxgate::core::{CircuitBreaker, Decision, Error, FailurePolicy, MaybeReady};
use fluxgate::core::{Engine, MemoryLimiter, RequestContext};
use fluxgate::redis::{Batching, RedisLimiter};

const DEADLINE: Duration = Duration::from_millis(50);
const SLACK: Duration = Duration::from_millis(20);

async fn limiter(server: &RedisServer) -> RedisLimiter {
    limiter_within(server, DEADLINE).await
}

/// [`limiter`] with another deadline.
async fn limiter_within(server: &RedisServer, deadline: Duration) -> RedisLimiter {
    RedisLimiter::builder(server.url())
        .timeout(deadline)
        .reconnect_delay(Duration::from_millis(50))
        .deny_cache(false)
        .connect()
        .await
        .expect("connect")
}

async fn engine(server: &RedisServer) -> Engine {
    let limiter = limiter(server).await;
    let rules = rules(
        "rule_sets:\n  - id: default\n    rules:\n      - id: per-ip\n        bands: [{ capacity: 1000, window: 1h }]\n",
    );
    Engine::builder(rules)
        .limiter(
            CircuitBreaker::new(limiter)
                .failure_threshold(1)
                .cool_down(Duration::from_millis(100)),
        )
        .fallback(MemoryLimiter::default())
        .build()
        .expect("the backend decides every rule")
}

fn ctx() -> RequestContext {
    RequestContext::builder()
        .client_ip("192.0.2.77".parse().expect("an address"))
        .build()
}

/// The slowest answer of 50 checks during an outage, and the machine's own lateness in the
/// same stretch: how late a timer of the deadline fired between some of the checks, or a
/// thread of the test's own woke at any time, at worst. A request may take the deadline
/// plus the slack plus that lateness; a busy machine is not a slow limiter.
async fn slowest_answer(engine: &Engine) -> (Duration, Duration) {
    let ((slowest, late), stalled) = with_lateness(async {
        let (mut slowest, mut late) = (Duration::ZERO, Duration::ZERO);
        for i in 0..50 {
            let start = Instant::now();
            let d = engine.check(&ctx()).await.expect("the fallback decides");
            slowest = slowest.max(start.elapsed());
            assert!(d.degraded);
            if i % 10 == 0 {
                let start = Instant::now();
                tokio::time::sleep(DEADLINE).await;
                late = late.max(start.elapsed().saturating_sub(DEADLINE));
            }
        }
        (slowest, late)
    })
    .await;
    (slowest, late.max(stalled))
}

/// Requests until one is decided by Redis again; returns how long that took.
async fn until_recovered(engine: &Engine) -> Duration {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        let d = engine.check(&ctx()).await.expect("the fallback decides");
        if !d.degraded {
            return start.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("decisions did not come from Redis again within 5 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_then_restarted() {
    let mut server = RedisServer::start();
    let engine = engine(&server).await;
    assert!(!engine.check(&ctx()).await.unwrap().degraded);

    server.kill();
    let (slowest, late) = slowest_answer(&engine).await;
    assert!(
        slowest <= DEADLINE + SLACK + late,
        "a request waited {slowest:?} during the outage (timers were late by up to {late:?})"
    );

    server.restart();
    let recovered = until_recovered(&engine).await;
    eprintln!("outage: slowest answer {slowest:?}; Redis decided again {recovered:?} after the restart");
    assert!(
        recovered <= Duration::from_secs(1),
        "Redis decided again only after {recovered:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_redis_blocks_no_request_beyond_the_deadline() {
    let server = RedisServer::start();
    let engine = engine(&server).await;
    assert!(!engine.check(&ctx()).await.unwrap().degraded);

    let signal = |sig: &str| {
        let ok = Command::new("kill")
            .args([sig, &server.pid().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    };
    let health = limiter(&server).await;
    let healthy = health.health().await.unwrap();
    assert!(healthy.latency < DEADLINE);
    assert_eq!(healthy.cluster_state, None);
    signal("-STOP");
    let (slowest, late) = slowest_answer(&engine).await;
    let start = Instant::now();
    assert!(health.health().await.is_err(), "a frozen Redis is not healthy");
    let health_took = start.elapsed();
    signal("-CONT");
    assert!(
        health_took <= DEADLINE + SLACK + late,
        "the health check took {health_took:?} (timers were late by up to {late:?})"
    );
    assert!(
        slowest <= DEADLINE + SLACK + late,
        "a request waited {slowest:?} while Redis was frozen (timers were late by up to {late:?})"
    );
    let recovered = until_recovered(&engine).await;
    eprintln!("frozen: slowest answer {slowest:?}; Redis decided again {recovered:?} after SIGCONT");
    assert!(
        recovered <= Duration::from_secs(1),
        "Redis decided again only after {recovered:?}"
    );
}

/// The admissions of `n` checks of `ctx`, and how many of them the fallback decided.
async fn admissions(engine: &Engine, ctx: &RequestContext, n: usize) -> (usize, usize) {
    let (mut admitted, mut degraded) = (0, 0);
    for _ in 0..n {
        let d = engine.check(ctx).await.expect("the fallback decides");
        if d.allowed() {
            admitted += 1;
            if d.degraded {
                degraded += 1;
            }
        }
    }
    (admitted, degraded)
}

/// Freezes Redis and has `bystander`'s request open the circuit (it misses the deadline);
/// then `n` checks of `client` while the circuit is open: its admissions, and whether they
/// all ran within the cool-down (a busy machine may let a check probe, which the deny cache
/// answers).
async fn during_an_outage(
    server: &RedisServer,
    engine: &Engine,
    bystander: &RequestContext,
    client: &RequestContext,
    n: usize,
    cool_down: Duration,
) -> (usize, bool) {
    server.signal("-STOP");
    let start = Instant::now();
    let opened = engine.check(bystander).await.expect("the fallback decides");
    assert!(opened.degraded, "a frozen Redis leaves the decision to the fallback");
    let (admitted, degraded) = admissions(engine, client, n).await;
    let in_time = start.elapsed() < cool_down;
    server.signal("-CONT");
    assert_eq!(admitted, degraded, "only the fallback admits while the circuit is open");
    (admitted, in_time)
}

/// An engine deciding a per-IP rule of `limit` per hour on `server`, the rule's YAML ending
/// with `more` (a `lease`, an `on_limit`), behind a circuit breaker that opens at the first
/// failure for `cool_down`, with the in-memory fallback; a client, and a bystander whose
/// requests open and probe the circuit.
async fn with_fallback_and(
    server: &RedisServer,
    limit: usize,
    more: &str,
    cool_down: Duration,
) -> (Engine, RequestContext, RequestContext) {
    let limiter = limiter(server).await;
    let rules = rules(&format!(
        "rule_sets:\n  - id: default\n    rules:\n      - id: per-ip\n        bands: [{{ capacity: {limit}, window: 1h }}]\n{more}"
    ));
    let engine = Engine::builder(rules)
        .limiter(CircuitBreaker::new(limiter).failure_threshold(1).cool_down(cool_down))
        .fallback(MemoryLimiter::default())
        .build()
        .expect("the backend decides every rule");
    let bystander = RequestContext::builder()
        .client_ip("198.51.100.3".parse().expect("an address"))
        .build();
    (engine, ctx(), bystander)
}

/// Waits until the circuit has closed again: a bystander's decision comes from Redis.
async fn circuit_closed(engine: &Engine, bystander: &RequestContext) {
    let start = Instant::now();
    while engine.check(bystander).await.expect("decided").degraded {
        assert!(start.elapsed() < Duration::from_secs(10), "the circuit never closed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `fallback_local` starts from what this process was admitted: every admission Redis
/// makes for the rule is charged to its in-memory bucket too, so a client that spent part
/// of its limit through this instance gets only the rest from memory when the circuit
/// opens; and what memory admitted, Redis's next call for the bucket takes, so after the
/// outage Redis does not admit it again (security.md, section 5). The in-memory bucket is
/// the same one at every outage: the circuit opening again gives it no fresh capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_local_starts_from_what_redis_admitted_through_this_instance() {
    const LIMIT: usize = 5;
    const SPENT: usize = 3;
    let AfterAnOutage {
        server,
        engine,
        client,
        bystander,
        by_redis,
        by_memory: first,
        in_time: first_in_time,
    } = after_an_outage(LIMIT, "", SPENT, 2 * LIMIT).await;
    let (again, _) = admissions(&engine, &client, 2 * LIMIT).await;
    let (second, _) = during_an_outage(&server, &engine, &bystander, &client, 2 * LIMIT, COOL_DOWN).await;

    let total = by_redis + first + again + second;
    eprintln!(
        "limit {LIMIT} per hour: Redis admitted {by_redis}, the fallback {first} in the first outage \
         (within the cool-down: {first_in_time}), Redis {again} after it and the fallback {second} in the \
         second; {total} in all"
    );
    if first_in_time {
        assert_eq!(
            first,
            LIMIT - SPENT,
            "the fallback's bucket starts from what Redis admitted through this instance"
        );
    }
    assert!(
        first <= LIMIT - SPENT,
        "{first} admitted by the fallback, past the rest of the limit"
    );
    assert_eq!(
        again,
        LIMIT - SPENT - first,
        "Redis admits what neither it nor memory admitted"
    );
    assert_eq!(second, 0, "a second outage gives the fallback no fresh capacity");
    assert_eq!(total, LIMIT, "{total} admitted of a limit of {LIMIT}");
}

/// What `fallback_local` admits while Redis fails, Redis counts once it answers again: the
/// next call of each bucket takes it with the request's own permits, so a client admitted
/// by memory during an outage gets from Redis only the rest of its limit afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_fallback_local_admits_redis_counts_after_the_outage() {
    const LIMIT: usize = 5;
    const DURING: usize = 2;
    let AfterAnOutage {
        server: _server,
        engine,
        client,
        by_memory: during,
        ..
    } = after_an_outage(LIMIT, "", 0, DURING).await;
    assert_eq!(during, DURING, "memory admits within the limit");
    let first = engine.check(&client).await.expect("decided");
    assert!(first.allowed() && !first.degraded, "{first:?}");
    assert_eq!(
        first.remaining(),
        Some((LIMIT - DURING - 1) as u64),
        "Redis's first call takes what memory admitted"
    );
    let (after, degraded) = admissions(&engine, &client, 2 * LIMIT).await;
    assert_eq!(degraded, 0, "Redis decides after the outage");
    let total = during + 1 + after;
    eprintln!(
        "limit {LIMIT} per hour: memory admitted {during} during the outage, Redis {} after it",
        1 + after
    );
    assert_eq!(total, LIMIT, "{total} admitted of a limit of {LIMIT}");
}

/// What memory admitted during an outage stays owed when the request that took it is
/// abandoned, as a client gone, an HTTP/2 reset or an outer timeout drops it: before its
/// call was made, or while the call is out. The call runs to its end, and Redis refusing it
/// (the client spent its limit through Redis and memory) leaves the owed permits for the
/// next call. Dropped with the request, they were forgotten, and Redis admitted them again:
/// 3 by Redis, 2 by memory, then 2 more by Redis, 7 of a limit of 5, either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_request_leaves_what_memory_admitted_owed() {
    const LIMIT: usize = 5;
    const SPENT: usize = 3;
    for call_out in [false, true] {
        let mut attempts = 0;
        let (by_redis, by_memory, again) = loop {
            attempts += 1;
            let AfterAnOutage {
                server,
                engine,
                client,
                by_redis,
                by_memory,
                ..
            } = after_an_outage(LIMIT, "", SPENT, 2 * LIMIT).await;
            let calls = server.evalsha_calls();
            if call_out {
                // Made while Redis is frozen: out, and unanswered, when it is dropped.
                let start = Instant::now();
                server.signal("-STOP");
                let dropped = tokio::time::timeout(Duration::from_millis(5), engine.check(&client)).await;
                server.signal("-CONT");
                if start.elapsed() >= DEADLINE / 2 && attempts < 5 {
                    // A busy machine: the call may have missed its deadline (and been
                    // answered by the failure policy before the 5 ms were up), and opened
                    // the circuit. Made again.
                    continue;
                }
                assert!(dropped.is_err(), "dropped before Redis answered");
            } else {
                drop(engine.check(&client));
            }
            // Redis runs the abandoned call, and its answer settles what the call took.
            let start = Instant::now();
            while server.evalsha_calls() == calls && start.elapsed() < Duration::from_secs(5) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            let (again, degraded) = admissions(&engine, &client, 2 * LIMIT).await;
            assert_eq!(degraded, 0, "Redis decides after the outage");
            break (by_redis, by_memory, again);
        };
        let total = by_redis + by_memory + again;
        eprintln!(
            "limit {LIMIT} per hour, a request dropped {}: Redis admitted {by_redis}, memory {by_memory}, \
             then Redis {again}; {total} in all",
            if call_out {
                "with its call out"
            } else {
                "before its call"
            }
        );
        assert_eq!(total, LIMIT, "{total} admitted of a limit of {LIMIT}");
    }
}

/// An engine of [`with_fallback_and`] on a server of its own, after `before` checks of the
/// client with Redis up, then `during` while the circuit is open, and the circuit closed
/// again.
struct AfterAnOutage {
    /// The server: Redis stops when it is dropped.
    server: RedisServer,
    engine: Engine,
    client: RequestContext,
    bystander: RequestContext,
    /// The client's admissions before the outage, all by Redis.
    by_redis: usize,
    /// Its admissions during the outage, all by memory.
    by_memory: usize,
    /// Whether the outage's checks ran within the cool-down.
    in_time: bool,
}

/// The circuit's cool-down in the tests of owed permits.
const COOL_DOWN: Duration = Duration::from_millis(300);

/// [`AfterAnOutage`] of a `fallback_local` rule of `limit` per hour ending with `more`.
async fn after_an_outage(limit: usize, more: &str, before: usize, during: usize) -> AfterAnOutage {
    let server = RedisServer::start();
    let (engine, client, bystander) = with_fallback_and(&server, limit, more, COOL_DOWN).await;
    let (by_redis, degraded) = admissions(&engine, &client, before).await;
    assert_eq!((by_redis, degraded), (before, 0), "Redis admits the first requests");
    let (by_memory, in_time) = during_an_outage(&server, &engine, &bystander, &client, during, COOL_DOWN).await;
    circuit_closed(&engine, &bystander).await;
    AfterAnOutage {
        server,
        engine,
        client,
        bystander,
        by_redis,
        by_memory,
        in_time,
    }
}

/// Redis before, memory during and Redis after an outage, for a `fallback_local` rule of
/// `limit` per hour ending with `more` ([`after_an_outage`]), then `2 × limit` checks once
/// the circuit has closed again. The admissions of each stretch, and whether the outage's
/// checks ran within the cool-down.
async fn across_an_outage(limit: usize, more: &str, before: usize, during: usize) -> (usize, usize, usize, bool) {
    let run = after_an_outage(limit, more, before, during).await;
    let (after, degraded) = admissions(&run.engine, &run.client, 2 * limit).await;
    assert_eq!(degraded, 0, "Redis decides after the outage");
    (run.by_redis, run.by_memory, after, run.in_time)
}

/// Checks a run of [`across_an_outage`] of a `kind` of rule of `limit`, `spent` before
/// the outage: memory admits at most the rest (all of it when the outage's checks ran
/// within the cool-down), and the three stretches together at most the limit.
fn within_the_limit(kind: &str, limit: usize, spent: usize, run: (usize, usize, usize, bool)) {
    let (by_redis, during, after, in_time) = run;
    let total = by_redis + during + after;
    eprintln!(
        "{kind}, limit {limit} per hour: Redis admitted {by_redis} before the outage, memory {during} during it \
         (within the cool-down: {in_time}), Redis {after} after it; {total} in all"
    );
    assert!(
        during <= limit - spent,
        "{during} admitted by memory, past the rest of the limit"
    );
    if in_time {
        assert_eq!(during, limit - spent, "memory starts from what Redis admitted");
    }
    assert!(total <= limit, "{total} admitted of a limit of {limit}");
}

/// A leased rule's lease: 3 permits at most, kept for an hour.
const LEASE: &str = "        lease: { max: 3, ttl: 1h }\n";

/// A leased `fallback_local` rule ([`LEASE`]): what memory admits during an outage, Redis
/// counts afterwards, even though the rule's requests are decided by local leases. Redis
/// admits 3 (one call taking a lease of 3), memory the 3 left, then Redis none: 6 of 6.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_fallback_local_admits_redis_counts_after_the_outage_for_a_leased_rule() {
    const LIMIT: usize = 6;
    // The lease's size: spent whole before the outage, so that memory decides every check
    // of the outage.
    const SPENT: usize = 3;
    let run = across_an_outage(LIMIT, LEASE, SPENT, 2 * LIMIT).await;
    within_the_limit("leased", LIMIT, SPENT, run);
}

/// A leased `fallback_local` rule ([`LEASE`]) whose debt is smaller than what Redis has
/// left: the call that takes the next lease takes the debt too. Redis admits 3, memory 1
/// during the outage, then Redis's next call takes 3 (the request's permit, the debt and a
/// lease of 1): 2 more admitted, 6 of 6.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_call_taking_a_lease_after_an_outage_takes_what_fallback_local_admitted() {
    const LIMIT: usize = 6;
    const SPENT: usize = 3;
    let (by_redis, during, after, in_time) = across_an_outage(LIMIT, LEASE, SPENT, 1).await;
    let total = by_redis + during + after;
    eprintln!(
        "leased, limit {LIMIT} per hour: Redis admitted {by_redis} before the outage, memory {during} during it \
         (within the cool-down: {in_time}), Redis {after} after it; {total} in all"
    );
    assert_eq!(during, 1, "memory admits the one check of the outage");
    assert!(total <= LIMIT, "{total} admitted of a limit of {LIMIT}");
}

/// A `fallback_local` rule whose requests may wait for the refill (`on_limit.wait`): what
/// memory admits during an outage, Redis counts afterwards, with the next call even when it
/// may wait. Redis admits 3, memory the 2 left, then Redis none: 5 of 5.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_fallback_local_admits_redis_counts_after_the_outage_for_a_waiting_rule() {
    const LIMIT: usize = 5;
    const SPENT: usize = 3;
    let wait = "        on_limit: { wait: { max_wait: 1s, max_waiters: 10 } }\n";
    let run = across_an_outage(LIMIT, wait, SPENT, 2 * LIMIT).await;
    within_the_limit("waiting", LIMIT, SPENT, run);
}

/// Requests made at once after an outage each carry what memory admitted during it, not
/// only the first: Redis admits 3, memory the 2 left, then 6 requests at once and 10 more
/// one after the other are all refused, 5 of 5. When only one request carried the debt,
/// Redis refused it (3 + 2 + 1 > 5) and admitted the others as if nothing were owed: 7.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_made_at_once_after_an_outage_each_carry_what_memory_admitted() {
    const LIMIT: usize = 5;
    const SPENT: usize = 3;
    let AfterAnOutage {
        server: _server,
        engine,
        client,
        by_redis,
        by_memory,
        in_time,
        ..
    } = after_an_outage(LIMIT, "", SPENT, 2 * LIMIT).await;
    let at_once: Vec<_> = (0..6)
        .map(|_| {
            let (engine, client) = (engine.clone(), client.clone());
            tokio::spawn(async move { engine.check(&client).await })
        })
        .collect();
    let mut together = 0;
    for check in at_once {
        let decision = check.await.expect("the check ran").expect("decided");
        assert!(!decision.degraded, "Redis decides after the outage");
        together += usize::from(decision.allowed());
    }
    let (after, _) = admissions(&engine, &client, 2 * LIMIT).await;
    let total = by_redis + by_memory + together + after;
    eprintln!(
        "limit {LIMIT} per hour: Redis admitted {by_redis}, memory {by_memory} (within the cool-down: {in_time}), \
         then Redis {together} of 6 requests made at once and {after} after them; {total} in all"
    );
    assert!(by_memory <= LIMIT - SPENT, "memory starts from what Redis admitted");
    assert!(total <= LIMIT, "{total} admitted of a limit of {LIMIT}");
}

/// Polls `decision` once (its call goes out): the decision, unless it was ready at once, to
/// be dropped when the client resets its request.
fn sent(mut decision: MaybeReady<Result<Decision, Error>>) -> Option<MaybeReady<Result<Decision, Error>>> {
    let mut cx = Context::from_waker(Waker::noop());
    match Pin::new(&mut decision).poll(&mut cx) {
        Poll::Ready(_) => None,
        Poll::Pending => Some(decision),
    }
}

/// What `fallback_local` admitted during an outage stays owed when the request whose call
/// takes it is dropped before Redis answers: Redis, refusing that call (3 permits where 2
/// are left), counts nothing, and the owed permits go back for the next call. Dropped with
/// the request, they were lost, and Redis admitted them again: 7 admitted of a limit of 5.
/// On a runtime of one thread, the call goes out only after the request is dropped.
#[tokio::test]
async fn owed_permits_outlive_a_request_dropped_during_its_call() {
    const LIMIT: usize = 5;
    const SPENT: usize = 3;
    let AfterAnOutage {
        server: _server,
        engine,
        client,
        by_redis,
        by_memory: during,
        ..
    } = after_an_outage(LIMIT, "", SPENT, 2 * LIMIT).await;
    // The client's next request takes what memory admitted with its own permit, and goes.
    let dropped = sent(engine.check(&client)).expect("the call is out");
    drop(dropped);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (after, degraded) = admissions(&engine, &client, 2 * LIMIT).await;
    assert_eq!(degraded, 0, "Redis decides after the outage");
    let total = by_redis + during + after;
    eprintln!(
        "limit {LIMIT} per hour: Redis admitted {by_redis}, memory {during} during the outage, a request \
         dropped during its call, then Redis {after}: {total} in all"
    );
    assert_eq!(total, LIMIT, "{total} admitted of a limit of {LIMIT}");
}

/// A probe of a half-open circuit dropped as soon as its call is out is still answered:
/// Redis, back, closes the circuit. Its answer was lost before, and a client dropping every
/// probe it made kept the circuit half-open: every request arriving while its probe was
/// out was answered by the failure policy (`fail_open` admitted a client's 5 requests of
/// each round, 1,520 over 2 s under a limit of 5). On a runtime of one thread, a probe's
/// call goes out only once the test awaits.
#[tokio::test]
async fn a_client_dropping_its_probes_does_not_hold_the_circuit_open() {
    const LIMIT: usize = 5;
    const COOL_DOWN: Duration = Duration::from_millis(100);
    let server = RedisServer::start();
    // A deadline a busy machine meets: a call that missed it would open the circuit again,
    // which is not what this test is about.
    let limiter = limiter_within(&server, Duration::from_millis(500)).await;
    let breaker = Arc::new(CircuitBreaker::new(limiter).failure_threshold(1).cool_down(COOL_DOWN));
    let rules = rules(&format!(
        "rule_sets:\n  - id: default\n    rules:\n      - id: per-ip\n        bands: [{{ capacity: {LIMIT}, window: 1h }}]\n"
    ));
    let engine = Engine::builder(rules)
        .shared_limiter(breaker.clone())
        .on_backend_failure(FailurePolicy::FailOpen)
        .build()
        .expect("the backend decides every rule");
    let (client, attacker, bystander) = (
        ctx(),
        RequestContext::builder()
            .client_ip("203.0.113.9".parse().expect("an address"))
            .build(),
        RequestContext::builder()
            .client_ip("198.51.100.3".parse().expect("an address"))
            .build(),
    );
    server.signal("-STOP");
    assert!(
        engine.check(&bystander).await.expect("decided").degraded,
        "the circuit opens"
    );
    server.signal("-CONT");
    tokio::time::sleep(COOL_DOWN).await;
    let (mut admitted, mut failed_open, mut probes, mut at_once) = (0, 0, 0, 0);
    for _ in 0..100 {
        // The attacker's request probes when the circuit is half-open, and is dropped. It is
        // answered at once (`None`) while the last one's call is still out (a busy machine).
        let probing = breaker.is_tripped();
        let probe = sent(engine.check(&attacker));
        probes += usize::from(probing && probe.is_some());
        at_once += usize::from(probe.is_none());
        for _ in 0..LIMIT {
            let d = engine.check(&client).await.expect("decided");
            admitted += usize::from(d.allowed());
            failed_open += usize::from(d.failed_open);
        }
        drop(probe);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let start = Instant::now();
    while breaker.is_tripped() && start.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!(
        "limit {LIMIT} per hour: {admitted} of the client's requests admitted, {failed_open} by fail_open, \
         beside {probes} probes dropped ({at_once} of the attacker's requests answered at once)"
    );
    assert!(
        !breaker.is_tripped(),
        "the circuit stayed open: {failed_open} admitted by fail_open"
    );
    assert!(
        admitted - failed_open <= LIMIT,
        "Redis admitted {}",
        admitted - failed_open
    );
}

/// A limit changed after an outage, before what memory admitted during it was counted:
/// the debt is carried at most up to what the new rule's smallest band holds beside the
/// request's cost. A global limit of 5 per hour, 5 admitted by memory during an outage (4
/// owed), then tightened to 2 per second: each call carries of the debt what the new band
/// holds beside its cost (1), so one request a second is admitted while it is paid, 2 or
/// more in 3 s. Carried whole (5 permits on a band of 2), every call of every client was
/// refused until the old rule's hour had passed: 0 in 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_tightened_after_an_outage_is_not_refused_for_what_memory_admitted() {
    const COOL_DOWN: Duration = Duration::from_millis(300);
    let server = RedisServer::start();
    let set = |band: &str| {
        rules(&format!(
            "rule_sets:\n  - id: default\n    rules:\n      - id: everyone\n        scope: global\n        bands: [{band}]\n"
        ))
    };
    let provider = Arc::new(ReloadingRuleSetProvider::new(set("{ capacity: 5, window: 1h }")));
    let engine = Engine::builder(provider.clone())
        .limiter(
            CircuitBreaker::new(limiter(&server).await)
                .failure_threshold(1)
                .cool_down(COOL_DOWN),
        )
        .fallback(MemoryLimiter::default())
        .build()
        .expect("the backend decides every rule");
    let client = ctx();
    let bystander = RequestContext::builder()
        .client_ip("198.51.100.3".parse().expect("an address"))
        .build();
    let (by_memory, _) = during_an_outage(&server, &engine, &bystander, &client, 10, COOL_DOWN).await;
    tokio::time::sleep(COOL_DOWN + Duration::from_millis(50)).await;
    provider
        .replace(set("{ capacity: 2, window: 1s }"))
        .expect("the new rule is valid");
    // Three seconds of the new limit, a request every 100 ms from one client or another.
    let start = Instant::now();
    let (mut admitted, mut degraded, mut sent) = (0, 0, 0);
    while start.elapsed() < Duration::from_secs(3) {
        let who = if sent % 2 == 0 { &client } else { &bystander };
        sent += 1;
        let d = engine.check(who).await.expect("decided");
        admitted += usize::from(d.allowed());
        degraded += usize::from(d.degraded);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "global 5 per hour: memory admitted {by_memory} during the outage; tightened to 2 per second, \
         {admitted} admitted in the next {:?} ({degraded} degraded)",
        start.elapsed()
    );
    assert!(
        admitted >= 2,
        "{admitted} admitted in 3 s of a limit of 2 per second: refused for what memory admitted under the old rule"
    );
}

/// A TCP proxy to `port` that numbers its connections from 0 in the order it accepts them.
/// Once `frozen` holds a connection's number, that connection forwards nothing more either
/// way and stays open, as one whose packets a middlebox drops does (no reset, no close).
/// While `refuse` is set, it closes every connection it accepts; `forwarded` counts those it
/// forwards, and `scripts` the script calls (`EVALSHA`) sent on each connection. Returns
/// the proxy's port.
async fn freezing_proxy(
    port: u16,
    frozen: Arc<AtomicUsize>,
    refuse: Arc<AtomicBool>,
    forwarded: Arc<AtomicUsize>,
    scripts: Arc<Mutex<Vec<usize>>>,
) -> u16 {
    struct Freezing {
        frozen: Arc<AtomicUsize>,
        refuse: Arc<AtomicBool>,
        forwarded: Arc<AtomicUsize>,
        scripts: Arc<Mutex<Vec<usize>>>,
    }
    impl Twist for Freezing {
        fn admit(&self) -> bool {
            !self.refuse.load(Ordering::SeqCst)
        }
        fn connected(&self, _n: usize) {
            self.forwarded.fetch_add(1, Ordering::SeqCst);
        }
        fn step(&self, n: usize, from: Side, read: Option<&[u8]>) -> Step {
            if self.frozen.load(Ordering::SeqCst) == n {
                // Hold both sockets open, forwarding nothing, even once a side closes.
                return Step::Hold;
            }
            if let (Side::Client, Some(chunk)) = (from, read) {
                let calls = chunk.windows(7).filter(|w| w == b"EVALSHA").count();
                let mut scripts = self.scripts.lock().expect("the counts");
                if scripts.len() <= n {
                    scripts.resize(n + 1, 0);
                }
                scripts[n] += calls;
            }
            Step::Forward
        }
    }
    proxy(
        port,
        Freezing {
            frozen,
            refuse,
            forwarded,
            scripts,
        },
    )
    .await
}

/// One connection of the pool stops answering while the others answer (a middlebox
/// dropping one flow's packets): the calls sent on it time out, and the failure policy
/// answers them (`fail_open`: admitted uncounted). fred does not count it dead, written to
/// more often than its check's period, and the hash slot's calls are answered on the other
/// connections. The limiter watches each client's calls as well: the client whose calls
/// keep timing out for the period (a second) while the others' are answered connects
/// again, and the failure policy answers nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stuck_connection_among_answering_ones_connects_again() {
    one_stuck_connection(None).await;
}

/// The same with batched decisions: a batch's call on the stuck connection times out, and
/// each of its requests with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stuck_connection_among_answering_ones_connects_again_with_batches() {
    one_stuck_connection(Some(Batching::new())).await;
}

/// A stuck connection whose client cannot connect again (a reconnection waits on a
/// connection task that waits on the stuck socket once its buffer is full; here, every new
/// connection is closed at once): its calls go to the pool's other clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_connection_that_cannot_connect_again_is_passed_over() {
    one_stuck_connection_with(None, true).await;
}

/// The same with batched decisions: no batch goes to the stuck client either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_connection_that_cannot_connect_again_is_passed_over_with_batches() {
    one_stuck_connection_with(Some(Batching::new()), true).await;
}

/// The same on a cluster: one of the pool's three connections to the primary of the
/// request's slot stops answering while the other two answer. The limiter watches each
/// client per range of 64 slots there; the client reconnects (to every node) and answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stuck_connection_to_a_cluster_node_connects_again() {
    one_stuck_connection_on(Where::Cluster, None, false).await;
}

/// The same with batched decisions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stuck_connection_to_a_cluster_node_connects_again_with_batches() {
    one_stuck_connection_on(Where::Cluster, Some(Batching::new()), false).await;
}

/// The same on a cluster when the node behind the proxy takes no new connection: the
/// client stays passed over for the node's ranges, and connects again once it can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_connection_to_a_cluster_node_that_cannot_connect_again_is_passed_over() {
    one_stuck_connection_on(Where::Cluster, None, true).await;
}

/// Where the proxy of [`one_stuck_connection_on`] stands: before a standalone server, or
/// before the primary of the request's slot in a cluster of three, which announces the
/// proxy's port as its own so that clients connect to it through the proxy.
#[derive(Clone, Copy, PartialEq)]
enum Where {
    Standalone,
    Cluster,
}

async fn one_stuck_connection(batching: Option<Batching>) {
    one_stuck_connection_with(batching, false).await;
}

async fn one_stuck_connection_with(batching: Option<Batching>, cannot_connect_again: bool) {
    one_stuck_connection_on(Where::Standalone, batching, cannot_connect_again).await;
}

async fn one_stuck_connection_on(place: Where, batching: Option<Batching>, cannot_connect_again: bool) {
    let frozen = Arc::new(AtomicUsize::new(usize::MAX));
    let refuse = Arc::new(AtomicBool::new(false));
    let forwarded = Arc::new(AtomicUsize::new(0));
    let scripts = Arc::new(Mutex::new(Vec::new()));
    let (_server, _cluster, url) = match place {
        Where::Standalone => {
            let server = RedisServer::start();
            let port = freezing_proxy(
                server.port(),
                frozen.clone(),
                refuse.clone(),
                forwarded.clone(),
                scripts.clone(),
            )
            .await;
            (Some(server), None, format!("redis://127.0.0.1:{port}"))
        }
        Where::Cluster => {
            let cluster = RedisCluster::start();
            let slot = fred::util::redis_keyslot(b"{default:per-ip:ip=192.0.2.77}");
            let node = cluster.node_of_slot(slot);
            let port = freezing_proxy(
                node.port(),
                frozen.clone(),
                refuse.clone(),
                forwarded.clone(),
                scripts.clone(),
            )
            .await;
            cluster.announce_port(node, port);
            let url = cluster.url();
            (None, Some(cluster), url)
        }
    };
    let limiter = RedisLimiter::builder(url)
        .pool_size(3)
        // Longer than the other tests' deadline: a busy machine's late timers time out no
        // call on the answering connections, whose every failure the test counts.
        .timeout(Duration::from_millis(200))
        .reconnect_delay(Duration::from_millis(50))
        .deny_cache(false)
        .batching(batching)
        .connect()
        .await
        .expect("connect");
    let rules = rules(
        "rule_sets:\n  - id: default\n    rules:\n      - id: per-ip\n        bands: [{ capacity: 1000000000, window: 1h }]\n",
    );
    let engine = Arc::new(
        Engine::builder(rules)
            .limiter(limiter)
            .on_backend_failure(FailurePolicy::FailOpen)
            .build()
            .expect("the backend decides every rule"),
    );
    for _ in 0..30 {
        let d = engine.check(&ctx()).await.expect("decided");
        assert!(
            d.allowed() && !d.failed_open,
            "decided by Redis before the freeze: {d:?}"
        );
    }
    // The pool's second connection (on a cluster, the second to the node behind the proxy).
    assert!(
        forwarded.load(Ordering::SeqCst) >= 3,
        "the pool's connections do not all go through the proxy"
    );
    frozen.store(1, Ordering::SeqCst);
    refuse.store(cannot_connect_again, Ordering::SeqCst);
    let start = Instant::now();
    let made_before_freeze = forwarded.load(Ordering::SeqCst);
    // When the proxy first forwards a connection made after the freeze.
    let connected_again = {
        let forwarded = forwarded.clone();
        let before = forwarded.load(Ordering::SeqCst);
        tokio::spawn(async move {
            while forwarded.load(Ordering::SeqCst) == before && start.elapsed() < Duration::from_secs(10) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (forwarded.load(Ordering::SeqCst) > before).then(|| start.elapsed())
        })
    };
    let run = Duration::from_secs(5);
    // Eight loops of requests, one every 5 ms each: each connection is written to far more
    // often than fred's check of its own looks for a silence.
    let loops: Vec<_> = (0..8)
        .map(|_| {
            let engine = engine.clone();
            tokio::spawn(async move {
                let mut failed = Vec::new();
                let mut decided = 0usize;
                while start.elapsed() < run {
                    let d = engine.check(&ctx()).await.expect("decided");
                    decided += 1;
                    if d.failed_open {
                        failed.push(start.elapsed());
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                (decided, failed)
            })
        })
        .collect();
    let (mut decided, mut failed) = (0, Vec::new());
    for l in loops {
        let (d, f) = l.await.expect("a loop");
        decided += d;
        failed.extend(f);
    }
    failed.sort();
    let last = failed.last().copied();
    let late = failed.iter().filter(|at| **at >= Duration::from_millis(3500)).count();
    eprintln!(
        "one stuck connection of three (cluster {}, batching {}, connecting again refused {cannot_connect_again}): {} \
         of {decided} decisions answered by the failure policy, the last {last:?} after the freeze; {late} in its last \
         1.5 s",
        place == Where::Cluster,
        batching.is_some(),
        failed.len()
    );
    assert!(
        !failed.is_empty(),
        "the frozen connection carried no call: the test proves nothing"
    );
    // Connected again, the client answers; unable to, it is passed over, and no decision
    // goes to it. Its first call times out 200 ms after the freeze, the period runs from
    // there.
    assert_eq!(
        late,
        0,
        "calls answered by the failure policy 3.5 s after the connection stopped answering (period 1 s): {} of \
         {decided} decisions in all",
        failed.len()
    );
    if !cannot_connect_again {
        // The stuck connection is replaced: on a cluster, by fred's own check once nothing
        // but the client's `PING` is written to it (a connection with no reply for the
        // period since its last write), which decisions sent to it kept from firing.
        let again = connected_again.await.expect("the watcher");
        eprintln!("a connection made again {again:?} after the freeze");
        assert!(again.is_some(), "the stuck connection was not replaced within 10 s");
        // And the client takes decisions again: script calls go out on its new connection.
        let late = || {
            scripts
                .lock()
                .expect("the counts")
                .iter()
                .skip(made_before_freeze)
                .sum::<usize>()
        };
        let before = late();
        // Decisions until one goes out on it: the client is counted back once its answers
        // to `PING` prove its ranges, which a busy machine may delay past a few dozen
        // decisions (5 s at most; 60 decisions were too few once in CI).
        let counted_back = Instant::now();
        let mut decisions = 0;
        while late() == before && counted_back.elapsed() < Duration::from_secs(5) {
            let d = engine.check(&ctx()).await.expect("decided");
            assert!(!d.failed_open, "{d:?}");
            decisions += 1;
        }
        assert!(
            late() > before,
            "no script call went out on a connection made after the freeze in {decisions} decisions over {:?}: the \
             client was not counted back",
            counted_back.elapsed()
        );
    }
    if cannot_connect_again {
        // Connecting possible again: the client passed over connects again within a period
        // or two (its reconnection asked for by the calls passing it over) and answers.
        let connections = forwarded.load(Ordering::SeqCst);
        refuse.store(false, Ordering::SeqCst);
        let again = Instant::now();
        while forwarded.load(Ordering::SeqCst) == connections && again.elapsed() < Duration::from_secs(5) {
            let d = engine.check(&ctx()).await.expect("decided");
            assert!(!d.failed_open, "a call went to the client passed over: {d:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            forwarded.load(Ordering::SeqCst) > connections,
            "the client passed over did not connect again within 5 s of connecting being possible"
        );
        eprintln!("connected again {:?} after connecting was possible", again.elapsed());
    }
}

/// An engine deciding `yaml` on the Redis at `url` (the builder's deny cache on), behind a
/// circuit breaker that opens at the first failure for 30 s, `fail_open`.
async fn breaker_engine(url: String, yaml: &str) -> Engine {
    let limiter = RedisLimiter::builder(url)
        .timeout(DEADLINE)
        .connect()
        .await
        .expect("connect");
    Engine::builder(rules(yaml))
        .limiter(
            CircuitBreaker::new(limiter)
                .failure_threshold(1)
                .cool_down(Duration::from_secs(30)),
        )
        .on_backend_failure(FailurePolicy::FailOpen)
        .build()
        .expect("the backend decides every rule")
}

/// A request of the client at `ip`.
fn client_at(ip: &str) -> RequestContext {
    RequestContext::builder()
        .client_ip(ip.parse().expect("an address"))
        .build()
}

/// While the circuit breaker is open, a client whose limit the deny cache knows to be spent
/// is refused by it, not left to the failure policy: the breaker answered every request
/// `CircuitOpen` without asking the limiter it wraps, and `fail_open` then admitted that
/// client uncounted for as long as the circuit stayed open. A client the cache knows
/// nothing of is still decided by the policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_circuit_still_refuses_a_client_the_deny_cache_knows_is_spent() {
    let server = RedisServer::start();
    let engine = breaker_engine(
        server.url(),
        "rule_sets:\n  - id: default\n    rules:\n      - id: per-ip\n        bands: [{ capacity: 2, window: 1h }]\n",
    )
    .await;
    let (spent, fresh, bystander) = (
        client_at("192.0.2.80"),
        client_at("192.0.2.81"),
        client_at("192.0.2.82"),
    );
    for _ in 0..2 {
        assert!(engine.check(&spent).await.expect("decided").allowed());
    }
    assert!(
        !engine.check(&spent).await.expect("decided").allowed(),
        "spent, and remembered"
    );
    server.signal("-STOP");
    // The bystander's call misses the deadline and opens the circuit.
    let opened = engine.check(&bystander).await.expect("the policy decides");
    assert!(opened.failed_open, "{opened:?}");
    for _ in 0..5 {
        let d = engine.check(&spent).await.expect("decided");
        assert!(!d.allowed() && !d.failed_open, "the deny cache refuses it: {d:?}");
        let d = engine.check(&fresh).await.expect("decided");
        assert!(d.allowed() && d.failed_open, "the policy admits it: {d:?}");
    }
    server.signal("-CONT");
}

/// The same on a cluster, for a rule set of two rules, whose requests span hash slots: the
/// cache lets one request of such a denial through to Redis every 100 ms, as a probe
/// (a refund across slots may free the band early). While the circuit is open such a
/// probe cannot reach Redis and was left to the failure policy, which admitted the spent
/// client about ten times a second; the breaker's question to the cache now spends no probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_circuit_still_refuses_a_spent_client_of_rules_across_slots() {
    let cluster = RedisCluster::start();
    let engine = breaker_engine(cluster.url(), "rule_sets:\n  - id: default\n    rules:\n      - id: per-ip\n        bands: [{ capacity: 2, window: 1h }]\n      - id: everyone\n        scope: global\n        bands: [{ capacity: 1000000, window: 1s }]\n").await;
    let (spent, bystander) = (client_at("192.0.2.90"), client_at("192.0.2.91"));
    for _ in 0..2 {
        assert!(engine.check(&spent).await.expect("decided").allowed());
    }
    assert!(
        !engine.check(&spent).await.expect("decided").allowed(),
        "spent, and remembered"
    );
    for node in &cluster.nodes {
        node.signal("-STOP");
    }
    let opened = engine.check(&bystander).await.expect("the policy decides");
    assert!(opened.failed_open, "{opened:?}");
    let mut admitted = 0;
    for _ in 0..25 {
        admitted += usize::from(engine.check(&spent).await.expect("decided").allowed());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for node in &cluster.nodes {
        node.signal("-CONT");
    }
    assert_eq!(
        admitted, 0,
        "the spent client admitted {admitted} times while the circuit was open"
    );
}
