//! [`RedisLimiter`], the [`RateLimiter`] over Redis.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fluxgate_core::limiter::{AcquireOutcome, AcquireRequest, RateLimiter};
use fluxgate_core::{Algorithm, BoxError, MaybeReady, Rule, RuleError, RuleSet};
use fred::clients::Client;

use crate::band;
use crate::batch::{Batcher, Batching};
use crate::cluster::decide_across_slots;
use crate::connection::Connection;
use crate::deny_cache::DenyCache;
use crate::error::RedisError;
use crate::health::{self, Health};
use crate::in_flight::{Held, InFlight, RunsOut, DEFAULT_CALLS_PER_KEY};
use crate::key;
use crate::protocol::{DecideArgs, Reply};
use crate::request::Keys;
use crate::request::{encode, encode_refund, mark_instants, outcome, Call};
use crate::script::{decided_again, Scripts};
use smallvec::SmallVec;

/// The Redis limiter. Cheap to clone: clones share the connections.
#[derive(Clone)]
pub struct RedisLimiter {
    inner: Arc<Inner>,
}

struct Inner {
    scripts: Arc<Scripts>,
    prefix: String,
    /// Shared by the handles made from one another ([`RedisLimiter::with_batching`],
    /// [`RedisLimiter::with_prefix`]): a reset through one forgets what any remembered.
    denied: Option<Arc<DenyCache>>,
    /// The calls in flight by bucket, shared like the deny cache (see [`InFlight`]).
    in_flight: Arc<InFlight>,
    /// Whether the connections are a cluster's (see [`Inner::deny_cache`]).
    cluster: bool,
    /// With batched decisions: the gathering of the requests (shared by the limiters of
    /// [`RedisLimiter::with_prefix`], whose requests carry their own keys).
    batcher: Option<Arc<Batcher>>,
}

/// How often a denial of a band of a rule set of several rules lets a request through to
/// Redis on a cluster, where refunds across hash slots may free the band before the
/// denial's retry-after (see [`Inner::deny_cache`]): a burst's refusals cost one call per
/// band in this time, and a band a refund freed is found admitting within this time.
const CROSS_SLOT_PROBE: Duration = Duration::from_millis(100);

impl Inner {
    /// The deny cache, for `request`, and how often a denial of its bands lets a request
    /// through to Redis. A request that may wait for the refill is refused only by a denial
    /// that ends later than it may wait (see [`DenyCache::check`]), and its refusals are
    /// remembered as any other's. Without the cache for such requests, each one that found a
    /// waiter's place free was a call of its own, however spent its bucket: one client that
    /// had spent a limit of 5 per hour, on a rule that may wait, sent 3,000 requests at
    /// once, the calls queued past the deadline, and `fail_open` admitted more than a
    /// thousand of them uncounted, and another spent client's requests with them
    /// (`a_spent_client_of_a_waiting_rule_cannot_flood_redis`).
    ///
    /// On a cluster too: without the cache, every refused request of a burst from one
    /// address was a call, thousands queued past the deadline, and `fail_open` admitted
    /// them uncounted (`tests/redis/client_failures.rs`). There the requests of a rule set
    /// of several rules may span hash slots, and one that a slot refuses is refunded in
    /// the slots that admitted it, which frees capacity before time does: a denial of such
    /// a rule set's band, remembered while a request that is then refunded held it full,
    /// would refuse what Redis admits for a whole retry-after. Such a denial lets one
    /// request through every [`CROSS_SLOT_PROBE`], and is forgotten once a band admits. A
    /// rule set of one rule never spans slots: as on a standalone server, only time frees
    /// its capacity.
    fn deny_cache(&self, request: &AcquireRequest) -> Option<(&Arc<DenyCache>, Option<Duration>)> {
        let cache = self.denied.as_ref()?;
        let spans = self.cluster && request.rule_set().rules().len() > 1;
        Some((cache, spans.then_some(CROSS_SLOT_PROBE)))
    }

    /// The deny cache's rejection of `request`, whose calls are `calls`, when a band of it
    /// is known to reject it at `now`.
    fn denied(&self, request: &AcquireRequest, calls: &[Call], now: Instant) -> Option<AcquireOutcome> {
        let outcome = self.deny_cache(request)?.0.check(request, calls, now)?;
        #[cfg(feature = "metrics")]
        metrics::counter!(fluxgate_core::metrics::DENY_CACHE_HITS_TOTAL).increment(1);
        Some(outcome)
    }

    /// One call's decision: in a batch with batching on, in a call of its own otherwise.
    /// Whether it was answered or timed out tells the connections whether Redis still
    /// answers the slot (`Connection::saw`).
    async fn decide(&self, slot: u16, keys: Keys, args: &DecideArgs) -> Result<Reply, RedisError> {
        let result = match &self.batcher {
            Some(batcher) => batcher.decide(slot, keys, args).await,
            None => self.scripts.decide(slot, keys, args).await,
        };
        self.scripts.connection().saw(slot, &result);
        result
    }
}

impl fmt::Debug for RedisLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLimiter")
            .field("prefix", &self.inner.prefix)
            .field("timeout", &self.inner.scripts.connection().timeout())
            .field("script_sha1", &self.script_sha1())
            .field("batching", &self.inner.batcher.as_ref().map(|b| b.batching()))
            .finish_non_exhaustive()
    }
}

impl RedisLimiter {
    /// A limiter running `scripts`, with a deny cache if `deny_cache`, no more than
    /// `calls_per_key` calls of one bucket in flight at once.
    pub(crate) fn new(
        scripts: Scripts,
        prefix: String,
        (deny_cache, calls_per_key): (bool, u64),
        batching: Option<Batching>,
    ) -> Self {
        let cluster = scripts.connection().is_cluster();
        let scripts = Arc::new(scripts);
        Self {
            inner: Arc::new(Inner {
                batcher: batching.map(|b| Arc::new(Batcher::new(scripts.clone(), b))),
                scripts,
                prefix,
                denied: deny_cache.then(|| Arc::new(DenyCache::new())),
                in_flight: Arc::new(InFlight::new(calls_per_key)),
                cluster,
            }),
        }
    }

    /// A limiter over a client the application already connected. The script is loaded
    /// on the first call that finds it missing. The deny cache is on (see
    /// [`RedisLimiterBuilder::deny_cache`](crate::RedisLimiterBuilder::deny_cache)).
    pub fn from_client(client: Client, prefix: impl Into<String>) -> Self {
        Self::new(
            Scripts::new(Connection::client(client)),
            prefix.into(),
            (true, DEFAULT_CALLS_PER_KEY),
            None,
        )
    }

    /// A limiter sharing this one's connections, prefix and deny cache, that decides in
    /// batches ([`Batching`]); with `None`, one call per request. A reset through either
    /// ([`reset_buckets`](Self::reset_buckets), a rule change listener's) forgets the
    /// denials both remembered.
    pub fn with_batching(&self, batching: Option<Batching>) -> Self {
        let scripts = self.inner.scripts.clone();
        Self {
            inner: Arc::new(Inner {
                batcher: batching.map(|b| Arc::new(Batcher::new(scripts.clone(), b))),
                scripts,
                prefix: self.inner.prefix.clone(),
                denied: self.inner.denied.clone(),
                in_flight: self.inner.in_flight.clone(),
                cluster: self.inner.cluster,
            }),
        }
    }

    /// Whether decisions go to Redis in batches ([`Batching`]).
    pub fn is_batching(&self) -> bool {
        self.inner.batcher.is_some()
    }

    /// Whether rejections are remembered and repeated locally (the deny cache). With the
    /// `metrics` feature, each request the cache rejects counts in
    /// `fluxgate_deny_cache_hits_total`.
    pub fn has_deny_cache(&self) -> bool {
        self.inner.denied.is_some()
    }

    /// A limiter sharing this one's connections and deny cache, with another key prefix
    /// (whose keys, and so whose denials, are its own).
    pub fn with_prefix(&self, prefix: impl Into<String>) -> Self {
        Self {
            inner: Arc::new(Inner {
                scripts: self.inner.scripts.clone(),
                prefix: prefix.into(),
                denied: self.inner.denied.clone(),
                in_flight: self.inner.in_flight.clone(),
                cluster: self.inner.cluster,
                batcher: self.inner.batcher.clone(),
            }),
        }
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The connections of the limiter.
    pub(crate) fn connection(&self) -> &Connection {
        self.inner.scripts.connection()
    }

    /// Forgets this instance's remembered denials of the bands whose keys begin with
    /// `start`.
    pub(crate) fn forget_denials(&self, start: &str) {
        if let Some(cache) = &self.inner.denied {
            cache.forget(start);
        }
    }

    /// The SHA-1 of the script, as used with `EVALSHA`.
    pub fn script_sha1(&self) -> &str {
        self.inner.scripts.decide_sha1()
    }

    /// Sends `PING` within the limiter's deadline and reports how long it took; on a
    /// cluster, also the cluster state.
    ///
    /// # Errors
    ///
    /// [`RedisError::Command`] or [`RedisError::Timeout`] when Redis does not answer.
    pub async fn health(&self) -> Result<Health, RedisError> {
        health::check(self.inner.scripts.connection()).await
    }

    /// The memory policy (`maxmemory`, `maxmemory-policy`) of each server the limiter's
    /// keys live on (each primary of a cluster), read with `CONFIG GET maxmemory*` within
    /// the limiter's deadline. [`connect`](crate::RedisLimiterBuilder::connect) reads it
    /// and warns of a Redis that may evict counters; a limiter made
    /// [`from_client`](Self::from_client) can check with this.
    ///
    /// # Errors
    ///
    /// [`RedisError::Command`] when `CONFIG` is refused (an ACL without `+config|get`, a
    /// managed Redis that renames it), or [`RedisError::Timeout`].
    pub async fn memory_policies(&self) -> Result<Vec<crate::MemoryPolicy>, RedisError> {
        let connection = self.inner.scripts.connection();
        crate::memory::read(connection, connection.timeout()).await
    }
}

impl RateLimiter for RedisLimiter {
    fn acquire(&self, request: &AcquireRequest) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        let inner = &self.inner;
        let cluster = inner.scripts.connection().is_cluster();
        let calls = match encode(request, &inner.prefix, cluster) {
            Ok(calls) => calls,
            // A configuration error, not a backend failure (see `RateLimiter::validate`).
            Err(e) => return MaybeReady::ready(Err(e.into())),
        };
        let start = Instant::now();
        if let Some(outcome) = inner.denied(request, &calls, start) {
            return MaybeReady::ready(Ok(outcome));
        }
        // No more calls for a bucket than it could admit at once (see `InFlight`).
        let counted = inner.in_flight.counted(&inner.prefix, request);
        match inner.in_flight.try_take(counted) {
            Ok(held) => Self::call(inner, request.clone(), calls, start, held),
            Err(counted) => {
                let inner = inner.clone();
                let request = request.clone();
                MaybeReady::boxed(async move {
                    let taken = inner
                        .in_flight
                        .wait(
                            counted,
                            || inner.denied(&request, &calls, Instant::now()).map(Ok),
                            // A call it waited for missed its deadline: Redis hangs, and
                            // this request would only wait for its own call to miss it too.
                            || Err(RedisError::Timeout(inner.scripts.connection().timeout()).into()),
                        )
                        .await;
                    match taken {
                        Ok(held) => Self::call(&inner, request, calls, Instant::now(), held).await,
                        Err(answer) => answer,
                    }
                })
            }
        }
    }

    /// Also refuses, on a cluster whose key prefix holds an empty hash tag (`{}`: Redis then
    /// hashes every key whole), a rule of several keys (several bands of an algorithm other
    /// than the token bucket): its keys would lie in several hash slots, and every call
    /// deciding them would fail (`CROSSSLOT`), leaving every request to the failure policy.
    fn validate(&self, set: &RuleSet) -> Result<(), RuleError> {
        let hashed_whole = self.connection().is_cluster() && key::hashes_whole(&self.inner.prefix);
        for rule in set.rules() {
            for band in rule.bands().iter() {
                band::check(set.id(), rule, band)?;
            }
            let keys = if rule.algorithm() == Algorithm::TokenBucket {
                1
            } else {
                rule.bands().len()
            };
            if let (true, Some(band)) = (hashed_whole && keys > 1, rule.bands().get(1)) {
                return Err(RuleError::Unsupported {
                    backend: "redis",
                    rule_set: set.id().to_string(),
                    rule: rule.id().to_string(),
                    band: band.name().to_string(),
                    message: format!(
                        "the key prefix `{}` holds an empty hash tag (`{{}}`), so Redis Cluster hashes each key \
                         whole and this rule's {keys} band keys would lie in different hash slots; use a prefix \
                         without `{{}}`, or one band per rule",
                        self.inner.prefix
                    ),
                });
            }
        }
        Ok(())
    }

    fn backend_name(&self) -> &'static str {
        "redis"
    }

    /// Redis takes a waiting request's place in every algorithm, within the scripts' exact
    /// range, and on a cluster in a rule set of one rule (see `docs/acquisition.md`, "Wait
    /// for refill").
    fn check_wait(&self, set: &RuleSet, rule: &Rule, max_wait: Duration) -> Result<(), RuleError> {
        band::check_wait(set, rule, max_wait, self.connection().is_cluster())
    }

    fn gives_back(&self) -> bool {
        true
    }

    /// Gives back with the refund script (each algorithm's refund, in `lua/`), one call
    /// per hash slot, within the limiter's deadline.
    fn give_back(&self, request: &AcquireRequest, decided_unix_nanos: u64) -> MaybeReady<Result<(), BoxError>> {
        self.refund(request, decided_unix_nanos, &[])
    }

    /// As [`give_back`](Self::give_back), each token- or leaky-bucket band only while it
    /// holds the state its mark records (the refund script compares it).
    fn give_back_place(
        &self,
        request: &AcquireRequest,
        at_unix_nanos: u64,
        marks: &[u128],
    ) -> MaybeReady<Result<(), BoxError>> {
        self.refund(request, at_unix_nanos, marks)
    }

    /// The deny cache's refusal of `request`, if it knows one, a denial whose probe is due
    /// included (the request cannot reach Redis to probe it).
    fn refused_locally(&self, request: &AcquireRequest) -> Option<AcquireOutcome> {
        let cluster = self.inner.scripts.connection().is_cluster();
        let calls = encode(request, &self.inner.prefix, cluster).ok()?;
        let cache = self.inner.deny_cache(request)?.0;
        let outcome = cache.check_without_probing(request, &calls, Instant::now())?;
        #[cfg(feature = "metrics")]
        metrics::counter!(fluxgate_core::metrics::DENY_CACHE_HITS_TOTAL).increment(1);
        Some(outcome)
    }
}

/// Whether `error` is a call's missed deadline.
fn timed_out(error: &(dyn std::error::Error + 'static)) -> bool {
    matches!(error.downcast_ref::<RedisError>(), Some(RedisError::Timeout(_)))
}

impl RedisLimiter {
    /// Decides `request` by its `calls`, made from `start`, holding their places among
    /// their buckets' calls in flight.
    fn call(
        inner: &Arc<Inner>,
        request: AcquireRequest,
        mut calls: SmallVec<[Call; 1]>,
        start: Instant,
        mut held: Held,
    ) -> MaybeReady<Result<AcquireOutcome, BoxError>> {
        let cluster = inner.scripts.connection().is_cluster();
        let remembers = inner.deny_cache(&request).map(|(_, probe)| probe);
        let inner = inner.clone();
        let deadline = start + inner.scripts.connection().timeout();
        // One call (always so on a standalone Redis): nothing to refund.
        if calls.len() == 1 {
            if let Some(Call {
                slot,
                keys,
                args,
                bands,
            }) = calls.pop()
            {
                // The request in a box of its own: with it, the decision's future would
                // outgrow the allocator's cache of small blocks (1,312 bytes against
                // about 820), and every request would pay for a large allocation.
                let request = Box::new(request);
                return MaybeReady::boxed(RunsOut::new(async move {
                    held.sent(deadline);
                    let reply = match inner.decide(slot, keys, &args).await {
                        // The keys went to Redis: made again from the request (one call, as
                        // the first time), then decided within the rest of the deadline. A
                        // future of its own, rarely made: this one, which every request
                        // allocates, does not hold it.
                        Err(e) if decided_again(&e, cluster) => {
                            Box::pin(async {
                                let remaining = inner.scripts.connection().timeout().saturating_sub(start.elapsed());
                                let mut calls = encode(&request, &inner.prefix, cluster)?;
                                let Some(Call { slot, keys, args, .. }) = calls.pop() else {
                                    return Err(BoxError::from(e));
                                };
                                drop(calls);
                                Ok(inner.scripts.decide_again(slot, keys, &args, remaining, &e).await?)
                            })
                            .await
                        }
                        result => result.map_err(BoxError::from),
                    };
                    // Answered or failed, the call is no longer out (one that timed out
                    // may still run, but its deadline has passed).
                    held.returned(reply.as_ref().err().is_some_and(|e| timed_out(&**e)));
                    let mut reply = reply?;
                    let mut marks = std::mem::take(&mut reply.marks);
                    mark_instants(&bands, &mut marks, reply.now_us);
                    let outcome = outcome(
                        &request,
                        (reply.allowed, reply.shadow_allowed),
                        (reply.now_us, reply.admitted_after_us),
                        marks,
                        reply.bands(),
                    );
                    if let (Some(cache), Some(probe)) = (&inner.denied, remembers) {
                        cache.remember(&request, &inner.prefix, &bands, &outcome, start, probe);
                    }
                    Ok(outcome)
                }));
            }
        }
        let calls = calls.into_vec();
        MaybeReady::boxed(async move {
            let scripts = inner.scripts.clone();
            // The deny cache remembers the bands that refused.
            let decided = move |request: &AcquireRequest, calls: &[Call], outcome: &AcquireOutcome| {
                if let (Some(denied), Some(probe)) = (&inner.denied, remembers) {
                    for call in calls {
                        denied.remember(request, &inner.prefix, &call.bands, outcome, start, probe);
                    }
                }
            };
            // Spawned at the first poll: once a call has gone out, the refunds it may need
            // happen whether or not this future is still awaited.
            let task = tokio::spawn(async move {
                held.sent(deadline);
                let decided = decide_across_slots(scripts, calls, request, decided).await;
                held.returned(matches!(decided, Err(RedisError::Timeout(_))));
                decided
            });
            match task.await {
                Ok(result) => Ok(result?),
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(_) => Err(RedisError::Interrupted.into()),
            }
        })
    }
}

impl RedisLimiter {
    /// Gives back what `request` took at `at_unix_nanos`, with `marks` (see
    /// [`encode_refund`]).
    fn refund(&self, request: &AcquireRequest, at_unix_nanos: u64, marks: &[u128]) -> MaybeReady<Result<(), BoxError>> {
        let inner = &self.inner;
        let cluster = inner.scripts.connection().is_cluster();
        let decided_us = i64::try_from(at_unix_nanos / 1_000).unwrap_or(i64::MAX);
        let calls = match encode_refund(request, &inner.prefix, cluster, decided_us, marks) {
            Ok(calls) => calls,
            Err(e) => return MaybeReady::ready(Err(e.into())),
        };
        let scripts = inner.scripts.clone();
        // The bands given back to: a denial this instance remembers of them, of this cost,
        // may end earlier now (a waiter's place), so it is forgotten once the permits are
        // back, and the next request of the same cost asks Redis. (A lease gives back what
        // is left of it, a cost its denials seldom have: they may outlive it, as a refund
        // across slots may.)
        let given_back: Vec<String> = match (&inner.denied, encode(request, &inner.prefix, cluster)) {
            (Some(_), Ok(decided)) => decided
                .iter()
                .flat_map(|call| {
                    call.bands
                        .iter()
                        .filter_map(|band| band.deny_key(call.keys.get(band.key)?))
                })
                .collect(),
            _ => Vec::new(),
        };
        let denied = inner.denied.clone();
        MaybeReady::boxed(async move {
            let pending = calls
                .into_iter()
                .filter(|(keys, _)| !keys.is_empty())
                .map(|(keys, args)| scripts.refund(keys, args));
            for result in futures_util::future::join_all(pending).await {
                result?;
            }
            if let Some(cache) = denied {
                cache.forget_keys(&given_back);
            }
            Ok(())
        })
    }
}
