//! The Redis rule store: one JSON document per rule set and an index of ids, validated
//! before anything is stored, read back as a reload source, on a standalone server and on a
//! cluster.

use std::sync::Arc;

use fluxgate::core::reload::ReloadingRuleSetProvider;
use fluxgate::core::{Engine, RequestContext, RuleSetSpec, RuleSets};
use fluxgate::redis::{RedisLimiter, RedisRuleSetStore, StoreError};

use crate::support::backend::check;
use crate::support::redis::Servers;
use crate::support::servers::RedisServer;

fn spec(id: &str, capacity: u64) -> RuleSetSpec {
    serde_json::from_str(&format!(
        r#"{{"id": "{id}", "rules": [{{"id": "per-ip", "bands": [{{"capacity": {capacity}, "window": "1h"}}]}}]}}"#
    ))
    .expect("a rule set spec")
}

fn ids(specs: &[RuleSetSpec]) -> Vec<&str> {
    specs.iter().map(|s| s.id.as_str()).collect()
}

#[tokio::test]
async fn put_list_and_delete_with_validation_first() {
    let server = RedisServer::start();
    let store = RedisRuleSetStore::connect(&server.url()).await.expect("connect");
    store.put(&spec("web", 10)).await.expect("put web");
    store.put(&spec("api", 5)).await.expect("put api");
    store.put(&spec("api", 7)).await.expect("replace api");
    let listed = store.list().await.expect("list");
    assert_eq!(ids(&listed), ["api", "web"]);
    assert_eq!(listed[0], spec("api", 7));

    // An invalid rule set is refused with the rule error, and nothing is stored.
    let invalid = spec("bad", 0);
    let error = store.put(&invalid).await.unwrap_err();
    assert!(matches!(error, StoreError::Rule(_)), "{error}");
    assert!(error.to_string().contains("capacity"), "{error}");
    assert_eq!(ids(&store.list().await.expect("list")), ["api", "web"]);
    assert_eq!(server.cli(&["EXISTS", &store.document_key("bad")]).trim(), "0");

    assert!(store.delete("web").await.expect("delete"));
    assert!(!store.delete("web").await.expect("delete again"));
    assert_eq!(ids(&store.list().await.expect("list")), ["api"]);

    // Every key carries the store's hash tag: none starts with a bucket prefix.
    let keys = server.cli(&["KEYS", "*"]);
    let keys: Vec<&str> = keys.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(keys.iter().all(|k| k.starts_with("{fluxgate:rules}:")), "{keys:?}");
}

#[tokio::test]
async fn a_reload_from_the_store_is_enforced_and_a_bad_document_keeps_the_rules() {
    let server = RedisServer::start();
    let store = Arc::new(RedisRuleSetStore::connect(&server.url()).await.expect("connect"));
    store.put(&spec("default", 5)).await.expect("put");
    let provider = Arc::new(ReloadingRuleSetProvider::new(RuleSets::default()));
    let limiter = RedisLimiter::builder(server.url())
        .prefix("store-test")
        .connect()
        .await
        .expect("limiter");
    let engine = Engine::builder(provider.clone())
        .limiter(limiter)
        .build()
        .expect("engine");
    provider.reload_from(&*store).await.expect("first load");
    let ctx = RequestContext::builder()
        .client_ip("192.0.2.40".parse().expect("an address"))
        .build();
    let check = || check(&engine, &ctx);
    assert_eq!(check().await.remaining(), Some(4));

    // A tighter rule: enforced from the next request after the reload, counting the permit
    // the former capacity's band holds in use (the band keeps its name and window).
    store.put(&spec("default", 2)).await.expect("put tighter");
    let report = provider.reload_from(&*store).await.expect("reload");
    assert_eq!(report.changed, ["default".into()]);
    assert_eq!(check().await.remaining(), Some(0));
    assert!(!check().await.allowed());

    // A document that is not a rule set fails the load; the rules in force stay.
    let key = store.document_key("default");
    server.cli(&["SET", &key, "{not json"]);
    let failures = provider.failures();
    let error = provider.reload_from(&*store).await.unwrap_err();
    assert!(error.to_string().contains(&key), "{error}");
    assert_eq!(provider.failures(), failures + 1);
    assert!(!check().await.allowed(), "the tighter rule is still in force");

    // An empty store fails the load too (an evicted or flushed index must not remove
    // every rule), unless the store is told that no rules is a valid state.
    server.cli(&["FLUSHDB"]);
    let error = provider.reload_from(&*store).await.unwrap_err();
    assert!(error.to_string().contains("names no rule set"), "{error}");
    let in_force = provider.rule_sets();
    let set = in_force.get("default").expect("the rule set is still in force");
    assert_eq!(
        set.rules()[0].bands()[0].capacity(),
        2,
        "the tighter rule is still in force"
    );
    let allowing = RedisRuleSetStore::new(store.client().clone())
        .expect("store")
        .allow_empty(true);
    assert!(allowing.load_rule_sets().await.expect("an empty load").is_empty());

    // An index entry without its document fails the load too.
    store.put(&spec("default", 2)).await.expect("repair");
    server.cli(&["SADD", &store.index_key(), "ghost"]);
    let error = provider.reload_from(&*store).await.unwrap_err();
    assert!(error.to_string().contains("ghost"), "{error}");

    // An index entry that is not a valid id is named, quoted and cut, never used as a key.
    server.cli(&["SREM", &store.index_key(), "ghost"]);
    let hostile = format!("x}}\n{}", "y".repeat(500));
    server.cli(&["SADD", &store.index_key(), &hostile]);
    let error = provider.reload_from(&*store).await.unwrap_err().to_string();
    assert!(error.contains("not a valid rule set id"), "{error}");
    assert!(!error.contains(&"y".repeat(100)), "the id is cut: {error}");
    let set = provider.rule_sets().get("default").cloned().expect("still in force");
    assert_eq!(set.rules()[0].bands()[0].capacity(), 2);

    // Bytes that are not UTF-8: in a document, named as such (not as a missing document);
    // in the index, an id that is not valid, named like any other.
    server.cli(&["SREM", &store.index_key(), &hostile]);
    let with_byte = |key: &str, before: &str, after: &str| {
        let script = "redis.call(ARGV[3], KEYS[1], ARGV[1] .. string.char(255) .. ARGV[2])";
        let set = if key == store.index_key() { "SADD" } else { "SET" };
        server.cli(&["EVAL", script, "1", key, before, after, set]);
    };
    with_byte(&key, r#"{"id": "default", "rules": [], "x": ""#, r#""}"#);
    let error = provider.reload_from(&*store).await.unwrap_err().to_string();
    assert!(
        error.contains(&key) && error.contains("not UTF-8 text (byte 37"),
        "{error}"
    );
    store.put(&spec("default", 2)).await.expect("repair");
    with_byte(&store.index_key(), "ab", "c");
    let error = provider.reload_from(&*store).await.unwrap_err().to_string();
    assert!(error.contains("not a valid rule set id"), "{error}");
    assert_eq!(
        provider.rule_sets().get("default").expect("still in force").rules()[0].bands()[0].capacity(),
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_works_on_a_cluster() {
    let servers = Servers::shared_cluster();
    let url = match &servers {
        Servers::Cluster(cluster) => cluster.url(),
        Servers::Standalone(server) => server.url(),
    };
    let store = RedisRuleSetStore::with_namespace(
        RedisRuleSetStore::connect(&url)
            .await
            .expect("connect")
            .client()
            .clone(),
        "store-cluster-test",
    )
    .expect("namespace");
    for (i, id) in ["a", "b", "c", "d", "e"].iter().enumerate() {
        store.put(&spec(id, 10 + i as u64)).await.expect("put");
    }
    assert!(store.delete("c").await.expect("delete"));
    let sets = store.load_rule_sets().await.expect("load");
    let mut loaded: Vec<String> = sets.iter().map(|s| s.id().to_string()).collect();
    loaded.sort();
    assert_eq!(loaded, ["a", "b", "d", "e"]);
    assert!(store.delete("a").await.expect("cleanup"));
}

/// `RuleAdmin` stores a change and publishes it in one script call, on the slot of the
/// store's hash tag: on a cluster, a listener subscribed through any node hears the
/// change, reloads it, and a delete of a rule set never stored publishes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_change_on_a_cluster_reaches_a_listener() {
    use std::time::{Duration, Instant};

    use fluxgate::redis::{RuleAdmin, RuleChangeListener};

    let servers = Servers::shared_cluster();
    let url = match &servers {
        Servers::Cluster(cluster) => cluster.url(),
        Servers::Standalone(server) => server.url(),
    };
    let client = RedisRuleSetStore::connect(&url)
        .await
        .expect("connect")
        .client()
        .clone();
    let store = Arc::new(RedisRuleSetStore::with_namespace(client, "admin-cluster-test").expect("namespace"));
    store.put(&spec("api", 10)).await.expect("put");
    store.put(&spec("kept", 10)).await.expect("put");
    let provider = Arc::new(ReloadingRuleSetProvider::new(
        store.load_rule_sets().await.expect("load"),
    ));
    let channel = "admin-cluster-test:changes";
    let listener = RuleChangeListener::builder(provider.clone(), store.clone())
        .channel(channel)
        .subscribe(&url)
        .await
        .expect("subscribe");
    let admin = RuleAdmin::new((*store).clone()).channel(channel);
    let change = admin.put(&spec("api", 3)).await.expect("admin put");
    assert!(change.reset_buckets, "a change resets: {change:?}");
    let capacity = || {
        provider
            .rule_sets()
            .get("api")
            .map(|s| s.rules()[0].bands()[0].capacity())
    };
    let start = Instant::now();
    while capacity() != Some(3) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the change was not in force within 10 s: {:?}",
            listener.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(admin.delete("never-stored").await.expect("delete"), None);
    assert!(admin.delete("api").await.expect("delete").is_some());
    let start = Instant::now();
    while provider.rule_sets().get("api").is_some() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the delete was not in force within 10 s: {:?}",
            listener.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stats = listener.stats();
    // An event published while the subscription's connection was being made again (a
    // busy machine can leave a PING unanswered for the 2 s that takes) is not heard: the
    // full reload after the reconnection applied it instead.
    assert!(
        stats.events == 2 || (stats.events < 2 && stats.resyncs > 0),
        "a put and a delete, each heard or reloaded after a reconnection: {stats:?}"
    );
    assert!(store.delete("kept").await.expect("cleanup"));
}

#[test]
fn a_namespace_cannot_change_the_hash_tag() {
    let client = fred::clients::Client::default();
    for bad in ["", "x}y", "{x"] {
        let error = RedisRuleSetStore::with_namespace(client.clone(), bad).unwrap_err();
        assert!(matches!(error, StoreError::Namespace { .. }), "{bad}: {error}");
    }
}

/// A store given a deadline of 10 s, whose replies take 2.5 s to come back (a slow link,
/// or a load of many rule sets): its calls are answered within the deadline. A store
/// connected from a URL counted its connection dead after 2 s with a command unanswered
/// (and its reconnection's `HELLO` timed out after 2 s), so every call slower than 2 s
/// failed whatever the deadline; it now waits 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_slower_than_two_seconds_is_answered_within_its_deadline() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let server = RedisServer::start();
    let slow = Arc::new(AtomicBool::new(false));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a port");
    let via = listener.local_addr().expect("an address").port();
    let port = server.port();
    let delay = slow.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(upstream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                continue;
            };
            let delay = delay.clone();
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = upstream.into_split();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                while let Ok(n) = cr.read(&mut buf).await {
                    if n == 0 || sw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                while let Ok(n) = sr.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    if delay.load(Ordering::SeqCst) {
                        tokio::time::sleep(Duration::from_millis(2500)).await;
                    }
                    if cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    let store = RedisRuleSetStore::connect(&format!("redis://127.0.0.1:{via}"))
        .await
        .expect("connect")
        .timeout(Duration::from_secs(10));
    store.put(&spec("web", 10)).await.expect("put web");
    slow.store(true, Ordering::SeqCst);
    let started = Instant::now();
    let listed = store.list().await;
    let took = started.elapsed();
    assert!(
        listed.is_ok(),
        "list answered {listed:?} after {took:?}, within a deadline of 10 s"
    );
}
