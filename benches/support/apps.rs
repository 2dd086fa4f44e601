//! The apps, rule sets and requests shared by the in-memory benchmarks (`engine`, `layer`,
//! `instructions`), so that they measure the same thing.

#![allow(dead_code)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::Router;
use fluxgate::{Engine, MemoryLimiter, RateLimitLayer, RequestContext, RuleSets};
use http::Request;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::GovernorLayer;

/// The number of client addresses the layer's requests rotate over, unless a variant says
/// otherwise.
pub(crate) const CLIENTS: u32 = 1_000;

/// One per-IP rule of one band.
pub(crate) const ONE_RULE: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 1000000000, window: 1h }]
"#;

/// One per-IP rule whose buckets stay active: one request takes one of 100 tokens that
/// refill over an hour (for the memory per active key).
pub(crate) const ACTIVE_KEYS: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        bands: [{ capacity: 100, window: 1h }]
"#;

/// Three rules of two bands: per IP and per user (both with path patterns, the second with
/// methods too) and global.
pub(crate) const THREE_RULES: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        match: { paths: ["/api/**"] }
        bands:
          - { capacity: 1000000000, window: 1s, label: burst }
          - { capacity: 1000000000000, window: 1h, label: sustained }
      - id: per-user
        scope: user
        match: { paths: ["/api/**"], methods: [GET, POST] }
        bands:
          - { capacity: 1000000000, window: 1s, label: burst }
          - { capacity: 1000000000000, window: 1h, label: sustained }
      - id: global
        scope: global
        bands:
          - { capacity: 1000000000, window: 1s, label: burst }
          - { capacity: 1000000000000, window: 1h, label: sustained }
"#;

/// An engine with these rules and an in-memory limiter of `max_keys` buckets.
pub(crate) fn engine(yaml: &str, max_keys: usize) -> Engine {
    let rules = RuleSets::from_yaml_str(yaml).expect("rules");
    Engine::builder(rules)
        .limiter(MemoryLimiter::builder().max_keys(max_keys).build())
        .build()
        .expect("the backend decides every rule")
}

/// `n` contexts of `GET /api/items` from `n` client addresses and 997 users.
pub(crate) fn contexts(n: u32) -> Vec<RequestContext> {
    (0..n)
        .map(|i| {
            RequestContext::builder()
                .path("/api/items")
                .client_ip(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)))
                .user_id(format!("user-{}", i % 997))
                .build()
        })
        .collect()
}

/// The app alone: one route with a trivial handler.
pub(crate) fn bare() -> Router {
    Router::new().route("/api/items", get(|| async { "ok" }))
}

/// The app behind FluxGate's layer, one per-IP rule of 10^9 per hour in memory.
pub(crate) fn fluxgate(ietf_headers: bool, identity_headers: bool) -> Router {
    fluxgate_with(true, ietf_headers, identity_headers)
}

/// [`fluxgate`], with the legacy headers on or off too (both families off: the decision
/// alone, for a breakdown of the layer's cost).
pub(crate) fn fluxgate_with(legacy_headers: bool, ietf_headers: bool, identity_headers: bool) -> Router {
    let rules = RuleSets::from_yaml_str(
        r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        scope: ip
        bands: [{ capacity: 1000000000, window: 1h }]
"#,
    )
    .expect("rules");
    let mut layer = RateLimitLayer::builder(Engine::in_memory(rules))
        .legacy_headers(legacy_headers)
        .ietf_headers(ietf_headers);
    if !identity_headers {
        layer = layer.no_user_header().no_api_key_header();
    }
    bare().layer(layer.build().expect("layer"))
}

/// The app behind `tower_governor`, per peer address, the same quota, with its headers.
pub(crate) fn governor() -> Router {
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(3_600)
        .burst_size(1_000_000_000)
        .use_headers()
        .finish()
        .expect("governor config");
    bare().layer(GovernorLayer::new(Arc::new(config)))
}

/// The app behind a layer that does nothing but add `n` rate-limit headers of constant
/// values to each response (`n` = 5: what FluxGate's default options write for an
/// admission; 3: its legacy headers; 2: `tower_governor`'s): the least that writing these
/// headers into axum's responses can cost, with no decision made.
pub(crate) fn headers_only(n: usize) -> Router {
    use http::{HeaderName, HeaderValue};
    /// Header `i`, made from constants as the layer makes its own: only the headers
    /// written are made, nothing is cloned.
    fn header(i: usize) -> (HeaderName, HeaderValue) {
        const LIMIT: (HeaderName, HeaderValue) = (
            HeaderName::from_static("x-ratelimit-limit"),
            HeaderValue::from_static("1000000000"),
        );
        const REMAINING: (HeaderName, HeaderValue) = (
            HeaderName::from_static("x-ratelimit-remaining"),
            HeaderValue::from_static("999999999"),
        );
        const RESET: (HeaderName, HeaderValue) = (
            HeaderName::from_static("x-ratelimit-reset"),
            HeaderValue::from_static("1800000000"),
        );
        const POLICY: (HeaderName, HeaderValue) = (
            HeaderName::from_static("ratelimit-policy"),
            HeaderValue::from_static("\"per-ip\";q=1000000000;w=3600"),
        );
        const CURRENT: (HeaderName, HeaderValue) = (
            HeaderName::from_static("ratelimit"),
            HeaderValue::from_static("\"per-ip\";r=999999999;t=3600"),
        );
        match i {
            0 => LIMIT,
            1 => REMAINING,
            2 => RESET,
            3 => POLICY,
            _ => CURRENT,
        }
    }
    bare().layer(tower::util::MapResponseLayer::new(
        move |mut resp: axum::response::Response| {
            let map = resp.headers_mut();
            for i in 0..n {
                let (name, value) = header(i);
                map.insert(name, value);
            }
            resp
        },
    ))
}

/// Request `i` of a run over `clients` client addresses.
pub(crate) fn request(i: u32, clients: u32) -> Request<Body> {
    let mut req = Request::builder()
        .uri("/api/items")
        .body(Body::empty())
        .expect("request");
    let ip = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + (i % clients)));
    req.extensions_mut().insert(ConnectInfo(SocketAddr::new(ip, 4000)));
    req
}

/// An engine with these rules on `limiter`: keep a clone of the limiter to read its
/// [`len`](MemoryLimiter::len) (the clones share their buckets).
pub(crate) fn engine_on(yaml: &str, limiter: MemoryLimiter) -> Engine {
    let rules = RuleSets::from_yaml_str(yaml).expect("rules");
    Engine::builder(rules)
        .limiter(limiter)
        .build()
        .expect("the backend decides every rule")
}
