//! Resource exhaustion and fairness: what one client can do to the limiter's state and to
//! the decisions of other clients.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use fluxgate::core::{CachingRuleSetProvider, Engine, RequestContext, RuleSets, StaticRuleSetProvider};

fn ip(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
}

/// The resident memory of this process, in bytes.
fn resident() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("resident pages");
    pages * 4096
}

/// A customizer that picks the rule set from a header (the documented tenant pattern), in
/// front of a `CachingRuleSetProvider`, under `UnknownRuleSet::Deny` (the documented
/// protection): every made-up id was looked up in the source and kept, whole, as a
/// not-found entry, up to `max_capacity` (10,000) of them, however long (1,000 of 64 KiB
/// held 65 MB). Rule set ids are at most 64 characters: no longer id can name one, and
/// none is kept.
#[test]
fn long_made_up_rule_set_ids_are_not_kept_by_the_caching_provider() {
    use fluxgate::core::UnknownRuleSet;
    const IDS: usize = 1_000;
    const LEN: usize = 64 * 1024;
    let rules =
        RuleSets::from_yaml_str("rule_sets: [{id: api, rules: [{id: per-ip, bands: [{capacity: 10, window: 1s}]}]}]")
            .expect("valid rules");
    let provider = Arc::new(CachingRuleSetProvider::builder(StaticRuleSetProvider::new(rules)).build());
    let engine = Engine::builder(provider.clone())
        .unknown_rule_set(UnknownRuleSet::Deny)
        .build()
        .expect("an engine");
    let before = resident();
    for n in 0..IDS {
        let mut id = format!("{n:08}");
        id.extend(std::iter::repeat_n('x', LEN - id.len()));
        let ctx = RequestContext::builder().rule_set_id(id).client_ip(ip(1)).build();
        let Ok(decision) = engine.check(&ctx).into_ready() else {
            panic!("decided at once")
        };
        assert!(!decision.expect("a decision").allowed(), "refused: no such rule set");
    }
    let grown = resident().saturating_sub(before);
    eprintln!(
        "{IDS} made-up ids of {LEN} bytes: resident memory grew by {} KiB ({} bytes per request); {provider:?}",
        grown / 1024,
        grown / IDS
    );
    // The resident memory is only reported: other tests of this binary allocate beside this
    // one. What the cache keeps is the measure.
    assert!(
        format!("{provider:?}").ends_with("entries: 0 }"),
        "made-up ids kept: {provider:?}"
    );
}
