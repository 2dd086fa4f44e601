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

mod hash;
mod shard;
#[cfg(test)]
mod tests;

use hash::*;
use shard::*;

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
