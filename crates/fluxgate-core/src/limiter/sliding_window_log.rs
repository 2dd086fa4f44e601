//! The sliding window log: one entry per admitted request, exact.
//!
//! A request of `permits` at `now` is admitted when the permits of the entries newer than
//! `now − window` plus its own stay within the capacity. Every admitted request is its own
//! entry, so requests at the same instant are all counted (the seed's undercounting fix; in
//! Redis each entry is a unique sorted-set member). The log holds at most `capacity`
//! permits' worth of entries per key, and those of requests waiting for a later instant
//! (`on_limit.wait`, at most `max_waiters` of them): exact, at the price of memory.

use std::collections::VecDeque;
use std::time::Duration;

use super::{Eval, Wait};

/// A band's log: the admitted requests of the last window, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Log {
    /// `(instant in nanoseconds since the Unix epoch, permits)`, oldest first.
    entries: VecDeque<(u64, u64)>,
    /// The permits of all entries (expired ones included until the next commit).
    total: u64,
}

impl Log {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    /// The instant of the newest entry, if any.
    pub fn newest(&self) -> Option<u64> {
        self.entries.back().map(|e| e.0)
    }

    /// The number of entries held (expired ones included until the next commit).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The permits of all its entries, expired ones included until the next commit.
    pub(crate) fn held(&self) -> u64 {
        self.total
    }

    /// Whether the log holds no entry.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The first entry still inside the window at `now`.
    fn live_from(&self, now: u64, window_nanos: u64) -> usize {
        let horizon = now.saturating_sub(window_nanos);
        self.entries.partition_point(|e| e.0 <= horizon)
    }

    /// Records an admitted request and drops the entries that left the window.
    pub fn commit(&mut self, now: u64, window_nanos: u64, permits: u64) {
        self.record(now, now, window_nanos, permits);
    }

    /// Records a request admitted at `at` (a request waiting until then, or `now`) and
    /// drops the entries that left the window as of `now`.
    pub(crate) fn record(&mut self, now: u64, at: u64, window_nanos: u64, permits: u64) {
        let live = self.live_from(now, window_nanos);
        let expired: u64 = self.entries.drain(..live).map(|e| e.1).sum();
        self.total = self.total - expired + permits;
        // After the entries of requests that wait for a later instant, if any: the log
        // stays in time order.
        let place = self.entries.partition_point(|e| e.0 <= at);
        self.entries.insert(place, (at, permits));
    }

    /// Gives back `permits` of the entries at `at`, the newest first.
    pub(crate) fn give_back(&mut self, at: u64, permits: u64) {
        let mut left = permits;
        while left > 0 {
            let Some(i) = self.entries.iter().rposition(|e| e.0 == at) else {
                break;
            };
            let taken = self.entries[i].1.min(left);
            self.entries[i].1 -= taken;
            self.total -= taken;
            left -= taken;
            if self.entries[i].1 == 0 {
                self.entries.remove(i);
            }
        }
    }

    /// Whether `permits` more at `at` (not before `now`) fit: every window holding `at`
    /// keeps to the capacity, counting every entry after `at − window`, those of
    /// requests that wait for a later instant as well.
    pub(crate) fn admits_at(&self, at: u64, capacity: u64, window_nanos: u64, permits: u64) -> bool {
        let (count, _) = self.count(at, window_nanos);
        count.saturating_add(permits) <= capacity
    }

    /// The permits of the entries inside the window at `now`, and the first of them.
    fn count(&self, now: u64, window_nanos: u64) -> (u64, usize) {
        let live = self.live_from(now, window_nanos);
        let expired: u64 = self.entries.range(..live).map(|e| e.1).sum();
        (self.total - expired, live)
    }
}

/// Evaluates a band of `capacity` per `window_nanos` for a request of `permits` at `now`.
/// The log is only read; call [`Log::commit`] when the request is admitted.
///
/// ```
/// use fluxgate_core::limiter::sliding_window_log::{evaluate, Log};
/// const S: u64 = 1_000_000_000;
/// let mut log = Log::new();
/// for _ in 0..3 {
///     // Three requests in the same nanosecond: all three count.
///     assert!(evaluate(&log, 5 * S, 3, S, 1).allowed);
///     log.commit(5 * S, S, 1);
/// }
/// assert!(!evaluate(&log, 5 * S, 3, S, 1).allowed);
/// assert!(evaluate(&log, 6 * S, 3, S, 3).allowed);
/// ```
pub fn evaluate(log: &Log, now: u64, capacity: u64, window_nanos: u64, permits: u64) -> Eval<()> {
    let (count, live) = log.count(now, window_nanos);
    let count = count.min(capacity);
    let remaining_now = capacity - count;
    let reset_now = match log.newest() {
        Some(t) if count > 0 => t + window_nanos - now,
        _ => 0,
    };
    let rejected = |wait| Eval::rejected((), remaining_now, reset_now, wait);
    if permits > capacity {
        return rejected(Wait::Never);
    }
    if count + permits > capacity {
        // The oldest entries leave first; wait for enough of them.
        let mut left = count;
        let mut wait = 1;
        for &(t, p) in log.entries.range(live..) {
            left -= p.min(left);
            if left + permits <= capacity {
                wait = (t + window_nanos - now).max(1);
                break;
            }
        }
        return rejected(Wait::After(Duration::from_nanos(wait)));
    }
    Eval {
        allowed: true,
        next: (),
        remaining_after: capacity - count - permits,
        remaining_now,
        reset_after: window_nanos,
        reset_now,
        wait: Wait::None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn exact_over_the_sliding_window() {
        // 3 per second at 0, 0.4 and 0.8 s: the fourth waits for the first to leave at 1 s.
        const T: u64 = 1_700_000_000 * SEC;
        let ms = |n: u64| T + n * 1_000_000;
        let mut log = Log::new();
        for t in [ms(0), ms(400), ms(800)] {
            assert!(evaluate(&log, t, 3, SEC, 1).allowed);
            log.commit(t, SEC, 1);
        }
        let e = evaluate(&log, ms(900), 3, SEC, 1);
        assert!(!e.allowed);
        assert_eq!(e.wait, Wait::After(Duration::from_millis(100)));
        assert_eq!(e.reset_now, 900_000_000);
        // permits 2 wait for the second entry too.
        let e = evaluate(&log, ms(900), 3, SEC, 2);
        assert_eq!(e.wait, Wait::After(Duration::from_millis(500)));
        assert!(!evaluate(&log, ms(999), 3, SEC, 1).allowed);
        assert!(evaluate(&log, ms(1000), 3, SEC, 1).allowed);
        assert!(!evaluate(&log, ms(1000), 3, SEC, 2).allowed);
        log.commit(ms(1000), SEC, 1);
        assert_eq!(log.len(), 3, "the expired entry is dropped on commit");
    }

    #[test]
    fn permits_beyond_capacity_never_admit() {
        assert_eq!(evaluate(&Log::new(), 0, 3, SEC, 4).wait, Wait::Never);
    }
}
