//! Handlers: what the middleware asks for a decision.

use std::fmt;
use std::sync::Arc;

use crate::context::RequestContext;
use crate::decision::Decision;
use crate::engine::Engine;
use crate::error::Error;
use crate::future::MaybeReady;

/// Decides requests for the middleware: the local engine ([`EngineHandler`]) or, in
/// HTTP API mode, a remote rate-limit service.
pub trait RateLimitHandler: Send + Sync + fmt::Debug + 'static {
    /// Decides one request.
    fn check(&self, ctx: &RequestContext) -> MaybeReady<Result<Decision, Error>>;
}

impl<H: RateLimitHandler + ?Sized> RateLimitHandler for Arc<H> {
    fn check(&self, ctx: &RequestContext) -> MaybeReady<Result<Decision, Error>> {
        (**self).check(ctx)
    }
}

impl RateLimitHandler for Engine {
    fn check(&self, ctx: &RequestContext) -> MaybeReady<Result<Decision, Error>> {
        Engine::check(self, ctx)
    }
}

/// Receives every decision and error, for a custom metrics sink.
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

/// The handler that runs the [`Engine`] in process.
///
/// ```
/// use fluxgate_core::{Engine, EngineHandler, RuleSets};
/// let handler = EngineHandler::new(Engine::in_memory(RuleSets::default()));
/// ```
#[derive(Debug, Clone)]
pub struct EngineHandler {
    engine: Engine,
    recorder: Option<Arc<dyn RateLimitMetricsRecorder>>,
}

impl EngineHandler {
    /// A handler around an engine.
    pub fn new(engine: Engine) -> Self {
        Self { engine, recorder: None }
    }

    /// Sends every decision to `recorder`.
    pub fn with_recorder(mut self, recorder: impl RateLimitMetricsRecorder) -> Self {
        self.recorder = Some(Arc::new(recorder));
        self
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }
}

impl From<Engine> for EngineHandler {
    fn from(engine: Engine) -> Self {
        Self::new(engine)
    }
}

impl RateLimitHandler for EngineHandler {
    fn check(&self, ctx: &RequestContext) -> MaybeReady<Result<Decision, Error>> {
        let check = self.engine.check(ctx);
        let Some(recorder) = self.recorder.clone() else {
            return check;
        };
        let rule_set = ctx.rule_set_id().to_owned();
        check.map(move |result| {
            match &result {
                Ok(decision) => recorder.record_decision(decision),
                Err(error) => recorder.record_error(&rule_set, error),
            }
            result
        })
    }
}
