//! The one harness of the decision tests: a [`Backend`] gives fresh, isolated limiters and
//! the clock they decide on, so that the scenarios (`scenarios.rs`), the conformance suite
//! (`conformance.rs`) and the differential test run unchanged on every backend: the
//! in-memory limiter here, the reference model (`model.rs`), and Redis, standalone or a
//! cluster (`redis.rs`).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use fluxgate::core::limiter::{AcquireOutcome, AcquireRequest};
use fluxgate::core::{
    BoxError, Clock, Decision, Engine, ManualClock, MaybeReady, MemoryLimiter, RateLimiter, RequestContext, Rule,
    RuleError, RuleSet, TokioClock,
};

use super::app::rules;

/// What [`Backend::wait_until`] returns.
pub(crate) type Waiting<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// A limiter backend under test.
pub(crate) trait Backend: Send + Sync {
    /// The backend's name, in failure messages.
    fn name(&self) -> &'static str;
    /// A fresh limiter, isolated from every other: its own key prefix, or its own state.
    fn limiter(&self) -> Arc<dyn RateLimiter>;
    /// The backend's clock, in nanoseconds since the Unix epoch.
    fn now_nanos(&self) -> u64;
    /// Returns once the backend's clock reads at least `t` (moving a controlled clock there).
    fn wait_until(&self, t: u64) -> Waiting<'_>;
    /// How many admissions the exact-refill scenario may be off by.
    fn refill_tolerance(&self) -> usize;
    /// Whether every rule of a request is decided in one atomic step (not so for rules in
    /// different slots of a Redis Cluster, which are refunded instead).
    fn atomic_across_rules(&self) -> bool {
        true
    }
}

/// The in-memory limiter, on tokio's clock or on a clock that moves only when told to.
pub(crate) struct Memory {
    /// `None`: tokio's clock (paused by `start_paused`).
    manual: Option<ManualClock>,
}

impl Memory {
    /// On tokio's clock, which `#[tokio::test(start_paused = true)]` controls.
    pub(crate) const fn tokio() -> Self {
        Self { manual: None }
    }

    /// On `clock`, which moves only when the test (or [`Backend::wait_until`]) moves it, so
    /// that every figure is exact.
    pub(crate) fn manual(clock: ManualClock) -> Self {
        Self { manual: Some(clock) }
    }

    /// A fresh limiter, as its own type.
    pub(crate) fn memory_limiter(&self) -> MemoryLimiter {
        match &self.manual {
            None => MemoryLimiter::builder().clock(TokioClock::new()).build(),
            Some(clock) => MemoryLimiter::builder().clock(clock.clone()).build(),
        }
    }
}

impl Backend for Memory {
    fn name(&self) -> &'static str {
        "memory"
    }
    fn limiter(&self) -> Arc<dyn RateLimiter> {
        Arc::new(self.memory_limiter())
    }
    fn now_nanos(&self) -> u64 {
        match &self.manual {
            None => TokioClock::new().now_nanos(),
            Some(clock) => clock.now_nanos(),
        }
    }
    fn wait_until(&self, t: u64) -> Waiting<'_> {
        match &self.manual {
            None => {
                let now = self.now_nanos();
                Box::pin(tokio::time::sleep(Duration::from_nanos(t.saturating_sub(now))))
            }
            Some(clock) => advance_to(clock, t),
        }
    }
    fn refill_tolerance(&self) -> usize {
        1
    }
}

/// Moves a controlled clock to `t` (never back).
pub(crate) fn advance_to(clock: &ManualClock, t: u64) -> Waiting<'static> {
    let now = clock.now_nanos();
    clock.advance(Duration::from_nanos(t.saturating_sub(now)));
    Box::pin(std::future::ready(()))
}

/// An engine over the rules of `yaml` and a fresh limiter of `backend`.
pub(crate) fn engine(backend: &dyn Backend, yaml: &str) -> Engine {
    Engine::builder(rules(yaml))
        .shared_limiter(backend.limiter())
        .build()
        .expect("the backend decides every rule")
}

pub(crate) fn ctx(ip: &str) -> RequestContext {
    RequestContext::builder()
        .path("/api/users")
        .client_ip(ip.parse().unwrap())
        .build()
}

pub(crate) async fn check(engine: &Engine, ctx: &RequestContext) -> Decision {
    engine.check(ctx).await.expect("decision")
}

/// Rules of two waiting rules, for the tests that a request waits only as long as every rule
/// that refuses it allows: `quick`, of `algorithm` (a token or leaky bucket), 10 per 10 s,
/// lets its requests wait 1.5 s; `slow`, a token bucket of 1 per 4 s on `/slow`, lets them
/// wait 10 s.
pub(crate) fn shortest_wait(algorithm: &str) -> String {
    format!(
        r#"
rule_sets:
  - id: default
    rules:
      - id: quick
        scope: global
        algorithm: {algorithm}
        bands: [{{ capacity: 10, window: 10s }}]
        on_limit: {{ wait: {{ max_wait: 1500ms, max_waiters: 10 }} }}
      - id: slow
        match: {{ paths: ["/slow"] }}
        scope: global
        bands: [{{ capacity: 1, window: 4s }}]
        on_limit: {{ wait: {{ max_wait: 10s, max_waiters: 10 }} }}
"#
    )
}

/// Starts `n` requests with an empty context at once; returns, for each, whether it was
/// admitted and when it was answered, after `start`, in the order they were answered.
pub(crate) async fn at_once(engine: &Engine, n: usize, start: tokio::time::Instant) -> Vec<(bool, Duration)> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let engine = engine.clone();
            tokio::spawn(async move {
                let decision = check(&engine, &RequestContext::builder().build()).await;
                (decision.allowed(), start.elapsed())
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("the task ran"));
    }
    answers.sort_by_key(|a| (a.1, a.0));
    answers
}

/// What [`Around`] does with a call of its limiter.
type Acquire<L> = dyn Fn(&L, &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> + Send + Sync;

/// A limiter that decides as `inner`, each `acquire` passed through `around` (a delay, a
/// gate, a panic): it validates, lets requests wait and gives back as `inner` does, and is
/// neither local nor keyed by typed values, as a limiter in front of a remote store is.
pub(crate) struct Around<L> {
    inner: L,
    around: Box<Acquire<L>>,
}

impl<L> Around<L> {
    /// `inner`, its calls passed through `around`.
    pub(crate) fn new(
        inner: L,
        around: impl Fn(&L, &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> + Send + Sync + 'static,
    ) -> Self {
        Self {
            inner,
            around: Box::new(around),
        }
    }
}

impl<L: fmt::Debug> fmt::Debug for Around<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Around")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<L: RateLimiter> RateLimiter for Around<L> {
    fn acquire(&self, request: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        (self.around)(&self.inner, request)
    }

    fn validate(&self, set: &RuleSet) -> Result<(), RuleError> {
        self.inner.validate(set)
    }

    fn gives_back(&self) -> bool {
        self.inner.gives_back()
    }

    fn check_wait(&self, set: &RuleSet, rule: &Rule, max_wait: Duration) -> Result<(), RuleError> {
        self.inner.check_wait(set, rule, max_wait)
    }

    fn give_back(&self, request: &AcquireRequest, decided_unix_nanos: u64) -> MaybeReady<Result<(), BoxError>> {
        self.inner.give_back(request, decided_unix_nanos)
    }

    fn give_back_place(
        &self,
        request: &AcquireRequest,
        at_unix_nanos: u64,
        marks: &[u128],
    ) -> MaybeReady<Result<(), BoxError>> {
        self.inner.give_back_place(request, at_unix_nanos, marks)
    }
}
