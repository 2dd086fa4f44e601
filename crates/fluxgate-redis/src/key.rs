//! The keys of the bands in Redis:
//! `<prefix>:{<rule set>:<rule>:<key value>}:<band>:<capacity>/<window>[:<suffix>]`, and
//! the deny cache's keys.

use fluxgate_core::{Algorithm, Band, Rule};

/// The hash tag of a bucket, `{<rule set>:<rule>:<key value>}`: all bands of a rule share
/// a hash slot.
pub(crate) fn hash_tag(rule_set: &str, rule: &Rule, key: &str) -> String {
    format!("{{{rule_set}:{}:{key}}}", rule.id())
}

/// The key of a band of a bucket (`tag`, from [`hash_tag`]).
pub(crate) fn band_key(prefix: &str, tag: &str, band: &Band, capacity: i64, algorithm: Algorithm) -> String {
    let window = fluxgate_core::rule::format_duration(band.window());
    let mut key = format!("{prefix}:{tag}:{}:{capacity}/{window}", band.name());
    if let Some(suffix) = suffix(algorithm) {
        key.push(':');
        key.push_str(suffix);
    }
    key
}

/// The deny cache's key of a band for requests of a cost: a denial holds for one cost.
pub(crate) fn deny_key(band_key: &str, permits: u64) -> String {
    format!("{band_key}#{permits}")
}

/// The end of a band's key: none for the token bucket, the algorithm for the others, so
/// that a rule whose algorithm changes starts new counters.
fn suffix(algorithm: Algorithm) -> Option<&'static str> {
    match algorithm {
        Algorithm::TokenBucket => None,
        Algorithm::LeakyBucket => Some("lb"),
        Algorithm::FixedWindow => Some("fw"),
        Algorithm::SlidingWindowLog => Some("swl"),
        Algorithm::SlidingWindowCounter => Some("swc"),
    }
}
