//! Local leases: a rule's `lease: { max, ttl }` (see [`Lease`]).
//!
//! An instance takes up to `max` permits of a key from the shared bucket in one backend
//! call, spends them with no further call, and gives back what it has not spent when the
//! lease expires, when the rule changes, and at shutdown. The permits are consumed in the
//! backend when they are taken, so no more requests are admitted than the bucket granted
//! (each counted from when its lease was taken, at most `ttl` earlier): what a lease costs
//! is under-admission, permits sitting in one instance while another is refused.
//!
//! How many permits a call takes adapts: the request's own cost, plus at most `max` less
//! that cost, and after the first call never more than half of what the bucket held at the
//! last one, so that the last permits of a bucket go one request per call. A call that
//! asked for more than its request and was refused only for that is made again for the
//! request alone.
//!
//! One call at a time takes a lease for a rule and key: the requests that find the lease
//! spent while that call is out wait for it and spend from the lease it brings, rather
//! than each taking one of their own.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::SystemTime;

use smallvec::SmallVec;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::decision::{BandReport, Bands};
use crate::error::BoxError;
use crate::future::MaybeReady;
use crate::key::TypedKey;
use crate::limiter::{AcquireOutcome, AcquireRequest, Bucket, RateLimiter, Wait};
use crate::name::Name;
use crate::rule::{Algorithm, Band, Lease, Rule, RuleSet};
use crate::text::Text;

const SHARDS: usize = 16;

/// The most leases an engine holds, over all rules and keys: past that (a leased rule
/// keyed by many values), a key without a lease is decided one request at a time.
const MAX_LEASES: usize = 65_536;

/// The leases of one engine: per rule and key, the permits this instance holds.
#[derive(Clone)]
pub(crate) struct Leases {
    shared: Arc<Shared>,
}

struct Shared {
    limiter: Arc<dyn RateLimiter>,
    shards: Box<[Mutex<Shard>]>,
    hasher: std::collections::hash_map::RandomState,
    /// Whether a task gives back the leases that expire.
    sweeping: AtomicBool,
    /// When that task next looks, and how to wake it sooner for a lease that expires first.
    next_sweep: Mutex<Option<Instant>>,
    wake: Arc<tokio::sync::Notify>,
    /// The number given to the next lease taken.
    next_id: AtomicU64,
    /// The generation of each rule set's counters in force, or about to be
    /// ([`LeaseWatch::rules_changed`]): a lease of another one is never kept, spent or given
    /// back. A rule set not named here is taken as current.
    generations: Mutex<HashMap<Name, u64>>,
}

#[derive(Default)]
struct Shard {
    held: HashMap<LeaseKey, Held>,
    /// The rules and keys for which a call taking a lease is out: the requests that find
    /// the lease spent wait for it, told at its end whether it left a lease.
    taking: HashMap<LeaseKey, watch::Sender<bool>>,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct LeaseKey {
    set: Name,
    rule: Name,
    key: Text,
    /// The key's typed value, which the in-memory limiter keys the bucket by: the calls and
    /// give-backs of the lease count in the bucket of the engine's requests.
    typed: TypedKey,
}

impl LeaseKey {
    fn of(bucket: &Bucket<'_>) -> Self {
        Self {
            set: bucket.rule_set.id().clone(),
            rule: bucket.rule.id().clone(),
            key: bucket.key.clone(),
            typed: bucket.typed,
        }
    }
}

/// The permits held for one rule and key.
struct Held {
    /// Which lease this is: a spend made back is made back only to the lease it came from.
    id: u64,
    /// The rule set the lease was taken with and the rule's index: what giving back needs.
    set: Arc<RuleSet>,
    rule: usize,
    /// What identifies the rule's counters and cost, to notice a changed rule.
    bands: Arc<[Band]>,
    permits: u64,
    lease: Lease,
    /// Permits taken and not spent.
    left: u64,
    /// Permits spent by requests whose call for their other rules is out: they come back
    /// into the lease if that call refuses them, so a call adding to the lease counts them
    /// against `max` (see [`Shared::hold`]).
    out: u64,
    /// What the backend recorded of each band's state after the last call that added to
    /// the lease ([`AcquireOutcome::marks`]; empty when it recorded none), and the permits
    /// that call took beyond its request: see [`Held::into_give_back`].
    marks: Vec<u128>,
    last_extra: u64,
    /// The backend's clock when the permits were taken.
    decided_unix_nanos: u64,
    expires: Instant,
    /// Each band's report at the call, its remaining permits those the bucket kept
    /// (without the lease's).
    reports: SmallVec<[BandReport; 2]>,
    /// When that call started, on the monotonic clock: the reports' times until each band
    /// is full count down from it, whatever the host's wall clock says of the backend's
    /// reset instants.
    reported: Instant,
}

impl Held {
    /// Whether the lease was taken for `rule` as it is now.
    fn is_for(&self, rule: &Rule) -> bool {
        (Arc::ptr_eq(&self.bands, rule.bands()) || *self.bands == **rule.bands())
            && self.permits == rule.permits()
            && Some(self.lease) == rule.lease()
    }

    /// Whether the lease was taken under `set`'s generation of its counters: a bucket
    /// reset ([`ReloadingRuleSetProvider::reset_buckets`](crate::ReloadingRuleSetProvider::reset_buckets))
    /// raises it.
    fn is_of(&self, set: &RuleSet) -> bool {
        self.set.generation() == set.generation()
    }

    /// The bucket's least remaining permits at the call, the lease's not counted.
    fn shared_remaining(&self) -> u64 {
        self.reports.iter().map(|r| r.remaining).min().unwrap_or(0)
    }

    /// The reports of a request admitted from the lease, as of now: each band's remaining
    /// permits are the bucket's at the call plus what the lease still holds; its reset
    /// instant the backend's, the time until it counted down since the call.
    fn reports_now(&self, now: Instant) -> impl Iterator<Item = BandReport> + '_ {
        let since = now.saturating_duration_since(self.reported);
        self.reports.iter().map(move |r| {
            let mut r = r.clone();
            r.remaining = r.remaining.saturating_add(self.left).min(r.limit);
            r.reset_after = r.reset_after.saturating_sub(since);
            r.allowed = true;
            r.wait = Wait::None;
            r
        })
    }

    /// What goes back of the lease: see [`GiveBack::of`]; the lease's own permits are at
    /// most what its last call took beyond its request.
    fn into_give_back(self, key: LeaseKey) -> Option<GiveBack> {
        GiveBack::of(
            self.set,
            self.rule,
            key,
            self.left.min(self.last_extra),
            self.left,
            self.decided_unix_nanos,
            self.marks,
        )
    }
}

/// Gives back the leases of rules that change; holds the leases weakly.
pub(crate) struct LeaseWatch(Weak<Shared>);

impl LeaseWatch {
    /// Gives back the leases of rules of `set`'s id that `set` changes or removes: called
    /// when a rule set is about to be swapped in. The leases taken under another
    /// generation of it (a bucket reset since, or before) end without going back: their
    /// permits were counted in counters a reset deletes, and a window's given back into
    /// the fresh count would free permits taken after the reset.
    pub(crate) fn rules_changed(&self, set: &RuleSet) {
        let Some(shared) = self.0.upgrade() else {
            return;
        };
        // First the generation, then the leases: a call out now stores no lease of the
        // previous generation after this (`Shared::hold` reads it under its shard's lock).
        lock(&shared.generations).insert(set.id().clone(), set.generation());
        drop(shared.take(|key, held| key.set == *set.id() && !held.is_of(set)));
        let stale = shared.take(|key, held| {
            key.set == *set.id()
                && !set
                    .rules()
                    .iter()
                    .any(|rule| *rule.id() == key.rule && held.is_for(rule))
        });
        shared.give_back_later(stale);
    }
}

/// Unspent permits on their way back to the backend.
struct GiveBack {
    set: Arc<RuleSet>,
    rule: usize,
    key: Text,
    typed: TypedKey,
    left: u64,
    decided_unix_nanos: u64,
    /// The state the bucket must still hold for them to go back (see
    /// [`Held::into_give_back`]); empty: whatever it holds.
    marks: Vec<u128>,
}

impl GiveBack {
    /// What goes back of `left` permits of rule `rule` of `set` for `key`, taken by a call
    /// decided at `decided_unix_nanos` that left `marks` (see
    /// [`AcquireOutcome::marks`]), of which `own` are the last that call took. A token or
    /// leaky bucket keeps one instant, not a list of whose permits lie where: moving it back
    /// frees the last permits taken, so they go back only while they are the lease's own:
    /// at most `own`, and only while the bucket holds the state the call left (the backend
    /// compares the marks). Without marks (none, or none for a band), such a bucket's
    /// permits stay taken, and pass unused. A window's count is a count: its permits go back
    /// whoever took permits since, at the instant of the last call. A fixed window's lease
    /// holds permits of one window only (it ends with the window it was taken in), so all
    /// of them go back; a sliding window counter's or log's may hold permits of earlier
    /// calls, counted in an earlier window or at an earlier instant, and only `own`, those
    /// the last call took, go back there: taking the others off that window's count would
    /// free permits admitted in it. A window's permits go back at the instant its marks
    /// record for its call, where the backend records one (see [`AcquireOutcome::marks`]):
    /// a request decided in parts at several instants (a Redis Cluster's hash slots) has
    /// the latest as its own, which may lie in the next window.
    #[allow(clippy::too_many_arguments)]
    fn of(
        set: Arc<RuleSet>,
        rule: usize,
        key: LeaseKey,
        own: u64,
        left: u64,
        decided_unix_nanos: u64,
        marks: Vec<u128>,
    ) -> Option<Self> {
        let algorithm = set.rules().get(rule).map(Rule::algorithm);
        let instant = algorithm.is_some_and(Algorithm::keeps_an_instant);
        let decided_unix_nanos = if instant {
            decided_unix_nanos
        } else {
            let mut taken = marks.iter().copied().filter(|&mark| mark != 0);
            match taken.next() {
                None => decided_unix_nanos,
                // In µs; instants that disagree name no window: nothing goes back.
                Some(first) if taken.all(|mark| mark == first) => u64::try_from(first).ok()?.checked_mul(1_000)?,
                Some(_) => return None,
            }
        };
        let marked = !marks.is_empty() && marks.iter().all(|&mark| mark != 0);
        let left = match (algorithm, instant, marked) {
            (Some(Algorithm::FixedWindow), _, _) => left,
            (_, false, _) => own,
            (_, true, false) => 0,
            (_, true, true) => own,
        };
        (left > 0).then_some(Self {
            set,
            rule,
            key: key.key,
            typed: key.typed,
            left,
            decided_unix_nanos,
            marks: if instant { marks } else { Vec::new() },
        })
    }
}

/// What a call took for a lease: the permits beyond its request, when the backend decided,
/// each band's report and what the backend recorded of each band's state.
struct Took {
    extra: u64,
    decided_unix_nanos: u64,
    reports: SmallVec<[BandReport; 2]>,
    marks: Vec<u128>,
}

/// What a request does with each of its buckets.
#[derive(Clone)]
enum Plan {
    /// Admitted from the lease with this id (given back to it should the request fail),
    /// with its bands' figures just after the spend.
    Spent(u64, Bands),
    /// Decided by the backend, taking this many permits more than the request's.
    Call { extra: u64 },
}

/// What a request does next.
enum Planned {
    /// Admitted from its leases alone.
    Local(SmallVec<[Plan; 4]>),
    /// A backend call, started at the instant given, taking the leases it holds back the
    /// other requests for; the request's spends are out until the call settles them.
    Call(
        SmallVec<[Plan; 4]>,
        SmallVec<[Taking; 1]>,
        Instant,
        Option<Box<OutSpends>>,
    ),
    /// Wait for another request's call taking a lease this request needs, then plan again.
    Wait(watch::Receiver<bool>),
}

/// The call taking a lease for a rule and key (one at a time): while it is out, the key's
/// requests that find the lease spent wait for it. Dropped, it lets them go.
struct Taking {
    shared: Arc<Shared>,
    key: LeaseKey,
    /// Whether the call left a lease for the waiting requests to spend.
    stored: bool,
}

impl Taking {
    /// Marks the call taking `key`'s lease as out, in `taking` (its shard's).
    fn start(shared: &Arc<Shared>, taking: &mut HashMap<LeaseKey, watch::Sender<bool>>, key: LeaseKey) -> Self {
        taking.insert(key.clone(), watch::channel(false).0);
        Self {
            shared: shared.clone(),
            key,
            stored: false,
        }
    }
}

impl Drop for Taking {
    fn drop(&mut self) {
        let ended = lock(self.shared.shard(&self.key)).taking.remove(&self.key);
        // Tells the waiting requests whether a lease came of the call.
        if let Some(ended) = ended {
            ended.send_replace(self.stored);
        }
    }
}

/// The spends of a request whose call is out ([`Held::out`]), settled by the call's
/// answer: admitted, they are no longer out ([`admitted`](Self::admitted)); refused or
/// failed, or never settled (the request's future dropped before its call started, the
/// call panicked), they are made back into their leases when the guard is dropped, as a
/// request that was not admitted. Left out, they stayed out until their lease expired, and
/// every call adding to the lease meanwhile was held to `max` less them.
struct OutSpends {
    shared: Arc<Shared>,
    /// Each spend's lease key, lease id and permits.
    spends: SmallVec<[(LeaseKey, u64, u64); 1]>,
}

impl OutSpends {
    /// The guard of `request`'s spends among `plans`; none when it spent nothing.
    fn new(shared: &Arc<Shared>, request: &AcquireRequest, plans: &[Plan]) -> Option<Box<Self>> {
        let spends: SmallVec<[(LeaseKey, u64, u64); 1]> = request
            .buckets()
            .zip(plans)
            .filter_map(|(bucket, plan)| match *plan {
                Plan::Spent(id, _) => Some((LeaseKey::of(&bucket), id, bucket.permits)),
                Plan::Call { .. } => None,
            })
            .collect();
        (!spends.is_empty()).then(|| {
            Box::new(Self {
                shared: shared.clone(),
                spends,
            })
        })
    }

    /// The call admitted the request: its spends stand, and are no longer out.
    fn admitted(&mut self) {
        self.settle(|_, _| {});
    }

    /// Takes each spend out of [`Held::out`] (if its lease is still held), applying `more`.
    fn settle(&mut self, mut more: impl FnMut(&mut Held, u64)) {
        for (key, id, permits) in self.spends.drain(..) {
            if let Some(held) = lock(self.shared.shard(&key)).held.get_mut(&key).filter(|h| h.id == id) {
                held.out = held.out.saturating_sub(permits);
                more(held, permits);
            }
        }
    }
}

impl Drop for OutSpends {
    fn drop(&mut self) {
        self.settle(|held, permits| held.left += permits);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Leases {
    pub(crate) fn new(limiter: Arc<dyn RateLimiter>) -> Self {
        Self {
            shared: Arc::new(Shared {
                limiter,
                shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
                hasher: std::collections::hash_map::RandomState::new(),
                sweeping: AtomicBool::new(false),
                next_sweep: Mutex::new(None),
                wake: Arc::default(),
                next_id: AtomicU64::new(1),
                generations: Mutex::default(),
            }),
        }
    }

    /// A weak handle, for the engine's rule check (which the provider keeps).
    pub(crate) fn watch(&self) -> LeaseWatch {
        LeaseWatch(Arc::downgrade(&self.shared))
    }

    /// Decides `request`, some of whose rules have leases.
    pub(crate) fn acquire(&self, request: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        let shared = &self.shared;
        match shared.try_plan(request, true) {
            Planned::Local(plans) => MaybeReady::ready(Ok(Shared::local_outcome(request, plans))),
            planned => {
                let shared = shared.clone();
                let request = request.clone();
                MaybeReady::boxed(async move { shared.settle(request, planned).await })
            }
        }
    }

    /// Gives back every lease this instance holds; returns the permits given back.
    ///
    /// # Errors
    ///
    /// The first backend failure; the other leases are given back all the same.
    pub(crate) async fn release_all(&self) -> Result<u64, BoxError> {
        let all = self.shared.take(|_, _| true);
        give_back_all(&self.shared.limiter, all).await
    }
}

impl Shared {
    fn shard(&self, key: &LeaseKey) -> &Mutex<Shard> {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }

    /// Whether `set` is of the generation of its counters in force (see `generations`).
    fn is_current(&self, set: &RuleSet) -> bool {
        lock(&self.generations)
            .get(set.id())
            .is_none_or(|&generation| generation == set.generation())
    }

    /// Plans every bucket of `request`; a request that must wait spends nothing. A request
    /// that is not `patient` (it waited for a call that left no lease) neither waits nor
    /// takes a lease: it makes its own call.
    fn try_plan(self: &Arc<Self>, request: &AcquireRequest, patient: bool) -> Planned {
        let now = Instant::now();
        let mut plans: SmallVec<[Plan; 4]> = SmallVec::new();
        let mut taking = SmallVec::new();
        let mut stale = Vec::new();
        let mut wait = None;
        // A request with a rule that has no lease makes a call whatever its leases hold: its
        // spends are out until that call ends (see `Held::out`).
        let out = request.buckets().any(|b| b.rule.lease().is_none() || b.shadow());
        for bucket in request.buckets() {
            match self.plan(&bucket, patient, out, &mut stale, &mut taking) {
                Ok(plan) => plans.push(plan),
                Err(receiver) => {
                    wait = Some(receiver);
                    break;
                }
            }
        }
        self.give_back_later(stale);
        if let Some(receiver) = wait {
            self.unspend(request, &plans, out);
            drop(taking);
            return Planned::Wait(receiver);
        }
        if plans.iter().all(|p| matches!(p, Plan::Spent(..))) {
            return Planned::Local(plans);
        }
        if !out {
            // Leases spent before another lease's bucket turned out to need a call.
            self.mark_out(request, &plans);
        }
        let out = OutSpends::new(self, request, &plans);
        Planned::Call(plans, taking, now, out)
    }

    /// What to do with `bucket`: spend from its lease, or ask the backend (for how many),
    /// or (`Err`) wait for the call taking its lease.
    fn plan(
        self: &Arc<Self>,
        bucket: &Bucket<'_>,
        patient: bool,
        out: bool,
        stale: &mut Vec<GiveBack>,
        taking: &mut SmallVec<[Taking; 1]>,
    ) -> Result<Plan, watch::Receiver<bool>> {
        let Some(lease) = bucket.rule.lease().filter(|_| !bucket.shadow()) else {
            return Ok(Plan::Call { extra: 0 });
        };
        let cost = bucket.permits;
        let most = lease.max().saturating_sub(cost);
        let key = LeaseKey::of(bucket);
        let mut guard = lock(self.shard(&key));
        let shard = &mut *guard;
        // Read under the lock: a lease is never spent past its expiry.
        let now = Instant::now();
        let room = shard.held.len() < MAX_LEASES / SHARDS;
        let extra = match shard.held.get_mut(&key) {
            // A new lease, while the engine holds fewer than its most.
            None if room => most,
            None => 0,
            Some(held) if !held.is_of(bucket.rule_set) => {
                if !self.is_current(bucket.rule_set) {
                    // The request is of the generation before a reset (it took its rule set
                    // before the swap): decided alone, the lease of the new one left alone.
                    return Ok(Plan::Call { extra: 0 });
                }
                // Taken under another generation of the counters (a bucket reset between):
                // ended, not given back (see `LeaseWatch::rules_changed`).
                shard.held.remove(&key);
                most
            }
            Some(held) if held.is_for(bucket.rule) && now < held.expires => {
                if held.left >= cost {
                    held.left -= cost;
                    if out {
                        held.out += cost;
                    }
                    let mut reports = Bands::with_capacity(held.reports.len());
                    reports.extend(held.reports_now(now));
                    return Ok(Plan::Spent(held.id, reports));
                }
                // Too few permits left: a new lease, no larger than half the bucket as it was,
                // nor than what leaves room for the permits that may come back.
                most.min(held.shared_remaining() / 2)
                    .min(lease.max().saturating_sub(held.left + held.out))
            }
            Some(_) => {
                // Expired, or taken for the rule as it was.
                if let Some(old) = shard.held.remove(&key) {
                    stale.extend(old.into_give_back(key.clone()));
                }
                most
            }
        };
        if extra == 0 || !patient {
            // Nothing to share, or no lease came of the last call: a call of its own.
            return Ok(Plan::Call { extra: 0 });
        }
        if let Some(ended) = shard.taking.get(&key) {
            return Err(ended.subscribe());
        }
        let started = Taking::start(self, &mut shard.taking, key);
        drop(guard);
        taking.push(started);
        Ok(Plan::Call { extra })
    }

    /// Decides a request that could not be admitted from its leases at once.
    async fn settle(
        self: Arc<Self>,
        request: AcquireRequest,
        mut planned: Planned,
    ) -> Result<AcquireOutcome, BoxError> {
        loop {
            match planned {
                Planned::Local(plans) => return Ok(Shared::local_outcome(&request, plans)),
                Planned::Call(plans, taking, now, out) => {
                    // On a task of its own: once the call has gone out, the lease it takes
                    // is kept (or the spends put back) whether or not this request is still
                    // awaited.
                    let call = tokio::spawn(self.decide(request, plans, taking, now, out));
                    return match call.await {
                        Ok(result) => result,
                        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
                        Err(error) => Err(error.into()),
                    };
                }
                Planned::Wait(mut receiver) => {
                    // Ends when the call is over. If it left no lease (refused for another
                    // rule, or failed), this request makes its own call rather than wait
                    // for the next one.
                    let stored = receiver.changed().await.is_ok() && *receiver.borrow();
                    planned = self.try_plan(&request, stored);
                }
            }
        }
    }

    /// The outcome of a request admitted from its leases alone.
    fn local_outcome(request: &AcquireRequest, plans: SmallVec<[Plan; 4]>) -> AcquireOutcome {
        let mut bands = Bands::with_capacity(request.band_count());
        for plan in plans {
            if let Plan::Spent(_, reports) = plan {
                bands.extend(reports);
            }
        }
        AcquireOutcome::new(true, true, unix_nanos(SystemTime::now()), bands).answered_locally()
    }

    /// Decides the buckets the leases did not admit in the backend, takes the new leases,
    /// and merges the figures.
    async fn decide(
        self: Arc<Self>,
        request: AcquireRequest,
        plans: SmallVec<[Plan; 4]>,
        mut taking: SmallVec<[Taking; 1]>,
        now: Instant,
        out: Option<Box<OutSpends>>,
    ) -> Result<AcquireOutcome, BoxError> {
        let mut asked = plans.clone();
        let mut result = self.limiter.acquire(&self.call(&request, &asked)).await;
        if let Ok(outcome) = &result {
            if !outcome.allowed && refused_for_the_lease(&request, &asked, outcome) {
                for plan in &mut asked {
                    if let Plan::Call { extra } = plan {
                        *extra = 0;
                    }
                }
                result = self.limiter.acquire(&self.call(&request, &asked)).await;
            }
        }
        // Refused or failed, the request's spends go back into their leases (`out` dropped).
        let outcome = result?;
        if let Some(mut out) = out {
            if outcome.allowed {
                out.admitted();
            }
        }
        let mut called = outcome.bands.iter();
        // Where the bucket's bands begin among the call's, for their marks.
        let mut band_at = 0;
        let mut bands = Bands::with_capacity(request.band_count());
        let mut taken = Vec::new();
        for (index, (bucket, plan)) in request.buckets().zip(&asked).enumerate() {
            let count = bucket.rule.bands().len();
            match *plan {
                Plan::Spent(_, ref reports) => bands.extend(reports.iter().map(|r| {
                    let mut r = r.clone();
                    if !outcome.allowed {
                        // Refused: the lease holds this request's permits again (`unspend`).
                        r.remaining = r.remaining.saturating_add(bucket.permits).min(r.limit);
                    }
                    r
                })),
                Plan::Call { extra } => {
                    let reports: SmallVec<[BandReport; 2]> = called.by_ref().take(count).cloned().collect();
                    let marks = outcome.marks.get(band_at..band_at + count).unwrap_or_default().to_vec();
                    band_at += count;
                    let leased = bucket.rule.lease().filter(|_| !bucket.shadow());
                    match leased {
                        Some(lease) if outcome.allowed => {
                            bands.extend(reports.iter().map(|r| {
                                let mut r = r.clone();
                                r.remaining = r.remaining.saturating_add(extra).min(r.limit);
                                r
                            }));
                            let took = Took {
                                extra,
                                decided_unix_nanos: outcome.now_unix_nanos,
                                reports,
                                marks,
                            };
                            taken.push((index, lease, took));
                        }
                        _ => bands.extend(reports),
                    }
                }
            }
        }
        for (index, lease, took) in taken {
            if let Some(bucket) = request.bucket(index) {
                let extra = took.extra;
                self.hold(&request, index, &bucket, lease, took, now);
                let key = LeaseKey::of(&bucket);
                for call in taking.iter_mut().filter(|t| t.key == key) {
                    call.stored = extra > 0;
                }
            }
        }
        // The new leases are in: the requests waiting for them may go.
        drop(taking);
        let mut merged = AcquireOutcome::new(outcome.allowed, outcome.shadow_allowed, outcome.now_unix_nanos, bands);
        merged.local = outcome.local;
        Ok(merged)
    }

    /// The backend's part of a request: the buckets not admitted from a lease, each
    /// taking its request's permits and the extra its plan asks.
    fn call(&self, request: &AcquireRequest, plans: &[Plan]) -> AcquireRequest {
        let mut call = AcquireRequest::new(request.rule_set().clone());
        for (index, (bucket, plan)) in request.buckets().zip(plans).enumerate() {
            if let (Plan::Call { extra }, Some(rule)) = (plan, request.rule_index(index)) {
                call.push_typed(
                    rule,
                    bucket.key.clone(),
                    bucket.typed,
                    bucket.permits.saturating_add(*extra),
                );
                if bucket.rule.lease().is_some() && !bucket.shadow() {
                    // What giving the lease back checks (see `Held::into_give_back`), for a
                    // call that takes a lease or adds to one.
                    call.mark_places();
                }
            }
        }
        call
    }

    /// Keeps the permits a call took beyond its request as the lease of `bucket`: added to
    /// the lease in force, or a new lease in place of one that has expired.
    fn hold(
        self: &Arc<Self>,
        request: &AcquireRequest,
        index: usize,
        bucket: &Bucket<'_>,
        lease: Lease,
        took: Took,
        now: Instant,
    ) {
        let Took {
            extra,
            decided_unix_nanos,
            reports,
            marks,
        } = took;
        let Some(rule) = request.rule_index(index) else {
            return;
        };
        let key = LeaseKey::of(bucket);
        let expires = expiry(bucket.rule, lease, now, &reports);
        let mut shard = lock(self.shard(&key));
        if !self.is_current(request.rule_set()) {
            // A call out at a bucket reset: its permits were counted in the counters the
            // reset deletes (or were counted afresh after it). Neither kept nor given back,
            // they end with the old generation (see `LeaseWatch::rules_changed`).
            return;
        }
        if let Some(held) = shard.held.get_mut(&key) {
            if held.is_for(bucket.rule) && held.is_of(request.rule_set()) && Instant::now() < held.expires {
                // Added to the lease in force, which keeps its expiry: no permit is spent
                // later than `ttl` after it was taken. A window that has ended has expired
                // its lease, so a fixed window's permits never reach the next window. The
                // lease holds at most `max` (refused requests may have put permits back
                // meanwhile, and those out may yet): what is over goes back.
                let kept = extra.min(lease.max().saturating_sub(held.left + held.out));
                held.left += kept;
                held.decided_unix_nanos = decided_unix_nanos;
                held.reports = reports;
                held.reported = now;
                held.expires = held.expires.min(expires);
                // What is over goes back now, from the last permits taken; after it, a
                // token or leaky bucket no longer holds the state the call left, and the
                // lease keeps no marks (its bucket's permits then stay taken, see
                // `into_give_back`). A window's marks, its call's instant, stay.
                let over = extra - kept;
                let instant = bucket.rule.algorithm().keeps_an_instant();
                held.marks = if over > 0 && instant { Vec::new() } else { marks.clone() };
                held.last_extra = kept;
                let over = GiveBack::of(
                    request.rule_set().clone(),
                    rule,
                    key.clone(),
                    over,
                    over,
                    decided_unix_nanos,
                    marks,
                );
                drop(shard);
                if let Some(over) = over {
                    self.give_back_later(vec![over]);
                }
                self.wake_sweep(expires);
                return;
            }
        }
        let held = Held {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            set: request.rule_set().clone(),
            rule,
            bands: bucket.rule.bands().clone(),
            permits: bucket.rule.permits(),
            lease,
            left: extra,
            out: 0,
            marks,
            last_extra: extra,
            decided_unix_nanos,
            expires,
            reports,
            reported: now,
        };
        let old = shard.held.insert(key.clone(), held);
        drop(shard);
        // A lease of another generation of the counters ends without going back.
        let old = old.filter(|old| old.is_of(request.rule_set()));
        self.give_back_later(old.and_then(|old| old.into_give_back(key)).into_iter().collect());
        self.sweep_later();
        self.wake_sweep(expires);
    }

    /// Wakes the expiry task if a lease expiring at `expires` is due before it next looks.
    fn wake_sweep(&self, expires: Instant) {
        // `None`: the task is between two looks (or about to start), and looks again.
        let due_sooner = lock(&self.next_sweep).is_none_or(|next| expires < next);
        if due_sooner {
            self.wake.notify_one();
        }
    }

    /// Makes back the spends of a request that was not admitted after all; `out`: they
    /// were counted as out ([`Held::out`]).
    fn unspend(&self, request: &AcquireRequest, plans: &[Plan], out: bool) {
        self.each_spend(request, plans, |held, permits| {
            held.left += permits;
            if out {
                held.out = held.out.saturating_sub(permits);
            }
        });
    }

    /// Counts the spends of a request that makes a call as out ([`Held::out`]).
    fn mark_out(&self, request: &AcquireRequest, plans: &[Plan]) {
        self.each_spend(request, plans, |held, permits| held.out += permits);
    }

    /// Applies `change` to the lease each spend of `request` came from, with its permits,
    /// if that lease is still held.
    fn each_spend(&self, request: &AcquireRequest, plans: &[Plan], mut change: impl FnMut(&mut Held, u64)) {
        for (bucket, plan) in request.buckets().zip(plans) {
            if let Plan::Spent(id, _) = *plan {
                let key = LeaseKey::of(&bucket);
                if let Some(held) = lock(self.shard(&key)).held.get_mut(&key).filter(|h| h.id == id) {
                    change(held, bucket.permits);
                }
            }
        }
    }

    /// Takes out the leases `which` names; those of a generation no longer in force end
    /// without going back (see [`LeaseWatch::rules_changed`]).
    fn take(&self, mut which: impl FnMut(&LeaseKey, &Held) -> bool) -> Vec<GiveBack> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            let keys: Vec<LeaseKey> = shard
                .held
                .iter()
                .filter(|(k, h)| which(k, h))
                .map(|(k, _)| k.clone())
                .collect();
            for key in keys {
                if let Some(held) = shard.held.remove(&key) {
                    if self.is_current(&held.set) {
                        out.extend(held.into_give_back(key));
                    }
                }
            }
        }
        out
    }

    /// Gives `leases` back on the runtime, without waiting.
    fn give_back_later(&self, leases: Vec<GiveBack>) {
        if leases.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                leases = leases.len(),
                "no runtime to give leases back on: their permits stay consumed"
            );
            return;
        };
        let limiter = self.limiter.clone();
        runtime.spawn(async move {
            let _ = give_back_all(&limiter, leases).await;
        });
    }

    /// Starts the task that gives back expired leases, unless it runs.
    fn sweep_later(self: &Arc<Self>) {
        if self.sweeping.swap(true, Ordering::AcqRel) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(sweep(Arc::downgrade(self)));
            }
            Err(_) => self.sweeping.store(false, Ordering::Release),
        }
    }

    /// Takes out the expired leases; returns them and when the next one expires.
    fn expired(&self, now: Instant) -> (Vec<GiveBack>, Option<Instant>) {
        let expired = self.take(|_, held| held.expires <= now);
        let next = self
            .shards
            .iter()
            .filter_map(|shard| lock(shard).held.values().map(|h| h.expires).min())
            .min();
        (expired, next)
    }
}

/// Gives back expired leases as they expire, while there are leases; ends with the engine.
/// It holds the engine's leases (and limiter) only while it works, not while it sleeps.
async fn sweep(weak: Weak<Shared>) {
    loop {
        let Some(shared) = weak.upgrade() else {
            return;
        };
        // While it looks, a lease taken wakes it again (`wake_sweep`): none is missed.
        *lock(&shared.next_sweep) = None;
        let (expired, next) = shared.expired(Instant::now());
        *lock(&shared.next_sweep) = next;
        let (limiter, wake) = (shared.limiter.clone(), shared.wake.clone());
        let again = match next {
            Some(_) => true,
            None => {
                shared.sweeping.store(false, Ordering::Release);
                // A lease taken since, whose taker saw the task running, needs it again.
                shared.shards.iter().any(|s| !lock(s).held.is_empty()) && !shared.sweeping.swap(true, Ordering::AcqRel)
            }
        };
        drop(shared);
        let _ = give_back_all(&limiter, expired).await;
        drop(limiter);
        match next {
            // Until the next lease expires, or one that expires sooner is taken.
            Some(next) => {
                let _ = tokio::time::timeout_at(next, wake.notified()).await;
            }
            None if again => {}
            None => return,
        }
    }
}

/// The give-back calls out at once for one batch of leases.
const GIVING_BACK_AT_ONCE: usize = 16;

/// Gives `leases` back, each in a call of its own, [`GIVING_BACK_AT_ONCE`] at a time;
/// returns the permits given back.
///
/// # Errors
///
/// The first failure, after trying every lease.
async fn give_back_all(limiter: &Arc<dyn RateLimiter>, leases: Vec<GiveBack>) -> Result<u64, BoxError> {
    let mut first_error = None;
    let mut given = 0;
    let mut leases = leases.into_iter();
    let mut calls = tokio::task::JoinSet::new();
    loop {
        while calls.len() < GIVING_BACK_AT_ONCE {
            let Some(lease) = leases.next() else {
                break;
            };
            let mut request = AcquireRequest::new(lease.set);
            request.push_typed(lease.rule, lease.key, lease.typed, lease.left);
            let call = if lease.marks.is_empty() {
                limiter.give_back(&request, lease.decided_unix_nanos)
            } else {
                limiter.give_back_place(&request, lease.decided_unix_nanos, &lease.marks)
            };
            calls.spawn(async move { (lease.left, call.await) });
        }
        let Some(ended) = calls.join_next().await else {
            break;
        };
        let error = match ended {
            Ok((left, Ok(()))) => {
                given += left;
                continue;
            }
            Ok((left, Err(error))) => {
                tracing::warn!(%error, permits = left, "giving back a lease failed: its permits stay consumed");
                error
            }
            Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
            Err(error) => error.into(),
        };
        first_error.get_or_insert(error);
    }
    match first_error {
        Some(error) => Err(error),
        None => Ok(given),
    }
}

/// Whether a refusal came only from the permits a call asked beyond its request: every
/// enforced band that refused belongs to a bucket asking more, and still holds the
/// request's own cost.
fn refused_for_the_lease(request: &AcquireRequest, asked: &[Plan], outcome: &AcquireOutcome) -> bool {
    let mut bands = outcome.bands.iter();
    let mut asked_more = false;
    for (bucket, plan) in request.buckets().zip(asked) {
        let Plan::Call { extra } = *plan else {
            continue;
        };
        for report in bands.by_ref().take(bucket.rule.bands().len()) {
            if report.allowed || bucket.shadow() {
                continue;
            }
            if extra == 0 || report.remaining < bucket.permits {
                return false;
            }
            asked_more = true;
        }
    }
    asked_more
}

/// When a lease taken at `now` expires: after its `ttl`, and for fixed windows at the end
/// of the window it was taken in (as the call's reports give it, from an instant after
/// `now`), so that each window admits no more than its capacity.
fn expiry(rule: &Rule, lease: Lease, now: Instant, reports: &[BandReport]) -> Instant {
    let ttl = now + lease.ttl();
    if rule.algorithm() != Algorithm::FixedWindow {
        return ttl;
    }
    reports.iter().map(|r| now + r.reset_after).fold(ttl, Instant::min)
}

fn unix_nanos(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held: usize = self.shared.shards.iter().map(|s| lock(s).held.len()).sum();
        f.debug_struct("Leases").field("held", &held).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use crate::{Engine, MemoryLimiter, RateLimiter, RequestContext, RuleSets};

    /// In memory every decision is local (`is_local`): a leased rule is decided one request
    /// at a time, exactly as without its lease.
    #[test]
    fn in_memory_a_leased_rule_is_decided_as_without_its_lease() {
        assert!(MemoryLimiter::default().is_local());
        let rules = |lease: &str| {
            RuleSets::from_yaml_str(&format!(
                "rule_sets: [{{ id: default, rules: [{{ id: g, scope: global, bands: [{{ capacity: 5, window: 1h }}]{lease} }}] }}]"
            ))
            .unwrap()
        };
        let leased = Engine::in_memory(rules(", lease: { max: 5, ttl: 1s }"));
        let plain = Engine::in_memory(rules(""));
        let ctx = RequestContext::builder().build();
        for i in 0..7 {
            let a = leased.check(&ctx).into_ready().unwrap().unwrap();
            let b = plain.check(&ctx).into_ready().unwrap().unwrap();
            assert_eq!(
                (a.allowed(), a.remaining()),
                (b.allowed(), b.remaining()),
                "request {i}"
            );
        }
    }
}
