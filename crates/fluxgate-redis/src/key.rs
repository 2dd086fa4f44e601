//! The keys of the bands in Redis:
//! `<prefix>:{<rule set>:<rule>:<key value>}:<band>:<capacity>/<window>[:<suffix>]`, and
//! the deny cache's keys.

use std::fmt::Write as _;

use fluxgate_core::{Band, Rule};

use crate::protocol::ScriptAlgorithm;

/// The hash tag of a bucket, `{<rule set>:<rule>:<key value>}`: all bands of a rule share
/// a hash slot.
pub(crate) fn hash_tag(rule_set: &str, rule: &Rule, key: &str) -> String {
    let id: &str = rule.id().as_ref();
    let mut tag = String::with_capacity(rule_set.len() + id.len() + key.len() + 4);
    for part in ["{", rule_set, ":", id, ":", key, "}"] {
        tag.push_str(part);
    }
    tag
}

/// The key of a band of a bucket (`tag`, from [`hash_tag`]).
pub(crate) fn band_key(prefix: &str, tag: &str, band: &Band, capacity: i64, algorithm: ScriptAlgorithm) -> String {
    // Written part by part into one allocation, made for every band of every request.
    let window = fluxgate_core::rule::format_duration(band.window());
    let name: &str = band.name().as_ref();
    let mut key = String::with_capacity(prefix.len() + tag.len() + name.len() + window.len() + 32);
    for part in [prefix, ":", tag, ":", name, ":"] {
        key.push_str(part);
    }
    let _ = write!(key, "{capacity}"); // writing to a String cannot fail
    key.push('/');
    key.push_str(&window);
    if let Some(suffix) = suffix(algorithm) {
        key.push(':');
        key.push_str(suffix);
    }
    key
}

/// The deny cache's key of a band for requests of a cost: a denial holds for one cost.
pub(crate) fn deny_key(band_key: &str, permits: u64) -> String {
    let mut key = String::with_capacity(band_key.len() + 21);
    key.push_str(band_key);
    key.push('#');
    let _ = write!(key, "{permits}"); // writing to a String cannot fail
    key
}

/// The end of a band's key: none for the token bucket, the algorithm for the others, so
/// that a rule whose algorithm changes starts new counters.
fn suffix(algorithm: ScriptAlgorithm) -> Option<&'static str> {
    match algorithm {
        ScriptAlgorithm::TokenBucket => None,
        ScriptAlgorithm::LeakyBucket => Some("lb"),
        ScriptAlgorithm::FixedWindow => Some("fw"),
        ScriptAlgorithm::SlidingWindowLog => Some("swl"),
        ScriptAlgorithm::SlidingWindowCounter => Some("swc"),
    }
}

/// What every key of a rule set's buckets (`Some(id)`) or of every bucket (`None`) begins
/// with: `<prefix>:{<rule set>:` or `<prefix>:{`. Rule set ids hold no `:`, so one rule
/// set's keys never begin with another's.
pub(crate) fn buckets_start(prefix: &str, rule_set: Option<&str>) -> String {
    match rule_set {
        Some(id) => format!("{prefix}:{{{id}:"),
        None => format!("{prefix}:{{"),
    }
}

/// The `SCAN` pattern of the keys beginning with `start`: its glob characters escaped,
/// then `*`.
pub(crate) fn scan_pattern(start: &str) -> String {
    let mut pattern = String::with_capacity(start.len() + 8);
    for c in start.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    pattern.push('*');
    pattern
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deny_keys_name_the_cost() {
        assert_eq!(deny_key("k", 12), "k#12");
    }

    #[test]
    fn reset_patterns_reach_one_rule_sets_buckets_and_escape_the_prefix() {
        assert_eq!(scan_pattern(&buckets_start("fluxgate", Some("api"))), "fluxgate:{api:*");
        assert_eq!(scan_pattern(&buckets_start("fluxgate", None)), "fluxgate:{*");
        assert_eq!(
            scan_pattern(&buckets_start("a*b?[c]\\", Some("x"))),
            "a\\*b\\?\\[c\\]\\\\:{x:*"
        );
    }
}
