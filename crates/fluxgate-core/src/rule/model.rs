//! The validated model: rule sets, rules, bands and scopes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use sha2::{Digest, Sha256};

use super::validate::validate_band;
use super::{Algorithm, BandRangeError, Mode, OnMissingKey};
use crate::failure::FailurePolicy;
use crate::name::Name;
use crate::path::{trimmed, without_trailing_slash, PathPattern, RequestPaths};

/// A validated rule set. Its rules are ordered by priority, highest first (ties keep the
/// order of the file).
///
/// Two rule sets are equal when their ids are equal, their rules are equal, in the same
/// order, and so are their [generations](Self::generation); rules compare every field
/// (path patterns by their text). Hot reload ([`crate::reload`]) swaps in only the rule
/// sets that are not equal to the ones in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSet {
    pub(super) id: Name,
    pub(super) rules: Arc<[Rule]>,
    pub(super) generation: u64,
}

/// A validated rule. Equal rules have equal fields, path patterns compared by their text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub(super) id: Name,
    pub(super) enabled: bool,
    pub(super) paths: Vec<PathPattern>,
    pub(super) methods: Vec<Method>,
    pub(super) priority: i32,
    pub(super) scope: Scope,
    pub(super) on_missing_key: OnMissingKey,
    pub(super) algorithm: Algorithm,
    pub(super) permits: u64,
    pub(super) bands: Arc<[Band]>,
    pub(super) mode: Mode,
    pub(super) on_backend_failure: Option<FailurePolicy>,
    pub(super) lease: Option<Lease>,
    pub(super) wait: Option<WaitPolicy>,
}

/// A rule's `on_limit: { wait: { max_wait, max_waiters } }`: a request the rule would
/// refuse, and that it would admit within `max_wait`, reserves its place at once (in the
/// same step as the decision) and proceeds when that time comes, instead of a refusal. At
/// most `max_waiters` requests of the rule wait at once on one instance. A waiting request
/// that is dropped gives its place back. See `docs/acquisition.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WaitPolicy {
    pub(super) max_wait: Duration,
    pub(super) max_waiters: u32,
}

impl WaitPolicy {
    /// Waiting at most `max_wait` (1ms to 1h), at most `max_waiters` (at least 1) requests
    /// of a rule at once on one instance.
    ///
    /// # Errors
    ///
    /// A [`WaitError`](super::WaitError) naming the value out of range.
    ///
    /// ```
    /// use std::time::Duration;
    /// use fluxgate_core::WaitPolicy;
    /// let policy = WaitPolicy::new(Duration::from_millis(500), 100).unwrap();
    /// assert_eq!(policy.max_waiters(), 100);
    /// assert!(WaitPolicy::new(Duration::ZERO, 100).is_err());
    /// ```
    pub fn new(max_wait: Duration, max_waiters: u32) -> Result<Self, super::WaitError> {
        super::validate::wait(super::WaitSpec { max_wait, max_waiters }, false)
    }

    /// The longest a request waits.
    pub fn max_wait(&self) -> Duration {
        self.max_wait
    }

    /// The most requests of the rule waiting at once on one instance.
    pub fn max_waiters(&self) -> u32 {
        self.max_waiters
    }
}

/// A rule's local leases (`lease: { max, ttl }`): an instance takes up to `max` permits of
/// a key from the shared bucket in one backend call, spends them with no further call, and
/// gives back what it has not spent after `ttl`, when the rule changes, and at shutdown
/// ([`Engine::release_leases`](crate::Engine::release_leases)). Leased permits are
/// consumed in the backend when taken, so the limit is never exceeded; see
/// `docs/acquisition.md` for the bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease {
    pub(super) max: u64,
    pub(super) ttl: Duration,
}

impl Lease {
    /// The most permits one backend call takes.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// How long unspent permits are kept before they are given back.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }
}

/// What a rule's limit is counted per.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scope {
    /// One counter for everybody.
    Global,
    /// Per client IP.
    Ip,
    /// Per user id.
    User,
    /// Per API key.
    ApiKey,
    /// Per value of the named attribute.
    Attribute(Arc<str>),
    /// Per combination of the fields.
    Composite(Vec<KeyField>),
}

/// One part of a composite key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyField {
    /// The client IP.
    Ip,
    /// The user id.
    User,
    /// The API key.
    ApiKey,
    /// The named attribute.
    Attribute(Arc<str>),
}

/// A validated band: `capacity` per `window`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Band {
    pub(super) capacity: u64,
    pub(super) window: Duration,
    pub(super) label: Option<Arc<str>>,
    pub(super) name: Name,
    pub(super) ident: u64,
    /// See [`Band::interval_class`] and [`Band::weight_shift`]: worked out once, not for
    /// each request.
    pub(super) interval_class: u8,
    pub(super) weight_shift: u8,
}

/// The time the permits of one request (`permits` of `capacity` per `window`) take to come
/// back, in ns, rounded down to a power of two, as that power (0 to 63).
pub(super) fn interval_class(capacity: u64, window: Duration, permits: u64) -> u8 {
    let interval = window.as_nanos().saturating_mul(u128::from(permits.max(1))) / u128::from(capacity.max(1));
    // At most 63: clamped to what 64 bits hold.
    let interval = interval.clamp(1, u128::from(u64::MAX));
    (127 - interval.leading_zeros()) as u8
}

/// The cost of one request, `permits`, rounded down to a power of two, as that power.
pub(super) fn weight_shift(permits: u64) -> u8 {
    permits.max(1).ilog2() as u8
}

/// A digest of what identifies a band's counters: rule set, rule, band name, algorithm,
/// capacity and window. Equal bands get equal identities, so a reloaded rule keeps its
/// counters; a changed algorithm, capacity, window or name starts new ones.
///
/// The first 64 bits of the SHA-256 of a fixed encoding (each text length-prefixed, the
/// algorithm by its file name, numbers little-endian): the same on every platform, in
/// every process and release, though only one process's in-memory limiter relies on it
/// today. The memory limiter mixes it with its own random seed.
pub(super) fn band_ident(
    rule_set: &str,
    rule: &str,
    name: &str,
    algorithm: Algorithm,
    capacity: u64,
    window: Duration,
) -> u64 {
    let mut h = Sha256::new();
    for text in [rule_set, rule, name, algorithm.as_str()] {
        h.update((text.len() as u64).to_le_bytes());
        h.update(text.as_bytes());
    }
    h.update(capacity.to_le_bytes());
    h.update(window.as_secs().to_le_bytes());
    h.update(window.subsec_nanos().to_le_bytes());
    let digest = h.finalize();
    let mut first = [0; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(first)
}

impl Band {
    /// A band of `capacity` per `window`.
    ///
    /// # Errors
    ///
    /// When capacity or window is zero or beyond [`MAX_CAPACITY`](super::MAX_CAPACITY) / [`MAX_WINDOW`](super::MAX_WINDOW).
    pub fn new(capacity: u64, window: Duration) -> Result<Self, BandRangeError> {
        validate_band(capacity, window)?;
        Ok(Self {
            capacity,
            window,
            label: None,
            name: Name::new(""),
            ident: band_ident("", "", "", Algorithm::TokenBucket, capacity, window),
            interval_class: interval_class(capacity, window, 1),
            weight_shift: 0,
        })
    }

    /// A stable digest of the rule set, rule, name, algorithm, capacity and window: limiters key a
    /// band's counters by it (with the key value).
    pub fn ident(&self) -> u64 {
        self.ident
    }

    /// The time one request's permits take to come back (the window times its rule's
    /// cost, divided by the capacity) in ns, rounded down to a power of two, as that
    /// power: what the in-memory limiter ranks token and leaky buckets by when it must
    /// evict some, so that a bucket is ranked by the requests it still counts.
    pub(crate) fn interval_class(&self) -> u8 {
        self.interval_class
    }

    /// Its rule's cost per request, rounded down to a power of two, as that power: what
    /// the in-memory limiter divides a window's count by to rank it in requests.
    pub(crate) fn weight_shift(&self) -> u8 {
        self.weight_shift
    }

    /// The capacity: tokens, or requests per window.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The window.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The label, if one was given.
    pub fn label(&self) -> Option<&str> {
        self.label.as_deref()
    }

    /// The label, or `b<position>` for unlabeled bands: the band's name in keys.
    pub fn name(&self) -> &Name {
        &self.name
    }
}

impl RuleSet {
    /// The id.
    pub fn id(&self) -> &Name {
        &self.id
    }

    /// The rules, highest priority first.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// The generation of the rule set's counters: 0 as loaded, raised by each bucket
    /// reset ([`ReloadingRuleSetProvider::reset_buckets`](crate::reload::ReloadingRuleSetProvider::reset_buckets)).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The same rules with counters of another generation: every band gets another
    /// [identity](Band::ident), so that the in-memory limiter starts them fresh (the old
    /// counters are dropped as idle). Generation 0 gives the identities of the rules as
    /// loaded. The Redis backend's keys do not depend on it.
    #[must_use]
    pub fn with_generation(&self, generation: u64) -> RuleSet {
        let change = generation_mix(self.generation) ^ generation_mix(generation);
        let rules: Vec<Rule> = self
            .rules
            .iter()
            .map(|rule| {
                let bands: Vec<Band> = rule
                    .bands
                    .iter()
                    .map(|band| Band {
                        ident: band.ident ^ change,
                        ..band.clone()
                    })
                    .collect();
                Rule {
                    bands: bands.into(),
                    ..rule.clone()
                }
            })
            .collect();
        RuleSet {
            id: self.id.clone(),
            rules: rules.into(),
            generation,
        }
    }
}

/// What a generation changes in a band's identity: nothing for 0, a well-mixed 64-bit
/// value otherwise (SplitMix64's finalizer, a bijection, so two generations never give the
/// same identities).
fn generation_mix(generation: u64) -> u64 {
    if generation == 0 {
        return 0;
    }
    let mut z = generation.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Rule {
    /// The id, unique in its rule set.
    pub fn id(&self) -> &Name {
        &self.id
    }

    /// Whether the rule takes part in decisions.
    pub fn enabled(&self) -> bool {
        self.enabled
    }
    /// The path patterns; empty means all paths.
    pub fn paths(&self) -> &[PathPattern] {
        &self.paths
    }
    /// The methods; empty means all methods.
    pub fn methods(&self) -> &[Method] {
        &self.methods
    }
    /// The priority: higher first.
    pub fn priority(&self) -> i32 {
        self.priority
    }
    /// The scope.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }
    /// What happens when the scope's value is missing.
    pub fn on_missing_key(&self) -> OnMissingKey {
        self.on_missing_key
    }
    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }
    /// The cost of one request.
    pub fn permits(&self) -> u64 {
        self.permits
    }
    /// The bands; all must admit.
    pub fn bands(&self) -> &Arc<[Band]> {
        &self.bands
    }
    /// Enforce or shadow.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// What the rule does when the backend fails; `None` follows the engine.
    pub fn on_backend_failure(&self) -> Option<FailurePolicy> {
        self.on_backend_failure
    }

    /// The rule's local leases, if it has them.
    pub fn lease(&self) -> Option<Lease> {
        self.lease
    }

    /// Whether and how a request the rule would refuse waits for the refill instead.
    pub fn wait(&self) -> Option<WaitPolicy> {
        self.wait
    }

    /// Whether the rule has a wait policy.
    #[inline]
    pub(crate) fn waits(&self) -> bool {
        self.wait.is_some()
    }

    /// Whether the rule applies to a request with this path (split in segments, see
    /// [`PathPattern::matches_segments`]) and method.
    pub fn applies_to(&self, path_segments: &[&str], method: &Method) -> bool {
        self.enabled && self.matches_method(method) && self.matches_path(path_segments)
    }

    /// Whether the rule applies to a request: enabled, its method matches, and its path,
    /// normalized or as routed (with or without a trailing `/`), matches (see
    /// [`crate::path`]).
    ///
    /// ```
    /// use fluxgate_core::{RequestContext, RuleSets};
    /// let sets = RuleSets::from_yaml_str(r#"
    /// rule_sets:
    ///   - id: api
    ///     rules:
    ///       - id: login
    ///         match: { paths: ["/api/*/login"], methods: [GET] }
    ///         bands: [{ capacity: 5, window: 1m }]
    /// "#).unwrap();
    /// let rule = &sets.get("api").unwrap().rules()[0];
    /// let at = |method: &str, path: &str| {
    ///     RequestContext::builder().method(method.parse().unwrap()).path(path).build()
    /// };
    /// assert!(rule.applies(&at("GET", "/api/v1/login")));
    /// // HEAD runs GET handlers; `/api/../login` reaches a `/api/{version}/login` route.
    /// assert!(rule.applies(&at("HEAD", "/api/../login")));
    /// assert!(!rule.applies(&at("POST", "/api/v1/login")));
    /// // A pattern ignores its trailing `/`, and so does the routed view: `/api//login/`
    /// // reaches a `/api/{version}/login/` route.
    /// assert!(rule.applies(&at("GET", "/api//login/")));
    /// ```
    pub fn applies(&self, ctx: &crate::RequestContext) -> bool {
        // The paths are looked at (and the routed one split) only by a rule with patterns.
        if !self.has_path_patterns() {
            return self.applies_to_paths(None, ctx.method());
        }
        crate::path::with_paths(ctx, |paths| self.applies_to_paths(Some(paths), ctx.method()))
    }

    /// Whether the rule applies to a request with these paths (its normalized path and,
    /// when it differs, its routed path; `None` only for a rule without path patterns) and
    /// method.
    pub(crate) fn applies_to_paths(&self, paths: Option<&RequestPaths<'_>>, method: &Method) -> bool {
        self.enabled
            && self.matches_method(method)
            && (self.paths.is_empty()
                || paths.is_some_and(|paths| {
                    paths.too_long()
                        || self.paths.iter().any(|p| p.matches_normalized(paths))
                        || paths.routed().is_some_and(|r| self.matches_routed(r))
                        || paths.decoded().is_some_and(|v| {
                            self.matches_routed(v.routed)
                                || self.matches_routed(v.flattened_routed)
                                || self.matches_path(v.flattened)
                        })
                        || paths.clamped().iter().any(|v| self.matches_path(v))
                }))
    }

    /// Whether one of the rule's patterns matches the segments of a path as routed, with
    /// or without its trailing `/`, or trimmed.
    fn matches_routed(&self, routed: &[&str]) -> bool {
        self.matches_path(routed)
            || without_trailing_slash(routed).is_some_and(|r| self.matches_path(r))
            || trimmed(routed).is_some_and(|r| self.matches_path(r))
    }

    /// Whether the rule's methods include `method`. `HEAD` is matched as `GET` too,
    /// because routers (axum among them) run `GET` handlers for `HEAD` requests; and so is
    /// `CONNECT`, because a WebSocket handshake over HTTP/2 is a `CONNECT` (RFC 8441) that
    /// axum's `any` routes run the handler of a handshake over HTTP/1.1, a `GET`, for. A
    /// `CONNECT` to a `GET`-only route is refused by the router: counting it only counts
    /// more, never less.
    pub fn matches_method(&self, method: &Method) -> bool {
        self.methods.is_empty()
            || self.methods.contains(method)
            || ((*method == Method::HEAD || *method == Method::CONNECT) && self.methods.contains(&Method::GET))
    }

    /// Whether the rule names path patterns (without, it applies to every path).
    pub fn has_path_patterns(&self) -> bool {
        !self.paths.is_empty()
    }

    /// Whether one of the rule's patterns matches a path split in segments.
    pub fn matches_path(&self, path_segments: &[&str]) -> bool {
        self.paths.is_empty() || self.paths.iter().any(|p| p.matches_segments(path_segments))
    }
}

/// Validated rule sets by id, as loaded from one source.
#[derive(Debug, Clone, Default)]
pub struct RuleSets {
    pub(super) sets: HashMap<Name, Arc<RuleSet>>,
}

impl RuleSets {
    /// A rule set by id.
    pub fn get(&self, id: &str) -> Option<&Arc<RuleSet>> {
        // A handful of rule sets is the common case: comparing ids is cheaper than hashing.
        if self.sets.len() <= 8 {
            return self.sets.iter().find(|(k, _)| ***k == *id).map(|(_, v)| v);
        }
        self.sets.get(id)
    }

    /// Adds or replaces a rule set.
    pub fn insert(&mut self, set: RuleSet) {
        self.sets.insert(set.id.clone(), Arc::new(set));
    }

    /// Adds or replaces a rule set, shared.
    pub(crate) fn insert_shared(&mut self, set: Arc<RuleSet>) {
        self.sets.insert(set.id.clone(), set);
    }

    /// The rule sets.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<RuleSet>> {
        self.sets.values()
    }

    /// The number of rule sets.
    pub fn len(&self) -> usize {
        self.sets.len()
    }

    /// Whether there are no rule sets.
    pub fn is_empty(&self) -> bool {
        self.sets.is_empty()
    }
}

impl FromIterator<RuleSet> for RuleSets {
    fn from_iter<I: IntoIterator<Item = RuleSet>>(iter: I) -> Self {
        let mut sets = Self::default();
        for set in iter {
            sets.insert(set);
        }
        sets
    }
}
