//! What the limiter sends for a rule, worked out once per rule instead of once per
//! request: its script arguments (numbers in hexadecimal, its layout), the ends of its keys
//! and of its deny-cache keys. Only the key value changes from one request to the next.
//!
//! Each thread keeps the plans of the rules it decided ([`plan`]), up to [`KEPT`]; past
//! that it forgets them all and starts again. A plan is found by the rule's bands (the
//! `Arc` every copy of a rule shares) and checked against the rule's id, rule set, cost,
//! algorithm and mode before use; the plan holds the bands' `Arc`, so no other rule's
//! bands can take that address while the plan is kept.

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use fluxgate_core::{Algorithm, Band, Mode, Name, Rule, RuleError};
use fred::bytes_utils::Str;
use smallvec::SmallVec;

use crate::band::{band_args, script_algorithm, script_number};
use crate::key;
use crate::protocol::{BandArgs, BucketArgs, Flags, RefundBand, RuleArgs, RulePlace, ScriptAlgorithm};

/// The plans a thread keeps at most: the rules of many rule sets.
const KEPT: usize = 4096;

/// Hashes the address of a rule's bands: addresses are not chosen by requests, so one
/// multiplication spreads them enough.
#[derive(Default)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type Plans = HashMap<usize, Arc<RulePlan>, BuildHasherDefault<AddressHasher>>;

thread_local! {
    static PLANS: RefCell<Plans> = RefCell::new(Plans::default());
}

/// A rule as the limiter sends it (see the module's documentation).
#[derive(Debug)]
pub(crate) struct RulePlan {
    /// What the plan was made from, checked at each use.
    bands: Arc<[Band]>,
    rule_set: Name,
    rule: Name,
    permits: u64,
    max_wait_us: i64,
    algorithm: Algorithm,
    mode: Mode,
    /// The scripts' arguments.
    pub(crate) args: Arc<RuleArgs>,
    /// A token-bucket rule's key is `<prefix>:<hash tag>`; a band of another algorithm's
    /// key is that followed by its part here (see [`key::band_part`]).
    band_parts: SmallVec<[String; 2]>,
    /// What follows a band's name in its deny-cache key: `#<cost>` after a leaky bucket's
    /// band key, `@<capacity>#<cost>` after a window algorithm's, `:<band tag>#<cost>` after
    /// a token-bucket rule's key (see [`key::band_part`], [`key::capacity_part`] and
    /// [`key::cost_part`]).
    deny_suffixes: SmallVec<[String; 2]>,
}

/// The plan of `rule` of the rule set `rule_set` for a request of `permits` (the rule's
/// cost, or a lease's) that may wait `max_wait_us` for a token-bucket rule to admit it (0:
/// not at all), the thread's kept one when it has it.
///
/// # Errors
///
/// [`RuleError::Unsupported`] for a band the scripts cannot decide exactly (a rule that
/// was not validated). `rule` has at least one band.
pub(crate) fn plan(
    rule_set: &Name,
    rule: &Rule,
    first: &Band,
    permits: u64,
    max_wait_us: i64,
) -> Result<Arc<RulePlan>, RuleError> {
    // A cost other than the rule's (a lease's), or a wait, is a plan of its own, found
    // beside it.
    let other_cost = (permits ^ rule.permits()) as usize;
    let address = rule.bands().as_ptr() as usize
        ^ other_cost.wrapping_mul(0x9e37_79b9_7f4a_7c15_u64 as usize)
        ^ (max_wait_us as usize).wrapping_mul(0xc2b2_ae3d_27d4_eb4f_u64 as usize);
    let kept = PLANS
        .try_with(|plans| {
            let plans = plans.try_borrow().ok()?;
            plans
                .get(&address)
                .filter(|plan| plan.is_for(rule_set, rule, permits, max_wait_us))
                .cloned()
        })
        .ok()
        .flatten();
    if let Some(plan) = kept {
        return Ok(plan);
    }
    let plan = Arc::new(RulePlan::new(rule_set, rule, first, permits, max_wait_us)?);
    let _ = PLANS.try_with(|plans| {
        if let Ok(mut plans) = plans.try_borrow_mut() {
            if plans.len() >= KEPT {
                plans.clear();
            }
            plans.insert(address, plan.clone());
        }
    });
    Ok(plan)
}

impl RulePlan {
    fn new(rule_set: &Name, rule: &Rule, first: &Band, cost: u64, max_wait_us: i64) -> Result<Self, RuleError> {
        let set: &str = rule_set.as_ref();
        let algorithm = script_algorithm(set, rule, first)?;
        let permits = script_number(cost, set, rule, first)?;
        let numbers = rule
            .bands()
            .iter()
            .map(|band| band_args(set, rule, band))
            .collect::<Result<SmallVec<[BandArgs; 4]>, RuleError>>()?;
        let shadow = rule.mode() == Mode::Shadow;
        // Each band's part of its key (`:<band tag>[:<suffix>]`).
        let parts: SmallVec<[String; 2]> = rule
            .bands()
            .iter()
            .zip(&numbers)
            .map(|(band, args)| key::band_part(band, args.capacity, algorithm))
            .collect();
        let cost_part = key::cost_part(cost);
        let (layout, band_parts, deny_suffixes) = if algorithm == ScriptAlgorithm::TokenBucket {
            // A token-bucket rule is one key, its bands named in its layout by their tags
            // (each part without its leading `:`); the deny cache names a band
            // `<rule key>:<band tag>#<cost>`, as the other algorithms' bands are named.
            let mut layout = String::with_capacity(parts.iter().map(String::len).sum::<usize>() + 1);
            for (i, part) in parts.iter().enumerate() {
                if i > 0 {
                    layout.push(',');
                }
                layout.push_str(part.strip_prefix(':').unwrap_or(part));
            }
            layout.push('|');
            let deny = parts.iter().map(|part| format!("{part}{cost_part}")).collect();
            (Some(Str::from(layout)), SmallVec::new(), deny)
        } else if key::counts_permits(algorithm) {
            // A window algorithm's key holds no capacity: its deny-cache name does.
            let deny = numbers
                .iter()
                .map(|args| format!("{}{cost_part}", key::capacity_part(args.capacity)))
                .collect();
            (None, parts, deny)
        } else {
            let deny = parts.iter().map(|_| cost_part.clone()).collect();
            (None, parts, deny)
        };
        let bucket = BucketArgs {
            permits,
            flags: Flags::new(numbers.len(), algorithm, shadow),
            layout,
            // A shadow rule never makes a request wait (the one-band script cannot tell it
            // from an enforced one).
            max_wait_us: if shadow { 0 } else { max_wait_us },
        };
        Ok(Self {
            bands: rule.bands().clone(),
            rule_set: rule_set.clone(),
            rule: rule.id().clone(),
            permits: cost,
            max_wait_us,
            algorithm: rule.algorithm(),
            mode: rule.mode(),
            args: Arc::new(RuleArgs::new(bucket, numbers)),
            band_parts,
            deny_suffixes,
        })
    }

    /// Whether this plan was made from `rule` (or a copy of it) of the rule set `rule_set`,
    /// for a request of `permits` that may wait `max_wait_us`.
    fn is_for(&self, rule_set: &Name, rule: &Rule, permits: u64, max_wait_us: i64) -> bool {
        Arc::ptr_eq(&self.bands, rule.bands())
            && self.rule == *rule.id()
            && self.rule_set == *rule_set
            && self.permits == permits
            && self.max_wait_us == max_wait_us
            && self.algorithm == rule.algorithm()
            && self.mode == rule.mode()
    }

    /// Whether the rule is one key holding all its bands (a token bucket).
    pub(crate) fn is_one_key(&self) -> bool {
        self.args.bucket.layout.is_some()
    }

    /// Whether the rule is in shadow mode.
    pub(crate) fn shadow(&self) -> bool {
        self.mode == Mode::Shadow
    }

    /// The bands' count.
    pub(crate) fn band_count(&self) -> usize {
        self.args.bands.len()
    }

    /// The key of band `index` of a rule of another algorithm than the token bucket, whose
    /// bucket's key begins with `start` (`<prefix>:<hash tag>`).
    pub(crate) fn band_key(&self, start: &str, index: usize) -> String {
        joined(start, &self.band_parts, index)
    }

    /// The deny-cache key of band `index`, after `key`: the rule's key for a token bucket,
    /// the band's key for another algorithm.
    pub(crate) fn deny_key(&self, key: &str, index: usize) -> String {
        joined(key, &self.deny_suffixes, index)
    }

    /// What the refund script needs to give band `index`'s consumption back.
    pub(crate) fn refund(&self, index: usize) -> Option<RefundBand> {
        let args = &self.args;
        let band = *args.bands.get(index)?;
        Some(RefundBand {
            algorithm: ScriptAlgorithm::of(self.algorithm)?,
            permits: args.bucket.permits.min(band.capacity),
            band,
            place: args.bucket.layout.as_ref().map(|layout| RulePlace {
                layout: layout.clone(),
                index: i64::try_from(index + 1).unwrap_or(i64::MAX),
                count: i64::try_from(args.bands.len()).unwrap_or(i64::MAX),
            }),
            expect: None,
        })
    }
}

/// `start` followed by `ends[index]` (nothing when there is no such end), in one allocation.
fn joined(start: &str, ends: &[String], index: usize) -> String {
    let end = ends.get(index).map_or("", String::as_str);
    let mut out = String::with_capacity(start.len() + end.len());
    out.push_str(start);
    out.push_str(end);
    out
}

#[cfg(test)]
mod tests {
    use fluxgate_core::{Format, RuleSets};

    use super::*;

    fn rules(json: &str) -> RuleSets {
        RuleSets::parse(json, Format::Json).unwrap()
    }

    fn the_plan(sets: &RuleSets, rule: usize) -> Arc<RulePlan> {
        let set = sets.get("api").unwrap();
        let rule = &set.rules()[rule];
        plan(set.id(), rule, &rule.bands()[0], rule.permits(), 0).unwrap()
    }

    #[test]
    fn a_plan_names_the_keys_and_writes_the_arguments_once() {
        let sets = rules(
            r#"{"rule_sets": [{"id": "api", "rules": [
                {"id": "tb", "permits": 2, "bands": [
                    {"capacity": 10, "window": "1s", "label": "second"},
                    {"capacity": 100, "window": "1m", "label": "minute"}]},
                {"id": "fw", "algorithm": "fixed_window", "bands": [{"capacity": 5, "window": "1m", "label": "m"}]}]}]}"#,
        );
        let tb = the_plan(&sets, 0);
        assert!(tb.is_one_key());
        assert_eq!(tb.band_count(), 2);
        let layout = tb.args.bucket.layout.as_ref().unwrap().to_string();
        assert_eq!(layout, "second:10/1s,minute:100/1m|");
        assert_eq!(tb.deny_key("p:{api:tb:k}", 0), "p:{api:tb:k}:second:10/1s#2");
        assert_eq!(tb.deny_key("p:{api:tb:k}", 1), "p:{api:tb:k}:minute:100/1m#2");
        let refund = tb.refund(1).unwrap();
        assert_eq!(refund.place.as_ref().map(|p| (p.index, p.count)), Some((2, 2)));

        let fw = the_plan(&sets, 1);
        assert!(!fw.is_one_key());
        assert_eq!(fw.band_key("p:{api:fw:k}", 0), "p:{api:fw:k}:m:1m:fw");
        assert_eq!(fw.deny_key("p:{api:fw:k}:m:1m:fw", 0), "p:{api:fw:k}:m:1m:fw@5#1");
        assert!(fw.refund(0).unwrap().place.is_none());
        assert!(fw.refund(1).is_none());
    }

    #[test]
    fn a_thread_reuses_the_plan_of_a_rule_and_never_another_rules() {
        let json = |capacity: u32| {
            format!(
                r#"{{"rule_sets": [{{"id": "api", "rules": [{{"id": "r", "bands": [{{"capacity": {capacity}, "window": "1s"}}]}}]}}]}}"#
            )
        };
        let first = rules(&json(10));
        let a = the_plan(&first, 0);
        assert!(Arc::ptr_eq(&a, &the_plan(&first, 0)), "the same rule, the same plan");
        // A copy of the rule set (as each thread's copy) shares the bands, so the plan.
        let copy = fluxgate_core::RuleSet::clone(first.get("api").unwrap());
        let rule = &copy.rules()[0];
        assert!(Arc::ptr_eq(
            &a,
            &plan(copy.id(), rule, &rule.bands()[0], rule.permits(), 0).unwrap()
        ));
        // The same ids with other bands (a reload) make another plan.
        let second = rules(&json(20));
        let b = the_plan(&second, 0);
        assert!(!Arc::ptr_eq(&a, &b));
        assert_eq!(b.args.bands[0].capacity, 20);
        // Another thread makes its own.
        let other = std::thread::spawn(move || the_plan(&first, 0)).join().unwrap();
        assert!(!Arc::ptr_eq(&a, &other));
        assert_eq!(a.args.bands, other.args.bands);
    }

    #[test]
    fn past_the_bound_a_thread_forgets_its_plans_and_still_plans_right() {
        std::thread::spawn(|| {
            let count = KEPT + 10;
            let specs: Vec<String> = (0..count)
                .map(|i| {
                    format!(
                        r#"{{"id": "r{i}", "bands": [{{"capacity": {}, "window": "1s"}}]}}"#,
                        i + 1
                    )
                })
                .collect();
            let sets = rules(&format!(
                r#"{{"rule_sets": [{{"id": "api", "rules": [{}]}}]}}"#,
                specs.join(",")
            ));
            let set = sets.get("api").unwrap();
            for round in 0..2 {
                for (i, rule) in set.rules().iter().enumerate() {
                    let plan = plan(set.id(), rule, &rule.bands()[0], rule.permits(), 0).unwrap();
                    assert_eq!(
                        plan.args.bands[0].capacity,
                        i64::try_from(i).unwrap() + 1,
                        "round {round}"
                    );
                    assert!(PLANS.with(|plans| plans.borrow().len()) <= KEPT);
                }
            }
        })
        .join()
        .unwrap();
    }
}
