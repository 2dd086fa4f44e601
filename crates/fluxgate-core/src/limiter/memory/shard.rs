//! The shards of the table: token and leaky buckets' instants and window states by
//! bucket identity, swept when idle and evicted, the closest to full first, when full.

use super::*;

pub(super) type Map<V> = HashMap<u128, V, BuildHasherDefault<PreHashed>>;

/// A shard's mutex on cache lines of its own: without the padding, neighbouring shards
/// share a line, and threads deciding for unrelated keys would contend for it.
#[repr(align(128))]
pub(super) struct Padded(pub(super) Mutex<Shard>);

pub(super) struct Shard {
    /// Token and leaky buckets: one instant each.
    pub(super) gcra: Map<Kept>,
    /// Fixed windows, sliding window counters and logs.
    pub(super) windows: Map<Slot>,
    pub(super) next_sweep: usize,
    /// The latest instant a decision in this shard was made at: no later decision in it is
    /// made at an earlier one, whatever the clock reads (see [`not_before`]).
    pub(super) latest: u64,
}

/// A window-based band's state and the instant after which it counts nothing.
pub(super) struct Slot {
    pub(super) idle_after: u64,
    pub(super) state: State,
}

/// The top byte of a kept instant's remainder holds its band's interval class.
pub(super) const CLASS_SHIFT: u32 = 56;
pub(super) const FRAC_MASK: u64 = (1 << CLASS_SHIFT) - 1;

/// A token or leaky bucket's instant as the table keeps it: its remainder is below the
/// band's capacity (at most 2^40), so the remainder's top byte holds the band's interval
/// class ([`Band::interval_class`]), which eviction reads, at no cost in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Kept(pub(super) Tat);

impl Kept {
    pub(super) fn new(tat: Tat, band: &Band) -> Self {
        Self(Tat {
            nanos: tat.nanos,
            frac: (tat.frac & FRAC_MASK) | (u64::from(band.interval_class()) << CLASS_SHIFT),
        })
    }

    pub(super) fn tat(self) -> Tat {
        Tat {
            nanos: self.0.nanos,
            frac: self.0.frac & FRAC_MASK,
        }
    }

    pub(super) fn class(self) -> u8 {
        (self.0.frac >> CLASS_SHIFT) as u8
    }

    /// The same instant, ranked by `band`'s class: see [`Shard::restamp`].
    pub(super) fn restamp(&mut self, band: &Band) {
        if self.class() != band.interval_class() {
            *self = Self::new(self.tat(), band);
        }
    }
}

/// The permits a token or leaky bucket still counts at `now`: the time until it is full,
/// in intervals of its class (within a factor of two).
pub(super) fn permits_ahead(until: u64, now: u64, class: u8) -> u64 {
    until.saturating_sub(now) >> class
}

/// A window-based band's state, with its rule's [weight](Band::weight_shift) (held beside
/// the variant's tag, at no cost in memory), by which eviction ranks it in requests.
pub(super) enum State {
    Fixed(Window, u8),
    Counter(Counter, u8),
    Log(Box<Log>, u8),
}

/// A stored state that becomes the same as no state once time has passed.
pub(super) trait Stored {
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
pub(super) fn not_before(latest: &mut u64, now: u64) -> u64 {
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
    pub(super) fn restamp(&mut self, key: u128, band: &Band) {
        if let Some(kept) = self.gcra.get_mut(&key) {
            kept.restamp(band);
        } else if let Some(slot) = self.windows.get_mut(&key) {
            let (State::Fixed(_, weight) | State::Counter(_, weight) | State::Log(_, weight)) = &mut slot.state;
            *weight = band.weight_shift();
        }
    }

    pub(super) fn len(&self) -> usize {
        self.gcra.len() + self.windows.len()
    }

    pub(super) fn sweep(&mut self, now: u64) {
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
    pub(super) fn make_room(&mut self, now: u64, max: usize) {
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
    pub(super) fn evict_fewest_permits(&mut self, count: usize, now: u64) {
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
pub(super) enum Next {
    Tat(Tat),
    Fixed(Window),
    Counter(Counter),
    /// A new log entry.
    Log,
    /// A new log entry at a later instant, for a request that waits until then.
    LogAt(u64),
}

pub(super) const MIN_SWEEP: usize = 1024;
