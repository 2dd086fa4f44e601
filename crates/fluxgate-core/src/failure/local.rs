//! [`FallbackHandler`]: a handler that decides with a local engine whenever another fails.

use crate::context::RequestContext;
use crate::decision::{Decision, Outcome};
use crate::engine::Engine;
use crate::error::{BoxError, Error};
use crate::future::MaybeReady;
use crate::handler::RateLimitHandler;

/// Decides with a local [`Engine`] whenever the handler it wraps fails
/// ([`Error::Backend`]: an error, a deadline, an open [`CircuitBreaker`](super::CircuitBreaker)):
/// the `fallback_local` policy for a handler that is not an engine, such as a gateway's
/// `RemoteHandler`. While the rate-limit service does not answer in time, for whatever
/// reason (down, or a burst that overloads the gateway or the service), the gateway keeps
/// its limits, per instance, instead of admitting every request (`fail_open`) or refusing
/// them all (`fail_closed`). Give the local engine the rules the service has.
///
/// Every request the wrapped handler admits is charged to the local engine's in-memory
/// buckets as well (each band takes the request's permits, or empties without going into
/// debt), so that when the handler fails, a client that spent its limit through this
/// process is not admitted again from full buckets. What other processes admitted, the
/// local engine does not know. The charge goes through the local engine's limiter
/// ([`RateLimiter::charge`](crate::RateLimiter::charge)): the in-memory limiter counts it,
/// given as it is, shared, or wrapped in a `CircuitBreaker`; a limiter of your own that
/// wraps it must pass `charge` on.
///
/// Decisions of the local engine are [`degraded`](Decision::degraded). A request of a rule
/// set the local engine does not have is left to the layer's `on_error`, with the
/// handler's failure. Any other error of the wrapped handler (a configuration error, a
/// refusal of the service) is passed on as it is: the service answered.
///
/// ```
/// use fluxgate_core::{Engine, FallbackHandler, RuleSets};
/// let rules = RuleSets::from_yaml_str(
///     "rule_sets: [{id: default, rules: [{id: per-ip, bands: [{capacity: 5, window: 10s}]}]}]",
/// )?;
/// // In a gateway, the first handler would be the `RemoteHandler` (in a `CircuitBreaker`).
/// let handler = FallbackHandler::new(Engine::in_memory(rules.clone()), Engine::in_memory(rules));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct FallbackHandler<H> {
    primary: H,
    local: Engine,
}

impl<H> FallbackHandler<H> {
    /// `primary`, decided by `local` whenever it fails.
    pub fn new(primary: H, local: Engine) -> Self {
        Self { primary, local }
    }
}

impl<H: RateLimitHandler> RateLimitHandler for FallbackHandler<H> {
    fn check(&self, ctx: &RequestContext) -> MaybeReady<Result<Decision, Error>> {
        match self.primary.check(ctx).into_ready() {
            Ok(Err(Error::Backend(error))) => locally(&self.local, ctx, error),
            Ok(result) => MaybeReady::ready(charged(&self.local, ctx, result)),
            Err(pending) => {
                let (local, ctx) = (self.local.clone(), ctx.clone());
                MaybeReady::boxed(async move {
                    match pending.await {
                        Err(Error::Backend(error)) => locally(&local, &ctx, error).await,
                        result => charged(&local, &ctx, result),
                    }
                })
            }
        }
    }
}

/// The handler's answer, after charging the local engine's in-memory buckets with a
/// request it admitted ([`Engine::charge`]): when the handler fails, the local engine
/// starts from what this process was admitted, not from full buckets.
fn charged(local: &Engine, ctx: &RequestContext, result: Result<Decision, Error>) -> Result<Decision, Error> {
    if let Ok(decision) = &result {
        if decision.allowed() && !decision.degraded {
            local.charge(ctx);
        }
    }
    result
}

/// The local engine's decision of `ctx`, marked degraded, after the handler failed with
/// `error`. A rule set the local engine does not have is no decision of it: the failure is
/// passed on, for the layer's `on_error` (a local engine given other rules than the
/// service's must not admit the requests of a rule set it lacks unlimited, as its
/// `UnknownRuleSet::Allow` would).
fn locally(local: &Engine, ctx: &RequestContext, error: BoxError) -> MaybeReady<Result<Decision, Error>> {
    tracing::debug!(%error, "the rate-limit handler failed: decided by the local engine");
    local.check(ctx).map(move |result| match result {
        Ok(decision) if decision.outcome == Outcome::UnknownRuleSetAllowed => Err(Error::Backend(error)),
        Ok(mut decision) => {
            decision.degraded = true;
            Ok(decision)
        }
        Err(e) => Err(e),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::{CircuitBreaker, MemoryLimiter, RuleSets};

    /// A handler that decides with its engine until it is told to fail.
    #[derive(Debug)]
    struct Failing {
        engine: Engine,
        failing: Arc<AtomicBool>,
    }

    impl RateLimitHandler for Failing {
        fn check(&self, ctx: &RequestContext) -> MaybeReady<Result<Decision, Error>> {
            if self.failing.load(Ordering::Relaxed) {
                return MaybeReady::ready(Err(Error::Backend("down".into())));
            }
            self.engine.check(ctx)
        }
    }

    fn rules() -> RuleSets {
        RuleSets::from_yaml_str("rule_sets: [{id: default, rules: [{id: per-ip, bands: [{capacity: 5, window: 1h}]}]}]")
            .unwrap()
    }

    /// The handler admits 3 of 5 and fails: the local engine admits the 2 left, however
    /// its in-memory limiter was given to it.
    #[test]
    fn the_local_engine_is_charged_whether_its_limiter_is_given_as_it_is_shared_or_wrapped() {
        let locals: [(&str, Engine); 4] = [
            ("in_memory", Engine::in_memory(rules())),
            (
                "limiter",
                Engine::builder(rules())
                    .limiter(MemoryLimiter::default())
                    .build()
                    .unwrap(),
            ),
            (
                "shared_limiter",
                Engine::builder(rules())
                    .shared_limiter(Arc::new(MemoryLimiter::default()))
                    .build()
                    .unwrap(),
            ),
            (
                "in a CircuitBreaker",
                Engine::builder(rules())
                    .limiter(CircuitBreaker::new(MemoryLimiter::default()))
                    .build()
                    .unwrap(),
            ),
        ];
        for (given, local) in locals {
            let failing = Arc::new(AtomicBool::new(false));
            let primary = Failing {
                engine: Engine::in_memory(rules()),
                failing: failing.clone(),
            };
            let handler = FallbackHandler::new(primary, local);
            let ctx = RequestContext::builder().client_ip("10.0.0.1".parse().unwrap()).build();
            let check = || handler.check(&ctx).into_ready().unwrap().unwrap();
            for _ in 0..3 {
                assert!(check().allowed(), "{given}: the handler admits");
            }
            failing.store(true, Ordering::Relaxed);
            let admitted = (0..5).filter(|_| check().allowed()).count();
            assert_eq!(admitted, 2, "{given}: the local engine admits the rest of 5, not 5");
            let decision = check();
            assert!(decision.degraded, "{given}: decided by the local engine");
            assert_eq!(decision.remaining(), Some(0), "{given}");
        }
    }
}
