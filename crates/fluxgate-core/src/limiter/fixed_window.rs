//! The fixed window: a counter per window aligned on the Unix epoch.
//!
//! Windows are `[k × window, (k + 1) × window)` in Unix time, the same on every backend and
//! every instance. A request of `permits` is admitted when `count + permits <= capacity`;
//! the count starts over at each window. Across a boundary a client may get up to twice the
//! capacity in a short time (the end of one window, then the start of the next): that is
//! the algorithm, not a defect of this implementation.

use super::{Eval, Wait};
use std::time::Duration;

/// A band's stored state: the end of the window it counts, the count, and the permits
/// reserved in the window after it by requests waiting for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Window {
    /// The end of the counted window, in nanoseconds since the Unix epoch.
    pub end: u64,
    /// Permits admitted in that window.
    pub count: u64,
    /// Permits reserved in the next window (`[end, end + window)`).
    pub next: u64,
}

impl Window {
    /// The counts of the window ending at `end` and of the one after it, as of a time in
    /// the window ending at `end`.
    fn at(state: Option<Window>, end: u64, window_nanos: u64) -> (u64, u64) {
        match state {
            Some(s) if s.end == end => (s.count, s.next),
            Some(s) if s.end.checked_add(window_nanos) == Some(end) => (s.next, 0),
            _ => (0, 0),
        }
    }
}

/// The window `[start, end)` holding `now`.
pub(crate) fn bounds(now: u64, window_nanos: u64) -> (u64, u64) {
    let start = now - now % window_nanos;
    (start, start.saturating_add(window_nanos))
}

/// Evaluates a band of `capacity` per `window_nanos` for a request of `permits` at `now`.
///
/// ```
/// use fluxgate_core::limiter::fixed_window::evaluate;
/// const S: u64 = 1_000_000_000;
/// // 2 per second: two at 10.9 s, the third waits for the window at 11 s.
/// let a = evaluate(None, 10_900_000_000, 2, S, 1);
/// let b = evaluate(Some(a.next), 10_900_000_000, 2, S, 1);
/// let c = evaluate(Some(b.next), 10_900_000_000, 2, S, 1);
/// assert!(a.allowed && b.allowed && !c.allowed);
/// assert_eq!(c.wait, fluxgate_core::limiter::Wait::After(std::time::Duration::from_millis(100)));
/// assert!(evaluate(Some(b.next), 11 * S, 2, S, 1).allowed);
/// ```
pub fn evaluate(state: Option<Window>, now: u64, capacity: u64, window_nanos: u64, permits: u64) -> Eval<Window> {
    let (_, end) = bounds(now, window_nanos);
    let (count, next) = Window::at(state, end, window_nanos);
    let count = count.min(capacity);
    let remaining_now = capacity - count;
    let reset_now = if count > 0 { end - now } else { 0 };
    let rejected = |wait| Eval::rejected(state.unwrap_or_default(), remaining_now, reset_now, wait);
    if permits > capacity {
        return rejected(Wait::Never);
    }
    if count + permits > capacity {
        return rejected(Wait::After(Duration::from_nanos((end - now).max(1))));
    }
    let count = count + permits;
    Eval {
        allowed: true,
        next: Window { end, count, next },
        remaining_after: capacity - count,
        remaining_now,
        reset_after: end - now,
        reset_now,
        wait: Wait::None,
    }
}

/// The state after reserving `permits` at `at` (not before `now`) for a request that
/// waits until then, if the band admits them there: in the window of `now` or the next
/// one, which the state keeps apart; `None` otherwise.
pub(crate) fn reserve(
    state: Option<Window>,
    now: u64,
    at: u64,
    capacity: u64,
    window_nanos: u64,
    permits: u64,
) -> Option<Window> {
    let (_, end) = bounds(now, window_nanos);
    let (count, next) = Window::at(state, end, window_nanos);
    let (_, end_at) = bounds(at, window_nanos);
    if end_at == end {
        (count + permits <= capacity).then_some(Window {
            end,
            count: count + permits,
            next,
        })
    } else if Some(end_at) == end.checked_add(window_nanos) {
        (next + permits <= capacity).then_some(Window {
            end,
            count,
            next: next + permits,
        })
    } else {
        None
    }
}

/// The state after giving back `permits` taken at `at`: from its window's count, if the
/// state still counts that window.
pub(crate) fn give_back(state: Window, at: u64, window_nanos: u64, permits: u64) -> Window {
    let (_, end_at) = bounds(at, window_nanos);
    let mut state = state;
    if state.end == end_at {
        state.count = state.count.saturating_sub(permits);
    } else if state.end.checked_add(window_nanos) == Some(end_at) {
        state.next = state.next.saturating_sub(permits);
    }
    state
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn the_boundary_burst_is_twice_the_capacity() {
        // 10 per minute: 10 in the last second of one window and 10 in the first second
        // of the next: 20 within two seconds.
        let w = 60 * SEC;
        let mut state = None;
        let mut admitted = 0;
        for t in [59 * SEC, 61 * SEC] {
            for _ in 0..11 {
                let e = evaluate(state, t, 10, w, 1);
                if e.allowed {
                    admitted += 1;
                    state = Some(e.next);
                }
            }
        }
        assert_eq!(admitted, 20);
    }

    #[test]
    fn rejections_keep_the_count() {
        let mut state = None;
        for permits in [3, 5] {
            let e = evaluate(state, SEC, 10, 60 * SEC, permits);
            assert!(e.allowed);
            state = Some(e.next);
        }
        let e = evaluate(state, SEC, 10, 60 * SEC, 3);
        assert!(!e.allowed);
        assert_eq!(e.remaining_now, 2);
        assert_eq!(e.next, state.unwrap());
        assert_eq!(e.wait, Wait::After(Duration::from_secs(59)));
        assert_eq!(e.reset_now, 59 * SEC);
        assert_eq!(evaluate(state, SEC, 10, 60 * SEC, 11).wait, Wait::Never);
    }
}
