//! The protocol between the crate and its scripts, typed: what a decision or a refund
//! call sends in `ARGV` and what it answers. `lua/README.md` ("Protocol") states it once,
//! field by field, next to the scripts' contract, and `lua/protocol.lua` names the same
//! numbers on the Lua side.

use std::sync::Arc;
use std::time::Duration;

use fluxgate_core::limiter::Wait;
use fluxgate_core::Algorithm;
use fred::bytes_utils::Str;
use fred::types::Value;
use smallvec::SmallVec;

use crate::error::RedisError;
use crate::rule_script::{self, Constants, RuleScript};

mod refund;
mod reply;
#[cfg(test)]
mod tests;

pub(crate) use refund::*;
pub(crate) use reply::*;

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
/// `bands × 32 + algorithm × 2 + shadow`, and `16` more in a call where the request may
/// wait for the bucket (`FLAG_*` in `lua/protocol.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Flags(i64);

impl Flags {
    const SHADOW: i64 = 1;
    const ALGORITHM: i64 = 2;
    const WAITS: i64 = 16;
    const BANDS: i64 = 32;

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

    /// The flags of the same bucket in a call where the request may wait for it.
    fn waiting(self) -> Self {
        Self(self.0 + Self::WAITS)
    }

    /// Whether the request may wait for the bucket.
    #[cfg(test)]
    fn waits(self) -> bool {
        self.0 % Self::BANDS >= Self::WAITS
    }

    /// The band count.
    #[cfg(test)]
    fn bands(self) -> i64 {
        self.0 / Self::BANDS
    }

    /// The algorithm's number.
    fn algorithm(self) -> i64 {
        self.0 % Self::WAITS / Self::ALGORITHM
    }

    /// Whether the rule is in shadow mode.
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

/// What a decision call says of one bucket before its bands: its cost, flags and, for a
/// token bucket, its layout (the names of its bands, see `lua/token_bucket.lua`, "State").
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BucketArgs {
    pub(crate) permits: i64,
    pub(crate) flags: Flags,
    pub(crate) layout: Option<Str>,
    /// How long the request may wait for the rule's bands to admit it, in µs (0: refused
    /// at once); see [`DecideArgs::token_reply`] and `lua/decide.lua`.
    pub(crate) max_wait_us: i64,
}

/// What a decision call sends for one rule, worked out once per rule (see
/// `crate::plan`): its [`BucketArgs`], its bands' [`BandArgs`] and, for a token-bucket
/// rule, its part of the `ARGV` of each token-bucket script, already written.
#[derive(Debug, Clone)]
pub(crate) struct RuleArgs {
    pub(crate) bucket: BucketArgs,
    pub(crate) bands: SmallVec<[BandArgs; 4]>,
    /// Its part of `token_buckets.lua`'s `ARGV`; empty for another algorithm.
    token_buckets_argv: Vec<Value>,
    /// The whole `ARGV` of `one_token_bucket.lua`, for a token-bucket rule of one band.
    one_token_bucket_argv: Option<Vec<Value>>,
    /// For a token-bucket rule of one band, its own script and that script's `ARGV` (the
    /// cost alone); `None` past the process's [`rule_script::MOST`].
    rule_script: Option<(Arc<RuleScript>, Vec<Value>)>,
}

impl RuleArgs {
    /// A rule's arguments: `bucket`'s flags name as many bands as `bands` holds.
    pub(crate) fn new(bucket: BucketArgs, bands: SmallVec<[BandArgs; 4]>) -> Self {
        let mut args = Self {
            bucket,
            bands,
            token_buckets_argv: Vec::new(),
            one_token_bucket_argv: None,
            rule_script: None,
        };
        if args.is_token_bucket() {
            args.token_buckets_argv = args.write_token_buckets_argv();
            if let [band] = args.bands.as_slice() {
                args.one_token_bucket_argv = Some(args.write_one_token_bucket_argv(*band));
                args.rule_script = args.write_rule_script(*band);
            }
        }
        args
    }

    /// Whether the rule is a token bucket, which the token-bucket scripts decide.
    fn is_token_bucket(&self) -> bool {
        self.bucket.flags.algorithm() == ScriptAlgorithm::TokenBucket.number()
    }

    /// Its part of the `ARGV` of `token_buckets.lua`: `bands × 8 + waits × 4 + scaled × 2 +
    /// shadow`, its layout and its key's expiry in ms (its longest window and longest wait
    /// plus one second, in decimal, passed to `PSETEX` as it came), then its longest wait in
    /// µs when the request may wait (`waits`), then for each of its bands its capacity and
    /// the request's cost in units and, when some band of the rule has a scale other than 1
    /// (`scaled`), its scale, in hexadecimal (see `lua/README.md`, "The token-bucket call").
    fn write_token_buckets_argv(&self) -> Vec<Value> {
        let bucket = &self.bucket;
        let bands: SmallVec<[TokenBand; 4]> = self
            .bands
            .iter()
            .map(|band| TokenBand::new(bucket.permits, *band))
            .collect();
        let scaled = bands.iter().any(|band| band.scale != 1);
        let mut argv = Vec::with_capacity(3 + 3 * bands.len());
        let count = i64::try_from(bands.len()).unwrap_or(i64::MAX);
        let waits = bucket.max_wait_us > 0;
        let flags = count.saturating_mul(8)
            + 4 * i64::from(waits)
            + 2 * i64::from(scaled)
            + i64::from(bucket.flags.is_shadow());
        argv.push(hex(flags));
        argv.push(Value::String(bucket.layout.clone().unwrap_or_default()));
        // capacity × interval / scale is a band's window in µs (validated below 2^52).
        let window_us = bands.iter().map(|band| band.cap / band.scale.max(1)).max().unwrap_or(0);
        argv.push(Value::String(Str::from(self.expiry_ms(window_us).to_string())));
        if waits {
            argv.push(hex(bucket.max_wait_us));
        }
        for band in bands {
            argv.extend([hex(band.cap), hex(band.cost)]);
            if scaled {
                argv.push(hex(band.scale));
            }
        }
        argv
    }

    /// The `ARGV` of `one_token_bucket.lua`: the layout, the band's capacity and the
    /// request's cost in units (hexadecimal), the key's expiry in ms (the window and the
    /// longest wait plus one second), then the scale (hexadecimal), left out when it is 1
    /// and the request may not wait, then the longest wait in µs (hexadecimal) when it may.
    fn write_one_token_bucket_argv(&self, band: BandArgs) -> Vec<Value> {
        let numbers = TokenBand::new(self.bucket.permits, band);
        // capacity × interval / scale is the window in µs (validated below 2^52).
        let window_us = numbers.cap / numbers.scale.max(1);
        let mut argv = vec![
            Value::String(self.bucket.layout.clone().unwrap_or_default()),
            hex(numbers.cap),
            hex(numbers.cost),
            Value::Integer(self.expiry_ms(window_us)),
        ];
        let waits = self.bucket.max_wait_us > 0;
        if numbers.scale != 1 || waits {
            argv.push(hex(numbers.scale));
        }
        if waits {
            argv.push(hex(self.bucket.max_wait_us));
        }
        argv
    }

    /// The rule's own one-band script ([`rule_script`]) and its `ARGV`: the request's cost
    /// in units (hexadecimal); the rest of [`write_one_token_bucket_argv`]'s arguments are
    /// in the script.
    ///
    /// [`write_one_token_bucket_argv`]: Self::write_one_token_bucket_argv
    fn write_rule_script(&self, band: BandArgs) -> Option<(Arc<RuleScript>, Vec<Value>)> {
        let numbers = TokenBand::new(self.bucket.permits, band);
        let layout = self.bucket.layout.as_deref().unwrap_or_default();
        let script = rule_script::rule_script(Constants {
            layout,
            cap: numbers.cap,
            expiry_ms: self.expiry_ms(numbers.cap / numbers.scale.max(1)),
            scale: numbers.scale,
            max_wait_us: self.bucket.max_wait_us,
        })?;
        Some((script, vec![hex(numbers.cost)]))
    }

    /// A token-bucket rule's key expiry in ms, its longest window being `window_us`: one
    /// second after the last instant a band's state may lie ahead of now (its window, and
    /// the longest wait of a request that took its place ahead), as `px()` in
    /// `lua/common.lua`.
    fn expiry_ms(&self, window_us: i64) -> i64 {
        window_us.saturating_add(self.bucket.max_wait_us) / 1000 + 1001
    }
}

/// The arguments of a decision call: each rule's [`RuleArgs`], written for the script of
/// their [`Shape`]; and, for the token-bucket scripts, what reads their reply.
#[derive(Debug, Clone)]
pub(crate) struct DecideArgs {
    rules: SmallVec<[Arc<RuleArgs>; 3]>,
    /// The bands of all rules.
    band_count: usize,
    /// Every rule so far is a token bucket.
    token_buckets: bool,
    /// Whether the reply gives the bands' marks even for a request admitted at once
    /// ([`Reply::marks`]).
    marks: bool,
}

/// Which script decides a call: the one-band script, the token buckets' script or the
/// general one (see `lua/README.md`). They decide alike; the first two cost less.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// One bucket of one token-bucket band (`one_token_bucket.lua`), in shadow mode or not.
    OneTokenBucket,
    /// Token buckets only (`token_buckets.lua`).
    TokenBuckets,
    /// Any other (`decide.lua`).
    General,
}

/// Added to `decide.lua`'s bucket count when the reply is to give the bands' marks
/// (`CALL_MARKS` in `lua/protocol.lua`).
const CALL_MARKS: i64 = 65_536;

/// The numbers of a decision script's reply: in place for a token-bucket request of up to
/// seven bands.
pub(crate) type Numbers = SmallVec<[i64; 8]>;

/// A number in hexadecimal, as the token-bucket scripts read it (`tonumber(s, 16)`, which
/// Lua 5.1 parses with `strtoul`, cheaper than the `strtod` of a decimal number).
fn hex(n: i64) -> Value {
    Value::String(Str::from(format!("{n:x}")))
}

impl DecideArgs {
    /// No rule yet.
    pub(crate) fn new() -> Self {
        Self {
            rules: SmallVec::new(),
            band_count: 0,
            token_buckets: true,
            marks: false,
        }
    }

    /// Asks the reply for the bands' marks ([`Reply::marks`]) whether the request waits or
    /// not.
    pub(crate) fn mark_places(&mut self) {
        self.marks = true;
    }

    /// Whether the reply gives the bands' marks even for a request admitted at once.
    pub(crate) fn marks_places(&self) -> bool {
        self.marks
    }

    /// A rule of the call.
    pub(crate) fn rule(&mut self, rule: Arc<RuleArgs>) {
        self.token_buckets &= rule.is_token_bucket();
        self.band_count += rule.bands.len();
        self.rules.push(rule);
    }

    /// Whether `other` has the same arguments: the same rules' arguments (the same
    /// [`RuleArgs`], which these hold), in the same order, and the same request for the
    /// bands' marks (the general script's arguments say it).
    pub(crate) fn same_as(&self, other: &Self) -> bool {
        self.marks == other.marks
            && self.rules.len() == other.rules.len()
            && self.rules.iter().zip(&other.rules).all(|(a, b)| Arc::ptr_eq(a, b))
    }

    /// The number of bands.
    pub(crate) fn band_count(&self) -> usize {
        self.band_count
    }

    /// The script that decides these arguments.
    pub(crate) fn shape(&self) -> Shape {
        match (self.token_buckets, self.rules.len(), self.band_count) {
            (true, 1, 1) => Shape::OneTokenBucket,
            (true, _, _) => Shape::TokenBuckets,
            _ => Shape::General,
        }
    }

    /// Each bucket with its bands.
    fn buckets(&self) -> impl Iterator<Item = (&BucketArgs, &[BandArgs])> + '_ {
        self.rules.iter().map(|rule| (&rule.bucket, rule.bands.as_slice()))
    }

    /// The `ARGV` of `decide.lua`: the bucket count (plus [`CALL_MARKS`] when the reply is
    /// to give the bands' marks), then each bucket's permits, flags, (a token bucket)
    /// layout and (a bucket the request may wait for) longest wait in µs, followed by its
    /// bands' three numbers.
    pub(crate) fn general_argv(&self) -> Vec<Value> {
        let mut argv = Vec::with_capacity(1 + 4 * self.rules.len() + 3 * self.band_count);
        let buckets = i64::try_from(self.rules.len()).unwrap_or(i64::MAX);
        argv.push(Value::Integer(if self.marks { buckets + CALL_MARKS } else { buckets }));
        for (bucket, bands) in self.buckets() {
            let waits = bucket.max_wait_us > 0;
            let flags = if waits { bucket.flags.waiting() } else { bucket.flags };
            argv.extend([Value::Integer(bucket.permits), Value::Integer(flags.get())]);
            if let Some(layout) = &bucket.layout {
                argv.push(Value::String(layout.clone()));
            }
            if waits {
                argv.push(Value::Integer(bucket.max_wait_us));
            }
            for band in bands {
                argv.extend([band.capacity, band.a, band.b].map(Value::Integer));
            }
        }
        argv
    }

    /// The `ARGV` of `token_buckets.lua`: each rule's part, written when its arguments were
    /// worked out ([`RuleArgs::new`]).
    pub(crate) fn token_buckets_argv(&self) -> Vec<Value> {
        let mut argv = Vec::with_capacity(self.rules.iter().map(|r| r.token_buckets_argv.len()).sum());
        for rule in &self.rules {
            argv.extend(rule.token_buckets_argv.iter().cloned());
        }
        argv
    }

    /// The rule's own one-band script and its `ARGV`, for [`Shape::OneTokenBucket`] (see
    /// [`rule_script`]); `None` for another shape, or a rule without one.
    pub(crate) fn rule_script(&self) -> Option<(&Arc<RuleScript>, &[Value])> {
        match (self.shape(), self.rules.as_slice()) {
            (Shape::OneTokenBucket, [rule]) => {
                let (script, argv) = rule.rule_script.as_ref()?;
                Some((script, argv))
            }
            _ => None,
        }
    }

    /// The `ARGV` of `one_token_bucket.lua`, for [`Shape::OneTokenBucket`] (see
    /// [`RuleArgs`]); `None` for another shape.
    pub(crate) fn one_token_bucket_argv(&self) -> Option<Vec<Value>> {
        match (self.shape(), self.rules.as_slice()) {
            (Shape::OneTokenBucket, [rule]) => rule.one_token_bucket_argv.clone(),
            _ => None,
        }
    }

    /// The reply of a token-bucket script (`now_us`, then each band's debt before the
    /// request), read as the script decided: a rule admits when each of its bands does; the
    /// enforced rules commit when they all admit, the shadow rules when, besides, every
    /// shadow rule admits. When an enforced band refuses and every refusing one lets the
    /// request wait ([`wait_us`](Self::wait_us)), the rules are decided again at that
    /// instant, and the request admitted then commits now.
    ///
    /// # Errors
    ///
    /// [`RedisError::Reply`] when it has not `1 + bands` numbers.
    pub(crate) fn token_reply(&self, numbers: &[i64]) -> Result<Reply, RedisError> {
        let Some((&now_us, debts)) = numbers.split_first() else {
            return Err(Reply::wrong_length(numbers, self.band_count));
        };
        if debts.len() != self.band_count {
            return Err(Reply::wrong_length(numbers, self.band_count));
        }
        let (mut allowed, mut shadow_allowed) = self.verdicts(debts, 0);
        let mut off = 0;
        if !allowed {
            // Decided again at the instant the request would wait for; refused there too, it
            // is refused now, with the shadow rules' verdict of now.
            if let Some(wait) = self.wait_us(debts) {
                let (later, shadow_later) = self.verdicts(debts, wait);
                if later {
                    (allowed, shadow_allowed, off) = (true, shadow_later, wait);
                }
            }
        }
        let mut replies = SmallVec::with_capacity(self.band_count);
        let mut marks = Vec::new();
        let mut debts = debts.iter();
        for (bucket, bands) in self.buckets() {
            let commit = allowed && (shadow_allowed || !bucket.flags.is_shadow());
            for (band, &debt) in bands.iter().zip(debts.by_ref()) {
                let band = TokenBand::new(bucket.permits, *band);
                replies.push(band.reply(debt, commit));
                if off > 0 || self.marks {
                    marks.push(if commit { band.mark(now_us, debt) } else { 0 });
                }
            }
        }
        Ok(Reply {
            allowed,
            shadow_allowed,
            now_us,
            admitted_after_us: off,
            marks,
            bands: replies,
        })
    }

    /// Whether the enforced rules, and the shadow rules, admit a request `off` µs after the
    /// decision, each band's debt at the decision being in `debts` (see
    /// [`TokenBand::admits_at`]).
    fn verdicts(&self, debts: &[i64], off: i64) -> (bool, bool) {
        let (mut allowed, mut shadow_allowed) = (true, true);
        let mut debts = debts.iter();
        for (bucket, bands) in self.buckets() {
            let admits = bands.iter().zip(debts.by_ref()).fold(true, |all, (band, &debt)| {
                all & TokenBand::new(bucket.permits, *band).admits_at(debt, off)
            });
            if bucket.flags.is_shadow() {
                shadow_allowed &= admits;
            } else {
                allowed &= admits;
            }
        }
        (allowed, shadow_allowed)
    }

    /// How long, in µs, a request some enforced band refuses waits for the last of them to
    /// admit it, if each such band's rule lets it wait that long (its `max_wait_us`);
    /// `None` when one does not.
    fn wait_us(&self, debts: &[i64]) -> Option<i64> {
        let (mut wait, mut most) = (0, i64::MAX);
        let mut debts = debts.iter();
        for (bucket, bands) in self.buckets() {
            for (band, &debt) in bands.iter().zip(debts.by_ref()) {
                let band = TokenBand::new(bucket.permits, *band);
                if bucket.flags.is_shadow() || band.admits(debt) {
                    continue;
                }
                wait = wait.max(ceil_div(band.excess(debt), band.scale));
                most = most.min(bucket.max_wait_us);
            }
        }
        (wait <= most).then_some(wait)
    }
}

/// A token-bucket band as its scripts compute it, in units of `1/scale` µs: its capacity
/// (`cap`), the request's cost (`cost`, one unit more than `cap` when the request asks more
/// than the capacity, which the band never admits), its scale and interval (see
/// `lua/token_bucket.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TokenBand {
    cap: i64,
    cost: i64,
    scale: i64,
    interval: i64,
}

impl TokenBand {
    fn new(permits: i64, band: BandArgs) -> Self {
        let BandArgs {
            capacity,
            a: scale,
            b: interval,
        } = band;
        // Validated: capacity × interval <= 2^52, so neither product leaves the exact range.
        let permits = permits.clamp(0, capacity.saturating_add(1));
        Self {
            cap: capacity.saturating_mul(interval),
            cost: permits.saturating_mul(interval),
            scale: scale.max(1),
            interval: interval.max(1),
        }
    }

    /// How far the request's cost takes the band past its capacity, its debt (the units its
    /// instant lies ahead of now) being `debt`: the band admits when it is at most 0.
    fn excess(self, debt: i64) -> i64 {
        debt.max(0).saturating_add(self.cost).saturating_sub(self.cap)
    }

    /// The band's state after the request committed at `now_us`, its debt before being
    /// `debt`: its instant in µs (high 64 bits) and its remainder (low), as the scripts
    /// store it (see [`expected_state`]).
    fn mark(self, now_us: i64, debt: i64) -> u128 {
        let after = debt.max(0).saturating_add(self.cost);
        let whole = after / self.scale;
        let (tat, frac) = (now_us.saturating_add(whole), after - whole * self.scale);
        (u128::from(nonnegative(tat)) << 64) | u128::from(nonnegative(frac))
    }

    /// Whether the band admits the request, its debt being `debt`.
    fn admits(self, debt: i64) -> bool {
        self.excess(debt) <= 0
    }

    /// Whether the band admits the request at `off` µs after the decision, its debt at the
    /// decision being `debt`, and takes its place then as it would now: its stored instant
    /// lies at or past that instant (whole µs: `debt` less its remainder, at least `off ×
    /// scale`), so that it does not jump ahead, and `debt + cost - off × scale <= cap`. At
    /// `off = 0`, whether it admits now.
    fn admits_at(self, debt: i64, off: i64) -> bool {
        // The scripts never answer a negative debt; a state Redis read wrong (a key written
        // by hand) is a full band, as in `reply`.
        let debt = debt.max(0);
        let ahead = off.saturating_mul(self.scale);
        debt - debt % self.scale >= ahead && self.excess(debt) <= ahead
    }

    /// What the band reports after the decision, its debt before being `debt`: committed
    /// (admitted now, or its place taken for later), its debt grows by the cost. The debt
    /// may exceed the capacity (requests waiting for a later instant, or a rule changed):
    /// remaining counts from the capacity, the reset and the wait from the whole debt.
    fn reply(self, debt: i64, committed: bool) -> BandReply {
        let debt = debt.max(0);
        let allowed = committed || self.admits(debt);
        let after = if committed {
            debt.saturating_add(self.cost)
        } else {
            debt
        };
        let wait = if allowed {
            Wait::None
        } else if self.cost > self.cap {
            Wait::Never
        } else {
            Wait::After(Duration::from_micros(nonnegative(
                ceil_div(self.excess(debt), self.scale).max(1),
            )))
        };
        BandReply {
            allowed,
            remaining: nonnegative((self.cap - after.min(self.cap)) / self.interval),
            reset_after: Duration::from_micros(nonnegative(ceil_div(after, self.scale))),
            wait,
        }
    }
}
