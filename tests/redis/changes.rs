//! Rule changes over Redis Pub/Sub: `RuleAdmin` stores and publishes, every listening
//! instance reloads, and the changed rule set's buckets are reset once per event, on a
//! standalone server and on a cluster; the three message forms, invalid messages, polls of
//! unchanged rules, and a listener whose connection is lost.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fluxgate::core::reload::{spawn_polling, ReloadingRuleSetProvider};
use fluxgate::core::{Engine, RequestContext, RuleSetSpec};
use fluxgate::redis::{
    AdminError, RedisLimiter, RedisRuleSetStore, ResetScope, RuleAdmin, RuleChange, RuleChangeListener,
};

use crate::support::backend::check;
use crate::support::redis::Servers;
use crate::support::servers::RedisServer;

/// How long a change may take to be enforced everywhere.
const PROPAGATION: Duration = Duration::from_secs(1);

/// A rule set `id` of one per-IP rule, `per-ip`, of `capacity` per hour.
pub(crate) fn spec(id: &str, capacity: u64) -> RuleSetSpec {
    serde_json::from_str(&format!(
        r#"{{"id": "{id}", "rules": [{{"id": "per-ip", "bands": [{{"capacity": {capacity}, "window": "1h"}}]}}]}}"#
    ))
    .expect("a rule set spec")
}

fn ctx(rule_set: &str, ip: &str) -> RequestContext {
    RequestContext::builder()
        .rule_set_id(rule_set)
        .client_ip(ip.parse().expect("an address"))
        .build()
}

/// One application instance: its provider, engine, Redis limiter and listener.
struct Instance {
    provider: Arc<ReloadingRuleSetProvider>,
    engine: Engine,
    listener: RuleChangeListener,
}

impl Instance {
    async fn start(url: &str, store: &Arc<RedisRuleSetStore>, prefix: &str) -> Self {
        Self::start_with(url, store, prefix, false).await
    }

    /// An instance whose listener resets only for events with a grant in `store`, if
    /// `grants`.
    async fn start_with(url: &str, store: &Arc<RedisRuleSetStore>, prefix: &str, grants: bool) -> Self {
        let limiter = RedisLimiter::builder(url)
            .prefix(prefix)
            .connect()
            .await
            .expect("limiter");
        let sets = store.load_rule_sets().await.expect("first load");
        let provider = Arc::new(ReloadingRuleSetProvider::new(sets));
        let engine = Engine::builder(provider.clone())
            .limiter(limiter.clone())
            .build()
            .expect("engine");
        let mut listener = RuleChangeListener::builder(provider.clone(), store.clone()).reset(limiter);
        if grants {
            listener = listener.require_reset_grants((**store).clone());
        }
        let listener = listener.subscribe(url).await.expect("subscribe");
        Self {
            provider,
            engine,
            listener,
        }
    }

    fn capacity(&self, rule_set: &str) -> Option<u64> {
        let sets = self.provider.rule_sets();
        Some(sets.get(rule_set)?.rules()[0].bands()[0].capacity())
    }

    async fn remaining(&self, rule_set: &str, ip: &str) -> Option<u64> {
        check(&self.engine, &ctx(rule_set, ip)).await.remaining()
    }

    /// How many of `n` requests of `ip` to `rule_set` are admitted.
    async fn admitted(&self, rule_set: &str, ip: &str, n: usize) -> usize {
        let mut admitted = 0;
        for _ in 0..n {
            admitted += usize::from(check(&self.engine, &ctx(rule_set, ip)).await.allowed());
        }
        admitted
    }
}

/// A store on `url` holding a rule set of one per-IP rule of `capacity` per hour for each
/// `(id, capacity)`.
async fn stored(url: &str, sets: &[(&str, u64)]) -> Arc<RedisRuleSetStore> {
    let store = Arc::new(RedisRuleSetStore::connect(url).await.expect("store"));
    for &(id, capacity) in sets {
        store.put(&spec(id, capacity)).await.expect("put");
    }
    store
}

/// Publishes `message` on the change channel as the user `notifier` ([`notifier`]);
/// answers how many subscribers received it.
fn publish_as_notifier(server: &RedisServer, message: &str) -> String {
    let args = [
        "--user",
        "notifier",
        "--pass",
        "secret",
        "PUBLISH",
        "fluxgate:rule-changes",
        message,
    ];
    server.cli(&args).trim().to_owned()
}

/// Adds the Redis user `notifier` (password `secret`), who may publish on the change channel
/// and run the commands `more` names, and touch no key.
fn notifier(server: &RedisServer, more: &[&str]) {
    let mut args = vec![
        "ACL",
        "SETUSER",
        "notifier",
        "on",
        ">secret",
        "resetchannels",
        "&fluxgate:rule-changes",
        "+publish",
    ];
    args.extend_from_slice(more);
    assert_eq!(server.cli(&args).trim(), "OK");
}

/// Waits until `done` holds, at most `limit` beside the time the machine stalled meanwhile
/// (how late its own 1 ms timers fired, beyond the timer's millisecond of resolution,
/// added up: a busy machine delays the change's way through Redis and the listeners as
/// much); answers how long it took.
async fn until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    let mut stalled = Duration::ZERO;
    while !done() {
        assert!(
            start.elapsed() < limit + stalled,
            "{what}: not within {limit:?} (the machine stalled {stalled:?} meanwhile)"
        );
        let slept = Instant::now();
        tokio::time::sleep(Duration::from_millis(1)).await;
        stalled += slept.elapsed().saturating_sub(Duration::from_millis(2));
    }
    start.elapsed()
}

/// How late a 10 ms timer fires now: a test that waits in real time reports it with its
/// own figures rather than blaming the code for a busy machine.
async fn lateness() -> Duration {
    let start = Instant::now();
    tokio::time::sleep(Duration::from_millis(10)).await;
    start.elapsed().saturating_sub(Duration::from_millis(10))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_put_is_enforced_by_both_instances_and_resets_its_buckets_once() {
    let server = RedisServer::start();
    let url = server.url();
    let store = stored(&url, &[("api", 10), ("web", 10)]).await;
    let a = Instance::start(&url, &store, "changes").await;
    let b = Instance::start(&url, &store, "changes").await;
    let admin = RuleAdmin::new((*store).clone());

    for _ in 0..3 {
        a.remaining("api", "192.0.2.1").await;
    }
    assert_eq!(b.remaining("api", "192.0.2.1").await, Some(6), "one shared bucket");
    assert_eq!(a.remaining("web", "192.0.2.1").await, Some(9));

    // A tighter rule: both instances enforce it within a second.
    let put = Instant::now();
    admin.put(&spec("api", 2)).await.expect("put a tighter api");
    let took = until(PROPAGATION, "both instances enforce the tighter rule", || {
        a.capacity("api") == Some(2) && b.capacity("api") == Some(2)
    })
    .await;
    eprintln!(
        "pub/sub: enforced by both instances {:?} after the put",
        put.elapsed().max(took)
    );
    let resets = |i: &Instance| i.listener.stats().redis_resets;
    until(PROPAGATION, "both listeners handled the event", || {
        a.listener.stats().events == 1 && b.listener.stats().events == 1
    })
    .await;
    assert_eq!(resets(&a) + resets(&b), 1, "one reset for the event");
    assert_eq!(a.remaining("api", "192.0.2.1").await, Some(1));
    assert_eq!(b.remaining("api", "192.0.2.1").await, Some(0));
    assert!(!a.engine.check(&ctx("api", "192.0.2.1")).await.unwrap().allowed());

    // Another change: its event resets api's buckets, once, and nothing else.
    admin.put(&spec("api", 3)).await.expect("put a looser api");
    until(PROPAGATION, "both listeners handled both events", || {
        a.listener.stats().events == 2 && b.listener.stats().events == 2
    })
    .await;
    until(PROPAGATION, "both instances enforce the looser rule", || {
        a.capacity("api") == Some(3) && b.capacity("api") == Some(3)
    })
    .await;
    assert_eq!(resets(&a) + resets(&b), 2, "one listener reset the buckets");
    assert_eq!(a.remaining("api", "192.0.2.1").await, Some(2), "api starts over");
    // Give a second reset, if there were one, the time to happen: it must not.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(resets(&a) + resets(&b), 2, "one reset per event, not one per instance");
    assert_eq!(
        b.remaining("api", "192.0.2.1").await,
        Some(1),
        "the consumption after the reset stays"
    );
    assert_eq!(a.remaining("web", "192.0.2.1").await, Some(8), "web's bucket is intact");
    assert_eq!(store.list().await.expect("list").len(), 2, "the rule store is intact");
    assert_eq!(server.cli(&["EXISTS", &store.index_key()]).trim(), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_rule_set_is_never_stored_nor_published() {
    let server = RedisServer::start();
    let url = server.url();
    let store = stored(&url, &[("api", 10)]).await;
    let limiter = RedisLimiter::builder(&url).connect().await.expect("limiter");
    let admin = RuleAdmin::new((*store).clone()).validate_with(limiter);
    let a = Instance::start(&url, &store, "invalid").await;

    let error = admin.put(&spec("api", 0)).await.unwrap_err();
    assert!(matches!(error, AdminError::Rule(_)), "{error}");
    // A capacity the Redis limiter cannot decide exactly: refused before it is stored.
    let error = admin.put(&spec("api", u64::MAX / 2)).await.unwrap_err();
    assert!(matches!(error, AdminError::Rule(_)), "{error}");
    assert!(error.to_string().contains("api"), "{error}");
    assert_eq!(store.list().await.expect("list"), [spec("api", 10)]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(a.listener.stats().events, 0, "nothing was published");
    assert_eq!(a.capacity("api"), Some(10));

    assert!(admin.delete("missing").await.expect("delete").is_none());
    store.put(&spec("web", 10)).await.expect("put web");
    let change = admin.delete("api").await.expect("delete").expect("an event");
    assert_eq!(change.rule_set.as_deref(), Some("api"));
    assert_eq!(change.source.as_deref(), Some("admin"));
}

/// A change after which the store no longer loads is stored and published, but no
/// instance can apply it (each refuses the load and keeps the rules in force): the admin
/// says so rather than answering as for a change in force.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_that_leaves_the_store_unloadable_is_reported() {
    let server = RedisServer::start();
    let url = server.url();
    let store = stored(&url, &[("api", 10)]).await;
    let a = Instance::start(&url, &store, "unloadable").await;
    let admin = RuleAdmin::new((*store).clone());

    // The last rule set deleted: an empty store, which instances refuse.
    let error = admin.delete("api").await.unwrap_err();
    assert!(
        matches!(error, AdminError::Unloadable { ref rule_set, .. } if rule_set == "api"),
        "{error}"
    );
    assert!(error.to_string().contains("names no rule set"), "{error}");
    until(PROPAGATION, "the instance tried the event", || {
        a.provider.failures() >= 1
    })
    .await;
    assert_eq!(a.capacity("api"), Some(10), "still in force on the instance");

    // An index entry whose document is gone (a key deleted by hand): every later change
    // is stored, and applied nowhere.
    admin.put(&spec("api", 10)).await.expect("put api again");
    server.cli(&["SADD", &store.index_key(), "ghost"]);
    let error = admin.put(&spec("api", 2)).await.unwrap_err();
    assert!(
        matches!(error, AdminError::Unloadable { ref rule_set, .. } if rule_set == "api"),
        "{error}"
    );
    assert!(error.to_string().contains("ghost"), "{error}");
    server.cli(&["SREM", &store.index_key(), "ghost"]);
    admin.put(&spec("api", 3)).await.expect("the store loads again");
    until(PROPAGATION, "the repaired store is applied", || {
        a.capacity("api") == Some(3)
    })
    .await;
}

/// `api` with a second rule that waits for the refill longer than the Redis limiter can
/// reserve exactly (its debt would pass 2^52 units): valid rules, and every band within the
/// limiter's range, but an engine on that limiter refuses the rule set.
fn unwaitable() -> RuleSetSpec {
    serde_json::from_str(
        r#"{"id": "api", "rules": [
            {"id": "per-ip", "bands": [{"capacity": 1, "window": "1h"}]},
            {"id": "slow", "bands": [{"capacity": 999983, "window": "1h"}],
             "on_limit": {"wait": {"max_wait": "1h", "max_waiters": 1}}}]}"#,
    )
    .expect("a rule set spec")
}

/// A rule set the engines would refuse is refused by an admin that validates with the
/// limiter or the engine; stored past such an admin, it is refused by every instance's
/// reload, and the change then resets no bucket: the counts go on under the rules in force.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_the_engines_refuse_is_not_stored_and_resets_nothing() {
    let server = RedisServer::start();
    let url = server.url();
    let store = stored(&url, &[("api", 2)]).await;
    let a = Instance::start(&url, &store, "refused").await;
    let limiter = RedisLimiter::builder(&url).connect().await.expect("limiter");
    for admin in [
        RuleAdmin::new((*store).clone()).validate_with(limiter),
        RuleAdmin::new((*store).clone()).validate_with_engine(a.engine.clone()),
    ] {
        let error = admin.put(&unwaitable()).await.unwrap_err();
        assert!(matches!(error, AdminError::Rule(_)), "{error}");
        assert!(error.to_string().contains("slow"), "{error}");
    }
    assert_eq!(store.list().await.expect("list"), [spec("api", 2)]);

    assert_eq!(a.remaining("api", "192.0.2.1").await, Some(1));
    assert_eq!(a.remaining("api", "192.0.2.1").await, Some(0));
    // Stored by an admin that does not validate with the limiter: published, refused by
    // the reload.
    RuleAdmin::new((*store).clone())
        .put(&unwaitable())
        .await
        .expect("stored without the limiter's check");
    until(PROPAGATION, "the listener handled the event", || {
        a.listener.stats().events == 1
    })
    .await;
    assert_eq!(a.listener.stats().redis_resets, 0, "no reset for a refused reload");
    assert_eq!(a.capacity("api"), Some(2), "the rules in force stay");
    assert!(
        !a.engine
            .check(&ctx("api", "192.0.2.1"))
            .await
            .expect("decision")
            .allowed(),
        "the spent bucket was not refilled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_three_message_forms_and_an_invalid_message() {
    let server = RedisServer::start();
    let url = server.url();
    let store = stored(&url, &[("api", 10), ("web", 10)]).await;
    let a = Instance::start(&url, &store, "forms").await;
    // An instance deciding in memory listens too: resets reach its own counters.
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let memory = {
        let provider = Arc::new(ReloadingRuleSetProvider::new(store.load_rule_sets().await.unwrap()));
        let engine = Engine::builder(provider.clone()).build().expect("engine");
        let record = seen.clone();
        let listener = RuleChangeListener::builder(provider.clone(), store.clone())
            .on_event(move |change| record.lock().unwrap().push(change.clone()))
            .subscribe(&url)
            .await
            .expect("subscribe");
        (provider, engine, listener)
    };
    let memory_remaining = || {
        memory
            .1
            .check(&ctx("api", "192.0.2.9"))
            .into_ready()
            .expect("in memory")
            .expect("decided")
            .remaining()
    };
    let publish = |message: &str| {
        let receivers = server.cli(&["PUBLISH", "fluxgate:rule-changes", message]);
        assert_eq!(receivers.trim(), "2", "both listeners are subscribed");
    };
    let events = |n: u64| {
        let (a, m) = (&a, &memory.2);
        move || a.listener.stats().events == n && m.stats().events == n
    };

    // A bare id: reload, and reset that rule set's buckets.
    for _ in 0..4 {
        a.remaining("api", "192.0.2.9").await;
        a.remaining("web", "192.0.2.9").await;
        memory_remaining();
    }
    store.put(&spec("api", 20)).await.expect("store without publishing");
    publish("api");
    until(PROPAGATION, "the bare-id event", events(1)).await;
    assert_eq!(a.capacity("api"), Some(20));
    assert_eq!(
        memory.0.rule_sets().get("api").unwrap().rules()[0].bands()[0].capacity(),
        20
    );
    until(PROPAGATION, "the reset", || a.listener.stats().redis_resets == 1).await;
    assert_eq!(a.remaining("api", "192.0.2.9").await, Some(19));
    assert_eq!(a.remaining("web", "192.0.2.9").await, Some(5), "web is not reset");
    assert_eq!(memory_remaining(), Some(19), "the in-memory counters start over too");

    // JSON without a reset: reload only.
    store.put(&spec("web", 30)).await.expect("store without publishing");
    publish(r#"{"ruleSetId":"web","fullReload":false,"resetBuckets":false,"source":"test"}"#);
    until(PROPAGATION, "the JSON event", events(2)).await;
    assert_eq!(a.capacity("web"), Some(30));
    assert_eq!(a.remaining("api", "192.0.2.9").await, Some(18), "nothing reset");
    assert_eq!(a.listener.stats().redis_resets, 1);

    // `*`: reload everything, reset nothing.
    store.put(&spec("api", 40)).await.expect("store without publishing");
    store.put(&spec("web", 40)).await.expect("store without publishing");
    publish("*");
    until(PROPAGATION, "the `*` event", events(3)).await;
    assert_eq!((a.capacity("api"), a.capacity("web")), (Some(40), Some(40)));
    assert_eq!(memory_remaining(), Some(39), "a new capacity: a new band, fresh");
    assert_eq!(memory_remaining(), Some(38), "and not reset again");

    // Invalid messages are counted and ignored; the rules stay.
    store.put(&spec("api", 50)).await.expect("store without publishing");
    for bad in ["no spaces allowed", "{\"ruleSetId\": 7}", "{broken"] {
        publish(bad);
    }
    until(PROPAGATION, "the invalid messages", || {
        a.listener.stats().invalid == 3 && memory.2.stats().invalid == 3
    })
    .await;
    assert_eq!(a.listener.stats().events, 3);
    assert_eq!(a.capacity("api"), Some(40), "no reload for an invalid message");
    let seen = seen.lock().unwrap().clone();
    let expected = [
        RuleChange::rule_set("api"),
        RuleChange::rule_set("web").with_reset(false).with_source("test"),
        RuleChange::everything(),
    ];
    assert_eq!(seen, expected, "the callback saw each valid event once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_polls_of_unchanged_rules_reset_nothing() {
    let server = RedisServer::start();
    let url = server.url();
    let store = stored(&url, &[("api", 10)]).await;
    let a = Instance::start(&url, &store, "polls").await;
    for _ in 0..3 {
        a.remaining("api", "192.0.2.2").await;
    }
    let keys = || {
        let mut keys: Vec<String> = server.cli(&["KEYS", "polls:*"]).lines().map(str::to_owned).collect();
        keys.sort();
        keys
    };
    let keys_before = keys();
    let set_before = a.provider.rule_sets().get("api").cloned().expect("api");
    let reloads = a.provider.reloads();
    let polling = spawn_polling(a.provider.clone(), store.clone(), Duration::from_millis(5));
    until(Duration::from_secs(10), "20 polls", || {
        a.provider.reloads() >= reloads + 20
    })
    .await;
    polling.abort();
    assert_eq!(a.provider.failures(), 0);
    let set_after = a.provider.rule_sets().get("api").cloned().expect("api");
    assert!(Arc::ptr_eq(&set_before, &set_after), "an unchanged poll swaps nothing");
    assert_eq!(keys(), keys_before, "no key was touched");
    assert_eq!(
        a.remaining("api", "192.0.2.2").await,
        Some(6),
        "the bucket kept its count"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_subscription_reloads_everything_when_it_comes_back() {
    let mut server = RedisServer::start();
    let url = server.url();
    let store = stored(&url, &[("api", 10)]).await;
    let a = Instance::start(&url, &store, "lost").await;

    // A change stored while the event is lost: the subscription's connection is killed
    // after the store changed and before anything was published.
    store.put(&spec("api", 3)).await.expect("store without publishing");
    let killed = server.cli(&["CLIENT", "KILL", "TYPE", "pubsub"]);
    assert_eq!(killed.trim(), "1", "the listener's connection");
    let took = until(Duration::from_secs(5), "the reload after the reconnection", || {
        a.capacity("api") == Some(3)
    })
    .await;
    eprintln!("listener: reconnected and reloaded {took:?} after its connection was killed");
    assert!(a.listener.stats().resyncs >= 1);

    // Redis restarted (its data gone, as after a crash): the listener subscribes again,
    // and the next change reaches it.
    server.restart();
    let late = lateness().await;
    until(
        Duration::from_secs(5) + late,
        "the reconnection after the restart",
        || a.listener.stats().resyncs >= 2,
    )
    .await;
    assert_eq!(a.capacity("api"), Some(3), "an empty store keeps the rules in force");
    let admin = RuleAdmin::new((*store).clone());
    // The store's own connection reconnects too: retry until it is back.
    let start = Instant::now();
    while let Err(error) = admin.put(&spec("api", 7)).await {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the store did not come back: {error}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    until(PROPAGATION, "the change after the restart", || {
        a.capacity("api") == Some(7)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_reset_reaches_every_primary_and_only_its_rule_set() {
    let servers = Servers::shared_cluster();
    let Servers::Cluster(cluster) = &servers else {
        unreachable!("a cluster")
    };
    let url = cluster.url();
    let store = Arc::new(
        RedisRuleSetStore::with_namespace(
            RedisRuleSetStore::connect(&url).await.expect("store").client().clone(),
            "changes-cluster",
        )
        .expect("namespace"),
    );
    store.put(&spec("api", 5)).await.expect("put api");
    store.put(&spec("web", 5)).await.expect("put web");
    let limiter = RedisLimiter::builder(&url)
        .prefix("changes-cluster")
        .connect()
        .await
        .expect("limiter");
    let provider = Arc::new(ReloadingRuleSetProvider::new(store.load_rule_sets().await.unwrap()));
    let engine = Engine::builder(provider.clone())
        .limiter(limiter.clone())
        .build()
        .expect("engine");
    let ips: Vec<String> = (0..60).map(|i| format!("198.51.100.{i}")).collect();
    for ip in &ips {
        check(&engine, &ctx("api", ip)).await;
        check(&engine, &ctx("web", ip)).await;
    }
    let nodes_with_api_keys = cluster
        .nodes
        .iter()
        .filter(|n| !n.cli(&["KEYS", "changes-cluster:{api:*"]).trim().is_empty())
        .count();
    assert_eq!(nodes_with_api_keys, 3, "60 buckets spread over every primary");

    let deleted = limiter.reset_buckets(ResetScope::RuleSet("api")).await.expect("reset");
    assert_eq!(deleted, 60, "one key per bucket");
    for node in &cluster.nodes {
        assert_eq!(
            node.cli(&["KEYS", "changes-cluster:{api:*"]).trim(),
            "",
            "node {}",
            node.port()
        );
    }
    for ip in &ips {
        assert_eq!(
            check(&engine, &ctx("api", ip)).await.remaining(),
            Some(4),
            "{ip}: api starts over"
        );
        assert_eq!(
            check(&engine, &ctx("web", ip)).await.remaining(),
            Some(3),
            "{ip}: web kept its count"
        );
    }
    assert_eq!(store.list().await.expect("list").len(), 2, "the rule store is intact");

    // Two listeners on the cluster: one reset per event.
    let second = RedisLimiter::builder(&url)
        .prefix("changes-cluster")
        .connect()
        .await
        .expect("limiter");
    let listen = |limiter: RedisLimiter| {
        RuleChangeListener::builder(provider.clone(), store.clone())
            .channel("changes-cluster:events")
            .reset(limiter)
            .subscribe(&url)
    };
    let (one, two) = (listen(limiter).await.expect("one"), listen(second).await.expect("two"));
    let admin = RuleAdmin::new((*store).clone()).channel("changes-cluster:events");
    admin.put(&spec("web", 6)).await.expect("put a looser web");
    until(PROPAGATION, "the reset", || {
        one.stats().redis_resets + two.stats().redis_resets == 1
    })
    .await;
    until(PROPAGATION, "both listeners", || {
        one.stats().events == 1 && two.stats().events == 1
    })
    .await;
    until(PROPAGATION, "the looser web in force", || {
        provider
            .rule_sets()
            .get("web")
            .is_some_and(|set| set.rules()[0].bands()[0].capacity() == 6)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(one.stats().redis_resets + two.stats().redis_resets, 1);
    assert_eq!(
        check(&engine, &ctx("web", &ips[0])).await.remaining(),
        Some(5),
        "web starts over"
    );
    assert_eq!(
        check(&engine, &ctx("api", &ips[0])).await.remaining(),
        Some(3),
        "api kept its count"
    );
    limiter_cleanup(&store).await;
}

async fn limiter_cleanup(store: &RedisRuleSetStore) {
    for id in ["api", "web"] {
        store.delete(id).await.expect("cleanup");
    }
}

#[test]
fn a_change_event_round_trips_through_its_json() {
    let change = RuleChange::rule_set("api").with_source("admin").with_new_event_id();
    assert_eq!(RuleChange::parse(&change.to_json()).expect("parse"), change);
}

/// A rule source whose next `failures` loads fail (a store that times out), then the store.
#[derive(Debug)]
struct Flaky {
    store: Arc<RedisRuleSetStore>,
    failures: std::sync::atomic::AtomicU32,
}

impl fluxgate::core::reload::RuleSource for Flaky {
    fn load(&self) -> fluxgate::core::BoxFuture<Result<fluxgate::core::RuleSets, fluxgate::core::BoxError>> {
        use std::sync::atomic::Ordering;
        let fail = self
            .failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if fail {
            return Box::pin(async { Err("the rule store did not answer in time".into()) });
        }
        let store = self.store.clone();
        Box::pin(async move { store.load_rule_sets().await.map_err(Into::into) })
    }
}

/// A reload that fails when a change arrives is tried again until it succeeds: the instance
/// does not stay on the rules it had (here a limit of 100 where the change made it 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_fails_is_tried_again() {
    let server = RedisServer::start();
    let url = server.url();
    let store = stored(&url, &[("retry", 100)]).await;
    let provider = Arc::new(ReloadingRuleSetProvider::new(
        store.load_rule_sets().await.expect("load"),
    ));
    let source = Arc::new(Flaky {
        store: store.clone(),
        failures: std::sync::atomic::AtomicU32::new(3),
    });
    let _listener = RuleChangeListener::builder(provider.clone(), source)
        .subscribe(&url)
        .await
        .expect("subscribe");
    RuleAdmin::new((*store).clone())
        .put(&spec("retry", 1))
        .await
        .expect("put");
    let capacity = || {
        provider
            .rule_sets()
            .get("retry")
            .map(|set| set.rules()[0].bands()[0].capacity())
    };
    // Three failures: tries after about 100, 200 and 400 ms, the fourth load succeeds.
    let took = until(
        Duration::from_secs(10),
        "the tightened limit reaches the instance",
        || capacity() == Some(1),
    )
    .await;
    assert!(
        took >= Duration::from_millis(300),
        "tried again after waits, not at once: {took:?}"
    );
}

/// `RuleAdmin::put` of a rule set as it is stored already resets nothing: a tool that
/// applies the same rules again and again (a GitOps sync, a deploy step calling
/// `PUT /api/rulesets/{id}`) would otherwise give every client of the rule set a full
/// quota at each apply, in Redis and in every instance's memory (9 admitted of 3 per hour
/// over three applies).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_put_of_unchanged_rules_resets_nothing() {
    let server = RedisServer::start();
    let url = server.url();
    let store = stored(&url, &[("api", 3)]).await;
    let a = Instance::start(&url, &store, "unchanged-put").await;
    let admin = RuleAdmin::new((*store).clone());
    let mut admitted = 0;
    for round in 1..=3u64 {
        for _ in 0..3 {
            admitted += usize::from(check(&a.engine, &ctx("api", "192.0.2.3")).await.allowed());
        }
        // The same rule set stored again.
        admin.put(&spec("api", 3)).await.expect("put the same api");
        until(PROPAGATION, "the listener handled the event", || {
            a.listener.stats().events == round
        })
        .await;
    }
    assert_eq!(
        admitted,
        3,
        "3 per hour, the rules never changed; {} resets",
        a.listener.stats().redis_resets
    );
}

/// Change messages are not authenticated: a Redis user allowed only to publish on the
/// change channel (no key access) made the listeners, which hold the limiter's rights,
/// delete any rule set's buckets, every time it published. A listener that requires reset
/// grants resets only for the events an admin of its store published, once each: the
/// publisher's events, and the admin's own event published again, reset nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_without_key_rights_cannot_reset_buckets() {
    let server = RedisServer::start();
    let url = server.url();
    let store = stored(&url, &[("api", 3)]).await;
    let a = Instance::start_with(&url, &store, "publisher", true).await;
    // A user that may publish on the channel and touch no key.
    notifier(&server, &[]);
    let publish = |message: &str| {
        let published = publish_as_notifier(&server, message);
        assert_eq!(published, "1", "{published}");
    };
    let mut admitted = 0;
    for round in 1..=3u64 {
        for _ in 0..3 {
            admitted += usize::from(check(&a.engine, &ctx("api", "192.0.2.4")).await.allowed());
        }
        publish(&format!(
            r#"{{"ruleSetId":"api","resetBuckets":true,"eventId":"{round}"}}"#
        ));
        until(PROPAGATION, "the listener handled the event", || {
            a.listener.stats().events == round
        })
        .await;
    }
    assert_eq!(
        admitted,
        3,
        "3 per hour; {} resets by a user without key rights",
        a.listener.stats().redis_resets
    );
    // The admin's change resets, once: heard again (published by the notifier), it resets
    // nothing more.
    let change = RuleAdmin::new((*store).clone())
        .put(&spec("api", 4))
        .await
        .expect("admin put");
    until(PROPAGATION, "the admin's event handled", || {
        a.listener.stats().events == 4
    })
    .await;
    publish(&change.to_json());
    until(PROPAGATION, "the replayed event handled", || {
        a.listener.stats().events == 5
    })
    .await;
    let admitted = a.admitted("api", "192.0.2.4", 6).await;
    let stats = a.listener.stats();
    assert_eq!(admitted, 4, "4 per hour after one reset: {stats:?}");
    assert_eq!((stats.redis_resets, stats.ungranted_resets), (1, 4), "{stats:?}");
}

/// `RuleAdmin::put` asks for a reset only when its store write changed the document. A put
/// that stored a change and then failed to publish it would leave the change stored
/// without its reset, and a retry would find it stored and publish it without one. The
/// admin stores and publishes in one script call, which first checks that its user may
/// publish: a put that cannot publish stores nothing, and its retry resets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_put_retried_after_its_publish_failed_resets_its_buckets() {
    let server = RedisServer::start();
    let url = server.url();
    let store = stored(&url, &[("api", 3)]).await;
    let a = Instance::start(&url, &store, "retried-put").await;
    for _ in 0..3 {
        a.remaining("api", "192.0.2.5").await;
    }
    // An admin whose publish fails (here a user without PUBLISH).
    let acl = server.cli(&[
        "ACL",
        "SETUSER",
        "nopublish",
        "on",
        ">secret",
        "~*",
        "&*",
        "+@all",
        "-publish",
    ]);
    assert_eq!(acl.trim(), "OK");
    let limited_url = url.replacen("redis://", "redis://nopublish:secret@", 1);
    let limited = RedisRuleSetStore::connect(&limited_url).await.expect("store");
    let failed = RuleAdmin::new(limited).put(&spec("api", 4)).await;
    let message = format!("{failed:?}");
    assert!(
        matches!(failed, Err(AdminError::Store(_))) && message.contains("publish"),
        "{message}"
    );
    assert_eq!(
        store.list().await.expect("list"),
        vec![spec("api", 3)],
        "a put that cannot publish stores nothing"
    );
    // The same change put again, and published.
    RuleAdmin::new((*store).clone())
        .put(&spec("api", 4))
        .await
        .expect("put again");
    until(PROPAGATION, "the looser api in force", || a.capacity("api") == Some(4)).await;
    until(PROPAGATION, "the listener handled the event", || {
        a.listener.stats().events == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        a.listener.stats().redis_resets,
        1,
        "the change resets api's buckets once it is published"
    );
}

/// A reset grant was the event id's alone: it said nothing of what the event resets. A user
/// allowed only to subscribe and publish on the change channel hears an admin's change of
/// one rule set, and publishes its event id again with no rule set (every rule set): a
/// listener that requires grants and did not hear the admin's event (an instance started
/// within the grant's minute) found the grant and reset every rule set's buckets, in Redis
/// too once the admin event's reset claim (10 s) had expired. The admin's event published
/// again reset its own rule set's buckets in Redis a second time. A grant now names the
/// rule set it resets, and a granted reset's claim is kept as long as the grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_granted_event_id_replayed_with_another_scope_resets_nothing_else() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let server = RedisServer::start();
    let url = server.url();
    let store = stored(&url, &[("api", 3), ("web", 3)]).await;
    let a = Instance::start_with(&url, &store, "grant-scope", true).await;
    notifier(&server, &["+subscribe"]);
    // The notifier listens on the channel.
    let port = server.port().to_string();
    let mut listening = Command::new("redis-cli")
        .args(["-p", &port, "--user", "notifier", "--pass", "secret"])
        .args(["SUBSCRIBE", "fluxgate:rule-changes"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-cli");
    let stdout = listening.stdout.take().expect("its output");
    let heard = std::thread::spawn(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find(|line| line.starts_with('{'))
    });
    tokio::time::sleep(Duration::from_millis(300)).await;

    // A client spends its `web` quota.
    let admitted = a.admitted("web", "192.0.2.9", 4).await;
    assert_eq!(admitted, 3);
    // The admin changes `api`: its event resets `api` alone, and the client spends its new
    // `api` quota.
    let change = RuleAdmin::new((*store).clone())
        .put(&spec("api", 4))
        .await
        .expect("admin put");
    until(PROPAGATION, "the admin's event handled", || {
        a.listener.stats().events == 1
    })
    .await;
    let admitted = a.admitted("api", "192.0.2.9", 5).await;
    assert_eq!(admitted, 4);
    let message = heard
        .join()
        .expect("the reader")
        .expect("the notifier heard the admin's event");
    let _ = listening.kill();
    let _ = listening.wait();
    let event_id = RuleChange::parse(&message)
        .expect("a change")
        .event_id
        .expect("an event id");
    assert_eq!(Some(&event_id), change.event_id.as_ref());

    // The admin event's reset claim expires; an instance starts, within the grant's minute.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let b = Instance::start_with(&url, &store, "grant-scope", true).await;
    let forged = format!(r#"{{"resetBuckets":true,"fullReload":true,"eventId":"{event_id}"}}"#);
    let published = publish_as_notifier(&server, &forged);
    assert_eq!(published, "2", "{published}");
    // And the admin's event as it was.
    let published = publish_as_notifier(&server, &message);
    assert_eq!(published, "2", "{published}");
    until(PROPAGATION, "both listeners handled the notifier's events", || {
        a.listener.stats().events == 3 && b.listener.stats().events == 2
    })
    .await;
    // Instance `a` remembers its denial locally; `b`, behind the same load balancer, asks
    // Redis.
    let mut web = 0;
    let mut api = 0;
    for _ in 0..3 {
        web += usize::from(check(&b.engine, &ctx("web", "192.0.2.9")).await.allowed());
        api += usize::from(check(&b.engine, &ctx("api", "192.0.2.9")).await.allowed());
    }
    let (sa, sb) = (a.listener.stats(), b.listener.stats());
    eprintln!(
        "after the notifier's events: admitted by instance b, `web` {web} of 3 and `api` {api} of 3 \
         (both quotas spent); instance a {sa:?}; new instance b {sb:?}"
    );
    assert_eq!(
        web, 0,
        "an admin's grant for `api` reset every rule set's buckets: a {sa:?}, b {sb:?}"
    );
    assert_eq!(
        api, 0,
        "the admin's event heard again reset `api` in Redis again: a {sa:?}, b {sb:?}"
    );
}

/// With grants required, two admin changes of one rule set within a minute each reset its
/// buckets in Redis once: the claim of the first event, kept as long as its grant, does not
/// hold back the second (another event id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_grants_two_admin_changes_within_a_minute_each_reset_once() {
    let server = RedisServer::start();
    let url = server.url();
    let store = stored(&url, &[("api", 3)]).await;
    let a = Instance::start_with(&url, &store, "two-changes", true).await;
    let b = Instance::start_with(&url, &store, "two-changes", true).await;
    let admin = RuleAdmin::new((*store).clone());
    let resets = |a: &Instance, b: &Instance| a.listener.stats().redis_resets + b.listener.stats().redis_resets;
    let mut after = Vec::new();
    for (round, capacity) in [(1_u64, 4_u64), (2, 5)] {
        // The client spends its quota on instance b.
        while check(&b.engine, &ctx("api", "192.0.2.7")).await.allowed() {}
        admin.put(&spec("api", capacity)).await.expect("admin put");
        until(PROPAGATION, "both listeners handled the event", || {
            a.listener.stats().events == round && b.listener.stats().events == round
        })
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let admitted = a.admitted("api", "192.0.2.7", capacity as usize + 1).await;
        after.push((resets(&a, &b), admitted as u64));
    }
    eprintln!("(redis resets so far, admitted of a fresh quota) after each change: {after:?}");
    assert_eq!(after, vec![(1, 4), (2, 5)]);
    assert_eq!(
        a.listener.stats().ungranted_resets + b.listener.stats().ungranted_resets,
        0
    );
}
