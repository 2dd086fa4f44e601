//! Local leases: a rule's `lease: { max, ttl }` (see [`Lease`]).
//!
//! An instance takes up to `max` permits of a key from the shared bucket in one backend
//! call, spends them with no further call, and gives back what it has not spent when the
//! lease expires, when the rule changes, and at shutdown. The permits are consumed in the
//! backend when they are taken, so the limit is never exceeded: what a lease costs is
//! under-admission, permits sitting in one instance while another is refused.
//!
//! How many permits a call takes adapts: the request's own cost, plus at most `max` less
//! that cost, and never more than half of what the bucket held at the last call, so that
//! the last permits of a bucket go one request per call. A call that asked for more than
//! its request and was refused only for that is made again for the request alone.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::SystemTime;

use smallvec::SmallVec;
use tokio::time::Instant;

use crate::decision::{BandReport, Bands};
use crate::error::BoxError;
use crate::future::MaybeReady;
use crate::limiter::{AcquireOutcome, AcquireRequest, Bucket, RateLimiter, Wait};
use crate::name::Name;
use crate::rule::{Band, Lease, Rule, RuleSet};
use crate::text::Text;

const SHARDS: usize = 16;

/// The leases of one engine: per rule and key, the permits this instance holds.
#[derive(Clone)]
pub(crate) struct Leases {
    shared: Arc<Shared>,
}

struct Shared {
    limiter: Arc<dyn RateLimiter>,
    shards: Box<[Mutex<HashMap<LeaseKey, Held>>]>,
    hasher: std::collections::hash_map::RandomState,
    /// Whether a task gives back the leases that expire.
    sweeping: AtomicBool,
    /// The number given to the next lease taken.
    next_id: AtomicU64,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct LeaseKey {
    set: Name,
    rule: Name,
    key: Text,
}

impl LeaseKey {
    fn of(bucket: &Bucket<'_>) -> Self {
        Self {
            set: bucket.rule_set.id().clone(),
            rule: bucket.rule.id().clone(),
            key: bucket.key.clone(),
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
    /// The backend's clock when the permits were taken.
    decided_unix_nanos: u64,
    expires: Instant,
    /// Each band's report at the call, its remaining permits those the bucket kept
    /// (without the lease's).
    reports: SmallVec<[BandReport; 2]>,
}

impl Held {
    /// Whether the lease was taken for `rule` as it is now.
    fn is_for(&self, rule: &Rule) -> bool {
        (Arc::ptr_eq(&self.bands, rule.bands()) || *self.bands == **rule.bands())
            && self.permits == rule.permits()
            && Some(self.lease) == rule.lease()
    }

    /// The bucket's least remaining permits at the call, the lease's not counted.
    fn shared_remaining(&self) -> u64 {
        self.reports.iter().map(|r| r.remaining).min().unwrap_or(0)
    }

    /// The reports of a request admitted from the lease, as of now: each band's remaining
    /// permits are the bucket's at the call plus what the lease still holds.
    fn reports_now(&self, now: SystemTime) -> impl Iterator<Item = BandReport> + '_ {
        self.reports.iter().map(move |r| {
            let mut r = r.clone();
            r.remaining = r.remaining.saturating_add(self.left).min(r.limit);
            r.reset_after = r.reset_at.duration_since(now).unwrap_or_default();
            r.allowed = true;
            r.wait = Wait::None;
            r
        })
    }

    fn into_give_back(self, key: LeaseKey) -> Option<GiveBack> {
        (self.left > 0).then_some(GiveBack {
            set: self.set,
            rule: self.rule,
            key: key.key,
            left: self.left,
            decided_unix_nanos: self.decided_unix_nanos,
        })
    }
}

/// Gives back the leases of rules that change; holds the leases weakly.
pub(crate) struct LeaseWatch(Weak<Shared>);

impl LeaseWatch {
    /// Gives back the leases of rules of `set`'s id that `set` changes or removes: called
    /// when a rule set is about to be swapped in.
    pub(crate) fn rules_changed(&self, set: &RuleSet) {
        let Some(shared) = self.0.upgrade() else {
            return;
        };
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
    left: u64,
    decided_unix_nanos: u64,
}

/// What a request does with each of its buckets.
#[derive(Clone, Copy)]
enum Plan {
    /// Admitted from the lease with this id (given back to it should the request fail).
    Spent(u64),
    /// Decided by the backend, taking this many permits more than the request's.
    Call { extra: u64 },
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Leases {
    pub(crate) fn new(limiter: Arc<dyn RateLimiter>) -> Self {
        Self {
            shared: Arc::new(Shared {
                limiter,
                shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
                hasher: std::collections::hash_map::RandomState::new(),
                sweeping: AtomicBool::new(false),
                next_id: AtomicU64::new(1),
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
        let now = Instant::now();
        let mut plans: SmallVec<[Plan; 4]> = SmallVec::new();
        let mut stale = Vec::new();
        for bucket in request.buckets() {
            plans.push(shared.plan(&bucket, now, &mut stale));
        }
        shared.give_back_later(stale);
        if plans.iter().all(|p| matches!(p, Plan::Spent(_))) {
            return MaybeReady::ready(Ok(shared.local_outcome(request, &plans)));
        }
        let shared = shared.clone();
        let request = request.clone();
        MaybeReady::boxed(async move { shared.decide(request, plans, now).await })
    }

    /// Gives back every lease this instance holds; returns the permits given back.
    ///
    /// # Errors
    ///
    /// The first backend failure; the other leases are given back all the same.
    pub(crate) async fn release_all(&self) -> Result<u64, BoxError> {
        let all = self.shared.take(|_, _| true);
        self.shared.give_back_all(all).await
    }
}

impl Shared {
    fn shard(&self, key: &LeaseKey) -> &Mutex<HashMap<LeaseKey, Held>> {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }

    /// What to do with `bucket`: spend from its lease, or ask the backend (for how many).
    fn plan(&self, bucket: &Bucket<'_>, now: Instant, stale: &mut Vec<GiveBack>) -> Plan {
        let Some(lease) = bucket.rule.lease().filter(|_| !bucket.shadow()) else {
            return Plan::Call { extra: 0 };
        };
        let cost = bucket.permits;
        let most = lease.max().saturating_sub(cost);
        let key = LeaseKey::of(bucket);
        let mut shard = lock(self.shard(&key));
        let Some(held) = shard.get_mut(&key) else {
            return Plan::Call { extra: most };
        };
        if held.is_for(bucket.rule) && now < held.expires {
            if held.left >= cost {
                held.left -= cost;
                return Plan::Spent(held.id);
            }
            // Too few permits left: a new lease, no larger than half the bucket as it was.
            return Plan::Call {
                extra: most.min(held.shared_remaining() / 2),
            };
        }
        // Expired, or taken for the rule as it was.
        if let Some(old) = shard.remove(&key) {
            stale.extend(old.into_give_back(key));
        }
        Plan::Call { extra: most }
    }

    /// The outcome of a request admitted from its leases alone.
    fn local_outcome(&self, request: &AcquireRequest, plans: &[Plan]) -> AcquireOutcome {
        let now = SystemTime::now();
        let mut bands = Bands::with_capacity(request.band_count());
        for (bucket, plan) in request.buckets().zip(plans) {
            let key = LeaseKey::of(&bucket);
            let shard = lock(self.shard(&key));
            match (shard.get(&key), plan) {
                (Some(held), Plan::Spent(id)) if held.id == *id => bands.extend(held.reports_now(now)),
                // The lease went (given back) since the spend: its figures as they were.
                _ => bands.extend(
                    bucket
                        .rule
                        .bands()
                        .iter()
                        .map(|band| bucket.report(band, unix_nanos(now), 0, std::time::Duration::ZERO, Wait::None)),
                ),
            }
        }
        AcquireOutcome::new(true, true, unix_nanos(now), bands).answered_locally()
    }

    /// Decides the buckets the leases did not admit in the backend, takes the new leases,
    /// and merges the figures.
    async fn decide(
        self: Arc<Self>,
        request: AcquireRequest,
        plans: SmallVec<[Plan; 4]>,
        now: Instant,
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
        let outcome = match result {
            Ok(outcome) => outcome,
            Err(error) => {
                self.unspend(&request, &plans);
                return Err(error);
            }
        };
        if !outcome.allowed {
            self.unspend(&request, &plans);
        }
        let wall = SystemTime::now();
        let mut called = outcome.bands.iter();
        let mut bands = Bands::with_capacity(request.band_count());
        let mut taken = Vec::new();
        for (index, (bucket, plan)) in request.buckets().zip(&asked).enumerate() {
            let count = bucket.rule.bands().len();
            match *plan {
                Plan::Spent(id) => {
                    let key = LeaseKey::of(&bucket);
                    let shard = lock(self.shard(&key));
                    // Refused: the lease holds this request's permits again (`unspend`).
                    match shard.get(&key).filter(|held| held.id == id) {
                        Some(held) => bands.extend(held.reports_now(wall)),
                        None => bands.extend(bucket.rule.bands().iter().map(|band| {
                            bucket.report(band, outcome.now_unix_nanos, 0, std::time::Duration::ZERO, Wait::None)
                        })),
                    }
                }
                Plan::Call { extra } => {
                    let reports: SmallVec<[BandReport; 2]> = called.by_ref().take(count).cloned().collect();
                    let leased = bucket.rule.lease().filter(|_| !bucket.shadow());
                    match leased {
                        Some(lease) if outcome.allowed => {
                            bands.extend(reports.iter().map(|r| {
                                let mut r = r.clone();
                                r.remaining = r.remaining.saturating_add(extra).min(r.limit);
                                r
                            }));
                            taken.push((index, lease, extra, reports));
                        }
                        _ => bands.extend(reports),
                    }
                }
            }
        }
        for (index, lease, extra, reports) in taken {
            if let Some(bucket) = request.bucket(index) {
                self.hold(
                    &request,
                    index,
                    &bucket,
                    lease,
                    extra,
                    outcome.now_unix_nanos,
                    now,
                    reports,
                );
            }
        }
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
                call.push_permits(rule, bucket.key.clone(), bucket.permits.saturating_add(*extra));
            }
        }
        call
    }

    /// Keeps the permits a call took beyond its request as the lease of `bucket`.
    #[allow(clippy::too_many_arguments)]
    fn hold(
        self: &Arc<Self>,
        request: &AcquireRequest,
        index: usize,
        bucket: &Bucket<'_>,
        lease: Lease,
        extra: u64,
        decided_unix_nanos: u64,
        now: Instant,
        reports: SmallVec<[BandReport; 2]>,
    ) {
        let Some(rule) = request.rule_index(index) else {
            return;
        };
        let key = LeaseKey::of(bucket);
        let held = Held {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            set: request.rule_set().clone(),
            rule,
            bands: bucket.rule.bands().clone(),
            permits: bucket.rule.permits(),
            lease,
            left: extra,
            decided_unix_nanos,
            expires: now + lease.ttl(),
            reports,
        };
        let old = lock(self.shard(&key)).insert(key.clone(), held);
        self.give_back_later(old.and_then(|old| old.into_give_back(key)).into_iter().collect());
        self.sweep_later();
    }

    /// Makes back the spends of a request that was not admitted after all.
    fn unspend(&self, request: &AcquireRequest, plans: &[Plan]) {
        for (bucket, plan) in request.buckets().zip(plans) {
            if let Plan::Spent(id) = *plan {
                let key = LeaseKey::of(&bucket);
                if let Some(held) = lock(self.shard(&key)).get_mut(&key).filter(|h| h.id == id) {
                    held.left += bucket.permits;
                }
            }
        }
    }

    /// Takes out the leases `which` names.
    fn take(&self, mut which: impl FnMut(&LeaseKey, &Held) -> bool) -> Vec<GiveBack> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            let keys: Vec<LeaseKey> = shard
                .iter()
                .filter(|(k, h)| which(k, h))
                .map(|(k, _)| k.clone())
                .collect();
            for key in keys {
                if let Some(held) = shard.remove(&key) {
                    out.extend(held.into_give_back(key));
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
            let _ = give_back_all(&*limiter, leases).await;
        });
    }

    async fn give_back_all(&self, leases: Vec<GiveBack>) -> Result<u64, BoxError> {
        give_back_all(&*self.limiter, leases).await
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
            .filter_map(|shard| lock(shard).values().map(|h| h.expires).min())
            .min();
        (expired, next)
    }
}

/// Gives back expired leases as they expire, while there are leases; ends with the engine.
async fn sweep(weak: Weak<Shared>) {
    loop {
        let Some(shared) = weak.upgrade() else {
            return;
        };
        let (expired, next) = shared.expired(Instant::now());
        let limiter = shared.limiter.clone();
        let next = match next {
            Some(next) => next,
            None => {
                shared.sweeping.store(false, Ordering::Release);
                // A lease taken since, whose taker saw the task running, needs it again.
                let again =
                    shared.shards.iter().any(|s| !lock(s).is_empty()) && !shared.sweeping.swap(true, Ordering::AcqRel);
                drop(shared);
                let _ = give_back_all(&*limiter, expired).await;
                if again {
                    continue;
                }
                return;
            }
        };
        drop(shared);
        let _ = give_back_all(&*limiter, expired).await;
        tokio::time::sleep_until(next).await;
    }
}

/// Gives `leases` back one by one (each its own call); returns the permits given back.
///
/// # Errors
///
/// The first failure, after trying every lease.
async fn give_back_all(limiter: &dyn RateLimiter, leases: Vec<GiveBack>) -> Result<u64, BoxError> {
    let mut first_error = None;
    let mut given = 0;
    for lease in leases {
        let mut request = AcquireRequest::new(lease.set);
        request.push_permits(lease.rule, lease.key, lease.left);
        match limiter.give_back(&request, lease.decided_unix_nanos).await {
            Ok(()) => given += lease.left,
            Err(error) => {
                tracing::warn!(%error, permits = lease.left, "giving back a lease failed: its permits stay consumed");
                first_error.get_or_insert(error);
            }
        }
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

fn unix_nanos(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held: usize = self.shared.shards.iter().map(|s| lock(s).len()).sum();
        f.debug_struct("Leases").field("held", &held).finish_non_exhaustive()
    }
}
