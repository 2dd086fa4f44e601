//! Every key outlives its meaning: after any mix of decisions (every algorithm, bands of
//! several windows, costs above 1, requests that wait, a rule whose window changed, refunds
//! of leases and of dropped waiters' places), each key's expiry (Redis's `TIME` and the
//! key's `PTTL`, read in one script) lies at or after the last instant its stored state
//! still counts something, by 100 ms or more (a second when its expiry is written, less
//! when a token bucket's write keeps it). A key that expired earlier would be read as a
//! full bucket while its permits were still spent.

use std::sync::Arc;
use std::time::Duration;

use fluxgate::core::limiter::AcquireRequest;
use fluxgate::core::{RateLimiter, Text};
use fluxgate::redis::{Batching, RedisLimiter};

use crate::support::app::{five_algorithms_in_two_versions as versions, rules};
use crate::support::redis::{Redis, Servers};
use crate::support::rng::Rng;
use crate::support::servers::RedisServer;

/// A window as the keys write it (`700ms`, `1s`), in µs.
fn window_us(text: &str) -> i64 {
    if let Some(ms) = text.strip_suffix("ms") {
        ms.parse::<i64>().expect("ms") * 1_000
    } else if let Some(s) = text.strip_suffix('s') {
        s.parse::<i64>().expect("s") * 1_000_000
    } else {
        panic!("a window in a key: {text}")
    }
}

/// A token or leaky bucket's stored instant (`<t>` or `<t>:<f>`) in `radix`: the instant it
/// is full (or its queue empty) again.
fn instant(state: &str, radix: u32) -> Option<i64> {
    if state.is_empty() {
        return None;
    }
    let mut parts = state.split(':');
    let t = i64::from_str_radix(parts.next()?, radix).expect("an instant");
    let f = parts
        .next()
        .map_or(0, |f| i64::from_str_radix(f, radix).expect("a remainder"));
    Some(t + i64::from(f > 0))
}

/// The last instant (µs) the state of `key` (its value, or a log's newest score) still
/// counts something; `None` when it counts nothing.
fn meaning_until(key: &str, value: &str) -> Option<i64> {
    let tail = key.rsplit('}').next().unwrap_or("");
    if tail.is_empty() {
        // A token-bucket rule: its bands' instants, in hexadecimal, after the layout.
        return value.split('|').skip(1).filter_map(|s| instant(s, 16)).max();
    }
    // `:<band>:<capacity>/<window>:lb`, `:<band>:<window>:<suffix>` for the windows
    let parts: Vec<&str> = tail.split(':').collect();
    let [_, _, figures, suffix] = parts[..] else {
        return None; // a refund's mark
    };
    let w = window_us(figures.rsplit('/').next().expect("a window"));
    let n: Vec<i64> = value.split(':').map(|x| x.parse().unwrap_or(0)).collect();
    let at = |i: usize| n.get(i).copied().unwrap_or(0);
    match suffix {
        "lb" => instant(value, 10),
        "fw" => [(at(1), at(0)), (at(2), at(0) + w)]
            .into_iter()
            .filter(|(count, _)| *count > 0)
            .map(|(_, until)| until)
            .max(),
        "swc" => [(at(1), at(0)), (at(2), at(0) + w), (at(3), at(0) + 2 * w)]
            .into_iter()
            .filter(|(count, _)| *count > 0)
            .map(|(_, until)| until)
            .max(),
        "swl" => value.parse::<i64>().ok().map(|newest| newest + w),
        _ => None,
    }
}

/// Every key under `prefix`: Redis's now (µs), and per key its name, value (a log's newest
/// score) and `PTTL`, read in one script.
const READ: &str = r"
local t = redis.call('TIME')
local out = {t[1], t[2]}
local cursor = '0'
repeat
  local r = redis.call('SCAN', cursor, 'MATCH', ARGV[1], 'COUNT', 1000)
  cursor = r[1]
  for _, k in ipairs(r[2]) do
    local kind = redis.call('TYPE', k).ok
    local v = ''
    if kind == 'string' then
      v = redis.call('GET', k)
    elseif kind == 'zset' then
      v = redis.call('ZRANGE', k, -1, -1, 'WITHSCORES')[2] or ''
    end
    out[#out + 1] = k
    out[#out + 1] = v
    out[#out + 1] = redis.call('PTTL', k)
  end
until cursor == '0'
return out
";

/// Checks every key under `prefix`; returns the least margin (µs) by which a key with state
/// outlived its meaning, and the keys that expire before it.
fn check(nodes: &[&RedisServer], prefix: &str) -> (i64, Vec<String>) {
    let (mut least, mut early) = (i64::MAX, Vec::new());
    for node in nodes {
        let (margin, keys) = check_node(node, prefix);
        least = least.min(margin);
        early.extend(keys);
    }
    (least, early)
}

/// [`check`] on one node.
fn check_node(node: &RedisServer, prefix: &str) -> (i64, Vec<String>) {
    let out = node.cli(&["EVAL", READ, "0", &format!("{prefix}:*")]);
    let lines: Vec<&str> = out.lines().collect();
    let now = lines[0].parse::<i64>().expect("secs") * 1_000_000 + lines[1].parse::<i64>().expect("us");
    let mut least = i64::MAX;
    let mut early = Vec::new();
    for item in lines[2..].chunks(3) {
        let [key, value, pttl] = item else { continue };
        let pttl: i64 = pttl.trim().parse().expect("a PTTL");
        let Some(until) = meaning_until(key, value) else {
            continue;
        };
        if until <= now {
            continue;
        }
        if pttl < 0 {
            early.push(format!("{key} = {value}: PTTL {pttl}"));
            continue;
        }
        let expires = now + pttl * 1_000;
        least = least.min(expires - until);
        if expires < until {
            early.push(format!(
                "{key} = {value}: expires {} ms before its state ends",
                (until - expires) / 1_000
            ));
        }
    }
    (least, early)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_outlives_what_its_state_counts() {
    let redis = Redis::start(Servers::standalone()).await;
    outlive(&redis, &[redis.server()], "outlive", None, 0x9e37_79b9_7f4a_7c15).await;
}

/// On a cluster, where each rule's keys sit in a hash slot of their own: a request of
/// several rules is decided by one call per slot, and the slots that admitted it give back
/// what they took when another refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_outlives_what_its_state_counts_on_a_cluster() {
    let redis = Redis::start(Servers::shared_cluster()).await;
    let nodes: Vec<&RedisServer> = redis.cluster().nodes.iter().collect();
    outlive(&redis, &nodes, "outlive-cluster", None, 0x5555_3333_1111_7777).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_outlives_what_its_state_counts_in_batches() {
    let redis = Redis::start(Servers::standalone()).await;
    outlive(
        &redis,
        &[redis.server()],
        "outlive-batched",
        Some(Batching::new()),
        0x0123_4567_89ab_cdef,
    )
    .await;
}

/// A limiter on `redis` under `prefix`, without a deny cache: every decision is Redis's.
async fn limiter(redis: &Redis, prefix: &str, batching: Option<Batching>) -> RedisLimiter {
    RedisLimiter::builder(redis.url())
        .prefix(prefix)
        .timeout(Duration::from_secs(5))
        .deny_cache(false)
        .batching(batching)
        .connect()
        .await
        .expect("connect to the test Redis")
}

/// Random decisions and refunds on `redis`, under `prefix`, each followed by the check of
/// every key.
async fn outlive(redis: &Redis, nodes: &[&RedisServer], prefix: &str, batching: Option<Batching>, seed: u64) {
    let limiter = limiter(redis, prefix, batching).await;
    let sets = versions();
    let mut rng = Rng(seed);
    let (mut least, mut early, mut waited, mut refunds) = (i64::MAX, Vec::new(), 0, 0);
    // 400 steps, and more (up to 1,200) until more than 10 requests have waited: on a slow
    // machine more time passes between steps, the buckets refill, and fewer requests wait.
    for step in 0..1_200 {
        if step >= 400 && waited > 10 {
            break;
        }
        let set = &sets[usize::from(rng.below_u64(5) == 0)];
        let mut request = AcquireRequest::new(set.clone());
        let count = 1 + rng.below_u64(3);
        let mut chosen = Vec::new();
        while (chosen.len() as u64) < count {
            let rule = rng.below_u64(6) as usize;
            if !chosen.contains(&rule) {
                chosen.push(rule);
            }
        }
        let max_wait = [0, 0, 500, 2_000, 4_000][rng.below_u64(5) as usize];
        for (index, &rule) in chosen.iter().enumerate() {
            request.push_permits(rule, Text::from("global"), 1 + rng.below_u64(3));
            request.set_max_wait(index, Duration::from_millis(max_wait));
        }
        let outcome = limiter.acquire(&request).await.expect("Redis decides");
        if outcome.allowed {
            let later = !outcome.admitted_after.is_zero();
            waited += u32::from(later);
            // Now and then, a refund: a dropped waiter's place, or a lease's permits.
            if rng.below_u64(4) == 0 {
                refunds += 1;
                if later {
                    let at = outcome.now_unix_nanos + u64::try_from(outcome.admitted_after.as_nanos()).unwrap_or(0);
                    limiter
                        .give_back_place(&request, at, &outcome.marks)
                        .await
                        .expect("the place goes back");
                } else {
                    limiter
                        .give_back(&request, outcome.now_unix_nanos)
                        .await
                        .expect("the permits go back");
                }
            }
        }
        let (margin, mut keys) = check(nodes, prefix);
        least = least.min(margin);
        for key in &mut keys {
            key.insert_str(0, &format!("step {step}: "));
        }
        early.extend(keys);
        tokio::time::sleep(Duration::from_millis(rng.below_u64(120))).await;
    }
    eprintln!(
        "{waited} requests waited, {refunds} refunds; least margin {} ms",
        least / 1_000
    );
    assert!(waited > 10, "too few waiting requests to say anything: {waited}");
    assert!(
        early.is_empty(),
        "keys expiring before their state ends:\n{}",
        early.join("\n")
    );
    // Every key keeps 100 ms or more past its state's end: a second when written with
    // its expiry, and a write that keeps the expiry leaves its instant 100 ms or more short
    // of the end of the second the stored instant lies in (`one_token_bucket.lua`). `px()`
    // and PTTL each drop part of a ms, and a loaded server may start a script's expiry
    // clock a little before the script reads `TIME` (3.1 ms measured once on the cluster).
    assert!(least >= 90_000, "a key outlived its state by only {least} µs");
}

/// The microseconds since the Unix epoch on this host's clock (Redis runs on it too).
fn unix_us() -> i64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after the epoch");
    i64::try_from(since.as_micros()).expect("a recent instant")
}

/// A fixed window's lease ends with its window: three instances hammering one leased key
/// of 10 per 500 ms (leases of 4, for an hour) never admit more than 10 in a window, counting
/// each admitted request whose decision began and ended inside one window, across six
/// windows and the leases expiring at each window's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_windows_leases_never_carry_permits_into_the_next_window() {
    use fluxgate::core::{Engine, RequestContext};
    let redis = Redis::start(Servers::standalone()).await;
    let yaml = r#"
rule_sets:
  - id: default
    rules:
      - id: global
        scope: global
        algorithm: fixed_window
        bands: [{ capacity: 10, window: 500ms }]
        lease: { max: 4, ttl: 1h }
"#;
    let mut engines = Vec::new();
    for _ in 0..3 {
        let limiter = RedisLimiter::builder(redis.url())
            .prefix("fw-lease")
            .deny_cache(false)
            .timeout(Duration::from_secs(5))
            .connect()
            .await
            .expect("connect to the test Redis");
        let engine = Engine::builder(rules(yaml))
            .limiter(limiter)
            .build()
            .expect("the rules load");
        engines.push(Arc::new(engine));
    }
    const W: i64 = 500_000;
    let end = unix_us() + 6 * W;
    let mut tasks = Vec::new();
    for engine in &engines {
        let engine = engine.clone();
        tasks.push(tokio::spawn(async move {
            let ctx = RequestContext::builder().build();
            let mut admitted = Vec::new();
            while unix_us() < end {
                let before = unix_us();
                let decision = engine.check(&ctx).await.expect("a decision");
                let after = unix_us();
                if decision.allowed() {
                    admitted.push((before, after));
                }
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
            admitted
        }));
    }
    let mut per_window = std::collections::BTreeMap::<i64, u32>::new();
    let mut total = 0;
    for task in tasks {
        for (before, after) in task.await.expect("the task ends") {
            total += 1;
            if before / W == after / W {
                *per_window.entry(before / W).or_default() += 1;
            }
        }
    }
    eprintln!(
        "{total} admitted; per window: {:?}",
        per_window.values().collect::<Vec<_>>()
    );
    assert!(per_window.len() >= 5, "too few windows: {per_window:?}");
    assert!(
        per_window.values().all(|&n| n <= 10),
        "a window admitted more than 10: {per_window:?}"
    );
}

/// A token bucket's write keeps its key's expiry (`SETRANGE` in place, or `SET … KEEPTTL`,
/// each well below `PSETEX` in Redis) only while its new instant lies 100 ms or more short
/// of the end of the whole second in which the stored instant lies; past that, the write
/// sets the expiry again. Through the rule's one-band script and through batches alike: see
/// [`writes_and_expiries`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_keeps_its_keys_expiry_only_well_inside_the_stored_instants_second() {
    let redis = Redis::start(Servers::standalone()).await;
    for (prefix, batching) in [("keep", None), ("keep-batched", Some(Batching::new()))] {
        let limiter = limiter(&redis, prefix, batching).await;
        writes_and_expiries(&redis, &limiter, prefix, true).await;
    }
}

/// A Redis user allowed only the commands the one-band scripts made before batches read
/// their keys together and writes kept their expiry (no `MGET`, `SET` or `SETRANGE`) still
/// gets every decision, exactly: a batch reads each key with `GET`, and a write that would
/// keep its key's expiry sets it again with `PSETEX`. (With the refused commands failing
/// the call, every such request went to the failure policy, admitted uncounted under
/// `fail_open`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_allowed_only_the_earlier_commands_gets_every_decision() {
    let redis = Redis::start(Servers::standalone()).await;
    let server = redis.server();
    let created = server.cli(&[
        "ACL",
        "SETUSER",
        "earlier",
        "on",
        ">earlier-password",
        "~*",
        "&*",
        "+@all",
        "-mget",
        "-set",
        "-setrange",
    ]);
    assert_eq!(created.trim(), "OK");
    let url = format!("redis://earlier:earlier-password@127.0.0.1:{}", server.port());
    for (prefix, batching) in [("earlier", None), ("earlier-batched", Some(Batching::new()))] {
        let limiter = RedisLimiter::builder(url.clone())
            .prefix(prefix)
            .timeout(Duration::from_secs(5))
            .deny_cache(false)
            .batching(batching)
            .connect()
            .await
            .expect("connect to the test Redis");
        writes_and_expiries(&redis, &limiter, prefix, false).await;
    }
}

/// Through `limiter` (keys under `prefix`): each rule's key is set to a state at an instant
/// 10 s ahead, at a chosen point of its second, with an expiry of a minute, and a request
/// of one permit moves it on: 1 ms for a rule of 3,600,000 an hour (13 digits written over
/// 13 in place), 514 µs and 3,600 sevenths for one of 7,000,000 (a state with a remainder,
/// written whole). Each time, the new state is checked, and the expiry: kept while the new
/// instant stays 100 ms short of the end of the stored instant's second and `may_keep`, set
/// again otherwise. The requests before a rule's first check let its scripts load.
async fn writes_and_expiries(redis: &Redis, limiter: &RedisLimiter, prefix: &str, may_keep: bool) {
    let server = redis.server();
    let set = rules(
        "rule_sets:\n  - id: default\n    rules:\n      - { id: fine, scope: global, bands: [{ capacity: 3600000, window: 1h }] }\n      - { id: scaled, scope: global, bands: [{ capacity: 7000000, window: 1h }] }\n",
    )
    .get("default")
    .expect("a rule set")
    .clone();
    // The stored state and the one written after a permit, of an instant.
    type State = fn(u64) -> String;
    // The last point of a second (µs) whose instant, moved on, stays short of 900 ms.
    let cases: [(usize, &str, State, State, u64); 2] = [
        (
            0,
            "fine",
            |at| format!("{at:x}"),
            |at| format!("{:x}", at + 1_000),
            898_999,
        ),
        (
            1,
            "scaled",
            |at| format!("{at:x}:3"),
            |at| format!("{:x}:5", at + 514),
            899_485,
        ),
    ];
    for (rule, name, stored_state, written_state, last_kept) in cases {
        let mut request = AcquireRequest::new(set.clone());
        request.push_permits(rule, Text::from("global"), 1);
        for _ in 0..3 {
            assert!(limiter.acquire(&request).await.expect("a decision").allowed);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let keys = server.cli(&["--scan", "--pattern", &format!("{prefix}:*:{name}:*")]);
        let key = keys.lines().next().expect("the rule's key").to_owned();
        let stored = server.cli(&["GET", &key]);
        let layout = &stored[..=stored.find('|').expect("a layout")];
        // Where in its second the stored instant lies (µs), and whether the write keeps
        // the minute's expiry: the new instant stays short of 900 ms, or not.
        for (into_second, kept) in [
            (300_000, true),
            (last_kept, true),
            (last_kept + 1, false),
            (950_000, false),
            (0, true),
        ] {
            let kept = kept && may_keep;
            let second = server.time_us() / 1_000_000 + 10;
            let instant = second * 1_000_000 + into_second;
            let value = format!("{layout}{}", stored_state(instant));
            assert_eq!(server.cli(&["SET", &key, &value, "PX", "60000"]).trim(), "OK");
            let outcome = limiter.acquire(&request).await.expect("a decision");
            assert!(outcome.allowed, "{prefix}, {name}: 10 s of an hour's debt admits");
            let written = server.cli(&["GET", &key]);
            assert_eq!(
                written.trim(),
                format!("{layout}{}", written_state(instant)),
                "{prefix}, {name}: the instant moved by the permit"
            );
            let pttl: i64 = server.cli(&["PTTL", &key]).trim().parse().expect("a PTTL");
            if kept {
                assert!(
                    pttl <= 60_000,
                    "{prefix}, {name}: the instant at {into_second} µs into its second kept the expiry: {pttl} ms"
                );
            } else {
                assert!(
                    pttl > 3_590_000,
                    "{prefix}, {name}: the instant at {into_second} µs into its second set the expiry again: {pttl} ms"
                );
            }
        }
    }
}
