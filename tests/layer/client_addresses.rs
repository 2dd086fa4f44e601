//! The client address a rule counts by: IPv6 clients that share a /64, `X-Forwarded-For`
//! (or `Forwarded`) believed only from trusted proxies, an address given by a `ClientIp`
//! extension or by a customizer (`CF-Connecting-IP`), and trusted networks that would trust
//! every address refused.

use std::net::SocketAddr;

use fluxgate::tower::{ClientIp, ConfigError, RateLimitLayer};
use http::StatusCode;

use crate::support::app::{app, layer, request, send};
use crate::{builder, engine, support};

/// IPv6 clients that share a /64 without being one client are counted apart: the clients
/// of one Teredo relay server (its address fills their first 64 bits) are their public
/// IPv4 addresses, and the IPv4 clients of a NAT64 prefix of the network's own, once the
/// engine is told it, their IPv4 addresses. Before, each group shared one counter, so one
/// client spent the others' limit. Link-local clients stay cut to their /64, whatever
/// their link: a client on the server's link that takes a new address for each request
/// gets no new counter.
#[tokio::test]
async fn ipv6_clients_that_share_a_64_are_counted_apart() {
    use std::net::{Ipv6Addr, SocketAddrV6};
    const PER_IP: &str = "rule_sets: [{id: default, rules: [{id: per-ip, bands: [{capacity: 2, window: 1h}]}]}]";
    let nat64: Ipv6Addr = "2001:db8:64::".parse().expect("a prefix");
    let app = app(layer(builder(PER_IP).nat64_prefix(nat64).build().unwrap())
        .build()
        .unwrap());
    let from = |ip: &str, zone: u32| {
        let mut req = request("GET", "/health", "192.0.2.1", &[]);
        let ip: Ipv6Addr = ip.parse().expect("an address");
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo(SocketAddr::V6(SocketAddrV6::new(
                ip, 40_000, 0, zone,
            ))));
        req
    };
    for (a, b) in [
        // Two clients of the Teredo server 65.54.227.120.
        (
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
            "2001:0:4136:e378:8000:ec77:cecc:9bf8",
        ),
        // Two IPv4 clients of the network's NAT64 prefix.
        ("2001:db8:64::192.0.2.1", "2001:db8:64::198.51.100.7"),
    ] {
        for _ in 0..2 {
            assert_eq!(send(&app, from(a, 2)).await.status, StatusCode::OK, "{a}");
        }
        assert_eq!(
            send(&app, from(a, 2)).await.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{a}"
        );
        let other = send(&app, from(b, 3)).await;
        assert_eq!(other.status, StatusCode::OK, "{b} after {a} spent its limit");
        assert_eq!(other.num("x-ratelimit-remaining"), 1, "{b}");
    }
    // A link-local client rotating its address, one a request: one counter.
    let statuses: Vec<StatusCode> = {
        let mut out = Vec::new();
        for i in 1..=5 {
            out.push(send(&app, from(&format!("fe80::{i:x}"), 2)).await.status);
        }
        out
    };
    use StatusCode as S;
    assert_eq!(
        statuses,
        [
            S::OK,
            S::OK,
            S::TOO_MANY_REQUESTS,
            S::TOO_MANY_REQUESTS,
            S::TOO_MANY_REQUESTS
        ]
    );
}

#[tokio::test]
async fn forwarded_for_is_only_believed_from_trusted_proxies() {
    let rules = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 1, window: 1h }]
"#;
    let app = app(layer(engine(rules)).trusted_proxies(["10.0.0.0/8"]).build().unwrap());
    // From an untrusted peer, X-Forwarded-For is ignored: the two requests share the peer's bucket.
    let from_untrusted = |xff: &'static str| request("GET", "/api/users", "203.0.113.50", &[("x-forwarded-for", xff)]);
    assert_eq!(send(&app, from_untrusted("198.51.100.1")).await.status, StatusCode::OK);
    assert_eq!(
        send(&app, from_untrusted("198.51.100.2")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // From the trusted proxy, each forwarded client has its own bucket.
    let via_proxy = |xff: &'static str| request("GET", "/api/users", "10.0.0.1", &[("x-forwarded-for", xff)]);
    assert_eq!(
        send(&app, via_proxy("198.51.100.1, 10.0.0.7")).await.status,
        StatusCode::OK
    );
    assert_eq!(send(&app, via_proxy("198.51.100.2")).await.status, StatusCode::OK);
    assert_eq!(
        send(&app, via_proxy("198.51.100.1")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Only X-Forwarded-For, the header the proxy maintains, is read: a `Forwarded` header
    // is the client's own, passed through untouched, and cannot pick a bucket.
    for (i, client) in ["198.51.100.3", "198.51.100.4", "198.51.100.5"].into_iter().enumerate() {
        let forwarded = format!("for={client};proto=https");
        let req = request(
            "GET",
            "/api/users",
            "10.0.0.1",
            &[("forwarded", &forwarded), ("x-forwarded-for", "198.51.100.9")],
        );
        let expected = if i == 0 {
            StatusCode::OK
        } else {
            StatusCode::TOO_MANY_REQUESTS
        };
        assert_eq!(send(&app, req).await.status, expected, "Forwarded: {forwarded}");
    }
    // With `Forwarded` configured instead, it is read, and X-Forwarded-For ignored.
    let app_rfc = support::app::app(
        layer(engine(rules))
            .trusted_proxies(["10.0.0.0/8"])
            .forwarded_for_header("forwarded")
            .build()
            .unwrap(),
    );
    let fwd = |client: &str, xff: &str| {
        let forwarded = format!("for={client};proto=https");
        request(
            "GET",
            "/api/users",
            "10.0.0.1",
            &[("forwarded", &forwarded), ("x-forwarded-for", xff)],
        )
    };
    assert_eq!(
        send(&app_rfc, fwd("198.51.100.3", "1.1.1.1")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(&app_rfc, fwd("198.51.100.4", "1.1.1.1")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(&app_rfc, fwd("198.51.100.3", "2.2.2.2")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // No trusted proxies configured: never believed.
    let app = app_default(rules);
    assert_eq!(send(&app, via_proxy("198.51.100.4")).await.status, StatusCode::OK);
    assert_eq!(
        send(&app, via_proxy("198.51.100.5")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

fn app_default(rules: &str) -> axum::Router {
    app(RateLimitLayer::new(engine(rules)))
}

#[tokio::test]
async fn client_ip_extension_and_cf_connecting_ip() {
    let rules = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 1, window: 1h }]
"#;
    let app = app(layer(engine(rules))
        .customizer(|ctx, parts| {
            if let Some(ip) = parts
                .headers
                .get("cf-connecting-ip")
                .and_then(|v| v.to_str().ok()?.parse().ok())
            {
                ctx.set_client_ip(Some(ip));
            }
        })
        .build()
        .unwrap());
    let cf = |ip: &'static str| request("GET", "/api/users", "192.0.2.50", &[("cf-connecting-ip", ip)]);
    assert_eq!(send(&app, cf("198.51.100.60")).await.status, StatusCode::OK);
    assert_eq!(send(&app, cf("198.51.100.61")).await.status, StatusCode::OK);
    assert_eq!(
        send(&app, cf("198.51.100.60")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    let mut req = request("GET", "/api/users", "192.0.2.50", &[]);
    req.extensions_mut().insert(ClientIp("198.51.100.62".parse().unwrap()));
    assert_eq!(send(&app, req).await.status, StatusCode::OK);
}

/// Trusted networks that together hold every address of a family trust every peer of
/// it, as `0.0.0.0/0` alone does: refused, naming them. Networks that leave an address of
/// each family out stay allowed.
#[tokio::test]
async fn trusted_networks_that_together_hold_every_address_are_refused() {
    let engine = engine("rule_sets: [{id: default, rules: [{id: per-ip, bands: [{capacity: 1, window: 1h}]}]}]");
    for (covering, named) in [
        (
            &["0.0.0.0/1", "10.0.0.0/8", "128.0.0.0/1"][..],
            "0.0.0.0/1, 128.0.0.0/1",
        ),
        (
            &["128.0.0.0/2", "0.0.0.0/1", "192.0.0.0/2"][..],
            "128.0.0.0/2, 0.0.0.0/1, 192.0.0.0/2",
        ),
        // An address with host bits names its whole network.
        (&["0.0.0.0/1", "128.0.0.1/1"][..], "0.0.0.0/1, 128.0.0.1/1"),
        (&["::/1", "8000::/1"][..], "::/1, 8000::/1"),
        (
            &["::ffff:0.0.0.0/1", "128.0.0.0/1"][..],
            "::ffff:0.0.0.0/1, 128.0.0.0/1",
        ),
    ] {
        let err = RateLimitLayer::builder(engine.clone())
            .trusted_proxies(covering.iter().copied())
            .build()
            .unwrap_err();
        assert!(
            matches!(&err, ConfigError::TrustedProxy { value, .. } if value == named)
                && err.to_string().contains("trust every address"),
            "{covering:?}: {err}"
        );
    }
    for partial in [
        &["0.0.0.0/1", "128.0.0.0/2"][..],
        &["0.0.0.0/1", "8000::/1"][..],
        &["10.0.0.0/8", "192.168.0.0/16", "fd00::/8"][..],
    ] {
        assert!(
            layer(engine.clone())
                .trusted_proxies(partial.iter().copied())
                .build()
                .is_ok(),
            "{partial:?}"
        );
    }
}
