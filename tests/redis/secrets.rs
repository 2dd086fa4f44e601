//! What the Redis backend shows of its credentials, and where it sends them.

use fluxgate::redis::{RedisError, RedisLimiter, RedisRuleSetStore};

use crate::support::servers::RedisServer;

/// A `rediss://` URL asks for TLS. The crate is built without a TLS client, so such a URL
/// is refused, naming TLS, rather than connecting in plain text: a plain-text server with
/// a password (which would never answer a TLS client) was reached with it, the password
/// sent in clear over the network.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_url_never_connects_in_plain_text() {
    let server = RedisServer::start();
    let created = server.cli(&[
        "ACL",
        "SETUSER",
        "probe",
        "on",
        ">tls-only-password",
        "~*",
        "&*",
        "+@all",
    ]);
    assert_eq!(created.trim(), "OK");
    for url in [
        format!("rediss://probe:tls-only-password@127.0.0.1:{}", server.port()),
        format!("rediss-cluster://probe:tls-only-password@127.0.0.1:{}", server.port()),
    ] {
        let error = RedisLimiter::builder(url.clone())
            .connect()
            .await
            .map(|_| ())
            .expect_err("a TLS URL connected in plain text");
        assert!(matches!(error, RedisError::Url { .. }), "{url}: {error}");
        let shown = error.to_string();
        assert!(shown.contains("TLS"), "{shown}");
        assert!(!shown.contains("tls-only-password"), "{shown}");
        let error = RedisRuleSetStore::connect(&url)
            .await
            .map(|_| ())
            .expect_err("the store connected in plain text");
        assert!(!error.to_string().contains("tls-only-password"), "{error}");
    }
}

/// Where an API key a rule counts by ends up in Redis: in the name of its bucket's key, as
/// the client sent it (a value of up to 64 encoded characters is kept as is), readable by
/// any Redis user allowed `SCAN`, in `MONITOR`, `SLOWLOG` and the snapshots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_is_named_in_its_bucket_key() {
    use crate::support::backend::{check, engine};
    use crate::support::redis::{Redis, Servers};
    let redis = Redis::start(Servers::standalone()).await;
    let engine = engine(
        &redis,
        "rule_sets:\n  - id: default\n    rules:\n      - id: per-key\n        scope: api_key\n        bands: [{ capacity: 5, window: 1h }]\n",
    );
    let ctx = fluxgate::core::RequestContext::builder()
        .client_ip("192.0.2.80".parse().expect("an address"))
        .api_key("sk_live_4f9a2c7e1b")
        .build();
    assert!(check(&engine, &ctx).await.allowed());
    let keys = redis.server().cli(&["--scan"]);
    assert!(keys.contains("sk_live_4f9a2c7e1b"), "{keys}");
}
