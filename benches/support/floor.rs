//! The least an in-memory decision of one per-IP token bucket can cost on the engine
//! benchmark's contexts: a plan fixed in advance (no rule lookup, no matching, no key
//! text), the address's bytes hashed by a keyed SipHash-1-3, one of 32 shards locked, one
//! lookup in a table of prehashed identities, the exact GCRA in whole nanoseconds with its
//! remaining count and reset, and nothing built for the caller but those three figures.
//!
//! It is not a limiter (no eviction, no rule changes, no waits, no reports): it measures
//! what remains of a decision once everything a rule set could settle when it loads is
//! taken out, to tell how far the engine's time can fall on this machine and benchmark.

#![allow(dead_code)]

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};
use std::net::IpAddr;
use std::sync::Mutex;

use fluxgate::core::{Clock, SystemClock};
use fluxgate::RequestContext;

/// A hasher that passes a prehashed identity through.
#[derive(Default)]
pub(crate) struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u128 identities are hashed")
    }
    fn write_u128(&mut self, i: u128) {
        self.0 = i as u64;
    }
}

#[repr(align(128))]
struct Shard(Mutex<HashMap<u128, u64, BuildHasherDefault<PassThrough>>>);

/// One per-IP token bucket of `capacity` per `window_nanos`, exact in whole nanoseconds.
pub(crate) struct Floor {
    shards: Box<[Shard]>,
    hash: RandomState,
    clock: SystemClock,
    capacity: u64,
    interval: u64,
}

/// What a layer needs of a decision: admitted, remaining, nanoseconds until full.
pub(crate) struct Figures {
    pub(crate) allowed: bool,
    pub(crate) remaining: u64,
    pub(crate) reset_nanos: u64,
}

impl Floor {
    pub(crate) fn new(capacity: u64, window_nanos: u64) -> Self {
        Self {
            shards: (0..32).map(|_| Shard(Mutex::new(HashMap::default()))).collect(),
            hash: RandomState::new(),
            clock: SystemClock::new(),
            capacity,
            interval: window_nanos / capacity,
        }
    }

    pub(crate) fn decide(&self, ctx: &RequestContext) -> Figures {
        let mut h = self.hash.build_hasher();
        match ctx.client_ip() {
            Some(IpAddr::V4(ip)) => h.write(&ip.octets()),
            Some(IpAddr::V6(ip)) => h.write(&ip.octets()),
            None => h.write_u8(0),
        }
        let low = h.finish();
        let id = u128::from(low) | (u128::from(low.rotate_left(29) ^ 0x9e37_79b9_7f4a_7c15) << 64);
        let shard = &self.shards[(low >> 59) as usize];
        let now = self.clock.now_nanos();
        let mut table = shard.0.lock().unwrap_or_else(|e| e.into_inner());
        let tat = table.entry(id).or_insert(now);
        let debt = tat.saturating_sub(now);
        let full = self.capacity * self.interval;
        let after = debt + self.interval;
        if after > full {
            return Figures {
                allowed: false,
                remaining: self.capacity - debt.div_ceil(self.interval),
                reset_nanos: debt,
            };
        }
        *tat = now + after;
        Figures {
            allowed: true,
            remaining: self.capacity - after.div_ceil(self.interval),
            reset_nanos: after,
        }
    }
}
