//! Fairness of waiting for the refill on Redis: what other clients' requests do to one
//! client's waiting place.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fluxgate::core::{Engine, RequestContext};
use fluxgate::redis::RedisLimiter;

use crate::support::app::rules;
use crate::support::redis::{Redis, Servers};

/// A per-IP rule of 1 a second that lets requests wait up to 5 s, 4 at once.
async fn engine(redis: &Redis) -> Engine {
    per_ip_waiting(redis, "fairness", "5s", 4).await
}

/// A per-IP rule of 1 a second that lets requests wait up to `max_wait`, `max_waiters` at
/// once, its keys under `prefix`.
async fn per_ip_waiting(redis: &Redis, prefix: &str, max_wait: &str, max_waiters: u32) -> Engine {
    let limiter = RedisLimiter::builder(redis.url())
        .prefix(prefix)
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("connect to the test Redis");
    let rules = rules(&format!(
        r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        scope: ip
        bands: [{{ capacity: 1, window: 1s }}]
        on_limit: {{ wait: {{ max_wait: {max_wait}, max_waiters: {max_waiters} }} }}
"#
    ));
    Engine::builder(rules).limiter(limiter).build().expect("an engine")
}

/// Of `trials` clients, each sending two requests (the second waits 1 s for its own
/// bucket), how many had their second request admitted.
async fn victims(engine: &Engine, first: u8, trials: u8) -> usize {
    let mut admitted = 0;
    for t in 0..trials {
        let client = IpAddr::V4(Ipv4Addr::new(10, 9, first, t));
        let ctx = RequestContext::builder().client_ip(client).build();
        let one = engine.check(&ctx).await.expect("a decision");
        assert!(one.allowed(), "a fresh bucket admits");
        let two = engine.check(&ctx).await.expect("a decision");
        admitted += usize::from(two.allowed());
    }
    admitted
}

/// A request holds a waiter's place of each of its rules while its Redis call is out,
/// whether it will wait or not: a client keeping a few requests in flight (each from a
/// fresh address, each admitted at once, none waiting) leaves no place to the requests of
/// other clients that their own buckets would admit after a wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "by design: a request holds a waiter's place while its call is out, so that max_waiters holds (docs/acquisition.md)"]
async fn requests_in_flight_hold_the_waiters_places_of_other_clients() {
    let redis = Redis::start(Servers::standalone()).await;
    let engine = engine(&redis).await;
    const TRIALS: u8 = 10;
    let alone = victims(&engine, 1, TRIALS).await;

    // 8 loops of requests from fresh addresses, every one admitted at once.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let loops: Vec<_> = (0..8u8)
        .map(|l| {
            let (engine, stop, sent) = (engine.clone(), stop.clone(), sent.clone());
            tokio::spawn(async move {
                let mut n: u16 = 0;
                while !stop.load(Ordering::Relaxed) {
                    let [hi, lo] = n.to_be_bytes();
                    let client = IpAddr::V4(Ipv4Addr::new(10, 100 + l, hi, lo));
                    n = n.wrapping_add(1);
                    let decision = engine
                        .check(&RequestContext::builder().client_ip(client).build())
                        .await
                        .expect("a decision");
                    assert!(decision.allowed());
                    sent.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let beside = victims(&engine, 2, TRIALS).await;
    stop.store(true, Ordering::Relaxed);
    for l in loops {
        l.await.expect("no panic");
    }
    eprintln!(
        "second requests admitted after their wait: {alone} of {TRIALS} alone, {beside} of {TRIALS} beside \
         {} requests of fresh addresses (none waiting)",
        sent.load(Ordering::Relaxed)
    );
    assert_eq!(
        beside, alone,
        "requests that waited for nothing took the waiters' places of other clients"
    );
}

/// Requests of one address in flight together, each of which may wait, with one waiter's
/// place: the first takes it before its call and waits; the others may not wait and are
/// refused without taking a place in the bucket, so no place goes unused. (Had each
/// checked for a free place, reserved a later instant and then found the place taken when
/// answered, it could not have given that instant back, a token bucket giving back only the
/// latest place taken: the bucket's next admission was pushed seconds past what anyone
/// used.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_place_a_burst_takes_in_the_bucket_is_used() {
    let redis = Redis::start(Servers::standalone()).await;
    let engine = per_ip_waiting(&redis, "burst-places", "3s", 1).await;
    let client = IpAddr::V4(Ipv4Addr::new(10, 7, 7, 8));
    let ctx = RequestContext::builder().client_ip(client).build();
    let start = std::time::Instant::now();
    assert!(engine.check(&ctx).await.expect("a decision").allowed());
    // 6 requests at once, their calls out together: Redis holds writes for 300 ms.
    let paused = redis.server().cli(&["CLIENT", "PAUSE", "300", "WRITE"]);
    assert_eq!(paused.trim(), "OK");
    let burst: Vec<_> = (0..6)
        .map(|_| {
            let (engine, ctx) = (engine.clone(), ctx.clone());
            tokio::spawn(async move {
                let decision = engine.check(&ctx).await.expect("a decision");
                (decision.allowed(), start.elapsed())
            })
        })
        .collect();
    let mut admitted = Vec::new();
    for task in burst {
        let (allowed, at) = task.await.expect("no panic");
        if allowed {
            admitted.push(at);
        }
    }
    admitted.sort();
    let no_wait = RequestContext::builder()
        .client_ip(client)
        .max_wait(Duration::ZERO)
        .build();
    let next = loop {
        if engine.check(&no_wait).await.expect("a decision").allowed() {
            break start.elapsed();
        }
        assert!(start.elapsed() < Duration::from_secs(10), "nothing admitted in 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    eprintln!(
        "1 per second, waits up to 3 s: the burst's admitted after {admitted:?}, the next request after {next:?}"
    );
    // One waits, for the place at 1 s; the next is the next request's, 1 s after it.
    assert_eq!(admitted.len(), 1, "{admitted:?}");
    let last = admitted.last().copied().unwrap_or_default();
    assert!(
        next < last + Duration::from_millis(1500),
        "a place between went unused: the burst's last admitted after {last:?}, the next request after {next:?}"
    );
}
