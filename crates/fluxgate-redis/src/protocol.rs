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
fn ceil_div(a: i64, b: i64) -> i64 {
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
    argv: Vec<Value>,
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
    bands: SmallVec<[BandReply; 1]>,
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

    fn wrong_length(numbers: &[i64], bands: usize) -> RedisError {
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
pub(crate) fn nonnegative(n: i64) -> u64 {
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
            ("FLAG_WAITS", Flags::WAITS),
            ("FLAG_BANDS", Flags::BANDS),
            ("CALL_MARKS", CALL_MARKS),
        ] {
            let line = format!("\nlocal {name} = {value}\n");
            assert!(PROTOCOL_LUA.contains(&line), "{line:?}");
        }
    }

    #[test]
    fn flags() {
        for (algorithm, _) in ALGORITHMS {
            for bands in [1, 2, 15, 16, 1000] {
                for (shadow, waits) in [(false, false), (true, false), (false, true), (true, true)] {
                    let mut flags = Flags::new(bands, algorithm, shadow);
                    if waits {
                        flags = flags.waiting();
                    }
                    assert_eq!(flags.bands(), i64::try_from(bands).unwrap());
                    assert_eq!(flags.algorithm(), algorithm.number());
                    assert_eq!(flags.is_shadow(), shadow);
                    assert_eq!(flags.waits(), waits);
                }
            }
        }
        assert_eq!(Flags::new(2, ScriptAlgorithm::FixedWindow, true).get(), 69);
        assert_eq!(Flags::new(2, ScriptAlgorithm::FixedWindow, true).waiting().get(), 85);
    }

    fn text(values: &[Value]) -> Vec<String> {
        values
            .iter()
            .map(|v| match v {
                Value::Integer(n) => n.to_string(),
                Value::String(s) => s.to_string(),
                other => format!("{other:?}"),
            })
            .collect()
    }

    fn rule(bucket: BucketArgs, bands: &[BandArgs]) -> Arc<RuleArgs> {
        Arc::new(RuleArgs::new(bucket, bands.iter().copied().collect()))
    }

    fn tb(bands: usize, shadow: bool, permits: i64) -> BucketArgs {
        BucketArgs {
            permits,
            flags: Flags::new(bands, ScriptAlgorithm::TokenBucket, shadow),
            layout: Some(Str::from_static("b0:10/1s|")),
            max_wait_us: 0,
        }
    }

    #[test]
    fn decide_args() {
        let mut args = DecideArgs::new();
        let band = BandArgs {
            capacity: 10,
            a: 1,
            b: 360,
        };
        args.rule(rule(tb(2, false, 1), &[band, band]));
        // A fixed window the request may wait 2.5 s for: its flags say so, its wait follows.
        args.rule(rule(
            BucketArgs {
                permits: 3,
                flags: Flags::new(1, ScriptAlgorithm::FixedWindow, false),
                layout: None,
                max_wait_us: 2_500_000,
            },
            &[BandArgs {
                capacity: 5,
                a: 60_000_000,
                b: 0,
            }],
        ));
        assert_eq!(
            text(&args.general_argv()),
            [
                "2",
                "1",
                "64",
                "b0:10/1s|",
                "10",
                "1",
                "360",
                "10",
                "1",
                "360",
                "3",
                "52",
                "2500000",
                "5",
                "60000000",
                "0"
            ]
        );
        // A call asking for the bands' marks says so with its bucket count.
        args.mark_places();
        assert_eq!(text(&args.general_argv())[0], "65538");
    }

    #[test]
    fn shapes_choose_the_script() {
        let band = BandArgs {
            capacity: 10,
            a: 7,
            b: 360,
        };
        for shadow in [false, true] {
            let mut args = DecideArgs::new();
            args.rule(rule(tb(1, shadow, 1), &[band]));
            assert_eq!(args.shape(), Shape::OneTokenBucket);
            // 10 × 360 = 0xe10 units, a cost of 360 = 0x168, 3600 / 7 = 514 µs: 0 ms + 1001,
            // scale 7.
            let argv = args.one_token_bucket_argv().unwrap();
            assert_eq!(text(&argv), ["b0:10/1s|", "e10", "168", "1001", "7"]);
        }
        let mut args = DecideArgs::new();
        args.rule(rule(
            tb(1, false, 3),
            &[BandArgs {
                capacity: 10_000_000,
                a: 1,
                b: 360,
            }],
        ));
        // An hour: 3,600,000 ms + 1001; a scale of 1 left out; a cost of 3 × 360.
        let argv = args.one_token_bucket_argv().unwrap();
        assert_eq!(text(&argv), ["b0:10/1s|", "d693a400", "438", "3601001"]);
        let mut args = DecideArgs::new();
        args.rule(rule(tb(2, false, 1), &[band, band]));
        assert_eq!(args.shape(), Shape::TokenBuckets);
        assert_eq!(args.one_token_bucket_argv(), None);
        // More permits than the capacity cost one unit more than the band holds.
        args.rule(rule(tb(1, true, 99), &[band]));
        assert_eq!(
            text(&args.token_buckets_argv()),
            [
                "12",
                "b0:10/1s|",
                "1001",
                "e10",
                "168",
                "7",
                "e10",
                "168",
                "7",
                "b",
                "b0:10/1s|",
                "1001",
                "e10",
                "f78",
                "7"
            ]
        );
        // A rule whose bands all have a scale of 1 sends no scales; its key outlives its
        // longest window (3.6 s) by a second.
        let mut unscaled = DecideArgs::new();
        let band = BandArgs { a: 1, ..band };
        let long = BandArgs { b: 360_000, ..band };
        unscaled.rule(rule(tb(2, false, 2), &[band, long]));
        assert_eq!(
            text(&unscaled.token_buckets_argv()),
            ["10", "b0:10/1s|", "4601", "e10", "2d0", "36ee80", "afc80"]
        );
        args.rule(rule(
            BucketArgs {
                permits: 1,
                flags: Flags::new(1, ScriptAlgorithm::LeakyBucket, false),
                layout: None,
                max_wait_us: 0,
            },
            &[band],
        ));
        assert_eq!(args.shape(), Shape::General);
    }

    /// A token-bucket reply: the script returns each band's debt, the verdicts and figures
    /// follow as the script decided.
    #[test]
    fn token_replies() {
        // 10 per 3,600 µs at scale 1: a permit costs 360 units, the band holds 3,600.
        let band = BandArgs {
            capacity: 10,
            a: 1,
            b: 360,
        };
        for (debt, shadow, verdicts, remaining, wait) in [
            (0, false, (true, true), 9, Wait::None),
            (3_600, false, (false, true), 0, Wait::After(Duration::from_micros(360))),
            (3_500, false, (false, true), 0, Wait::After(Duration::from_micros(260))),
            (3_240, true, (true, true), 0, Wait::None),
            (3_600, true, (true, false), 0, Wait::After(Duration::from_micros(360))),
        ] {
            let mut args = DecideArgs::new();
            args.rule(rule(tb(1, shadow, 1), &[band]));
            let reply = args.token_reply(&[42, debt]).unwrap();
            assert_eq!((reply.allowed, reply.shadow_allowed), verdicts, "{debt}");
            assert_eq!(reply.now_us, 42);
            let bands: Vec<_> = reply.bands().collect();
            assert_eq!(bands.len(), 1);
            assert_eq!(bands[0].allowed, wait == Wait::None);
            assert_eq!(bands[0].remaining, remaining, "{debt}");
            assert_eq!(bands[0].wait, wait, "{debt}");
        }
        // A debt out of range (a state written by hand): a full band, never a panic, and
        // the verdict and the band's report agree.
        for debt in [-1, i64::MIN, i64::MAX] {
            let mut args = DecideArgs::new();
            args.rule(rule(tb(1, false, 1), &[band]));
            let reply = args.token_reply(&[42, debt]).unwrap();
            let bands: Vec<_> = reply.bands().collect();
            assert_eq!(reply.allowed, debt < 0, "{debt}");
            assert_eq!(bands[0].allowed, reply.allowed, "{debt}");
        }
        // Two rules: the second rejects, so the first commits nothing.
        let mut args = DecideArgs::new();
        args.rule(rule(tb(1, false, 1), &[band]));
        args.rule(rule(tb(1, false, 11), &[band]));
        let reply = args.token_reply(&[42, 360, 0]).unwrap();
        assert!(!reply.allowed);
        let bands: Vec<_> = reply.bands().collect();
        assert_eq!(
            bands,
            [
                BandReply {
                    allowed: true,
                    remaining: 9,
                    reset_after: Duration::from_micros(360),
                    wait: Wait::None,
                },
                BandReply {
                    allowed: false,
                    remaining: 10,
                    reset_after: Duration::ZERO,
                    wait: Wait::Never,
                },
            ]
        );
        assert!(args.token_reply(&[42, 0]).is_err());
        assert!(args.token_reply(&[]).is_err());
    }

    /// A request that may wait: its longest wait in the arguments, and the key's expiry
    /// past it.
    #[test]
    fn waiting_arguments() {
        let band = BandArgs {
            capacity: 10,
            a: 1,
            b: 360,
        };
        let waiting = |bands: &[BandArgs]| {
            let mut args = DecideArgs::new();
            args.rule(rule(
                BucketArgs {
                    max_wait_us: 2_500_000,
                    ..tb(bands.len(), false, 1)
                },
                bands,
            ));
            args
        };
        // One band: the scale (1) is sent, then the wait (2.5 s = 0x2625a0 µs); the key
        // outlives the window (3.6 ms) and the wait by a second: 2,503.6 ms, rounded
        // down, + 1001.
        let argv = waiting(&[band]).one_token_bucket_argv().unwrap();
        assert_eq!(text(&argv), ["b0:10/1s|", "e10", "168", "3504", "1", "2625a0"]);
        // Several: the flags say the rule waits (2 × 8 + 4), the wait follows the expiry.
        assert_eq!(
            text(&waiting(&[band, band]).token_buckets_argv()),
            ["14", "b0:10/1s|", "3504", "2625a0", "e10", "168", "e10", "168"]
        );
    }

    /// A token-bucket reply when the request may wait: the verdicts and figures of the
    /// request admitted later, its place taken now, as the scripts decide.
    #[test]
    fn waiting_replies() {
        // 10 per 3,600 µs at scale 1: a permit costs 360 units, the band holds 3,600.
        let band = BandArgs {
            capacity: 10,
            a: 1,
            b: 360,
        };
        let waits = |max_wait_us| BucketArgs {
            max_wait_us,
            ..tb(1, false, 1)
        };
        for (debt, max_wait_us, admitted_after_us) in [
            // A full bucket: admitted now, whatever the wait.
            (3_240, 1_000, Some(0)),
            // Empty: the next permit in 360 µs.
            (3_600, 1_000, Some(360)),
            (3_600, 360, Some(360)),
            (3_600, 359, None),
            // Three waiters ahead: the fourth place, 4 × 360 µs ahead.
            (4_680, 2_000, Some(1_440)),
            (4_680, 1_439, None),
        ] {
            let mut args = DecideArgs::new();
            args.rule(rule(waits(max_wait_us), &[band]));
            let reply = args.token_reply(&[42, debt]).unwrap();
            assert_eq!(reply.allowed, admitted_after_us.is_some(), "{debt} {max_wait_us}");
            assert_eq!(reply.admitted_after_us, admitted_after_us.unwrap_or(0));
            let [b]: [BandReply; 1] = reply.bands().collect::<Vec<_>>().try_into().unwrap();
            if admitted_after_us.is_some() {
                // Committed: the debt grows by the cost, past the capacity while waiting.
                assert_eq!(b.wait, Wait::None);
                assert_eq!(b.reset_after, Duration::from_micros((debt + 360) as u64));
            } else {
                // Refused: the wait counts every place taken ahead.
                assert_eq!(b.wait, Wait::After(Duration::from_micros((debt + 360 - 3_600) as u64)));
            }
            // Every permit taken: none remains.
            assert_eq!(b.remaining, 0);
        }

        // Two rules: the second, waiting, needs 720 µs; the first admits now and its instant
        // lies 1,000 µs ahead, past 720: it takes its place then as now.
        let mut args = DecideArgs::new();
        args.rule(rule(tb(1, false, 1), &[band]));
        args.rule(rule(waits(1_000), &[band]));
        let reply = args.token_reply(&[42, 1_000, 3_960]).unwrap();
        assert!(reply.allowed);
        assert_eq!(reply.admitted_after_us, 720);
        let bands: Vec<_> = reply.bands().collect();
        assert_eq!(bands[0].remaining, (3_600 - 1_360) / 360);
        assert!(bands.iter().all(|b| b.allowed));
        // The first rule's instant lies only 500 µs ahead: taking its place 720 µs ahead
        // would move it on, holding back its other requests: refused at once.
        let reply = args.token_reply(&[42, 500, 3_960]).unwrap();
        assert!(!reply.allowed);
        assert_eq!(reply.admitted_after_us, 0);
        // With a shadow rule that admits now but not 720 µs ahead (its instant lies before
        // then): refused, and the shadow rule's verdict is now's.
        let mut shadowed = args.clone();
        shadowed.rule(rule(tb(1, true, 1), &[band]));
        let reply = shadowed.token_reply(&[42, 500, 3_960, 0]).unwrap();
        assert_eq!((reply.allowed, reply.shadow_allowed), (false, true));
        // A rule that may not wait refuses at once, whatever the others allow.
        let reply = args.token_reply(&[42, 3_600, 0]).unwrap();
        assert!(!reply.allowed);
        // A shadow rule never makes a request wait.
        let mut args = DecideArgs::new();
        args.rule(rule(
            BucketArgs {
                max_wait_us: 1_000,
                ..tb(1, true, 1)
            },
            &[band],
        ));
        let reply = args.token_reply(&[42, 3_600]).unwrap();
        assert_eq!(
            (reply.allowed, reply.shadow_allowed, reply.admitted_after_us),
            (true, false, 0)
        );
    }

    #[test]
    fn refund_args() {
        let mut args = RefundArgs::new(1_700_000_000_000_000, 1_699_999_999_000_000);
        args.band(&RefundBand {
            algorithm: ScriptAlgorithm::SlidingWindowCounter,
            permits: 3,
            band: BandArgs {
                capacity: 10,
                a: 60_000_000,
                b: 0,
            },
            place: None,
            expect: None,
        });
        args.band(&RefundBand {
            algorithm: ScriptAlgorithm::TokenBucket,
            permits: 1,
            band: BandArgs {
                capacity: 10,
                a: 1,
                b: 360,
            },
            place: Some(RulePlace {
                layout: Str::from_static("b0:10/1s|"),
                index: 1,
                count: 1,
            }),
            expect: Some("6553f100:3".to_owned()),
        });
        assert_eq!(
            text(&args.into_argv()),
            [
                "1700000000000000",
                "1699999999000000",
                "4",
                "3",
                "10",
                "60000000",
                "0",
                "0",
                "1",
                "10",
                "1",
                "360",
                "b0:10/1s|",
                "1",
                "1",
                "6553f100:3"
            ]
        );
    }

    /// A waiting request's marks: each committed band's state after it, as the scripts
    /// write it.
    #[test]
    fn marks_of_a_waiting_request() {
        // 10 per 3,600 µs at scale 7 (a permit costs 360 units, 51 3/7 µs).
        let band = BandArgs {
            capacity: 10,
            a: 7,
            b: 360,
        };
        let mut args = DecideArgs::new();
        args.rule(rule(
            BucketArgs {
                max_wait_us: 1_000,
                ..tb(1, false, 1)
            },
            &[band],
        ));
        // Full: 3,600 units of debt; the request's place 360 units past the capacity.
        let reply = args.token_reply(&[1_000, 3_600]).unwrap();
        assert_eq!(reply.admitted_after_us, 52);
        // After: 3,960 units = 565 µs and 5 units (565 × 7 = 3,955).
        assert_eq!(reply.marks, [(1_565u128 << 64) | 5]);
        assert_eq!(expected_state(reply.marks[0]).as_deref(), Some("61d:5"));
        assert_eq!(expected_state((0x61d_u128) << 64).as_deref(), Some("61d"));
        assert_eq!(expected_state(0), None);
        // Admitted at once: no marks.
        assert!(args.token_reply(&[1_000, 0]).unwrap().marks.is_empty());
    }

    #[test]
    fn replies() {
        let reply = Reply::decode(&[1, 0, 42, 0, 1, 9, 100, 0, 0, 0, 7, -1], 2, false).unwrap();
        assert!(reply.allowed && !reply.shadow_allowed);
        assert_eq!(reply.now_us, 42);
        assert_eq!(reply.admitted_after_us, 0);
        assert!(reply.marks.is_empty());
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
        // Admitted 30 µs later: each band's mark follows the figures (0 for a window band).
        let later = Reply::decode(&[1, 1, 42, 30, 1, 0, 1_530, 0, 1, 2, 60, 0, 1_572, 3, 0, 0], 2, false).unwrap();
        assert!(later.allowed && later.shadow_allowed);
        assert_eq!(later.admitted_after_us, 30);
        assert_eq!(later.marks, [(1_572u128 << 64) | 3, 0]);
        assert_eq!(expected_leaky_state(later.marks[0]).as_deref(), Some("1572:3"));
        assert_eq!(expected_leaky_state(1_572u128 << 64).as_deref(), Some("1572:0"));
        assert_eq!(expected_leaky_state(0), None);
        assert_eq!(later.bands().count(), 2);
        // Admitted at once, its marks asked for (a lease's call).
        let marked = Reply::decode(&[1, 1, 42, 0, 1, 5, 900, 0, 1_042, 7], 1, true).unwrap();
        assert_eq!(marked.marks, [(1_042u128 << 64) | 7]);
        assert!(Reply::decode(&[1, 1, 42, 0, 1, 5, 900, 0], 1, true).is_err());
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
            (vec![1, 1, 5], 0),
            (vec![1, 1, 5, 0], 1),
            (vec![1, 1, 5, 0, 1, 2, 3, 4, 5], 1),
            // Admitted later: the marks are missing.
            (vec![1, 1, 5, 9, 1, 2, 3, 4], 1),
        ] {
            let error = Reply::decode(&numbers, bands, false).unwrap_err();
            assert_eq!(
                error.to_string(),
                format!(
                    "unexpected reply from the rate-limit script: {} numbers for {bands} bands",
                    numbers.len()
                )
            );
        }
        assert!(Reply::decode(&[1, 1, 5, 0], 0, false).is_ok());
        assert!(RefundReply::decode(vec![1, 2, 3], 2).is_err());
    }
}
