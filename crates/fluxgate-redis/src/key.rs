//! The keys in Redis: a token-bucket rule's, `<prefix>:{<rule set>:<rule>:<key value>}`,
//! whose value holds all its bands, each named by its tag `<band>:<capacity>/<window>`;
//! a leaky bucket's band,
//! `<prefix>:{<rule set>:<rule>:<key value>}:<band>:<capacity>/<window>:lb`; a window
//! algorithm's band, `<prefix>:{<rule set>:<rule>:<key value>}:<band>:<window>:<suffix>`;
//! and the deny cache's keys.

use std::fmt::Write as _;

use fluxgate_core::{Band, Rule};

use crate::protocol::ScriptAlgorithm;

/// The key of a bucket, `<prefix>:{<rule set>:<rule>:<key value>}`: a token-bucket rule's
/// key (all its bands), and the start of the keys of the other algorithms' bands. What
/// follows `<prefix>:` is its hash tag (unless the prefix holds one of its own): all bands
/// of a rule share a hash slot.
pub(crate) fn rule_key(prefix: &str, rule_set: &str, rule: &Rule, key: &str) -> String {
    let id: &str = rule.id().as_ref();
    let mut out = String::with_capacity(prefix.len() + rule_set.len() + id.len() + key.len() + 5);
    for part in [prefix, ":{", rule_set, ":", id, ":", key, "}"] {
        out.push_str(part);
    }
    out
}

/// Whether Redis Cluster hashes the keys made with `prefix` whole: their first `{` (the
/// prefix's) is followed at once by a `}`, an empty hash tag, so the keys of one rule do not
/// share a slot. Any other prefix leaves every key of a rule one tag (the rule's, or one
/// that begins in the prefix).
pub(crate) fn hashes_whole(prefix: &str) -> bool {
    prefix.find('{').is_some_and(|open| prefix[open + 1..].starts_with('}'))
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

/// What follows a bucket's key (from [`rule_key`]) in the key of one of its bands: the
/// key of a band of the algorithms other than the token bucket, and the name of a
/// token-bucket band in the deny cache. `:<band tag>` for a token or leaky bucket, whose
/// state is counted in units of its capacity, then `:lb` for a leaky bucket;
/// `:<band>:<window>:<suffix>` for a window algorithm (fixed window, sliding window log or
/// counter), whose state counts permits: a band whose capacity alone changed keeps its
/// count, so that instances holding two versions of the rule count one window, in which
/// each admits while the count is within its own capacity (the looser version's limit,
/// where a key per capacity gave both versions' capacities together), and a capacity
/// changed on every instance goes on from the window's count.
pub(crate) fn band_part(band: &Band, capacity: i64, algorithm: ScriptAlgorithm) -> String {
    let mut part = String::with_capacity(48);
    part.push(':');
    if counts_permits(algorithm) {
        part.push_str(band.name().as_ref());
        part.push(':');
        part.push_str(&fluxgate_core::rule::format_duration(band.window()));
    } else {
        push_band_tag(&mut part, band, capacity);
    }
    if let Some(suffix) = suffix(algorithm) {
        part.push(':');
        part.push_str(suffix);
    }
    part
}

/// Whether a band of `algorithm` counts permits (a window algorithm), whatever its
/// capacity, rather than units of its capacity (a token or leaky bucket).
pub(crate) fn counts_permits(algorithm: ScriptAlgorithm) -> bool {
    matches!(
        algorithm,
        ScriptAlgorithm::FixedWindow | ScriptAlgorithm::SlidingWindowLog | ScriptAlgorithm::SlidingWindowCounter
    )
}

/// What follows a window algorithm's band key in its deny-cache key, `@<capacity>`: the
/// key holds no capacity, and a denial holds for one.
pub(crate) fn capacity_part(capacity: i64) -> String {
    format!("@{capacity}")
}

/// What follows a band's name (its key, or its rule's key and [`band_part`] for a token
/// bucket; and [`capacity_part`] for a window algorithm) in its deny-cache key, `#<cost>`:
/// a denial holds for one cost.
pub(crate) fn cost_part(permits: u64) -> String {
    let mut part = String::with_capacity(21);
    part.push('#');
    let _ = write!(part, "{permits}"); // writing to a String cannot fail
    part
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
    fn a_rule_key_holds_its_hash_tag() {
        let sets = fluxgate_core::RuleSets::from_yaml_str(
            "rule_sets:\n  - id: api\n    rules:\n      - id: r\n        bands: [{ capacity: 1, window: 1s }]\n",
        )
        .unwrap();
        let rule = &sets.get("api").unwrap().rules()[0];
        let key = rule_key("p:x", "api", rule, "ip=1");
        assert_eq!(key, "p:x:{api:r:ip=1}");
        let slot = fred::util::redis_keyslot;
        assert_eq!(slot(key.as_bytes()), slot(b"api:r:ip=1"));
        assert_eq!(slot(format!("{key}:fw").as_bytes()), slot(key.as_bytes()));
    }

    #[test]
    fn only_an_empty_hash_tag_in_the_prefix_hashes_keys_whole() {
        for prefix in ["app{}", "{}", "a{}b{c}", "x}{}"] {
            assert!(hashes_whole(prefix), "{prefix}");
        }
        for prefix in ["fluxgate", "a{", "a{b}", "}{x}", "a}{", "a{b{}"] {
            assert!(!hashes_whole(prefix), "{prefix}");
        }
        // As Redis finds the tag: `a{b{}` → `b{`, shared by the rule's keys.
        let slot = |k: &str| fred::util::redis_keyslot(k.as_bytes());
        assert_eq!(slot("a{b{}:{s:r:k}:x:fw"), slot("a{b{}:{s:r:k}:y:fw"));
        assert_ne!(slot("app{}:{s:r:k}:x:1/1s:fw"), slot("app{}:{s:r:k}:y:1/1s:fw"));
    }

    #[test]
    fn band_and_deny_keys_name_the_band_the_algorithm_and_the_cost() {
        let band = Band::new(10, std::time::Duration::from_secs(1)).unwrap();
        let name = band.name().to_string();
        assert_eq!(
            band_part(&band, 10, ScriptAlgorithm::TokenBucket),
            format!(":{name}:10/1s")
        );
        assert_eq!(
            band_part(&band, 10, ScriptAlgorithm::LeakyBucket),
            format!(":{name}:10/1s:lb")
        );
        // A window algorithm's count is of permits: its key holds no capacity.
        for (algorithm, suffix) in [
            (ScriptAlgorithm::FixedWindow, "fw"),
            (ScriptAlgorithm::SlidingWindowLog, "swl"),
            (ScriptAlgorithm::SlidingWindowCounter, "swc"),
        ] {
            assert_eq!(band_part(&band, 10, algorithm), format!(":{name}:1s:{suffix}"));
        }
        assert_eq!(capacity_part(10), "@10");
        assert_eq!(cost_part(12), "#12");
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
