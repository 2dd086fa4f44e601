//! The token bucket in its exact GCRA form, shared by the in-memory limiter.
//!
//! A band of capacity `C` per window `W` refills one token every `W / C`. The state is the
//! theoretical arrival time (TAT): the instant at which the bucket is full again. To keep
//! refill exact when `W / C` is not a whole number of nanoseconds, every instant is
//! scaled by `C`: `tat_s = tat_ns * C + frac`, a token costs `W` scaled units and the
//! bucket holds `C * W` of them. No fraction of a token is ever rounded away.

use std::time::Duration;

use super::Wait;
use crate::num::{ceil_div, div, to_u64};

/// A band's stored state: the scaled TAT as whole nanoseconds and a remainder `< C`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tat {
    /// Whole nanoseconds.
    pub nanos: u64,
    /// The remainder in units of `1 / C` nanoseconds.
    pub frac: u64,
}

impl Tat {
    /// Whether a bucket with this TAT is full at `now` (and can be forgotten).
    pub fn is_full_at(&self, now: u64) -> bool {
        self.nanos < now || (self.nanos == now && self.frac == 0)
    }
}

/// The evaluation of one token-bucket band for one request.
pub type Eval = super::Eval<Tat>;

/// Evaluates a band of `capacity` per `window_nanos` for a request of `permits` at `now`.
///
/// All arithmetic is relative to `now` and scaled by the capacity: the bucket's "debt" is
/// how far its TAT lies ahead of `now`, in units of `1 / capacity` nanoseconds.
///
/// ```
/// use fluxgate_core::limiter::token_bucket::{evaluate, Tat};
/// // 10 per second: a new bucket admits 10 at once, then one per 100 ms.
/// let mut tat = None;
/// for _ in 0..10 {
///     let e = evaluate(tat, 0, 10, 1_000_000_000, 1);
///     assert!(e.allowed);
///     tat = Some(e.next);
/// }
/// let e = evaluate(tat, 0, 10, 1_000_000_000, 1);
/// assert!(!e.allowed);
/// assert_eq!(e.remaining_now, 0);
/// assert!(evaluate(tat, 100_000_000, 10, 1_000_000_000, 1).allowed);
/// ```
pub fn evaluate(state: Option<Tat>, now: u64, capacity: u64, window_nanos: u64, permits: u64) -> Eval {
    let c = u128::from(capacity);
    // Debt: max(tat - now, 0), scaled by the capacity.
    let debt = match state {
        Some(t) if !t.is_full_at(now) => u128::from(t.nanos - now) * c + u128::from(t.frac),
        _ => 0,
    };
    gcra(state, debt, 0, now, capacity, window_nanos, permits)
}

/// The GCRA step shared with the leaky bucket, in units of `1 / capacity` nanoseconds:
/// `debt` is how far the stored instant `state` lies ahead of `now` (`(t.nanos − now)·c +
/// t.frac`, or 0), and `credit` (only with no debt) how far an admitted request's instant
/// is moved back before `now`.
pub(crate) fn gcra(
    state: Option<Tat>,
    debt: u128,
    credit: u128,
    now: u64,
    capacity: u64,
    window_nanos: u64,
    permits: u64,
) -> Eval {
    let c = u128::from(capacity);
    let w = u128::from(window_nanos);
    let cap = c * w;
    // A stored state exceeds the capacity when requests wait for a later instant (their
    // places are taken), or when rules have changed since: the figures see a bucket
    // emptied, and a request waits behind all of it.
    let owed = debt;
    let clamped = debt > cap;
    let debt = debt.min(cap);
    // `(c·w − d) / w` rounded down is `c − ⌈d / w⌉`: no division of the (often wider than
    // 64 bits) full capacity. A full bucket (no debt, the usual state of a quiet key) needs
    // no division at all.
    let (remaining_now, reset_now) = match state {
        _ if debt == 0 => (capacity, 0),
        // A debt is `(t.nanos − now)·c + t.frac` with `t.frac < c`: its whole nanoseconds,
        // rounded up, need no division.
        Some(t) if !clamped && t.frac < capacity && t.nanos >= now => (
            to_u64(c - ceil_div(debt, w)),
            (t.nanos - now).saturating_add(u64::from(t.frac > 0)),
        ),
        _ => (to_u64(c - ceil_div(debt, w)), to_u64(ceil_div(owed, c))),
    };
    let not_allowed = |wait| Eval::rejected(state.unwrap_or_default(), remaining_now, reset_now, wait);
    if permits > capacity {
        return not_allowed(Wait::Never);
    }
    let new_debt = debt + u128::from(permits) * w;
    if new_debt > cap {
        let wait = to_u64(ceil_div(owed + u128::from(permits) * w - cap, c)).max(1);
        return not_allowed(Wait::After(Duration::from_nanos(wait)));
    }
    // ⌈(d + p·w) / w⌉ is ⌈d / w⌉ + p: without a credit, one division fewer.
    let remaining_after = if credit == 0 {
        remaining_now - permits
    } else {
        // A credit is less than one leak interval, so the request's own cost covers it.
        to_u64(c - ceil_div(new_debt - credit.min(new_debt), w))
    };
    let new_debt = new_debt - credit.min(new_debt);
    let whole = div(new_debt, c);
    Eval {
        allowed: true,
        next: Tat {
            nanos: now.saturating_add(to_u64(whole)),
            frac: to_u64(new_debt - whole * c),
        },
        remaining_after,
        remaining_now,
        reset_after: to_u64(whole + u128::from(whole * c < new_debt)),
        reset_now,
        wait: Wait::None,
    }
}

/// The state of a token or leaky bucket after giving back `permits`: its instant moves
/// back by their cost, `permits × window / capacity` (exactly, in units of `1 / capacity`
/// nanoseconds). A token bucket more than full is full; a leaky bucket's grid stays put.
pub(crate) fn give_back(state: Tat, capacity: u64, window_nanos: u64, permits: u64) -> Tat {
    let c = u128::from(capacity.max(1));
    let scaled = u128::from(state.nanos) * c + u128::from(state.frac);
    let back = scaled.saturating_sub(u128::from(permits) * u128::from(window_nanos));
    let whole = div(back, c);
    Tat {
        nanos: to_u64(whole),
        frac: to_u64(back - whole * c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn exact_refill_at_a_fractional_interval() {
        // 10/s, a request every 66 ms for 6 s: 10 + 60 ± 1 admitted.
        let mut tat = None;
        let mut admitted = 0;
        let mut t = 0;
        while t < 6 * SEC {
            let e = evaluate(tat, t, 10, SEC, 1);
            if e.allowed {
                admitted += 1;
                tat = Some(e.next);
            }
            t += 66_000_000;
        }
        assert!((69..=71).contains(&admitted), "{admitted}");
    }

    #[test]
    fn thirds_do_not_drift() {
        // 3 per second: the interval is 333_333_333.33 ns.
        let mut tat = None;
        for _ in 0..3 {
            let e = evaluate(tat, 0, 3, SEC, 1);
            assert!(e.allowed);
            tat = Some(e.next);
        }
        // After exactly 1 s, exactly 3 more; at 1 s - 1 ns only 2.
        assert!(!evaluate(tat, SEC - 1, 3, SEC, 3).allowed);
        assert!(evaluate(tat, SEC, 3, SEC, 3).allowed);
        let e = evaluate(tat, 0, 3, SEC, 1);
        assert_eq!(e.wait, Wait::After(Duration::from_nanos(333_333_334)));
    }

    /// The figures computed without division agree with the divisions they replace.
    #[test]
    fn figures_agree_with_the_divisions() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..20_000 {
            let capacity = 1 + next() % 1_000;
            let window = 1 + next() % (10 * SEC);
            let permits = 1 + next() % capacity;
            let now = 1_000 * SEC + next() % SEC;
            let (c, w) = (u128::from(capacity), u128::from(window));
            // A stored state somewhere within the bucket's capacity ahead of `now`.
            let debt = u128::from(next()) % (c * w + 1);
            let tat = Tat {
                nanos: now + to_u64(debt / c),
                frac: to_u64(debt % c),
            };
            let e = evaluate(Some(tat), now, capacity, window, permits);
            assert_eq!(
                e.reset_now,
                to_u64(ceil_div(debt, c)),
                "{capacity}/{window} debt {debt}"
            );
            assert_eq!(e.remaining_now, to_u64(c - ceil_div(debt, w)));
            if e.allowed {
                let new_debt = debt + u128::from(permits) * w;
                assert_eq!(e.remaining_after, to_u64(c - ceil_div(new_debt, w)));
                assert_eq!(e.reset_after, to_u64(ceil_div(new_debt, c)));
            }
        }
    }

    #[test]
    fn permits_beyond_capacity_never_admit() {
        let e = evaluate(None, 0, 10, SEC, 11);
        assert!(!e.allowed);
        assert_eq!(e.wait, Wait::Never);
        assert_eq!(e.remaining_now, 10);
    }

    #[test]
    fn huge_values_do_not_overflow() {
        let now = u64::MAX / 2;
        let window = 10 * 366 * 24 * 3600 * SEC;
        let e = evaluate(None, now, crate::rule::MAX_CAPACITY, window, 1);
        assert!(e.allowed);
        let e2 = evaluate(
            Some(e.next),
            now,
            crate::rule::MAX_CAPACITY,
            window,
            crate::rule::MAX_CAPACITY,
        );
        assert!(!e2.allowed);
    }
}
