//! Waiting for the refill (a rule's `on_limit: { wait: { max_wait, max_waiters } }`).
//!
//! A request that a rule with a wait policy would refuse, and that the rule would admit
//! within `max_wait`, may wait instead: the engine lets the backend take the request's
//! place at the instant it will be admitted (in the same step as the decision, see
//! [`Bucket::max_wait`](crate::limiter::Bucket::max_wait)), then sleeps until then. At most
//! `max_waiters` requests of a rule wait at once on one engine, give or take the requests
//! in flight: a request sent when they are all taken may not wait, and is refused at once.
//! A place is taken when the backend's answer makes the request wait, not while the
//! request is being decided, so that requests in flight that end up admitted at once hold
//! no place. Requests sent together while a place was free each took their place in the
//! bucket with their decision, and all wait for it (refused, their places would pass
//! unused: a bucket gives back only the latest place taken). A waiting request that is
//! dropped (its client gone) gives its place back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use smallvec::SmallVec;

use crate::future::MaybeReady;
use crate::limiter::{AcquireOutcome, AcquireRequest, RateLimiter};
use crate::name::Name;
use crate::rule::{Rule, WaitPolicy};

/// The requests waiting on one engine, per rule set and rule.
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    counts: Mutex<HashMap<(Name, Name), Arc<AtomicU32>>>,
    /// The policy of the rules that name none (and have no lease).
    default: Option<WaitPolicy>,
}

/// The places a request holds among its rules' waiters; given back when dropped.
#[derive(Default)]
pub(crate) struct Places(SmallVec<[Arc<AtomicU32>; 1]>);

/// The waiters of the rules a request may wait for: each had a place free when the request
/// was sent; [`take`](Self::take) takes one in each when the answer makes it wait.
#[derive(Default)]
pub(crate) struct Candidates(SmallVec<[Arc<AtomicU32>; 1]>);

impl Candidates {
    /// A place in each rule's waiters, taken even past `max_waiters` when requests sent
    /// together took the last ones first: the request's place in its bucket is taken, and
    /// a bucket gives back only the latest place taken (see the module's documentation).
    pub(crate) fn take(self) -> Places {
        for count in &self.0 {
            count.fetch_add(1, Ordering::AcqRel);
        }
        Places(self.0)
    }
}

impl Drop for Places {
    fn drop(&mut self) {
        for count in &self.0 {
            count.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Waiters {
    /// Waiters with `default` for the rules that name no policy.
    pub(crate) fn new(default: Option<WaitPolicy>) -> Self {
        Self {
            counts: Mutex::default(),
            default,
        }
    }

    /// The policy of `rule`: its own, else the engine's for a rule without a lease.
    pub(crate) fn policy(&self, rule: &Rule) -> Option<WaitPolicy> {
        rule.wait().or(self.default.filter(|_| rule.lease().is_none()))
    }

    /// Lets `request` wait for each of its enforced buckets whose rule has a wait policy,
    /// as long as the rule has a waiter's place free, and at most `cap` (the caller's
    /// [`max_wait`](crate::RequestContext::max_wait)); returns those rules' waiters, whose
    /// places are taken only if the answer makes the request wait (`None` when no rule of
    /// its rule set waits).
    #[inline]
    pub(crate) fn admit(&self, request: &mut AcquireRequest, cap: Option<Duration>) -> Option<Candidates> {
        // The common case, checked first and inline: nothing in the rule set waits.
        if self.default.is_none() && !request.rule_set().rules().iter().any(Rule::waits) {
            return None;
        }
        Some(self.candidates(request, cap.unwrap_or(Duration::MAX)))
    }

    #[inline(never)]
    fn candidates(&self, request: &mut AcquireRequest, cap: Duration) -> Candidates {
        if cap.is_zero() {
            // The caller cannot wait: no rule makes it.
            return Candidates::default();
        }
        let mut candidates = Candidates::default();
        let mut allowed: SmallVec<[(usize, Duration); 2]> = SmallVec::new();
        for (index, bucket) in request.buckets().enumerate() {
            let Some(policy) = self.policy(bucket.rule).filter(|_| !bucket.shadow()) else {
                continue;
            };
            let count = {
                let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
                counts
                    .entry((bucket.rule_set.id().clone(), bucket.rule.id().clone()))
                    .or_default()
                    .clone()
            };
            if count.load(Ordering::Acquire) < policy.max_waiters() {
                candidates.0.push(count);
                allowed.push((index, policy.max_wait().min(cap)));
            }
        }
        for (index, max_wait) in allowed {
            request.set_max_wait(index, max_wait);
        }
        candidates
    }
}

/// A request whose place the backend took for a later instant: given back unless the
/// wait ends.
struct Reserved {
    limiter: Arc<dyn RateLimiter>,
    /// The buckets that took the place: the enforced ones, and the shadow ones if they did.
    request: AcquireRequest,
    /// The instant of the place, on the backend's clock.
    at_unix_nanos: u64,
    /// What the backend recorded of each band's state ([`AcquireOutcome::marks`]).
    marks: Vec<u128>,
    over: bool,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if self.over {
            return;
        }
        // The waiting request was dropped: its place goes back for the next request.
        let given = self
            .limiter
            .give_back_place(&self.request, self.at_unix_nanos, &self.marks);
        match given.into_ready() {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(%error, "giving back a waiting request's place failed"),
            Err(pending) => match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(async move {
                        if let Err(error) = pending.await {
                            tracing::warn!(%error, "giving back a waiting request's place failed");
                        }
                    });
                }
                Err(_) => tracing::warn!("no runtime to give a waiting request's place back on"),
            },
        }
    }
}

impl Reserved {
    /// The place `outcome` took for `request`, given back when dropped.
    fn new(limiter: Arc<dyn RateLimiter>, request: &AcquireRequest, outcome: &AcquireOutcome) -> Self {
        let mut taken = request.clone();
        let shadow_allowed = outcome.shadow_allowed;
        // The marks of the buckets kept, band by band.
        let mut marks = Vec::with_capacity(outcome.marks.len());
        let mut all = outcome.marks.iter();
        for bucket in request.buckets() {
            let keep = !bucket.shadow() || shadow_allowed;
            for _ in 0..bucket.rule.bands().len() {
                // Every band's mark is read, kept or not, so that the next bucket's line up.
                let mark = all.next().copied().unwrap_or(0);
                if keep {
                    marks.push(mark);
                }
            }
        }
        taken.retain(|b| !b.shadow() || shadow_allowed);
        let at_unix_nanos = outcome
            .now_unix_nanos
            .saturating_add(u64::try_from(outcome.admitted_after.as_nanos()).unwrap_or(u64::MAX));
        Self {
            limiter,
            request: taken,
            at_unix_nanos,
            marks,
            over: false,
        }
    }
}

/// Waits until the place `outcome` took for `request` comes, then answers with `then`;
/// dropped before, gives the place back. `places` are held until then.
pub(crate) fn wait_for<T: Send + 'static>(
    limiter: Arc<dyn RateLimiter>,
    request: &AcquireRequest,
    outcome: &AcquireOutcome,
    places: Places,
    then: impl FnOnce() -> T + Send + 'static,
) -> MaybeReady<T> {
    let after = outcome.admitted_after;
    let reserved = Reserved::new(limiter, request, outcome);
    MaybeReady::boxed(async move {
        // The whole guard moves into the future, to be dropped with it.
        let mut reserved = reserved;
        tokio::time::sleep(after).await;
        reserved.over = true;
        drop(places);
        then()
    })
}

/// Whether the request may wait: some rule had a waiter's place free when it was sent.
pub(crate) fn may_wait(candidates: &Option<Candidates>) -> bool {
    candidates.as_ref().is_some_and(|c| !c.0.is_empty())
}
