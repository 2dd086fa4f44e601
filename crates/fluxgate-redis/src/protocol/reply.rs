//! What a decision call answers: the request's verdict and each band's figures.

use super::*;

/// The reply of a decision call, checked: the request's verdict, then a [`BandReply`] per
/// band.
#[derive(Debug)]
pub(crate) struct Reply {
    /// Every enforced band admitted, and the request was committed.
    pub(crate) allowed: bool,
    /// Every shadow band admitted.
    pub(crate) shadow_allowed: bool,
    /// Redis `TIME` of the decision, in µs.
    pub(crate) now_us: i64,
    /// How long after `now_us` the request is admitted: 0, unless it waits for the refill
    /// (its place taken now).
    pub(crate) admitted_after_us: i64,
    /// For a request admitted later, or a call that asked for them
    /// ([`DecideArgs::mark_places`]): per band, the state the request left (its instant in
    /// µs in the high 64 bits, its remainder in the low ones; 0 for a band not committed,
    /// and for the window algorithms, whose places go back by their instant: the limiter
    /// records the decision's instant there, see [`crate::request::mark_instants`]), as
    /// [`AcquireOutcome::marks`](fluxgate_core::limiter::AcquireOutcome::marks). Empty
    /// otherwise.
    pub(crate) marks: Vec<u128>,
    /// In place for a request of one band.
    pub(super) bands: SmallVec<[BandReply; 1]>,
}

impl Reply {
    /// The numbers before the first band.
    const HEAD: usize = 4;

    /// The numbers of a band's mark, after the bands, in the reply of a request admitted
    /// later: its instant in µs and its remainder.
    const MARK: usize = 2;

    /// Checks that `numbers` is the reply of `decide.lua` for a call of `bands` bands that
    /// asked for the bands' marks or not (`marked`).
    ///
    /// # Errors
    ///
    /// [`RedisError::Reply`] when it has not `4 + 4 × bands` numbers, and `2 × bands`
    /// more (the marks) for a request admitted later or a call that asked for them.
    pub(crate) fn decode(numbers: &[i64], bands: usize, marked: bool) -> Result<Self, RedisError> {
        let &[allowed, shadow_allowed, now_us, admitted_after_us, ..] = numbers else {
            return Err(Self::wrong_length(numbers, bands));
        };
        let figures = Self::HEAD + BandReply::LEN * bands;
        let marks = if admitted_after_us > 0 || marked {
            Self::MARK * bands
        } else {
            0
        };
        if numbers.len() != figures + marks {
            return Err(Self::wrong_length(numbers, bands));
        }
        Ok(Self {
            allowed: allowed == 1,
            shadow_allowed: shadow_allowed == 1,
            now_us,
            admitted_after_us: admitted_after_us.max(0),
            marks: numbers[figures..]
                .chunks_exact(Self::MARK)
                .map(|mark| (u128::from(nonnegative(mark[0])) << 64) | u128::from(nonnegative(mark[1])))
                .collect(),
            bands: numbers[Self::HEAD..figures]
                .chunks_exact(BandReply::LEN)
                .filter_map(|chunk| chunk.try_into().ok())
                .map(BandReply::decode)
                .collect(),
        })
    }

    pub(super) fn wrong_length(numbers: &[i64], bands: usize) -> RedisError {
        RedisError::Reply(format!("{} numbers for {bands} bands", numbers.len()))
    }

    /// The bands, in the order of the call's bands.
    pub(crate) fn bands(&self) -> impl Iterator<Item = BandReply> + '_ {
        self.bands.iter().copied()
    }
}

/// What a decision call says of one band, after the decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BandReply {
    /// The band admits the request.
    pub(crate) allowed: bool,
    /// Permits left.
    pub(crate) remaining: u64,
    /// Until the band is full again.
    pub(crate) reset_after: Duration,
    /// When a band that rejects would admit the request.
    pub(crate) wait: Wait,
}

impl BandReply {
    /// The numbers of one band: `allowed, remaining, reset_after_us, wait_us`.
    const LEN: usize = 4;

    pub(super) fn decode([allowed, remaining, reset_after_us, wait_us]: [i64; Self::LEN]) -> Self {
        Self {
            allowed: allowed == 1,
            remaining: nonnegative(remaining),
            reset_after: Duration::from_micros(nonnegative(reset_after_us)),
            wait: match wait_us {
                0 => Wait::None,
                w if w < 0 => Wait::Never,
                w => Wait::After(Duration::from_micros(nonnegative(w))),
            },
        }
    }
}

/// A count or a duration from the scripts, which are never negative but for `wait_us`'s
/// `-1`.
pub(crate) fn nonnegative(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}
