//! The requests a [`FallbackHandler`](super::FallbackHandler)'s local engine admitted while
//! the handler it wraps failed, kept to be replayed to that handler ([`LocalAdmissions`]).

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use smallvec::SmallVec;

use crate::context::RequestContext;
use crate::decision::Decision;
use crate::engine::Engine;
use crate::error::Error;

/// How long a replay the handler did not count waits at least before it is made again
/// ([`Replays::refused`]).
const RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// The most requests kept for the wrapped handler to count, per request identity: past
/// it, what the local engine admits for that identity is not replayed.
const MOST_REPLAYS: u64 = 10_000;

/// The most request identities kept at once, and the most bytes of their contexts: past
/// either, what the local engine admits for a new identity is not replayed.
const MOST_IDENTITIES: usize = 100_000;

/// How often [`LocalAdmissions::take`] forgets the entries that lapsed.
pub(super) const PURGE: std::time::Duration = std::time::Duration::from_secs(1);

/// The longest list of a bucket's identities searched before one is added to it.
pub(super) const SEARCHED: usize = 8;

/// The most bytes of the contexts kept: past it, what the local engine admits for a new
/// identity is not replayed.
const MOST_BYTES: usize = 64 << 20;

/// The requests the local engine admitted while the wrapped handler failed, which the
/// handler has not counted, kept to be replayed to it ([`FallbackHandler::replay`]) when it
/// answers again: per request identity (everything of a [`RequestContext`] a rule matches
/// or keys on; not its `max_wait`), with the context and the buckets it counted in. The
/// next request that counts in any of those buckets has them replayed first, whatever its
/// own path or attributes: the handler then counts what the local engine admitted, and
/// does not admit it again. Identities and buckets are hashed with a key of this process,
/// so that a client cannot make its own collide with another's. A debt lapses after the
/// longest window of the bands that admitted it: by then the handler would have refilled
/// it.
#[derive(Debug, Default)]
pub(super) struct LocalAdmissions {
    /// The identities kept and the buckets in flight, read without the lock on every check.
    pub(super) len: AtomicUsize,
    pub(super) keys: RandomState,
    pub(super) state: Mutex<State>,
    /// Woken when a replay ends.
    pub(super) done: tokio::sync::Notify,
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) entries: HashMap<u64, Entry>,
    /// The identities that counted in each bucket (some perhaps gone since).
    pub(super) by_bucket: HashMap<u64, SmallVec<[u64; 2]>>,
    /// The bytes of the entries' contexts, about.
    pub(super) bytes: usize,
    /// The buckets of the requests being replayed, each with the replays holding it.
    pub(super) in_flight: HashMap<u64, usize>,
    /// When [`LocalAdmissions::take`] next forgets the entries that lapsed ([`State::purge`]).
    pub(super) purge_at: Option<Instant>,
}

impl State {
    /// Forgets the entries that lapsed by `now`, and the identities gone from the buckets'
    /// lists.
    pub(super) fn purge(&mut self, now: Instant) {
        self.entries.retain(|_, e| e.until > now);
        self.bytes = self.entries.values().map(|e| size(&e.ctx)).sum();
        let entries = &self.entries;
        self.by_bucket.retain(|_, ids| {
            ids.retain(|id| entries.contains_key(id));
            ids.sort_unstable();
            ids.dedup();
            !ids.is_empty()
        });
    }
}

/// What [`LocalAdmissions::take`] found for a request.
pub(super) enum Taken {
    /// Nothing owed in its buckets.
    Nothing,
    /// Requests to replay before it.
    Replay(Replays),
    /// Nothing left to take, but another request is replaying requests of its buckets: it
    /// waits for them ([`LocalAdmissions::done`]).
    Busy,
}

#[derive(Debug)]
pub(super) struct Entry {
    pub(super) ctx: RequestContext,
    pub(super) buckets: SmallVec<[u64; 4]>,
    pub(super) requests: u64,
    pub(super) until: Instant,
    /// Not replayed before then: the handler refused a replay of it
    /// ([`Replays::refused`]).
    pub(super) retry_at: Option<Instant>,
}

/// The bytes a context holds, about.
fn size(ctx: &RequestContext) -> usize {
    let attributes: usize = ctx.attributes().iter().map(|(k, v)| k.len() + v.len() + 64).sum();
    256 + ctx.routed_path().len()
        + ctx.path().len()
        + ctx.user_id().map_or(0, str::len)
        + ctx.api_key().map_or(0, str::len)
        + attributes
}

/// Requests taken from [`LocalAdmissions`] to replay: whatever is left of them when dropped goes
/// back.
pub(super) struct Replays {
    pub(super) owed: Arc<LocalAdmissions>,
    pub(super) entries: Vec<(u64, Entry)>,
    /// The buckets it holds in flight ([`State::in_flight`]).
    pub(super) buckets: SmallVec<[u64; 8]>,
}

impl Replays {
    /// The context of the next request to replay.
    pub(super) fn next(&mut self) -> Option<&RequestContext> {
        while self.entries.last().is_some_and(|(_, e)| e.requests == 0) {
            self.entries.pop();
        }
        self.entries.last().map(|(_, e)| &e.ctx)
    }

    /// The handler counted the request [`next`](Self::next) gave.
    pub(super) fn paid(&mut self) {
        if let Some((_, entry)) = self.entries.last_mut() {
            entry.requests -= 1;
        }
    }

    /// Up to `most` requests to replay together: each with the index of its entry.
    pub(super) fn wave(&mut self, most: usize) -> Vec<(usize, RequestContext)> {
        // Those the last waves paid, not gone through again.
        while self.entries.last().is_some_and(|(_, e)| e.requests == 0) {
            self.entries.pop();
        }
        let mut wave = Vec::new();
        for (index, (_, entry)) in self.entries.iter().enumerate().rev() {
            let room = most - wave.len();
            let count = usize::try_from(entry.requests).unwrap_or(usize::MAX).min(room);
            wave.extend(std::iter::repeat_n((index, entry.ctx.clone()), count));
            if wave.len() == most {
                break;
            }
        }
        wave
    }

    /// The handler did not count the replay [`next`](Self::next) gave ([`Self::refused_at`]).
    pub(super) fn refused(&mut self, answer: &Result<Decision, Error>) {
        if let Some(index) = self.entries.len().checked_sub(1) {
            self.refused_at(index, answer);
        }
    }

    /// The handler did not count a replay of the entry at `index` (`answer`). When it
    /// refused it, the entry is not replayed again before the refusal's `retry_after`
    /// ([`RETRY`] without one), when the handler would admit it: until then it stays owed,
    /// and the requests of its buckets neither replay it nor wait for it. A debt the
    /// handler keeps refusing (the identity's own bucket full at the service, spent through
    /// another gateway) so costs the requests of a bucket it shares with others (a global
    /// limit) one refused replay per `retry_after`, not one or a wave of them each, in
    /// turn. A failure or a fallback's decision is tried again by the next request.
    pub(super) fn refused_at(&mut self, index: usize, answer: &Result<Decision, Error>) {
        let Ok(decision) = answer else {
            return;
        };
        if decision.allowed() {
            return;
        }
        let now = Instant::now();
        let after = decision.retry_after.unwrap_or(RETRY);
        let at = now.checked_add(after).unwrap_or(now);
        if let Some((_, entry)) = self.entries.get_mut(index) {
            entry.retry_at = entry.retry_at.max(Some(at));
        }
    }

    /// The handler counted one request of the entry at `index`.
    pub(super) fn paid_for(&mut self, index: usize) {
        if let Some((_, entry)) = self.entries.get_mut(index) {
            entry.requests = entry.requests.saturating_sub(1);
        }
    }
}

impl Drop for Replays {
    fn drop(&mut self) {
        let left: Vec<_> = self.entries.drain(..).filter(|(_, e)| e.requests > 0).collect();
        let mut state = self.owed.lock();
        for (id, entry) in left {
            self.owed.put(&mut state, id, entry);
        }
        for bucket in &self.buckets {
            if let Some(holders) = state.in_flight.get_mut(bucket) {
                *holders -= 1;
                if *holders == 0 {
                    state.in_flight.remove(bucket);
                }
            }
        }
        let len = state.entries.len() + state.in_flight.len();
        self.owed.len.store(len, Ordering::Relaxed);
        drop(state);
        self.owed.done.notify_waiters();
    }
}

impl LocalAdmissions {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The identity of `ctx`'s request.
    pub(super) fn id(&self, ctx: &RequestContext) -> u64 {
        let mut hasher = self.keys.build_hasher();
        ctx.rule_set_id().hash(&mut hasher);
        ctx.client_ip().hash(&mut hasher);
        ctx.user_id().hash(&mut hasher);
        ctx.api_key().hash(&mut hasher);
        ctx.method().hash(&mut hasher);
        ctx.routed_path().hash(&mut hasher);
        ctx.attributes().hash(&mut hasher);
        hasher.finish()
    }

    /// Records that `local` admitted `ctx`'s request by `decision`.
    pub(super) fn add(&self, local: &Engine, ctx: &RequestContext, decision: &Decision) {
        let longest = decision
            .bands
            .iter()
            .chain(decision.shadow_bands.iter())
            .map(|b| b.window)
            .max()
            .unwrap_or_default();
        let now = Instant::now();
        let mut kept = ctx.to_builder();
        kept.set_max_wait(None);
        let entry = Entry {
            ctx: kept.build(),
            buckets: local.bucket_ids(ctx, &self.keys),
            requests: 1,
            until: now.checked_add(longest).unwrap_or(now),
            retry_at: None,
        };
        let id = self.id(ctx);
        let mut state = self.lock();
        self.put(&mut state, id, entry);
    }

    /// Adds `entry` to what identity `id` owes.
    pub(super) fn put(&self, state: &mut State, id: u64, entry: Entry) {
        let now = Instant::now();
        if let Some(kept) = state.entries.get_mut(&id).filter(|e| e.until > now) {
            kept.requests = kept.requests.saturating_add(entry.requests).min(MOST_REPLAYS);
            kept.until = kept.until.max(entry.until);
            kept.retry_at = kept.retry_at.max(entry.retry_at);
            return;
        }
        let bytes = size(&entry.ctx);
        if state.entries.len() >= MOST_IDENTITIES || state.bytes + bytes > MOST_BYTES {
            state.purge(now);
            if state.entries.len() >= MOST_IDENTITIES || state.bytes + bytes > MOST_BYTES {
                return;
            }
        }
        let State { entries, by_bucket, .. } = state;
        for bucket in &entry.buckets {
            let ids = by_bucket.entry(*bucket).or_default();
            // A long list (a bucket of everybody's) is not searched at each of its
            // identities: it may list one twice ([`LocalAdmissions::take`] counts it once), until it
            // is twice as long as there are identities, when it is made one of each again.
            if ids.len() <= SEARCHED {
                if !ids.contains(&id) {
                    ids.push(id);
                }
                continue;
            }
            if ids.len() > 2 * entries.len() + SEARCHED {
                ids.retain(|id| entries.contains_key(id));
                ids.sort_unstable();
                ids.dedup();
            }
            ids.push(id);
        }
        state.bytes += bytes;
        if let Some(old) = state.entries.insert(id, entry) {
            state.bytes -= size(&old.ctx);
        }
        self.len
            .store(state.entries.len() + state.in_flight.len(), Ordering::Relaxed);
    }

    /// The requests owed by `ctx`'s identity or by any identity that counted in one of
    /// `ctx`'s buckets, taken to be replayed, their buckets held in flight until the
    /// replay ends; else whether a replay holds one of `ctx`'s buckets. One atomic load
    /// while nothing is owed nor replayed.
    pub(super) fn take(self: &Arc<Self>, local: &Engine, ctx: &RequestContext) -> Taken {
        if self.len.load(Ordering::Relaxed) == 0 {
            return Taken::Nothing;
        }
        let buckets = local.bucket_ids(ctx, &self.keys);
        let own = self.id(ctx);
        let now = Instant::now();
        let mut state = self.lock();
        // Entries whose requests never come back lapse all the same, at most a second late:
        // once none is left, a check is again one atomic load.
        if state.purge_at.is_none_or(|at| at <= now) {
            state.purge(now);
            state.purge_at = now.checked_add(PURGE);
        }
        let mut ids: SmallVec<[u64; 4]> = SmallVec::new();
        ids.push(own);
        for bucket in &buckets {
            if let Some(owing) = state.by_bucket.remove(bucket) {
                ids.extend(owing);
            }
        }
        // Each identity once, in n log n: a bucket of everybody's (a global limit) may list
        // 100,000 of them, and this lock is every request's.
        ids.sort_unstable();
        ids.dedup();
        let mut entries = Vec::new();
        // Refused lately, left owed where they are: found again by these buckets later.
        let mut deferred: SmallVec<[u64; 4]> = SmallVec::new();
        for id in ids {
            let Some(entry) = state.entries.get(&id) else {
                continue;
            };
            if entry.until > now && entry.retry_at.is_some_and(|at| at > now) {
                deferred.push(id);
            } else if let Some(entry) = state.entries.remove(&id) {
                state.bytes -= size(&entry.ctx);
                if entry.until > now {
                    entries.push((id, entry));
                }
            }
        }
        for id in deferred {
            for bucket in &buckets {
                let counted = state.entries.get(&id).is_some_and(|e| e.buckets.contains(bucket));
                if counted {
                    state.by_bucket.entry(*bucket).or_default().push(id);
                }
            }
        }
        let taken = if entries.is_empty() {
            if buckets.iter().any(|b| state.in_flight.contains_key(b)) {
                Taken::Busy
            } else {
                Taken::Nothing
            }
        } else {
            let mut held: SmallVec<[u64; 8]> = SmallVec::new();
            for bucket in entries.iter().flat_map(|(_, e)| e.buckets.iter()) {
                if !held.contains(bucket) {
                    held.push(*bucket);
                    *state.in_flight.entry(*bucket).or_default() += 1;
                }
            }
            Taken::Replay(Replays {
                owed: self.clone(),
                entries,
                buckets: held,
            })
        };
        self.len
            .store(state.entries.len() + state.in_flight.len(), Ordering::Relaxed);
        taken
    }
}
