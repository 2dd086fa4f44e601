//! A reference model of the five algorithms, written from their definitions
//! (docs/algorithms.md) and nothing else: the differential test (`tests/redis/differential.rs`)
//! runs the same requests through it and through a real limiter and compares every figure.
//!
//! It is meant to be plainly correct, not fast:
//!
//! - time is a count of *ticks* (nanoseconds for the in-memory limiter, microseconds for
//!   Redis, whose scripts count in `TIME` microseconds), and a band's window is a number
//!   of ticks;
//! - each band keeps the state its definition talks about (tokens, a queue level, a count
//!   per window, a log of admitted requests), advanced to any instant without traffic by
//!   [`usage`], in exact integers;
//! - every band is judged the same way: at an instant it *uses* `used / scale` of its
//!   capacity, admits `p` permits iff `p <= C` and `used + p × scale <= C × scale`, has
//!   `floor((C × scale − used) / scale)` remaining and is back to its full capacity iff
//!   `used == 0`;
//! - reset and retry-after are found by binary search over time on the band's own state
//!   (without traffic a band only recovers), never by a closed formula.
//!
//! The algorithms, for a band of capacity C and window W ticks and a request of p permits
//! at t:
//!
//! - token bucket: tokens refill continuously at C / W per tick, start at C and never
//!   exceed it; kept as `tokens × W`, an integer;
//! - leaky bucket: a queue of C leaking one unit at each instant `anchor + k × W / C`
//!   (k >= 1), `anchor` being the instant of the band's first admitted request; the grid
//!   continues while the queue is empty;
//! - fixed window: a count per window `[k × W, (k + 1) × W)` of absolute ticks;
//! - sliding window log: the admitted requests `(t_i, p_i)`; those with `t_i > t − W` count;
//! - sliding window counter: a count per aligned window; at t in the window ending at
//!   `end`, `previous × (end − t) / W + current` is used.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fluxgate::core::limiter::{AcquireOutcome, AcquireRequest, Bucket, Wait};
use fluxgate::core::{Algorithm, BoxError, Clock, ManualClock, MaybeReady, Mode, RateLimiter};

use super::backend::{advance_to, Backend, Waiting};

/// An instant or a duration, in ticks.
pub(crate) type Tick = u64;

/// What a tick is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unit {
    /// The in-memory limiter's nanoseconds.
    Nanos,
    /// Redis `TIME` microseconds.
    Micros,
}

impl Unit {
    pub(crate) fn nanos_per_tick(self) -> u64 {
        match self {
            Unit::Nanos => 1,
            Unit::Micros => 1_000,
        }
    }

    /// A whole number of ticks (windows are whole milliseconds).
    pub(crate) fn ticks(self, d: Duration) -> Tick {
        let nanos = u64::try_from(d.as_nanos()).expect("a duration within u64 nanoseconds");
        nanos / self.nanos_per_tick()
    }

    pub(crate) fn duration(self, ticks: Tick) -> Duration {
        Duration::from_nanos(ticks * self.nanos_per_tick())
    }
}

/// One band: its algorithm, capacity and window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct BandSpec {
    pub(crate) algorithm: Algorithm,
    pub(crate) capacity: u64,
    pub(crate) window: Tick,
}

/// A band's state; `None` (in [`Model`]) is a band that has never admitted anything.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Token bucket: `tokens × W` at instant `at`.
    Tokens { at: Tick, scaled: u128 },
    /// Leaky bucket: `level` units queued at `at`, leaking on the grid `anchor + k × W / C`.
    /// `expires`: when the state is forgotten (Redis key expiry, see [`Model::redis`]).
    Queue {
        anchor: Tick,
        at: Tick,
        level: u64,
        expires: Option<Tick>,
    },
    /// Fixed window: the count of window number `index` (`[index × W, (index + 1) × W)`).
    Window { index: u64, count: u64 },
    /// Sliding window log: every admitted request, `(instant, permits)`.
    Log(Vec<(Tick, u64)>),
    /// Sliding window counter: the count of every window, by window number.
    Counts(BTreeMap<u64, u64>),
}

/// What a band uses of its capacity at an instant: `used / scale`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Usage {
    used: u128,
    scale: u128,
}

impl Usage {
    fn admits(self, capacity: u64, permits: u64) -> bool {
        permits <= capacity && self.used + u128::from(permits) * self.scale <= u128::from(capacity) * self.scale
    }

    fn remaining(self, capacity: u64) -> u64 {
        let full = u128::from(capacity) * self.scale;
        u64::try_from((full - self.used.min(full)) / self.scale).expect("at most the capacity")
    }

    fn is_full(self) -> bool {
        self.used == 0
    }
}

/// The state as it is at `t`, with no traffic since it was written: a forgotten state is none.
fn live(state: Option<&State>, t: Tick) -> Option<&State> {
    match state {
        Some(State::Queue {
            expires: Some(expires), ..
        }) if t > *expires => None,
        s => s,
    }
}

/// What the band uses at `t` (at or after the last write), without traffic in between.
fn usage(band: BandSpec, state: Option<&State>, t: Tick) -> Usage {
    let c = u128::from(band.capacity);
    let w = u128::from(band.window);
    match (band.algorithm, live(state, t)) {
        (Algorithm::TokenBucket, state) => {
            let tokens = match state {
                // A new bucket is full.
                None => c * w,
                Some(State::Tokens { at, scaled }) => (scaled + c * u128::from(t - at)).min(c * w),
                Some(s) => panic!("token bucket with {s:?}"),
            };
            Usage {
                used: c * w - tokens,
                scale: w,
            }
        }
        (Algorithm::LeakyBucket, state) => {
            let level = match state {
                None => 0,
                Some(&State::Queue { anchor, at, level, .. }) => {
                    // Leaks at anchor + k × W / C: k <= (x − anchor) × C / W of them by x.
                    let leaks_by = |x: Tick| u128::from(x - anchor) * c / w;
                    let leaked = leaks_by(t) - leaks_by(at);
                    u128::from(level).saturating_sub(leaked)
                }
                Some(s) => panic!("leaky bucket with {s:?}"),
            };
            Usage { used: level, scale: 1 }
        }
        (Algorithm::FixedWindow, state) => {
            let count = match state {
                None => 0,
                Some(&State::Window { index, count }) if index == t / band.window => count,
                Some(State::Window { .. }) => 0,
                Some(s) => panic!("fixed window with {s:?}"),
            };
            Usage {
                used: u128::from(count),
                scale: 1,
            }
        }
        (Algorithm::SlidingWindowLog, state) => {
            let count: u64 = match state {
                None => 0,
                Some(State::Log(entries)) => entries
                    .iter()
                    .filter(|(at, _)| u128::from(*at) + w > u128::from(t))
                    .map(|(_, p)| p)
                    .sum(),
                Some(s) => panic!("sliding window log with {s:?}"),
            };
            Usage {
                used: u128::from(count),
                scale: 1,
            }
        }
        (Algorithm::SlidingWindowCounter, state) => {
            let k = t / band.window;
            let end = (k + 1) * band.window;
            let (previous, current) = match state {
                None => (0, 0),
                Some(State::Counts(counts)) => {
                    let of = |i: u64| counts.get(&i).copied().unwrap_or(0);
                    (if k > 0 { of(k - 1) } else { 0 }, of(k))
                }
                Some(s) => panic!("sliding window counter with {s:?}"),
            };
            Usage {
                used: u128::from(previous) * u128::from(end - t) + u128::from(current) * w,
                scale: w,
            }
        }
        (algorithm, _) => panic!("the model has no {algorithm:?}"),
    }
}

/// The state after admitting `permits` at `t`. `ttl`: when a written leaky bucket expires.
fn commit(band: BandSpec, state: Option<State>, t: Tick, permits: u64, ttl: Option<Tick>) -> State {
    let used = usage(band, state.as_ref(), t);
    let c = u128::from(band.capacity);
    let w = u128::from(band.window);
    match band.algorithm {
        Algorithm::TokenBucket => State::Tokens {
            at: t,
            scaled: c * w - used.used - u128::from(permits) * w,
        },
        Algorithm::LeakyBucket => {
            let anchor = match live(state.as_ref(), t) {
                Some(&State::Queue { anchor, .. }) => anchor,
                _ => t,
            };
            State::Queue {
                anchor,
                at: t,
                level: u64::try_from(used.used).expect("a level") + permits,
                expires: ttl.map(|ttl| t + ttl),
            }
        }
        Algorithm::FixedWindow => State::Window {
            index: t / band.window,
            count: u64::try_from(used.used).expect("a count") + permits,
        },
        Algorithm::SlidingWindowLog => {
            let mut entries = match state {
                Some(State::Log(entries)) => entries,
                _ => Vec::new(),
            };
            entries.push((t, permits));
            State::Log(entries)
        }
        Algorithm::SlidingWindowCounter => {
            let mut counts = match state {
                Some(State::Counts(counts)) => counts,
                _ => BTreeMap::new(),
            };
            *counts.entry(t / band.window).or_insert(0) += permits;
            State::Counts(counts)
        }
        algorithm => panic!("the model has no {algorithm:?}"),
    }
}

/// The least `x` in `lo..=hi` for which `pred` holds, `pred` being monotone and true at `hi`.
fn least(mut lo: Tick, mut hi: Tick, pred: impl Fn(Tick) -> bool) -> Tick {
    assert!(pred(hi), "the model's search bound is too small");
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pred(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

/// How far the searches look: every band recovers fully within two windows.
fn horizon(band: BandSpec) -> Tick {
    3 * band.window
}

/// Ticks from `t` until the band is back to its full capacity without further traffic.
fn reset_after(band: BandSpec, state: Option<&State>, t: Tick) -> Tick {
    least(0, horizon(band), |d| usage(band, state, t + d).is_full())
}

/// When a rejecting band would admit `permits`: the least `d >= 1` such that it admits
/// at `t + d` without other traffic.
fn wait(band: BandSpec, state: Option<&State>, t: Tick, permits: u64) -> ModelWait {
    if usage(band, state, t).admits(band.capacity, permits) {
        ModelWait::None
    } else if permits > band.capacity {
        ModelWait::Never
    } else {
        ModelWait::After(least(1, horizon(band), |d| {
            usage(band, state, t + d).admits(band.capacity, permits)
        }))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ModelWait {
    None,
    After(Tick),
    Never,
}

/// One rule's share of a request: its bands (with their state's names), cost and mode.
#[derive(Debug, Clone)]
pub(crate) struct BucketSpec {
    /// One name per band, identifying its state.
    pub(crate) names: Vec<String>,
    pub(crate) bands: Vec<BandSpec>,
    pub(crate) permits: u64,
    pub(crate) shadow: bool,
}

/// One band's figures after a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Figures {
    /// Whether this band alone admits the request.
    pub(crate) allowed: bool,
    pub(crate) remaining: u64,
    pub(crate) reset_after: Tick,
    pub(crate) wait: ModelWait,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ModelDecision {
    pub(crate) allowed: bool,
    pub(crate) shadow_allowed: bool,
    /// Bucket by bucket, band by band.
    pub(crate) bands: Vec<Figures>,
}

/// The model: every band's state, by name.
#[derive(Debug, Default)]
pub(crate) struct Model {
    states: HashMap<String, State>,
    /// Redis only: a written leaky bucket is forgotten this long after the write.
    leaky_ttl: Option<fn(Tick) -> Tick>,
}

impl Model {
    /// The model of the in-memory limiter: nothing is ever forgotten (a bucket is only
    /// dropped when it is the same as no bucket, or by sweeps of large shards).
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// The model of the Redis backend, in microseconds. The one documented difference: a
    /// leaky bucket's key expires `floor(W / 1 ms) + 1001` ms after it was last written
    /// (`px()` in `lua/common.lua`), and the grid then starts over at the next admitted
    /// request (docs/algorithms.md, "Leaky bucket", Redis). The other algorithms' keys
    /// expire only once they count nothing, which changes no figure.
    pub(crate) fn redis() -> Self {
        Self {
            states: HashMap::new(),
            leaky_ttl: Some(|window_us| (window_us / 1000 + 1001) * 1000),
        }
    }

    /// The instants at which the leaky buckets named `names` will be forgotten (Redis).
    pub(crate) fn expiries<'a>(
        &'a self,
        names: impl IntoIterator<Item = &'a str> + 'a,
    ) -> impl Iterator<Item = Tick> + 'a {
        names.into_iter().filter_map(|n| match self.states.get(n) {
            Some(State::Queue {
                expires: Some(expires), ..
            }) => Some(*expires),
            _ => None,
        })
    }

    /// Decides a request at `t`: all or nothing for the enforced buckets; the shadow ones
    /// consume only when the enforced ones did and every shadow band admits too.
    pub(crate) fn decide(&mut self, buckets: &[BucketSpec], t: Tick) -> ModelDecision {
        let mut allowed = true;
        let mut shadow_allowed = true;
        for b in buckets {
            for (name, &band) in b.names.iter().zip(&b.bands) {
                if !usage(band, self.states.get(name), t).admits(band.capacity, b.permits) {
                    if b.shadow {
                        shadow_allowed = false;
                    } else {
                        allowed = false;
                    }
                }
            }
        }
        let mut bands = Vec::new();
        for b in buckets {
            let committed = if b.shadow { allowed && shadow_allowed } else { allowed };
            for (name, &band) in b.names.iter().zip(&b.bands) {
                let before = self.states.get(name);
                let wait = wait(band, before, t, b.permits);
                if committed {
                    let ttl = match band.algorithm {
                        Algorithm::LeakyBucket => self.leaky_ttl.map(|f| f(band.window)),
                        _ => None,
                    };
                    let next = commit(band, self.states.remove(name), t, b.permits, ttl);
                    self.states.insert(name.clone(), next);
                }
                let after = self.states.get(name);
                bands.push(Figures {
                    allowed: wait == ModelWait::None,
                    remaining: usage(band, after, t).remaining(band.capacity),
                    reset_after: reset_after(band, after, t),
                    wait,
                });
            }
        }
        ModelDecision {
            allowed,
            shadow_allowed,
            bands,
        }
    }

    /// The library's request in the model's terms: each band's state is named by the rule
    /// set, rule, key value, band name, algorithm, capacity and window.
    pub(crate) fn buckets(request: &AcquireRequest, unit: Unit) -> Vec<BucketSpec> {
        request.buckets().map(|b| bucket(&b, unit)).collect()
    }

    /// Decides a library request at `t` ticks and reports it as the library does.
    pub(crate) fn acquire(&mut self, request: &AcquireRequest, t: Tick, unit: Unit) -> AcquireOutcome {
        let decision = self.decide(&Self::buckets(request, unit), t);
        report(&decision, request, t, unit)
    }
}

/// A decision of the model on `request` at `t` ticks, reported as the library reports it.
pub(crate) fn report(decision: &ModelDecision, request: &AcquireRequest, t: Tick, unit: Unit) -> AcquireOutcome {
    let now_unix_nanos = t * unit.nanos_per_tick();
    let mut figures = decision.bands.iter();
    let mut bands = Vec::new();
    for (b, band) in request.bands() {
        {
            let f = figures.next().expect("one figure per band");
            let wait = match f.wait {
                ModelWait::None => Wait::None,
                ModelWait::After(d) => Wait::After(unit.duration(d)),
                ModelWait::Never => Wait::Never,
            };
            bands.push(b.report(band, now_unix_nanos, f.remaining, unit.duration(f.reset_after), wait));
        }
    }
    AcquireOutcome::new(decision.allowed, decision.shadow_allowed, now_unix_nanos, bands)
}

fn bucket(b: &Bucket<'_>, unit: Unit) -> BucketSpec {
    let rule = b.rule;
    let bands: Vec<BandSpec> = rule
        .bands()
        .iter()
        .map(|band| BandSpec {
            algorithm: rule.algorithm(),
            capacity: band.capacity(),
            window: unit.ticks(band.window()),
        })
        .collect();
    let names = rule
        .bands()
        .iter()
        .zip(&bands)
        .map(|(band, spec)| {
            format!(
                "{}\u{1}{}\u{1}{}\u{1}{}\u{1}{:?}",
                b.rule_set.id(),
                rule.id(),
                b.key.as_str(),
                band.name(),
                spec
            )
        })
        .collect();
    BucketSpec {
        names,
        bands,
        permits: rule.permits(),
        shadow: rule.mode() == Mode::Shadow,
    }
}

/// The model as a [`RateLimiter`] on a controlled clock (ticks = nanoseconds).
#[derive(Debug)]
pub(crate) struct ModelLimiter {
    clock: ManualClock,
    model: Mutex<Model>,
}

impl ModelLimiter {
    pub(crate) fn new(clock: ManualClock) -> Self {
        Self {
            clock,
            model: Mutex::new(Model::new()),
        }
    }
}

impl RateLimiter for ModelLimiter {
    fn acquire(&self, request: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        let now = self.clock.now_nanos();
        let mut model = self.model.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        MaybeReady::ready(Ok(model.acquire(request, now, Unit::Nanos)))
    }
}

/// The model as a backend on a controlled clock, so that the conformance suite's
/// hand-worked cases check the model itself.
pub(crate) struct ModelBackend {
    clock: ManualClock,
}

impl ModelBackend {
    pub(crate) fn new(clock: ManualClock) -> Self {
        Self { clock }
    }
}

impl Backend for ModelBackend {
    fn name(&self) -> &'static str {
        "model"
    }
    fn limiter(&self) -> Arc<dyn RateLimiter> {
        Arc::new(ModelLimiter::new(self.clock.clone()))
    }
    fn now_nanos(&self) -> u64 {
        self.clock.now_nanos()
    }
    fn wait_until(&self, t: u64) -> Waiting<'_> {
        advance_to(&self.clock, t)
    }
    fn refill_tolerance(&self) -> usize {
        // Exact on its clock, as the in-memory limiter.
        1
    }
}
