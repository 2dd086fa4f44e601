//! The shared decision scenarios, run against a real `redis-server` in real time, one
//! server per test; and what only the Redis backend does.

use crate::support::redis::{Redis, Servers};
use crate::support::scenarios::scenario_tests;

scenario_tests!(
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    Redis::start(Servers::standalone()).await
);

/// The same scenarios with decisions in batches (the concurrency scenario's requests go
/// out together).
mod batched {
    use crate::support::redis::{Redis, Servers};
    use crate::support::scenarios::scenario_tests;

    scenario_tests!(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        Redis::batched(Servers::standalone()).await
    );
}

mod redis_only {
    use fluxgate::core::CircuitBreaker;
    use fluxgate::core::{
        CachingRuleSetProvider, Engine, MaybeReady, RequestContext, RuleSetLookup, RuleSetProvider,
        StaticRuleSetProvider,
    };
    use fluxgate::tower::RateLimitLayer;

    use crate::support::app::{app, get_from, rules};
    use crate::support::backend::{check, engine, Backend, Memory};
    use crate::support::redis::{Redis, Servers};
    use crate::support::servers::RedisCluster;

    const THREE_BY_TWO: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 100, window: 1m, label: minute }, { capacity: 1000, window: 1h, label: hour }]
      - id: per-user
        scope: user
        bands: [{ capacity: 100, window: 1m, label: minute }, { capacity: 1000, window: 1h, label: hour }]
      - id: global
        scope: global
        bands: [{ capacity: 100, window: 1m, label: minute }, { capacity: 1000, window: 1h, label: hour }]
"#;

    fn evalsha_calls(redis: &Redis) -> u64 {
        redis.server().evalsha_calls()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_script_call_per_decision_whatever_the_rule_count() {
        let redis = Redis::start(Servers::standalone()).await;
        let engine = engine(&redis, THREE_BY_TWO);
        let before = evalsha_calls(&redis);
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.1".parse().unwrap())
            .user_id("u")
            .build();
        for _ in 0..10 {
            let d = check(&engine, &ctx).await;
            assert!(d.allowed());
            assert_eq!(d.bands.len(), 6);
        }
        assert_eq!(evalsha_calls(&redis) - before, 10);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn script_flush_fails_no_request() {
        let redis = Redis::start(Servers::standalone()).await;
        let engine = engine(&redis, THREE_BY_TWO);
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.2".parse().unwrap())
            .user_id("u")
            .build();
        for i in 0..30 {
            if i % 10 == 5 {
                assert_eq!(redis.server().cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
            }
            let d = engine.check(&ctx).await.expect("no request fails after SCRIPT FLUSH");
            assert_eq!(d.remaining(), Some(99 - i));
        }
    }

    /// A rule of one token-bucket band is decided by a script of its own, its numbers
    /// written in (`src/rule_script.rs`): loaded before its first call, so that no call
    /// fails for want of it, and loaded again after `SCRIPT FLUSH`. The one-band script
    /// with arguments is never needed, even after the flush.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_one_band_rule_is_decided_by_a_script_of_its_own() {
        const ONE_BAND: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 40, window: 1h, label: hour }]
"#;
        let redis = Redis::start(Servers::standalone()).await;
        let server = redis.server();
        let engine = engine(&redis, ONE_BAND);
        let shared = fred::types::scripts::Script::from_lua(fluxgate::redis::ONE_TOKEN_BUCKET_LUA);
        let exists = |sha: &str| server.cli(&["SCRIPT", "EXISTS", sha]).trim().to_string();
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.3".parse().unwrap())
            .build();
        let (calls, failed) = (server.evalsha_calls(), server.evalsha_stat("failed_calls"));
        for i in 0..30 {
            if i % 10 == 5 {
                assert_eq!(server.cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
            }
            let d = engine.check(&ctx).await.expect("no request fails after SCRIPT FLUSH");
            assert!(d.allowed());
            assert_eq!(d.remaining(), Some(39 - i));
        }
        assert_eq!(
            exists(shared.sha1()),
            "0",
            "the shared one-band script was not loaded again"
        );
        // Three flushes, each found by one call that failed for want of the script.
        assert_eq!(server.evalsha_calls() - calls, 33);
        assert_eq!(server.evalsha_stat("failed_calls") - failed, 3.0);
    }

    /// A Redis user that may run scripts but not load them (`-script`: the operator loads
    /// the crate's scripts), over the application's client: a rule of one token-bucket
    /// band, whose own script Redis does not take, is decided by the shared one-band
    /// script, which the operator loaded. Old behaviour: every decision failed (20 of 20),
    /// its `SCRIPT LOAD` refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_user_who_may_not_load_scripts_is_decided_by_the_loaded_shared_script() {
        use fred::interfaces::ClientLike;
        let redis = Redis::start(Servers::standalone()).await;
        let server = redis.server();
        let loaded = server.cli(&["SCRIPT", "LOAD", fluxgate::redis::ONE_TOKEN_BUCKET_LUA]);
        assert_eq!(loaded.trim().len(), 40, "{loaded}");
        let created = server.cli(&[
            "ACL",
            "SETUSER",
            "runner",
            "on",
            ">runner-password",
            "~*",
            "&*",
            "+@all",
            "-script",
        ]);
        assert_eq!(created.trim(), "OK");
        let url = format!("redis://runner:runner-password@127.0.0.1:{}", server.port());
        let config = fred::types::config::Config::from_url(&url).expect("the test server's URL");
        let client = fred::types::Builder::from_config(config).build().expect("a client");
        client.init().await.expect("the client connects");
        let limiter = fluxgate::redis::RedisLimiter::from_client(client, "runner");
        let engine = Engine::builder(rules(
            "rule_sets:\n  - id: default\n    rules:\n      - id: per-ip\n        bands: [{ capacity: 5, window: 1h }]\n",
        ))
        .limiter(limiter)
        .build()
        .expect("the backend decides every rule");
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.71".parse().expect("an address"))
            .build();
        let (mut admitted, mut refused, mut failed) = (0, 0, 0);
        for _ in 0..20 {
            match engine.check(&ctx).await {
                Ok(d) if d.allowed() => admitted += 1,
                Ok(_) => refused += 1,
                Err(_) => failed += 1,
            }
        }
        assert_eq!((admitted, refused, failed), (5, 15, 0));
        // Refused once, its load is not tried again: the later calls go to the shared script.
        // (Redis counts a command the user may not run in `rejected_calls`.)
        let refused_loads = || server.rejected_script_loads();
        assert_eq!(refused_loads(), 1, "the load was tried once");
        let calls = server.evalsha_calls();
        let other = RequestContext::builder()
            .client_ip("192.0.2.72".parse().expect("an address"))
            .build();
        for _ in 0..3 {
            assert!(engine.check(&other).await.expect("decided").allowed());
        }
        assert_eq!(server.evalsha_calls() - calls, 3);
        assert_eq!(refused_loads(), 1, "no load tried again");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keys_are_bounded_tagged_and_expire() {
        let redis = Redis::start(Servers::standalone()).await;
        let engine = engine(&redis, THREE_BY_TWO);
        let hostile = format!("}}{{x:{}\n", "y".repeat(10_000));
        let ctx = RequestContext::builder()
            .client_ip("2001:db8::1".parse().unwrap())
            .user_id(hostile)
            .build();
        assert!(check(&engine, &ctx).await.allowed());
        let keys = redis.server().cli(&["--scan", "--pattern", "*"]);
        let keys: Vec<&str> = keys.lines().collect();
        // One key per token-bucket rule, holding both its bands.
        assert_eq!(keys.len(), 3, "{keys:?}");
        for key in keys {
            assert!(key.starts_with("test0:{default:"), "{key}");
            assert!(key.ends_with('}'), "{key}");
            assert!(key.len() < 200, "{key}");
            // Exactly one hash tag, and nothing of the user's value outside it.
            assert_eq!(key.matches('{').count(), 1, "{key}");
            assert_eq!(key.matches('}').count(), 1, "{key}");
            let value = redis.server().cli(&["GET", key]);
            assert!(value.starts_with("minute:100/1m,hour:1000/1h|"), "{key}: {value}");
            // The key outlives the longest window, an hour, by at most a second.
            let ttl: i64 = redis.server().cli(&["PTTL", key]).trim().parse().unwrap();
            assert!(ttl > 3_600_000 && ttl <= 3_601_000, "{key}: ttl {ttl}");
        }
    }

    /// An engine on a limiter of its own (keys under `prefix`, no deny cache) for a
    /// token-bucket rule `r` of `bands`, with a leaky-bucket rule `lb` of `other` per hour
    /// beside it when given (the general script then decides).
    async fn rule_r_engine(url: String, prefix: &str, bands: &str, other: Option<u64>) -> Engine {
        engine_on(url, prefix, &rule_r(bands, other), None).await
    }

    /// The rule set of [`rule_r_engine`].
    fn rule_r(bands: &str, other: Option<u64>) -> String {
        let mut yaml = format!("rule_sets:\n  - id: default\n    rules:\n      - id: r\n        bands: [{bands}]\n");
        if let Some(capacity) = other {
            yaml.push_str(&format!(
                "      - {{ id: lb, algorithm: leaky_bucket, bands: [{{ capacity: {capacity}, window: 1h }}] }}\n"
            ));
        }
        yaml
    }

    /// An engine of the rule set `yaml` on a limiter of its own (keys under `prefix`, no
    /// deny cache, `batching`).
    async fn engine_on(url: String, prefix: &str, yaml: &str, batching: Option<fluxgate::redis::Batching>) -> Engine {
        let limiter = fluxgate::redis::RedisLimiter::builder(url)
            .prefix(prefix)
            .deny_cache(false)
            .batching(batching)
            .timeout(std::time::Duration::from_secs(2))
            .connect()
            .await
            .expect("the test server takes connections");
        Engine::builder(rules(yaml))
            .limiter(limiter)
            .build()
            .expect("Redis decides every rule")
    }

    /// A token-bucket rule keeps its bands in one key: when the rule changes, a band whose
    /// window or label changed starts full, one whose capacity alone changed goes on from
    /// the permits its former band holds in use, and the others keep their counts,
    /// whichever script decides (one band, token buckets only, or with another algorithm).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_changed_band_goes_on_or_starts_fresh_and_the_others_keep_their_counts() {
        let redis = Redis::start(Servers::standalone()).await;
        let url = redis.url();
        let engine_of =
            |bands: &'static str, other: bool| rule_r_engine(url.clone(), "changes", bands, other.then_some(100));
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.77".parse().unwrap())
            .build();
        let remaining = |d: &fluxgate::core::Decision| -> Vec<(String, u64)> {
            d.bands
                .iter()
                .filter(|b| &*b.rule == "r")
                .map(|b| (b.band.to_string(), b.remaining))
                .collect()
        };
        let pairs =
            |v: &[(&str, u64)]| -> Vec<(String, u64)> { v.iter().map(|(b, n)| ((*b).to_owned(), *n)).collect() };
        // Days, not minutes: no permit refills while the steps run on a busy machine.
        const MINUTE_10: &str = "{ capacity: 10, window: 1d, label: minute }";
        const MINUTE_20: &str = "{ capacity: 20, window: 1d, label: minute }";
        const MINUTE_DAY2: &str = "{ capacity: 10, window: 2d, label: minute }";
        const HOUR: &str = "{ capacity: 100, window: 10d, label: hour }";
        // The rule's bands, whether a rule of another algorithm comes with it, and the
        // remaining permits of each band after one request.
        type Step = (String, bool, &'static [(&'static str, u64)]);
        let steps: [Step; 8] = [
            (format!("{MINUTE_10}, {HOUR}"), false, &[("minute", 9), ("hour", 99)]),
            (format!("{MINUTE_10}, {HOUR}"), false, &[("minute", 8), ("hour", 98)]),
            // The minute's capacity changed: it goes on from the 2 permits its former band
            // holds in use, the hour keeps its count.
            (format!("{MINUTE_20}, {HOUR}"), false, &[("minute", 17), ("hour", 97)]),
            // One band left (the one-band script): the hour keeps its count.
            (HOUR.to_owned(), false, &[("hour", 96)]),
            // The minute back: the key kept its state (a band of another version of the
            // rule, still holding permits), so it goes on from it.
            (format!("{MINUTE_20}, {HOUR}"), false, &[("minute", 16), ("hour", 95)]),
            // With a rule of another algorithm (the general script).
            (format!("{MINUTE_20}, {HOUR}"), true, &[("minute", 15), ("hour", 94)]),
            // The first minute band, kept through every version since: it counts the 5
            // permits the band of 20 holds in use, more than its own 2.
            (format!("{MINUTE_10}, {HOUR}"), true, &[("minute", 4), ("hour", 93)]),
            // A window changed: another limit, which starts full.
            (format!("{MINUTE_DAY2}, {HOUR}"), false, &[("minute", 9), ("hour", 92)]),
        ];
        for (bands, other, expected) in steps {
            let bands: &'static str = Box::leak(bands.into_boxed_str());
            let engine = engine_of(bands, other).await;
            let d = check(&engine, &ctx).await;
            assert!(d.allowed());
            assert_eq!(
                remaining(&d),
                pairs(expected),
                "{bands} (with another algorithm: {other})"
            );
        }
        let keys = redis.server().cli(&["--scan", "--pattern", "changes:*"]);
        let mut keys: Vec<&str> = keys.lines().collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "changes:{default:lb:ip=192.0.2.77}:b0:100/1h:lb",
                "changes:{default:r:ip=192.0.2.77}"
            ]
        );
    }

    /// A shadow rule on Redis: decided and reported, never blocking; it consumes only what
    /// it admits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shadow_rules_on_redis() {
        let redis = Redis::start(Servers::standalone()).await;
        for rules in [
            "rule_sets:\n  - id: default\n    rules:\n      - id: trial\n        mode: shadow\n        bands: [{ capacity: 1, window: 1h }]\n",
            "rule_sets:\n  - id: default\n    rules:\n      - id: trial\n        mode: shadow\n        bands: [{ capacity: 1, window: 1h }, { capacity: 5, window: 1m }]\n      - id: real\n        bands: [{ capacity: 3, window: 1h }]\n",
        ] {
            let engine = engine(&redis, rules);
            let ctx = RequestContext::builder().client_ip("192.0.2.66".parse().unwrap()).build();
            let first = check(&engine, &ctx).await;
            assert!(first.allowed() && first.shadow_rejected_by.is_none());
            assert_eq!(first.shadow_bands[0].remaining, 0);
            let second = check(&engine, &ctx).await;
            assert!(second.allowed(), "a shadow rule never blocks");
            assert_eq!(second.shadow_rejected_by.as_deref(), Some("trial"));
            assert_eq!(second.shadow_bands[0].remaining, 0, "the rejected shadow band consumed nothing");
        }
    }

    /// A flood on one key costs a handful of script calls per retry-after period, and the
    /// key is admitted again as soon as the wait has passed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deny_cache_absorbs_a_flood() {
        let redis = Redis::start(Servers::standalone()).await;
        let rules = rules(
            "rule_sets:\n  - id: default\n    rules:\n      - id: per-ip\n        bands: [{ capacity: 2, window: 1s }]\n",
        );
        let engine_with = |deny_cache: bool| {
            let rules = rules.clone();
            let url = redis.url();
            async move {
                let limiter = fluxgate::redis::RedisLimiter::builder(url)
                    .prefix(format!("deny-{deny_cache}"))
                    .deny_cache(deny_cache)
                    .timeout(std::time::Duration::from_secs(2))
                    .connect()
                    .await
                    .unwrap();
                fluxgate::core::Engine::builder(rules)
                    .limiter(limiter)
                    .build()
                    .expect("the backend decides every rule")
            }
        };
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.9".parse().unwrap())
            .build();

        let cached = engine_with(true).await;
        let before = evalsha_calls(&redis);
        let mut admitted = 0;
        let mut last = None;
        for _ in 0..10_000 {
            let d = check(&cached, &ctx).await;
            admitted += usize::from(d.allowed());
            if !d.allowed() {
                assert!(d.retry_after.unwrap() <= std::time::Duration::from_secs(1));
                last = Some(d);
            }
        }
        let calls = evalsha_calls(&redis) - before;
        eprintln!("deny cache: {calls} script calls for 10,000 requests on one key ({admitted} admitted)");
        let flood_secs = 1 + admitted as u64 / 2;
        assert!(calls <= 4 * flood_secs, "{calls} script calls for {admitted} admitted");
        assert!(admitted >= 2, "{admitted}");
        assert_eq!(last.unwrap().retry_after_secs(), Some(1));
        // After the wait, the key is admitted again.
        tokio::time::sleep(std::time::Duration::from_millis(1_100)).await;
        assert!(check(&cached, &ctx).await.allowed());

        // Without the cache every request is a script call.
        let uncached = engine_with(false).await;
        let before = evalsha_calls(&redis);
        for _ in 0..200 {
            check(&uncached, &ctx).await;
        }
        assert_eq!(evalsha_calls(&redis) - before, 200);
    }

    /// 3 per second refills one token every 333,333.33 µs: the script keeps the fraction.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fractional_refill_is_exact() {
        let redis = Redis::start(Servers::standalone()).await;
        let engine = engine(
            &redis,
            "rule_sets:\n  - id: default\n    rules:\n      - id: thirds\n        scope: attribute\n        attribute: run\n        bands: [{ capacity: 3, window: 1s }]\n",
        );
        let mut late = Vec::new();
        for attempt in 0..3 {
            // A fresh key per run.
            let ctx = RequestContext::builder().attribute("run", attempt.to_string()).build();
            let every = std::time::Duration::from_millis(50);
            match crate::support::scenarios::ticks(every, std::time::Duration::from_secs(3), &engine, &ctx).await {
                Ok(admitted) => {
                    // 3 at once, then 3 per second for 3 s.
                    assert!(admitted.abs_diff(12) <= 1, "admitted {admitted}, expected 12 ± 1");
                    return;
                }
                Err(ms) => late.push(ms),
            }
        }
        panic!("a request was late on each run, by {late:?} ms: the machine is too busy");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn four_engines_on_separate_connections_share_one_limit() {
        let redis = Redis::start(Servers::standalone()).await;
        let rules = rules(
            "rule_sets:\n  - id: default\n    rules:\n      - id: global\n        scope: global\n        bands: [{ capacity: 100, window: 1h }]\n",
        );
        let mut tasks = Vec::new();
        for _ in 0..4 {
            let limiter = fluxgate::redis::RedisLimiter::builder(redis.url())
                .prefix("shared")
                .pool_size(2)
                .timeout(std::time::Duration::from_secs(2))
                .connect()
                .await
                .unwrap();
            let engine = fluxgate::core::Engine::builder(rules.clone())
                .limiter(limiter)
                .build()
                .expect("the backend decides every rule");
            for _ in 0..50 {
                let engine = engine.clone();
                tasks.push(tokio::spawn(async move {
                    let ctx = RequestContext::builder()
                        .client_ip("192.0.2.3".parse().unwrap())
                        .build();
                    engine.check(&ctx).await.unwrap().allowed()
                }));
            }
        }
        let mut admitted = 0;
        for t in tasks {
            admitted += usize::from(t.await.unwrap());
        }
        assert_eq!(admitted, 100);
    }

    const FIVE_ALGORITHMS: &str = r#"
rule_sets:
  - id: default
    rules:
      - { id: tb, algorithm: token_bucket, bands: [{ capacity: 2, window: 1m }] }
      - { id: lb, algorithm: leaky_bucket, bands: [{ capacity: 2, window: 1m }] }
      - { id: fw, algorithm: fixed_window, bands: [{ capacity: 2, window: 1m }] }
      - { id: swl, algorithm: sliding_window_log, bands: [{ capacity: 2, window: 1m }] }
      - { id: swc, algorithm: sliding_window_counter, bands: [{ capacity: 2, window: 1m }] }
"#;

    /// Every algorithm's key: tagged like the token bucket's, named after its algorithm,
    /// expiring when its state is worthless, and untouched by a rejected request.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_algorithm_has_its_key_and_expiry() {
        let redis = Redis::start(Servers::standalone()).await;
        let engine = engine(&redis, FIVE_ALGORITHMS);
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.9".parse().unwrap())
            .build();
        // The fixed window's and the counter's windows are the clock's minutes: start at
        // least 10 s before a minute ends, so that the three requests fall in one window.
        let into_minute = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            % 60;
        if into_minute >= 50 {
            tokio::time::sleep(std::time::Duration::from_secs(61 - into_minute)).await;
        }
        let started = std::time::Instant::now();
        let before = evalsha_calls(&redis);
        for _ in 0..2 {
            assert!(check(&engine, &ctx).await.allowed());
        }
        assert_eq!(
            evalsha_calls(&redis) - before,
            2,
            "one call per decision for five algorithms"
        );
        let snapshot = |key: &str| {
            let kind = redis.server().cli(&["TYPE", key]).trim().to_owned();
            if kind == "zset" {
                redis.server().cli(&["ZRANGE", key, "0", "-1", "WITHSCORES"])
            } else {
                redis.server().cli(&["GET", key])
            }
        };
        let keys = redis.server().cli(&["--scan", "--pattern", "*"]);
        let mut keys: Vec<String> = keys.lines().map(str::to_owned).collect();
        keys.sort();
        let ip = "ip=192.0.2.9";
        // A leaky bucket's band named by its capacity and window (its state is counted in
        // units of its capacity); a window algorithm's by its window alone (it counts
        // permits).
        let expected: Vec<String> = [
            ("fw", ":1m:fw"),
            ("lb", ":2/1m:lb"),
            ("swc", ":1m:swc"),
            ("swl", ":1m:swl"),
        ]
        .iter()
        .map(|(rule, suffix)| format!("test0:{{default:{rule}:{ip}}}:b0{suffix}"))
        // A token-bucket rule is one key, its bands named in its value.
        .chain([format!("test0:{{default:tb:{ip}}}")])
        .collect();
        assert_eq!(keys, expected);
        let states: Vec<String> = keys.iter().map(|k| snapshot(k)).collect();
        // The third request is rejected by every rule and writes nothing anywhere.
        let d = check(&engine, &ctx).await;
        assert!(!d.allowed());
        assert_eq!(
            d.bands.iter().filter(|b| !b.allowed).count(),
            5,
            "every rule rejects the third request ({:?} after the first: more than 10 s means a minute's window may have ended)",
            started.elapsed()
        );
        let after: Vec<String> = keys.iter().map(|k| snapshot(k)).collect();
        assert_eq!(states, after, "a rejection wrote to Redis");
        let bucket = keys.iter().find(|k| k.ends_with('}')).unwrap();
        assert!(snapshot(bucket).starts_with("b0:2/1m|"), "{}", snapshot(bucket));
        for key in &keys {
            let ttl: i64 = redis.server().cli(&["PTTL", key]).trim().parse().unwrap();
            // At most: the window and one second (log, buckets), the rest of the window
            // and one second (fixed), the rest of this window and the next (counter).
            let most = if key.ends_with(":swc") { 121_000 } else { 61_000 };
            assert!(ttl > 1_000 && ttl <= most, "{key}: ttl {ttl}");
        }
        // The log holds one member per permit, unique within the microsecond.
        let log = keys.iter().find(|k| k.ends_with(":swl")).unwrap();
        let members = redis.server().cli(&["ZRANGE", log, "0", "-1"]);
        let members: Vec<&str> = members.lines().collect();
        assert_eq!(members.len(), 2);
        assert!(members.iter().all(|m| m.ends_with(":1")), "{members:?}");
    }

    /// Requests in one microsecond all count in the log: a request of 5 permits adds 5
    /// members with one score.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn log_members_are_unique_within_a_microsecond() {
        let redis = Redis::start(Servers::standalone()).await;
        let engine = engine(
            &redis,
            "rule_sets:\n  - id: default\n    rules:\n      - { id: swl, algorithm: sliding_window_log, permits: 5, bands: [{ capacity: 12, window: 1m }] }\n",
        );
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.10".parse().unwrap())
            .build();
        for remaining in [7, 2] {
            let d = check(&engine, &ctx).await;
            assert!(d.allowed());
            assert_eq!(d.remaining(), Some(remaining));
        }
        assert!(!check(&engine, &ctx).await.allowed());
        let key = "test0:{default:swl:ip=192.0.2.10}:b0:1m:swl";
        let scored = redis.server().cli(&["ZRANGE", key, "0", "-1", "WITHSCORES"]);
        let lines: Vec<&str> = scored.lines().collect();
        assert_eq!(lines.len(), 20, "{lines:?}");
        let first_score = lines[1];
        for pair in lines[..10].chunks(2) {
            assert_eq!(pair[1], first_score, "one request's members share its microsecond");
            assert!(pair[0].starts_with(&format!("{first_score}:")), "{pair:?}");
        }
        let unique: std::collections::HashSet<&str> = lines.chunks(2).map(|p| p[0]).collect();
        assert_eq!(unique.len(), 10);
    }

    /// Sliding window counters need capacity × window µs within 2^52 in Redis; beyond, the
    /// decision fails with an error that names the rule, the band and the limit.
    /// A band the scripts cannot decide exactly is refused when the engine is built, with
    /// an error naming the rule set, the rule, the band and the limit: it never reaches a
    /// request, so it can neither fail every request nor open the circuit. The in-memory
    /// backend decides the same rules.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bands_beyond_exact_arithmetic_are_refused_when_loaded() {
        let redis = Redis::start(Servers::standalone()).await;
        for (rule, band, limit) in [
            (
                "{ id: monthly, algorithm: sliding_window_counter, bands: [{ capacity: 2000, window: 30d, label: month }] }",
                "month",
                "2^52",
            ),
            (
                "{ id: decade, algorithm: token_bucket, bands: [{ capacity: 1099511627776, window: 3660d, label: decade }] }",
                "decade",
                "2^52",
            ),
            (
                "{ id: huge-log, algorithm: sliding_window_log, bands: [{ capacity: 100000, window: 1h }] }",
                "b0",
                "65536",
            ),
        ] {
            let yaml = format!("rule_sets:\n  - id: default\n    rules:\n      - {rule}\n");
            let rules = rules(&yaml);
            let built = Engine::builder(rules.clone())
                .shared_limiter(redis.limiter())
                .build();
            let err = built.expect_err("refused when loaded").to_string();
            let id = rule.split(',').next().unwrap().trim_start_matches("{ id: ");
            for part in ["rule set `default`".to_owned(), format!("rule `{id}`"), format!("band `{band}`"), limit.to_owned(), "redis".to_owned()] {
                assert!(err.contains(&part), "`{part}` missing from: {err}");
            }
            // The in-memory backend decides it exactly.
            let memory = Engine::builder(rules).build().expect("in memory");
            let ctx = RequestContext::builder().client_ip("192.0.2.11".parse().unwrap()).build();
            assert!(check(&memory, &ctx).await.allowed());
        }
    }

    /// A provider that hands out rule sets without validating them (it does not implement
    /// `validate`).
    #[derive(Debug)]
    struct Unchecked(StaticRuleSetProvider);

    impl RuleSetProvider for Unchecked {
        fn rule_set(&self, id: &str) -> MaybeReady<RuleSetLookup> {
            self.0.rule_set(id)
        }
    }

    /// Should a rule the backend cannot decide reach a request anyway, it is a
    /// configuration error: refused with 500 whatever the failure policy, and no failure
    /// of the backend (the circuit stays closed for the other rules).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_undecidable_rule_is_refused_and_opens_no_circuit() {
        let redis = Redis::start(Servers::standalone()).await;
        let rules = rules(
            r#"
rule_sets:
  - id: default
    rules:
      - { id: monthly, algorithm: sliding_window_counter, bands: [{ capacity: 2000, window: 30d }] }
  - id: fine
    rules:
      - { id: per-ip, bands: [{ capacity: 100, window: 1m }] }
"#,
        );
        let breaker = CircuitBreaker::new(redis.limiter()).failure_threshold(1);
        let engine = Engine::builder(Unchecked(StaticRuleSetProvider::new(rules)))
            .limiter(breaker)
            .build()
            .expect("nothing to validate");
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.12".parse().unwrap())
            .build();
        for _ in 0..5 {
            let error = engine.check(&ctx).await.expect_err("a configuration error");
            assert!(matches!(error, fluxgate::core::Error::Rule(_)), "{error}");
        }
        let fine = ctx.to_builder().rule_set_id("fine").build();
        assert!(check(&engine, &fine).await.allowed(), "the circuit opened");
        // Through the layer, with the default fail-open policy: refused, not admitted.
        let app = app(RateLimitLayer::new(engine));
        let r = get_from(&app, "/api/users", "192.0.2.12").await;
        assert_eq!(r.status, http::StatusCode::INTERNAL_SERVER_ERROR);
    }

    /// A caching provider checks what its source loads with the backend's validation: a
    /// rule set the backend cannot decide is never handed out, nor cached.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_caching_provider_refuses_undecidable_rule_sets() {
        let redis = Redis::start(Servers::standalone()).await;
        let rules = rules(
            "rule_sets:\n  - id: default\n    rules:\n      - { id: monthly, algorithm: sliding_window_counter, bands: [{ capacity: 2000, window: 30d }] }\n",
        );
        let cached = CachingRuleSetProvider::builder(Unchecked(StaticRuleSetProvider::new(rules))).build();
        let engine = Engine::builder(cached)
            .shared_limiter(redis.limiter())
            .build()
            .expect("nothing loaded yet");
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.13".parse().unwrap())
            .build();
        for _ in 0..2 {
            let error = engine.check(&ctx).await.expect_err("refused when loaded");
            assert!(matches!(&error, fluxgate::core::Error::Rule(_)), "{error}");
            assert!(error.to_string().contains("rule `monthly`"), "{error}");
        }
    }

    /// `permits` beyond the largest capacity is refused when the rules are loaded: it used
    /// to reach Redis as -1, always admitted and giving capacity back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn permits_beyond_the_range_are_refused_when_loaded() {
        for permits in ["18446744073709551615", "9223372036854775808", "1099511627777"] {
            let yaml = format!(
                "rule_sets:\n  - id: default\n    rules:\n      - {{ id: costly, permits: {permits}, bands: [{{ capacity: 10, window: 1m }}] }}\n"
            );
            let err = fluxgate::core::RuleSets::from_yaml_str(&yaml)
                .expect_err("refused")
                .to_string();
            for part in ["rule set `default`", "rule `costly`", "field `permits`", "2^40"] {
                assert!(err.contains(part), "`{part}` missing from: {err}");
            }
        }
        // The largest cost accepted is never admitted by a smaller band, on Redis as in memory.
        let redis = Redis::start(Servers::standalone()).await;
        let yaml = "rule_sets:\n  - id: default\n    rules:\n      - { id: costly, permits: 1099511627776, bands: [{ capacity: 10, window: 1m }] }\n";
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.14".parse().unwrap())
            .build();
        for engine in [engine(&redis, yaml), engine(&Memory::tokio(), yaml)] {
            for _ in 0..3 {
                let d = check(&engine, &ctx).await;
                assert!(!d.allowed());
                assert_eq!(d.retry_after, None, "never admissible");
                assert_eq!(d.remaining(), Some(10), "nothing was consumed or given back");
            }
        }
    }

    /// A rejection from the deny cache repeats what Redis's own rejection said: the same
    /// remaining and the same reset instant (the end of the day's window here, not a day
    /// from now).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deny_cache_repeats_redis_figures() {
        let redis = Redis::start(Servers::standalone()).await;
        let engine = engine(
            &redis,
            "rule_sets:\n  - id: default\n    rules:\n      - { id: daily, algorithm: fixed_window, permits: 2, bands: [{ capacity: 3, window: 1d }] }\n",
        );
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.15".parse().unwrap())
            .build();
        assert!(check(&engine, &ctx).await.allowed());
        let calls = evalsha_calls(&redis);
        let from_redis = check(&engine, &ctx).await;
        assert!(!from_redis.allowed());
        assert_eq!(evalsha_calls(&redis), calls + 1);
        let local = check(&engine, &ctx).await;
        assert!(!local.allowed());
        assert_eq!(evalsha_calls(&redis), calls + 1, "answered by the deny cache");
        assert_eq!(local.remaining(), Some(1));
        assert_eq!(local.remaining(), from_redis.remaining());
        assert_eq!(local.reset_unix_secs(), from_redis.reset_unix_secs());
        let midnight = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            .div_ceil(86_400)
            * 86_400;
        assert_eq!(local.reset_unix_secs(), Some(midnight));
        assert!(local.binding().unwrap().reset_after <= from_redis.binding().unwrap().reset_after);
        // Both headers agree through the layer.
        let app = app(RateLimitLayer::new(engine));
        let r = get_from(&app, "/api/users", "192.0.2.15").await;
        assert_eq!(r.status, http::StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.num("x-ratelimit-reset"), midnight);
        assert_eq!(r.num("x-ratelimit-remaining"), 1);
    }

    /// A deny-cache hit says nothing about Redis's health: it never closes an open circuit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_deny_cache_hit_closes_no_circuit() {
        let mut redis = Redis::start(Servers::standalone()).await;
        let limiter = fluxgate::redis::RedisLimiter::builder(redis.url())
            .timeout(std::time::Duration::from_millis(200))
            .reconnect_delay(std::time::Duration::from_millis(20))
            .connect()
            .await
            .unwrap();
        let clock = fluxgate::core::ManualClock::new(1_000_000_000);
        let breaker = std::sync::Arc::new(
            CircuitBreaker::new(limiter)
                .failure_threshold(1)
                .cool_down(std::time::Duration::from_secs(1))
                .clock(clock.clone()),
        );
        let engine = Engine::builder(rules(
            "rule_sets:\n  - id: default\n    rules:\n      - { id: per-ip, bands: [{ capacity: 1, window: 1h }] }\n",
        ))
        .shared_limiter(breaker.clone())
        .build()
        .unwrap();
        let denied = RequestContext::builder()
            .client_ip("192.0.2.16".parse().unwrap())
            .build();
        let other = RequestContext::builder()
            .client_ip("192.0.2.17".parse().unwrap())
            .build();
        assert!(check(&engine, &denied).await.allowed());
        assert!(!check(&engine, &denied).await.allowed(), "remembered by the deny cache");
        // Redis goes away: the circuit opens.
        redis.server_mut().kill();
        assert!(engine.check(&other).await.is_err());
        assert!(breaker.is_open());
        // Half-open: the deny cache answers the probe, which proves nothing.
        clock.advance(std::time::Duration::from_secs(1));
        let d = check(&engine, &denied).await;
        assert!(!d.allowed());
        assert!(breaker.is_tripped(), "a deny-cache hit closed the circuit");
        // The next real call probes, fails, and the circuit is open again.
        assert!(engine.check(&other).await.is_err());
        assert!(breaker.is_open());
    }

    /// A limiter over the application's own client, whose commands fred does not time out,
    /// still holds its deadline: with Redis paused for a second, a decision fails long
    /// before Redis answers, and decisions come back once it does.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_limiter_over_the_applications_client_keeps_its_deadline() {
        own_client_keeps_its_deadline(None).await;
    }

    /// The same with batched decisions: the batch's call has a timer of its own, as a
    /// single call does on the application's client.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batching_limiter_over_the_applications_client_keeps_its_deadline() {
        own_client_keeps_its_deadline(Some(fluxgate::redis::Batching::new())).await;
    }

    async fn own_client_keeps_its_deadline(batching: Option<fluxgate::redis::Batching>) {
        use fred::interfaces::ClientLike;
        let redis = Redis::start(Servers::standalone()).await;
        let config = fred::types::config::Config::from_url(&redis.url()).expect("the test server's URL");
        let client = fred::types::Builder::from_config(config).build().expect("a client");
        client.init().await.expect("the client connects");
        let limiter = fluxgate::redis::RedisLimiter::from_client(client, "own-client").with_batching(batching);
        let engine = Engine::builder(rules(
            "rule_sets:\n  - id: default\n    rules:\n      - id: per-ip\n        bands: [{ capacity: 100, window: 1h }]\n",
        ))
        .limiter(limiter)
        .build()
        .expect("the backend decides every rule");
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.61".parse().expect("an address"))
            .build();
        assert_eq!(check(&engine, &ctx).await.remaining(), Some(99));
        assert_eq!(redis.server().cli(&["CLIENT", "PAUSE", "1000", "ALL"]).trim(), "OK");
        let start = std::time::Instant::now();
        let paused = engine.check(&ctx).await;
        let took = start.elapsed();
        assert!(paused.is_err(), "a paused Redis decided, after {took:?}: {paused:?}");
        // The deadline is 50 ms; Redis answers after 1 s. Anything well below 1 s shows the
        // deadline held, whatever the machine's load.
        assert!(took < std::time::Duration::from_millis(800), "took {took:?}");
        redis.server().cli(&["CLIENT", "UNPAUSE"]);
        let mut back = None;
        for _ in 0..50 {
            if let Ok(d) = engine.check(&ctx).await {
                back = Some(d);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let back = back.expect("decisions come back after the pause");
        assert!(back.allowed());
    }

    /// On a cluster the deny cache answers the refused requests of a rule set of one rule
    /// (its keys in one hash slot) and of one of several rules (its request decided by a
    /// call per slot), whether the limiter is built from a URL or over the application's
    /// client with `from_client`. On a standalone server both keep the cache on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_deny_cache_answers_refusals_on_a_cluster() {
        use fred::interfaces::ClientLike;
        let cluster = RedisCluster::start();
        let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port()).collect();
        let config = fred::types::config::Config::from_url_clustered(&format!(
            "redis-cluster://127.0.0.1:{}?node=127.0.0.1:{}&node=127.0.0.1:{}",
            ports[0], ports[1], ports[2]
        ))
        .unwrap();
        let client = fred::types::Builder::from_config(config).build().unwrap();
        client.init().await.unwrap();
        assert!(client.is_clustered());
        let from_client = fluxgate::redis::RedisLimiter::from_client(client, "from-client");
        let from_url = fluxgate::redis::RedisLimiter::builder(cluster.url())
            .deny_cache(true)
            .connect()
            .await
            .unwrap();
        let yaml = "rule_sets:\n  - id: one\n    rules:\n      - id: per-ip\n        bands: [{ capacity: 1, window: 1h }]\n  - id: two\n    rules:\n      - id: per-ip\n        bands: [{ capacity: 1, window: 1h }]\n      - id: per-user\n        scope: user\n        bands: [{ capacity: 100, window: 1h }]\n";
        for (name, limiter) in [("from_client", from_client), ("from a URL", from_url)] {
            assert!(limiter.has_deny_cache(), "{name}");
            let engine = Engine::builder(rules(yaml)).limiter(limiter).build().unwrap();
            for set in ["one", "two"] {
                let ctx = RequestContext::builder()
                    .rule_set_id(set)
                    .client_ip("192.0.2.44".parse().unwrap())
                    .user_id("u")
                    .build();
                assert!(engine.check(&ctx).await.unwrap().allowed());
                assert!(!engine.check(&ctx).await.unwrap().allowed());
                let before = cluster.evalsha_calls();
                let start = std::time::Instant::now();
                for _ in 0..5 {
                    assert!(!engine.check(&ctx).await.unwrap().allowed());
                }
                let calls = cluster.evalsha_calls() - before;
                if set == "one" {
                    assert_eq!(calls, 0, "{name}: rule set `{set}` answered by the cache");
                } else {
                    // A rule set of several rules lets one request through every 100 ms
                    // (two calls and a refund at most): none in the usual few ms.
                    let probes = start.elapsed().as_millis() / 100 + 1;
                    assert!(
                        u128::from(calls) <= 3 * probes,
                        "{name}: rule set `{set}` answered by the cache but for its probes: {calls} calls in {:?}",
                        start.elapsed()
                    );
                }
            }
        }

        let redis = Redis::start(Servers::standalone()).await;
        let config = fred::types::config::Config::from_url(&redis.url()).expect("the test server's URL");
        let client = fred::types::Builder::from_config(config).build().expect("a client");
        client.init().await.expect("the client connects");
        assert!(fluxgate::redis::RedisLimiter::from_client(client, "from-client").has_deny_cache());
        let limiter = fluxgate::redis::RedisLimiter::builder(redis.url())
            .connect()
            .await
            .unwrap();
        assert!(limiter.has_deny_cache(), "built from a standalone server's URL");
    }

    /// Redis's clock may go back (a step of the server's clock, a failover to a replica
    /// whose clock is behind): a window state then lies ahead of now's window. It keeps
    /// counting, neither read as empty nor moved back to an earlier window.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_window_state_ahead_of_redis_clock_keeps_its_counts() {
        let redis = Redis::start(Servers::standalone()).await;
        let limiter = fluxgate::redis::RedisLimiter::builder(redis.url())
            .prefix("clockback")
            .deny_cache(false)
            .timeout(std::time::Duration::from_secs(2))
            .connect()
            .await
            .expect("the test server takes connections");
        let engine = Engine::builder(rules(
            "rule_sets:\n  - id: default\n    rules:\n      \
             - { id: fw, algorithm: fixed_window, bands: [{ capacity: 3, window: 1h }] }\n      \
             - { id: swc, algorithm: sliding_window_counter, bands: [{ capacity: 3, window: 1h }] }\n",
        ))
        .limiter(limiter)
        .build()
        .expect("Redis decides every rule");
        let time = redis.server().cli(&["TIME"]);
        let mut time = time.lines().map(|l| l.trim().parse::<u64>().expect("TIME"));
        let now = time.next().expect("seconds") * 1_000_000 + time.next().expect("microseconds");
        let w = 3_600_000_000u64;
        // The state as a clock one window ahead left it: the window after now's, full.
        let ahead = now - now % w + 2 * w;
        let (fw, swc) = (
            "clockback:{default:fw:ip=192.0.2.50}:b0:1h:fw",
            "clockback:{default:swc:ip=192.0.2.50}:b0:1h:swc",
        );
        let (fw_state, swc_state) = (format!("{ahead}:3"), format!("{ahead}:0:3"));
        redis.server().cli(&["SET", fw, &fw_state, "PX", "86400000"]);
        redis.server().cli(&["SET", swc, &swc_state, "PX", "86400000"]);
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.50".parse().unwrap())
            .build();
        for _ in 0..3 {
            let d = check(&engine, &ctx).await;
            assert!(!d.allowed());
            for band in &d.bands {
                assert!(!band.allowed, "{}: admitted from a state ahead of the clock", band.rule);
                assert_eq!(band.remaining, 0, "{}", band.rule);
                // Counted on Redis's clock: the stored window ends more than an hour ahead.
                assert!(
                    band.reset_after > std::time::Duration::from_secs(3_600),
                    "{}: {:?}",
                    band.rule,
                    band.reset_after
                );
            }
        }
        assert_eq!(redis.server().cli(&["GET", fw]).trim(), fw_state);
        assert_eq!(redis.server().cli(&["GET", swc]).trim(), swc_state);

        // A state with room left counts on in its own window, not in an earlier one.
        redis
            .server()
            .cli(&["SET", fw, &format!("{ahead}:1"), "PX", "86400000"]);
        redis
            .server()
            .cli(&["SET", swc, &format!("{ahead}:0:1"), "PX", "86400000"]);
        let d = check(&engine, &ctx).await;
        assert!(d.allowed());
        assert_eq!(d.remaining(), Some(1));
        assert_eq!(redis.server().cli(&["GET", fw]).trim(), format!("{ahead}:2"));
        assert_eq!(redis.server().cli(&["GET", swc]).trim(), format!("{ahead}:0:2"));
    }

    /// Two instances holding two versions of a token-bucket rule at once (a rolling change,
    /// a file each instance polls, an instance whose reload failed) share the rule's key:
    /// neither refills the other's band, whichever script decides. Bands of different names
    /// or windows are different limits: each version counts against its own band, at most
    /// the two capacities together, once (a band of one name and window is one limit:
    /// `two_versions_of_a_band_admit_together_no_more_than_the_looser`).
    #[tokio::test]
    async fn two_versions_of_a_rule_do_not_refill_each_others_bands() {
        let redis = Redis::start(Servers::standalone()).await;
        let url = redis.url();
        let engine_of =
            |bands: &'static str, other: bool| rule_r_engine(url.clone(), "versions", bands, other.then_some(1000));
        // One band against one band (the one-band script), two bands (the token-bucket
        // script) and a rule of another algorithm beside (the general script).
        let cases = [
            (
                "{ capacity: 10, window: 1h, label: a }",
                "{ capacity: 5, window: 1h, label: b }",
                false,
                15,
            ),
            (
                "{ capacity: 10, window: 1h, label: a }, { capacity: 1000, window: 1d }",
                "{ capacity: 5, window: 1h, label: b }, { capacity: 1000, window: 1d }",
                false,
                15,
            ),
            (
                "{ capacity: 10, window: 1h, label: a }",
                "{ capacity: 5, window: 1h, label: b }",
                true,
                15,
            ),
            (
                "{ capacity: 10, window: 1h }",
                "{ capacity: 10, window: 2h }",
                false,
                20,
            ),
        ];
        for (i, (old, new, other, most)) in cases.into_iter().enumerate() {
            let (old, new) = (engine_of(old, other).await, engine_of(new, other).await);
            let ctx = RequestContext::builder()
                .client_ip(format!("192.0.2.{}", 100 + i).parse().unwrap())
                .build();
            let mut admitted = 0;
            for n in 0..100 {
                let engine = if n % 2 == 0 { &old } else { &new };
                admitted += usize::from(check(engine, &ctx).await.allowed());
            }
            assert_eq!(
                admitted, most,
                "case {i}: admitted of 100 alternating between the versions"
            );
        }

        // The key outlives the other version's band: a day's band kept by an hour's writes.
        let (day, hour) = (
            engine_of("{ capacity: 10, window: 1d }", false).await,
            engine_of("{ capacity: 5, window: 1h }", false).await,
        );
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.120".parse().unwrap())
            .build();
        assert!(check(&day, &ctx).await.allowed());
        assert!(check(&hour, &ctx).await.allowed());
        let key = "versions:{default:r:ip=192.0.2.120}";
        let value = redis.server().cli(&["GET", key]);
        assert!(value.starts_with("b0:5/1h,b0:10/1d|"), "{value}");
        let ttl: i64 = redis.server().cli(&["PTTL", key]).trim().parse().unwrap();
        assert!(
            ttl > 8_000_000,
            "a tenth of a day's band ahead (8,641,000 ms when written): {ttl} ms"
        );

        // A band of another version that is full again is dropped at the next write.
        let key = "versions:{default:r:ip=192.0.2.121}";
        redis.server().cli(&["SET", key, "b0:10/1h,b9:7/1m|1|1"]);
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.121".parse().unwrap())
            .build();
        let d = check(&hour, &ctx).await;
        assert!(d.allowed());
        assert_eq!(d.remaining(), Some(4));
        let value = redis.server().cli(&["GET", key]);
        assert!(value.starts_with("b0:5/1h|") && !value.contains(','), "{value}");
    }

    /// Two instances holding two versions of a token-bucket band of one name and window (its
    /// capacity changed) admit together no more than the looser version allows: each
    /// version's band counts the permits the other's holds in use, whichever script decides
    /// (one band, alone or batched; token buckets only; with another algorithm) and in
    /// whichever order the client takes them. Before, each version counted only its own
    /// band's admissions: 10 per hour and 5 per hour admitted 15.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_versions_of_a_band_admit_together_no_more_than_the_looser() {
        let redis = Redis::start(Servers::standalone()).await;
        let url = redis.url();
        let engine_of = |bands: &str, other: bool, batch: bool| {
            let (url, yaml) = (url.clone(), rule_r(bands, other.then_some(1000)));
            async move { engine_on(url, "looser", &yaml, batch.then(fluxgate::redis::Batching::new)).await }
        };
        // The versions' bands, whether a rule of another algorithm comes with the rule,
        // whether the first version's instance batches its decisions.
        let cases = [
            (
                "{ capacity: 10, window: 1h }",
                "{ capacity: 5, window: 1h }",
                false,
                false,
            ),
            (
                "{ capacity: 10, window: 1h }",
                "{ capacity: 5, window: 1h }",
                false,
                true,
            ),
            (
                "{ capacity: 10, window: 1h, label: hour }, { capacity: 1000, window: 1d, label: day }",
                "{ capacity: 5, window: 1h, label: hour }, { capacity: 1000, window: 1d, label: day }",
                false,
                false,
            ),
            (
                "{ capacity: 10, window: 1h }",
                "{ capacity: 5, window: 1h }",
                true,
                false,
            ),
        ];
        for (i, (looser, stricter, other, batch)) in cases.into_iter().enumerate() {
            let looser = engine_of(looser, other, batch).await;
            let stricter = engine_of(stricter, other, false).await;
            let admitted = taking_turns(&looser, &stricter, 141 + 3 * i).await;
            assert_eq!(
                admitted, [10; 3],
                "case {i}: admitted of 100 across the versions, by order"
            );
        }
    }

    /// The same for the window algorithms, whose keys name a band by its window alone: two
    /// versions of a band of one name and window and another capacity count one window, in
    /// which each admits while the count is within its own capacity. Before, each version
    /// had a key of its own: 10 per hour and 5 per hour admitted 15.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_versions_of_a_window_band_admit_together_no_more_than_the_looser() {
        let redis = Redis::start(Servers::standalone()).await;
        let url = redis.url();
        let engine_of = |algorithm: &str, capacity: u64| {
            let yaml = format!(
                "rule_sets:\n  - id: default\n    rules:\n      - id: r\n        algorithm: {algorithm}\n        \
                 bands: [{{ capacity: {capacity}, window: 1h }}]\n"
            );
            let url = url.clone();
            async move { engine_on(url, "looser-windows", &yaml, None).await }
        };
        // Windows are aligned on the hour: a run that would cross one starts after it.
        let into_hour = redis.server().time_us() / 1_000_000 % 3_600;
        if into_hour >= 3_590 {
            tokio::time::sleep(std::time::Duration::from_secs(3_601 - into_hour)).await;
        }
        for (i, algorithm) in ["fixed_window", "sliding_window_counter", "sliding_window_log"]
            .into_iter()
            .enumerate()
        {
            let looser = engine_of(algorithm, 10).await;
            let stricter = engine_of(algorithm, 5).await;
            let admitted = taking_turns(&looser, &stricter, 201 + 3 * i).await;
            assert_eq!(
                admitted, [10; 3],
                "{algorithm}: admitted of 100 across the versions, by order"
            );
        }
    }

    /// A client's 100 requests to two instances holding two versions of a rule, in three
    /// orders: alternating, the looser first or the stricter first; and the stricter's
    /// spent before the looser's. Each order from its own address, `192.0.2.<first>` and
    /// the two after it. The requests admitted in each order.
    async fn taking_turns(looser: &Engine, stricter: &Engine, first: usize) -> [usize; 3] {
        let orders: [&dyn Fn(usize) -> bool; 3] = [&|n| n % 2 == 0, &|n| n % 2 == 1, &|n| n >= 50];
        let mut admitted = [0; 3];
        for (o, on_looser) in orders.into_iter().enumerate() {
            let ctx = RequestContext::builder()
                .client_ip(format!("192.0.2.{}", first + o).parse().expect("an address"))
                .build();
            for n in 0..100 {
                let engine = if on_looser(n) { looser } else { stricter };
                admitted[o] += usize::from(check(engine, &ctx).await.allowed());
            }
        }
        admitted
    }

    /// A limiter made from another (`with_batching`) shares its deny cache: a reset through
    /// either forgets the denials both remembered, rather than one refusing reset keys until
    /// each remembered retry-after.
    #[tokio::test]
    async fn a_reset_forgets_the_denials_of_every_handle_of_a_limiter() {
        let redis = Redis::start(Servers::standalone()).await;
        let limiter = fluxgate::redis::RedisLimiter::builder(redis.url())
            .prefix("shared-denials")
            .timeout(std::time::Duration::from_secs(2))
            .connect()
            .await
            .unwrap();
        assert!(limiter.has_deny_cache());
        let batched = limiter.with_batching(Some(fluxgate::redis::Batching::new()));
        let engine = Engine::builder(rules(
            "rule_sets: [{id: default, rules: [{id: r, bands: [{capacity: 1, window: 1h}]}]}]",
        ))
        .limiter(batched)
        .build()
        .unwrap();
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.130".parse().unwrap())
            .build();
        assert!(check(&engine, &ctx).await.allowed());
        assert!(!check(&engine, &ctx).await.allowed(), "refused, and remembered");
        limiter.reset_buckets(fluxgate::redis::ResetScope::All).await.unwrap();
        assert!(
            check(&engine, &ctx).await.allowed(),
            "the reset reached the batched handle's denials"
        );
    }
}

/// A limiter whose scripts Redis will not load (here `SCRIPT` is renamed away) fails to
/// connect, and leaves no connection behind: its pool's clients are quit, where before
/// they stayed connected, and reconnecting, for as long as the process ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limiter_whose_scripts_do_not_load_leaves_no_connection() {
    use std::time::{Duration, Instant};

    use crate::support::servers::RedisServer;
    use fluxgate::redis::RedisLimiter;

    let server = RedisServer::start_with(&["--rename-command", "SCRIPT", ""]);
    let connected = RedisLimiter::builder(server.url()).pool_size(3).connect().await;
    assert!(connected.is_err(), "the scripts cannot be loaded");
    // `CLIENT LIST` lists the asking `redis-cli` alone once the pool's clients are gone.
    let clients = || server.cli(&["CLIENT", "LIST"]).lines().count();
    let start = Instant::now();
    while clients() > 1 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{} connections left behind",
            clients() - 1
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A limiter connects over a link slower than its decision deadline: loading its scripts
/// (each compiled as it loads) and reading the server's memory policy have a second at
/// least, as its connections do. Before, they had the deadline, so that a Redis busy for
/// longer than it when the limiter connected (a CI machine's two cores) failed `connect`
/// with a timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limiter_connects_over_a_link_slower_than_its_deadline() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use crate::support::app::rules;
    use crate::support::proxy::{proxy, Side, Step};
    use crate::support::servers::RedisServer;
    use fluxgate::core::{Engine, RequestContext};
    use fluxgate::redis::RedisLimiter;

    /// A TCP proxy to `port` whose replies wait 120 ms each while `slow` holds.
    async fn slow_proxy(port: u16, slow: Arc<AtomicBool>) -> u16 {
        let twist = move |_: usize, from: Side, read: Option<&[u8]>| match (from, read) {
            (Side::Server, Some(_)) if slow.load(Ordering::SeqCst) => Step::Delay(Duration::from_millis(120)),
            _ => Step::Forward,
        };
        proxy(port, twist).await
    }

    let server = RedisServer::start();
    let slow = Arc::new(AtomicBool::new(true));
    let port = slow_proxy(server.port(), slow.clone()).await;
    let limiter = RedisLimiter::builder(format!("redis://127.0.0.1:{port}"))
        .timeout(Duration::from_millis(50))
        .connect()
        .await
        .expect("connected, the scripts loaded, within a second per command");
    let engine = Engine::builder(rules(
        "rule_sets: [{id: default, rules: [{id: r, bands: [{capacity: 1000, window: 1h}]}]}]",
    ))
    .limiter(limiter)
    .build()
    .unwrap();
    let ctx = RequestContext::builder()
        .client_ip("192.0.2.140".parse().unwrap())
        .build();
    // A decision still has its deadline: over the slow link it fails.
    let slow_decision = engine.check(&ctx).await;
    assert!(
        matches!(slow_decision, Err(fluxgate::core::Error::Backend(_))),
        "{slow_decision:?}"
    );
    slow.store(false, Ordering::SeqCst);
    // Once the link is fast again, the limiter decides.
    let start = std::time::Instant::now();
    loop {
        match engine.check(&ctx).await {
            Ok(decision) => {
                assert!(decision.allowed(), "{decision:?}");
                break;
            }
            Err(error) => assert!(
                start.elapsed() < Duration::from_secs(10),
                "no decision by Redis: {error}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
