//! [`LogThrottle`]: at most one warning of a kind per period.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// At most one warning of one kind per period: the first at once, then the first after
/// each period, which says how many it held back since the last. What it holds back is
/// for debug level.
///
/// A backend that is down without a [`CircuitBreaker`](super::CircuitBreaker) fails
/// every request: without a throttle, an outage would write a warning per request. The
/// engine's failure policies keep one for the requests a `fail_closed` rule refuses and
/// one for those the other policies decide; a [`FallbackHandler`](super::FallbackHandler)
/// and each tower layer's `on_error` keep one each. An outage writes at most one warning
/// from each per [`LogThrottle::EVERY`], and the engine's recorder still counts every
/// failure. The count
/// a warning gives is of the occurrences since the previous warning, which may be long
/// ago.
///
/// ```
/// use std::time::Duration;
/// use fluxgate_core::failure::LogThrottle;
///
/// let warnings = LogThrottle::new(Duration::from_secs(3600));
/// assert_eq!(warnings.due(), Some(0)); // the first: warn
/// assert_eq!(warnings.due(), None); // within the hour: debug level
/// assert_eq!(warnings.due(), None);
/// // An hour later, `due` gives `Some(2)`: warn, saying two were held back.
/// ```
#[derive(Debug)]
pub struct LogThrottle {
    start: Instant,
    every_ms: u64,
    /// The time of the last warning, in ms since `start`, plus one (0: never warned).
    last: AtomicU64,
    /// The occurrences held back since the last warning.
    held: AtomicU64,
}

impl LogThrottle {
    /// The period of the crate's own throttles.
    pub const EVERY: Duration = Duration::from_secs(10);

    /// At most one warning per `every`.
    pub fn new(every: Duration) -> Self {
        Self {
            start: Instant::now(),
            every_ms: u64::try_from(every.as_millis()).unwrap_or(u64::MAX),
            last: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    /// Whether an occurrence is to be warned of now: `Some` with the number held back
    /// since the last warning, or `None`, counted as held back (for debug level).
    pub fn due(&self) -> Option<u64> {
        let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.due_at(now)
    }

    /// [`due`](Self::due) at `now`, in ms since the throttle was made.
    fn due_at(&self, now: u64) -> Option<u64> {
        let now = now.saturating_add(1); // 0 is never
        let last = self.last.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= self.every_ms)
            && self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            Some(self.held.swap(0, Ordering::Relaxed))
        } else {
            self.held.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

impl Default for LogThrottle {
    /// At most one warning per [`LogThrottle::EVERY`].
    fn default() -> Self {
        Self::new(Self::EVERY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_warns_then_one_per_period_with_the_count_held_back() {
        let throttle = LogThrottle::new(Duration::from_millis(100));
        assert_eq!(throttle.due_at(0), Some(0));
        assert_eq!(throttle.due_at(1), None);
        assert_eq!(throttle.due_at(99), None);
        assert_eq!(throttle.due_at(100), Some(2));
        assert_eq!(throttle.due_at(150), None);
        assert_eq!(throttle.due_at(5_000), Some(1));
        assert_eq!(throttle.due_at(5_001), None);
    }

    #[test]
    fn a_zero_period_warns_every_time() {
        let throttle = LogThrottle::new(Duration::ZERO);
        for now in [0, 0, 1, 1, 7] {
            assert_eq!(throttle.due_at(now), Some(0));
        }
    }

    #[test]
    fn the_end_of_the_clock_neither_panics_nor_warns_twice() {
        let throttle = LogThrottle::new(Duration::MAX);
        assert_eq!(throttle.due_at(u64::MAX), Some(0));
        assert_eq!(throttle.due_at(u64::MAX), None);
        assert_eq!(throttle.due_at(0), None);
    }
}
