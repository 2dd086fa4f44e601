//! The shared decision scenarios on a real 3-primary Redis Cluster, including rule sets
//! whose rules hash to different slots (one concurrent script call per slot, refunds when
//! a slot rejects).

mod support;

use support::redis::Cluster;
use support::scenarios;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_scenarios() {
    // One cluster for the whole suite: each scenario has its own key prefix.
    let cluster = Cluster::start().await;
    let health = fluxgate_redis::RedisLimiter::builder(cluster.cluster.url())
        .connect()
        .await
        .unwrap();
    assert_eq!(health.health().await.unwrap().cluster_state.as_deref(), Some("ok"));
    scenarios::hundred_per_minute_engine(&cluster).await;
    scenarios::hundred_per_minute_layer(&cluster).await;
    scenarios::two_bands(&cluster).await;
    scenarios::permits(&cluster).await;
    scenarios::per_ip_and_global(&cluster).await;
    scenarios::remaining_is_the_least(&cluster).await;
    scenarios::isolation(&cluster).await;
    scenarios::ipv6(&cluster).await;
    scenarios::concurrency(&cluster).await;
    scenarios::hostile_header_values(&cluster).await;
    scenarios::exact_refill(&cluster).await;
}

mod cross_slot {
    use fluxgate::core::RequestContext;

    use super::support::redis::Cluster;
    use super::support::{check, engine};

    /// Per-IP 2 and per-user 100 land in different slots: when the per-IP slot rejects,
    /// the per-user slot gives back what it took.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rejecting_slot_refunds_the_others() {
        let cluster = Cluster::start().await;
        let engine = engine(
            &cluster,
            r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        priority: 1
        bands: [{ capacity: 2, window: 1h }]
      - id: per-user
        scope: user
        bands: [{ capacity: 100, window: 1h }]
"#,
        );
        let ctx = RequestContext::builder()
            .client_ip("192.0.2.44".parse().unwrap())
            .user_id("alice")
            .build();
        let tags = ["{default:per-ip:ip=192.0.2.44}", "{default:per-user:user=alice}"];
        let slots: Vec<u16> = tags.iter().map(|t| fred_keyslot(t)).collect();
        assert_ne!(
            slots[0], slots[1],
            "the two rules must hash to different slots for this test"
        );

        let before = cluster.cluster.evalsha_calls();
        assert!(check(&engine, &ctx).await.allowed);
        assert!(check(&engine, &ctx).await.allowed);
        assert_eq!(
            cluster.cluster.evalsha_calls() - before,
            4,
            "one call per slot per decision"
        );
        let d = check(&engine, &ctx).await;
        assert!(!d.allowed);
        assert_eq!(d.rule().map(|r| &**r), Some("per-ip"));
        let user = d.bands.iter().find(|b| &*b.rule == "per-user").unwrap();
        assert_eq!(user.remaining, 98, "the per-user slot was refunded");
        for _ in 0..5 {
            assert!(!check(&engine, &ctx).await.allowed);
        }
        // Another IP for the same user sees the user's 98: the rejections consumed nothing.
        let other = RequestContext::builder()
            .client_ip("192.0.2.45".parse().unwrap())
            .user_id("alice")
            .build();
        let d = check(&engine, &other).await;
        assert!(d.allowed);
        assert_eq!(d.bands.iter().find(|b| &*b.rule == "per-user").unwrap().remaining, 97);
    }

    fn fred_keyslot(tag: &str) -> u16 {
        // CRC16 (XMODEM) of the hash tag, as Redis Cluster computes it.
        let inner = tag.trim_start_matches('{').trim_end_matches('}');
        let mut crc: u16 = 0;
        for b in inner.bytes() {
            crc ^= u16::from(b) << 8;
            for _ in 0..8 {
                crc = if crc & 0x8000 != 0 {
                    (crc << 1) ^ 0x1021
                } else {
                    crc << 1
                };
            }
        }
        crc % 16384
    }
}
