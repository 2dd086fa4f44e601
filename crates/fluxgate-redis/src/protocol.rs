//! The protocol between the crate and its scripts, typed: what a decision or a refund
//! call sends in `ARGV` and what it answers. `lua/README.md` ("Protocol") states it once,
//! field by field, next to the scripts' contract, and `lua/protocol.lua` names the same
//! numbers on the Lua side.

use std::time::Duration;

use fluxgate_core::limiter::Wait;
use fluxgate_core::Algorithm;

use crate::error::RedisError;

/// The number of an algorithm in the scripts' arguments (`TOKEN_BUCKET`, … in
/// `lua/protocol.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScriptAlgorithm {
    TokenBucket = 0,
    LeakyBucket = 1,
    FixedWindow = 2,
    SlidingWindowLog = 3,
    SlidingWindowCounter = 4,
}

impl ScriptAlgorithm {
    /// The number the scripts know it by.
    pub(crate) const fn number(self) -> i64 {
        self as i64
    }
}

impl ScriptAlgorithm {
    /// The scripts' version of `algorithm`; `None` for an algorithm they do not have,
    /// which [`crate::band::check`] refuses when rules load.
    pub(crate) fn of(algorithm: Algorithm) -> Option<Self> {
        Some(match algorithm {
            Algorithm::TokenBucket => Self::TokenBucket,
            Algorithm::LeakyBucket => Self::LeakyBucket,
            Algorithm::FixedWindow => Self::FixedWindow,
            Algorithm::SlidingWindowLog => Self::SlidingWindowLog,
            Algorithm::SlidingWindowCounter => Self::SlidingWindowCounter,
            _ => return None,
        })
    }
}

/// A bucket's flags: its band count, algorithm and mode in one number,
/// `bands × 16 + algorithm × 2 + shadow` (`FLAG_*` in `lua/protocol.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Flags(i64);

impl Flags {
    const SHADOW: i64 = 1;
    const ALGORITHM: i64 = 2;
    const BANDS: i64 = 16;

    /// The flags of a bucket of `bands` bands of `algorithm`, whose rule is in shadow mode
    /// or not.
    pub(crate) fn new(bands: usize, algorithm: ScriptAlgorithm, shadow: bool) -> Self {
        let bands = i64::try_from(bands).unwrap_or(i64::MAX).saturating_mul(Self::BANDS);
        let shadow = if shadow { Self::SHADOW } else { 0 };
        Self(bands.saturating_add(algorithm.number() * Self::ALGORITHM + shadow))
    }

    /// The number sent.
    pub(crate) fn get(self) -> i64 {
        self.0
    }

    /// The band count.
    #[cfg(test)]
    fn bands(self) -> i64 {
        self.0 / Self::BANDS
    }

    /// The algorithm's number.
    #[cfg(test)]
    fn algorithm(self) -> i64 {
        self.0 % Self::BANDS / Self::ALGORITHM
    }

    /// Whether the rule is in shadow mode.
    #[cfg(test)]
    fn is_shadow(self) -> bool {
        self.0 % Self::ALGORITHM == Self::SHADOW
    }
}

/// A band's three numbers: its capacity, then two whose meaning depends on the algorithm
/// (`scale` and `interval` for token and leaky buckets, the window in µs and `0` for the
/// others).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BandArgs {
    pub(crate) capacity: i64,
    pub(crate) a: i64,
    pub(crate) b: i64,
}

/// What a decision call says of one bucket before its bands: its cost and flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BucketArgs {
    pub(crate) permits: i64,
    pub(crate) flags: Flags,
}

/// The `ARGV` of a decision call: the bucket count, then each bucket's [`BucketArgs`]
/// followed by its bands' [`BandArgs`]; and what chooses the script that decides it
/// ([`Shape`]).
#[derive(Debug, Clone)]
pub(crate) struct DecideArgs {
    /// The first number is the bucket count, written by [`DecideArgs::into_argv`].
    argv: Vec<i64>,
    buckets: i64,
    bands: usize,
    /// Every bucket so far is a token bucket.
    token_buckets: bool,
    /// Whether the first bucket's rule is in shadow mode.
    first_shadow: bool,
}

/// Which script decides a call: the one-band script, the token buckets' script or the
/// general one (see `lua/README.md`). They decide alike; the first two cost less.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// One bucket of one token-bucket band (`one_token_bucket.lua`), in shadow mode or not.
    OneTokenBucket { shadow: bool },
    /// Token buckets only (`token_buckets.lua`).
    TokenBuckets,
    /// Any other (`decide.lua`).
    General,
}

impl DecideArgs {
    /// No bucket yet.
    pub(crate) fn new() -> Self {
        // Room for the count and the common case, one bucket of one band (permits, flags
        // and three numbers), in one allocation.
        let mut argv = Vec::with_capacity(8);
        argv.push(0);
        Self {
            argv,
            buckets: 0,
            bands: 0,
            token_buckets: true,
            first_shadow: false,
        }
    }

    /// Starts a bucket; its bands follow.
    pub(crate) fn bucket(&mut self, bucket: BucketArgs) {
        let Flags(flags) = bucket.flags;
        if self.buckets == 0 {
            self.first_shadow = flags % Flags::ALGORITHM == Flags::SHADOW;
        }
        self.buckets += 1;
        self.token_buckets &= flags % Flags::BANDS / Flags::ALGORITHM == ScriptAlgorithm::TokenBucket.number();
        self.argv.extend([bucket.permits, bucket.flags.get()]);
    }

    /// A band of the current bucket.
    pub(crate) fn band(&mut self, band: BandArgs) {
        self.bands += 1;
        self.argv.extend([band.capacity, band.a, band.b]);
    }

    /// The script that decides these arguments.
    pub(crate) fn shape(&self) -> Shape {
        match (self.token_buckets, self.buckets, self.bands) {
            (true, 1, 1) => Shape::OneTokenBucket {
                shadow: self.first_shadow,
            },
            (true, _, _) => Shape::TokenBuckets,
            _ => Shape::General,
        }
    }

    /// The numbers to send to `decide.lua` or `token_buckets.lua`.
    pub(crate) fn into_argv(mut self) -> Vec<i64> {
        self.argv[0] = self.buckets;
        self.argv
    }

    /// The numbers to send to `one_token_bucket.lua`, for [`Shape::OneTokenBucket`]:
    /// `capacity, interval`, the key's expiry in ms (the window plus one second, as `px()`
    /// in `lua/common.lua`), then `permits` and `scale`, each left out when it is 1 and
    /// nothing follows it; `None` for another shape.
    pub(crate) fn one_token_bucket_argv(&self) -> Option<Vec<i64>> {
        let Shape::OneTokenBucket { .. } = self.shape() else {
            return None;
        };
        let &[_, permits, _, capacity, scale, interval] = self.argv.as_slice() else {
            return None;
        };
        // capacity × interval / scale is the window in µs (validated below 2^52).
        let window_us = capacity.checked_mul(interval)? / scale.max(1);
        let mut argv = vec![capacity, interval, window_us / 1000 + 1001, permits, scale];
        while argv.len() > 3 && argv.last() == Some(&1) {
            argv.pop();
        }
        Some(argv)
    }
}

/// What the refund script needs to give back one band's consumption.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RefundBand {
    pub(crate) algorithm: ScriptAlgorithm,
    /// The request's cost, at most the band's capacity (a larger cost never consumed).
    pub(crate) permits: i64,
    pub(crate) band: BandArgs,
}

/// The `ARGV` of a refund call: the decision's instant, then each band's [`RefundBand`].
#[derive(Debug)]
pub(crate) struct RefundArgs {
    argv: Vec<i64>,
}

impl RefundArgs {
    /// The arguments of a refund of what was decided at `decided_us` (the decision's
    /// `now_us`: it tells the windows and log entries to take back).
    pub(crate) fn new(decided_us: i64) -> Self {
        Self { argv: vec![decided_us] }
    }

    /// A band to refund.
    pub(crate) fn band(&mut self, refund: &RefundBand) {
        let RefundBand {
            algorithm,
            permits,
            band,
        } = *refund;
        self.argv
            .extend([algorithm.number(), permits, band.capacity, band.a, band.b]);
    }

    /// The numbers to send.
    pub(crate) fn into_argv(self) -> Vec<i64> {
        self.argv
    }
}

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
    /// The whole reply; the bands start at `head`.
    numbers: Vec<i64>,
    head: usize,
}

impl Reply {
    /// The numbers before the first band.
    const HEAD: usize = 3;

    /// The numbers of a one-band reply before its band.
    const ONE_HEAD: usize = 1;

    /// Checks that `numbers` is the reply of a call of `bands` bands.
    ///
    /// # Errors
    ///
    /// [`RedisError::Reply`] when it has not `3 + 4 × bands` numbers.
    pub(crate) fn decode(numbers: Vec<i64>, bands: usize) -> Result<Self, RedisError> {
        let &[allowed, shadow_allowed, now_us, ..] = numbers.as_slice() else {
            return Err(Self::wrong_length(&numbers, bands));
        };
        if numbers.len() != Self::HEAD + BandReply::LEN * bands {
            return Err(Self::wrong_length(&numbers, bands));
        }
        Ok(Self {
            allowed: allowed == 1,
            shadow_allowed: shadow_allowed == 1,
            now_us,
            numbers,
            head: Self::HEAD,
        })
    }

    /// Checks the reply of `one_token_bucket.lua`, `now_us` then one band, for a bucket in
    /// shadow mode or not: the request's verdict is the band's (a shadow band that rejects
    /// leaves the request allowed, and its shadow verdict rejected).
    ///
    /// # Errors
    ///
    /// [`RedisError::Reply`] when it has not `1 + 4` numbers.
    pub(crate) fn decode_one(numbers: Vec<i64>, shadow: bool) -> Result<Self, RedisError> {
        let &[now_us, allowed, ..] = numbers.as_slice() else {
            return Err(Self::wrong_length(&numbers, 1));
        };
        if numbers.len() != Self::ONE_HEAD + BandReply::LEN {
            return Err(Self::wrong_length(&numbers, 1));
        }
        let allowed = allowed == 1;
        Ok(Self {
            allowed: allowed || shadow,
            shadow_allowed: allowed || !shadow,
            now_us,
            numbers,
            head: Self::ONE_HEAD,
        })
    }

    fn wrong_length(numbers: &[i64], bands: usize) -> RedisError {
        RedisError::Reply(format!("{} numbers for {bands} bands", numbers.len()))
    }

    /// The bands, in the order of the call's keys.
    pub(crate) fn bands(&self) -> impl Iterator<Item = BandReply> + '_ {
        // `decode` checked the length: every chunk is whole.
        self.numbers[self.head..]
            .chunks_exact(BandReply::LEN)
            .filter_map(|chunk| chunk.try_into().ok())
            .map(BandReply::decode)
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

    fn decode([allowed, remaining, reset_after_us, wait_us]: [i64; Self::LEN]) -> Self {
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

/// The reply of a refund call, checked: a [`RefundedBand`] per band.
#[derive(Debug)]
pub(crate) struct RefundReply {
    numbers: Vec<i64>,
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

/// A count or a duration from the scripts, which are never negative but for `wait_us`'s
/// `-1`.
fn nonnegative(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Lua side's names of the numbers, part of both scripts.
    const PROTOCOL_LUA: &str = include_str!(concat!(env!("OUT_DIR"), "/protocol.lua"));

    const ALGORITHMS: [(ScriptAlgorithm, &str); 5] = [
        (ScriptAlgorithm::TokenBucket, "TOKEN_BUCKET"),
        (ScriptAlgorithm::LeakyBucket, "LEAKY_BUCKET"),
        (ScriptAlgorithm::FixedWindow, "FIXED_WINDOW"),
        (ScriptAlgorithm::SlidingWindowLog, "SLIDING_WINDOW_LOG"),
        (ScriptAlgorithm::SlidingWindowCounter, "SLIDING_WINDOW_COUNTER"),
    ];

    /// `lua/protocol.lua` names the numbers this module sends.
    #[test]
    fn the_scripts_know_the_same_numbers() {
        for (algorithm, name) in ALGORITHMS {
            let line = format!("\nlocal {name} = {}\n", algorithm.number());
            assert!(PROTOCOL_LUA.contains(&line), "{line:?}");
        }
        for (name, value) in [
            ("FLAG_SHADOW", Flags::SHADOW),
            ("FLAG_ALGORITHM", Flags::ALGORITHM),
            ("FLAG_BANDS", Flags::BANDS),
        ] {
            let line = format!("\nlocal {name} = {value}\n");
            assert!(PROTOCOL_LUA.contains(&line), "{line:?}");
        }
    }

    #[test]
    fn flags() {
        for (algorithm, _) in ALGORITHMS {
            for bands in [1, 2, 15, 16, 1000] {
                for shadow in [false, true] {
                    let flags = Flags::new(bands, algorithm, shadow);
                    assert_eq!(flags.bands(), i64::try_from(bands).unwrap());
                    assert_eq!(flags.algorithm(), algorithm.number());
                    assert_eq!(flags.is_shadow(), shadow);
                }
            }
        }
        assert_eq!(Flags::new(2, ScriptAlgorithm::FixedWindow, true).get(), 37);
    }

    #[test]
    fn decide_args() {
        let mut args = DecideArgs::new();
        let band = BandArgs {
            capacity: 10,
            a: 1,
            b: 360,
        };
        args.bucket(BucketArgs {
            permits: 1,
            flags: Flags::new(2, ScriptAlgorithm::TokenBucket, false),
        });
        args.band(band);
        args.band(band);
        args.bucket(BucketArgs {
            permits: 3,
            flags: Flags::new(1, ScriptAlgorithm::FixedWindow, true),
        });
        args.band(BandArgs {
            capacity: 5,
            a: 60_000_000,
            b: 0,
        });
        assert_eq!(
            args.into_argv(),
            [2, 1, 32, 10, 1, 360, 10, 1, 360, 3, 21, 5, 60_000_000, 0]
        );
    }

    #[test]
    fn shapes_choose_the_script() {
        let tb = |bands: usize, shadow| BucketArgs {
            permits: 1,
            flags: Flags::new(bands, ScriptAlgorithm::TokenBucket, shadow),
        };
        let band = BandArgs {
            capacity: 10,
            a: 7,
            b: 360,
        };
        for shadow in [false, true] {
            let mut args = DecideArgs::new();
            args.bucket(tb(1, shadow));
            args.band(band);
            assert_eq!(args.shape(), Shape::OneTokenBucket { shadow });
            // capacity, interval, 10 × 360 / 7 = 514 µs: 0 ms + 1001, permits 1, scale 7.
            assert_eq!(args.one_token_bucket_argv(), Some(vec![10, 360, 1001, 1, 7]));
        }
        let mut args = DecideArgs::new();
        args.bucket(tb(1, false));
        args.band(BandArgs {
            capacity: 10_000_000,
            a: 1,
            b: 360,
        });
        // An hour: 3,600,000 ms + 1001; permits and scale of 1 left out.
        assert_eq!(args.one_token_bucket_argv(), Some(vec![10_000_000, 360, 3_601_001]));
        let mut args = DecideArgs::new();
        args.bucket(BucketArgs {
            permits: 3,
            flags: Flags::new(1, ScriptAlgorithm::TokenBucket, false),
        });
        args.band(BandArgs {
            capacity: 10_000_000,
            a: 1,
            b: 360,
        });
        assert_eq!(args.one_token_bucket_argv(), Some(vec![10_000_000, 360, 3_601_001, 3]));
        let mut args = DecideArgs::new();
        args.bucket(tb(2, false));
        args.band(band);
        args.band(band);
        assert_eq!(args.shape(), Shape::TokenBuckets);
        assert_eq!(args.one_token_bucket_argv(), None);
        let mut args = DecideArgs::new();
        args.bucket(tb(1, false));
        args.band(band);
        args.bucket(tb(1, true));
        args.band(band);
        assert_eq!(args.shape(), Shape::TokenBuckets);
        args.bucket(BucketArgs {
            permits: 1,
            flags: Flags::new(1, ScriptAlgorithm::LeakyBucket, false),
        });
        args.band(band);
        assert_eq!(args.shape(), Shape::General);
        let mut args = DecideArgs::new();
        args.bucket(BucketArgs {
            permits: 1,
            flags: Flags::new(1, ScriptAlgorithm::FixedWindow, true),
        });
        args.band(band);
        assert_eq!(args.shape(), Shape::General);
    }

    /// A one-band reply: the request's verdicts follow the band's and its mode.
    #[test]
    fn one_band_replies() {
        for (allowed, shadow, verdicts) in [
            (1, false, (true, true)),
            (0, false, (false, true)),
            (1, true, (true, true)),
            (0, true, (true, false)),
        ] {
            let reply = Reply::decode_one(vec![42, allowed, 9, 100, 0], shadow).unwrap();
            assert_eq!((reply.allowed, reply.shadow_allowed), verdicts);
            assert_eq!(reply.now_us, 42);
            let bands: Vec<_> = reply.bands().collect();
            assert_eq!(bands.len(), 1);
            assert_eq!(bands[0].allowed, allowed == 1);
            assert_eq!(bands[0].remaining, 9);
        }
        assert!(Reply::decode_one(vec![42, 1, 9, 100], false).is_err());
        assert!(Reply::decode_one(vec![42, 1, 9, 100, 0, 0, 0, 0], false).is_err());
    }

    #[test]
    fn refund_args() {
        let mut args = RefundArgs::new(1_700_000_000_000_000);
        args.band(&RefundBand {
            algorithm: ScriptAlgorithm::SlidingWindowCounter,
            permits: 3,
            band: BandArgs {
                capacity: 10,
                a: 60_000_000,
                b: 0,
            },
        });
        assert_eq!(args.into_argv(), [1_700_000_000_000_000, 4, 3, 10, 60_000_000, 0]);
    }

    #[test]
    fn replies() {
        let reply = Reply::decode(vec![1, 0, 42, 1, 9, 100, 0, 0, 0, 7, -1], 2).unwrap();
        assert!(reply.allowed && !reply.shadow_allowed);
        assert_eq!(reply.now_us, 42);
        let bands: Vec<_> = reply.bands().collect();
        assert_eq!(
            bands,
            [
                BandReply {
                    allowed: true,
                    remaining: 9,
                    reset_after: Duration::from_micros(100),
                    wait: Wait::None,
                },
                BandReply {
                    allowed: false,
                    remaining: 0,
                    reset_after: Duration::from_micros(7),
                    wait: Wait::Never,
                },
            ]
        );
        let refunded = RefundReply::decode(vec![3, 50, -1, 0], 2).unwrap();
        let refunded: Vec<_> = refunded.bands().collect();
        assert_eq!(refunded[0].remaining, 3);
        assert_eq!(refunded[1].remaining, 0);
    }

    /// A reply of the wrong length is an error naming what came, never a panic.
    #[test]
    fn malformed_replies() {
        for (numbers, bands) in [
            (vec![], 0),
            (vec![1, 1], 0),
            (vec![1, 1, 5], 1),
            (vec![1, 1, 5, 1, 2, 3, 4, 5], 1),
        ] {
            let error = Reply::decode(numbers.clone(), bands).unwrap_err();
            assert_eq!(
                error.to_string(),
                format!(
                    "unexpected reply from the rate-limit script: {} numbers for {bands} bands",
                    numbers.len()
                )
            );
        }
        assert!(Reply::decode(vec![1, 1, 5], 0).is_ok());
        assert!(RefundReply::decode(vec![1, 2, 3], 2).is_err());
    }
}
