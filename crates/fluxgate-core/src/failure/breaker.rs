//! [`CircuitBreaker`]: stop waiting for a backend that is down.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, SystemClock};
use crate::context::RequestContext;
use crate::decision::Decision;
use crate::error::Error;
use crate::error::{BoxError, RuleError};
use crate::future::{MaybeReady, Settled};
use crate::handler::RateLimitHandler;
use crate::limiter::{is_rule_error, is_store_full, AcquireOutcome, AcquireRequest, RateLimiter};
use crate::rule::{Rule, RuleSet};

/// The error of a call refused because the circuit is open.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the rate-limit backend is unavailable (circuit open after repeated failures)")]
pub struct CircuitOpen;

/// Wraps a backend: after `failure_threshold` failures in a row the circuit opens and calls
/// fail at once, without waiting for the backend's deadline; after `cool_down` one call is
/// let through as a probe, and its success closes the circuit again.
///
/// Only the backend's own answers count. A call that is abandoned (its future dropped: a
/// client gone, an outer timeout) counts neither way, and a probe abandoned before its call
/// went out lets the next call probe. A probe abandoned once its call is out runs to its
/// end, and its answer counts; no other call probes meanwhile, so wrap a backend whose
/// calls end within a deadline (the Redis limiter's, the rate-limit service's handler's). An answer the backend gave from local knowledge
/// ([`AcquireOutcome::local`], a deny-cache hit) is no evidence that the store is back,
/// and a configuration error ([`RuleError`]) is no failure of the backend: neither
/// resets the failure count nor closes the circuit, and neither opens it. A backend whose
/// store is full ([`StoreFull`](crate::limiter::StoreFull): Redis out of memory) answers
/// within its deadline and still refuses what it would refuse: that answer counts as one,
/// and the circuit stays closed, so that only the requests it would admit go to the
/// failure policy.
///
/// ```
/// use std::time::Duration;
/// use fluxgate_core::CircuitBreaker;
/// use fluxgate_core::MemoryLimiter;
/// let guarded = CircuitBreaker::new(MemoryLimiter::default())
///     .failure_threshold(3)
///     .cool_down(Duration::from_millis(250));
/// assert!(!guarded.is_open());
/// ```
pub struct CircuitBreaker<L> {
    inner: L,
    state: Arc<State>,
}

struct State {
    clock: Arc<dyn Clock>,
    threshold: u32,
    cool_down: Duration,
    failures: AtomicU32,
    /// The clock's reading until which the circuit is open; 0 when closed.
    open_until: AtomicU64,
    /// Whether a probe is in flight.
    probing: AtomicBool,
}

impl State {
    fn now(&self) -> u64 {
        self.clock.now_nanos().max(1)
    }

    fn succeeded(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if self.open_until.swap(0, Ordering::AcqRel) != 0 {
            tracing::warn!("rate-limit backend is back: circuit closed");
        }
    }

    /// Counts a limiter's answer to a call (a `probe` or not).
    fn acquired(&self, result: &Result<AcquireOutcome, BoxError>, probe: bool) {
        match result {
            // A local answer or a configuration error says nothing about the backend.
            Ok(outcome) if outcome.local => {}
            Err(error) if is_rule_error(error) => {}
            Err(error) if is_store_full(&**error) => self.succeeded(),
            Ok(_) => self.succeeded(),
            Err(_) => self.failed(probe),
        }
    }

    /// The answer of the call `call` makes, counted; `None`, without the call, while the
    /// circuit is open or half-open with a probe already in flight. A probe dropped once its
    /// call is out is still answered, and counted (see [`Probe`]).
    fn guard<T: Counted>(self: &Arc<Self>, call: impl FnOnce() -> MaybeReady<T>) -> Option<MaybeReady<T>> {
        let until = self.open_until.load(Ordering::Acquire);
        let probe = until != 0;
        if probe && (until > self.now() || self.probing.swap(true, Ordering::AcqRel)) {
            return None;
        }
        let answer = call();
        let state = self.clone();
        if !probe {
            return Some(answer.map(move |answer| {
                answer.count(&state, false);
                answer
            }));
        }
        let probe = Probe(state);
        Some(match answer.into_ready() {
            Ok(answer) => {
                answer.count(&probe.0, true);
                MaybeReady::ready(answer)
            }
            Err(pending) => MaybeReady::boxed(async move {
                let (probe, answer) = Settled::new(pending, probe, Probe::abandoned).await;
                answer.count(&probe.0, true);
                answer
            }),
        })
    }

    /// Counts a handler's answer to a check (a `probe` or not).
    fn checked(&self, result: &Result<Decision, Error>, probe: bool) {
        match result {
            Err(Error::Backend(error)) if is_store_full(&**error) => self.succeeded(),
            Err(Error::Backend(_)) => self.failed(probe),
            // An answer, or an error that says nothing of the service's health.
            _ => self.succeeded(),
        }
    }

    fn failed(&self, probe: bool) {
        let failures = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if probe || failures >= self.threshold {
            let cool_down = u64::try_from(self.cool_down.as_nanos()).unwrap_or(u64::MAX);
            let was = self
                .open_until
                .swap(self.now().saturating_add(cool_down), Ordering::AcqRel);
            if was == 0 {
                tracing::warn!(failures, "rate-limit backend failing: circuit open");
            }
        }
    }
}

/// Held by a probe in flight: when the probe ends, however it ends (answered, failed or
/// its future dropped), the next call may probe.
///
/// A probe whose future is dropped once its call is out is still answered: the call runs
/// to its end and its answer counts ([`Settled`]), the next call probing only then. Its
/// answer was lost before, and a client that dropped every probe it made as soon as it was
/// sent (an HTTP/2 stream reset) kept the circuit half-open with Redis back, every request
/// arriving while its probe was out answered by the failure policy (`fail_open` admitted
/// 1,520 of a client's requests over 2 s under a limit of 5).
struct Probe(Arc<State>);

impl Probe {
    /// A probe dropped before its answer: the answer it got after all, if any.
    fn abandoned<T: Counted>(self, answer: Option<T>) {
        if let Some(answer) = &answer {
            answer.count(&self.0, true);
        }
    }
}

/// An answer the breaker counts: a limiter's to a call, a handler's to a check.
trait Counted: Send + 'static {
    /// Counts it (the answer to a `probe` or not).
    fn count(&self, state: &State, probe: bool);
}

impl Counted for Result<AcquireOutcome, BoxError> {
    fn count(&self, state: &State, probe: bool) {
        state.acquired(self, probe);
    }
}

impl Counted for Result<Decision, Error> {
    fn count(&self, state: &State, probe: bool) {
        state.checked(self, probe);
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.0.probing.store(false, Ordering::Release);
    }
}

impl<L> CircuitBreaker<L> {
    /// A breaker that opens after 3 failures in a row and probes every 250 ms.
    pub fn new(inner: L) -> Self {
        Self {
            inner,
            state: Arc::new(State {
                clock: Arc::new(SystemClock::new()),
                threshold: 3,
                cool_down: Duration::from_millis(250),
                failures: AtomicU32::new(0),
                open_until: AtomicU64::new(0),
                probing: AtomicBool::new(false),
            }),
        }
    }

    /// Failures in a row that open the circuit (at least 1). Default 3.
    pub fn failure_threshold(mut self, failures: u32) -> Self {
        self.rebuild(|s| s.threshold = failures.max(1));
        self
    }

    /// How long the circuit stays open before a probe. Default 250 ms.
    pub fn cool_down(mut self, cool_down: Duration) -> Self {
        self.rebuild(|s| s.cool_down = cool_down);
        self
    }

    /// The clock that times the cool-down. Default [`SystemClock`]; tests use a
    /// [`ManualClock`](crate::ManualClock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        let clock: Arc<dyn Clock> = Arc::new(clock);
        self.rebuild(|s| s.clock = clock);
        self
    }

    fn rebuild(&mut self, f: impl FnOnce(&mut State)) {
        let mut state = State {
            clock: self.state.clock.clone(),
            threshold: self.state.threshold,
            cool_down: self.state.cool_down,
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            probing: AtomicBool::new(false),
        };
        f(&mut state);
        self.state = Arc::new(state);
    }

    /// Whether calls are refused right now.
    pub fn is_open(&self) -> bool {
        let until = self.state.open_until.load(Ordering::Acquire);
        until != 0 && until > self.state.now()
    }

    /// Whether the circuit has opened and not closed since: refusing calls, or waiting for
    /// a probe to succeed.
    pub fn is_tripped(&self) -> bool {
        self.state.open_until.load(Ordering::Acquire) != 0
    }

    /// The wrapped backend.
    pub fn get_ref(&self) -> &L {
        &self.inner
    }
}

impl<L: fmt::Debug> fmt::Debug for CircuitBreaker<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreaker")
            .field("inner", &self.inner)
            .field("threshold", &self.state.threshold)
            .field("cool_down", &self.state.cool_down)
            .field("open", &self.is_open())
            .finish()
    }
}

impl<L: RateLimiter> RateLimiter for CircuitBreaker<L> {
    fn acquire(&self, request: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        // Open, or half-open with a probe already in flight: failed at once, but for a
        // refusal the backend knows without its store (a Redis limiter's deny cache): a
        // client whose limit is known to be spent is refused, not left to the failure
        // policy, which may admit.
        self.state.guard(|| self.inner.acquire(request)).unwrap_or_else(|| {
            MaybeReady::ready(
                self.inner
                    .refused_locally(request)
                    .map_or_else(|| Err(Box::new(CircuitOpen) as BoxError), Ok),
            )
        })
    }

    fn validate(&self, set: &RuleSet) -> Result<(), RuleError> {
        self.inner.validate(set)
    }

    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }

    fn gives_back(&self) -> bool {
        self.inner.gives_back()
    }

    fn is_local(&self) -> bool {
        self.inner.is_local()
    }

    fn reads_key_text(&self) -> bool {
        self.inner.reads_key_text()
    }

    fn check_wait(&self, set: &RuleSet, rule: &Rule, max_wait: Duration) -> Result<(), RuleError> {
        self.inner.check_wait(set, rule, max_wait)
    }

    /// Passed on whether the breaker is open or not: what a lease took must go back.
    fn give_back(&self, request: &AcquireRequest, decided_unix_nanos: u64) -> MaybeReady<Result<(), BoxError>> {
        self.inner.give_back(request, decided_unix_nanos)
    }

    /// Passed on whether the breaker is open or not, as [`give_back`](Self::give_back).
    fn give_back_place(
        &self,
        request: &AcquireRequest,
        at_unix_nanos: u64,
        marks: &[u128],
    ) -> MaybeReady<Result<(), BoxError>> {
        self.inner.give_back_place(request, at_unix_nanos, marks)
    }

    /// Passed on whether the breaker is open or not: it decides nothing.
    fn charge(&self, request: &AcquireRequest) {
        self.inner.charge(request)
    }

    fn refused_locally(&self, request: &AcquireRequest) -> Option<AcquireOutcome> {
        self.inner.refused_locally(request)
    }
}

/// Guards a remote [`RateLimitHandler`] (the rate-limit service) as it guards a limiter:
/// after `failure_threshold` backend failures in a row ([`Error::Backend`]), checks fail at
/// once with [`CircuitOpen`] for the cool-down, then one probe goes through. The failure
/// policy (the layer's `on_error`) decides what such a failure means for the request.
impl<H: RateLimitHandler> RateLimitHandler for CircuitBreaker<H> {
    fn check(&self, ctx: &RequestContext) -> MaybeReady<Result<Decision, Error>> {
        self.state
            .guard(|| self.inner.check(ctx))
            .unwrap_or_else(|| MaybeReady::ready(Err(Error::Backend(Box::new(CircuitOpen)))))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Mutex;

    use std::future::Future;

    use super::*;
    use crate::clock::ManualClock;

    /// What the test backend answers.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Answer {
        Up,
        Down,
        /// Admitted from local knowledge (a deny-cache hit).
        Local,
        /// A rule the backend cannot decide.
        BadRule,
        /// Never answers.
        Hang,
        /// Answers, once polled again.
        Later,
    }

    /// A backend that answers as told, and counts its calls.
    #[derive(Debug)]
    struct Backend {
        answer: Mutex<Answer>,
        calls: AtomicUsize,
    }

    impl Backend {
        fn new() -> Arc<Self> {
            Arc::new(Self {
                answer: Mutex::new(Answer::Up),
                calls: AtomicUsize::new(0),
            })
        }
        fn set(&self, answer: Answer) {
            *self.answer.lock().unwrap() = answer;
        }
        fn calls(&self) -> usize {
            self.calls.load(Ordering::SeqCst)
        }
    }

    impl RateLimiter for Arc<Backend> {
        fn acquire(&self, _: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let outcome = |local| AcquireOutcome {
                allowed: true,
                shadow_allowed: true,
                now_unix_nanos: 0,
                bands: crate::decision::Bands::new(),
                local,
                admitted_after: std::time::Duration::ZERO,
                marks: Vec::new(),
            };
            match *self.answer.lock().unwrap() {
                Answer::Up => MaybeReady::ready(Ok(outcome(false))),
                Answer::Local => MaybeReady::ready(Ok(outcome(true))),
                Answer::Down => MaybeReady::ready(Err("down".into())),
                Answer::BadRule => MaybeReady::ready(Err(Box::new(RuleError::invalid("s", "r", "bands", "too large")))),
                Answer::Hang => MaybeReady::boxed(std::future::pending()),
                Answer::Later => MaybeReady::boxed(async move {
                    tokio::task::yield_now().await;
                    Ok(outcome(false))
                }),
            }
        }
    }

    const COOL_DOWN: Duration = Duration::from_millis(250);

    fn empty_request() -> AcquireRequest {
        let rules: [crate::rule::Rule; 0] = [];
        AcquireRequest::new(Arc::new(crate::rule::RuleSet::new("s", rules).unwrap()))
    }

    fn breaker(backend: &Arc<Backend>, clock: &ManualClock) -> CircuitBreaker<Arc<Backend>> {
        CircuitBreaker::new(backend.clone())
            .failure_threshold(2)
            .cool_down(COOL_DOWN)
            .clock(clock.clone())
    }

    fn call(breaker: &CircuitBreaker<Arc<Backend>>) -> Result<AcquireOutcome, BoxError> {
        breaker.acquire(&empty_request()).into_ready().expect("a ready answer")
    }

    /// Opens the circuit of a breaker with a threshold of 2.
    fn trip(backend: &Backend, breaker: &CircuitBreaker<Arc<Backend>>) {
        backend.set(Answer::Down);
        assert!(call(breaker).is_err());
        assert!(call(breaker).is_err());
        assert!(breaker.is_open());
    }

    #[test]
    fn opens_after_the_threshold_probes_and_closes() {
        let (backend, clock) = (Backend::new(), ManualClock::new(1_000_000_000));
        let breaker = breaker(&backend, &clock);
        assert!(call(&breaker).is_ok());
        backend.set(Answer::Down);
        assert!(call(&breaker).is_err());
        assert!(!breaker.is_open());
        assert!(call(&breaker).is_err());
        assert!(breaker.is_open());
        // Open: refused without calling the backend, until the cool-down has passed.
        let before = backend.calls();
        for _ in 0..10 {
            assert!(call(&breaker).unwrap_err().is::<CircuitOpen>());
        }
        clock.advance(COOL_DOWN - Duration::from_nanos(1));
        assert!(call(&breaker).unwrap_err().is::<CircuitOpen>());
        assert_eq!(backend.calls(), before);
        // A failed probe keeps it open for another cool-down.
        clock.advance(Duration::from_nanos(1));
        assert!(!call(&breaker).unwrap_err().is::<CircuitOpen>());
        assert_eq!(backend.calls(), before + 1);
        assert!(breaker.is_open());
        // The backend is back: the next probe closes the circuit.
        backend.set(Answer::Up);
        clock.advance(COOL_DOWN);
        assert!(call(&breaker).is_ok());
        assert!(!breaker.is_open() && !breaker.is_tripped());
        assert!(call(&breaker).is_ok());
    }

    /// A call the backend has not answered yet.
    type Pending = MaybeReady<Result<AcquireOutcome, BoxError>>;

    /// A breaker whose circuit opened and whose cool-down has just passed, and a probe
    /// sent to a backend that does not answer.
    fn probe_in_flight() -> (Arc<Backend>, CircuitBreaker<Arc<Backend>>, Pending) {
        let (backend, clock) = (Backend::new(), ManualClock::new(1_000_000_000));
        let breaker = breaker(&backend, &clock);
        trip(&backend, &breaker);
        clock.advance(COOL_DOWN);
        backend.set(Answer::Hang);
        let probe = breaker.acquire(&empty_request());
        (backend, breaker, probe)
    }

    #[test]
    fn a_dropped_probe_lets_the_next_call_probe() {
        // The probe's future is dropped before the backend answers (a client gone, an
        // outer timeout).
        let (backend, breaker, probe) = probe_in_flight();
        assert!(probe.into_ready().is_err(), "the probe is in flight");
        // Backend back: the next call probes and closes the circuit.
        backend.set(Answer::Up);
        assert!(call(&breaker).is_ok(), "the circuit stayed open after a dropped probe");
        assert!(!breaker.is_tripped());
    }

    /// A probe dropped once polled (its call out) is answered all the same, and its
    /// answer counts: the backend is back, the circuit closes. Until then the probe is in
    /// flight, and no other call probes.
    #[tokio::test]
    async fn a_probe_dropped_once_out_is_answered() {
        let (backend, clock) = (Backend::new(), ManualClock::new(1_000_000_000));
        let breaker = breaker(&backend, &clock);
        trip(&backend, &breaker);
        clock.advance(COOL_DOWN);
        backend.set(Answer::Later);
        let mut probe = breaker.acquire(&empty_request());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(
            std::pin::Pin::new(&mut probe).poll(&mut cx).is_pending(),
            "the probe is out"
        );
        drop(probe);
        assert!(
            call(&breaker).unwrap_err().is::<CircuitOpen>(),
            "the probe is still out"
        );
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!breaker.is_tripped(), "the dropped probe's answer was lost");
        assert_eq!(backend.calls(), 3, "two failures and the probe");
    }

    #[test]
    fn a_probe_in_flight_refuses_other_calls() {
        let (backend, breaker, probe) = probe_in_flight();
        backend.set(Answer::Up);
        assert!(call(&breaker).unwrap_err().is::<CircuitOpen>());
        drop(probe);
        assert!(call(&breaker).is_ok());
    }

    #[test]
    fn local_answers_neither_close_the_circuit_nor_reset_the_count() {
        let (backend, clock) = (Backend::new(), ManualClock::new(1_000_000_000));
        let breaker = breaker(&backend, &clock);
        // One failure, a local answer, one more failure: two failures in a row.
        backend.set(Answer::Down);
        assert!(call(&breaker).is_err());
        backend.set(Answer::Local);
        assert!(call(&breaker).is_ok());
        backend.set(Answer::Down);
        assert!(call(&breaker).is_err());
        assert!(breaker.is_open(), "a local answer reset the failure count");
        // Half-open, a local answer is no probe's success: the circuit stays tripped, and
        // the next call probes again.
        clock.advance(COOL_DOWN);
        backend.set(Answer::Local);
        assert!(call(&breaker).is_ok());
        assert!(breaker.is_tripped(), "a local answer closed the circuit");
        backend.set(Answer::Down);
        assert!(call(&breaker).is_err());
        assert!(breaker.is_open(), "one failed probe reopens the circuit");
    }

    #[test]
    fn rule_errors_are_not_backend_failures() {
        let (backend, clock) = (Backend::new(), ManualClock::new(1_000_000_000));
        let breaker = breaker(&backend, &clock);
        backend.set(Answer::BadRule);
        for _ in 0..5 {
            assert!(is_rule_error(&call(&breaker).unwrap_err()));
        }
        assert!(!breaker.is_tripped(), "configuration errors opened the circuit");
    }

    /// A handler (the rate-limit service's) that fails while told to, and otherwise
    /// answers once polled again.
    #[derive(Debug)]
    struct Service(Arc<std::sync::atomic::AtomicBool>);

    impl RateLimitHandler for Service {
        fn check(&self, _: &RequestContext) -> MaybeReady<Result<Decision, Error>> {
            if self.0.load(Ordering::SeqCst) {
                return MaybeReady::ready(Err(Error::Backend("down".into())));
            }
            MaybeReady::boxed(async {
                tokio::task::yield_now().await;
                Ok(Decision::without_bands("s".into(), crate::decision::Outcome::Admitted))
            })
        }
    }

    /// As [`a_probe_dropped_once_out_is_answered`], for a guarded handler.
    #[tokio::test]
    async fn a_handlers_probe_dropped_once_out_is_answered() {
        let failing = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let clock = ManualClock::new(1_000_000_000);
        let breaker = CircuitBreaker::new(Service(failing.clone()))
            .failure_threshold(1)
            .cool_down(COOL_DOWN)
            .clock(clock.clone());
        let ctx = RequestContext::builder().build();
        assert!(breaker.check(&ctx).into_ready().expect("ready").is_err());
        assert!(breaker.is_open());
        clock.advance(COOL_DOWN);
        failing.store(false, Ordering::SeqCst);
        let mut probe = breaker.check(&ctx);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(
            std::pin::Pin::new(&mut probe).poll(&mut cx).is_pending(),
            "the probe is out"
        );
        drop(probe);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!breaker.is_tripped(), "the dropped probe's answer was lost");
    }
}
