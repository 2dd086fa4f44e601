//! [`CircuitBreaker`]: stop waiting for a backend that is down.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{AcquireOutcome, AcquireRequest, RateLimiter};
use crate::error::BoxError;
use crate::future::MaybeReady;

/// The error of a call refused because the circuit is open.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the rate-limit backend is unavailable (circuit open after repeated failures)")]
pub struct CircuitOpen;

/// Wraps a backend: after `failure_threshold` failures in a row the circuit opens and calls
/// fail at once, without waiting for the backend's deadline; after `cool_down` one call is
/// let through as a probe, and its success closes the circuit again.
///
/// ```
/// use std::time::Duration;
/// use fluxgate_core::limiter::CircuitBreaker;
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
    origin: Instant,
    threshold: u32,
    cool_down: Duration,
    failures: AtomicU32,
    /// Nanoseconds since `origin` until which the circuit is open; 0 when closed.
    open_until: AtomicU64,
    probing: AtomicBool,
}

impl State {
    fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    fn succeeded(&self) {
        self.failures.store(0, Ordering::Relaxed);
        self.probing.store(false, Ordering::Relaxed);
        if self.open_until.swap(0, Ordering::AcqRel) != 0 {
            tracing::warn!("rate-limit backend is back: circuit closed");
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
        self.probing.store(false, Ordering::Relaxed);
    }
}

impl<L> CircuitBreaker<L> {
    /// A breaker that opens after 3 failures in a row and probes every 250 ms.
    pub fn new(inner: L) -> Self {
        Self {
            inner,
            state: Arc::new(State {
                origin: Instant::now(),
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

    fn rebuild(&mut self, f: impl FnOnce(&mut State)) {
        let mut state = State {
            origin: self.state.origin,
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
    fn acquire(&self, request: &AcquireRequest<'_>) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        let state = &self.state;
        let until = state.open_until.load(Ordering::Acquire);
        let probe = until != 0;
        if probe && (until > state.now() || state.probing.swap(true, Ordering::AcqRel)) {
            // Open, or half-open with a probe already in flight.
            return MaybeReady::ready(Err(Box::new(CircuitOpen)));
        }
        let state = self.state.clone();
        self.inner.acquire(request).map(move |result| {
            match &result {
                Ok(_) => state.succeeded(),
                Err(_) => state.failed(probe),
            }
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// A backend that fails while `down` is set, and counts its calls.
    #[derive(Debug, Default)]
    struct Flaky {
        down: AtomicBool,
        calls: AtomicUsize,
    }

    impl RateLimiter for Arc<Flaky> {
        fn acquire(&self, _: &AcquireRequest<'_>) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                return MaybeReady::ready(Err("down".into()));
            }
            MaybeReady::ready(Ok(AcquireOutcome {
                allowed: true,
                shadow_allowed: true,
                now_unix_nanos: 0,
                bands: Vec::new(),
            }))
        }
    }

    #[test]
    fn opens_after_the_threshold_probes_and_closes() {
        let flaky = Arc::new(Flaky::default());
        let breaker = CircuitBreaker::new(flaky.clone())
            .failure_threshold(2)
            .cool_down(Duration::from_millis(30));
        let call = || breaker.acquire(&AcquireRequest::default()).into_ready().unwrap();
        assert!(call().is_ok());
        flaky.down.store(true, Ordering::SeqCst);
        assert!(call().is_err());
        assert!(!breaker.is_open());
        assert!(call().is_err());
        assert!(breaker.is_open());
        // Open: refused without calling the backend.
        let before = flaky.calls.load(Ordering::SeqCst);
        for _ in 0..10 {
            assert!(call().unwrap_err().is::<CircuitOpen>());
        }
        assert_eq!(flaky.calls.load(Ordering::SeqCst), before);
        // A failed probe keeps it open for another cool-down.
        std::thread::sleep(Duration::from_millis(40));
        assert!(!call().unwrap_err().is::<CircuitOpen>());
        assert!(breaker.is_open());
        // The backend is back: the next probe closes the circuit.
        flaky.down.store(false, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(40));
        assert!(call().is_ok());
        assert!(!breaker.is_open());
        assert!(call().is_ok());
    }
}
