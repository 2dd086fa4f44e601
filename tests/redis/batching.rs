//! Batched decisions (`Batching`) against a real `redis-server`: a lone request goes out at
//! once, gathered requests go out in batches of at most `max_requests` and are decided in
//! the order they arrived, and a request that fails in Redis fails alone.

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fluxgate::core::limiter::{AcquireOutcome, AcquireRequest, Wait};
use fluxgate::core::{Decision, Engine, Error, RateLimiter, RequestContext, Text};
use fluxgate::redis::{Batching, RedisLimiter};

use crate::support::app::rules;
use crate::support::redis::{Redis, Servers};

const PER_IP_TEN: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 10, window: 1h }]
"#;

/// A rule of 1,000 per hour, of which a client spends 990 before its 21 requests: no more
/// calls of one bucket go out at once than it admits from full (see `docs/redis.md`), so
/// its last 10 permits are what more requests than fit in one batch can contend for.
const PER_IP_THOUSAND: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 1000, window: 1h }]
"#;

async fn engine(redis: &Redis, batching: Batching) -> Engine {
    engine_within(redis, batching, Duration::from_secs(20)).await
}

async fn engine_within(redis: &Redis, batching: Batching, timeout: Duration) -> Engine {
    engine_of(redis, batching, timeout, PER_IP_TEN).await
}

async fn engine_of(redis: &Redis, batching: Batching, timeout: Duration, yaml: &str) -> Engine {
    let limiter = RedisLimiter::builder(redis.url())
        .prefix("batch")
        .deny_cache(false)
        .timeout(timeout)
        .batching(batching)
        .connect()
        .await
        .expect("connect to the test Redis");
    assert!(limiter.is_batching());
    Engine::builder(rules(yaml))
        .limiter(limiter)
        .build()
        .expect("the backend decides every rule")
}

fn ctx(ip: &str) -> RequestContext {
    RequestContext::builder()
        .client_ip(ip.parse().expect("an address"))
        .build()
}

type Pending = Pin<Box<dyn Future<Output = Result<Decision, Error>> + Send>>;

/// Starts each decision in turn (each is polled once, so that it reaches the limiter's
/// queue in this order), while Redis is paused: none of them can be answered yet.
async fn start_in_order(engine: &Engine, contexts: &[RequestContext]) -> Vec<Pending> {
    let mut pending: Vec<Pending> = contexts.iter().map(|c| Box::pin(engine.check(c)) as Pending).collect();
    poll_fn(|cx| {
        for (i, decision) in pending.iter_mut().enumerate() {
            assert!(
                decision.as_mut().poll(cx).is_pending(),
                "request {i} decided while Redis is paused"
            );
        }
        Poll::Ready(())
    })
    .await;
    pending
}

/// Pauses the writing commands on `redis` (every `EVALSHA`; `CLIENT LIST` still runs) for
/// `pause`, and says how long the caller then took to start its requests: past the pause,
/// the test cannot tell what it checks.
struct Paused {
    at: Instant,
    pause: Duration,
}

impl Paused {
    fn new(redis: &Redis, pause: Duration) -> Self {
        let ms = pause.as_millis().to_string();
        assert_eq!(redis.server().cli(&["CLIENT", "PAUSE", &ms, "WRITE"]).trim(), "OK");
        Self {
            at: Instant::now(),
            pause,
        }
    }

    fn check_still_paused(&self) {
        let late = self.at.elapsed();
        assert!(
            late < self.pause,
            "the requests took {late:?} to start, longer than Redis was paused ({:?}): the machine is too busy for this test",
            self.pause
        );
    }
}

/// With no call in flight, a request goes out at once, alone: it never waits for the
/// batch's delay, however long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_request_goes_out_at_once() {
    let redis = Redis::start(Servers::standalone()).await;
    let max_delay = Duration::from_secs(30);
    let engine = engine(&redis, Batching::new().max_calls(1).max_delay(max_delay)).await;
    for i in 0..3 {
        let before = redis.server().evalsha_calls();
        let start = Instant::now();
        let d = engine.check(&ctx("192.0.2.1")).await.expect("decision");
        let took = start.elapsed();
        assert!(d.allowed());
        assert_eq!(d.remaining(), Some(9 - i));
        assert!(took < max_delay / 3, "a lone request waited {took:?}");
        assert_eq!(redis.server().evalsha_calls() - before, 1, "one call for one request");
    }
}

/// While the one call allowed is in flight, the requests that arrive gather, and go out
/// together when it ends, decided in the order they arrived: of 21 requests of one client
/// with 10 permits left, exactly the first 10 pass, in two calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gathered_requests_are_decided_in_arrival_order() {
    let batching = Batching::new().max_calls(1).max_delay(Duration::from_secs(60));
    let (allowed, calls) = one_client_while_paused(batching, "192.0.2.2").await;
    let expected: Vec<bool> = (0..21).map(|i| i < 10).collect();
    assert_eq!(allowed, expected, "the first ten in arrival order pass");
    assert_eq!(calls, 2, "the first request alone, then the 20 gathered in one batch");
}

/// A batch holds at most `max_requests`: a full one goes out at once, even while the calls
/// allowed are in flight. Of 21 requests with batches of 8: the first alone (the call was
/// free), two full batches, and the last 4 when a call ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_closes_at_max_requests() {
    let batching = Batching::new()
        .max_calls(1)
        .max_requests(8)
        .max_delay(Duration::from_secs(60));
    let (allowed, calls) = one_client_while_paused(batching, "192.0.2.6").await;
    let admitted = allowed.iter().filter(|a| **a).count();
    assert_eq!(admitted, 10, "exactly the capacity, whatever the order of the batches");
    assert_eq!(calls, 4, "21 requests in batches of at most 8");
}

/// 21 requests of the client `ip` (10 permits left), started in turn while Redis is
/// paused: whether each passed, and the script calls they took.
async fn one_client_while_paused(batching: Batching, ip: &str) -> (Vec<bool>, u64) {
    let redis = Redis::start(Servers::standalone()).await;
    let engine = engine_of(&redis, batching, Duration::from_secs(20), PER_IP_THOUSAND).await;
    for _ in 0..990 {
        assert!(engine.check(&ctx(ip)).await.expect("decision").allowed());
    }
    let before = redis.server().evalsha_calls();
    let contexts: Vec<RequestContext> = (0..21).map(|_| ctx(ip)).collect();
    let paused = Paused::new(&redis, Duration::from_millis(1500));
    let pending = start_in_order(&engine, &contexts).await;
    paused.check_still_paused();
    let mut allowed = Vec::new();
    for decision in pending {
        allowed.push(decision.await.expect("decision").allowed());
    }
    (allowed, redis.server().evalsha_calls() - before)
}

/// While the calls allowed are in flight, a request waits at most `max_delay`, then goes
/// out whether or not a call is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_at_most_max_delay_for_a_call() {
    let redis = Redis::start(Servers::standalone()).await;
    let batching = Batching::new().max_calls(1).max_delay(Duration::from_millis(100));
    let engine = engine(&redis, batching).await;
    let before = redis.server().evalsha_calls();
    let contexts: Vec<RequestContext> = (0..3).map(|_| ctx("192.0.2.7")).collect();
    // Redis answers nothing for 3 s: the first call stays in flight all that time.
    let paused = Paused::new(&redis, Duration::from_secs(3));
    let pending = start_in_order(&engine, &contexts).await;
    paused.check_still_paused();
    // Past max_delay, the two waiting requests went out in a second call while the first
    // is still unanswered: two connections wait on Redis's pause.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let blocked = blocked_calls(&redis);
    paused.check_still_paused();
    assert_eq!(blocked, 2, "the first call and the one the timer sent");
    for decision in pending {
        assert!(decision.await.expect("decision").allowed());
    }
    assert_eq!(redis.server().evalsha_calls() - before, 2);
}

/// The connections whose `EVALSHA` waits on Redis's pause.
fn blocked_calls(redis: &Redis) -> usize {
    let clients = redis.server().cli(&["CLIENT", "LIST"]);
    clients
        .lines()
        .filter(|l| l.contains("cmd=evalsha") && l.split(' ').any(|f| f.starts_with("flags=") && f.contains('b')))
        .count()
}

/// Without the timer's help (a delay longer than the pause), the waiting requests stay
/// queued behind the call in flight: one connection waits on Redis's pause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_gather_while_the_calls_allowed_are_in_flight() {
    let redis = Redis::start(Servers::standalone()).await;
    let batching = Batching::new().max_calls(1).max_delay(Duration::from_secs(60));
    let engine = engine(&redis, batching).await;
    let contexts: Vec<RequestContext> = (0..3).map(|_| ctx("192.0.2.8")).collect();
    let paused = Paused::new(&redis, Duration::from_secs(3));
    let pending = start_in_order(&engine, &contexts).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let blocked = blocked_calls(&redis);
    paused.check_still_paused();
    assert_eq!(blocked, 1, "only the first call went out");
    for decision in pending {
        assert!(decision.await.expect("decision").allowed());
    }
}

/// A request of 256 keys or more (here one per band of a fixed-window rule) does not fit a
/// batch's header: it goes out in a call of its own at once, even while the one batch call
/// allowed is in flight; one of 255 keys waits for that call, as any request does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_256_keys_goes_in_a_call_of_its_own() {
    let redis = Redis::start(Servers::standalone()).await;
    let bands = |n: u32| {
        (1..=n)
            .map(|s| format!("{{ capacity: 1000, window: {s}s }}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let yaml = format!(
        "rule_sets:\n  - id: default\n    rules:\n      - {{ id: per-ip, bands: [{{ capacity: 10, window: 1h }}] }}\n  \
         - id: wide\n    rules:\n      - {{ id: w, algorithm: fixed_window, bands: [{}] }}\n  \
         - id: almost\n    rules:\n      - {{ id: w, algorithm: fixed_window, bands: [{}] }}\n",
        bands(256),
        bands(255)
    );
    let batching = Batching::new().max_calls(1).max_delay(Duration::from_secs(60));
    let engine = engine_of(&redis, batching, Duration::from_secs(20), &yaml).await;
    let wide = |set: &str| {
        RequestContext::builder()
            .rule_set_id(set)
            .client_ip("192.0.2.12".parse().expect("an address"))
            .build()
    };
    for (set, alone) in [("wide", true), ("almost", false)] {
        // The first request takes the one call allowed, held by Redis's pause; then the
        // request of many keys.
        let contexts = [ctx("192.0.2.11"), wide(set)];
        let paused = Paused::new(&redis, Duration::from_secs(3));
        let pending = start_in_order(&engine, &contexts).await;
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let blocked = blocked_calls(&redis);
        paused.check_still_paused();
        let keys = if alone { 256 } else { 255 };
        assert_eq!(
            blocked,
            if alone { 2 } else { 1 },
            "a request of {keys} keys while the batch call is in flight"
        );
        for decision in pending {
            assert!(decision.await.expect("decision").allowed());
        }
    }
}

/// A request keeps the limiter's deadline while it waits for a call: past it, it fails with
/// a timeout, however long `max_delay`, and a request that had not gone out never does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_keeps_its_deadline() {
    let redis = Redis::start(Servers::standalone()).await;
    let batching = Batching::new().max_calls(1).max_delay(Duration::from_secs(60));
    let engine = engine_within(&redis, batching, Duration::from_millis(300)).await;
    let before = redis.server().evalsha_calls();
    let contexts: Vec<RequestContext> = (0..3).map(|_| ctx("192.0.2.10")).collect();
    let pause = Duration::from_secs(2);
    let paused = Paused::new(&redis, pause);
    let pending = start_in_order(&engine, &contexts).await;
    for decision in pending {
        let error = decision.await.expect_err("no answer from a paused Redis");
        assert!(format!("{error:?}").contains("Timeout(300ms)"), "{error:?}");
    }
    // They did not wait for Redis: still paused.
    paused.check_still_paused();
    // Once Redis runs again, at most the first call, written before the deadline, ran (its
    // connection, unanswered for more than a second, may have been closed as unresponsive
    // first, and the call with it).
    tokio::time::sleep_until((paused.at + pause + Duration::from_millis(500)).into()).await;
    let calls = redis.server().evalsha_calls() - before;
    assert!(
        calls <= 1,
        "the two requests past their deadline were never sent: {calls} calls"
    );
}

/// A request whose key holds another type fails in Redis; its neighbours in the batch are
/// decided, and counted, as if it had not been there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_fails_in_redis_fails_alone() {
    let redis = Redis::start(Servers::standalone()).await;
    let engine = engine(&redis, Batching::new().max_calls(1).max_delay(Duration::from_secs(60))).await;
    // The key of 192.0.2.3, made by a first decision, replaced by a list.
    assert!(engine.check(&ctx("192.0.2.3")).await.expect("decision").allowed());
    let keys = redis.server().cli(&["--scan", "--pattern", "batch:*192.0.2.3*"]);
    let key = keys.lines().next().expect("the client's key").to_owned();
    redis.server().cli(&["DEL", &key]);
    redis.server().cli(&["RPUSH", &key, "not a bucket"]);

    let contexts = [ctx("192.0.2.9"), ctx("192.0.2.4"), ctx("192.0.2.3"), ctx("192.0.2.4")];
    let paused = Paused::new(&redis, Duration::from_millis(1500));
    let pending = start_in_order(&engine, &contexts).await;
    paused.check_still_paused();
    let mut results = Vec::new();
    for decision in pending {
        results.push(decision.await);
    }
    let remaining = |i: usize| results[i].as_ref().expect("decision").remaining();
    assert_eq!(remaining(0), Some(9));
    assert_eq!(remaining(1), Some(9));
    assert_eq!(
        remaining(3),
        Some(8),
        "the failed neighbour took nothing of this client's"
    );
    // The failed request's decision follows the failure policy (fail open by default):
    // degraded, never counted.
    match &results[2] {
        Ok(d) => assert!(d.degraded, "{d:?}"),
        Err(e) => assert!(e.to_string().contains("WRONGTYPE"), "{e}"),
    }
}

/// Requests of the same rules, one of which asks for the bands' marks (a lease's call) and
/// the others not, gathered in one batch: each goes with its own arguments and reads its
/// own reply, as its own call would (the general script's arguments say whether to give
/// the marks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_asking_for_marks_or_not_keep_their_own_arguments_in_a_batch() {
    let redis = Redis::start(Servers::standalone()).await;
    let limiter = RedisLimiter::builder(redis.url())
        .prefix("marks")
        .deny_cache(false)
        .timeout(Duration::from_secs(20))
        // The three behind the first wait for its call: a batch due after the default
        // 500 µs would go out on another connection beside it, and Redis, once it
        // resumes, may serve that connection first.
        .batching(Batching::new().max_calls(1).max_delay(Duration::from_secs(60)))
        .connect()
        .await
        .expect("connect to the test Redis");
    let rules = rules(
        r#"
rule_sets:
  - id: default
    rules:
      - id: windowed
        scope: global
        algorithm: fixed_window
        bands: [{ capacity: 10, window: 1h }]
"#,
    );
    let set = rules.get("default").expect("a rule set").clone();
    let request = |marked: bool| {
        let mut request = AcquireRequest::new(set.clone());
        request.push(0, Text::from("global"));
        if marked {
            request.mark_places();
        }
        request
    };
    // The first goes out alone; the next three gather behind it, the marked one between.
    let requests = [request(false), request(false), request(true), request(false)];
    let paused = Paused::new(&redis, Duration::from_millis(1500));
    let mut pending: Vec<_> = requests.iter().map(|r| limiter.acquire(r)).collect();
    poll_fn(|cx| {
        for (i, outcome) in pending.iter_mut().enumerate() {
            assert!(
                Pin::new(outcome).poll(cx).is_pending(),
                "request {i} decided while Redis is paused"
            );
        }
        Poll::Ready(())
    })
    .await;
    paused.check_still_paused();
    for (i, outcome) in pending.into_iter().enumerate() {
        let outcome = outcome.await.unwrap_or_else(|e| panic!("request {i}: {e}"));
        assert!(outcome.allowed, "request {i}");
        assert_eq!(outcome.bands[0].remaining, 9 - i as u64, "request {i}");
        assert_eq!(outcome.marks.len(), usize::from(i == 2), "request {i}");
    }
}

/// After `SCRIPT FLUSH`, batched requests are decided one by one with their own scripts
/// and the batch script is loaded again: no request fails, none is counted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_fails_no_batched_request() {
    let redis = Redis::start(Servers::standalone()).await;
    let engine = engine(&redis, Batching::new()).await;
    for i in 0..9 {
        if i % 3 == 1 {
            assert_eq!(redis.server().cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
        }
        let d = engine
            .check(&ctx("192.0.2.5"))
            .await
            .expect("no request fails after SCRIPT FLUSH");
        assert_eq!(d.remaining(), Some(9 - i));
    }
}

/// The rules of [`a_rule_batch_decides_as_the_shared_batch_script`]: one token-bucket band
/// each, of scale 1, of scale 7 (14 per hour: each permit an instant and a remainder), in
/// shadow mode, and one its requests wait for: four scripts (a rule's script is made of its
/// band's numbers and its wait). Each admits at least 3 requests of 4 permits, the calls
/// of one key the test has in flight at once (more would wait in the process,
/// `calls_in_flight_per_key`).
const ONE_BAND_RULES: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: plain
        bands: [{ capacity: 12, window: 1h }]
      - id: scaled
        bands: [{ capacity: 14, window: 1h }]
      - id: watched
        mode: shadow
        bands: [{ capacity: 13, window: 1h }]
      - id: queue
        bands: [{ capacity: 12, window: 1h }]
"#;

/// A batch whose requests are all of one token-bucket rule of one band goes to the rule's
/// own batch script (`src/rule_script.rs`, `lua/rule_batch.lua`), and is decided exactly
/// as the shared batch script decides it. Two limiters on one server run the same
/// requests: one may load scripts; the other's user may not (`-script`, revoked after it
/// connected), so that its batches go to the shared batch script, as after `NOPERM`. Each
/// phase seeds four keys of a rule, then sends twelve requests of it, three per key, while
/// Redis is paused (the first goes out alone, the other eleven in one batch behind it): of
/// 1 to 4 permits, or all of 1 (one cost for the batch), or allowed to wait two hours.
///
/// The buckets refill one permit in minutes, and each key's instant lies ahead of now from
/// its seed on, so every figure is the same whenever a script ran, relative to the key's
/// seed: whether the request passed (enforced and shadow), the permits left, when the band
/// is full again, when it would admit the request, and when a waiting request goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_batch_decides_as_the_shared_batch_script() {
    let redis = Redis::start(Servers::standalone()).await;
    let server = redis.server();
    let created = server.cli(&[
        "ACL",
        "SETUSER",
        "shared",
        "on",
        ">shared-password",
        "~*",
        "&*",
        "+@all",
    ]);
    assert_eq!(created.trim(), "OK");
    let batching = Batching::new().max_calls(1).max_delay(Duration::from_secs(60));
    let connect = |url: String, prefix: &'static str| async move {
        RedisLimiter::builder(url)
            .prefix(prefix)
            .deny_cache(false)
            .timeout(Duration::from_secs(20))
            .batching(batching)
            .connect()
            .await
            .expect("connect to the test Redis")
    };
    let own = connect(redis.url(), "own").await;
    let shared_url = format!("redis://shared:shared-password@127.0.0.1:{}", server.port());
    let shared = connect(shared_url, "shared").await;
    // The shared batch script is loaded (at connect); from now on its user may not load any.
    assert_eq!(server.cli(&["ACL", "SETUSER", "shared", "-script"]).trim(), "OK");
    let cached = || server.info_number("memory", "number_of_cached_scripts");
    let refused_loads = || server.rejected_script_loads();
    let (cached_before, refused_before) = (cached(), refused_loads());

    let set = rules(ONE_BAND_RULES).get("default").expect("a rule set").clone();
    // Per phase: the rule, the seed's permits, each request's (key `i % 4`), its wait.
    let varied = [4, 3, 2, 4, 4, 3, 3, 1, 4, 4, 2, 4];
    let phases: [(usize, u64, [u64; 12], Option<Duration>); 5] = [
        (0, 1, varied, None),
        (0, 10, [1; 12], None),
        (1, 3, varied, None),
        (2, 2, varied, None),
        (3, 1, varied, Some(Duration::from_secs(7200))),
    ];
    for (phase, (rule, seed, permits, wait)) in phases.into_iter().enumerate() {
        let request = |key: usize, permits: u64| {
            let mut request = AcquireRequest::new(set.clone());
            request.push_permits(rule, Text::from(format!("p{phase}-k{key}")), permits);
            if let Some(wait) = wait {
                request.set_max_wait(0, wait);
            }
            request
        };
        let mut figures = Vec::new();
        for limiter in [&own, &shared] {
            let mut seeds = Vec::new();
            for key in 0..4 {
                let outcome = limiter.acquire(&request(key, seed)).await.expect("a decision");
                assert!(outcome.allowed && outcome.bands[0].allowed);
                seeds.push(outcome.bands[0].reset_at);
            }
            let requests: Vec<AcquireRequest> = permits
                .iter()
                .enumerate()
                .map(|(i, &permits)| request(i % 4, permits))
                .collect();
            let outcomes = acquire_while_paused(&redis, limiter, &requests).await;
            let seen: Vec<String> = outcomes
                .iter()
                .enumerate()
                .map(|(i, outcome)| relative_figures(outcome, seeds[i % 4]))
                .collect();
            figures.push(seen);
        }
        assert_eq!(
            figures[0], figures[1],
            "phase {phase}: the rule's batch script, then the shared one"
        );
        // Some requests admitted at once, others refused (a waiting one: admitted later).
        let at_once = figures[0]
            .iter()
            .filter(|f| f.contains("admitted now") && f.contains("band allowed true"))
            .count();
        assert!(
            at_once > 0 && at_once < 12,
            "phase {phase}: its band admits some requests at once, not all: {:#?}",
            figures[0]
        );
    }
    // A batch script per rule for the limiter that may load them; none for the other, whose
    // load Redis refused once per rule.
    assert_eq!(cached() - cached_before, 4, "the four rules' batch scripts");
    assert_eq!(
        refused_loads() - refused_before,
        4,
        "one refused load per rule, none again"
    );
}

/// `requests` started in turn while Redis is paused (the first goes out alone, the others
/// gather in one batch behind it), then decided once it runs again.
async fn acquire_while_paused(
    redis: &Redis,
    limiter: &RedisLimiter,
    requests: &[AcquireRequest],
) -> Vec<AcquireOutcome> {
    let paused = Paused::new(redis, Duration::from_secs(5));
    let mut pending: Vec<_> = requests.iter().map(|r| limiter.acquire(r)).collect();
    poll_fn(|cx| {
        for (i, outcome) in pending.iter_mut().enumerate() {
            assert!(
                Pin::new(outcome).poll(cx).is_pending(),
                "request {i} decided while Redis is paused"
            );
        }
        Poll::Ready(())
    })
    .await;
    paused.check_still_paused();
    assert_eq!(redis.server().cli(&["CLIENT", "UNPAUSE"]).trim(), "OK");
    let mut outcomes = Vec::new();
    for (i, outcome) in pending.into_iter().enumerate() {
        outcomes.push(outcome.await.unwrap_or_else(|e| panic!("request {i}: {e}")));
    }
    outcomes
}

/// What `outcome` says of its one band, its instants in µs from `seed` (its key's first
/// instant): the same whenever it was decided, while the key's instant lies ahead of now.
fn relative_figures(outcome: &AcquireOutcome, seed: SystemTime) -> String {
    let from_seed = |at: SystemTime| match at.duration_since(seed) {
        Ok(after) => i128::try_from(after.as_micros()).expect("µs"),
        Err(before) => -i128::try_from(before.duration().as_micros()).expect("µs"),
    };
    let now = UNIX_EPOCH + Duration::from_nanos(outcome.now_unix_nanos);
    let band = &outcome.bands[0];
    let wait = match band.wait {
        Wait::None => "none".to_owned(),
        Wait::After(after) => format!("at {}", from_seed(now + after)),
        Wait::Never => "never".to_owned(),
    };
    let admitted = if outcome.admitted_after.is_zero() {
        "now".to_owned()
    } else {
        format!("at {}", from_seed(now + outcome.admitted_after))
    };
    format!(
        "allowed {} shadow {} admitted {admitted} remaining {} full at {} band allowed {} wait {wait}",
        outcome.allowed,
        outcome.shadow_allowed,
        band.remaining,
        from_seed(band.reset_at),
        band.allowed,
    )
}
