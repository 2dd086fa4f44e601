//! The in-memory limiter: sharded, exact, bounded.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use super::fixed_window::Window;
use super::sliding_window_counter::Counter;
use super::sliding_window_log::Log;
use super::token_bucket::Tat;
use super::{
    fixed_window, leaky_bucket, sliding_window_counter, sliding_window_log, token_bucket, AcquireOutcome,
    AcquireRequest, Bucket, Eval, RateLimiter, Wait,
};
use crate::clock::{Clock, SystemClock};
use smallvec::SmallVec;

use crate::decision::{BandReport, Bands};
use crate::error::{BoxError, RuleError};
use crate::future::MaybeReady;
use crate::key::TypedKey;
use crate::rule::{Algorithm, Band, Rule, RuleSet};

/// The in-memory limiter: the embedded default backend.
///
/// Buckets live in a fixed number of shards, each behind its own mutex on cache lines of
/// its own. A key value is hashed once, by SipHash-1-3 with a 128-bit output keyed at random
/// per limiter, which chooses its shard, and each band's identity (its rule set, rule, band
/// and figures) is folded into both halves to make the bucket's 128 bits: every band of a
/// key shares one shard, unrelated keys rarely contend, and a crafted header cannot aim at
/// another client's counter (without the key, no one can choose two key values whose
/// hashes meet). A request's bands are checked and consumed under the locks of all the
/// shards they live in (taken in index order), so a decision over many rules is one atomic
/// step.
///
/// Every algorithm of [`Algorithm`] is decided here, and one request may mix them. Token
/// and leaky buckets keep one instant per band (32 bytes with its identity), fixed windows
/// and sliding window counters a few counters (56 bytes), sliding window logs one entry
/// per admitted request on top of that.
///
/// Memory is bounded: a bucket that has refilled completely (a window that has ended, a
/// log whose entries have all left the window) is the same as no bucket and
/// is dropped when its shard is swept (each shard sweeps itself when it has doubled since
/// its last sweep, and [`MemoryLimiter::purge_idle`] sweeps all). Each shard holds at most
/// `max_keys / shards` (rounded up) buckets; when a shard is full of active buckets, the
/// ones closest to full are evicted first (they start over full, which errs towards
/// admitting).
///
/// ```
/// use fluxgate_core::MemoryLimiter;
/// let limiter = MemoryLimiter::builder().max_keys(100_000).build();
/// assert_eq!(limiter.len(), 0);
/// ```
#[derive(Clone)]
pub struct MemoryLimiter {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Box<[Padded]>,
    shard_mask: usize,
    max_per_shard: usize,
    clock: Arc<dyn Clock>,
    /// The key of the keyed hash of key values, random per limiter.
    hash_key: (u64, u64),
    /// The hashes of typed key values.
    typed: TypedHashes,
}

/// The hashes of key values known by their typed value ([`TypedKey`]), under a key of their
/// own, random per limiter: the text of such a key is never hashed, and no typed value
/// shares a hash with a text but by the chance of two random 128-bit values meeting.
struct TypedHashes {
    key: (u64, u64),
    global: KeyHash,
    no_ip: KeyHash,
}

/// The first byte of the message hashed for each typed value, so that none meets another.
const TYPED_GLOBAL: u8 = 1;
const TYPED_NO_IP: u8 = 2;
const TYPED_IPV6: u8 = 3;

impl TypedHashes {
    fn new(key: (u64, u64)) -> Self {
        let hash = |message: &[u8]| {
            let (low, high) = siphash128::<1, 3>(key, message);
            KeyHash { low, high }
        };
        Self {
            global: hash(&[TYPED_GLOBAL]),
            no_ip: hash(&[TYPED_NO_IP]),
            key,
        }
    }

    fn of(&self, typed: TypedKey) -> Option<KeyHash> {
        Some(match typed {
            TypedKey::Text => return None,
            TypedKey::Global => self.global,
            TypedKey::NoIp => self.no_ip,
            TypedKey::Ipv4(address) => self.ipv4(address),
            TypedKey::Ipv6 { bits, prefix } => {
                let mut message = [0u8; 18];
                message[0] = TYPED_IPV6;
                message[1] = prefix;
                message[2..].copy_from_slice(&bits.to_be_bytes());
                let (low, high) = siphash128::<1, 3>(self.key, &message);
                KeyHash { low, high }
            }
        })
    }

    /// An IPv4 address's hash: its low 32 bits a keyed bijection of the address, so that
    /// two addresses never share a bucket (a band's identity keeps the low 57 bits of the
    /// low half, see [`KeyHash::band`]), and the other 96 spread by the keyed multiply-fold.
    #[inline]
    fn ipv4(&self, address: u32) -> KeyHash {
        let (k0, k1) = self.key;
        // Each step is invertible on 32 bits: an xor, a multiplication by an odd number,
        // xor-shifts.
        let mut x = address ^ (k0 as u32);
        x = x.wrapping_mul((k1 as u32) | 1);
        x ^= x >> 16;
        x = x.wrapping_mul(0x7feb_352d);
        x ^= x >> 15;
        let a = u64::from(address);
        KeyHash {
            low: u64::from(x) | (fold(a ^ k1, MIX_P0) << 32),
            high: fold(a ^ k0, MIX_P1) ^ TYPED_V4_HIGH,
        }
    }
}

/// Mixed into the high half of every IPv4 address's hash.
const TYPED_V4_HIGH: u64 = 0x5bd1_e995_0000_0004;

type Map<V> = HashMap<u128, V, BuildHasherDefault<PreHashed>>;

/// A shard's mutex on cache lines of its own: without the padding, neighbouring shards
/// share a line, and threads deciding for unrelated keys would contend for it.
#[repr(align(128))]
struct Padded(Mutex<Shard>);

struct Shard {
    /// Token and leaky buckets: one instant each.
    gcra: Map<Kept>,
    /// Fixed windows, sliding window counters and logs.
    windows: Map<Slot>,
    next_sweep: usize,
    /// The latest instant a decision in this shard was made at: no later decision in it is
    /// made at an earlier one, whatever the clock reads (see [`not_before`]).
    latest: u64,
}

/// A window-based band's state and the instant after which it counts nothing.
struct Slot {
    idle_after: u64,
    state: State,
}

/// The top byte of a kept instant's remainder holds its band's interval class.
const CLASS_SHIFT: u32 = 56;
const FRAC_MASK: u64 = (1 << CLASS_SHIFT) - 1;

/// A token or leaky bucket's instant as the table keeps it: its remainder is below the
/// band's capacity (at most 2^40), so the remainder's top byte holds the band's interval
/// class ([`Band::interval_class`]), which eviction reads, at no cost in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Kept(Tat);

impl Kept {
    fn new(tat: Tat, band: &Band) -> Self {
        Self(Tat {
            nanos: tat.nanos,
            frac: (tat.frac & FRAC_MASK) | (u64::from(band.interval_class()) << CLASS_SHIFT),
        })
    }

    fn tat(self) -> Tat {
        Tat {
            nanos: self.0.nanos,
            frac: self.0.frac & FRAC_MASK,
        }
    }

    fn class(self) -> u8 {
        (self.0.frac >> CLASS_SHIFT) as u8
    }

    /// The same instant, ranked by `band`'s class: see [`Shard::restamp`].
    fn restamp(&mut self, band: &Band) {
        if self.class() != band.interval_class() {
            *self = Self::new(self.tat(), band);
        }
    }
}

/// The permits a token or leaky bucket still counts at `now`: the time until it is full,
/// in intervals of its class (within a factor of two).
fn permits_ahead(until: u64, now: u64, class: u8) -> u64 {
    until.saturating_sub(now) >> class
}

/// A window-based band's state, with its rule's [weight](Band::weight_shift) (held beside
/// the variant's tag, at no cost in memory), by which eviction ranks it in requests.
enum State {
    Fixed(Window, u8),
    Counter(Counter, u8),
    Log(Box<Log>, u8),
}

/// A stored state that becomes the same as no state once time has passed.
trait Stored {
    /// What evicting the state at `now` gives back: the requests it still counts (its
    /// permits in units of its rule's cost, within a factor of two). Ranked by time alone,
    /// an exhausted bucket of a minute (a minute from full) would go before a daily one
    /// that counted one request (86 s from full); by the share of its window, a daily quota
    /// counting a thousand requests before a flood of minute buckets counting one each; by
    /// permits, an exhausted login bucket of 5 before a flood of keys of a rule that costs
    /// 10 per request, each counting one. Each key an attacker makes costs it as many
    /// requests as make it outrank another.
    fn permits_ahead(&self, now: u64) -> u64;
    /// Whether the state can be forgotten at `now`.
    fn idle_at(&self, now: u64) -> bool;
}

impl Stored for Kept {
    fn permits_ahead(&self, now: u64) -> u64 {
        if self.idle_at(now) {
            return 0;
        }
        permits_ahead(self.0.nanos, now, self.class())
    }
    fn idle_at(&self, now: u64) -> bool {
        self.tat().is_full_at(now)
    }
}

impl Stored for Slot {
    fn permits_ahead(&self, now: u64) -> u64 {
        if self.idle_at(now) {
            return 0;
        }
        // What the state holds, expired permits included: an upper bound.
        match &self.state {
            State::Fixed(w, weight) => w.count.saturating_add(w.next) >> weight,
            State::Counter(c, weight) => c.previous.saturating_add(c.current).saturating_add(c.next) >> weight,
            State::Log(log, weight) => log.held() >> weight,
        }
    }
    fn idle_at(&self, now: u64) -> bool {
        self.idle_after <= now
    }
}

/// `now`, or a shard's `latest` decision instant if that is later, which becomes the latest:
/// the instant of the decision about to be made. The clock may go back between two readings
/// on two cores (quanta reads each core's time-stamp counter, and on some machines they
/// disagree): a fixed window would then count anew from a window that has ended, and a
/// bucket's state read at an instant before the one it was written at is not what the
/// algorithms are defined on.
fn not_before(latest: &mut u64, now: u64) -> u64 {
    let now = now.max(*latest);
    *latest = now;
    now
}

impl Shard {
    /// Ranks the state at `key` by `band`'s cost per request (a token or leaky bucket's
    /// interval class, a window state's weight), its counts left as they are. Called where
    /// the band refuses a request, which writes nothing: a state kept across a reload that
    /// changed its rule's cost is otherwise ranked by the old cost until its next
    /// admission, and an exhausted one, which refuses every request, never.
    fn restamp(&mut self, key: u128, band: &Band) {
        if let Some(kept) = self.gcra.get_mut(&key) {
            kept.restamp(band);
        } else if let Some(slot) = self.windows.get_mut(&key) {
            let (State::Fixed(_, weight) | State::Counter(_, weight) | State::Log(_, weight)) = &mut slot.state;
            *weight = band.weight_shift();
        }
    }

    fn len(&self) -> usize {
        self.gcra.len() + self.windows.len()
    }

    fn sweep(&mut self, now: u64) {
        self.gcra.retain(|_, t| !t.idle_at(now));
        self.windows.retain(|_, s| !s.idle_at(now));
    }

    /// Before an insertion: sweeps when the shard has doubled or is full, and, when it was
    /// full, evicts if the sweep leaves it above seven eighths of its limit.
    ///
    /// A full shard's next sweep is then an eighth of the limit away at least, so that
    /// sweeping costs amortized constant time per insertion: were a full shard left just
    /// below its limit (keys expiring as fast as new ones come), each sweep would free a
    /// few buckets, and the next insertions would each sweep the whole shard again. A shard
    /// below its limit evicts nothing: no bucket is dropped before `max_keys` is reached.
    fn make_room(&mut self, now: u64, max: usize) {
        if self.len() < self.next_sweep {
            return;
        }
        let full = self.len() >= max;
        self.sweep(now);
        let target = (max - max / 8).min(max.saturating_sub(1));
        if full && self.len() > target {
            let excess = self.len() - target;
            self.evict_fewest_permits(excess, now);
        }
        self.next_sweep = (self.len() * 2).clamp(MIN_SWEEP.min(max), max);
    }

    /// Drops the `count` states that give back the fewest permits at `now`
    /// ([`Stored::permits_ahead`]), ranked together whatever their table: a flood of window
    /// states does not evict an exhausted token bucket in their place, nor the reverse.
    /// Every state below the cut goes, then as many at the cut as make up the count.
    fn evict_fewest_permits(&mut self, count: usize, now: u64) {
        let total = self.len();
        if count == 0 || total == 0 {
            return;
        }
        let drop_count = count.min(total);
        let mut ranks: Vec<u64> = self
            .gcra
            .values()
            .map(|v| v.permits_ahead(now))
            .chain(self.windows.values().map(|v| v.permits_ahead(now)))
            .collect();
        let (below, cut, _) = ranks.select_nth_unstable(drop_count - 1);
        let cut = *cut;
        let mut ties = drop_count - below.iter().filter(|&&rank| rank < cut).count();
        let mut keep = |rank: u64| {
            if rank < cut {
                false
            } else if rank == cut && ties > 0 {
                ties -= 1;
                false
            } else {
                true
            }
        };
        self.gcra.retain(|_, v| keep(v.permits_ahead(now)));
        self.windows.retain(|_, v| keep(v.permits_ahead(now)));
        // Idle states were swept first: every state evicted still counted requests, and
        // its clients start over with a full bucket. Once per process a warning, since a
        // `max_keys` too small for the clients loosens every limit without another sign.
        static WARNED: AtomicBool = AtomicBool::new(false);
        if WARNED.swap(true, Ordering::Relaxed) {
            tracing::debug!(
                dropped = total - self.len(),
                "in-memory limiter at max_keys: evicted the buckets closest to full"
            );
        } else {
            tracing::warn!(
                dropped = total - self.len(),
                "in-memory limiter at max_keys: evicted buckets that still counted requests, whose clients \
                 start over with full buckets (looser limits); raise `max_keys` if this is not a flood of \
                 made-up keys; logged once, later evictions at debug level"
            );
        }
    }
}

/// What committing a band's evaluation stores.
#[derive(Debug, Clone, Copy)]
enum Next {
    Tat(Tat),
    Fixed(Window),
    Counter(Counter),
    /// A new log entry.
    Log,
    /// A new log entry at a later instant, for a request that waits until then.
    LogAt(u64),
}

const MIX_P0: u64 = 0xa076_1d64_78bd_642f;
const MIX_P1: u64 = 0xe703_7ed1_a0b4_28db;

/// The multiply-fold step of [`mix`].
fn fold(a: u64, b: u64) -> u64 {
    let m = u128::from(a) * u128::from(b);
    (m as u64) ^ ((m >> 64) as u64)
}

/// One SipHash round.
fn sip_round(v: &mut [u64; 4]) {
    v[0] = v[0].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(13) ^ v[0];
    v[0] = v[0].rotate_left(32);
    v[2] = v[2].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(16) ^ v[2];
    v[0] = v[0].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(21) ^ v[0];
    v[2] = v[2].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(17) ^ v[2];
    v[2] = v[2].rotate_left(32);
}

/// SipHash-`C`-`D` of `bytes` under the key `(k0, k1)`, its 128-bit output as two words
/// (the first eight bytes of the tag, then the last eight): a keyed pseudorandom function,
/// so that without the key no one can choose two inputs whose outputs meet.
fn siphash128<const C: usize, const D: usize>((k0, k1): (u64, u64), bytes: &[u8]) -> (u64, u64) {
    let mut v = [
        k0 ^ 0x736f_6d65_7073_6575,
        k1 ^ 0x646f_7261_6e64_6f6d ^ 0xee,
        k0 ^ 0x6c79_6765_6e65_7261,
        k1 ^ 0x7465_6462_7974_6573,
    ];
    let mut compress = |m: u64| {
        v[3] ^= m;
        for _ in 0..C {
            sip_round(&mut v);
        }
        v[0] ^= m;
    };
    let mut words = bytes.chunks_exact(8);
    for word in &mut words {
        let mut m = [0u8; 8];
        m.copy_from_slice(word);
        compress(u64::from_le_bytes(m));
    }
    let mut last = [0u8; 8];
    last[..words.remainder().len()].copy_from_slice(words.remainder());
    last[7] = bytes.len() as u8; // the length modulo 256, as SipHash defines it
    compress(u64::from_le_bytes(last));
    let finish = |v: &mut [u64; 4]| {
        for _ in 0..D {
            sip_round(v);
        }
        v[0] ^ v[1] ^ v[2] ^ v[3]
    };
    v[2] ^= 0xee;
    let first = finish(&mut v);
    v[1] ^= 0xdd;
    let second = finish(&mut v);
    (first, second)
}

/// The hash of one key value (see [`MemoryLimiter::key_hash`]): SipHash-1-3 with a 128-bit
/// output, keyed at random per limiter, or the hash of a typed value ([`TypedHashes`]).
#[derive(Clone, Copy)]
struct KeyHash {
    low: u64,
    high: u64,
}

impl KeyHash {
    /// A band's bucket identity, 128 bits: the key's keyed hash with the band's identity
    /// folded into its high half and into the top 7 bits of its low half. The hash is
    /// keyed at random per limiter, so a client cannot choose a key value whose hash meets
    /// another's; two buckets share state only if all 128 bits meet (two bands of one key
    /// differ in 71 bits folded from their identities).
    ///
    /// The low half is where the shard's table looks first (its low bits; the top 7 are
    /// the tag it compares): every band of a key starts at the same place, so a rule's
    /// bands sit next to each other, in one or two cache lines, instead of each at a random
    /// place that leaves the caches between two visits of the key.
    fn band(&self, band: &Band) -> u128 {
        const TAG: u64 = !0 >> 7;
        let ident = band.ident();
        let low = (self.low & TAG) | (fold(self.low ^ ident, MIX_P0) & !TAG);
        let high = fold(self.high ^ ident, MIX_P1) ^ self.high;
        (u128::from(high) << 64) | u128::from(low)
    }
}

/// The map keys are already uniformly distributed hashes.
#[derive(Default)]
struct PreHashed(u64);

impl Hasher for PreHashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u128(&mut self, n: u128) {
        self.0 = n as u64;
    }
}

const MIN_SWEEP: usize = 1024;

/// The fewest buckets per shard that the default shard count leaves
/// ([`MemoryLimiterBuilder::shards`]).
const MIN_DEFAULT_PER_SHARD: usize = 256;

/// Builds a [`MemoryLimiter`].
#[derive(Debug, Clone)]
pub struct MemoryLimiterBuilder {
    max_keys: usize,
    shards: usize,
    /// Whether `shards` was set, rather than the default.
    shards_set: bool,
    clock: Option<Arc<dyn Clock>>,
}

impl Default for MemoryLimiterBuilder {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(4, std::num::NonZeroUsize::get);
        Self {
            max_keys: 1_000_000,
            shards: (cores * 16).next_power_of_two().clamp(16, 1024),
            shards_set: false,
            clock: None,
        }
    }
}

impl MemoryLimiterBuilder {
    /// The most buckets kept (one per band per key). Default 1,000,000.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys.max(1);
        self
    }

    /// The number of shards, rounded up to a power of two. Default: 16 per core (16 to
    /// 1024), but no more than leaves each shard 256 buckets of `max_keys` (at least one
    /// shard).
    ///
    /// Each shard keeps `max_keys / shards` buckets: a shard that holds a single one
    /// evicts it for any other key that lands there, which then starts over full.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.clamp(1, 1 << 16).next_power_of_two();
        self.shards_set = true;
        self
    }

    /// The clock. Default [`SystemClock`]; tests use [`crate::TokioClock`] or
    /// [`crate::ManualClock`].
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Builds the limiter.
    pub fn build(mut self) -> MemoryLimiter {
        if !self.shards_set {
            // A small `max_keys` over the default shards (1,024 on a 64-core machine) would
            // leave a bucket or two per shard, evicted by every other key of the shard.
            let most = (self.max_keys / MIN_DEFAULT_PER_SHARD).max(1);
            let most = 1 << most.ilog2();
            self.shards = self.shards.min(most);
        }
        let max_per_shard = self.max_keys.div_ceil(self.shards).max(1);
        let shards = (0..self.shards)
            .map(|_| {
                Padded(Mutex::new(Shard {
                    gcra: HashMap::default(),
                    windows: HashMap::default(),
                    next_sweep: MIN_SWEEP.min(max_per_shard),
                    latest: 0,
                }))
            })
            .collect();
        MemoryLimiter {
            inner: Arc::new(Inner {
                shards,
                shard_mask: self.shards - 1,
                max_per_shard,
                clock: self.clock.unwrap_or_else(|| Arc::new(SystemClock::new())),
                // Two random words, from std's randomly keyed SipHash.
                hash_key: (RandomState::new().hash_one(0xf1u8), RandomState::new().hash_one(0xf2u8)),
                typed: TypedHashes::new((RandomState::new().hash_one(0xf3u8), RandomState::new().hash_one(0xf4u8))),
            }),
        }
    }
}

impl Default for MemoryLimiter {
    fn default() -> Self {
        Self::builder().build()
    }
}

impl fmt::Debug for MemoryLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLimiter")
            .field("shards", &self.inner.shards.len())
            .field("max_keys", &(self.inner.max_per_shard * self.inner.shards.len()))
            .field("clock", &self.inner.clock)
            .finish_non_exhaustive()
    }
}

struct Item<'a> {
    key: u128,
    /// The index of its shard's guard.
    guard: usize,
    bucket: Bucket<'a>,
    band: &'a Band,
}

/// The locks of a request's shards, in index order.
type Guards<'a> = SmallVec<[MutexGuard<'a, Shard>; 4]>;

/// A band whose instant [`MemoryLimiter::acquire_instants`] wrote before the request was
/// decided: what puts it back, and its figures should it not be committed.
struct Written {
    guard: usize,
    key: u128,
    old: Option<Kept>,
    shadow: bool,
    report: usize,
    remaining_now: u64,
    reset_now: u64,
}

/// What a band's evaluation leaves for the commit: the state to store, and the band's
/// figures should the request not be committed.
struct Pending {
    guard: usize,
    allowed: bool,
    next: Next,
    remaining_now: u64,
    reset_now: u64,
}

fn window_nanos(band: &Band) -> u64 {
    u64::try_from(band.window().as_nanos()).unwrap_or(u64::MAX)
}

fn lock(m: &Padded) -> MutexGuard<'_, Shard> {
    m.0.lock().unwrap_or_else(PoisonError::into_inner)
}

impl MemoryLimiter {
    /// A builder with the defaults.
    pub fn builder() -> MemoryLimiterBuilder {
        MemoryLimiterBuilder::default()
    }

    /// The number of buckets held.
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).len()).sum()
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every bucket that has refilled completely; returns how many were dropped.
    pub fn purge_idle(&self) -> usize {
        let now = self.inner.clock.now_nanos();
        self.inner
            .shards
            .iter()
            .map(|s| {
                let mut shard = lock(s);
                let before = shard.len();
                // At the shard's instant, which the sweep then holds to: a bucket idle at a
                // reading ahead (another core's counter) is not idle at an earlier instant
                // the shard's next decision would otherwise be made at.
                let now = not_before(&mut shard.latest, now);
                shard.sweep(now);
                before - shard.len()
            })
            .sum()
    }

    /// Forgets every bucket.
    pub fn clear(&self) {
        for s in self.inner.shards.iter() {
            let mut shard = lock(s);
            shard.gcra.clear();
            shard.windows.clear();
        }
    }

    /// The hash of a bucket's key value, from which each of its bands' identities comes
    /// ([`KeyHash::band`]): the key's bytes are hashed once however many bands the rule
    /// has.
    #[inline]
    fn key_hash(&self, b: &Bucket<'_>) -> KeyHash {
        if let Some(hash) = self.inner.typed.of(b.typed) {
            return hash;
        }
        let (low, high) = siphash128::<1, 3>(self.inner.hash_key, b.key.as_bytes());
        KeyHash { low, high }
    }

    /// The shard of a bucket: every band of one key lives in the same shard, so that a
    /// rule of several bands takes one lock.
    fn shard_of(&self, key: &KeyHash) -> usize {
        (key.high >> 40) as usize & self.inner.shard_mask
    }

    /// Applies a request synchronously (what [`RateLimiter::acquire`] does).
    pub fn acquire_now(&self, request: &AcquireRequest) -> AcquireOutcome {
        if request.len() == 1 {
            if let Some(only) = request.bucket(0) {
                if let [band] = &**only.rule.bands() {
                    return self.acquire_one(&only, band);
                }
            }
        }
        if request.buckets().all(|b| b.rule.algorithm().keeps_an_instant()) {
            if let Some(outcome) = self.acquire_instants(request) {
                return outcome;
            }
        }
        self.acquire_items(request)
    }

    /// Each bucket's key hash, and the shards of the keys locked in index order (no
    /// deadlock between requests), each once: per bucket its hash and the index of its
    /// shard's guard.
    #[inline]
    fn lock_keys(&self, request: &AcquireRequest) -> (SmallVec<[(KeyHash, usize); 4]>, Guards<'_>) {
        let mut keys: SmallVec<[(KeyHash, usize); 4]> = SmallVec::new();
        let mut shards: SmallVec<[usize; 4]> = SmallVec::new();
        for b in request.buckets() {
            let hash = self.key_hash(&b);
            let shard = self.shard_of(&hash);
            if !shards.contains(&shard) {
                shards.push(shard);
            }
            keys.push((hash, shard));
        }
        shards.sort_unstable();
        for (_, shard) in &mut keys {
            *shard = shards.iter().position(|s| s == shard).unwrap_or(0);
        }
        let guards = shards.iter().map(|&s| lock(&self.inner.shards[s])).collect();
        (keys, guards)
    }

    /// The instant of a decision in the locked `shards`: the clock, or the latest instant a
    /// decision in one of them was made at if that is later (see [`not_before`]).
    fn now_in(&self, shards: &mut Guards<'_>) -> u64 {
        let now = shards
            .iter()
            .fold(self.inner.clock.now_nanos(), |now, shard| now.max(shard.latest));
        for shard in shards.iter_mut() {
            shard.latest = now;
        }
        now
    }

    /// A request whose buckets are all token or leaky buckets, in one pass: each band's
    /// instant is looked up once, and written at once where the band admits (no one sees it
    /// before the request is decided: the shards stay locked); the instants written are put
    /// back when the request is not committed. `None` when the request is refused and may
    /// wait: nothing has changed, and [`Self::acquire_items`] takes its places.
    fn acquire_instants(&self, request: &AcquireRequest) -> Option<AcquireOutcome> {
        let (keys, mut guards) = self.lock_keys(request);
        // Read under the locks: a request decided after another is decided at an instant
        // no earlier than it (a window that has begun is not counted in the one before).
        let now = self.now_in(&mut guards);
        let max = self.inner.max_per_shard;
        let mut bands = Bands::with_capacity(request.band_count());
        let mut written: SmallVec<[Written; 8]> = SmallVec::new();
        let (mut allowed, mut shadow_allowed) = (true, true);
        for (b, (hash, guard)) in request.buckets().zip(&keys) {
            let (guard, shard) = (*guard, &mut *guards[*guard]);
            let shadow = b.shadow();
            for band in b.rule.bands().iter() {
                let key = hash.band(band);
                let stored = shard.gcra.get_mut(&key);
                let old = stored.as_deref().copied();
                let e = evaluate_instant(old.map(Kept::tat), &b, band, now);
                if shadow {
                    shadow_allowed &= e.allowed;
                } else {
                    allowed &= e.allowed;
                }
                bands.push(report(&b, band, now, &e, true));
                if !e.allowed {
                    if let Some(t) = stored {
                        t.restamp(band);
                    }
                } else {
                    let next = Kept::new(e.next, band);
                    match stored {
                        Some(t) => *t = next,
                        None => {
                            shard.make_room(now, max);
                            shard.gcra.insert(key, next);
                        }
                    }
                    written.push(Written {
                        guard,
                        key,
                        old,
                        shadow,
                        report: bands.len() - 1,
                        remaining_now: e.remaining_now,
                        reset_now: e.reset_now,
                    });
                }
            }
        }
        if !allowed || !shadow_allowed {
            // Put back what is not committed, the last written first.
            for w in written.iter().rev().filter(|w| !allowed || w.shadow) {
                let shard = &mut *guards[w.guard];
                match w.old {
                    Some(t) => {
                        shard.gcra.insert(w.key, t);
                    }
                    None => {
                        shard.gcra.remove(&w.key);
                    }
                }
                // Admitted by its band, not committed: the band as it stays.
                bands[w.report].refigure(now, w.remaining_now, Duration::from_nanos(w.reset_now));
            }
            if !allowed && request.may_wait() {
                return None;
            }
        }
        drop(guards);
        Some(AcquireOutcome::new(allowed, shadow_allowed, now, bands))
    }

    /// The general path: any mix of algorithms, every band evaluated, then committed or
    /// left as it was; a refused request that may wait takes its places here.
    fn acquire_items(&self, request: &AcquireRequest) -> AcquireOutcome {
        // Per band: its bucket's identity and its shard's guard, every band of a key in one.
        let (keys, mut guards) = self.lock_keys(request);
        // Read under the locks, as in `acquire_instants`.
        let now = self.now_in(&mut guards);
        let mut items: SmallVec<[Item<'_>; 8]> = SmallVec::new();
        for (b, (hash, guard)) in request.buckets().zip(&keys) {
            for band in b.rule.bands().iter() {
                items.push(Item {
                    key: hash.band(band),
                    guard: *guard,
                    bucket: b,
                    band,
                });
            }
        }

        // Every band evaluated at one instant; its report is written as if the request were
        // committed, and corrected below for the bands that do not commit.
        let mut bands = Bands::with_capacity(items.len());
        let mut pending: SmallVec<[Pending; 8]> = SmallVec::new();
        let (mut allowed, mut shadow_allowed) = (true, true);
        for i in &items {
            let guard = i.guard;
            let e = evaluate(&guards[guard], i.key, &i.bucket, i.band, now);
            if i.bucket.shadow() {
                shadow_allowed &= e.allowed;
            } else {
                allowed &= e.allowed;
            }
            bands.push(report(&i.bucket, i.band, now, &e, true));
            pending.push(Pending {
                guard,
                allowed: e.allowed,
                next: e.next,
                remaining_now: e.remaining_now,
                reset_now: e.reset_now,
            });
        }
        if !allowed {
            if let Some(outcome) = self.reserve_all(&items, &pending, &mut guards, now) {
                return outcome;
            }
        }
        for ((i, p), report) in items.iter().zip(&pending).zip(bands.iter_mut()) {
            if p.allowed && allowed && (!i.bucket.shadow() || shadow_allowed) {
                let shard = &mut *guards[p.guard];
                self.store(shard, i.key, p.next, now, i.band, i.bucket.permits);
            } else if p.allowed {
                // Admitted by its band, not committed: the band as it stays.
                report.refigure(now, p.remaining_now, Duration::from_nanos(p.reset_now));
            } else {
                guards[p.guard].restamp(i.key, i.band);
            }
        }
        drop(guards);
        AcquireOutcome::new(allowed, shadow_allowed, now, bands)
    }

    /// One bucket with one band: one lock, no intermediate allocation.
    pub(crate) fn acquire_one(&self, bucket: &Bucket<'_>, band: &Band) -> AcquireOutcome {
        self.acquire_single(bucket, band)
    }

    /// [`acquire_one`](Self::acquire_one) for a request its band admits and commits: the
    /// band's figures alone, no outcome, report or report vector; any other outcome as
    /// `acquire_one` gives it.
    pub(crate) fn acquire_one_admitted(&self, bucket: &Bucket<'_>, band: &Band) -> Result<Admitted, AcquireOutcome> {
        self.acquire_single(bucket, band)
    }

    fn acquire_single<O: SingleOutcome>(&self, bucket: &Bucket<'_>, band: &Band) -> O {
        let hash = self.key_hash(bucket);
        let key = hash.band(band);
        let mut shard = lock(&self.inner.shards[self.shard_of(&hash)]);
        if bucket.rule.algorithm().keeps_an_instant() {
            // One lookup of the instant, read and written in place. The clock is read and
            // the report's vector taken after the lookup, which they do not depend on: the
            // processor does both while the bucket's slot, rarely in its caches, loads.
            let Shard { gcra, latest, .. } = &mut *shard;
            let stored = gcra.get_mut(&key);
            let now = not_before(latest, self.inner.clock.now_nanos());
            let spare = O::spare();
            let e = evaluate_instant(stored.as_deref().copied().map(Kept::tat), bucket, band, now);
            if e.allowed {
                let next = Kept::new(e.next, band);
                match stored {
                    Some(slot) => *slot = next,
                    None => {
                        shard.make_room(now, self.inner.max_per_shard);
                        shard.gcra.insert(key, next);
                    }
                }
            }
            if !e.allowed {
                shard.restamp(key, band);
                if let Some(outcome) = self.reserve_one(&mut shard, key, bucket, band, now, &e) {
                    return O::reserved(outcome);
                }
            }
            drop(shard);
            return O::evaluated(spare, bucket, band, now, &e);
        }
        let now = not_before(&mut shard.latest, self.inner.clock.now_nanos());
        let e = evaluate(&shard, key, bucket, band, now);
        if e.allowed {
            self.store(&mut shard, key, e.next, now, band, bucket.permits);
        } else {
            shard.restamp(key, band);
            if let Some(outcome) = self.reserve_one(&mut shard, key, bucket, band, now, &e) {
                return O::reserved(outcome);
            }
        }
        drop(shard);
        O::evaluated(O::spare(), bucket, band, now, &e)
    }

    /// A one-band request the band refuses, if it may wait for it: the band's place at
    /// the instant it admits the request, taken now.
    fn reserve_one<S>(
        &self,
        shard: &mut Shard,
        key: u128,
        bucket: &Bucket<'_>,
        band: &Band,
        now: u64,
        e: &Eval<S>,
    ) -> Option<AcquireOutcome> {
        let wait = allowed_wait(bucket, e.wait)?;
        let at = now.checked_add(u64::try_from(wait.as_nanos()).ok()?)?;
        let next = reserve(shard, key, bucket, band, now, at)?;
        self.store(shard, key, next, now, band, bucket.permits);
        let mut bands = Bands::with_capacity(1);
        bands.push(figures_now(shard, key, bucket, band, now));
        Some(
            AcquireOutcome::new(true, true, now, bands)
                .admitted_later(wait)
                .with_marks(vec![mark(next)]),
        )
    }

    /// A request some enforced band refuses, if it may wait for every one of them: the
    /// place of every band at the instant the last of them admits it, taken now, all or
    /// nothing (the shadow bands as if enforced, and only if they all admit then).
    fn reserve_all(
        &self,
        items: &[Item<'_>],
        pending: &[Pending],
        guards: &mut [MutexGuard<'_, Shard>],
        now: u64,
    ) -> Option<AcquireOutcome> {
        // The longest wait of the refusing enforced bands, and the shortest their rules
        // allow: each must let the request wait until the last of them admits it.
        let (mut wait, mut most) = (Duration::ZERO, Duration::MAX);
        for (i, p) in items.iter().zip(pending) {
            if !p.allowed && !i.bucket.shadow() {
                // Evaluated again on this rare path, rather than carried by every band.
                let e = evaluate(&guards[i.guard], i.key, &i.bucket, i.band, now);
                wait = wait.max(allowed_wait(&i.bucket, e.wait)?);
                most = most.min(i.bucket.max_wait());
            }
        }
        if wait > most {
            return None;
        }
        let at = now.checked_add(u64::try_from(wait.as_nanos()).ok()?)?;
        let mut nexts: SmallVec<[Option<Next>; 8]> = SmallVec::new();
        let mut shadow_allowed = true;
        for i in items {
            let next = reserve(&guards[i.guard], i.key, &i.bucket, i.band, now, at);
            if next.is_none() {
                if !i.bucket.shadow() {
                    return None;
                }
                shadow_allowed = false;
            }
            nexts.push(next);
        }
        // The enforced bands, and the shadow ones if they all admit the request then.
        let kept = |i: &Item<'_>| !i.bucket.shadow() || shadow_allowed;
        for (i, next) in items.iter().zip(&nexts) {
            if let Some(next) = next.filter(|_| kept(i)) {
                self.store(&mut guards[i.guard], i.key, next, now, i.band, i.bucket.permits);
            }
        }
        // The bands that took their place report their figures with it, and their marks;
        // the shadow bands that did not (a shadow rule refused the request then) report
        // what they said now, and no mark.
        let bands: Bands = items
            .iter()
            .zip(&nexts)
            .map(|(i, next)| {
                if next.is_some() && kept(i) {
                    figures_now(&guards[i.guard], i.key, &i.bucket, i.band, now)
                } else {
                    let e = evaluate(&guards[i.guard], i.key, &i.bucket, i.band, now);
                    report(&i.bucket, i.band, now, &e, false)
                }
            })
            .collect();
        let marks = items
            .iter()
            .zip(&nexts)
            .map(|(i, next)| next.filter(|_| kept(i)).map_or(0, mark))
            .collect();
        Some(
            AcquireOutcome::new(true, shadow_allowed, now, bands)
                .admitted_later(wait)
                .with_marks(marks),
        )
    }

    /// Counts in this limiter what another limiter admitted for `bucket`: each band
    /// consumes the bucket's permits if it has them, else what it has left, so that it is
    /// empty (never in debt). The in-memory fallback of a Redis limiter is charged so with
    /// every admission Redis makes for a `fallback_local` rule, so that when Redis fails
    /// it starts from what this process was admitted, not from a full bucket.
    pub(crate) fn charge_bucket(&self, bucket: &Bucket<'_>) {
        let hash = self.key_hash(bucket);
        let mut shard = lock(&self.inner.shards[self.shard_of(&hash)]);
        let now = not_before(&mut shard.latest, self.inner.clock.now_nanos());
        for band in bucket.rule.bands().iter() {
            let key = hash.band(band);
            let mut charged = *bucket;
            let mut e = evaluate(&shard, key, &charged, band, now);
            if !e.allowed && e.remaining_now > 0 {
                charged.permits = e.remaining_now;
                e = evaluate(&shard, key, &charged, band, now);
            }
            if e.allowed {
                self.store(&mut shard, key, e.next, now, band, charged.permits);
            }
        }
    }

    /// Gives back what `request` took at `at` (see [`RateLimiter::give_back`]); with
    /// `marks`, a token or leaky bucket only while its state is the one its mark records
    /// (see [`RateLimiter::give_back_place`]).
    pub fn give_back_now(&self, request: &AcquireRequest, at: u64, marks: Option<&[u128]>) {
        let mut position = 0;
        for b in request.buckets() {
            let hash = self.key_hash(&b);
            let mut shard = lock(&self.inner.shards[self.shard_of(&hash)]);
            for band in b.rule.bands().iter() {
                let key = hash.band(band);
                let expected = marks.map(|marks| marks.get(position).copied().unwrap_or(0));
                position += 1;
                let (capacity, window, permits) = (band.capacity(), window_nanos(band), b.permits);
                if let Some(t) = shard.gcra.get_mut(&key) {
                    // A place taken after this one was counted behind it: this one stays.
                    if expected.is_none_or(|expected| expected == mark(Next::Tat(t.tat()))) {
                        *t = Kept::new(token_bucket::give_back(t.tat(), capacity, window, permits), band);
                    }
                } else if let Some(slot) = shard.windows.get_mut(&key) {
                    match &mut slot.state {
                        State::Fixed(w, _) => *w = fixed_window::give_back(*w, at, window, permits),
                        State::Counter(c, _) => *c = sliding_window_counter::give_back(*c, at, window, permits),
                        State::Log(log, _) => log.give_back(at, permits),
                    }
                }
            }
        }
    }

    /// Commits a band's evaluation.
    fn store(&self, shard: &mut Shard, key: u128, next: Next, now: u64, band: &Band, permits: u64) {
        let max = self.inner.max_per_shard;
        let window = window_nanos(band);
        if let Next::Tat(tat) = next {
            let tat = Kept::new(tat, band);
            if let Some(slot) = shard.gcra.get_mut(&key) {
                *slot = tat;
            } else {
                shard.make_room(now, max);
                shard.gcra.insert(key, tat);
            }
            return;
        }
        if !shard.windows.contains_key(&key) {
            shard.make_room(now, max);
        }
        let weight = band.weight_shift();
        let slot = shard.windows.entry(key).or_insert_with(|| Slot {
            idle_after: 0,
            state: State::Fixed(Window::default(), weight),
        });
        match next {
            Next::Fixed(w) => {
                *slot = Slot {
                    // Reservations in the next window keep the state until it ends.
                    idle_after: w.end.saturating_add(if w.next > 0 { window } else { 0 }),
                    state: State::Fixed(w, weight),
                }
            }
            Next::Counter(c) => {
                *slot = Slot {
                    idle_after: c
                        .end
                        .saturating_add(window)
                        .saturating_add(if c.next > 0 { window } else { 0 }),
                    state: State::Counter(c, weight),
                }
            }
            Next::Log | Next::LogAt(_) => {
                let at = match next {
                    Next::LogAt(at) => at,
                    _ => now,
                };
                if !matches!(slot.state, State::Log(..)) {
                    slot.state = State::Log(Box::default(), weight);
                }
                if let State::Log(log, kept_weight) = &mut slot.state {
                    *kept_weight = weight;
                    log.record(now, at, window, permits);
                }
                slot.idle_after = slot.idle_after.max(at.saturating_add(window));
            }
            Next::Tat(_) => {}
        }
    }
}

/// What [`AcquireOutcome::marks`] records of a band's state after a place was taken: a
/// token or leaky bucket's instant and remainder; 0 for the window algorithms, whose
/// places go back by their instant.
fn mark(next: Next) -> u128 {
    match next {
        Next::Tat(t) => (u128::from(t.nanos) << 64) | u128::from(t.frac),
        _ => 0,
    }
}

/// How long a request may wait for a band that refuses it: the band's wait, if the
/// bucket allows that long (never for a shadow rule).
fn allowed_wait(bucket: &Bucket<'_>, wait: Wait) -> Option<Duration> {
    match wait {
        Wait::After(d) if !bucket.shadow() && d <= bucket.max_wait() => Some(d),
        _ => None,
    }
}

/// The state of a band after taking the place of `bucket`'s request at `at` (not before
/// `now`), if the band admits it then without giving up what it admitted so far.
fn reserve(shard: &Shard, key: u128, bucket: &Bucket<'_>, band: &Band, now: u64, at: u64) -> Option<Next> {
    let (capacity, window, permits) = (band.capacity(), window_nanos(band), bucket.permits);
    let state = || shard.windows.get(&key).map(|s| &s.state);
    match bucket.rule.algorithm() {
        Algorithm::TokenBucket | Algorithm::LeakyBucket => {
            // The request counts at `at` only where the band's instant already lies at or
            // past `at`: there, taking its place now is what taking it at `at` would be
            // (the instant moves on by its cost, and back by it if the waiter is dropped).
            // Before `at`, the instant would have to jump to `at`, refusing everyone
            // until then: such a band does not let the request wait.
            let state = shard.gcra.get(&key).copied().map(Kept::tat);
            if state.is_none_or(|t| t.nanos < at) {
                return None;
            }
            let e = evaluate_instant(state, bucket, band, at);
            e.allowed.then_some(Next::Tat(e.next))
        }
        Algorithm::FixedWindow => {
            let state = match state() {
                Some(State::Fixed(w, _)) => Some(*w),
                _ => None,
            };
            fixed_window::reserve(state, now, at, capacity, window, permits).map(Next::Fixed)
        }
        Algorithm::SlidingWindowCounter => {
            let state = match state() {
                Some(State::Counter(c, _)) => Some(*c),
                _ => None,
            };
            sliding_window_counter::reserve(state, now, at, capacity, window, permits).map(Next::Counter)
        }
        Algorithm::SlidingWindowLog => {
            let admits = match state() {
                Some(State::Log(log, _)) => log.admits_at(at, capacity, window, permits),
                _ => permits <= capacity,
            };
            admits.then_some(Next::LogAt(at))
        }
    }
}

/// A band's report at `now`, as it stands (after a request that waits took its place).
fn figures_now(shard: &Shard, key: u128, bucket: &Bucket<'_>, band: &Band, now: u64) -> BandReport {
    let e = evaluate(shard, key, bucket, band, now);
    bucket.report(
        band,
        now,
        e.remaining_now,
        Duration::from_nanos(e.reset_now),
        Wait::None,
    )
}

/// Evaluates a token- or leaky-bucket band from its stored instant.
fn evaluate_instant(state: Option<Tat>, bucket: &Bucket<'_>, band: &Band, now: u64) -> Eval<Tat> {
    let (capacity, window, permits) = (band.capacity(), window_nanos(band), bucket.permits);
    if bucket.rule.algorithm() == Algorithm::LeakyBucket {
        leaky_bucket::evaluate(state, now, capacity, window, permits)
    } else {
        token_bucket::evaluate(state, now, capacity, window, permits)
    }
}

/// Evaluates one band of `bucket` for its key at `now`, reading the shard only.
fn evaluate(shard: &Shard, key: u128, bucket: &Bucket<'_>, band: &Band, now: u64) -> Eval<Next> {
    let (capacity, window, permits) = (band.capacity(), window_nanos(band), bucket.permits);
    fn map<S>(e: Eval<S>, f: impl FnOnce(S) -> Next) -> Eval<Next> {
        Eval {
            allowed: e.allowed,
            next: f(e.next),
            remaining_after: e.remaining_after,
            remaining_now: e.remaining_now,
            reset_after: e.reset_after,
            reset_now: e.reset_now,
            wait: e.wait,
        }
    }
    // Looked up only by the algorithms that keep their state there.
    let state = || shard.windows.get(&key).map(|s| &s.state);
    match bucket.rule.algorithm() {
        Algorithm::TokenBucket | Algorithm::LeakyBucket => map(
            evaluate_instant(shard.gcra.get(&key).copied().map(Kept::tat), bucket, band, now),
            Next::Tat,
        ),
        Algorithm::FixedWindow => {
            let state = match state() {
                Some(State::Fixed(w, _)) => Some(*w),
                _ => None,
            };
            map(
                fixed_window::evaluate(state, now, capacity, window, permits),
                Next::Fixed,
            )
        }
        Algorithm::SlidingWindowCounter => {
            let state = match state() {
                Some(State::Counter(c, _)) => Some(*c),
                _ => None,
            };
            map(
                sliding_window_counter::evaluate(state, now, capacity, window, permits),
                Next::Counter,
            )
        }
        Algorithm::SlidingWindowLog => {
            let empty = Log::new();
            let log = match state() {
                Some(State::Log(log, _)) => log,
                _ => &empty,
            };
            map(
                sliding_window_log::evaluate(log, now, capacity, window, permits),
                |()| Next::Log,
            )
        }
    }
}

/// What [`MemoryLimiter::acquire_single`] gives back: the whole outcome, or the report of
/// an admitted request alone.
trait SingleOutcome: Sized {
    /// What is taken before the evaluation (the report vector, for an outcome).
    type Spare;
    fn spare() -> Self::Spare;
    /// After the band's evaluation at `now`, committed when it admits.
    fn evaluated<S>(spare: Self::Spare, bucket: &Bucket<'_>, band: &Band, now: u64, e: &Eval<S>) -> Self;
    /// A refused request that waits for its place.
    fn reserved(outcome: AcquireOutcome) -> Self;
}

impl SingleOutcome for AcquireOutcome {
    type Spare = Bands;
    fn spare() -> Bands {
        Bands::with_capacity(1)
    }
    fn evaluated<S>(mut bands: Bands, bucket: &Bucket<'_>, band: &Band, now: u64, e: &Eval<S>) -> Self {
        let shadow = bucket.shadow();
        bands.push(report(bucket, band, now, e, e.allowed));
        AcquireOutcome::new(e.allowed || shadow, !shadow || e.allowed, now, bands)
    }
    fn reserved(outcome: AcquireOutcome) -> Self {
        outcome
    }
}

/// The figures of a one-band request its band admitted and committed: what its report
/// would say, without the report.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Admitted {
    pub(crate) now_unix_nanos: u64,
    pub(crate) remaining: u64,
    pub(crate) reset_after: Duration,
}

impl SingleOutcome for Result<Admitted, AcquireOutcome> {
    type Spare = ();
    fn spare() {}
    fn evaluated<S>((): (), bucket: &Bucket<'_>, band: &Band, now: u64, e: &Eval<S>) -> Self {
        if e.allowed && !bucket.shadow() {
            // The figures `report` takes for a committed band.
            Ok(Admitted {
                now_unix_nanos: now,
                remaining: e.remaining_after,
                reset_after: Duration::from_nanos(e.reset_after),
            })
        } else {
            Err(AcquireOutcome::evaluated(Bands::with_capacity(1), bucket, band, now, e))
        }
    }
    fn reserved(outcome: AcquireOutcome) -> Self {
        Err(outcome)
    }
}

fn report<S>(bucket: &Bucket<'_>, band: &Band, now: u64, e: &Eval<S>, committed: bool) -> BandReport {
    let (remaining, reset) = if committed {
        (e.remaining_after, e.reset_after)
    } else {
        (e.remaining_now, e.reset_now)
    };
    bucket.report(band, now, remaining, Duration::from_nanos(reset), e.wait)
}

impl RateLimiter for MemoryLimiter {
    fn acquire(&self, request: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        MaybeReady::ready(Ok(self.acquire_now(request)))
    }

    fn gives_back(&self) -> bool {
        true
    }

    fn give_back(&self, request: &AcquireRequest, decided_unix_nanos: u64) -> MaybeReady<Result<(), BoxError>> {
        self.give_back_now(request, decided_unix_nanos, None);
        MaybeReady::ready(Ok(()))
    }

    fn give_back_place(
        &self,
        request: &AcquireRequest,
        at_unix_nanos: u64,
        marks: &[u128],
    ) -> MaybeReady<Result<(), BoxError>> {
        self.give_back_now(request, at_unix_nanos, Some(marks));
        MaybeReady::ready(Ok(()))
    }

    fn is_local(&self) -> bool {
        true
    }

    fn reads_key_text(&self) -> bool {
        false
    }

    fn check_wait(&self, _: &RuleSet, _: &Rule, _: Duration) -> Result<(), RuleError> {
        Ok(())
    }

    fn backend_name(&self) -> &'static str {
        "memory"
    }

    /// Shadow buckets are not charged: they refuse nothing.
    fn charge(&self, request: &AcquireRequest) {
        for bucket in request.buckets().filter(|b| !b.shadow()) {
            self.charge_bucket(&bucket);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// An IPv4 address's hash keeps its low 32 bits a bijection of the address, and a
    /// band's identity keeps them: no two addresses share a bucket of a band. Typed values
    /// of other kinds, and IPv6 prefixes, hash apart.
    #[test]
    fn typed_addresses_never_share_a_bucket() {
        let typed = TypedHashes::new((0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210));
        let band = Band::new(3, Duration::from_secs(1)).unwrap();
        let mut seen = std::collections::HashSet::new();
        // Neighbouring addresses, and ones spread over the whole space.
        let addresses: std::collections::HashSet<u32> = (0..1u32 << 18)
            .chain((0..1u32 << 18).map(|i| i.wrapping_mul(0x9e37_79b9)))
            .collect();
        for &address in &addresses {
            let hash = typed.ipv4(address);
            let identity = hash.band(&band);
            assert_eq!(identity as u64 & (!0 >> 7), hash.low & (!0 >> 7));
            seen.insert(identity as u32);
        }
        assert_eq!(seen.len(), addresses.len());
        let v6 = |bits, prefix| typed.of(TypedKey::Ipv6 { bits, prefix }).unwrap().band(&band);
        let others = [
            typed.of(TypedKey::Global).unwrap().band(&band),
            typed.of(TypedKey::NoIp).unwrap().band(&band),
            v6(0x2001_0db8_0001 << 80, 48),
            v6(0x2001_0db8_0001 << 80, 64),
            v6(0x2001_0db8_0002 << 80, 64),
            typed.ipv4(0).band(&band),
        ];
        let distinct: std::collections::HashSet<_> = others.iter().collect();
        assert_eq!(distinct.len(), others.len());
        assert!(typed.of(TypedKey::Text).is_none());
    }

    /// SipHash-2-4-128 against the reference test vectors (key `00..0f`, message `00..`,
    /// from the SipHash reference implementation's `vectors.h`): the same code with one
    /// and three rounds is the limiter's hash.
    #[test]
    fn siphash_128_matches_the_reference_vectors() {
        let key = (0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908);
        let message: Vec<u8> = (0..64).collect();
        for (len, expected) in [
            (0, "a3817f04ba25a8e66df67214c7550293"),
            (1, "da87c1d86b99af44347659119b22fc45"),
            (7, "a1f1ebbed8dbc153c0b84aa61ff08239"),
            (8, "3b62a9ba6258f5610f83e264f31497b4"),
            (15, "5493e99933b0a8117e08ec0f97cfc3d9"),
            (16, "6ee2a4ca67b054bbfd3315bf85230577"),
            (63, "5150d1772f50834a503e069a973fbd7c"),
        ] {
            let (first, second) = siphash128::<2, 4>(key, &message[..len]);
            let tag: String = first
                .to_le_bytes()
                .iter()
                .chain(&second.to_le_bytes())
                .map(|b| format!("{b:02x}"))
                .collect();
            assert_eq!(tag, expected, "{len} bytes");
        }
        // Another key, another hash; one more byte, another hash.
        assert_ne!(siphash128::<1, 3>(key, b"ip=1"), siphash128::<1, 3>((1, 2), b"ip=1"));
        assert_ne!(siphash128::<1, 3>(key, b"ip=1"), siphash128::<1, 3>(key, b"ip=1\0"));
    }
    use crate::clock::ManualClock;
    use crate::rule::{BandSpec, Rule, RuleSpec};

    fn rule(cap: u64, secs: u64) -> Rule {
        Rule::from_spec(
            "s",
            RuleSpec::new("r", vec![BandSpec::new(cap, Duration::from_secs(secs))]),
        )
        .unwrap()
    }

    fn request(rule: &Rule, key: &str) -> AcquireRequest {
        let set = crate::rule::RuleSet::new("s", [rule.clone()]).unwrap();
        let mut request = AcquireRequest::new(Arc::new(set));
        request.push(0, key.into());
        request
    }

    #[test]
    fn idle_buckets_are_swept_and_max_keys_holds() {
        let clock = ManualClock::new(1_000_000_000);
        let limiter = MemoryLimiter::builder()
            .shards(1)
            .max_keys(2_000)
            .clock(clock.clone())
            .build();
        let r = rule(10, 1);
        for i in 0..5_000 {
            assert!(limiter.acquire_now(&request(&r, &format!("k{i}"))).allowed);
        }
        assert!(limiter.len() <= 2_000, "{}", limiter.len());
        clock.advance(Duration::from_secs(2));
        assert!(limiter.purge_idle() > 0);
        assert_eq!(limiter.len(), 0);
    }

    /// A small `max_keys` does not leave the default shards (16 per core, 1,024 on a big
    /// machine) a bucket or two each: a shard that holds one evicts it for any other key
    /// landing there, and that client starts over full. 16 clients of a rule of 1 per hour,
    /// within a `max_keys` of 32, are each admitted once, however many cores.
    #[test]
    fn a_small_max_keys_is_not_spread_over_shards_of_one_bucket() {
        let shards = |limiter: &MemoryLimiter| limiter.inner.shards.len();
        assert_eq!(shards(&MemoryLimiter::builder().max_keys(32).build()), 1);
        assert_eq!(shards(&MemoryLimiter::builder().max_keys(1_000).build()), 2);
        assert!(shards(&MemoryLimiter::builder().max_keys(100_000).build()) <= 256);
        // A count that is set is kept.
        assert_eq!(shards(&MemoryLimiter::builder().max_keys(32).shards(8).build()), 8);
        let clock = ManualClock::new(1_000_000_000);
        let limiter = MemoryLimiter::builder().max_keys(32).clock(clock).build();
        let r = rule(1, 3_600);
        let admitted = (0..10)
            .flat_map(|_| 0..16)
            .filter(|i| limiter.acquire_now(&request(&r, &format!("client{i}"))).allowed)
            .count();
        assert_eq!(admitted, 16, "buckets evicted and started over");
    }

    /// A rule of one band of `cap` per `secs` seconds, by `algorithm`.
    fn one_band(algorithm: crate::rule::Algorithm, cap: u64, secs: u64) -> Rule {
        one_band_costing(algorithm, cap, secs, 1)
    }

    /// The same, each request costing `permits`.
    fn one_band_costing(algorithm: crate::rule::Algorithm, cap: u64, secs: u64, permits: u64) -> Rule {
        let mut spec = RuleSpec::new("r", vec![BandSpec::new(cap, Duration::from_secs(secs))]);
        spec.algorithm = algorithm;
        spec.permits = permits;
        Rule::from_spec("s", spec).unwrap()
    }

    /// What another limiter admitted, charged in memory (the `fallback_local` rules'
    /// buckets): the permits come off the band, and a charge past what the band holds
    /// empties it without putting it in debt, with every algorithm.
    #[test]
    fn a_charge_takes_its_permits_and_empties_a_band_without_debt() {
        use crate::rule::Algorithm;
        for algorithm in [
            Algorithm::TokenBucket,
            Algorithm::LeakyBucket,
            Algorithm::FixedWindow,
            Algorithm::SlidingWindowCounter,
            Algorithm::SlidingWindowLog,
        ] {
            let (clock, limiter) = one_shard_of_1000();
            let r = one_band(algorithm, 10, 100);
            let charge = |key: &str, permits: u64| {
                let request = request(&r, key);
                let mut bucket = request.bucket(0).expect("one bucket");
                bucket.permits = permits;
                limiter.charge_bucket(&bucket);
            };
            let admitted = |key: &str| {
                (0..20)
                    .filter(|_| limiter.acquire_now(&request(&r, key)).allowed)
                    .count()
            };
            charge("part", 4);
            assert_eq!(admitted("part"), 6, "{algorithm:?}: 4 of 10 charged");
            charge("over", 25);
            assert_eq!(admitted("over"), 0, "{algorithm:?}: charged past its capacity");
            charge("over", 5);
            clock.advance(Duration::from_secs(200));
            assert_eq!(admitted("over"), 10, "{algorithm:?}: an emptied band is in no debt");
        }
    }

    /// A limiter of one shard of at most 1,000 keys, on a manual clock.
    fn one_shard_of_1000() -> (ManualClock, MemoryLimiter) {
        let clock = ManualClock::new(1_000_000_000);
        let limiter = MemoryLimiter::builder()
            .shards(1)
            .max_keys(1_000)
            .clock(clock.clone())
            .build();
        (clock, limiter)
    }

    /// Exhausts the `victim`'s bucket in a shard of at most 1,000 keys, floods the shard with
    /// 5,000 keys of `flood` a microsecond apart (each ranks differently by time), and
    /// asserts that the victim's bucket was not evicted: it still refuses.
    fn assert_a_flood_keeps_the_exhausted_bucket(victim: &Rule, flood: &Rule) {
        let (clock, limiter) = one_shard_of_1000();
        let capacity = victim.bands()[0].capacity();
        for _ in 0..capacity / victim.permits() {
            assert!(limiter.acquire_now(&request(victim, "victim")).allowed);
        }
        assert!(!limiter.acquire_now(&request(victim, "victim")).allowed);
        for i in 0..5_000 {
            clock.advance(Duration::from_micros(1));
            assert!(limiter.acquire_now(&request(flood, &format!("k{i}"))).allowed);
        }
        assert!(limiter.len() <= 1_000, "{}", limiter.len());
        assert!(
            !limiter.acquire_now(&request(victim, "victim")).allowed,
            "{:?} {capacity} per {:?} flooded by {:?}: the exhausted bucket was evicted and came back full",
            victim.algorithm(),
            victim.bands()[0].window(),
            flood.algorithm()
        );
    }

    /// At `max_keys`, a flood of made-up keys does not evict an exhausted bucket, which
    /// would come back full: eviction drops the buckets that still count the fewest
    /// permits, whatever their windows. A flood of buckets under a long window, each
    /// counting one request, does not evict a login's minute; nor does a flood of minute
    /// buckets, each exhausted by one request, evict a daily quota. So for windows.
    #[test]
    fn a_flood_of_made_up_keys_does_not_evict_an_exhausted_bucket() {
        use crate::rule::Algorithm::{FixedWindow, TokenBucket};
        // The victim's rule, then the flood's.
        for (victim, flood) in [
            (one_band(TokenBucket, 5, 60), one_band(TokenBucket, 1000, 86_400)),
            (one_band(TokenBucket, 20, 86_400), one_band(TokenBucket, 1, 60)),
            (one_band(FixedWindow, 5, 60), one_band(FixedWindow, 1000, 86_400)),
            (one_band(FixedWindow, 20, 86_400), one_band(FixedWindow, 1, 60)),
        ] {
            assert_a_flood_keeps_the_exhausted_bucket(&victim, &flood);
        }
    }

    /// Buckets are ranked by the requests they still count, not their permits: a flood of
    /// made-up keys of a rule whose requests cost 10 permits, each key counting one request
    /// (10 permits), does not evict an exhausted bucket of 5 (5 permits, 5 requests), for
    /// any algorithm. Before, it did, and the exhausted bucket came back full.
    #[test]
    fn a_flood_of_costly_requests_does_not_evict_an_exhausted_bucket() {
        for algorithm in crate::rule::Algorithm::ALL {
            let victim = one_band(algorithm, 5, 60);
            let flood = one_band_costing(algorithm, 1000, 86_400, 10);
            assert_a_flood_keeps_the_exhausted_bucket(&victim, &flood);
            // And a victim whose own requests cost several permits.
            let victim = one_band_costing(algorithm, 20, 60, 4);
            assert_a_flood_keeps_the_exhausted_bucket(&victim, &flood);
        }
    }

    /// A rule reloaded with a lower cost per request keeps its counters (the cost is not
    /// part of their identity): a bucket its clients exhausted before, now counting 1024
    /// requests of the new cost, still outranks a flood of made-up keys counting two each.
    /// Before, a token or leaky bucket kept the interval class, and a window state the
    /// weight, of the cost it was last written under (a log the one it was created under),
    /// and a refused request wrote nothing: ranked 1024 times too low, the exhausted bucket
    /// went first and came back full, for every algorithm. A refusal now ranks the state by
    /// the band's cost ([`Shard::restamp`]).
    #[test]
    fn a_bucket_kept_across_a_cost_change_is_ranked_by_the_new_cost() {
        let mut evicted = Vec::new();
        for algorithm in crate::rule::Algorithm::ALL {
            let before = one_band_costing(algorithm, 1024, 60, 1024);
            let after = one_band_costing(algorithm, 1024, 60, 1);
            assert_eq!(before.bands()[0].ident(), after.bands()[0].ident());
            let flood = one_band(algorithm, 1000, 86_400);
            let (clock, limiter) = one_shard_of_1000();
            assert!(limiter.acquire_now(&request(&before, "victim")).allowed);
            assert!(!limiter.acquire_now(&request(&after, "victim")).allowed);
            for i in 0..5_000 {
                clock.advance(Duration::from_micros(1));
                for _ in 0..2 {
                    assert!(limiter.acquire_now(&request(&flood, &format!("k{i}"))).allowed);
                }
            }
            if limiter.acquire_now(&request(&after, "victim")).allowed {
                evicted.push(algorithm);
            }
        }
        assert!(
            evicted.is_empty(),
            "{evicted:?}: the bucket exhausted before the cost changed was evicted and came back full"
        );
    }

    /// A window's state holds its rule's weight beside the variant's tag: no larger than
    /// without it.
    #[test]
    fn a_window_state_with_its_weight_is_no_larger() {
        assert_eq!(std::mem::size_of::<Slot>(), 48);
    }

    /// The token and leaky buckets and the window states live in two tables of a shard:
    /// a flood of one kind does not evict an exhausted bucket of the other, which it
    /// outranks no more than it would one of its own kind.
    #[test]
    fn a_flood_of_another_algorithm_does_not_evict_an_exhausted_bucket() {
        use crate::rule::Algorithm::{FixedWindow, SlidingWindowLog, TokenBucket};
        for (victim, flood) in [
            (one_band(TokenBucket, 5, 60), one_band(FixedWindow, 1000, 86_400)),
            (one_band(FixedWindow, 5, 60), one_band(TokenBucket, 1000, 86_400)),
            (one_band(SlidingWindowLog, 5, 60), one_band(TokenBucket, 1000, 86_400)),
        ] {
            assert_a_flood_keeps_the_exhausted_bucket(&victim, &flood);
        }
    }

    /// Eviction drops every bucket that counts fewer permits than the cut before any at
    /// the cut, whatever order the table holds them in: an exhausted bucket does not go in
    /// the place of one that counts a single request.
    #[test]
    fn eviction_drops_the_lightest_buckets_before_the_ties() {
        let clock = ManualClock::new(1_000_000_000);
        let limiter = MemoryLimiter::builder()
            .shards(1)
            .max_keys(100)
            .clock(clock.clone())
            .build();
        // 3 per minute: 90 exhausted buckets, then 10 that took one permit each.
        let r = rule(3, 60);
        for i in 0..90 {
            for _ in 0..3 {
                assert!(limiter.acquire_now(&request(&r, &format!("heavy{i}"))).allowed);
            }
        }
        for i in 0..10 {
            assert!(limiter.acquire_now(&request(&r, &format!("light{i}"))).allowed);
        }
        // One more bucket: 12 go, the 10 light ones and 2 exhausted ones.
        assert!(limiter.acquire_now(&request(&r, "new")).allowed);
        assert_eq!(limiter.len(), 89);
        let exhausted = (0..90)
            .filter(|i| !limiter.acquire_now(&request(&r, &format!("heavy{i}"))).allowed)
            .count();
        assert_eq!(exhausted, 88, "exhausted buckets evicted in place of lighter ones");
    }

    /// The three paths a request of `algorithm` takes, as rule sets of a band of
    /// `per_second` per second: one band alone, one rule of two bands, two rules.
    fn three_paths(
        algorithm: crate::rule::Algorithm,
        per_second: u64,
    ) -> [(&'static str, Arc<crate::rule::RuleSet>); 3] {
        let of = |id: &str, bands: Vec<BandSpec>| {
            let mut spec = RuleSpec::new(id, bands);
            spec.algorithm = algorithm;
            Rule::from_spec("s", spec).unwrap()
        };
        let second = || BandSpec::new(per_second, Duration::from_secs(1));
        let daily = || BandSpec::new(1000, Duration::from_secs(86_400));
        let set = |rules| Arc::new(crate::rule::RuleSet::new("s", rules).unwrap());
        [
            ("one band", set(vec![of("r", vec![second()])])),
            ("two bands", set(vec![of("r", vec![second(), daily()])])),
            (
                "two rules",
                set(vec![of("r", vec![second()]), of("daily", vec![daily()])]),
            ),
        ]
    }

    /// A request of key `k` to every rule of `set`.
    fn every_rule(set: &Arc<crate::rule::RuleSet>) -> AcquireRequest {
        let mut request = AcquireRequest::new(set.clone());
        for i in 0..set.rules().len() {
            request.push(i, "k".into());
        }
        request
    }

    /// A clock that a thread named `stalled` reads, then stalls on (until released, or
    /// for 300 ms when it holds a lock the others need): what a preempted thread, or one
    /// waiting for a shard's lock, does between reading the clock and deciding.
    #[derive(Debug, Clone)]
    struct StallingClock {
        now: ManualClock,
        read: Arc<std::sync::Barrier>,
        released: Arc<(Mutex<bool>, std::sync::Condvar)>,
    }

    impl Clock for StallingClock {
        fn now_nanos(&self) -> u64 {
            let now = self.now.now_nanos();
            if std::thread::current().name() == Some("stalled") {
                self.read.wait();
                let (released, signal) = &*self.released;
                let guard = released.lock().unwrap();
                let _ = signal
                    .wait_timeout_while(guard, Duration::from_millis(300), |r| !*r)
                    .unwrap();
            }
            now
        }
    }

    /// A request that read the clock before another decided at a later instant is decided
    /// after it, at that later instant: a fixed window or a sliding window counter does
    /// not count it in the window that had ended, and does not lose the new window's
    /// count to it. For every path: one band, one rule of two bands, two rules.
    #[test]
    fn a_request_that_read_the_clock_before_another_decided_counts_after_it() {
        use crate::rule::Algorithm::{FixedWindow, SlidingWindowCounter};
        for algorithm in [FixedWindow, SlidingWindowCounter] {
            for (shape, set) in three_paths(algorithm, 2) {
                let request = || every_rule(&set);
                const SEC: u64 = 1_000_000_000;
                let clock = ManualClock::new(1_000 * SEC);
                let read = Arc::new(std::sync::Barrier::new(2));
                let released = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
                let limiter = MemoryLimiter::builder()
                    .clock(StallingClock {
                        now: clock.clone(),
                        read: read.clone(),
                        released: released.clone(),
                    })
                    .build();
                // 2 per second: the window of second 1000 is spent by its first half.
                clock.advance(Duration::from_millis(500));
                let mut admitted = 0;
                for _ in 0..3 {
                    admitted += u32::from(limiter.acquire_now(&request()).allowed);
                }
                // One request reads the clock late in the second, and stalls.
                clock.advance(Duration::from_millis(499));
                let stalled = {
                    let (limiter, request) = (limiter.clone(), request());
                    std::thread::Builder::new()
                        .name("stalled".into())
                        .spawn(move || limiter.acquire_now(&request).allowed)
                        .unwrap()
                };
                read.wait();
                // Meanwhile the next second begins, and its requests are decided.
                clock.advance(Duration::from_millis(1));
                for _ in 0..3 {
                    admitted += u32::from(limiter.acquire_now(&request()).allowed);
                }
                *released.0.lock().unwrap() = true;
                released.1.notify_all();
                admitted += u32::from(stalled.join().unwrap());
                for _ in 0..3 {
                    admitted += u32::from(limiter.acquire_now(&request()).allowed);
                }
                // Two in the window of second 1000; in second 1001, at its first
                // millisecond, a sliding window counter still counts nearly all of the
                // previous one's two, and admits nothing; a fixed window admits two.
                let expected = if algorithm == FixedWindow { 4 } else { 2 };
                assert_eq!(admitted, expected, "{algorithm:?}, {shape}");
            }
        }
    }

    /// A clock read on two cores whose time-stamp counters disagree (as quanta reads them on
    /// some machines): every other reading is a little ahead, across a window's end.
    #[derive(Debug)]
    struct TwoCoresClock {
        behind: u64,
        ahead: u64,
        reads: std::sync::atomic::AtomicU64,
    }

    impl Clock for TwoCoresClock {
        fn now_nanos(&self) -> u64 {
            if self.reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 2 == 0 {
                self.behind
            } else {
                self.ahead
            }
        }
    }

    /// A clock that goes back between two readings (two cores' counters apart) never makes
    /// a bucket count anew: decisions in a shard are made at instants that never go back, so
    /// at most the two windows the readings fall in are counted, for every algorithm and
    /// every path (one band, one rule of two bands, two rules).
    #[test]
    fn a_clock_that_goes_back_between_readings_admits_no_more() {
        const SEC: u64 = 1_000_000_000;
        for algorithm in crate::rule::Algorithm::ALL {
            for (shape, set) in three_paths(algorithm, 5) {
                let limiter = MemoryLimiter::builder()
                    .clock(TwoCoresClock {
                        behind: 1_000 * SEC - 1_000_000,
                        ahead: 1_000 * SEC + 1_000_000,
                        reads: 0.into(),
                    })
                    .build();
                let admitted = (0..100)
                    .filter(|_| limiter.acquire_now(&every_rule(&set)).allowed)
                    .count();
                assert!(
                    admitted <= 10,
                    "{algorithm:?}, {shape}: {admitted} admitted of 5 per second"
                );
            }
        }
    }

    /// A clock read on whichever core a caller runs on, as the test sets it.
    #[derive(Debug, Default)]
    struct SetClock(std::sync::atomic::AtomicU64);

    impl SetClock {
        fn set(&self, nanos: u64) {
            self.0.store(nanos, std::sync::atomic::Ordering::Relaxed);
        }
    }

    impl Clock for Arc<SetClock> {
        fn now_nanos(&self) -> u64 {
            self.0.load(std::sync::atomic::Ordering::Relaxed)
        }
    }

    /// `purge_idle` read on a core whose counter is ahead sweeps a bucket as idle at that
    /// instant: the shard's next decisions, read on a core behind it, are made at no
    /// earlier an instant than the sweep's, or the swept bucket counts anew in the window
    /// it was exhausted in (a fixed window of 5 per second admitted 5 more at each sweep).
    #[test]
    fn a_sweep_on_a_clock_ahead_makes_no_bucket_count_anew() {
        const SEC: u64 = 1_000_000_000;
        for algorithm in crate::rule::Algorithm::ALL {
            let [(_, set), ..] = three_paths(algorithm, 5);
            let clock = Arc::new(SetClock::default());
            let limiter = MemoryLimiter::builder().shards(1).clock(clock.clone()).build();
            let (behind, ahead) = (1_000 * SEC - 1_000_000, 1_002 * SEC - 1_000_000);
            let mut admitted = 0;
            for _ in 0..10 {
                clock.set(behind);
                for _ in 0..10 {
                    admitted += usize::from(limiter.acquire_now(&every_rule(&set)).allowed);
                }
                clock.set(ahead);
                limiter.purge_idle();
            }
            assert!(admitted <= 10, "{algorithm:?}: {admitted} admitted of 5 per second");
        }
    }

    /// One reading far ahead (a core's counter an hour off, once) is the instant of every
    /// later decision in its shard until the clock catches up: the shard's time stands
    /// still, and every other client of the shard gets one burst of its capacity for that
    /// hour (here 1 of the 10 a rule of 1 per second admits over 10 seconds). Before, the
    /// reading made only its own request's buckets wait. A design question: how far behind
    /// the latest instant a reading may be and still be the clock's (a bound on the skew
    /// tolerated) is not settled.
    #[test]
    #[ignore = "design question: a single reading far ahead stands a shard's time still; no bound on the skew tolerated yet"]
    fn a_single_reading_far_ahead_does_not_stand_a_shard_still() {
        const SEC: u64 = 1_000_000_000;
        let clock = Arc::new(SetClock::default());
        let limiter = MemoryLimiter::builder().shards(1).clock(clock.clone()).build();
        let r = rule(1, 1);
        clock.set(1_000 * SEC + 3_600 * SEC);
        assert!(limiter.acquire_now(&request(&r, "a")).allowed);
        let admitted = (0..10)
            .filter(|i| {
                clock.set(1_000 * SEC + i * SEC);
                limiter.acquire_now(&request(&r, "b")).allowed
            })
            .count();
        assert_eq!(
            admitted, 10,
            "another key of the shard, one request a second at 1 per second"
        );
    }

    /// The one pass over token buckets writes each band as it goes: a request another band
    /// refuses leaves every band it wrote as it was, a new key's bucket included.
    #[test]
    fn a_refused_request_leaves_the_bands_it_wrote_as_they_were() {
        use crate::rule::RuleSet;
        let limiter = MemoryLimiter::builder().clock(ManualClock::new(1_000_000_000)).build();
        let hourly = Rule::from_spec(
            "s",
            RuleSpec::new("hourly", vec![BandSpec::new(1, Duration::from_secs(3600))]),
        )
        .unwrap();
        let set = Arc::new(RuleSet::new("s", [rule(10, 1), hourly]).unwrap());
        let request = |key: &str| {
            let mut request = AcquireRequest::new(set.clone());
            request.push(0, key.into());
            request.push(1, "shared".into());
            request
        };
        let first = limiter.acquire_now(&request("old"));
        assert!(first.allowed);
        assert_eq!(first.bands[0].remaining, 9);
        let buckets = limiter.len();
        // The second rule's only permit is gone: refused, after the first rule's band took
        // one from a key it had seen and from a key it had not.
        for key in ["old", "new"] {
            let refused = limiter.acquire_now(&request(key));
            assert!(!refused.allowed, "{key}");
            let expected = if key == "old" { 9 } else { 10 };
            assert_eq!(refused.bands[0].remaining, expected, "{key}: the band as it stays");
            assert_eq!(limiter.len(), buckets, "{key}: no bucket left behind");
        }
        let mut alone = AcquireRequest::new(set.clone());
        alone.push(0, "old".into());
        assert_eq!(limiter.acquire_now(&alone).bands[0].remaining, 8, "nothing taken twice");
    }

    #[test]
    fn a_rule_in_two_rule_sets_has_two_counters() {
        use crate::rule::RuleSet;
        let limiter = MemoryLimiter::default();
        let shared = rule(1, 3600);
        let a = RuleSet::new("a", [shared.clone()]).unwrap();
        let b = RuleSet::new("b", [shared]).unwrap();
        for set in [a, b] {
            let id = set.id().clone();
            let mut request = AcquireRequest::new(Arc::new(set));
            request.push(0, "k".into());
            assert!(limiter.acquire_now(&request).allowed, "{id}");
        }
    }

    #[test]
    fn sweeping_does_not_forget_active_buckets() {
        let clock = ManualClock::new(1_000_000_000);
        let limiter = MemoryLimiter::builder()
            .shards(1)
            .max_keys(1_000_000)
            .clock(clock.clone())
            .build();
        let (hourly, per_second) = (rule(1, 3600), rule(10, 1));
        let hot = request(&hourly, "hot");
        assert!(limiter.acquire_now(&hot).allowed);
        for i in 0..10_000 {
            limiter.acquire_now(&request(&per_second, &format!("k{i}")));
            clock.advance(Duration::from_millis(1));
        }
        assert!(!limiter.acquire_now(&hot).allowed, "an active bucket was forgotten");
    }
}
