//! The leaky bucket: a queue of `capacity` that leaks one unit every `window / capacity`.
//!
//! A request of `permits` enters the queue when `level + permits <= capacity`. Leaks happen
//! on a fixed grid anchored at the bucket's first request: the stored instant advances
//! only by the time of whole leaked units (the seed's precision fix), so no fraction of a
//! leak is lost, and the output never exceeds one unit per interval, even after the queue
//! ran empty mid-interval.
//!
//! The state is one instant, as for the token bucket: `drain`, when the queue is empty if
//! nothing else arrives, scaled by the capacity ([`Tat`]). While the queue is not empty the
//! level is `ceil((drain - now) / interval)`; once it is, the grid continues from `drain`.
//! That is the one difference from the token bucket, whose refill restarts at each request
//! on a full bucket: a request arriving at an empty queue part-way through an interval
//! leaves at the end of that interval, not one whole interval later.

use super::token_bucket::{gcra, Eval, Tat};

/// Evaluates a band of `capacity` per `window_nanos` for a request of `permits` at `now`.
///
/// ```
/// use fluxgate_core::limiter::leaky_bucket::evaluate;
/// const S: u64 = 1_000_000_000;
/// // Capacity 1, leaking one per second: admitted at 0, 1.9 s and 2.1 s (the leaks at 1 s
/// // and 2 s emptied the queue), rejected at 2.5 s until the leak at 3 s.
/// let a = evaluate(None, 0, 1, S, 1);
/// let b = evaluate(Some(a.next), 1_900_000_000, 1, S, 1);
/// let c = evaluate(Some(b.next), 2_100_000_000, 1, S, 1);
/// assert!(a.allowed && b.allowed && c.allowed);
/// let d = evaluate(Some(c.next), 2_500_000_000, 1, S, 1);
/// assert!(!d.allowed);
/// assert_eq!(d.wait, fluxgate_core::limiter::Wait::After(std::time::Duration::from_millis(500)));
/// ```
pub fn evaluate(state: Option<Tat>, now: u64, capacity: u64, window_nanos: u64, permits: u64) -> Eval {
    let c = u128::from(capacity);
    let w = u128::from(window_nanos);
    let now_s = u128::from(now) * c;
    let (debt, credit) = match state {
        None => (0, 0),
        Some(t) => {
            let drain = u128::from(t.nanos) * c + u128::from(t.frac);
            if drain > now_s {
                (drain - now_s, 0)
            } else {
                // Empty: the last leak on the grid was (now - drain) mod interval ago.
                (0, (now_s - drain) % w)
            }
        }
    };
    gcra(state, debt, credit, now, capacity, window_nanos, permits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Wait;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn the_timestamp_advances_by_whole_leaks_only() {
        // The seed's example: leaking 0.5 per second (capacity 1 per 2 s). Requests every
        // 3 s: 6 s see 3 leaks, not 2; a request every 2 s is admitted every time.
        let mut state = None;
        let mut admitted = 0;
        for i in 0..30u64 {
            let e = evaluate(state, i * 2 * SEC, 1, 2 * SEC, 1);
            assert!(e.allowed, "request {i}");
            admitted += 1;
            state = Some(e.next);
        }
        assert_eq!(admitted, 30);
        // Capacity 2 leaking 0.5 per second (one per 2 s), full at 0. At 3 s one unit has
        // leaked and the grid stands at 2 s, not 3 s: so at 4 s a second unit has leaked.
        let mut state = None;
        for _ in 0..2 {
            state = Some(evaluate(state, 0, 2, 4 * SEC, 1).next);
        }
        let e = evaluate(state, 3 * SEC, 2, 4 * SEC, 1);
        assert!(e.allowed);
        state = Some(e.next);
        assert!(!evaluate(state, 3 * SEC, 2, 4 * SEC, 1).allowed);
        let e = evaluate(state, 4 * SEC, 2, 4 * SEC, 1);
        assert!(e.allowed, "the leak due at 4 s was lost");
    }

    #[test]
    fn full_queue_rejects_without_changing_state() {
        let mut state = None;
        for _ in 0..10 {
            let e = evaluate(state, 0, 10, 10 * SEC, 1);
            assert!(e.allowed);
            state = Some(e.next);
        }
        let e = evaluate(state, 0, 10, 10 * SEC, 1);
        assert!(!e.allowed);
        assert_eq!(e.next, state.unwrap());
        assert_eq!(e.remaining_now, 0);
        assert_eq!(e.wait, Wait::After(std::time::Duration::from_secs(1)));
        assert_eq!(e.reset_now, 10 * SEC);
        // permits: 3 need three leaks.
        let e = evaluate(state, SEC / 2, 10, 10 * SEC, 3);
        assert_eq!(e.wait, Wait::After(std::time::Duration::from_millis(2_500)));
        assert_eq!(evaluate(state, 0, 10, 10 * SEC, 11).wait, Wait::Never);
    }

    #[test]
    fn output_never_exceeds_one_per_interval_after_the_burst() {
        // Capacity 2 per second: at most 2 in the first instant, then one per 500 ms.
        let mut state = None;
        let mut times = Vec::new();
        let mut t = 0;
        while t < 5 * SEC {
            let e = evaluate(state, t, 2, SEC, 1);
            if e.allowed {
                times.push(t);
                state = Some(e.next);
            }
            t += 10_000_000;
        }
        // 2 at 0, then one at each leak: 0.5, 1.0, ... 4.5 s.
        assert_eq!(times.len(), 2 + 9, "{times:?}");
        for pair in times[2..].windows(2) {
            assert_eq!(pair[1] - pair[0], SEC / 2);
        }
    }
}
