//! A layer with nothing but the rules reading a request (no customizer, include or exclude
//! patterns, or shadow mode) decides a rule set of one rule of one band, keyed by the client
//! address or global, by `Engine::check_address`, without building a context. It must answer
//! exactly as the layer that builds the context: random rules and random requests, sent to
//! both layers (the second made to build the context by a customizer that changes nothing)
//! on one paused clock, must give the same status, headers and body, request for request.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use fluxgate::core::{AddressDecision, Engine, MemoryLimiter, TokioClock};
use http::{Method, Request};

use crate::support::app::{rules, ALGORITHMS};
use crate::support::rng::Rng;
use crate::{app, engine, layer, send};

/// An engine of these rules whose in-memory limiter reads `clock`.
fn engine_on(yaml: &str, clock: TokioClock) -> Engine {
    Engine::builder(rules(yaml))
        .limiter(MemoryLimiter::builder().clock(clock).build())
        .build()
        .expect("the in-memory limiter decides every rule")
}

const SCOPES: [&str; 3] = ["ip", "global", "user"];
const PEERS: [Option<&str>; 5] = [
    Some("192.0.2.1"),
    Some("192.0.2.2"),
    Some("2001:db8::1"),
    Some("2001:db8::2:1"),
    None,
];
const METHODS: [&str; 4] = ["GET", "POST", "HEAD", "DELETE"];
const PATHS: [&str; 4] = ["/api/users", "/api/orders", "/api//x/../users", "/health"];

/// A rule set of one or two rules: each of one or two bands, of any algorithm and scope,
/// with or without a method or a path pattern.
fn rule_set(rng: &mut Rng) -> (String, bool) {
    let mut yaml = String::from("rule_sets:\n  - id: default\n    rules:\n");
    let rules = 1 + usize::from(rng.chance(4));
    let mut by_address = rules == 1;
    for r in 0..rules {
        let scope = rng.pick(&SCOPES);
        let bands = 1 + usize::from(rng.chance(4));
        let paths = rng.chance(4);
        let methods = rng.chance(3);
        by_address &= scope != "user" && bands == 1 && !paths;
        yaml += &format!(
            "      - id: r{r}\n        scope: {scope}\n        algorithm: {}\n",
            rng.pick(&ALGORITHMS)
        );
        if paths || methods {
            yaml += "        match: {";
            if paths {
                yaml += " paths: [\"/api/users\"]";
            }
            if methods {
                yaml += &format!("{} methods: [GET]", if paths { "," } else { "" });
            }
            yaml += " }\n";
        }
        yaml += "        bands:\n";
        for b in 0..bands {
            let label = if rng.chance(2) {
                format!(", label: l{b}")
            } else {
                String::new()
            };
            yaml += &format!(
                "          - {{ capacity: {}, window: {}{label} }}\n",
                1 + rng.below(3),
                rng.pick(&["1s", "1m"])
            );
        }
    }
    (yaml, by_address)
}

/// A request from `peer` (no address at all for `None`), with a user header.
fn request(method: &str, path: &str, peer: Option<&str>, user: &str) -> Request<Body> {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("x-user-id", user)
        .body(Body::empty())
        .expect("a request");
    if let Some(peer) = peer {
        let ip: IpAddr = peer.parse().expect("an address");
        req.extensions_mut().insert(ConnectInfo(SocketAddr::new(ip, 40_000)));
    }
    req
}

#[tokio::test(start_paused = true)]
async fn deciding_by_address_answers_as_the_context_does() {
    let mut rng = Rng(0x5eed_ad0d_2e55);
    let mut decided_by_address = 0;
    for case in 0..80 {
        let (yaml, by_address) = rule_set(&mut rng);
        let ietf = rng.chance(2);
        // One clock for both: a window's edges are read from it.
        let clock = TokioClock::new();
        let direct = layer(engine_on(&yaml, clock)).ietf_headers(ietf).build().unwrap();
        let general = layer(engine_on(&yaml, clock))
            .ietf_headers(ietf)
            .customizer(|_, _| {})
            .build()
            .unwrap();
        // The first layer asks `check_address` first, the second never does.
        assert!(format!("{direct:?}").contains("by_address: true"), "{direct:?}");
        assert!(format!("{general:?}").contains("by_address: false"), "{general:?}");
        let (direct, general) = (app(direct), app(general));
        // Which rule sets take the short path: one of one band, keyed by address or
        // global, without path patterns (asked of an engine of its own).
        let probe: Engine = engine(&yaml);
        let ip = Some("192.0.2.9".parse().unwrap());
        assert_eq!(
            probe.check_address("default", &Method::DELETE, ip, |_| ()).is_some(),
            by_address,
            "case {case}:\n{yaml}"
        );
        for step in 0..40 {
            let (method, path, peer) = (rng.pick(&METHODS), rng.pick(&PATHS), rng.pick(&PEERS));
            let user = format!("u{}", rng.below(2));
            let a = send(&direct, request(method, path, peer, &user)).await;
            let b = send(&general, request(method, path, peer, &user)).await;
            let what = format!("case {case}, step {step}: {method} {path} from {peer:?}\n{yaml}");
            assert_eq!(a.status, b.status, "{what}");
            assert_eq!(a.headers, b.headers, "{what}");
            assert_eq!(a.body, b.body, "{what}");
            if by_address && a.headers.contains_key("x-ratelimit-limit") {
                decided_by_address += 1;
            }
            match rng.below(4) {
                0 => tokio::time::advance(Duration::from_millis(300)).await,
                1 => tokio::time::advance(Duration::from_secs(1)).await,
                _ => {}
            }
        }
    }
    assert!(
        decided_by_address > 500,
        "only {decided_by_address} requests went the short path"
    );
}

/// The short path gives way to the context wherever something else reads it, before it
/// counts anything.
#[test]
fn the_short_path_is_taken_only_for_rule_sets_it_decides_alone() {
    let one = |extra: &str| {
        format!(
            "rule_sets:\n  - id: default\n    rules:\n      - id: r\n        bands: [{{ capacity: 1, window: 1h }}]\n{extra}"
        )
    };
    let address: IpAddr = "192.0.2.1".parse().expect("an address");
    let ip = Some(address);
    let plain = engine(&one(""));
    let admitted = |decision: AddressDecision<'_>| match decision {
        AddressDecision::Admitted(band) => Some(band.remaining()),
        AddressDecision::Decided(d) => d.allowed().then(|| d.remaining()).flatten(),
    };
    assert_eq!(
        plain.check_address("default", &Method::GET, ip, admitted),
        Some(Some(0))
    );
    assert_eq!(plain.check_address("default", &Method::GET, ip, admitted), Some(None));
    // A provider that lends no rule set in place (`RuleSetProvider::rule_set_in_place`)
    // is asked for its snapshot; the same decisions.
    let cached = Engine::builder(
        fluxgate::core::CachingRuleSetProvider::builder(fluxgate::core::StaticRuleSetProvider::new(rules(&one(""))))
            .build(),
    )
    .limiter(MemoryLimiter::builder().build())
    .build()
    .expect("an engine");
    assert_eq!(
        cached.check_address("default", &Method::GET, ip, admitted),
        Some(Some(0))
    );
    assert_eq!(cached.check_address("default", &Method::GET, ip, admitted), Some(None));
    assert!(cached.check_address("other", &Method::GET, ip, |_| ()).is_none());
    // An unknown rule set, a user's key, a path pattern, a shadow rule, a second band, a
    // lease, a wait: the context decides, and nothing was counted.
    assert!(plain.check_address("other", &Method::GET, ip, |_| ()).is_none());
    for yaml in [
        one("        scope: user\n"),
        one("        match: { paths: [\"/api/**\"] }\n"),
        one("        mode: shadow\n"),
        "rule_sets:\n  - id: default\n    rules:\n      - id: r\n        bands: [{ capacity: 1, window: 1h }, { capacity: 5, window: 1d }]\n".to_owned(),
        one("        lease: { max: 1, ttl: 1s }\n"),
        one("        on_limit: { wait: { max_wait: 1s, max_waiters: 1 } }\n"),
    ] {
        let engine = engine(&yaml);
        assert!(engine.check_address("default", &Method::GET, ip, |_| ()).is_none(), "{yaml}");
        let ctx = fluxgate::core::RequestContext::builder()
            .path("/api/x")
            .client_ip(address)
            .user_id("u")
            .build();
        let first = engine.check(&ctx).into_ready().ok().unwrap().unwrap();
        assert!(first.allowed(), "{yaml}: the short path counted the request");
    }
}

/// A handler around an engine, counting its checks: a wrapper's `check` may decide
/// otherwise (a circuit breaker, a fallback, a user's blocklist), so a layer around it
/// never asks the engine by address.
#[derive(Debug)]
struct Counted(Engine, std::sync::atomic::AtomicUsize);

impl fluxgate::core::RateLimitHandler for Counted {
    fn check(
        &self,
        ctx: &fluxgate::core::RequestContext,
    ) -> fluxgate::core::MaybeReady<Result<fluxgate::core::Decision, fluxgate::core::Error>> {
        self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.0.check(ctx)
    }
}

#[tokio::test(start_paused = true)]
async fn a_handler_around_an_engine_decides_every_request() {
    let yaml = "rule_sets:\n  - id: default\n    rules:\n      - id: r\n        bands: [{ capacity: 2, window: 1h }]\n";
    let counted = std::sync::Arc::new(Counted(engine(yaml), std::sync::atomic::AtomicUsize::new(0)));
    let built = layer(counted.0.clone()).build().unwrap();
    assert!(format!("{built:?}").contains("by_address: true"), "an engine itself");
    let shared = layer_of(std::sync::Arc::new(counted.0.clone()));
    assert!(
        format!("{shared:?}").contains("by_address: true"),
        "an `Arc` of an engine"
    );
    let wrapped = layer_of(counted.clone());
    assert!(format!("{wrapped:?}").contains("by_address: false"), "{wrapped:?}");
    let app = app(wrapped);
    for _ in 0..5 {
        send(&app, request("GET", "/api/users", Some("192.0.2.1"), "u")).await;
    }
    assert_eq!(counted.1.load(std::sync::atomic::Ordering::SeqCst), 5);
}

fn layer_of(handler: impl fluxgate::core::RateLimitHandler) -> fluxgate::tower::RateLimitLayer {
    fluxgate::tower::RateLimitLayer::builder(handler)
        .build()
        .expect("the default options are valid")
}
