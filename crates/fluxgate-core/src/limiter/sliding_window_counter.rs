//! The sliding window counter: the previous window's count, weighted by the part of it
//! that the sliding window still covers, plus the current window's count.
//!
//! With windows aligned as in [`super::fixed_window`], at `elapsed` into the current window
//! the estimate is `previous × (window − elapsed) / window + current`, and a request of
//! `permits` is admitted when `estimate + permits <= capacity`. The arithmetic is exact
//! (integers scaled by the window in nanoseconds), so the seed's examples hold to the last
//! digit: with a capacity of 10, previous 8 and current 3, the estimate is 7 at half the
//! window (admitted) and 10.2 at a tenth (rejected).

use std::time::Duration;

use super::fixed_window::bounds;
use super::{Eval, Wait};
use crate::num::{div, to_u64};

/// A band's stored state: the end of the current window and the counts of the window
/// before it and of the current one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counter {
    /// The end of the current window, in nanoseconds since the Unix epoch.
    pub end: u64,
    /// Permits admitted in the window before.
    pub previous: u64,
    /// Permits admitted in the current window.
    pub current: u64,
    /// Permits reserved in the window after the current one by requests waiting for it.
    pub next: u64,
}

/// The counts of the window before the one ending at `end`, of that window and of the one
/// after it, as of a time in the window ending at `end`.
fn counts(state: Option<Counter>, end: u64, window_nanos: u64) -> (u64, u64, u64) {
    match state {
        Some(s) if s.end == end => (s.previous, s.current, s.next),
        Some(s) if s.end.checked_add(window_nanos) == Some(end) => (s.current, s.next, 0),
        Some(s)
            if s.end
                .checked_add(window_nanos)
                .and_then(|e| e.checked_add(window_nanos))
                == Some(end) =>
        {
            (s.next, 0, 0)
        }
        _ => (0, 0, 0),
    }
}

/// Evaluates a band of `capacity` per `window_nanos` for a request of `permits` at `now`.
///
/// ```
/// use fluxgate_core::limiter::sliding_window_counter::{evaluate, Counter};
/// const S: u64 = 60_000_000_000; // a minute
/// let state = Counter { end: 2 * S, previous: 8, current: 3, next: 0 };
/// // Half-way: 8 × 0.5 + 3 = 7, admitted.
/// assert!(evaluate(Some(state), S + S / 2, 10, S, 1).allowed);
/// // A tenth of the way: 8 × 0.9 + 3 = 10.2, rejected.
/// assert!(!evaluate(Some(state), S + S / 10, 10, S, 1).allowed);
/// ```
pub fn evaluate(state: Option<Counter>, now: u64, capacity: u64, window_nanos: u64, permits: u64) -> Eval<Counter> {
    let (_, end) = bounds(now, window_nanos);
    let (previous, current, next) = counts(state, end, window_nanos);
    let w = u128::from(window_nanos);
    let c = u128::from(capacity);
    let left = u128::from(end - now); // the part of the previous window still covered
    let (p, q) = (u128::from(previous), u128::from(current));
    // The estimate, in units of 1 / window.
    let used = (p * left + q * w).min(c * w);
    let remaining_now = to_u64(div(c * w - used, w));
    let reset = |current: u128| {
        if next > 0 {
            end - now + 2 * window_nanos
        } else if current > 0 {
            end - now + window_nanos
        } else if previous > 0 {
            end - now
        } else {
            0
        }
    };
    let reset_now = reset(q);
    let rejected = |wait| Eval::rejected(state.unwrap_or_default(), remaining_now, reset_now, wait);
    if permits > capacity {
        return rejected(Wait::Never);
    }
    let cost = u128::from(permits);
    if next > 0 && q + cost + u128::from(next) > c {
        // Requests wait for the next window: none may take a place now that would leave
        // them over the capacity there.
        return rejected(Wait::After(Duration::from_nanos((end - now).max(1))));
    }
    if used + cost * w > c * w {
        // Without other traffic the estimate only falls: find when it first admits.
        let wait = if q + cost <= c {
            // Later in this window, once previous × left <= (capacity − current − permits) × window.
            let budget = (c - q - cost) * w;
            let left_max = div(budget, p); // p > 0, or the request would be admitted
            u128::from(end - now) - left_max
        } else {
            // In the next window, where the current count becomes the previous one.
            let budget = (c - cost) * w;
            let left_max = div(budget, q).min(w);
            u128::from(end - now) + (w - left_max)
        };
        return rejected(Wait::After(Duration::from_nanos(to_u64(wait).max(1))));
    }
    let used = used + cost * w;
    Eval {
        allowed: true,
        next: Counter {
            end,
            previous,
            current: current + permits,
            next,
        },
        remaining_after: to_u64(div(c * w - used, w)),
        remaining_now,
        reset_after: reset(q + cost),
        reset_now,
        wait: Wait::None,
    }
}

/// The state after reserving `permits` at `at` (not before `now`) for a request that
/// waits until then, if the band admits them there: in the window of `now` or the next
/// one, which the state keeps apart; `None` otherwise. A reservation in the next window
/// counts there in full and, once that window has begun, as its previous one.
pub(crate) fn reserve(
    state: Option<Counter>,
    now: u64,
    at: u64,
    capacity: u64,
    window_nanos: u64,
    permits: u64,
) -> Option<Counter> {
    let (_, end) = bounds(now, window_nanos);
    let (previous, current, next) = counts(state, end, window_nanos);
    let (_, end_at) = bounds(at, window_nanos);
    let (w, c, cost) = (u128::from(window_nanos), u128::from(capacity), u128::from(permits));
    let left = u128::from(end_at - at);
    if end_at == end {
        let used = u128::from(previous) * left + u128::from(current) * w;
        let fits = used + cost * w <= c * w && (next == 0 || u128::from(current + next) + cost <= c);
        fits.then_some(Counter {
            end,
            previous,
            current: current + permits,
            next,
        })
    } else if Some(end_at) == end.checked_add(window_nanos) {
        let used = u128::from(current) * left + u128::from(next) * w;
        (used + cost * w <= c * w).then_some(Counter {
            end,
            previous,
            current,
            next: next + permits,
        })
    } else {
        None
    }
}

/// The state after giving back `permits` taken at `at`: from the count of its window,
/// wherever the state keeps it.
pub(crate) fn give_back(state: Counter, at: u64, window_nanos: u64, permits: u64) -> Counter {
    let (_, end_at) = bounds(at, window_nanos);
    let mut state = state;
    if state.end == end_at {
        state.current = state.current.saturating_sub(permits);
    } else if state.end.checked_add(window_nanos) == Some(end_at) {
        state.next = state.next.saturating_sub(permits);
    } else if end_at.checked_add(window_nanos) == Some(state.end) {
        state.previous = state.previous.saturating_sub(permits);
    }
    state
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    fn seed(now: u64) -> Eval<Counter> {
        let state = Counter {
            end: 120 * SEC,
            previous: 8,
            current: 3,
            next: 0,
        };
        evaluate(Some(state), now, 10, 60 * SEC, 1)
    }

    #[test]
    fn the_seed_examples() {
        // At 50%: 7, admitted, 2 remain after it (10 − 8).
        let e = seed(90 * SEC);
        assert!(e.allowed);
        assert_eq!(e.remaining_now, 3);
        assert_eq!(e.remaining_after, 2);
        assert_eq!(e.next.current, 4);
        // At 10%: 10.2, rejected; admitted once 8 × left / 60 <= 6, at 25% (45 s left).
        let e = seed(66 * SEC);
        assert!(!e.allowed);
        assert_eq!(e.remaining_now, 0);
        assert_eq!(e.wait, Wait::After(Duration::from_secs(9)));
        assert!(!seed(75 * SEC - 1).allowed);
        assert!(seed(75 * SEC).allowed);
    }

    #[test]
    fn a_full_current_window_waits_for_the_next_one() {
        // 10 per second, all 10 taken at 0.5 s: the next window starts with previous 10;
        // a request is admitted once 10 × left / 1 s <= 9, at 0.1 s into it.
        let mut state = None;
        for _ in 0..10 {
            let e = evaluate(state, SEC / 2, 10, SEC, 1);
            assert!(e.allowed);
            state = Some(e.next);
        }
        let e = evaluate(state, SEC / 2, 10, SEC, 1);
        assert!(!e.allowed);
        assert_eq!(e.wait, Wait::After(Duration::from_millis(600)));
        assert!(!evaluate(state, SEC + 99_999_999, 10, SEC, 1).allowed);
        assert!(evaluate(state, SEC + 100_000_000, 10, SEC, 1).allowed);
        // Two windows later, nothing is counted.
        assert_eq!(evaluate(state, 2 * SEC, 10, SEC, 10).remaining_now, 10);
        assert_eq!(evaluate(state, SEC / 2, 10, SEC, 11).wait, Wait::Never);
    }

    #[test]
    fn permits_count_in_full_and_rejections_write_nothing() {
        let mut state = None;
        for (permits, remaining) in [(3, 7), (5, 2)] {
            let e = evaluate(state, 0, 10, SEC, permits);
            assert!(e.allowed);
            assert_eq!(e.remaining_after, remaining);
            state = Some(e.next);
        }
        let e = evaluate(state, 0, 10, SEC, 3);
        assert!(!e.allowed);
        assert_eq!(e.next, state.unwrap());
        assert_eq!(e.remaining_now, 2);
    }
}
