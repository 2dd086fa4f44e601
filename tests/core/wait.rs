//! Waiting for the refill (`on_limit: { wait: { max_wait, max_waiters } }`) in memory, on
//! a paused tokio clock: a request that would be refused, and admitted within `max_wait`,
//! takes its place at once and proceeds at exactly the instant the band admits it.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fluxgate::core::{
    Clock, Decision, Engine, MaybeReady, MemoryLimiter, RequestContext, RuleSets, TokioClock, WaitPolicy,
};
use tokio::time::Instant;

use crate::support::backend::{at_once, shortest_wait, Around};

/// A rule set of one global rule of `algorithm`, `capacity` per `window`, that lets
/// requests wait up to `max_wait`, `max_waiters` at once.
fn waiting(algorithm: &str, band: &str, max_wait: &str, max_waiters: u32) -> Engine {
    waiting_on(TokioClock::new(), algorithm, band, max_wait, max_waiters)
}

fn waiting_on(clock: TokioClock, algorithm: &str, band: &str, max_wait: &str, max_waiters: u32) -> Engine {
    let rules = RuleSets::from_yaml_str(&format!(
        r#"
rule_sets:
  - id: default
    rules:
      - id: global
        scope: global
        algorithm: {algorithm}
        bands: [{band}]
        on_limit: {{ wait: {{ max_wait: {max_wait}, max_waiters: {max_waiters} }} }}
"#
    ))
    .expect("valid rules");
    in_memory(rules, clock, None)
}

/// An engine deciding `rules` in memory on `clock`, with the engine's wait policy `wait`.
fn in_memory(rules: RuleSets, clock: TokioClock, wait: Option<WaitPolicy>) -> Engine {
    let mut builder = Engine::builder(rules).limiter(MemoryLimiter::builder().clock(clock).build());
    if let Some(wait) = wait {
        builder = builder.wait_on_limit(wait);
    }
    builder.build().expect("the in-memory limiter decides every rule")
}

async fn check(engine: &Engine) -> Decision {
    engine
        .check(&RequestContext::builder().build())
        .await
        .expect("a decision")
}

/// Starts a request that waits, and drops it after `after` (at once, once it has started,
/// for zero).
async fn drop_a_waiter(engine: &Engine, after: Duration) {
    let waiter = tokio::spawn({
        let engine = engine.clone();
        async move { check(&engine).await }
    });
    if after.is_zero() {
        tokio::task::yield_now().await;
    } else {
        tokio::time::sleep(after).await;
    }
    waiter.abort();
    assert!(waiter.await.is_err(), "the waiter was dropped");
}

#[tokio::test(start_paused = true)]
async fn a_token_bucket_admits_waiting_requests_at_its_refill_instants() {
    // 2 per second: two at once, then one every 500 ms. Waiting up to 1.2 s, the next two
    // proceed at 500 ms and 1 s (whole milliseconds: tokio's timer wakes them exactly);
    // the fifth would wait 1.5 s and is refused at once.
    let engine = waiting("token_bucket", "{ capacity: 2, window: 1s }", "1200ms", 100);
    let start = Instant::now();
    let answers = at_once(&engine, 5, start).await;
    let ms = |n| Duration::from_millis(n);
    assert_eq!(
        answers,
        [
            (false, ms(0)),
            (true, ms(0)),
            (true, ms(0)),
            (true, ms(500)),
            (true, ms(1000))
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_fixed_window_admits_waiting_requests_when_their_window_begins() {
    // 3 per second, aligned on the epoch: the requests past the third wait for the next
    // window, up to its 3; the seventh would wait two windows and is refused.
    let clock = TokioClock::new();
    let engine = waiting_on(clock, "fixed_window", "{ capacity: 3, window: 1s }", "1s", 100);
    let to_boundary = Duration::from_nanos(1_000_000_000 - clock.now_nanos() % 1_000_000_000);
    let start = Instant::now();
    let answers = at_once(&engine, 7, start).await;
    let now: Vec<(bool, Duration)> = answers.iter().copied().filter(|a| a.1.is_zero()).collect();
    assert_eq!(
        now,
        [
            (false, Duration::ZERO),
            (true, Duration::ZERO),
            (true, Duration::ZERO),
            (true, Duration::ZERO)
        ]
    );
    // The three others at the boundary, as tokio's timer wakes them: never before, and
    // within its resolution of a millisecond.
    let waited: Vec<(bool, Duration)> = answers.iter().copied().filter(|a| !a.1.is_zero()).collect();
    assert_eq!(waited.len(), 3);
    for (admitted, after) in waited {
        assert!(admitted);
        assert!(
            after >= to_boundary && after < to_boundary + Duration::from_millis(1),
            "proceeded after {after:?}, the window begins after {to_boundary:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn no_more_than_max_waiters_wait_and_the_next_is_refused_at_once() {
    let engine = waiting("token_bucket", "{ capacity: 1, window: 1s }", "1h", 2);
    let start = Instant::now();
    let answers = at_once(&engine, 5, start).await;
    let secs = Duration::from_secs;
    assert_eq!(
        answers,
        [
            (false, secs(0)),
            (false, secs(0)),
            (true, secs(0)),
            (true, secs(1)),
            (true, secs(2))
        ]
    );
    // The places are free again: two more may wait.
    let answers = at_once(&engine, 3, Instant::now()).await;
    assert_eq!(answers.iter().filter(|a| a.0).count(), 2, "{answers:?}");
}

#[tokio::test(start_paused = true)]
async fn a_dropped_waiter_gives_its_place_to_the_next_request() {
    let engine = waiting("token_bucket", "{ capacity: 1, window: 1s }", "10s", 100);
    assert!(check(&engine).await.allowed());
    // The second request waits for 1 s; dropped after 100 ms, its place goes back.
    drop_a_waiter(&engine, Duration::from_millis(100)).await;
    // The third request takes the place the dropped one held: at 1 s, not 2 s.
    let start = Instant::now();
    let decision = check(&engine).await;
    assert!(decision.allowed());
    assert_eq!(start.elapsed(), Duration::from_millis(900));
}

/// A waiter dropped while another waits behind it: the one behind counted its place, so
/// giving the dropped place back would let a new request share the later one. It stays
/// taken, and no two requests proceed within one permit's interval.
#[tokio::test(start_paused = true)]
async fn a_dropped_waiter_with_another_behind_it_keeps_its_place() {
    let clock = TokioClock::new();
    let engine = waiting_on(clock, "token_bucket", "{ capacity: 1, window: 2s }", "10s", 100);
    let start = Instant::now();
    assert!(check(&engine).await.allowed());
    let spawn = || {
        let engine = engine.clone();
        tokio::spawn(async move {
            let decision = check(&engine).await;
            (decision.allowed(), start.elapsed())
        })
    };
    // W1 waits for 2 s, W2 behind it for 4 s.
    let first = spawn();
    tokio::task::yield_now().await;
    let second = spawn();
    tokio::task::yield_now().await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    first.abort();
    assert!(first.await.is_err(), "W1 was dropped");
    // A new request: after W2 (6 s), not beside it at 4 s.
    let (allowed, at) = {
        let decision = check(&engine).await;
        (decision.allowed(), start.elapsed())
    };
    assert!(allowed);
    assert_eq!(at, Duration::from_secs(6));
    assert_eq!(second.await.expect("W2 ran"), (true, Duration::from_secs(4)));
    // W2 and the new request were the last places: with nobody behind, a dropped one's
    // place goes back (a_dropped_waiter_gives_its_place_to_the_next_request).
}

/// A waiter whose shadow rule did not take a place (it would have refused then) gives its
/// enforced place back when dropped: each band's mark is matched to its own band.
#[tokio::test(start_paused = true)]
async fn a_dropped_waiter_behind_a_shadow_rule_gives_its_place_back() {
    let rules = RuleSets::from_yaml_str(
        r#"
rule_sets:
  - id: default
    rules:
      - id: watched
        scope: global
        priority: 10
        mode: shadow
        bands: [{ capacity: 1, window: 1s }]
      - id: patient
        scope: global
        bands: [{ capacity: 1, window: 2s }]
        on_limit: { wait: { max_wait: 10s, max_waiters: 10 } }
"#,
    )
    .expect("valid rules");
    let engine = in_memory(rules, TokioClock::new(), None);
    assert!(check(&engine).await.allowed());
    drop_a_waiter(&engine, Duration::from_millis(100)).await;
    // The next request takes the dropped one's place, at 2 s.
    let start = Instant::now();
    assert!(check(&engine).await.allowed());
    assert_eq!(start.elapsed(), Duration::from_millis(1_900));
}

/// `tasks` tasks of `each` requests at once against `engine`: the instants (on `clock`)
/// at which admitted requests proceeded, in order.
async fn proceed_times(engine: &Engine, clock: TokioClock, tasks: usize, each: usize) -> Vec<u64> {
    let times = Arc::new(std::sync::Mutex::new(Vec::new()));
    let handles: Vec<_> = (0..tasks)
        .map(|_| {
            let (engine, times) = (engine.clone(), times.clone());
            tokio::spawn(async move {
                for _ in 0..each {
                    if check(&engine).await.allowed() {
                        times.lock().expect("not poisoned").push(clock.now_nanos());
                    }
                }
            })
        })
        .collect();
    for handle in handles {
        handle.await.expect("the task ran");
    }
    let mut times = std::mem::take(&mut *times.lock().expect("not poisoned"));
    times.sort_unstable();
    times
}

const SEC: u64 = 1_000_000_000;

#[tokio::test(start_paused = true)]
async fn with_waiting_a_bucket_stays_exact_under_concurrency() {
    // 40 tasks of 20 requests against 100 per second, waiting up to 2 s: 100 at once,
    // then exactly one every 10 ms, whoever asks, for as long as the waits reach.
    for algorithm in ["token_bucket", "leaky_bucket"] {
        let clock = TokioClock::new();
        let engine = waiting_on(clock, algorithm, "{ capacity: 100, window: 1s }", "2s", 10_000);
        let start = clock.now_nanos();
        let times = proceed_times(&engine, clock, 40, 20).await;
        assert!(times.len() > 200, "{algorithm}: {} proceeded", times.len());
        for (i, t) in times.iter().enumerate() {
            let expected = (i as u64).saturating_sub(99) * 10_000_000;
            assert_eq!(t - start, expected, "{algorithm}: request {i}");
        }
    }
}

#[tokio::test(start_paused = true)]
async fn with_waiting_the_windows_stay_within_their_capacity_under_concurrency() {
    // The window algorithms: whatever waits, no window admits more than it allows.
    for algorithm in ["fixed_window", "sliding_window_counter", "sliding_window_log"] {
        let clock = TokioClock::new();
        let engine = waiting_on(clock, algorithm, "{ capacity: 100, window: 1s }", "2s", 10_000);
        let times = proceed_times(&engine, clock, 40, 20).await;
        assert!(times.len() > 100, "{algorithm}: {} proceeded", times.len());
        // Every aligned window (all three keep at most the capacity in one).
        let mut per_window = std::collections::BTreeMap::new();
        for t in &times {
            *per_window.entry(t / SEC).or_insert(0) += 1;
        }
        assert!(per_window.values().all(|&n| n <= 100), "{algorithm}: {per_window:?}");
        if algorithm == "sliding_window_log" {
            // And every sliding window of one second.
            for (i, t) in times.iter().enumerate() {
                let within = times[i..].iter().take_while(|&&u| u < t + SEC).count();
                assert!(within <= 100, "{algorithm}: {within} within a second of request {i}");
            }
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_waits_for_its_slowest_rule_and_never_past_a_rule_that_does_not_wait() {
    // `slow` (1 a second) lets requests wait; `hourly` (3 an hour, two bands) does not.
    // Requests wait for `slow` and take their place in `hourly` for that instant; the
    // fourth would fit `slow` but not `hourly`, which refuses at once.
    let rules = RuleSets::from_yaml_str(
        r#"
rule_sets:
  - id: default
    rules:
      - id: slow
        scope: global
        bands: [{ capacity: 1, window: 1s }]
        on_limit: { wait: { max_wait: 10s, max_waiters: 100 } }
      - id: hourly
        scope: global
        algorithm: sliding_window_log
        bands: [{ capacity: 3, window: 1h }, { capacity: 5, window: 2h }]
"#,
    )
    .expect("valid rules");
    let engine = in_memory(rules, TokioClock::new(), None);
    let start = Instant::now();
    let answers = at_once(&engine, 5, start).await;
    let secs = Duration::from_secs;
    assert_eq!(
        answers,
        [
            (false, secs(0)),
            (false, secs(0)),
            (true, secs(0)),
            (true, secs(1)),
            (true, secs(2))
        ]
    );
    let refused = check(&engine).await;
    assert!(!refused.allowed());
    assert_eq!(refused.rule().map(|r| &**r), Some("hourly"));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_waiter_gives_its_window_place_back() {
    let clock = TokioClock::new();
    let engine = waiting_on(clock, "fixed_window", "{ capacity: 1, window: 1s }", "2s", 100);
    assert!(check(&engine).await.allowed());
    // The second waits for the next window; dropped, its place there goes back.
    drop_a_waiter(&engine, Duration::ZERO).await;
    let to_boundary = Duration::from_nanos(SEC - clock.now_nanos() % SEC);
    let start = Instant::now();
    assert!(check(&engine).await.allowed());
    let after = start.elapsed();
    assert!(
        after >= to_boundary && after < to_boundary + Duration::from_millis(1),
        "the next window's place was not given back: {after:?} against {to_boundary:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_engines_policy_lets_every_rule_without_its_own_wait() {
    let rules = RuleSets::from_yaml_str(
        "rule_sets: [{ id: default, rules: [{ id: g, scope: global, bands: [{ capacity: 1, window: 1s }] }] }]",
    )
    .expect("valid rules");
    let wait = WaitPolicy::new(Duration::from_secs(1), 10).expect("in range");
    let engine = in_memory(rules, TokioClock::new(), Some(wait));
    let answers = at_once(&engine, 3, Instant::now()).await;
    let secs = Duration::from_secs;
    assert_eq!(answers, [(false, secs(0)), (true, secs(0)), (true, secs(1))]);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_never_holds_back_a_bucket_of_another_rule() {
    // `export` lets its requests wait ten minutes; `api`, a bucket of 100 a second for
    // everyone, does not wait. Taking the export's place in ten minutes would have moved
    // `api`'s instant ten minutes ahead, refusing every request until then: the export
    // request is refused at once instead, and `api` goes on admitting.
    let rules = RuleSets::from_yaml_str(
        r#"
rule_sets:
  - id: default
    rules:
      - id: export
        scope: global
        match: { paths: ["/export"] }
        bands: [{ capacity: 1, window: 10m }]
        on_limit: { wait: { max_wait: 1h, max_waiters: 10 } }
      - id: api
        scope: global
        bands: [{ capacity: 100, window: 1s }]
"#,
    )
    .expect("valid rules");
    let engine = in_memory(rules, TokioClock::new(), None);
    let at = |path: &str| RequestContext::builder().path(path).build();
    let decide = |path: &'static str| {
        let engine = engine.clone();
        async move { engine.check(&at(path)).await.expect("a decision") }
    };
    assert!(decide("/export").await.allowed());
    let start = Instant::now();
    let second = decide("/export").await;
    assert!(!second.allowed(), "refused rather than hold `api` back");
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert!(decide("/other").await.allowed(), "`api` still admits");
}

/// A request waits only as long as every rule that refuses it allows: once `quick` is
/// empty, a request on `/slow`, which `quick` would admit after 1 s and `slow` after 4 s,
/// is refused at once (`quick` lets it wait 1.5 s), while one that `quick` alone decides
/// waits its second.
#[tokio::test(start_paused = true)]
async fn a_request_waits_no_longer_than_every_refusing_rule_allows() {
    for algorithm in ["token_bucket", "leaky_bucket"] {
        let rules = RuleSets::from_yaml_str(&shortest_wait(algorithm)).expect("valid rules");
        let engine = in_memory(rules, TokioClock::new(), None);
        let check_on = async |path: &str| {
            engine
                .check(&RequestContext::builder().path(path).build())
                .await
                .expect("a decision")
        };
        assert!(check_on("/slow").await.allowed());
        for _ in 0..9 {
            assert!(check_on("/fast").await.allowed());
        }
        let start = Instant::now();
        let refused = check_on("/slow").await;
        assert!(!refused.allowed(), "{algorithm}: a wait of 4 s past quick's 1.5 s");
        assert_eq!(start.elapsed(), Duration::ZERO, "{algorithm}: refused at once");
        assert!(check_on("/fast").await.allowed());
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(1),
            "{algorithm}: quick alone waits 1 s"
        );
    }
}

/// A caller's own bound on waiting (`RequestContext::max_wait`, what a gateway asking the
/// rate-limit service sends) caps every rule's: a request that would wait longer is refused
/// at once, one within it waits as the rule lets it, and a bound of zero never waits.
#[tokio::test(start_paused = true)]
async fn a_callers_max_wait_caps_the_rules() {
    // 1 per second, waiting up to 2 s: the second request would wait 1 s.
    let engine = waiting("token_bucket", "{ capacity: 1, window: 1s }", "2s", 100);
    assert!(check(&engine).await.allowed());
    let start = Instant::now();
    let bounded = |max_wait: Duration| RequestContext::builder().max_wait(max_wait).build();
    for cap in [Duration::ZERO, Duration::from_millis(999)] {
        let decision = engine.check(&bounded(cap)).await.expect("a decision");
        assert!(!decision.allowed(), "a wait of 1 s past a bound of {cap:?}");
        assert_eq!(start.elapsed(), Duration::ZERO, "refused at once");
        assert_eq!(decision.retry_after, Some(Duration::from_secs(1)));
    }
    let decision = engine
        .check(&bounded(Duration::from_secs(1)))
        .await
        .expect("a decision");
    assert!(decision.allowed());
    assert_eq!(start.elapsed(), Duration::from_secs(1), "waited as the rule lets it");
}

/// A backend that decides in memory as each call reaches it and answers the `n`th call
/// `n × 10 ms` later, as over a network: requests decided together come back one by one.
fn answers_in_turn(memory: MemoryLimiter) -> Around<MemoryLimiter> {
    let calls = AtomicU32::new(0);
    Around::new(memory, move |memory, request| {
        let outcome = memory.acquire_now(request);
        let n = calls.fetch_add(1, Ordering::Relaxed) + 1;
        MaybeReady::boxed(async move {
            tokio::time::sleep(Duration::from_millis(10 * u64::from(n))).await;
            Ok(outcome)
        })
    })
}

/// A waiter's place is taken before the request's call: of two requests sent together with
/// one place free, the first takes it and waits (at 1 s); the second finds none, may not
/// wait, and is refused at once without taking a place in the bucket, so the bucket's next
/// place (2 s) is the next request's. `max_waiters` holds however the answers come back.
#[tokio::test(start_paused = true)]
async fn of_requests_sent_together_no_more_than_max_waiters_wait_and_no_place_goes_unused() {
    let clock = TokioClock::new();
    let rules = RuleSets::from_yaml_str(
        r#"
rule_sets:
  - id: default
    rules:
      - id: global
        scope: global
        bands: [{ capacity: 1, window: 1s }]
        on_limit: { wait: { max_wait: 5s, max_waiters: 1 } }
"#,
    )
    .expect("valid rules");
    let limiter = answers_in_turn(MemoryLimiter::builder().clock(clock).build());
    let engine = Engine::builder(rules).limiter(limiter).build().expect("an engine");
    let start = Instant::now();
    assert!(check(&engine).await.allowed(), "the bucket's one permit");
    let mut answers = at_once(&engine, 2, start).await;
    answers.sort_by_key(|a| a.1);
    let (refused, waited) = (answers[0], answers[1]);
    assert!(
        !refused.0 && refused.1 < Duration::from_millis(100),
        "one is refused at once: {answers:?}"
    );
    assert!(
        waited.0 && waited.1 >= Duration::from_secs(1) && waited.1 < Duration::from_millis(1100),
        "the other waits for the place at 1 s: {answers:?}"
    );
    // The next place is at 2 s: the refused request took none.
    let ctx = RequestContext::builder().max_wait(Duration::ZERO).build();
    tokio::time::sleep_until(start + Duration::from_secs(2)).await;
    let next = engine.check(&ctx).await.expect("a decision");
    assert!(next.allowed(), "the place at 2 s is free: {next:?}");
}
