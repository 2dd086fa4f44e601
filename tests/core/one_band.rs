//! A rule set of one enforced rule of one band is decided by the in-memory limiter without
//! an acquire request: it must decide every request as the general path does.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use fluxgate_core::{Engine, ManualClock, MemoryLimiter, RequestContext, RuleSets};
use http::Method;

/// The rules, one rule set each: every algorithm, every scope, the key policies, patterns,
/// methods, a cost of 2 and a disabled rule.
fn rule_sets() -> Vec<String> {
    let mut sets = Vec::new();
    for algorithm in fluxgate_core::Algorithm::ALL.map(fluxgate_core::Algorithm::as_str) {
        for rule in [
            "scope: ip",
            "scope: global",
            "scope: user, on_missing_key: deny",
            "scope: user, on_missing_key: skip",
            "scope: user, on_missing_key: fallback_ip",
            "scope: composite, fields: [ip, user], on_missing_key: skip",
            "scope: api_key, permits: 2",
            "match: { paths: [\"/api/**\"], methods: [GET] }",
            "enabled: false",
        ] {
            sets.push(format!(
                "rule_sets:\n  - id: default\n    rules:\n      - {{ id: r, algorithm: {algorithm}, bands: [{{ capacity: 3, window: 1s }}], {rule} }}\n"
            ));
        }
    }
    sets
}

/// The requests: a few clients, with and without a user or an API key, on a few paths and
/// methods.
fn request(i: u64) -> RequestContext {
    let mut ctx = RequestContext::builder()
        .path(["/api/a", "/other", "/api/../x"][(i % 3) as usize])
        .method([Method::GET, Method::POST, Method::HEAD][(i / 3 % 3) as usize].clone());
    if i % 5 != 0 {
        ctx = ctx.client_ip(IpAddr::from([192, 0, 2, (i % 4) as u8]));
    }
    if i % 2 == 0 {
        ctx = ctx.user_id(format!("u{}", i % 3));
    }
    if i % 7 < 3 {
        ctx = ctx.api_key("k");
    }
    ctx.build()
}

#[test]
fn a_rule_set_of_one_band_is_decided_as_by_the_general_path() {
    for yaml in rule_sets() {
        let rules = || RuleSets::from_yaml_str(&yaml).unwrap();
        let clock = ManualClock::new(1_700_000_000_000_000_000);
        let memory = || MemoryLimiter::builder().clock(clock.clone()).build();
        // A limiter the engine knows as the in-memory one decides such a rule set directly;
        // one shared as a trait object, by the general path.
        let direct = Engine::builder(rules()).limiter(memory()).build().unwrap();
        let general = Engine::builder(rules())
            .shared_limiter(Arc::new(memory()))
            .build()
            .unwrap();
        let (mut admitted, mut refused) = (0, 0);
        let mut seed = 0x9e37_79b9_u64;
        for i in 0..400 {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            clock.advance(Duration::from_millis(seed >> 59));
            let ctx = request(seed >> 40);
            let a = direct.check(&ctx).into_ready().unwrap().unwrap();
            let b = general.check(&ctx).into_ready().unwrap().unwrap();
            assert_eq!(a, b, "request {i} of\n{yaml}");
            if a.allowed() {
                admitted += 1;
            } else {
                refused += 1;
            }
        }
        assert!(admitted > 0, "{yaml}");
        if !yaml.contains("enabled: false") {
            assert!(refused > 0, "{yaml}");
        }
    }
}
