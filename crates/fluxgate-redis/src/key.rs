//! The keys in Redis: a token-bucket rule's, `<prefix>:{<rule set>:<rule>:<key value>}`,
//! whose value holds all its bands, each named by its tag `<band>:<capacity>/<window>`;
//! a band's of the other algorithms,
//! `<prefix>:{<rule set>:<rule>:<key value>}:<band>:<capacity>/<window>:<suffix>`; and the
//! deny cache's keys.

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

/// The key of a token-bucket rule's bucket (`tag`, from [`hash_tag`]): all its bands.
pub(crate) fn rule_key(prefix: &str, tag: &str) -> String {
    let mut key = String::with_capacity(prefix.len() + tag.len() + 1);
    for part in [prefix, ":", tag] {
        key.push_str(part);
    }
    key
}

/// What names a band among its rule's, `<band>:<capacity>/<window>`, into `out`: a band
/// whose name, capacity or window changes is another band, which starts full. A
/// token-bucket rule's key holds its layout, its bands' tags joined by commas, then `|`,
/// then their states (see `lua/token_bucket.lua`, "State"). Tags hold no `,` nor `|`: band
/// names are `A-Z a-z 0-9 _ - .`, capacities digits, windows digits and a unit.
pub(crate) fn push_band_tag(out: &mut String, band: &Band, capacity: i64) {
    out.push_str(band.name().as_ref());
    out.push(':');
    let _ = write!(out, "{capacity}"); // writing to a String cannot fail
    out.push('/');
    out.push_str(&fluxgate_core::rule::format_duration(band.window()));
}

/// The key of a band of a bucket (`tag`, from [`hash_tag`]): the key of a band of the
/// algorithms other than the token bucket, and the name of any band in the deny cache.
pub(crate) fn band_key(prefix: &str, tag: &str, band: &Band, capacity: i64, algorithm: ScriptAlgorithm) -> String {
    // Written part by part into one allocation.
    let mut key = String::with_capacity(prefix.len() + tag.len() + 48);
    for part in [prefix, ":", tag, ":"] {
        key.push_str(part);
    }
    push_band_tag(&mut key, band, capacity);
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

/// The deny cache's key of band `band_tag` of the token-bucket rule of key `rule_key`, for
/// requests of a cost: `<rule key>:<band tag>#<cost>`, what [`deny_key`] makes of the
/// band's name as [`band_key`] writes it.
pub(crate) fn deny_key_in_rule(rule_key: &str, band_tag: &str, permits: u64) -> String {
    let mut key = String::with_capacity(rule_key.len() + band_tag.len() + 22);
    for part in [rule_key, ":", band_tag, "#"] {
        key.push_str(part);
    }
    let _ = write!(key, "{permits}"); // writing to a String cannot fail
    key
}

/// The end of a band's key: the algorithm (none for a token bucket's band, whose name only
/// serves the deny cache), so that a rule whose algorithm changes starts new counters.
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
        assert_eq!(deny_key_in_rule("p:{t}", "b0:10/1s", 3), "p:{t}:b0:10/1s#3");
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
