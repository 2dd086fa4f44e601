//! What happens when the limiter backend fails: the [`FailurePolicy`] of rules, the
//! engine and the layer, the [`CircuitBreaker`] that stops waiting for a backend that is
//! down, and the in-memory fallback that decides `fallback_local` rules meanwhile.

use serde::{Deserialize, Serialize};

use crate::decision::{Decision, Outcome};
use crate::error::{BoxError, Error};
use crate::limiter::{AcquireOutcome, AcquireRequest, Bucket, MemoryLimiter};

mod breaker;
mod local;
mod owed;
mod replay;
mod throttle;

pub use breaker::{CircuitBreaker, CircuitOpen};
pub use local::FallbackHandler;
pub use throttle::LogThrottle;

/// What to do with a request when the limiter backend fails (an error, a deadline, an
/// open [`CircuitBreaker`]).
///
/// The same policy is named in three places, from the most to the least specific: a
/// rule's `on_backend_failure`, the engine's
/// [`on_backend_failure`](crate::EngineBuilder::on_backend_failure), and the tower
/// layer's `on_error` for the failures that leave the engine undecided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Admit: the rule does not limit the request.
    FailOpen,
    /// Refuse the request ([`Outcome::BackendUnavailable`]; `503` from the layer).
    FailClosed,
    /// Decide the rule with the engine's in-memory fallback limiter.
    FallbackLocal,
}

/// The engine's answer to a failed backend: each rule's policy, else the engine's
/// default, and the in-memory limiter that decides the `fallback_local` rules.
#[derive(Debug, Default)]
pub(crate) struct Fallback {
    /// The policy of rules that name none; `None` passes the failure on.
    pub(crate) default: Option<FailurePolicy>,
    pub(crate) limiter: MemoryLimiter,
    /// Whether [`record`](Self::record) charges the in-memory limiter with what the
    /// backend admits, and the backend is later charged with what memory admitted
    /// ([`owe_into`](Self::owe_into)): when the backend is not itself in memory.
    pub(crate) charges: bool,
    /// What memory admitted while the backend failed, for the backend to count.
    pub(crate) owed: owed::Owed,
    /// The warnings of the failures of requests a `fail_closed` rule refused.
    pub(crate) refusals: LogThrottle,
    /// The warnings of the failures of requests the other policies decided (`fail_open`,
    /// `fallback_local`): a throttle of its own, so that neither kind hides the other.
    pub(crate) decided: LogThrottle,
}

impl Fallback {
    /// The policy of a bucket's rule: its own, else the engine's default; `None` when
    /// neither names one.
    fn policy(&self, bucket: &Bucket<'_>) -> Option<FailurePolicy> {
        bucket.rule.on_backend_failure().or(self.default)
    }

    /// Charges the in-memory limiter with what the backend admitted for the
    /// `fallback_local` rules of `request` ([`MemoryLimiter::charge`]): when the backend
    /// fails, their in-memory buckets hold what this process has been admitted already, so
    /// a client that spent its limit before the failure does not get it again from memory.
    /// Nothing is charged when the backend refused: it consumed nothing.
    pub(crate) fn record(&self, request: &AcquireRequest, outcome: &AcquireOutcome) {
        if !self.charges || !outcome.allowed {
            return;
        }
        for mut b in request.buckets() {
            if self.policy(&b) == Some(FailurePolicy::FallbackLocal) && (!b.shadow() || outcome.shadow_allowed) {
                // The rule's cost: what the call took on top of it memory admitted itself.
                b.permits = b.rule.permits();
                self.limiter.charge_bucket(&b);
            }
        }
    }

    /// Adds to the permits of `request`'s `fallback_local` buckets what memory admitted for
    /// them while the backend failed, which the backend has not counted: after an outage,
    /// the backend's next call for such a bucket takes it, so that what memory admitted is
    /// not admitted again. Whether it added any: one atomic load when nothing is owed. The
    /// debt stays owed until a request carrying it is admitted ([`settle`](Self::settle)).
    ///
    /// However the request is decided, its buckets' permits beyond their rules' cost are
    /// the debt: a leased rule's request pays it from its lease, or with the call adding to
    /// the lease; a waiting request's place, given back, gives back only the rule's cost
    /// (see `wait_for`).
    pub(crate) fn owe_into(&self, request: &mut AcquireRequest) -> bool {
        self.charges
            && self.owed.take(request, |b| {
                self.policy(b) == Some(FailurePolicy::FallbackLocal) && !b.shadow()
            })
    }

    /// Settles the debts `request` carried ([`owe_into`](Self::owe_into)) by the backend's
    /// answer to it, as soon as it answers (before any wait for the refill), whether its
    /// caller still waits for it or not: paid if the backend admitted the request, still
    /// owed otherwise.
    pub(crate) fn settle(&self, request: &AcquireRequest, result: &Result<AcquireOutcome, BoxError>) {
        if matches!(result, Ok(outcome) if outcome.allowed) {
            self.owed.settle(request);
        }
    }

    /// The decision after the backend failed, by the rules' failure policies, or the
    /// failure itself when a rule has no policy. A configuration error ([`Error::Rule`])
    /// is never covered by a policy.
    /// `request` is copied only when some of its rules are decided in memory, so that the
    /// engine's request is never moved on the path where the backend answered.
    pub(crate) fn decide(&self, request: &AcquireRequest, error: BoxError) -> Result<Decision, Error> {
        let error = match Error::from_limiter(error) {
            Error::Rule(rule) => {
                tracing::error!(error = %rule, "a rule cannot be decided by the rate-limit backend");
                return Err(Error::Rule(rule));
            }
            refused @ (Error::Refused(_) | Error::Overloaded(_)) => return Err(refused),
            Error::Backend(error) | Error::Provider { source: error, .. } => error,
        };
        let rule_set = request.rule_set().id().clone();
        if let Some(closed) = request
            .buckets()
            .find(|b| self.policy(b) == Some(FailurePolicy::FailClosed))
        {
            warn_failed(&self.refusals, &error, "refusing the request (fail_closed)");
            let rule = closed.rule.id().clone();
            let mut decision = Decision::without_bands(rule_set, Outcome::BackendUnavailable { rule });
            decision.degraded = true;
            return Ok(decision);
        }
        if request.is_empty() || request.buckets().any(|b| self.policy(&b).is_none()) {
            // Passed on: whoever handles the error logs it (the layer's `on_error`).
            return Err(Error::Backend(error));
        }
        warn_failed(
            &self.decided,
            &error,
            "deciding by the rules' failure policies (fail_open, fallback_local)",
        );
        let before = request.len();
        let mut request = request.clone();
        request.retain(|b| self.policy(&b) == Some(FailurePolicy::FallbackLocal));
        for index in 0..request.len() {
            // Decided at once: a degraded decision never waits for the refill.
            request.set_max_wait(index, std::time::Duration::ZERO);
            // At the rule's cost, without what the call was to take of memory's admissions.
            if let Some(cost) = request.bucket(index).map(|b| b.rule.permits()) {
                request.set_permits(index, cost);
            }
        }
        let mut decision = if request.is_empty() {
            Decision::without_bands(rule_set, Outcome::Admitted)
        } else {
            let outcome = self.limiter.acquire_now(&request);
            if outcome.allowed && self.charges {
                for b in request.buckets().filter(|b| !b.shadow()) {
                    self.owed.add(&b);
                }
            }
            Decision::from_outcome(rule_set, outcome)
        };
        decision.degraded = true;
        decision.failed_open = request.len() < before;
        Ok(decision)
    }
}

/// Logs a backend failure that a failure policy covers: a warning at most once per
/// [`LogThrottle::EVERY`] (`warnings`), saying how many it held back, the others at debug
/// level, so that a backend down without a [`CircuitBreaker`] does not write a warning per
/// request. While a breaker is open, which warned once when it opened and answers every
/// request with [`CircuitOpen`] meanwhile, at debug level.
///
/// A full store ([`StoreFull`](crate::limiter::StoreFull)) opens no circuit and fails every
/// request it would admit, for as long as it stays full: it is warned of at most once per
/// [`LogThrottle::EVERY`] in the process, so that a client that fills the store does not
/// also write a warning per request.
fn warn_failed(warnings: &LogThrottle, error: &BoxError, action: &str) {
    static STORE_FULL: std::sync::LazyLock<LogThrottle> = std::sync::LazyLock::new(LogThrottle::default);
    if error.is::<CircuitOpen>() {
        tracing::debug!(%error, "rate-limit backend unavailable; {action}");
    } else if crate::limiter::is_store_full(&**error) {
        if let Some(held_back) = STORE_FULL.due() {
            tracing::warn!(
                %error,
                held_back,
                "rate-limit store full: the requests it would admit are decided by their rules' failure policies; {action} \
                 (logged again in {}s at the earliest)",
                LogThrottle::EVERY.as_secs()
            );
        } else {
            tracing::debug!(%error, "rate-limit store full; {action}");
        }
    } else if let Some(held_back) = warnings.due() {
        tracing::warn!(
            %error,
            held_back,
            "rate-limit backend failed; {action} (warned again in {}s at the earliest, the failures between at debug level)",
            LogThrottle::EVERY.as_secs()
        );
    } else {
        tracing::debug!(%error, "rate-limit backend failed; {action}");
    }
}
