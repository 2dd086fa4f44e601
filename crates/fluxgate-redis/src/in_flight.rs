//! Calls in flight per bucket: no more calls for one bucket go out at once than its
//! rule could admit.
//!
//! A burst of one client's requests, sent at once, made one call each before the first
//! refusal came back (the deny cache answers only refusals it has heard). Thousands of
//! calls for one key queued for the pool's connections, the later ones missed the
//! deadline, and `fail_open` admitted them uncounted: a per-IP rule of 5 admitted 2,023
//! of 6,000 such requests on a standalone Redis, and about 3,500 on a cluster.
//!
//! Of the calls in flight for one bucket, no more than its capacity can be admitted
//! (less, time aside, what it has already spent): a call beyond that only adds to the
//! queue. So a request whose bucket has `capacity / permits` calls in flight waits here
//! until one of them returns, asks the deny cache again (the call that returned may have
//! been refused), and then makes its call, within a deadline of its own. A burst of one
//! key then costs Redis as many calls as the key's limit, and the rest are refused by the
//! deny cache. Requests of other keys never wait for it. Nor does a bucket let out more
//! than a limiter's `calls_in_flight_per_key` at once (64 by default), whatever its quota:
//! a burst within a large quota, admissible whole, queued past the deadline alike.

use std::collections::HashMap;
use std::future::Future;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use fluxgate_core::limiter::AcquireRequest;
use fluxgate_core::Mode;
use smallvec::SmallVec;
use tokio::sync::Notify;

/// The most calls of one bucket in flight at once by default, whatever its rule admits
/// ([`RedisLimiterBuilder::calls_in_flight_per_key`](crate::RedisLimiterBuilder::calls_in_flight_per_key)).
/// A burst of a key of a large quota (100,000 per hour) was admissible whole: every
/// request was a call, and 641 to 2,966 of 6,000 sent at once missed the deadline and were
/// admitted without being counted, a free share of the quota at each burst (1,024 at once
/// still let 1,369 to 2,966 through in a test build, 256 up to 1,364, 128 one; 64 none).
/// A key busier than this many calls per round trip (64,000 a second at 1 ms) queues here
/// rather than in the connections.
pub(crate) const DEFAULT_CALLS_PER_KEY: u64 = 64;

/// The number of shards of the table (a power of two).
const SHARDS: usize = 64;

/// How many windows of `window`, or parts of one, a wait of `wait` spans: 0 for no wait.
fn windows_spanned(wait: Duration, window: Duration) -> u64 {
    if wait.is_zero() || window.is_zero() {
        return 0;
    }
    let (wait, window) = (wait.as_nanos(), window.as_nanos());
    u64::try_from(wait.div_ceil(window)).unwrap_or(u64::MAX)
}

/// The calls in flight, by bucket.
pub(crate) struct InFlight {
    shards: Box<[Mutex<Table>]>,
    /// The most calls of one bucket in flight at once.
    most_at_once: u64,
    /// Keyed at random per limiter: a client choosing its key values cannot make two
    /// buckets share a count.
    hasher: RandomState,
}

type Table = HashMap<u64, Entry, BuildHasherDefault<Identity>>;

/// A bucket's calls in flight and the requests waiting for one to return. An entry is
/// dropped when both are none.
#[derive(Default)]
struct Entry {
    calls: u64,
    waiting: u32,
    /// Wakes a waiting request when a call returns.
    returned: Option<Arc<Notify>>,
    /// The missed deadlines since a call of the bucket last returned: of calls sent each
    /// after the one before was seen to miss its deadline (calls out together through one
    /// stall count once).
    timeouts_in_a_row: u32,
    /// When the last missed deadline counted in `timeouts_in_a_row` was seen.
    last_missed: Option<Instant>,
    /// How many times the requests waiting were failed ([`TIMEOUTS_TO_FAIL`]).
    failed: u64,
}

/// After this many calls of a bucket in a row missed their deadline, each sent after the
/// one before was seen to miss it, Redis is taken to hang and the requests waiting for the
/// bucket fail at once (the failure policy answers them): each would otherwise wait for a
/// call to miss its deadline, one after another (400 requests of a bucket letting out 10
/// calls at once waited up to 2 s for a deadline of 50 ms). One missed deadline alone (a
/// stall of the connection, an overload) does not: every request waiting behind a burst's
/// calls then failed, and `fail_open` admitted the whole burst uncounted. Nor do the calls
/// of a bucket out together through one stall, which miss their deadline together: counted
/// one by one, the 5 calls of a per-IP rule of 5 through a stall of 80 ms failed the rest
/// of a first burst (1,998 of 2,000 admitted uncounted). Only a call that Redis answered
/// starts the count again, not a place given back by a call that never went out. As the
/// circuit breaker's default threshold.
const TIMEOUTS_TO_FAIL: u32 = 3;

/// How a call that held places among its buckets' calls in flight ended, for the count of
/// missed deadlines ([`TIMEOUTS_TO_FAIL`]).
#[derive(Clone, Copy)]
enum Ended {
    /// Redis answered it, or failed it before its deadline: the count starts again.
    Answered,
    /// It missed its deadline; it was sent at this instant.
    Missed(Instant),
    /// It never went out (a place taken and given back at once), or how it ended is
    /// unknown: the count is left as it is.
    Unknown,
}

/// The buckets of a request that a call takes a place among the calls in flight of: the
/// hash of each and how many calls it lets out at once.
pub(crate) struct Counted(SmallVec<[(u64, u64); 2]>);

impl Counted {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The places a call holds among its buckets' calls in flight, given back when it is
/// dropped: at once when the call has returned ([`Held::returned`]) or never went out, or
/// else when its deadline has passed, since a call dropped while out still runs in Redis
/// (a decision abandoned by its caller runs to its end instead, [`RunsOut`], unless the
/// runtime is shutting down).
pub(crate) struct Held {
    table: Option<Arc<InFlight>>,
    counted: Counted,
    out_until: Option<Instant>,
    /// When the call went out.
    sent_at: Option<Instant>,
    /// How the call ended.
    ended: Ended,
}

impl Held {
    /// Nothing held.
    fn none() -> Self {
        Self {
            table: None,
            counted: Counted(SmallVec::new()),
            out_until: None,
            sent_at: None,
            ended: Ended::Unknown,
        }
    }

    /// The call went out and may run until `deadline`.
    pub(crate) fn sent(&mut self, deadline: Instant) {
        self.out_until = Some(deadline);
        self.sent_at = Some(Instant::now());
    }

    /// The call returned, or missed its deadline (`timed_out`): its places are given back
    /// when this is dropped, and after [`TIMEOUTS_TO_FAIL`] missed deadlines in a row the
    /// requests waiting for them fail at once.
    pub(crate) fn returned(&mut self, timed_out: bool) {
        self.out_until = None;
        self.ended = if timed_out {
            Ended::Missed(self.sent_at.unwrap_or_else(Instant::now))
        } else {
            Ended::Answered
        };
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let Some(table) = self.table.take() else {
            return;
        };
        let counted = Counted(std::mem::take(&mut self.counted.0));
        if let (Some(until), Ok(runtime)) = (self.out_until, tokio::runtime::Handle::try_current()) {
            if until > Instant::now() {
                // Given back when the deadline has passed, or when the task is dropped
                // (the runtime shutting down).
                let held = Held {
                    table: Some(table),
                    counted,
                    out_until: None,
                    sent_at: None,
                    ended: Ended::Unknown,
                };
                runtime.spawn(async move {
                    tokio::time::sleep_until(until.into()).await;
                    drop(held);
                });
                return;
            }
        }
        table.give_back(&counted, self.ended);
    }
}

/// A call's decision that runs to its end even when its caller is gone (a request dropped
/// once its call went out, as an HTTP/2 client resetting its stream drops it): its places
/// among the calls in flight are then given back when Redis answers, and the answer
/// reaches the deny cache. Held until the deadline instead, the places of calls a client
/// abandoned as soon as they went out delayed the other clients of a shared bucket (the
/// slowest decision of a global rule's clients went from 3-4 ms to 32-41 ms), and the
/// refusals taught the deny cache nothing.
pub(crate) struct RunsOut<T: Send + 'static> {
    decision: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
    /// Whether the decision was polled: its call may be out.
    started: bool,
}

impl<T: Send + 'static> RunsOut<T> {
    pub(crate) fn new(decision: impl Future<Output = T> + Send + 'static) -> Self {
        Self {
            decision: Some(Box::pin(decision)),
            started: false,
        }
    }
}

impl<T: Send + 'static> Future for RunsOut<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        self.started = true;
        let Some(decision) = self.decision.as_mut() else {
            return Poll::Pending; // polled again after its answer
        };
        let answer = ready!(decision.as_mut().poll(cx));
        self.decision = None;
        Poll::Ready(answer)
    }
}

impl<T: Send + 'static> Drop for RunsOut<T> {
    fn drop(&mut self) {
        if let (true, Some(decision)) = (self.started, self.decision.take()) {
            // Without a runtime (it is shutting down), the decision's places are given
            // back when its deadline has passed (`Held`).
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    let _answer = decision.await;
                });
            }
        }
    }
}

impl InFlight {
    /// No more than `most_at_once` calls of one bucket in flight at once (at least 1).
    pub(crate) fn new(most_at_once: u64) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Table::default())).collect(),
            most_at_once: most_at_once.max(1),
            hasher: RandomState::new(),
        }
    }

    fn shard(&self, hash: u64) -> MutexGuard<'_, Table> {
        // The count is consistent under the lock whatever panicked while it was held.
        self.shards[(hash >> 58) as usize % SHARDS]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The buckets of `request` (its keys named with `prefix`) whose calls in flight are
    /// counted: those its rules enforce, each letting out as many calls at once as it
    /// admits, and the table's most at once at most.
    ///
    /// A rule that lets requests wait for the refill (`on_limit.wait`) admits more within
    /// its longest wait: each band up to its capacity once more for every window, or part
    /// of one, that the wait spans (a fixed window that ends within the wait admits a second
    /// capacity). Its calls are counted by that bound, the same for every request of the
    /// bucket whether it waits or not (one count, one bound: a place freed is seen by every
    /// request that waits for one). Requests that wait were not counted before: one client
    /// that had spent its limit kept as many calls of its key out at once as the rule's
    /// `max_waiters` allowed, past the deadline (`a_spent_client_of_a_waiting_rule_cannot_flood_redis`).
    pub(crate) fn counted(&self, prefix: &str, request: &AcquireRequest) -> Counted {
        let mut counted = SmallVec::new();
        for bucket in request.buckets() {
            if bucket.rule.mode() == Mode::Shadow {
                continue;
            }
            // The rule's cost, not the call's: a lease's call takes more permits than its
            // request, and every call of a bucket must count its places alike, or a place
            // that one frees goes unseen by a request that waits with another count.
            let permits = bucket.rule.permits().max(1);
            let wait = bucket.rule.wait().map_or(Duration::ZERO, |policy| policy.max_wait());
            let at_once = bucket
                .rule
                .bands()
                .iter()
                .map(|band| {
                    band.capacity()
                        .saturating_mul(windows_spanned(wait, band.window()).saturating_add(1))
                        / permits
                })
                .min()
                .unwrap_or(self.most_at_once)
                .clamp(1, self.most_at_once);
            let mut hasher = self.hasher.build_hasher();
            for part in [prefix, bucket.rule_set.id(), bucket.rule.id(), bucket.key] {
                hasher.write(part.as_bytes());
                hasher.write_u8(0xff);
            }
            counted.push((hasher.finish(), at_once));
        }
        Counted(counted)
    }

    /// Takes a place among the calls in flight of every bucket of `counted`, or none: the
    /// first bucket that has as many calls in flight as it lets out at once (its hash and
    /// that number) otherwise.
    fn take(self: &Arc<Self>, counted: Counted) -> Result<Held, (Counted, (u64, u64))> {
        if counted.is_empty() {
            return Ok(Held::none());
        }
        for (taken, &(hash, at_once)) in counted.0.iter().enumerate() {
            let mut shard = self.shard(hash);
            let entry = shard.entry(hash).or_default();
            if entry.calls >= at_once {
                drop(shard);
                self.give_back(&Counted(counted.0[..taken].iter().copied().collect()), Ended::Unknown);
                return Err((counted, (hash, at_once)));
            }
            entry.calls += 1;
        }
        Ok(Held {
            table: Some(self.clone()),
            counted,
            out_until: None,
            sent_at: None,
            ended: Ended::Unknown,
        })
    }

    /// Gives back one place of each bucket of `counted`, waking a request that waits for
    /// one; or, for a call that missed its deadline ([`Ended::Missed`]) once
    /// [`TIMEOUTS_TO_FAIL`] did in a row, every request waiting, to fail.
    fn give_back(&self, counted: &Counted, ended: Ended) {
        for &(hash, at_once) in &counted.0 {
            let mut shard = self.shard(hash);
            if let Some(entry) = shard.get_mut(&hash) {
                entry.calls = entry.calls.saturating_sub(1);
                match ended {
                    Ended::Answered => {
                        entry.timeouts_in_a_row = 0;
                        entry.last_missed = None;
                    }
                    // A call sent before the last missed deadline was seen was out through
                    // the same stall: it counts with that one.
                    Ended::Missed(sent) => {
                        if entry.last_missed.is_none_or(|seen| sent >= seen) {
                            entry.timeouts_in_a_row = entry.timeouts_in_a_row.saturating_add(1);
                            entry.last_missed = Some(Instant::now());
                        }
                    }
                    Ended::Unknown => {}
                }
                let missed = matches!(ended, Ended::Missed(_));
                if missed && entry.timeouts_in_a_row >= TIMEOUTS_TO_FAIL && entry.waiting > 0 {
                    entry.failed = entry.failed.wrapping_add(1);
                    if let Some(returned) = &entry.returned {
                        returned.notify_waiters();
                    }
                }
                if entry.waiting > 0 && entry.calls < at_once {
                    if let Some(returned) = &entry.returned {
                        returned.notify_one();
                    }
                } else if entry.calls == 0 && entry.waiting == 0 {
                    shard.remove(&hash);
                }
            }
        }
    }

    /// Takes a place among the calls in flight of every bucket of `counted` when each has
    /// one free now; `Err` with `counted` otherwise, to [`wait`](Self::wait) for.
    pub(crate) fn try_take(self: &Arc<Self>, counted: Counted) -> Result<Held, Counted> {
        self.take(counted).map_err(|(counted, _)| counted)
    }

    /// Takes the places of `counted`, waiting for calls in flight to return while a
    /// bucket has as many as it lets out at once. After each wait, `answered` may answer
    /// the request without a call (the deny cache, which the call that returned may have
    /// taught); that answer is returned instead. When the bucket's calls missed
    /// [`TIMEOUTS_TO_FAIL`] deadlines in a row meanwhile, the answer is `failed`'s.
    pub(crate) async fn wait<T>(
        self: &Arc<Self>,
        counted: Counted,
        mut answered: impl FnMut() -> Option<T>,
        failed: impl FnOnce() -> T,
    ) -> Result<Held, T> {
        let (mut counted, mut full) = match self.take(counted) {
            Ok(held) => return Ok(held),
            Err(full) => full,
        };
        loop {
            let waiting = Waiting::new(self, full);
            let notified = waiting.returned.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // A call may have returned since the last try.
            match self.take(counted) {
                Ok(held) => return Ok(held),
                Err(again) => (counted, full) = again,
            }
            if full.0 != waiting.hash {
                continue; // another bucket is full now: wait for that one
            }
            notified.await;
            if let Some(answer) = answered() {
                return Err(answer);
            }
            if waiting.saw_a_timeout() {
                return Err(failed());
            }
            match self.take(counted) {
                Ok(held) => return Ok(held),
                Err(again) => (counted, full) = again,
            }
        }
    }
}

/// A request waiting for a call of one bucket to return: counted in the bucket's entry,
/// so that the entry and its `Notify` stay while it waits.
struct Waiting<'a> {
    table: &'a InFlight,
    hash: u64,
    at_once: u64,
    returned: Arc<Notify>,
    /// How many times the bucket's waiting requests were failed when the wait began.
    failed: u64,
}

impl<'a> Waiting<'a> {
    fn new(table: &'a InFlight, (hash, at_once): (u64, u64)) -> Self {
        let mut shard = table.shard(hash);
        let entry = shard.entry(hash).or_default();
        entry.waiting += 1;
        let returned = entry.returned.get_or_insert_with(Default::default).clone();
        Self {
            table,
            hash,
            at_once,
            returned,
            failed: entry.failed,
        }
    }

    /// Whether the bucket's calls missed [`TIMEOUTS_TO_FAIL`] deadlines in a row since the
    /// wait began.
    fn saw_a_timeout(&self) -> bool {
        let shard = self.table.shard(self.hash);
        shard.get(&self.hash).is_some_and(|entry| entry.failed != self.failed)
    }
}

impl Drop for Waiting<'_> {
    /// Stops waiting. While a place is free, the next waiting request is woken: the wake
    /// this one took may have been for that place (it was answered without a call, or its
    /// future dropped), and no request may wait for a place no call holds.
    fn drop(&mut self) {
        let mut shard = self.table.shard(self.hash);
        if let Some(entry) = shard.get_mut(&self.hash) {
            entry.waiting = entry.waiting.saturating_sub(1);
            if entry.waiting > 0 && entry.calls < self.at_once {
                self.returned.notify_one();
            } else if entry.calls == 0 && entry.waiting == 0 {
                shard.remove(&self.hash);
            }
        }
    }
}

/// The table's keys are keyed hashes already.
#[derive(Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use fluxgate_core::{RuleSet, RuleSets, Text};

    use super::*;

    const RULES: &str = r"
rule_sets:
  - id: api
    rules:
      - id: per-ip
        bands: [{ capacity: 7, window: 1h }, { capacity: 2, window: 1s }]
      - id: everyone
        scope: global
        bands: [{ capacity: 1000000, window: 1s }]
      - id: watched
        mode: shadow
        bands: [{ capacity: 1, window: 1s }]
";

    /// The rule set `api` of `yaml`.
    fn api(yaml: &str) -> Arc<RuleSet> {
        let sets = RuleSets::from_yaml_str(yaml).expect("valid rules");
        sets.get("api").expect("defined").clone()
    }

    /// A request of `set`, of its buckets `buckets` (each a rule's index and a key).
    fn request_in(set: &Arc<RuleSet>, buckets: &[(usize, &str)]) -> AcquireRequest {
        let mut request = AcquireRequest::new(set.clone());
        for &(rule, key) in buckets {
            request.push(rule, Text::from(key));
        }
        request
    }

    /// A request of `client` under the rules above, of the buckets `rules` (by index).
    fn request(client: &str, rules: &[usize]) -> AcquireRequest {
        let buckets: Vec<_> = rules.iter().map(|&rule| (rule, client)).collect();
        request_in(&api(RULES), &buckets)
    }

    fn table() -> Arc<InFlight> {
        Arc::new(InFlight::new(DEFAULT_CALLS_PER_KEY))
    }

    /// The bucket of client `ip=a`'s per-IP rule (2 calls at once), under the prefix `p`.
    fn ip_a(table: &InFlight) -> Counted {
        table.counted("p", &request("ip=a", &[0]))
    }

    /// `n` places of [`ip_a`]'s bucket, all free.
    fn places(table: &Arc<InFlight>, n: usize) -> Vec<Held> {
        (0..n)
            .map(|_| table.try_take(ip_a(table)).ok())
            .collect::<Option<_>>()
            .expect("free places")
    }

    fn entries(table: &InFlight) -> usize {
        table.shards.iter().map(|s| s.lock().map_or(0, |s| s.len())).sum()
    }

    /// A bucket lets out as many calls at once as its smallest band admits, and the
    /// table's most at once at most; the shadow bucket is not counted.
    #[test]
    fn a_bucket_lets_out_as_many_calls_as_it_admits_at_once() {
        let table = table();
        let counted = table.counted("p", &request("ip=a", &[0, 1, 2]));
        let at_once: Vec<u64> = counted.0.iter().map(|(_, at_once)| *at_once).collect();
        assert_eq!(at_once, [2, DEFAULT_CALLS_PER_KEY], "the per-IP and the global bucket");
        let first = table.try_take(ip_a(&table)).ok();
        let second = table.try_take(ip_a(&table)).ok();
        assert!(first.is_some() && second.is_some());
        assert!(table.try_take(ip_a(&table)).is_err());
        // Another key, another prefix: counts of their own.
        assert!(table.try_take(table.counted("p", &request("ip=b", &[0]))).is_ok());
        assert!(table.try_take(table.counted("q", &request("ip=a", &[0]))).is_ok());
        drop(first);
        let third = table.try_take(ip_a(&table)).ok();
        assert!(third.is_some(), "a call returned: its place is free");
        drop((second, third));
        assert_eq!(entries(&table), 0, "nothing in flight, nothing kept");
    }

    /// A request of a bucket that has a place free takes none of another bucket's when one
    /// of its buckets is full: all its places or none.
    #[test]
    fn a_request_takes_the_places_of_all_its_buckets_or_none() {
        let set = api(
            "rule_sets:\n  - id: api\n    rules:\n      - id: a\n        bands: [{ capacity: 1, window: 1s }]\n      - id: b\n        bands: [{ capacity: 1, window: 1s }]\n",
        );
        let both = request_in(&set, &[(0, "ip=a"), (1, "ip=a")]);
        let second_only = request_in(&set, &[(1, "ip=a")]);
        let table = table();
        let held = table.try_take(table.counted("p", &second_only)).ok();
        assert!(held.is_some());
        assert!(table.try_take(table.counted("p", &both)).is_err());
        let first_only = request_in(&set, &[(0, "ip=a")]);
        assert!(
            table.try_take(table.counted("p", &first_only)).is_ok(),
            "the refused request gave back the place it had taken"
        );
    }

    /// A waiting request goes when a call of its bucket returns; one answered without a
    /// call (the deny cache) passes the place on, so that no request waits for a place no
    /// call holds.
    #[tokio::test]
    async fn waiting_requests_go_as_calls_return_or_are_answered() {
        let table = table();
        let held: Vec<Held> = places(&table, 2);
        let refused = Arc::new(AtomicBool::new(false));
        let waiters: Vec<_> = (0..5)
            .map(|_| {
                let (table, refused) = (table.clone(), refused.clone());
                tokio::spawn(async move {
                    let counted = ip_a(&table);
                    table
                        .wait(counted, || refused.load(Ordering::SeqCst).then_some(()), || ())
                        .await
                        .is_ok()
                })
            })
            .collect();
        tokio::task::yield_now().await;
        assert!(waiters.iter().all(|w| !w.is_finished()), "both places are taken");
        // The deny cache learns the refusal; the call that taught it returns.
        refused.store(true, Ordering::SeqCst);
        drop(held);
        let mut took = 0;
        for waiter in waiters {
            took += usize::from(
                tokio::time::timeout(Duration::from_secs(5), waiter)
                    .await
                    .expect("answered")
                    .expect("no panic"),
            );
        }
        // Each woken request asked the deny cache first: none took a place.
        assert_eq!(took, 0);
        assert_eq!(entries(&table), 0);
    }

    /// Woken by a returning call, waiting requests take the places as they free, no more
    /// at once than the bucket admits.
    #[tokio::test]
    async fn waiting_requests_take_the_places_that_free() {
        let table = table();
        let first = table.try_take(ip_a(&table)).ok();
        let second = table.try_take(ip_a(&table)).ok();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for n in 0..4 {
            let (table, tx) = (table.clone(), tx.clone());
            tokio::spawn(async move {
                let counted = ip_a(&table);
                if let Ok(held) = table.wait(counted, || None::<()>, || ()).await {
                    let _ = tx.send((n, held));
                }
            });
        }
        tokio::task::yield_now().await;
        assert!(rx.try_recv().is_err());
        drop(first);
        let (_, a) = rx.recv().await.expect("one took the freed place");
        tokio::task::yield_now().await;
        assert!(rx.try_recv().is_err(), "two calls in flight: the others wait");
        drop((second, a));
        let (_, b) = rx.recv().await.expect("a second");
        let (_, c) = rx.recv().await.expect("a third");
        tokio::task::yield_now().await;
        assert!(rx.try_recv().is_err());
        drop((b, c));
        assert!(rx.recv().await.is_some(), "the last");
    }

    /// A call whose caller dropped it still goes to Redis: its place is given back when its
    /// deadline has passed, not when it is dropped.
    #[tokio::test(start_paused = true)]
    async fn a_call_abandoned_keeps_its_place_until_its_deadline() {
        let table = table();
        let mut abandoned = table.try_take(ip_a(&table)).ok().expect("a place");
        abandoned.sent(tokio::time::Instant::now().into_std() + Duration::from_millis(50));
        let returned = table.try_take(ip_a(&table)).ok();
        drop(abandoned);
        assert!(table.try_take(ip_a(&table)).is_err(), "both places are out");
        tokio::time::sleep(Duration::from_millis(49)).await;
        assert!(table.try_take(ip_a(&table)).is_err());
        tokio::time::sleep(Duration::from_millis(2)).await;
        tokio::task::yield_now().await;
        assert!(
            table.try_take(ip_a(&table)).is_ok(),
            "the abandoned call's deadline passed"
        );
        drop(returned);
    }

    /// Calls of a bucket that miss their deadline [`TIMEOUTS_TO_FAIL`] times in a row fail
    /// the requests waiting for it at once: while Redis hangs, each would otherwise wait
    /// for a call to miss its deadline, one after another (400 requests of a bucket letting
    /// out 10 calls at once waited up to 2 s for a deadline of 50 ms). A missed deadline
    /// fewer fails none of them: one stalled call failed every request waiting behind a
    /// burst, all of which `fail_open` then admitted uncounted.
    #[tokio::test(start_paused = true)]
    async fn calls_that_miss_their_deadline_in_a_row_fail_the_requests_waiting() {
        let table = table();
        let mut out: Vec<Held> = places(&table, 2);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..6 {
            let (table, tx) = (table.clone(), tx.clone());
            tokio::spawn(async move {
                let counted = ip_a(&table);
                let _ = tx.send(table.wait(counted, || None::<()>, || ()).await);
            });
        }
        tokio::task::yield_now().await;
        let time_out = |mut held: Held| {
            held.returned(true);
            drop(held);
        };
        // Two calls miss their deadline: a waiting request takes each place, none fails.
        for _ in 0..2 {
            time_out(out.remove(0));
            let took = tokio::time::timeout(Duration::from_secs(1), rx.recv()).await;
            let held = took.expect("woken").expect("a request").expect("it took the place");
            out.push(held);
        }
        // A third in a row: the four still waiting fail at once.
        time_out(out.remove(0));
        for _ in 0..4 {
            let answer = tokio::time::timeout(Duration::from_millis(1), rx.recv())
                .await
                .expect("answered at once")
                .expect("a request");
            assert!(answer.is_err(), "failed with the calls");
        }
        // A call that returns starts the count again.
        let mut returned = out.remove(0);
        returned.returned(false);
        drop(returned);
        assert_eq!(entries(&table), 0, "nothing in flight, nothing kept");
    }

    /// One stall of Redis of about one deadline, while a bucket that lets out 5 calls at
    /// once has all 5 out, fails none of the requests waiting for it: its 5 calls miss their
    /// deadline at once, which is one missed deadline in time, not three. Counted call by
    /// call, the third of them failed all 100 requests waiting, and `fail_open` admitted
    /// them uncounted. The calls of the requests that then take the places, sent
    /// after the stall began, count as the next missed deadline if they miss theirs too.
    #[tokio::test(start_paused = true)]
    async fn calls_that_miss_their_deadline_in_one_stall_fail_no_waiting_request() {
        let set = api(
            "rule_sets:\n  - id: api\n    rules:\n      - id: per-ip\n        bands: [{ capacity: 5, window: 1h }]\n",
        );
        let of = move || request_in(&set, &[(0, "ip=a")]);
        let table = table();
        let deadline = || tokio::time::Instant::now().into_std() + Duration::from_millis(50);
        let mut stalled: Vec<Held> = (0..5)
            .map(|_| table.try_take(table.counted("p", &of())).ok())
            .collect::<Option<_>>()
            .expect("five places");
        stalled.iter_mut().for_each(|held| held.sent(deadline()));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..100 {
            let (table, tx, request) = (table.clone(), tx.clone(), of());
            tokio::spawn(async move {
                let counted = table.counted("p", &request);
                let mut taken = table.wait(counted, || None::<()>, || ()).await;
                if let Ok(held) = taken.as_mut() {
                    held.sent(tokio::time::Instant::now().into_std() + Duration::from_millis(50));
                }
                let _ = tx.send(taken);
            });
            tokio::task::yield_now().await; // it waits
        }
        // The stall: the 5 calls miss their deadline together.
        for mut held in stalled.drain(..) {
            held.returned(true);
            drop(held);
        }
        let (mut took, mut failed) = (Vec::new(), 0);
        while let Ok(Some(answer)) = tokio::time::timeout(Duration::from_millis(1), rx.recv()).await {
            match answer {
                Ok(held) => took.push(held),
                Err(()) => failed += 1,
            }
        }
        assert_eq!(
            (took.len(), failed),
            (5, 0),
            "the waiting requests took the places freed"
        );
        // Redis still hangs: the next two waves of calls miss their deadlines too; the
        // third missed deadline in a row fails the requests still waiting at once.
        for wave in 0..2 {
            for mut held in took.drain(..) {
                held.returned(true);
                drop(held);
            }
            while let Ok(Some(answer)) = tokio::time::timeout(Duration::from_millis(1), rx.recv()).await {
                match answer {
                    Ok(held) => took.push(held),
                    Err(()) => failed += 1,
                }
            }
            if wave == 0 {
                assert_eq!((took.len(), failed), (5, 0), "two missed deadlines in a row");
            }
        }
        assert_eq!(failed, 90, "the third missed deadline in a row failed the rest at once");
        for mut held in took.drain(..) {
            held.returned(false);
        }
    }

    /// While Redis hangs, a request that takes a place of a bucket and gives it back at
    /// once, another of its buckets being full, is no call that returned: it leaves the
    /// count of missed deadlines alone. A global bucket of 3 calls at once, whose calls miss
    /// their deadline one after another, with a client whose own bucket is full asking
    /// after each: the 8 requests still waiting fail at the third. Reset by each such
    /// request, the count never reached 3, and they each waited for a call of their own to
    /// miss its deadline, one after another.
    #[tokio::test(start_paused = true)]
    async fn a_place_taken_and_given_back_at_once_is_no_call_that_returned() {
        let set = api(
            "rule_sets:\n  - id: api\n    rules:\n      - id: everyone\n        scope: global\n        bands: [{ capacity: 3, window: 1h }]\n      - id: per-ip\n        bands: [{ capacity: 1, window: 1h }]\n",
        );
        let of = move |client: &str, rules: &[usize]| {
            let buckets: Vec<_> = rules
                .iter()
                .map(|&rule| (rule, if rule == 0 { "all" } else { client }))
                .collect();
            request_in(&set, &buckets)
        };
        let table = table();
        let deadline = || tokio::time::Instant::now().into_std() + Duration::from_millis(50);
        let mut out: Vec<Held> = ["a", "b", "c"]
            .iter()
            .map(|client| table.try_take(table.counted("p", &of(client, &[0, 1]))).ok())
            .collect::<Option<_>>()
            .expect("the global bucket's 3 places");
        out.iter_mut().for_each(|held| held.sent(deadline()));
        // Client x has a call out of its own bucket, of 1 at once.
        let _x = table
            .try_take(table.counted("p", &of("x", &[1])))
            .ok()
            .expect("x's place");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for n in 0..10 {
            let (table, tx, request) = (table.clone(), tx.clone(), of(&format!("w{n}"), &[0, 1]));
            tokio::spawn(async move {
                let counted = table.counted("p", &request);
                let mut taken = table.wait(counted, || None::<()>, || ()).await;
                if let Ok(held) = taken.as_mut() {
                    held.sent(tokio::time::Instant::now().into_std() + Duration::from_millis(50));
                }
                let _ = tx.send(taken);
            });
        }
        tokio::task::yield_now().await;
        let mut failed = 0;
        for _ in 0..3 {
            // The newest call out misses its deadline ...
            let mut missed = out.pop().expect("a call out");
            missed.returned(true);
            drop(missed);
            // ... and x asks: the global bucket has a place, x's own bucket none.
            assert!(table.try_take(table.counted("p", &of("x", &[0, 1]))).is_err());
            while let Ok(Some(answer)) = tokio::time::timeout(Duration::from_millis(1), rx.recv()).await {
                match answer {
                    Ok(held) => out.push(held),
                    Err(()) => failed += 1,
                }
            }
        }
        assert_eq!(
            failed, 8,
            "the third missed deadline in a row failed the requests waiting"
        );
        for mut held in out {
            held.returned(false);
        }
    }

    /// Calls of one bucket may take different permits (a lease's call takes its request's
    /// and the lease's). Counted by its own permits, a call of 2 of a bucket of 2 let out 1
    /// at once and a call of 1 let out 2: when the call of 2 returned, leaving one call
    /// out, the request of 1 permit waiting was not woken (still waiting 10 s later) while
    /// a newcomer took the free place. Every call of a bucket counts by its rule's cost.
    #[tokio::test(start_paused = true)]
    async fn a_place_freed_by_a_call_of_more_permits_wakes_a_waiting_request() {
        let set = api(
            "rule_sets:\n  - id: api\n    rules:\n      - id: per-ip\n        bands: [{ capacity: 2, window: 1h }]\n",
        );
        let of = |permits: u64| {
            let mut request = AcquireRequest::new(set.clone());
            request.push_permits(0, Text::from("ip=a"), permits);
            request
        };
        let table = table();
        let lease = table.try_take(table.counted("p", &of(2))).ok().expect("a place");
        let one = table.try_take(table.counted("p", &of(1))).ok().expect("a second place");
        let waiter = {
            let (table, request) = (table.clone(), of(1));
            tokio::spawn(async move {
                let counted = table.counted("p", &request);
                table.wait(counted, || None::<()>, || ()).await.is_ok()
            })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "two calls out of two");
        drop(lease);
        // One call out of two: the waiting request may go.
        let woken = tokio::time::timeout(Duration::from_secs(10), waiter).await;
        assert!(
            woken.is_ok_and(|took| took.is_ok_and(|took| took)),
            "the waiting request took the place that was free"
        );
        drop(one);
    }

    /// A decision dropped once it was polled (its call out) runs to its end, giving its
    /// places back when it is answered; one dropped before it was polled never runs.
    #[tokio::test(start_paused = true)]
    async fn an_abandoned_decision_runs_to_its_end() {
        let table = table();
        let answered = Arc::new(AtomicBool::new(false));
        let decision = |held: Held| {
            let answered = answered.clone();
            RunsOut::new(async move {
                let mut held = held;
                held.sent(tokio::time::Instant::now().into_std() + Duration::from_secs(60));
                tokio::time::sleep(Duration::from_millis(1)).await; // Redis answers
                held.returned(false);
                answered.store(true, Ordering::SeqCst);
            })
        };
        let mut out = Box::pin(decision(table.try_take(ip_a(&table)).ok().expect("a place")));
        assert!(futures_util::poll!(out.as_mut()).is_pending(), "its call is out");
        drop(out);
        let _second = table.try_take(ip_a(&table)).ok().expect("the second place");
        assert!(table.try_take(ip_a(&table)).is_err(), "both places are out");
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert!(answered.load(Ordering::SeqCst), "the abandoned decision was answered");
        let third = table.try_take(ip_a(&table)).ok();
        assert!(
            third.is_some(),
            "its place came back with the answer, not at its deadline"
        );
        // Never polled: its call never went out, its place is free at once.
        drop(decision(third.expect("a place")));
        assert!(table.try_take(ip_a(&table)).is_ok());
    }

    /// A waiting request that is dropped frees its wait: the bucket's entry goes once no
    /// call is in flight.
    #[tokio::test]
    async fn a_dropped_waiting_request_leaves_nothing() {
        let table = table();
        let held: Vec<Held> = places(&table, 2);
        let waiter = {
            let table = table.clone();
            tokio::spawn(async move {
                let counted = ip_a(&table);
                table.wait(counted, || None::<()>, || ()).await.is_ok()
            })
        };
        tokio::task::yield_now().await;
        waiter.abort();
        assert!(waiter.await.is_err(), "aborted");
        drop(held);
        assert_eq!(entries(&table), 0);
    }
}
