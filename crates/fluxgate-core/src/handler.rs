//! Handlers: what the middleware asks for a decision.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::context::RequestContext;
use crate::decision::Decision;
use crate::error::{BoxError, Error};
use crate::future::MaybeReady;

/// Decides requests for the middleware: the local [`Engine`](crate::Engine) or, in HTTP API mode, a
/// remote rate-limit service.
pub trait RateLimitHandler: Send + Sync + fmt::Debug + 'static {
    /// Decides one request.
    fn check(&self, ctx: &RequestContext) -> MaybeReady<Result<Decision, Error>>;
}

impl<H: RateLimitHandler + ?Sized> RateLimitHandler for Arc<H> {
    fn check(&self, ctx: &RequestContext) -> MaybeReady<Result<Decision, Error>> {
        (**self).check(ctx)
    }
}

/// Receives every decision and error, for a custom metrics sink: an engine option
/// ([`EngineBuilder::recorder`](crate::EngineBuilder::recorder)). With the `metrics`
/// feature, `metrics::MetricsRecorder` sends them to the `metrics` facade.
///
/// Implementations should label by rule set, rule and outcome only: paths and key values
/// are unbounded and are not passed. A decision's [`rule_set`](Decision::rule_set) is the
/// id the request asked for when no rule set has it (the `UnknownRuleSet` outcomes), so it
/// is a label only for the other outcomes.
pub trait RateLimitMetricsRecorder: Send + Sync + fmt::Debug + 'static {
    /// Called once per decision.
    fn record_decision(&self, decision: &Decision);

    /// Called when no decision could be made, with the rule set id the request asked for:
    /// a rule set the provider holds, except for an [`Error::Provider`], where the lookup
    /// itself failed.
    fn record_error(&self, rule_set: &str, error: &Error) {
        let _ = (rule_set, error);
    }

    /// Called after each call of the limiter backend, with the backend's
    /// [name](crate::RateLimiter::backend_name), how long the call took, and the error
    /// when it failed (before any failure policy applies). A call that ends with a
    /// configuration error (a [`RuleError`](crate::RuleError): a rule the backend cannot
    /// decide) is not a backend call that failed and is not reported. The engine reads the
    /// clock for it only when it has a recorder.
    fn record_backend_call(&self, backend: &'static str, elapsed: Duration, error: Option<&BoxError>) {
        let _ = (backend, elapsed, error);
    }
}

impl<R: RateLimitMetricsRecorder + ?Sized> RateLimitMetricsRecorder for Arc<R> {
    fn record_decision(&self, decision: &Decision) {
        (**self).record_decision(decision);
    }

    fn record_error(&self, rule_set: &str, error: &Error) {
        (**self).record_error(rule_set, error);
    }

    fn record_backend_call(&self, backend: &'static str, elapsed: Duration, error: Option<&BoxError>) {
        (**self).record_backend_call(backend, elapsed, error);
    }
}
