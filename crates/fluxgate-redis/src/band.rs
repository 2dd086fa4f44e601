//! A band as the scripts compute it: its three numbers, and the range in which they decide
//! it exactly.

use std::time::Duration;

use fluxgate_core::rule::format_duration;
use fluxgate_core::{Algorithm, Band, Rule, RuleError, RuleSet};

use crate::protocol::{BandArgs, ScriptAlgorithm};

/// The largest number a band may need in the script: token and leaky buckets need
/// `capacity × window µs / gcd(capacity, window µs)`, sliding window counters
/// `capacity × window µs`. Twice it stays below 2^53, so every number in the script is an
/// exact integer.
pub const MAX_SCALED_CAPACITY: u64 = 1 << 52;

/// The largest capacity of a sliding window log band: the log keeps one sorted-set member
/// per admitted permit, and a request adds its permits one member each, so both the key's
/// size and the time one script call takes grow with it. Redis runs one script at a time:
/// removing 2^20 expired members took 332 ms of `redis-server` (measured, `ZREMRANGEBYSCORE`,
/// Redis 7.0), past every caller's deadline, so that a client which spent its own quota of
/// such a band made every instance fail for that long once per window; 2^16 take 8 ms.
pub const MAX_LOG_CAPACITY: u64 = 1 << 16;

/// Whether the scripts decide `band` exactly, as checked when rules are loaded.
///
/// # Errors
///
/// [`RuleError::Unsupported`] saying why not.
pub(crate) fn check(rule_set: &str, rule: &Rule, band: &Band) -> Result<(), RuleError> {
    numbers(rule_set, rule, band).map(drop)
}

/// Checks that the requests of `rule` of `set` can wait for the refill up to `max_wait` on
/// Redis: each token- or leaky-bucket band's state stays within the scripts' exact
/// arithmetic when it lies `max_wait` beyond its capacity (a waiting request's place is
/// taken in every band of its request, of whatever rule). The window algorithms' places lie
/// in the present window or the next, which their states keep apart. On a cluster
/// (`cluster`), the rule set has one rule: a request of several rules may span hash slots,
/// and a refund made across slots moves a bucket's instant back past a waiting request's
/// place it cannot see (a band the waiter did not wait for).
///
/// # Errors
///
/// [`RuleError::Unsupported`] naming the rule that waits and why.
pub(crate) fn check_wait(set: &RuleSet, rule: &Rule, max_wait: Duration, cluster: bool) -> Result<(), RuleError> {
    let first = rule.bands().first();
    let fail = |message: String| match first {
        Some(band) => unsupported(set.id(), rule, band, message),
        None => RuleError::Unsupported {
            backend: "redis",
            rule_set: set.id().to_string(),
            rule: rule.id().to_string(),
            band: String::new(),
            message,
        },
    };
    let wait = format_duration(max_wait);
    if cluster && set.rules().len() > 1 {
        return Err(fail(format!(
            "waiting for the refill (up to {wait}): on a Redis Cluster a request waits only in a rule set of one \
             rule, whose requests never span hash slots; this rule set has {} (a refund across slots could free a \
             waiting request's place)",
            set.rules().len()
        )));
    }
    let wait_us = u64::try_from(max_wait.as_micros()).unwrap_or(u64::MAX);
    let buckets = set
        .rules()
        .iter()
        .filter(|r| matches!(r.algorithm(), Algorithm::TokenBucket | Algorithm::LeakyBucket));
    for other in buckets {
        for band in other.bands().iter() {
            let [capacity, scale, interval] = numbers(set.id(), other, band)?;
            let furthest = wait_us
                .checked_mul(scale)
                .and_then(|ahead| ahead.checked_add(capacity.saturating_mul(interval)));
            if furthest.is_none_or(|n| n > MAX_SCALED_CAPACITY) {
                return Err(fail(format!(
                    "waiting for the refill up to {wait}: band `{}` of rule `{}` ({} per {}) would then lie \
                     beyond 2^52 units, the largest the script computes exactly; wait less",
                    band.name(),
                    other.id(),
                    band.capacity(),
                    format_duration(band.window()),
                )));
            }
        }
    }
    Ok(())
}

/// A band's three numbers for the scripts.
///
/// # Errors
///
/// [`RuleError::Unsupported`] when the scripts cannot decide it exactly.
pub(crate) fn band_args(rule_set: &str, rule: &Rule, band: &Band) -> Result<BandArgs, RuleError> {
    let [capacity, a, b] = numbers(rule_set, rule, band)?.map(|n| script_number(n, rule_set, rule, band));
    Ok(BandArgs {
        capacity: capacity?,
        a: a?,
        b: b?,
    })
}

/// A number for the scripts: below 2^53 for every value the validation lets through.
///
/// # Errors
///
/// [`RuleError::Unsupported`] for a larger one.
pub(crate) fn script_number(n: u64, rule_set: &str, rule: &Rule, band: &Band) -> Result<i64, RuleError> {
    i64::try_from(n).ok().filter(|&n| n < 1 << 53).ok_or_else(|| {
        unsupported(
            rule_set,
            rule,
            band,
            format!("{n} is beyond 2^53, the exact integers of the scripts"),
        )
    })
}

/// The scripts' version of the rule's algorithm.
///
/// # Errors
///
/// [`RuleError::Unsupported`] for an algorithm the scripts do not have.
pub(crate) fn script_algorithm(rule_set: &str, rule: &Rule, band: &Band) -> Result<ScriptAlgorithm, RuleError> {
    ScriptAlgorithm::of(rule.algorithm()).ok_or_else(|| {
        let message = format!("the Redis scripts have no {} algorithm", rule.algorithm().as_str());
        unsupported(rule_set, rule, band, message)
    })
}

fn unsupported(rule_set: &str, rule: &Rule, band: &Band, message: String) -> RuleError {
    RuleError::Unsupported {
        backend: "redis",
        rule_set: rule_set.to_owned(),
        rule: rule.id().to_string(),
        band: band.name().to_string(),
        message,
    }
}

/// A band's three numbers in the scripts (see `lua/README.md`), or why the scripts cannot
/// decide it exactly.
fn numbers(rule_set: &str, rule: &Rule, band: &Band) -> Result<[u64; 3], RuleError> {
    let fail = |message: String| unsupported(rule_set, rule, band, message);
    let capacity = band.capacity();
    let window = band.window();
    if window.subsec_nanos() % 1_000 != 0 {
        return Err(fail(format!(
            "the window {window:?} is not a whole number of microseconds, the unit of Redis time"
        )));
    }
    let window_us =
        u64::try_from(window.as_micros()).map_err(|_| fail(format!("the window {window:?} is too long")))?;
    let algorithm = script_algorithm(rule_set, rule, band)?;
    let (a, b, largest, what) = match algorithm {
        ScriptAlgorithm::TokenBucket | ScriptAlgorithm::LeakyBucket => {
            let g = gcd(capacity, window_us);
            let (scale, interval) = (capacity / g, window_us / g);
            (
                scale,
                interval,
                capacity.checked_mul(interval),
                "capacity × window in µs / gcd(capacity, window in µs)",
            )
        }
        ScriptAlgorithm::SlidingWindowCounter => {
            (window_us, 0, capacity.checked_mul(window_us), "capacity × window in µs")
        }
        ScriptAlgorithm::FixedWindow | ScriptAlgorithm::SlidingWindowLog => {
            (window_us, 0, Some(window_us), "the window in µs")
        }
    };
    match largest {
        Some(n) if n <= MAX_SCALED_CAPACITY => {}
        largest => {
            let shown = largest.map_or_else(|| "beyond 2^64".to_owned(), |n| n.to_string());
            return Err(fail(format!(
                "{} per {}: {what} is {shown}, above 2^52 ({MAX_SCALED_CAPACITY}), the largest the script computes \
                 exactly; use a smaller capacity or a shorter window",
                capacity,
                format_duration(window),
            )));
        }
    }
    if algorithm == ScriptAlgorithm::SlidingWindowLog && capacity > MAX_LOG_CAPACITY {
        return Err(fail(format!(
            "a sliding window log keeps one sorted-set member per permit: capacity {capacity} is above \
             {MAX_LOG_CAPACITY}; use a sliding window counter or a smaller capacity"
        )));
    }
    Ok([capacity, a, b])
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gcd_scales() {
        assert_eq!(gcd(10, 1_000_000), 10);
        assert_eq!(gcd(7, 1_000_000), 1);
        assert_eq!(gcd(1_000_000, 86_400_000_000), 1_000_000);
    }
}
