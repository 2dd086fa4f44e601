//! [`AcquireRequest`]: what one request consumes, owned, so that it can cross an `await`
//! and be handed to a fallback limiter without being taken apart and rebuilt.

use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;

use super::Wait;
use crate::decision::BandReport;
use crate::key::TypedKey;
use crate::rule::{Band, Mode, Rule, RuleSet};
use crate::text::Text;

/// Everything one request consumes, checked and applied as one atomic step: the rule set
/// and, per applicable rule (in priority order), the rule's index in the set and the
/// encoded key value (see [`crate::key`]).
///
/// The enforced buckets are all or nothing: either every band of every enforced bucket
/// admits the request and all of them consume, or none consumes. The shadow buckets
/// consume only when the enforced buckets admitted and every shadow band admits too, as
/// they would if they were enforced.
///
/// The request owns what it refers to (an [`Arc`] of the rule set and the keys), so it
/// is `'static`: a backend may keep it for as long as its answer takes.
///
/// ```
/// use std::sync::Arc;
/// use fluxgate_core::limiter::AcquireRequest;
/// use fluxgate_core::{RuleSets, Text};
///
/// let rules = RuleSets::from_yaml_str(r#"
/// rule_sets:
///   - id: api
///     rules:
///       - id: per-ip
///         bands: [{ capacity: 10, window: 1s }]
/// "#)?;
/// let set = rules.get("api").expect("defined above").clone();
/// let mut request = AcquireRequest::new(set);
/// request.push(0, Text::from("ip=192.0.2.7"));
/// let bucket = request.buckets().next().expect("one bucket");
/// assert_eq!(&**bucket.rule.id(), "per-ip");
/// assert_eq!(bucket.key, "ip=192.0.2.7");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct AcquireRequest {
    set: Arc<RuleSet>,
    buckets: SmallVec<[Entry; 4]>,
    /// Whether the backend is asked for the bands' marks ([`mark_places`](Self::mark_places)).
    marked: bool,
}

#[derive(Debug, Clone)]
struct Entry {
    rule: usize,
    key: Text,
    /// The key's typed value, for the in-memory limiter (see [`TypedKey`]).
    typed: TypedKey,
    /// What the bucket consumes: the rule's cost unless set otherwise.
    permits: u64,
    /// How long the request may wait for the bucket to admit it, in nanoseconds.
    max_wait_nanos: u64,
}

/// One rule's counter for one request, as a view into an [`AcquireRequest`]: the rule (its
/// id, algorithm, bands, cost and mode) and the encoded key value.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Bucket<'a> {
    /// The rule set.
    pub rule_set: &'a RuleSet,
    /// The rule.
    pub rule: &'a Rule,
    /// The encoded key value (see [`crate::key`]). Empty for the engine's address and
    /// global keys when its limiter does not
    /// [read key texts](super::RateLimiter::reads_key_text).
    pub key: &'a Text,
    /// The key's typed value, which the in-memory limiter hashes instead of the text.
    pub(crate) typed: TypedKey,
    /// What the request consumes from each band of the bucket: the rule's
    /// [`permits`](Rule::permits), unless the request was built with another count
    /// ([`AcquireRequest::push_permits`]; local leases take several requests' permits in
    /// one call).
    pub permits: u64,
    /// See [`Bucket::max_wait`].
    max_wait_nanos: u64,
}

impl Bucket<'_> {
    /// How long the request may wait for this bucket (its rule's `on_limit.wait`; zero:
    /// refused at once). See [`AcquireOutcome::admitted_after`](super::AcquireOutcome::admitted_after).
    pub fn max_wait(&self) -> Duration {
        Duration::from_nanos(self.max_wait_nanos)
    }

    /// Whether the rule is in shadow mode.
    #[inline]
    pub fn shadow(&self) -> bool {
        self.rule.mode() == Mode::Shadow
    }

    /// The report of `band` (one of this bucket's rule's bands) after a decision taken at
    /// `now_unix_nanos`: the one way every backend builds a [`BandReport`].
    #[inline]
    pub fn report(
        &self,
        band: &Band,
        now_unix_nanos: u64,
        remaining: u64,
        reset_after: Duration,
        wait: Wait,
    ) -> BandReport {
        BandReport::new(self.rule, band, now_unix_nanos, remaining, reset_after, wait)
    }
}

impl<'a> Bucket<'a> {
    /// The bucket of `rule` of `set` for a key, consuming the rule's cost, refused at once:
    /// a request of this one bucket, decided without an [`AcquireRequest`].
    pub(crate) fn of(set: &'a RuleSet, rule: &'a Rule, key: &'a Text, typed: TypedKey) -> Self {
        Self {
            rule_set: set,
            rule,
            key,
            typed,
            permits: rule.permits(),
            max_wait_nanos: 0,
        }
    }
}

impl AcquireRequest {
    /// A request that consumes nothing yet, from the rules of `set`.
    pub fn new(set: Arc<RuleSet>) -> Self {
        Self {
            set,
            buckets: SmallVec::new(),
            marked: false,
        }
    }

    /// Asks the backend for the state it leaves in each token-bucket band
    /// ([`AcquireOutcome::marks`](super::AcquireOutcome::marks)), to give what it takes
    /// back later with [`RateLimiter::give_back_place`](super::RateLimiter::give_back_place),
    /// which gives a bucket's permits back only while no one took any after them. Local
    /// leases ask for them. A request admitted for later has them whether asked or not.
    pub fn mark_places(&mut self) {
        self.marked = true;
    }

    /// Whether the request asks for the bands' marks (see [`mark_places`](Self::mark_places)).
    pub fn marks_places(&self) -> bool {
        self.marked
    }

    /// Adds the bucket of the rule at `rule` in the rule set, for the key value `key`.
    /// Buckets are decided in the order they are added. The in-memory limiter keys the
    /// engine's address and global keys by their typed value, not their text: a bucket
    /// pushed here as `ip=192.0.2.7` is another bucket than the one the engine counts that
    /// client in.
    ///
    /// # Panics
    ///
    /// When the rule set has no rule at `rule`.
    pub fn push(&mut self, rule: usize, key: Text) {
        assert!(
            rule < self.set.rules().len(),
            "rule index {rule} out of range: rule set `{}` has {} rules",
            self.set.id(),
            self.set.rules().len()
        );
        let permits = self.set.rules()[rule].permits();
        self.buckets.push(Entry {
            rule,
            key,
            typed: TypedKey::Text,
            permits,
            max_wait_nanos: 0,
        });
    }

    /// Adds the bucket of the rule at `rule` for the key value `key`, consuming `permits`
    /// from each of its bands instead of the rule's cost.
    ///
    /// # Panics
    ///
    /// When the rule set has no rule at `rule`, or `permits` is 0.
    pub fn push_permits(&mut self, rule: usize, key: Text, permits: u64) {
        assert!(permits > 0, "a bucket consumes at least 1 permit");
        self.push(rule, key);
        if let Some(entry) = self.buckets.last_mut() {
            entry.permits = permits;
        }
    }

    /// Adds the bucket of the rule at `rule` for the key value `key` of typed value `typed`
    /// (a bucket of another request, or a lease's), consuming `permits`: the in-memory
    /// limiter keys it as the engine's request that it comes from.
    ///
    /// # Panics
    ///
    /// As [`push_permits`](Self::push_permits).
    pub(crate) fn push_typed(&mut self, rule: usize, key: Text, typed: TypedKey, permits: u64) {
        self.push_permits(rule, key, permits);
        if let Some(entry) = self.buckets.last_mut() {
            entry.typed = typed;
        }
    }

    /// Adds the bucket of the rule at `rule`, its key value written in place by `key`
    /// (given the rule, an empty text and the typed value [`TypedKey::Text`]), unless `key`
    /// answers `false`.
    ///
    /// # Panics
    ///
    /// When the rule set has no rule at `rule`.
    pub(crate) fn push_keyed(&mut self, rule: usize, key: impl FnOnce(&Rule, &mut Text, &mut TypedKey) -> bool) {
        let Some(found) = self.set.rules().get(rule) else {
            panic!(
                "rule index {rule} out of range: rule set `{}` has {} rules",
                self.set.id(),
                self.set.rules().len()
            );
        };
        self.buckets.push(Entry {
            rule,
            key: Text::new(),
            typed: TypedKey::Text,
            permits: found.permits(),
            max_wait_nanos: 0,
        });
        let written = match self.buckets.last_mut() {
            Some(entry) => key(found, &mut entry.key, &mut entry.typed),
            None => false,
        };
        if !written {
            self.buckets.pop();
        }
    }

    /// The rule set.
    pub fn rule_set(&self) -> &Arc<RuleSet> {
        &self.set
    }

    /// The buckets, in the order they were added.
    pub fn buckets(&self) -> impl ExactSizeIterator<Item = Bucket<'_>> + Clone + '_ {
        self.buckets.iter().map(move |e| self.view(e))
    }

    /// The bucket at `index`.
    pub fn bucket(&self, index: usize) -> Option<Bucket<'_>> {
        self.buckets.get(index).map(|e| self.view(e))
    }

    /// Every band of every bucket, bucket by bucket: the order of
    /// [`AcquireOutcome::bands`](super::AcquireOutcome::bands).
    pub fn bands(&self) -> impl Iterator<Item = (Bucket<'_>, &Band)> + Clone + '_ {
        self.buckets()
            .flat_map(|b| b.rule.bands().iter().map(move |band| (b, band)))
    }

    /// The number of bands over all buckets.
    pub fn band_count(&self) -> usize {
        self.buckets().map(|b| b.rule.bands().len()).sum()
    }

    /// The number of buckets.
    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    /// Whether the request consumes nothing.
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// Keeps only the buckets for which `keep` says so.
    pub fn retain(&mut self, mut keep: impl FnMut(Bucket<'_>) -> bool) {
        let set = &self.set;
        self.buckets.retain(|e| {
            keep(Bucket {
                rule_set: set,
                rule: &set.rules()[e.rule],
                key: &e.key,
                typed: e.typed,
                permits: e.permits,
                max_wait_nanos: e.max_wait_nanos,
            })
        });
    }

    fn view<'a>(&'a self, e: &'a Entry) -> Bucket<'a> {
        Bucket {
            rule_set: &self.set,
            // `push` checked the index.
            rule: &self.set.rules()[e.rule],
            key: &e.key,
            typed: e.typed,
            permits: e.permits,
            max_wait_nanos: e.max_wait_nanos,
        }
    }

    /// Whether a bucket of the request may wait for the refill
    /// ([`set_max_wait`](Self::set_max_wait)) instead of a refusal.
    pub fn may_wait(&self) -> bool {
        self.buckets.iter().any(|e| e.max_wait_nanos > 0)
    }

    /// Lets the request wait up to `max_wait` for the bucket at `index` to admit it
    /// instead of a refusal, with a backend that lets its rule wait
    /// ([`check_wait`](super::RateLimiter::check_wait)).
    pub fn set_max_wait(&mut self, index: usize, max_wait: Duration) {
        if let Some(entry) = self.buckets.get_mut(index) {
            entry.max_wait_nanos = u64::try_from(max_wait.as_nanos()).unwrap_or(u64::MAX);
        }
    }

    /// Sets what the bucket at `index` consumes.
    pub(crate) fn set_permits(&mut self, index: usize, permits: u64) {
        if let Some(entry) = self.buckets.get_mut(index) {
            entry.permits = permits;
        }
    }

    /// The index in the rule set of the rule of the bucket at `index`.
    pub(crate) fn rule_index(&self, index: usize) -> Option<usize> {
        self.buckets.get(index).map(|e| e.rule)
    }
}
