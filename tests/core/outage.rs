//! `fallback_local` across an outage of a backend that is not in memory, on a paused tokio
//! clock: an in-memory limiter stands for the remote store, behind a switch that makes its
//! calls fail. What the fallback admits while it fails, the store counts afterwards
//! (security.md, section 5), however the request is decided: one that may wait for the
//! refill waits for it, and a waiting request's place given back keeps it counted.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fluxgate::core::{Engine, MaybeReady, MemoryLimiter, RequestContext, RuleSets, TokioClock};
use tokio::time::Instant;

use crate::support::backend::{at_once, Around};

/// The remote store answers.
const UP: u8 = 0;
/// Its calls fail at once.
const DOWN: u8 = 1;

/// An engine deciding one global token-bucket rule of `band` (ending with `more`) in an
/// in-memory store that is not local, on the paused clock, with the in-memory fallback;
/// and the switch of the store: [`UP`] or [`DOWN`].
fn engine(band: &str, more: &str) -> (Engine, Arc<AtomicU8>) {
    let clock = TokioClock::new();
    let rules = RuleSets::from_yaml_str(&format!(
        "rule_sets:\n  - id: default\n    rules:\n      - id: global\n        scope: global\n        \
         bands: [{band}]\n{more}"
    ))
    .expect("valid rules");
    let state = Arc::new(AtomicU8::new(UP));
    let switch = state.clone();
    let store = Around::new(
        MemoryLimiter::builder().clock(clock).build(),
        move |memory, request| match switch.load(Ordering::SeqCst) {
            DOWN => MaybeReady::ready(Err("the store is down".into())),
            _ => MaybeReady::ready(Ok(memory.acquire_now(request))),
        },
    );
    let engine = Engine::builder(rules)
        .limiter(store)
        .fallback(MemoryLimiter::builder().clock(clock).build())
        .build()
        .expect("the store decides every rule");
    (engine, state)
}

/// An engine of a global rule of 4 per 4 s whose requests may wait up to 10 s for the
/// refill, after the store admitted 2 and, while it failed, the fallback the 2 left; with
/// the instant it started.
async fn after_an_outage() -> (Engine, Instant) {
    let wait = "        on_limit: { wait: { max_wait: 10s, max_waiters: 10 } }\n";
    let (engine, store) = engine("{ capacity: 4, window: 4s }", wait);
    let ctx = RequestContext::builder().build();
    let start = Instant::now();
    assert_eq!(admissions(&engine, &ctx, 2).await, (2, 0), "the store admits 2");
    store.store(DOWN, Ordering::SeqCst);
    assert_eq!(admissions(&engine, &ctx, 4).await, (2, 2), "the fallback the 2 left");
    store.store(UP, Ordering::SeqCst);
    (engine, start)
}

/// The admissions of `n` checks, and how many of them the fallback decided.
async fn admissions(engine: &Engine, ctx: &RequestContext, n: usize) -> (usize, usize) {
    let (mut admitted, mut degraded) = (0, 0);
    for _ in 0..n {
        let d = engine.check(ctx).await.expect("a decision");
        if d.allowed() {
            admitted += 1;
            degraded += usize::from(d.degraded);
        }
    }
    (admitted, degraded)
}

/// Four per 4 s (one more each second), waiting up to 10 s: the store admits 2, the
/// fallback the 2 left during an outage; then three requests sent together, each of which
/// may wait, are admitted at 1, 2 and 3 s, as the bucket refills: the first takes the 2 the
/// fallback admitted with its own permit. Without that, two were admitted at once, 6 in the
/// first instant of a bucket of 4.
#[tokio::test(start_paused = true)]
async fn a_request_that_may_wait_takes_what_the_fallback_admitted_and_waits_for_it() {
    let (engine, start) = after_an_outage().await;
    let answers = at_once(&engine, 3, start).await;
    let s = Duration::from_secs;
    eprintln!("after the outage: {answers:?}");
    assert_eq!(answers, [(true, s(1)), (true, s(2)), (true, s(3))]);
}

/// As above; the first request after the outage, carrying the fallback's 2 admissions and
/// waiting for the place at 1 s, is dropped: its place goes back, its own permit only, so
/// the next request waits until 1 s all the same. Given back whole, the 2 were erased: the
/// next request was admitted at once, and one more after it.
#[tokio::test(start_paused = true)]
async fn a_waiting_place_given_back_keeps_what_the_fallback_admitted_counted() {
    let (engine, start) = after_an_outage().await;
    let waiter = tokio::spawn({
        let engine = engine.clone();
        async move { engine.check(&RequestContext::builder().build()).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    waiter.abort();
    assert!(waiter.await.is_err(), "the waiter was dropped while it waited");
    let answers = at_once(&engine, 2, start).await;
    eprintln!("after the dropped waiter: {answers:?}");
    let s = Duration::from_secs;
    assert_eq!(answers, [(true, s(1)), (true, s(2))]);
}
