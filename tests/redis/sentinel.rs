//! Redis Sentinel: after the primary dies and a replica is promoted, decisions resume
//! without restarting the application (the client follows the new primary and reloads the
//! script on `NOSCRIPT`).

use std::time::{Duration, Instant};

use crate::support::app::rules;
use crate::support::servers::RedisSentinels;
use fluxgate::core::{Engine, RequestContext};
use fluxgate::redis::RedisLimiter;

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
