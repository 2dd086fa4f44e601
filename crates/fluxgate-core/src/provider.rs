//! Rule set providers: where the engine gets its rules.

use std::cell::RefCell;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::Duration;

use crate::error::{BoxError, RuleError};
use crate::future::MaybeReady;
use crate::rule::{RuleSet, RuleSets};

/// The result of a rule set lookup: `Ok(None)` when no rule set has the id.
pub type RuleSetLookup = Result<Option<Arc<RuleSet>>, BoxError>;

/// A check that a rule set can be decided: the limiter's
/// [`validate`](crate::RateLimiter::validate), handed to providers by the engine.
pub type RuleCheck = Arc<CheckFn>;

/// The function behind a [`RuleCheck`].
pub type CheckFn = dyn Fn(&RuleSet) -> Result<(), RuleError> + Send + Sync;

/// A source of rule sets by id.
///
/// Object safe; synchronous providers answer with [`MaybeReady::ready`].
pub trait RuleSetProvider: Send + Sync + fmt::Debug + 'static {
    /// The rule set with this id.
    ///
    /// The `Arc` handed out need not be the provider's own: `RuleSets`,
    /// `StaticRuleSetProvider` and `ReloadingRuleSetProvider` hand each thread a copy of
    /// its own of the rule set, equal to it, so that threads deciding at the same time do
    /// not write one shared reference count.
    fn rule_set(&self, id: &str) -> MaybeReady<RuleSetLookup>;

    /// The rule set with this id, lent in place, when the provider holds its rule sets so
    /// and can lend one at once: `Some(None)` when it has no rule set of this id, `None`
    /// when it lends none (the default), and the caller asks [`rule_set`](Self::rule_set).
    /// What it lends is what `rule_set` hands out. `RuleSets` and `StaticRuleSetProvider`
    /// lend theirs: a lookup without a reference count written.
    fn rule_set_in_place(&self, id: &str) -> Option<Option<&RuleSet>> {
        let _ = id;
        None
    }

    /// Checks every rule set the provider holds now with `check`, and keeps `check` for
    /// the rule sets it loads later: a rule set that fails it is never handed out (its
    /// lookups fail with the [`RuleError`], which the engine reports as
    /// [`Error::Rule`](crate::Error::Rule)). The engine calls this once, when it is built,
    /// with its limiter's validation.
    ///
    /// Providers keep `check` weakly: it applies while the caller holds it (an engine
    /// holds its check as long as it lives), so that a provider outliving an engine does
    /// not keep the engine's limiter alive.
    ///
    /// The default does nothing: providers that load rule sets must override it.
    ///
    /// # Errors
    ///
    /// The first rule set held now that fails `check`.
    fn validate(&self, check: RuleCheck) -> Result<(), RuleError> {
        let _ = check;
        Ok(())
    }
}

/// The checks a provider keeps for the rule sets it loads later, held weakly (see
/// [`RuleSetProvider::validate`]).
#[derive(Default)]
pub(crate) struct Checks(RwLock<Vec<Weak<CheckFn>>>);

impl Checks {
    /// Keeps `check` while its holder does.
    pub(crate) fn push(&self, check: &RuleCheck) {
        let mut checks = self.0.write().unwrap_or_else(PoisonError::into_inner);
        checks.retain(|weak| weak.strong_count() > 0);
        checks.push(Arc::downgrade(check));
    }

    /// Runs every live check on `set`.
    pub(crate) fn run(&self, set: &RuleSet) -> Result<(), RuleError> {
        let checks = self.0.read().unwrap_or_else(PoisonError::into_inner);
        checks.iter().filter_map(Weak::upgrade).try_for_each(|check| check(set))
    }

    /// Runs every live check on `set`, each whatever the others answer (a rule set that
    /// only changes generation, which every check has accepted already).
    pub(crate) fn run_each(&self, set: &RuleSet) {
        let checks = self.0.read().unwrap_or_else(PoisonError::into_inner);
        for check in checks.iter().filter_map(Weak::upgrade) {
            let _ = check(set);
        }
    }

    /// The live checks.
    pub(crate) fn len(&self) -> usize {
        let checks = self.0.read().unwrap_or_else(PoisonError::into_inner);
        checks.iter().filter(|weak| weak.strong_count() > 0).count()
    }
}

impl<P: RuleSetProvider + ?Sized> RuleSetProvider for Arc<P> {
    fn rule_set(&self, id: &str) -> MaybeReady<RuleSetLookup> {
        (**self).rule_set(id)
    }

    fn rule_set_in_place(&self, id: &str) -> Option<Option<&RuleSet>> {
        (**self).rule_set_in_place(id)
    }

    fn validate(&self, check: RuleCheck) -> Result<(), RuleError> {
        (**self).validate(check)
    }
}

/// Rule sets fixed at construction (from a file or from code).
///
/// ```
/// use fluxgate_core::{RuleSets, StaticRuleSetProvider, RuleSetProvider};
/// let sets = RuleSets::from_yaml_str("rule_sets: [{id: api, rules: []}]").unwrap();
/// let provider = StaticRuleSetProvider::new(sets);
/// let found = provider.rule_set("api").into_ready().unwrap().unwrap();
/// assert!(found.is_some());
/// ```
#[derive(Debug, Clone, Default)]
pub struct StaticRuleSetProvider {
    sets: RuleSets,
}

impl StaticRuleSetProvider {
    /// A provider of these rule sets.
    pub fn new(sets: RuleSets) -> Self {
        Self { sets }
    }

    /// The rule sets.
    pub fn rule_sets(&self) -> &RuleSets {
        &self.sets
    }
}

impl From<RuleSets> for StaticRuleSetProvider {
    fn from(sets: RuleSets) -> Self {
        Self::new(sets)
    }
}

impl RuleSetProvider for StaticRuleSetProvider {
    fn rule_set(&self, id: &str) -> MaybeReady<RuleSetLookup> {
        self.sets.rule_set(id)
    }

    fn rule_set_in_place(&self, id: &str) -> Option<Option<&RuleSet>> {
        self.sets.rule_set_in_place(id)
    }

    fn validate(&self, check: RuleCheck) -> Result<(), RuleError> {
        self.sets.validate(check)
    }
}

/// The most rule sets of which each thread keeps a copy of its own.
const LOCAL_COPIES: usize = 8;

thread_local! {
    /// Per thread: shared rule sets, each with this thread's copy of it.
    static LOCAL: RefCell<Vec<(Arc<RuleSet>, Arc<RuleSet>)>> = const { RefCell::new(Vec::new()) };
}

/// This thread's own `Arc` of the rule set `shared`: a copy of it (its id and its rules,
/// themselves shared) made once per thread. A lookup hands out a reference to that copy,
/// so that threads deciding at the same time do not all write the reference count of the
/// one shared `Arc`. The thread keeps the copies of the last 8 rule sets it looked up,
/// with a reference to each shared one (so that no other rule set can take its address
/// while the copy is kept).
pub(crate) fn local_copy(shared: &Arc<RuleSet>) -> Arc<RuleSet> {
    LOCAL
        .try_with(|local| {
            let Ok(mut local) = local.try_borrow_mut() else {
                return shared.clone();
            };
            if let Some((_, copy)) = local.iter().find(|(kept, _)| Arc::ptr_eq(kept, shared)) {
                return copy.clone();
            }
            let copy = Arc::new(RuleSet::clone(shared));
            if local.len() >= LOCAL_COPIES {
                local.remove(0);
            }
            local.push((shared.clone(), copy.clone()));
            copy
        })
        .unwrap_or_else(|_| shared.clone())
}

/// Fixed rule sets are a provider of their own. A lookup hands out the looking thread's
/// own copy of the rule set (see [`RuleSetProvider`]).
impl RuleSetProvider for RuleSets {
    fn rule_set(&self, id: &str) -> MaybeReady<RuleSetLookup> {
        MaybeReady::ready(Ok(self.get(id).map(local_copy)))
    }

    fn rule_set_in_place(&self, id: &str) -> Option<Option<&RuleSet>> {
        Some(self.get(id).map(|set| &**set))
    }

    fn validate(&self, check: RuleCheck) -> Result<(), RuleError> {
        let mut sets: Vec<&Arc<RuleSet>> = self.iter().collect();
        // The same error first whatever the map's order.
        sets.sort_by(|a, b| a.id().cmp(b.id()));
        sets.into_iter().try_for_each(|set| check(set))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    use super::*;

    /// Fixed rule sets lend in place what they hand out; a provider that does not (the
    /// cache) lends none, and every wrapper says what it wraps says.
    #[test]
    fn rule_sets_lend_what_they_hand_out() {
        let sets = RuleSets::from_yaml_str(
            "rule_sets:\n  - id: a\n    rules: [{ id: r, bands: [{ capacity: 1, window: 1s }] }]\n",
        )
        .expect("rules");
        let handed =
            |p: &dyn RuleSetProvider, id: &str| p.rule_set(id).into_ready().ok().and_then(Result::ok).flatten();
        let fixed = StaticRuleSetProvider::new(sets.clone());
        let shared: Arc<dyn RuleSetProvider> = Arc::new(sets.clone());
        for provider in [&sets as &dyn RuleSetProvider, &fixed, &shared] {
            let lent = provider.rule_set_in_place("a").expect("lends").expect("a rule set");
            let out = handed(provider, "a").expect("handed out");
            assert_eq!((lent.id(), lent.rules()), (out.id(), out.rules()));
            assert!(provider.rule_set_in_place("b").expect("lends").is_none());
        }
        let cached = CachingRuleSetProvider::builder(fixed).build();
        assert!(cached.rule_set_in_place("a").is_none());
    }

    /// A source that counts its lookups and can be told to fail.
    #[derive(Debug, Default)]
    struct Counting {
        lookups: AtomicUsize,
        fail: Mutex<bool>,
        sets: RuleSets,
    }

    impl RuleSetProvider for Counting {
        fn rule_set(&self, id: &str) -> MaybeReady<RuleSetLookup> {
            self.lookups.fetch_add(1, Ordering::SeqCst);
            if *self.fail.lock().unwrap() {
                return MaybeReady::ready(Err("source down".into()));
            }
            let found = self.sets.get(id).cloned();
            // An asynchronous source: the lookup completes later.
            MaybeReady::boxed(async move { Ok(found) })
        }
    }

    fn lookup(provider: &dyn RuleSetProvider, id: &str) -> Arc<RuleSet> {
        provider.rule_set(id).into_ready().unwrap().unwrap().unwrap()
    }

    #[test]
    fn each_thread_is_handed_a_copy_of_its_own() {
        let sets = RuleSets::from_yaml_str(
            "rule_sets: [{id: api, rules: [{id: per-ip, bands: [{capacity: 1, window: 1s}]}]}]",
        )
        .unwrap();
        let shared = sets.get("api").unwrap().clone();
        let here = lookup(&sets, "api");
        assert!(Arc::ptr_eq(&here, &lookup(&sets, "api")), "one copy per thread");
        assert!(!Arc::ptr_eq(&here, &shared), "not the shared `Arc`");
        assert_eq!(*here, *shared);
        let there = std::thread::scope(|s| s.spawn(|| lookup(&sets, "api")).join().unwrap());
        assert!(!Arc::ptr_eq(&here, &there), "another thread has its own");
        assert_eq!(*there, *shared);
        // A rule set taking the place of another is never mistaken for it.
        let other = RuleSets::from_yaml_str("rule_sets: [{id: api, rules: []}]").unwrap();
        assert!(lookup(&other, "api").rules().is_empty());
        assert_eq!(lookup(&sets, "api").rules().len(), 1);
    }

    #[tokio::test]
    async fn caching_provider_caches_invalidates_and_skips_errors() {
        let sets = RuleSets::from_yaml_str("rule_sets: [{id: api, rules: []}]").unwrap();
        let cached = CachingRuleSetProvider::builder(Counting {
            sets,
            ..Counting::default()
        })
        .build();
        let lookups = |c: &CachingRuleSetProvider<Counting>| c.get_ref().lookups.load(Ordering::SeqCst);

        assert!(cached.rule_set("api").await.unwrap().is_some());
        assert!(
            cached.rule_set("api").into_ready().unwrap().unwrap().is_some(),
            "a hit is synchronous"
        );
        assert_eq!(lookups(&cached), 1);
        // Unknown ids are cached too.
        assert!(cached.rule_set("nope").await.unwrap().is_none());
        assert!(cached.rule_set("nope").await.unwrap().is_none());
        assert_eq!(lookups(&cached), 2);

        cached.invalidate("api");
        *cached.get_ref().fail.lock().unwrap() = true;
        // The source fails: the rule set found last stays in force, not cached (each
        // request that finds a turn free asks the source again, so that a change is in
        // force as soon as it answers).
        assert!(cached.rule_set("api").await.unwrap().is_some());
        assert!(cached.rule_set("api").await.unwrap().is_some());
        assert_eq!(lookups(&cached), 4, "asked again");
        // An id never found has nothing to fall back on: the error, not cached.
        assert!(cached.rule_set("never").await.is_err());
        assert!(cached.rule_set("never").await.is_err());
        assert_eq!(lookups(&cached), 6);
        cached.invalidate("api");
        *cached.get_ref().fail.lock().unwrap() = false;
        assert!(cached.rule_set("api").await.unwrap().is_some());
        cached.invalidate_all();
        assert!(cached.rule_set("api").await.unwrap().is_some());
        assert_eq!(lookups(&cached), 8);
    }

    /// A source whose lookups answer what it held when they were made, once released.
    #[derive(Debug, Default)]
    struct Gated {
        sets: Mutex<RuleSets>,
        gate: Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
    }

    impl RuleSetProvider for Gated {
        fn rule_set(&self, id: &str) -> MaybeReady<RuleSetLookup> {
            let found = self.sets.lock().unwrap().get(id).cloned();
            let gate = self.gate.lock().unwrap().take();
            MaybeReady::boxed(async move {
                if let Some(gate) = gate {
                    let _ = gate.await;
                }
                Ok(found)
            })
        }
    }

    #[tokio::test]
    async fn a_lookup_made_before_an_invalidation_is_not_cached_after_it() {
        let cached = CachingRuleSetProvider::builder(Gated::default()).build();
        // A lookup made while the rule set does not exist yet, answered late.
        let (release, gate) = tokio::sync::oneshot::channel();
        *cached.get_ref().gate.lock().unwrap() = Some(gate);
        let slow = cached.rule_set("api");
        // Meanwhile the rule set is created, the cache invalidated, and a lookup finds it.
        *cached.get_ref().sets.lock().unwrap() = RuleSets::from_yaml_str("rule_sets: [{id: api, rules: []}]").unwrap();
        cached.invalidate("api");
        assert!(cached.rule_set("api").await.unwrap().is_some());
        // The late answer is handed to its own request, and does not replace the newer one.
        release.send(()).unwrap();
        assert!(slow.await.unwrap().is_none());
        assert!(
            cached.rule_set("api").into_ready().unwrap().unwrap().is_some(),
            "the rule set stays known, not unknown (admitted) until the entry expires"
        );

        // The same after `invalidate_all`, with no newer lookup in between.
        let (release, gate) = tokio::sync::oneshot::channel();
        cached.invalidate_all();
        *cached.get_ref().gate.lock().unwrap() = Some(gate);
        let slow = cached.rule_set("web");
        *cached.get_ref().sets.lock().unwrap() =
            RuleSets::from_yaml_str("rule_sets: [{id: api, rules: []}, {id: web, rules: []}]").unwrap();
        cached.invalidate_all();
        release.send(()).unwrap();
        assert!(slow.await.unwrap().is_none());
        assert!(
            cached.rule_set("web").await.unwrap().is_some(),
            "read again from the source"
        );
    }

    #[test]
    fn lookups_by_id() {
        let yaml = (0..20)
            .map(|i| format!("  - {{id: s{i}, rules: []}}\n"))
            .collect::<String>();
        let sets = RuleSets::from_yaml_str(&format!("rule_sets:\n{yaml}")).unwrap();
        let provider = StaticRuleSetProvider::new(sets);
        for i in 0..20 {
            let found = provider
                .rule_set(&format!("s{i}"))
                .into_ready()
                .unwrap()
                .unwrap()
                .unwrap();
            assert_eq!(&**found.id(), format!("s{i}"));
        }
        assert!(provider.rule_set("s20").into_ready().unwrap().unwrap().is_none());
    }
}

/// A [moka] cache in front of another provider: lookups (found or not) are kept until
/// they expire or are invalidated. Errors are not cached, and do not take rules out of
/// force: when the inner provider fails to look up a rule set it found before (the source
/// is down after an entry expired), the rule set it found last is served, and the failure
/// logged, until a lookup succeeds. A source outage therefore never leaves requests
/// without their rules (to a failure policy that may admit them all). An id that no rule
/// set can have (not 1 to 64 of `A-Z a-z 0-9 _ - .`, see [`check_id`](crate::rule::check_id))
/// is found at once to name none, neither asked of the source nor kept.
///
/// The source is asked at most [`max_lookups`](CachingRuleSetProviderBuilder::max_lookups)
/// lookups at once (4 by default); the other requests whose ids no entry holds wait for
/// one of them to end, and ask the cache again before they ask the source (a burst of
/// requests for one rule set looks it up once). The ids may come from the request (a
/// customizer reading a tenant header): without the bound, a client sending many made-up
/// ids at once made as many lookups at once, the source's connections ran out, its
/// lookups failed, and a failure for an id never found before follows the failure policy,
/// which may admit (`fail_open`): the client caused the outage that let its requests, and
/// those of real rule sets looked up meanwhile, through uncounted. Keep the bound within
/// what the source serves at once (its pool of connections). A request that waits longer
/// than [`lookup_timeout`](CachingRuleSetProviderBuilder::lookup_timeout) (1 s by default)
/// for its turn fails with [`LookupsBusy`], which the engine reports as
/// [`Error::Overloaded`](crate::Error::Overloaded): no failure policy admits it. A lookup
/// of the source that takes longer than that fails as the source's own failures do (the
/// rule set found last is served, if any). The time counts from the request's arrival: a
/// request that waited for its turn has what is left of it for its lookup, and fails with
/// [`LookupsBusy`] when it runs out. A request for a rule set found before, when no turn is
/// free, is served the rule set found last at once rather than queued behind a flood; ids
/// not found before hold at most all turns but one, so that ids found before are still
/// looked up again meanwhile and the rule sets in force follow their changes whatever the
/// flood. A failed lookup's rule set found last is served, not cached: the next request
/// that finds a turn free asks the source again. These waits use tokio's timers:
/// use the provider on a tokio runtime with time enabled (`#[tokio::main]` enables it).
///
/// ```
/// use std::time::Duration;
/// use fluxgate_core::{CachingRuleSetProvider, RuleSets, StaticRuleSetProvider};
/// let source = StaticRuleSetProvider::new(RuleSets::default());
/// let cached = CachingRuleSetProvider::builder(source)
///     .time_to_live(Duration::from_secs(30))
///     .max_capacity(1_000)
///     .max_lookups(8)
///     .lookup_timeout(Duration::from_millis(500))
///     .build();
/// cached.invalidate("api");
/// ```
pub struct CachingRuleSetProvider<P> {
    inner: Arc<P>,
    /// Each lookup's answer, with the ticket of the lookup that made it.
    cache: moka::sync::Cache<Arc<str>, (u64, Option<Arc<RuleSet>>)>,
    /// Tickets handed to lookups of the inner provider as they start, and to invalidations.
    tickets: Arc<AtomicU64>,
    /// The ticket of the last invalidation: a lookup that started before it answers its
    /// request, and caches nothing.
    invalidated: Arc<AtomicU64>,
    /// The rule set each id was last found to be, served when a lookup fails; dropped when
    /// a lookup finds none.
    last: moka::sync::Cache<Arc<str>, Arc<RuleSet>>,
    /// The checks of the engines built on this provider, run on every rule set it loads.
    checks: Arc<Checks>,
    /// The lookups of the inner provider allowed at once (`max_lookups`).
    slots: Arc<tokio::sync::Semaphore>,
    /// The lookups of ids not found before allowed at once, one fewer than `slots` (when
    /// there are two or more): a flood of made-up ids leaves a turn to the ids found
    /// before, so that the rule sets in force still follow their changes.
    new_ids: Arc<tokio::sync::Semaphore>,
    max_lookups: usize,
    /// How long a request may take to look its rule set up, from its arrival.
    lookup_timeout: Duration,
    /// At most one warning per period for the failed lookups served the rule set found last.
    failures: Arc<crate::failure::LogThrottle>,
}

/// Builds a [`CachingRuleSetProvider`].
#[derive(Debug)]
pub struct CachingRuleSetProviderBuilder<P> {
    inner: P,
    ttl: Duration,
    max_capacity: u64,
    max_lookups: usize,
    lookup_timeout: Duration,
}

/// A rule set could not be looked up in time: the request's lookup timeout passed while it
/// waited for one of the lookups a [`CachingRuleSetProvider`] allows at once, or in the
/// lookup it then made (a flood of ids that no entry holds, or a source that answers
/// slowly). The engine reports it as [`Error::Overloaded`](crate::Error::Overloaded), which
/// no failure policy admits.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "rule set `{rule_set}` not looked up within {timeout:?}: it waited for one of the rule source's {max_lookups} lookups at once"
)]
pub struct LookupsBusy {
    /// The rule set asked for, as a log line shows it.
    pub rule_set: String,
    /// The provider's bound on lookups at once.
    pub max_lookups: usize,
    /// The provider's lookup timeout, counted from the request's arrival.
    pub timeout: Duration,
}

impl<P: RuleSetProvider> CachingRuleSetProvider<P> {
    /// A builder: expire after write 60 s, at most 10,000 rule sets, at most 4 lookups of
    /// the source at once, each request looked up within 1 s of its arrival.
    pub fn builder(inner: P) -> CachingRuleSetProviderBuilder<P> {
        CachingRuleSetProviderBuilder {
            inner,
            ttl: Duration::from_secs(60),
            max_capacity: 10_000,
            max_lookups: 4,
            lookup_timeout: Duration::from_secs(1),
        }
    }

    /// Takes a ticket for an invalidation: the lookups of the inner provider that started
    /// before it cache nothing.
    fn outdate_running_lookups(&self) {
        self.invalidated
            .fetch_max(self.tickets.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
    }

    /// Forgets one rule set: the next lookup asks the inner provider. A lookup of the
    /// inner provider still running, made before the call, caches nothing.
    pub fn invalidate(&self, id: &str) {
        self.outdate_running_lookups();
        self.cache.invalidate(id);
    }

    /// Forgets every rule set, as [`invalidate`](Self::invalidate) does one.
    pub fn invalidate_all(&self) {
        self.outdate_running_lookups();
        self.cache.invalidate_all();
    }

    /// The inner provider.
    pub fn get_ref(&self) -> &P {
        &self.inner
    }
}

impl<P: RuleSetProvider> CachingRuleSetProviderBuilder<P> {
    /// How long an entry lives after it was loaded.
    pub fn time_to_live(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The most rule sets (found or not) kept.
    pub fn max_capacity(mut self, max: u64) -> Self {
        self.max_capacity = max;
        self
    }

    /// The most lookups of the inner provider at once (at least 1; default 4), one of them
    /// kept for ids found before when there are two or more. Keep it within what the source
    /// serves at once, such as its pool of connections: a lookup that fails because the
    /// source is saturated follows the failure policy for an id never found before, which
    /// may admit.
    pub fn max_lookups(mut self, max: usize) -> Self {
        self.max_lookups = max.clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
        self
    }

    /// How long a request may take to look its rule set up, counted from its arrival: its
    /// wait for a turn and its lookup of the inner provider together (default 1 s). Past it,
    /// a request whose time went in the queue fails with [`LookupsBusy`]; one that found a
    /// turn free fails as a failure of the source does. In a rate-limit service, keep it below its gateways' deadline: the
    /// service answers a request that was not looked up in time with a `503` its gateways
    /// refuse whatever their failure policy, while an answer later than their deadline is
    /// a failure their policy decides.
    ///
    /// Keep it above what the source takes to answer: a lookup that times out for an id
    /// never found before follows the failure policy, which may admit. A zero timeout is
    /// taken as 1 ms.
    pub fn lookup_timeout(mut self, timeout: Duration) -> Self {
        self.lookup_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Builds the provider.
    pub fn build(self) -> CachingRuleSetProvider<P> {
        CachingRuleSetProvider {
            inner: Arc::new(self.inner),
            cache: moka::sync::Cache::builder()
                .max_capacity(self.max_capacity)
                .time_to_live(self.ttl)
                .build(),
            tickets: Arc::new(AtomicU64::new(0)),
            invalidated: Arc::new(AtomicU64::new(0)),
            last: moka::sync::Cache::builder().max_capacity(self.max_capacity).build(),
            checks: Arc::new(Checks::default()),
            slots: Arc::new(tokio::sync::Semaphore::new(self.max_lookups)),
            new_ids: Arc::new(tokio::sync::Semaphore::new((self.max_lookups - 1).max(1))),
            max_lookups: self.max_lookups,
            lookup_timeout: self.lookup_timeout,
            failures: Arc::new(crate::failure::LogThrottle::new(crate::failure::LogThrottle::EVERY)),
        }
    }
}

impl<P: RuleSetProvider> RuleSetProvider for CachingRuleSetProvider<P> {
    fn rule_set(&self, id: &str) -> MaybeReady<RuleSetLookup> {
        if crate::rule::check_id(id).is_err() {
            // No rule set has such an id (every rule set's id is checked when it is made):
            // neither asked of the source nor cached. The id may come from the request (a
            // customizer reading a header), and each made-up one would otherwise be a
            // lookup of the source and an entry of its own, however long, up to
            // `max_capacity` of them.
            return MaybeReady::ready(Ok(None));
        }
        if let Some((_, hit)) = self.cache.get(id) {
            return MaybeReady::ready(Ok(hit));
        }
        let lookup = Lookup {
            inner: self.inner.clone(),
            key: Arc::from(id),
            cache: self.cache.clone(),
            last: self.last.clone(),
            checks: self.checks.clone(),
            tickets: self.tickets.clone(),
            invalidated: self.invalidated.clone(),
            timeout: self.lookup_timeout,
            max_lookups: self.max_lookups,
            failures: self.failures.clone(),
        };
        // The request's one deadline, from now: its wait for a turn and its lookup together.
        let deadline = tokio::time::Instant::now().checked_add(self.lookup_timeout);
        if let Some(set) = self.last.get(id) {
            // Found before: looked up again in any free turn (the one ids not found before
            // cannot all hold included), else served as found last, at once, rather than
            // queued behind a flood of made-up ids.
            return match self.slots.clone().try_acquire_owned() {
                Ok(turn) => lookup.run(vec![turn], deadline, false),
                Err(_) => MaybeReady::ready(Ok(Some(set))),
            };
        }
        // Not found before: a turn among those of such ids, then one of all.
        let (new_ids, slots) = (self.new_ids.clone(), self.slots.clone());
        if let Ok(first) = new_ids.clone().try_acquire_owned() {
            if let Ok(turn) = slots.clone().try_acquire_owned() {
                return lookup.run(vec![first, turn], deadline, false);
            }
        }
        // Every turn is taken: wait for one to end, then ask the cache again (the lookup
        // that ended may have been of this id).
        MaybeReady::boxed(async move {
            let turns = async {
                let first = new_ids.acquire_owned().await.ok()?;
                let turn = slots.acquire_owned().await.ok()?;
                Some(vec![first, turn])
            };
            let turns = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, turns).await.ok().flatten(),
                None => turns.await,
            };
            match turns {
                Some(turns) => match lookup.cache.get(&lookup.key) {
                    Some((_, hit)) => Ok(hit),
                    None => lookup.run(turns, deadline, true).await,
                },
                // Timed out (the semaphores are never closed): the rule set found last if
                // one was found meanwhile, else refused.
                None => match lookup.last.get(&lookup.key) {
                    Some(set) => Ok(Some(set)),
                    None => Err(Box::new(lookup.busy()) as BoxError),
                },
            }
        })
    }

    fn validate(&self, check: RuleCheck) -> Result<(), RuleError> {
        self.inner.validate(check.clone())?;
        for (_, (_, set)) in &self.cache {
            if let Some(set) = set {
                check(&set)?;
            }
        }
        // The rule sets a failed lookup would serve are held to the same check.
        for (_, set) in &self.last {
            check(&set)?;
        }
        // Rule sets loaded from now on are checked before they are cached.
        self.checks.push(&check);
        Ok(())
    }
}

/// One lookup of the inner provider for a request whose id no entry holds, made in its
/// turn (while it holds one of the provider's `max_lookups` turns).
struct Lookup<P> {
    inner: Arc<P>,
    key: Arc<str>,
    cache: moka::sync::Cache<Arc<str>, (u64, Option<Arc<RuleSet>>)>,
    last: moka::sync::Cache<Arc<str>, Arc<RuleSet>>,
    checks: Arc<Checks>,
    tickets: Arc<AtomicU64>,
    invalidated: Arc<AtomicU64>,
    timeout: Duration,
    max_lookups: usize,
    failures: Arc<crate::failure::LogThrottle>,
}

impl<P: RuleSetProvider> Lookup<P> {
    /// Asks the inner provider, holding `turn` until it answers or the request's
    /// `deadline` passes. Past the deadline, a request that `waited` for its turn fails with
    /// [`LookupsBusy`] (its time went in the queue, which requests can fill), one that did
    /// not as the source's failures do; either is served the rule set found last, if any.
    fn run(
        self,
        turn: Vec<tokio::sync::OwnedSemaphorePermit>,
        deadline: Option<tokio::time::Instant>,
        waited: bool,
    ) -> MaybeReady<RuleSetLookup> {
        let ticket = self.tickets.fetch_add(1, Ordering::SeqCst) + 1;
        match self.inner.rule_set(&self.key).into_ready() {
            Ok(result) => {
                drop(turn);
                MaybeReady::ready(self.answer(ticket, result))
            }
            Err(pending) => MaybeReady::boxed(async move {
                let answered = match deadline {
                    Some(deadline) => tokio::time::timeout_at(deadline, pending).await.ok(),
                    None => Some(pending.await),
                };
                drop(turn);
                let result = match answered {
                    Some(result) => result,
                    None if waited => Err(Box::new(self.busy()) as BoxError),
                    None => Err(format!("the rule source did not answer within {:?}", self.timeout).into()),
                };
                self.answer(ticket, result)
            }),
        }
    }

    /// The error of a request whose time went waiting for a turn.
    fn busy(&self) -> LookupsBusy {
        LookupsBusy {
            rule_set: crate::error::Shown(&self.key).to_string(),
            max_lookups: self.max_lookups,
            timeout: self.timeout,
        }
    }

    /// Caches the answer of the lookup with `ticket` unless an invalidation, or a lookup
    /// that started later, came first: an answer read before a change (a rule set not
    /// created yet) must not be served after it until the entry expires. The rule set found
    /// last follows in the same step (under the entry's lock), so that it is always the
    /// answer cached last: two lookups that end together cannot leave the older one's.
    fn keep(&self, ticket: u64, found: Option<Arc<RuleSet>>) {
        self.cache.entry(self.key.clone()).and_compute_with(|entry| {
            let newer = entry.is_some_and(|entry| entry.value().0 > ticket);
            if newer || self.invalidated.load(Ordering::SeqCst) > ticket {
                return moka::ops::compute::Op::Nop;
            }
            match &found {
                Some(set) => self.last.insert(self.key.clone(), set.clone()),
                None => self.last.invalidate(&self.key),
            }
            moka::ops::compute::Op::Put((ticket, found))
        });
    }

    /// The request's answer from the inner provider's.
    fn answer(&self, ticket: u64, result: RuleSetLookup) -> RuleSetLookup {
        let found = match result {
            Ok(found) => found,
            Err(error) => {
                return match self.last.get(&self.key) {
                    Some(set) => {
                        // Not cached: the next request that finds a turn free asks the source
                        // again, so that the rule set follows its changes once it answers
                        // (the requests that find none are served the rule set found last
                        // at once, and the turns bound what the source is asked meanwhile).
                        if let Some(held_back) = self.failures.due() {
                            tracing::warn!(
                                rule_set = %self.key, %error, held_back,
                                "rule source failed: the rule set found last stays in force (warned again in {}s at the earliest)",
                                crate::failure::LogThrottle::EVERY.as_secs()
                            );
                        } else {
                            tracing::debug!(rule_set = %self.key, %error, "rule source failed: the rule set found last stays in force");
                        }
                        Ok(Some(set))
                    }
                    None => Err(error),
                };
            }
        };
        if let Some(set) = &found {
            if let Err(error) = self.checks.run(set) {
                tracing::error!(%error, "rule set refused: the rate-limit backend cannot decide it");
                return Err(error.into());
            }
        }
        self.keep(ticket, found.clone());
        Ok(found)
    }
}

impl<P: fmt::Debug> fmt::Debug for CachingRuleSetProvider<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachingRuleSetProvider")
            .field("inner", &self.inner)
            .field("entries", &self.cache.entry_count())
            .finish()
    }
}
