//! Handlers: what the middleware asks for a decision.

use std::fmt;
use std::sync::Arc;

use crate::context::RequestContext;
use crate::decision::Decision;
use crate::error::Error;
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
/// ([`EngineBuilder::recorder`](crate::EngineBuilder::recorder)).
///
/// Implementations should label by rule set, rule and outcome only: paths and key values
/// are unbounded and are not passed.
pub trait RateLimitMetricsRecorder: Send + Sync + fmt::Debug + 'static {
    /// Called once per decision.
    fn record_decision(&self, decision: &Decision);

    /// Called when no decision could be made.
    fn record_error(&self, rule_set: &str, error: &Error) {
        let _ = (rule_set, error);
    }
}

impl<R: RateLimitMetricsRecorder + ?Sized> RateLimitMetricsRecorder for Arc<R> {
    fn record_decision(&self, decision: &Decision) {
        (**self).record_decision(decision);
    }

    fn record_error(&self, rule_set: &str, error: &Error) {
        (**self).record_error(rule_set, error);
    }
}
