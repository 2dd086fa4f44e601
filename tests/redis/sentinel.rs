//! Redis Sentinel: after the primary dies and a replica is promoted, decisions resume
//! without restarting the application (the client follows the new primary and reloads the
//! script on `NOSCRIPT`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::changes::spec;
use crate::support::app::rules;
use crate::support::backend::ctx;
use crate::support::redis::{other_clients, per_ip_engine, until_decided_after_promotion};
use crate::support::servers::RedisSentinels;
use fluxgate::core::reload::ReloadingRuleSetProvider;
use fluxgate::core::{Engine, FailurePolicy, RequestContext};
use fluxgate::redis::{RedisLimiter, RedisRuleSetStore, RuleAdmin, RuleChangeListener};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_resume_after_a_failover() {
    let mut sentinels = RedisSentinels::start();
    let limiter = RedisLimiter::builder(sentinels.url())
        .timeout(Duration::from_millis(200))
        .reconnect_delay(Duration::from_millis(100))
        .connect()
        .await
        .expect("connect through the sentinels");
    let rules = rules(
        "rule_sets:\n  - id: default\n    rules:\n      - id: per-ip\n        bands: [{ capacity: 1000, window: 1h }]\n",
    );
    let engine = Engine::builder(rules)
        .limiter(limiter)
        .build()
        .expect("the backend decides every rule");
    let ctx = RequestContext::builder()
        .client_ip("192.0.2.5".parse().expect("an address"))
        .build();
    for _ in 0..3 {
        assert!(engine.check(&ctx).await.expect("decided by the primary").allowed());
    }

    let old = sentinels.primary.port();
    sentinels.primary.kill();
    let start = Instant::now();
    let mut resumed = None;
    while start.elapsed() < Duration::from_secs(30) {
        if let Ok(d) = engine.check(&ctx).await {
            if sentinels.primary_port().is_some_and(|p| p != old) {
                assert!(d.allowed());
                resumed = Some(start.elapsed());
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let resumed = resumed.expect("decisions resumed on the promoted replica within 30 s");
    assert_eq!(sentinels.primary_port(), Some(sentinels.replica.port()));
    eprintln!("sentinel: decisions resumed {resumed:?} after the primary was killed");
}

/// A primary that stops answering without closing its connections (a frozen process; a host
/// gone or cut off, which sends no reset either) is failed over by the sentinels too: the
/// connections to it count as dead after a second without an answer, and the client asks
/// the sentinels again. They used to stay open, every decision timing out on the old
/// primary until TCP gave up, minutes later: the failure policy answered all that time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_resume_after_a_failover_from_a_frozen_primary() {
    after_a_frozen_primary(None, false).await;
}

/// The same under load: requests of other clients keep every connection written to, so
/// fred never counts one dead by itself (its check waits for a connection's last write to
/// be a second old), whatever the pool's size. The limiter sees the slot's calls time out
/// with none answered for a second, and reconnects the pool. Before, decisions never
/// resumed: every one timed out on the frozen primary and was admitted by `fail_open`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_resume_after_a_failover_from_a_frozen_primary_under_load() {
    after_a_frozen_primary(Some(4), true).await;
}

/// Decisions resume within 3 s of the promotion after the primary froze, with a pool of
/// `pool` connections (the limiter's default if `None`), `under_load` or not.
async fn after_a_frozen_primary(pool: Option<usize>, under_load: bool) {
    let sentinels = RedisSentinels::start();
    let mut builder = RedisLimiter::builder(sentinels.url())
        .timeout(Duration::from_millis(200))
        .reconnect_delay(Duration::from_millis(100));
    if let Some(pool) = pool {
        builder = builder.pool_size(pool);
    }
    let limiter = builder.connect().await.expect("connect through the sentinels");
    let engine = per_ip_engine(limiter, 1000, FailurePolicy::FailOpen);
    let ctx = ctx("192.0.2.5");
    assert!(!engine.check(&ctx).await.expect("a decision").failed_open);

    let load = under_load.then(|| other_clients(&engine));
    let old = sentinels.primary.port();
    sentinels.primary.signal("-STOP");
    let seen =
        until_decided_after_promotion(&engine, &ctx, || sentinels.primary_port().is_some_and(|p| p != old)).await;
    sentinels.primary.signal("-CONT");
    if let Some(load) = load {
        load.abort();
    }
    seen.assert_resumed_within(Duration::from_secs(3), &format!("sentinel (under load: {under_load})"));
}

/// A rule change listener follows a failover from a primary that stops answering without
/// closing its connections: a heartbeat left unanswered counts its subscription's
/// connection as dead, the client asks the sentinels for the new primary, subscribes there
/// and reloads everything, so that a change made on the new primary comes into force.
/// Before, the subscription stayed on the frozen primary and no change reached the instance
/// until TCP gave up, minutes later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_follows_a_failover_from_a_frozen_primary() {
    let sentinels = RedisSentinels::start();
    let url = sentinels.url();
    let store = Arc::new(RedisRuleSetStore::connect(&url).await.expect("store"));
    store.put(&spec("api", 10)).await.expect("put");
    let provider = Arc::new(ReloadingRuleSetProvider::new(
        store.load_rule_sets().await.expect("first load"),
    ));
    let capacity = || {
        provider
            .rule_sets()
            .get("api")
            .map(|s| s.rules()[0].bands()[0].capacity())
    };
    let _listener = RuleChangeListener::builder(provider.clone(), store.clone())
        .subscribe(&url)
        .await
        .expect("subscribe through the sentinels");

    let old = sentinels.primary.port();
    sentinels.primary.signal("-STOP");
    let start = Instant::now();
    while sentinels.primary_port().is_none_or(|p| p == old) {
        if start.elapsed() > Duration::from_secs(30) {
            sentinels.primary.signal("-CONT");
            panic!("the sentinels promoted no replica within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let promoted = start.elapsed();
    // A change made on the new primary, through a store connected after the promotion.
    let changed = Instant::now();
    let admin = loop {
        match RedisRuleSetStore::connect(&url).await {
            Ok(store) => break RuleAdmin::new(store),
            Err(error) if changed.elapsed() < Duration::from_secs(10) => {
                eprintln!("no store on the new primary yet: {error}");
            }
            Err(error) => {
                sentinels.primary.signal("-CONT");
                panic!("no store on the new primary within 10 s: {error}");
            }
        }
    };
    while let Err(error) = admin.put(&spec("api", 3)).await {
        if changed.elapsed() > Duration::from_secs(10) {
            sentinels.primary.signal("-CONT");
            panic!("the new primary took no change within 10 s: {error}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    while capacity() != Some(3) {
        if changed.elapsed() > Duration::from_secs(45) {
            sentinels.primary.signal("-CONT");
            panic!("the change on the new primary did not reach the listener within 45 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sentinels.primary.signal("-CONT");
    eprintln!(
        "sentinel: promoted {promoted:?} after the freeze; the change was in force {:?} after it was made",
        changed.elapsed()
    );
}
