//! Waiting for the refill (a rule's `on_limit: { wait: { max_wait, max_waiters } }`).
//!
//! A request that a rule with a wait policy would refuse, and that the rule would admit
//! within `max_wait`, may wait instead: the engine lets the backend take the request's
//! place at the instant it will be admitted (in the same step as the decision, see
//! [`Bucket::max_wait`](crate::limiter::Bucket::max_wait)), then sleeps until then. At most
//! `max_waiters` requests of a rule wait at once on one engine: a request that finds them
//! all taken may not wait, and is refused at once. A waiting request that is dropped
//! (its client gone) gives its place back; dropped while its call is out, it keeps its
//! waiter's place until the backend answers, and then gives back the place it was given.

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

impl Drop for Places {
    fn drop(&mut self) {
        for count in &self.0 {
            count.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Places {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
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
    /// [`max_wait`](crate::RequestContext::max_wait)); returns the places taken (`None`
    /// when no rule of its rule set waits).
    #[inline]
    pub(crate) fn admit(&self, request: &mut AcquireRequest, cap: Option<Duration>) -> Option<Places> {
        // The common case, checked first and inline: nothing in the rule set waits.
        if self.default.is_none() && !request.rule_set().rules().iter().any(Rule::waits) {
            return None;
        }
        Some(self.places(request, cap.unwrap_or(Duration::MAX)))
    }

    #[inline(never)]
    fn places(&self, request: &mut AcquireRequest, cap: Duration) -> Places {
        if cap.is_zero() {
            // The caller cannot wait: no rule makes it.
            return Places::default();
        }
        let mut places = Places::default();
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
            if count.fetch_add(1, Ordering::AcqRel) < policy.max_waiters() {
                places.0.push(count);
                allowed.push((index, policy.max_wait().min(cap)));
            } else {
                count.fetch_sub(1, Ordering::AcqRel);
            }
        }
        for (index, max_wait) in allowed {
            request.set_max_wait(index, max_wait);
        }
        places
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
    /// The place `outcome` took for `request`, given back when this is dropped unless the
    /// wait ends.
    fn of(limiter: Arc<dyn RateLimiter>, request: &AcquireRequest, outcome: &AcquireOutcome) -> Self {
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
        // Given back, a place gives back its rules' cost: what a bucket took beyond it is
        // what memory admitted while the backend failed (`Fallback::owe_into`), which stays
        // counted.
        for index in 0..taken.len() {
            if let Some(cost) = taken.bucket(index).map(|b| b.rule.permits()) {
                taken.set_permits(index, cost);
            }
        }
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
    places: Option<Places>,
    then: impl FnOnce() -> T + Send + 'static,
) -> MaybeReady<T> {
    let after = outcome.admitted_after;
    let reserved = Reserved::of(limiter, request, outcome);
    MaybeReady::boxed(async move {
        // The whole guard moves into the future, to be dropped with it.
        let mut reserved = reserved;
        tokio::time::sleep(after).await;
        reserved.over = true;
        drop(places);
        then()
    })
}

/// Gives back the place `outcome` took for `request`, whose client is gone: what a waiting
/// request dropped before its wait ends gives back, for one dropped before the backend's
/// answer came.
pub(crate) fn give_back(limiter: Arc<dyn RateLimiter>, request: &AcquireRequest, outcome: &AcquireOutcome) {
    drop(Reserved::of(limiter, request, outcome));
}

/// The places a request holds among the waiters, if any: only then can it wait.
pub(crate) fn may_wait(places: &Option<Places>) -> bool {
    places.as_ref().is_some_and(|p| !p.is_empty())
}
