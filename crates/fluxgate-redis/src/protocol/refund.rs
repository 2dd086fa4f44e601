//! What a refund call sends and answers: each band's consumption to give back, and the
//! bands after it.

use super::*;

/// A token-bucket band's state as the scripts write it (`<instant>` or
/// `<instant>:<remainder>`, in hexadecimal), from its mark (see [`Reply::marks`]); `None`
/// for no mark.
pub(crate) fn expected_state(mark: u128) -> Option<String> {
    if mark == 0 {
        return None;
    }
    let (tat, frac) = ((mark >> 64) as u64, mark as u64);
    Some(if frac == 0 {
        format!("{tat:x}")
    } else {
        format!("{tat:x}:{frac:x}")
    })
}

/// A leaky-bucket band's state as the refund script compares it (`<instant>:<remainder>`,
/// in decimal, see `lua/refund.lua`), from its mark (see [`Reply::marks`]); `None` for no
/// mark.
pub(crate) fn expected_leaky_state(mark: u128) -> Option<String> {
    (mark != 0).then(|| format!("{}:{}", (mark >> 64) as u64, mark as u64))
}

/// The ceiling of `a / b`, for `a >= 0` and `b > 0`.
pub(super) fn ceil_div(a: i64, b: i64) -> i64 {
    a / b + i64::from(a % b != 0)
}

/// What the refund script needs to give back one band's consumption.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RefundBand {
    pub(crate) algorithm: ScriptAlgorithm,
    /// The request's cost, at most the band's capacity (a larger cost never consumed).
    pub(crate) permits: i64,
    pub(crate) band: BandArgs,
    /// A token-bucket band: where it lies in its rule's key.
    pub(crate) place: Option<RulePlace>,
    /// A token- or leaky-bucket band: the state it must still hold to be refunded (a
    /// waiting request's place, see [`Reply::marks`]), as the refund script compares it
    /// ([`expected_state`], [`expected_leaky_state`]); `None`: refunded whatever it holds.
    pub(crate) expect: Option<String>,
}

impl RefundBand {
    /// Whether the band keeps no state a refund compares (a window or a log, given back by
    /// its instant): its mark is then the decision's instant ([`crate::request::mark_instants`]).
    pub(crate) fn keeps_no_state(&self) -> bool {
        self.place.is_none() && self.algorithm != ScriptAlgorithm::LeakyBucket
    }
}

/// Where a token-bucket band lies in its rule's key: the rule's layout, the band's position
/// among its bands (from 1) and their count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RulePlace {
    pub(crate) layout: Str,
    pub(crate) index: i64,
    pub(crate) count: i64,
}

/// The `ARGV` of a refund call: the decision's instant, then each band's [`RefundBand`].
#[derive(Debug)]
pub(crate) struct RefundArgs {
    pub(super) argv: Vec<Value>,
}

impl RefundArgs {
    /// The arguments of a refund of what was decided at `decided_us` (the decision's
    /// `now_us`, or a waiting request's later instant: it tells the windows and log entries
    /// to take back), taken by a call at `made_us` (the decision's `now_us`: nothing goes
    /// back of permits taken before the server started, see `lua/refund.lua`).
    pub(crate) fn new(decided_us: i64, made_us: i64) -> Self {
        Self {
            argv: vec![Value::Integer(decided_us), Value::Integer(made_us)],
        }
    }

    /// A band to refund.
    pub(crate) fn band(&mut self, refund: &RefundBand) {
        let RefundBand {
            algorithm,
            permits,
            band,
            ref place,
            ref expect,
        } = *refund;
        self.argv
            .extend([algorithm.number(), permits, band.capacity, band.a, band.b].map(Value::Integer));
        if algorithm == ScriptAlgorithm::LeakyBucket {
            self.argv
                .push(Value::String(Str::from(expect.as_deref().unwrap_or_default())));
        }
        if let Some(place) = place {
            self.argv.extend([
                Value::String(place.layout.clone()),
                Value::Integer(place.index),
                Value::Integer(place.count),
                Value::String(Str::from(expect.as_deref().unwrap_or_default())),
            ]);
        }
    }

    /// The arguments to send.
    pub(crate) fn into_argv(self) -> Vec<Value> {
        self.argv
    }
}

/// The reply of a refund call, checked: a [`RefundedBand`] per band.
#[derive(Debug)]
pub(crate) struct RefundReply {
    pub(super) numbers: Vec<i64>,
}

impl RefundReply {
    /// The numbers of one band: `remaining, reset_after_us`.
    const PER_BAND: usize = 2;

    /// Checks that `numbers` is the reply of a refund of `bands` bands.
    ///
    /// # Errors
    ///
    /// [`RedisError::Reply`] when it has not `2 × bands` numbers.
    pub(crate) fn decode(numbers: Vec<i64>, bands: usize) -> Result<Self, RedisError> {
        if numbers.len() != Self::PER_BAND * bands {
            return Err(RedisError::Reply(format!(
                "{} numbers for {bands} refunds",
                numbers.len()
            )));
        }
        Ok(Self { numbers })
    }

    /// The bands, in the order of the call's keys.
    pub(crate) fn bands(&self) -> impl Iterator<Item = RefundedBand> + '_ {
        // `decode` checked the length: every chunk is whole.
        self.numbers
            .chunks_exact(Self::PER_BAND)
            .filter_map(|chunk| chunk.try_into().ok())
            .map(|[remaining, reset_after_us]: [i64; Self::PER_BAND]| RefundedBand {
                remaining: nonnegative(remaining),
                reset_after: Duration::from_micros(nonnegative(reset_after_us)),
            })
    }
}

/// A band after a refund.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RefundedBand {
    /// Permits left.
    pub(crate) remaining: u64,
    /// Until the band is full again.
    pub(crate) reset_after: Duration,
}
