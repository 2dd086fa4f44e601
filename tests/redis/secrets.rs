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
