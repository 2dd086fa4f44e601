//! Batched decisions: [`Batching`], and how the requests arriving together gather into one
//! call of the batch script ([`BATCH_LUA`](crate::BATCH_LUA)); or, when they are all of one
//! token-bucket rule of one band, of that rule's own batch script (see
//! `src/rule_script.rs`).

use std::collections::{HashSet, VecDeque};
use std::fmt::Write as _;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use fred::bytes_utils::Str;
use fred::error::{Error as FredError, ErrorKind};
use fred::types::{Key, Value};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::error::RedisError;
use crate::protocol::{DecideArgs, Numbers, Reply};
use crate::request::Keys;
use crate::rule_script::RuleScript;
use crate::script::{missing_script, Scripts};

/// Batched decisions, for [`RedisLimiterBuilder::batching`](crate::RedisLimiterBuilder::batching):
/// the requests an instance decides at the same time go to Redis together, in one script
/// call per batch instead of one per request.
///
/// A batch holds the requests of one hash slot (any request on a standalone Redis). The
/// script decides them one after the other in the order they arrived, each all or nothing
/// across its own rules and bands exactly as its own call would: a request rejected in a
/// batch consumes nothing and gives back nothing of its neighbours', and a request whose
/// decision fails in Redis (a key of the wrong type) fails alone.
///
/// A request never waits for company while a call is free: when fewer than
/// [`max_calls`](Self::max_calls) batch calls are in flight, whatever has arrived goes out
/// at once, so a lone request on an idle instance goes out alone, without delay. While all
/// of them are in flight the arriving requests gather; a batch goes out when a call ends,
/// when it holds [`max_requests`](Self::max_requests), or when its first request has
/// waited [`max_delay`](Self::max_delay), whichever comes first (tokio's timer rounds it
/// up to the next millisecond, and a busy machine wakes it later still). Each request
/// keeps the limiter's deadline from the moment it reached the batch (after its wait, if
/// any, for its bucket's calls in flight, which their own deadlines bound), wherever it
/// waits: past it, it fails with
/// [`RedisError::Timeout`] (and its failure policy answers it). A request still gathering
/// then leaves its batch; one whose batch was already handed to the client may still be
/// written and counted in Redis, which errs towards refusing, never admitting. On the pools
/// [`RedisLimiterBuilder`](crate::RedisLimiterBuilder) makes, a batch's call is bounded by
/// fred's command timeout, counted from when the call is handed to the client.
///
/// ```
/// use std::time::Duration;
/// use fluxgate_redis::Batching;
///
/// # async fn connect() -> Result<(), fluxgate_redis::RedisError> {
/// let limiter = fluxgate_redis::RedisLimiter::builder("redis://127.0.0.1:6379")
///     .batching(
///         Batching::new()
///             .max_requests(32)
///             .max_delay(Duration::from_micros(200)),
///     )
///     .connect()
///     .await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    max_requests: usize,
    max_delay: Duration,
    max_calls: usize,
}

impl Default for Batching {
    fn default() -> Self {
        Self::new()
    }
}

impl Batching {
    /// Batches of at most 64 requests, that wait at most 500 µs for a free call, with at
    /// most 2 calls in flight: one in Redis while the instance reads the other's replies
    /// and gathers the next requests.
    pub fn new() -> Self {
        Self {
            max_requests: 64,
            max_delay: Duration::from_micros(500),
            max_calls: 2,
        }
    }

    /// The most requests in one batch (at least 1). Default 64.
    pub fn max_requests(mut self, max: usize) -> Self {
        self.max_requests = max.max(1);
        self
    }

    /// How long a request waits for a free call at most, before its batch goes out anyway.
    /// Default 500 µs.
    pub fn max_delay(mut self, max: Duration) -> Self {
        self.max_delay = max;
        self
    }

    /// The most batch calls in flight at once before requests gather (at least 1). Default
    /// 2. More calls in flight make smaller batches: each call costs Redis and the client
    /// the same, whatever its size, so fewer, larger batches decide more per second.
    pub fn max_calls(mut self, max: usize) -> Self {
        self.max_calls = max.max(1);
        self
    }
}

/// A request of more keys than this goes in a call of its own (`lua/batch.lua` counts a
/// request's keys below 256).
const MAX_KEYS: usize = 256;

/// A request waiting for its batch.
struct Job {
    /// The hash slot of its keys (0 on a standalone Redis).
    slot: u16,
    keys: Keys,
    /// Its arguments (a request of the same rules has the same: sent once per batch).
    args: DecideArgs,
    arrived: Instant,
    reply: oneshot::Sender<Result<Numbers, RedisError>>,
}

/// The batching of one limiter: the requests waiting for a call, and the calls in flight.
///
/// No task runs between batches. A request that finds a call free starts one (a task that
/// sends its batch); a call that ends takes the next batch of the waiting requests, if any,
/// before it gives its place back; and a timer, armed while requests wait, sends those that
/// have waited `max_delay`.
pub(crate) struct Batcher {
    shared: Arc<Shared>,
}

struct Shared {
    scripts: Arc<Scripts>,
    limits: Batching,
    queue: Mutex<Queue>,
}

#[derive(Default)]
struct Queue {
    /// In the order they arrived.
    waiting: VecDeque<Job>,
    /// The calls in flight (each a task).
    calls: usize,
    /// Whether the timer of the waiting requests is armed (a task).
    timer: bool,
}

impl Batcher {
    /// Batching over `scripts`.
    pub(crate) fn new(scripts: Arc<Scripts>, batching: Batching) -> Self {
        Self {
            shared: Arc::new(Shared {
                limits: batching,
                scripts,
                queue: Mutex::new(Queue::default()),
            }),
        }
    }

    /// The options it runs with.
    pub(crate) fn batching(&self) -> Batching {
        self.shared.limits
    }

    /// Decides one request of one hash slot in a batch, within the limiter's deadline from
    /// now: what [`Scripts::decide`] does for a call of its own.
    ///
    /// # Errors
    ///
    /// As [`Scripts::decide`]; [`RedisError::Interrupted`] when the call's task ended
    /// without an answer (its runtime shut down).
    pub(crate) async fn decide(&self, slot: u16, keys: Keys, args: &DecideArgs) -> Result<Reply, RedisError> {
        if keys.len() >= MAX_KEYS || self.shared.scripts.migrating(&keys) {
            // More keys than a batch's header can count, or a cluster's slot found
            // migrating (its calls go in a transaction): a call of its own (a future of its
            // own, rarely made, that this one does not hold).
            return Box::pin(self.shared.scripts.decide(slot, keys, args)).await;
        }
        let (reply, answer) = oneshot::channel();
        let arrived = Instant::now();
        self.shared.submit(Job {
            slot,
            keys,
            args: args.clone(),
            arrived,
            reply,
        });
        // The request's own deadline, wherever it waits. Past it the answer is dropped,
        // and a request still waiting is left out of its batch (see `take`).
        let timeout = self.shared.scripts.connection().timeout();
        let answered = match arrived.checked_add(timeout) {
            Some(deadline) => tokio::time::timeout_at(deadline, answer).await,
            None => Ok(answer.await), // a deadline beyond the clock's range
        };
        match answered {
            Ok(Ok(result)) => Scripts::read(args, &result?),
            Ok(Err(_)) => Err(RedisError::Interrupted),
            Err(_) => Err(RedisError::Timeout(timeout)),
        }
    }
}

/// A task to start once the queue's lock is released: a call for a batch, or the timer.
enum Start {
    Call(Vec<Job>),
    Timer,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `job`, then starts the calls it allows: while a call is free, one per batch
    /// of the waiting requests; and a full batch of its hash slot whether or not a call is
    /// free. Arms the timer if requests are left waiting.
    fn submit(self: &Arc<Self>, job: Job) {
        let slot = job.slot;
        let mut starts = Vec::new();
        {
            let mut queue = self.lock();
            queue.waiting.push_back(job);
            while queue.calls < self.limits.max_calls && !queue.waiting.is_empty() {
                starts.extend(self.next_call(&mut queue, None));
            }
            let max = self.limits.max_requests;
            if queue.waiting.iter().filter(|j| j.slot == slot).take(max).count() >= max {
                starts.extend(self.next_call(&mut queue, Some(slot)));
            }
            if !queue.waiting.is_empty() && !queue.timer {
                queue.timer = true;
                starts.push(Start::Timer);
            }
        }
        self.spawn(starts);
    }

    /// The next batch of `slot` (by default the first waiting request's), counted as a
    /// call in flight: to start once the lock is released ([`Shared::spawn`]).
    fn next_call(&self, queue: &mut Queue, slot: Option<u16>) -> Option<Start> {
        let batch = take(&mut queue.waiting, slot, self.limits.max_requests);
        if batch.is_empty() {
            return None;
        }
        queue.calls += 1;
        Some(Start::Call(batch))
    }

    /// Starts tasks, the queue's lock released: a task dropped unstarted (its runtime shut
    /// down) gives its place back through its guard, which takes the lock.
    fn spawn(self: &Arc<Self>, starts: Vec<Start>) {
        for start in starts {
            match start {
                Start::Call(batch) => {
                    tokio::spawn(calls(Held::new(self.clone(), give_back_call), batch));
                }
                Start::Timer => {
                    tokio::spawn(timer(Held::new(self.clone(), disarm_timer)));
                }
            }
        }
    }

    /// When a request that arrived at `arrived` is due to go out whether or not a call is
    /// free; `None` when never (a delay beyond the clock's range).
    fn due(&self, arrived: Instant) -> Option<Instant> {
        arrived.checked_add(self.limits.max_delay)
    }
}

/// A task's hold on the queue's bookkeeping (a call's place among those in flight, or the
/// timer's being armed), released under the queue's lock when the task ends, however it
/// ends (even dropped unstarted), unless the task released it itself.
struct Held {
    shared: Arc<Shared>,
    release: Option<fn(&mut Queue)>,
}

impl Held {
    fn new(shared: Arc<Shared>, release: fn(&mut Queue)) -> Self {
        Self {
            shared,
            release: Some(release),
        }
    }

    /// The task released it itself, under the lock it already held.
    fn released(&mut self) {
        self.release = None;
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release(&mut self.shared.lock());
        }
    }
}

fn give_back_call(queue: &mut Queue) {
    queue.calls -= 1;
}

fn disarm_timer(queue: &mut Queue) {
    queue.timer = false;
}

/// A call's task: sends `batch`, then the next batches of the waiting requests while any
/// wait and the calls in flight are within bounds. Its place is given back under the same
/// lock that found nothing to send: a request arriving then finds the call free.
async fn calls(mut place: Held, mut batch: Vec<Job>) {
    loop {
        send(&place.shared.scripts, batch).await;
        let shared = place.shared.clone();
        let mut queue = shared.lock();
        // Past the bound (the timer sent more calls than allowed) the others take the rest.
        if queue.calls <= shared.limits.max_calls {
            // Past the requests whose callers are gone, to the next batch to send.
            batch = Vec::new();
            while batch.is_empty() && !queue.waiting.is_empty() {
                batch = take(&mut queue.waiting, None, shared.limits.max_requests);
            }
            if !batch.is_empty() {
                continue;
            }
        }
        give_back_call(&mut queue);
        place.released();
        return;
    }
}

/// The timer of the waiting requests: at the time the first of them has waited
/// `max_delay`, sends every request that has, in batches, whether or not a call is free;
/// disarmed, under the same lock, when none waits.
async fn timer(mut armed: Held) {
    loop {
        let shared = armed.shared.clone();
        let mut starts = Vec::new();
        let due = {
            let mut queue = shared.lock();
            let now = Instant::now();
            while queue
                .waiting
                .front()
                .is_some_and(|job| shared.due(job.arrived).is_some_and(|due| due <= now))
            {
                starts.extend(shared.next_call(&mut queue, None));
            }
            let due = queue.waiting.front().and_then(|job| shared.due(job.arrived));
            if due.is_none() {
                disarm_timer(&mut queue);
            }
            due
        };
        shared.spawn(starts);
        match due {
            Some(due) => tokio::time::sleep_until(due).await,
            None => {
                armed.released();
                return;
            }
        }
    }
}

/// The next batch: the waiting requests of `slot` (by default the first one's hash slot),
/// at most `max`, in the order they arrived, leaving out those whose caller is gone.
fn take(waiting: &mut VecDeque<Job>, slot: Option<u16>, max: usize) -> Vec<Job> {
    let Some(slot) = slot.or_else(|| waiting.front().map(|job| job.slot)) else {
        return Vec::new();
    };
    let mut batch = Vec::with_capacity(max.min(waiting.len()));
    let mut others = VecDeque::new();
    while let Some(job) = waiting.pop_front() {
        if job.slot == slot && batch.len() < max {
            if !job.reply.is_closed() {
                batch.push(job);
            }
        } else {
            others.push_back(job);
            if batch.len() >= max {
                others.extend(waiting.drain(..));
            }
        }
    }
    *waiting = others;
    batch
}

/// One call of a batch script for `batch`, each request answered with its own reply: the
/// rule's own batch script when every request is of one token-bucket rule of one band that
/// has one, the shared one otherwise. A request whose deadline has passed is answered with
/// a timeout and left out.
async fn send(scripts: &Scripts, batch: Vec<Job>) {
    let timeout = scripts.connection().timeout();
    let now = Instant::now();
    let (batch, late): (Vec<Job>, Vec<Job>) = batch
        .into_iter()
        .partition(|job| job.arrived.checked_add(timeout).is_none_or(|deadline| now < deadline));
    for job in late {
        let _ = job.reply.send(Err(RedisError::Timeout(timeout)));
    }
    let Some(oldest) = batch.iter().map(|job| job.arrived).min() else {
        return;
    };
    // One hash slot's requests (see `take`).
    let slot = batch.first().map_or(0, |job| job.slot);
    // What is left of the deadline of the oldest request.
    let remaining = || timeout.saturating_sub(oldest.elapsed());
    if let Some((rule, argv)) = one_rule(&batch) {
        if scripts.rule_batch_ready(&rule) {
            let mut keys = Vec::with_capacity(batch.len());
            let mut replies = Vec::with_capacity(batch.len());
            for job in batch {
                keys.extend(job.keys.into_iter().map(Key::from));
                replies.push(job.reply);
            }
            let result = scripts.decide_batch(slot, Some(&rule), keys, argv, remaining()).await;
            return answer_all(scripts, Some(&rule), result, replies, one_rule_reply).await;
        }
    }
    // Each distinct list of arguments once, by the first request that has it.
    let mut lists: Vec<usize> = Vec::new();
    let mut refs = Vec::with_capacity(batch.len());
    for (i, job) in batch.iter().enumerate() {
        let list = match lists.iter().position(|&first| batch[first].args.same_as(&job.args)) {
            Some(list) => list,
            None => {
                lists.push(i);
                lists.len() - 1
            }
        };
        refs.push(list);
    }
    let mut argv = Vec::with_capacity(1 + 8 * lists.len() + batch.len());
    argv.push(hex(lists.len() as u64));
    let mut entries = Vec::with_capacity(lists.len());
    for &first in &lists {
        let (entry, list) = Scripts::batch_entry(&batch[first].args);
        entries.push(entry);
        argv.push(hex(list.len() as u64));
        argv.extend(list);
    }
    let mut keys = Vec::with_capacity(batch.iter().map(|job| job.keys.len()).sum());
    let mut replies = Vec::with_capacity(batch.len());
    for (job, list) in batch.into_iter().zip(refs) {
        let header = u64::try_from(entries[list]).unwrap_or(0) + 4 * job.keys.len() as u64 + 1024 * list as u64;
        argv.push(hex(header));
        keys.extend(job.keys.into_iter().map(Key::from));
        replies.push(job.reply);
    }
    let result = scripts.decide_batch(slot, None, keys, argv, remaining()).await;
    answer_all(scripts, None, result, replies, next_reply).await;
}

/// When every request of `batch` is of one token-bucket rule of one band that has its own
/// script: that script, and its batch script's `ARGV` (`lua/rule_batch.lua`): how many
/// requests' keys repeat an earlier request's and their places ([`repeated_keys`]), then
/// each request's cost in units, or the one cost of them all when they are the same (a
/// rule's requests of as many permits).
fn one_rule(batch: &[Job]) -> Option<(Arc<RuleScript>, Vec<Value>)> {
    let (rule, _) = batch.first()?.args.rule_script()?;
    let mut costs = Vec::with_capacity(batch.len());
    for job in batch {
        match job.args.rule_script() {
            Some((other, [cost])) if Arc::ptr_eq(other, rule) && job.keys.len() == 1 => costs.push(cost),
            _ => return None,
        }
    }
    let repeats = repeated_keys(batch);
    let mut argv = Vec::with_capacity(1 + repeats.len() + costs.len());
    argv.push(hex(repeats.len() as u64));
    argv.extend(repeats.into_iter().map(|place| hex(place as u64)));
    match costs.split_first() {
        Some((first, rest)) if rest.iter().all(|cost| cost == first) => argv.push((*first).clone()),
        _ => argv.extend(costs.into_iter().cloned()),
    }
    Some((rule.clone(), argv))
}

/// The places, from 1, of the requests of `batch` whose key an earlier request of the batch
/// has too. The rule's batch script reads the batch's keys before it decides any request,
/// so the request at such a place reads its key again, after the earlier request's write:
/// a place left out here would be decided on a count from before that write.
fn repeated_keys(batch: &[Job]) -> Vec<usize> {
    fn key(job: &Job) -> Option<&str> {
        job.keys.first().map(String::as_str)
    }
    let mut places = Vec::new();
    if batch.len() <= 16 {
        for (i, job) in batch.iter().enumerate() {
            if batch[..i].iter().any(|earlier| key(earlier) == key(job)) {
                places.push(i + 1);
            }
        }
    } else {
        let mut seen = HashSet::with_capacity(batch.len());
        for (i, job) in batch.iter().enumerate() {
            if !seen.insert(key(job)) {
                places.push(i + 1);
            }
        }
    }
    places
}

/// Answers each request of a batch from its script's `result`, each reply read by `read`.
/// A call that failed fails each request; after `NOSCRIPT` (answered first: each request
/// retries on its own within its deadline) the batch's script is loaded again, so that the
/// next batches find it.
async fn answer_all(
    scripts: &Scripts,
    rule: Option<&RuleScript>,
    result: Result<Vec<Value>, RedisError>,
    replies: Vec<oneshot::Sender<Result<Numbers, RedisError>>>,
    read: Read,
) {
    match result {
        Ok(values) => answer(values, replies, read),
        Err(e) => {
            for reply in replies {
                let _ = reply.send(Err(copy(&e)));
            }
            if missing_script(&e) {
                scripts.reload_batch(rule).await;
            }
        }
    }
}

/// The numbers [`hex`] writes from a table, written once: every header of a request of up
/// to 255 keys in the first four argument lists, and every count below that.
const SMALL: usize = 4096;

/// A number in hexadecimal, as `lua/batch.lua` reads it. Below [`SMALL`] it comes from a
/// table written once, whose strings are static: a header costs no allocation, and fred's
/// copy of it no reference count.
fn hex(n: u64) -> Value {
    static TABLE: LazyLock<Vec<Str>> = LazyLock::new(|| {
        let mut all = String::new();
        let mut ends = Vec::with_capacity(SMALL);
        for n in 0..SMALL {
            let _ = write!(all, "{n:x}");
            ends.push(all.len());
        }
        let all: &'static str = Box::leak(all.into_boxed_str());
        let mut start = 0;
        ends.into_iter()
            .map(|end| {
                let s = Str::from_static(&all[start..end]);
                start = end;
                s
            })
            .collect()
    });
    match usize::try_from(n).ok().and_then(|n| TABLE.get(n)) {
        Some(s) => Value::String(s.clone()),
        None => Value::String(format!("{n:x}").into()),
    }
}

/// Reads the reply of request `i` of `total` from the rest of a batch's reply, decided at
/// `now` (µs).
type Read = fn(&mut std::vec::IntoIter<Value>, i64, usize, usize) -> Result<Numbers, RedisError>;

/// Answers each request of a batch from the batch script's reply: the batch's `now_us`,
/// then each request's reply, read by `read` ([`next_reply`] for `lua/batch.lua`'s,
/// [`one_rule_reply`] for `lua/rule_batch.lua`'s).
fn answer(values: Vec<Value>, replies: Vec<oneshot::Sender<Result<Numbers, RedisError>>>, read: Read) {
    let mut values = values.into_iter();
    let total = replies.len();
    let now = match values.next() {
        Some(Value::Integer(now)) => Ok(now),
        _ => Err(RedisError::Reply(format!(
            "batch reply of {total} requests: no instant first"
        ))),
    };
    for (i, reply) in replies.into_iter().enumerate() {
        let _ = reply.send(match &now {
            Ok(now) => read(&mut values, *now, i, total),
            Err(e) => Err(copy(e)),
        });
    }
}

/// The reply of request `i` of `total` from the rest of a rule's own batch script's reply
/// (`lua/rule_batch.lua`), decided at `now` (µs): its band's debt, or the error its
/// decision raised.
fn one_rule_reply(
    values: &mut std::vec::IntoIter<Value>,
    now: i64,
    i: usize,
    total: usize,
) -> Result<Numbers, RedisError> {
    match values.next() {
        Some(Value::Integer(debt)) => Ok(Numbers::from_slice(&[now, debt])),
        Some(Value::String(s)) => Err(script_error(s.to_string())),
        Some(Value::Bytes(b)) => Err(script_error(String::from_utf8_lossy(&b).into_owned())),
        _ => Err(RedisError::Reply(format!(
            "batch reply of request {} of {total}: no debt",
            i + 1
        ))),
    }
}

/// The error a request's script raised in a batch.
fn script_error(message: String) -> RedisError {
    RedisError::command(FredError::new(ErrorKind::Unknown, message))
}

/// The reply of request `i` of `total` from the rest of the batch's reply, decided at
/// `now` (µs).
fn next_reply(values: &mut std::vec::IntoIter<Value>, now: i64, i: usize, total: usize) -> Result<Numbers, RedisError> {
    let wrong = |what: &str| RedisError::Reply(format!("batch reply of request {} of {total}: {what}", i + 1));
    match values.next() {
        // The one-band call's reply, its debt alone: with the batch's instant, as its own
        // call replies.
        Some(Value::Integer(-2)) => match values.next() {
            Some(Value::Integer(debt)) => Ok(Numbers::from_slice(&[now, debt])),
            _ => Err(wrong("a one-band reply without its debt")),
        },
        Some(Value::Integer(-1)) => {
            let message = match values.next() {
                Some(Value::String(s)) => s.to_string(),
                Some(Value::Bytes(b)) => String::from_utf8_lossy(&b).into_owned(),
                _ => return Err(wrong("an error without its message")),
            };
            Err(script_error(message))
        }
        Some(Value::Integer(len)) => {
            let len = usize::try_from(len).map_err(|_| wrong("a negative length"))?;
            let mut numbers = Numbers::with_capacity(len);
            for _ in 0..len {
                match values.next() {
                    Some(Value::Integer(n)) => numbers.push(n),
                    _ => return Err(wrong("fewer numbers than its length")),
                }
            }
            Ok(numbers)
        }
        _ => Err(wrong("no length")),
    }
}

/// The same error, for each request of a batch that failed as a whole.
fn copy(error: &RedisError) -> RedisError {
    match error {
        RedisError::Command(e) => RedisError::Command(e.clone()),
        RedisError::OutOfMemory(full) => match full.0.downcast_ref::<FredError>() {
            Some(e) => RedisError::command(e.clone()),
            None => RedisError::Reply(full.to_string()),
        },
        RedisError::Connect(e) => RedisError::Connect(e.clone()),
        RedisError::Timeout(d) => RedisError::Timeout(*d),
        RedisError::Reply(s) => RedisError::Reply(s.clone()),
        RedisError::Url { url, reason } => RedisError::Url {
            url: url.clone(),
            reason: reason.clone(),
        },
        RedisError::Option { option, reason } => RedisError::Option { option, reason },
        RedisError::Interrupted => RedisError::Interrupted,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{BandArgs, BucketArgs, Flags, RuleArgs, ScriptAlgorithm};

    fn job(slot: u16) -> (Job, oneshot::Receiver<Result<Numbers, RedisError>>) {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            slot,
            keys: Keys::from_elem(format!("k{slot}"), 1),
            args: DecideArgs::new(),
            arrived: Instant::now(),
            reply,
        };
        (job, answer)
    }

    /// A batch takes the first request's slot only, in arrival order, at most `max`, and
    /// leaves out requests whose caller is gone.
    #[tokio::test]
    async fn a_batch_is_one_slot_in_arrival_order() {
        let mut waiting = VecDeque::new();
        let mut answers = Vec::new();
        for slot in [7, 3, 7, 7, 3, 7] {
            let (job, answer) = job(slot);
            waiting.push_back(job);
            answers.push(answer);
        }
        drop(answers.remove(2)); // the second request of slot 7: its caller is gone
        let batch = take(&mut waiting, None, 2);
        let slots: Vec<u16> = batch.iter().map(|j| j.slot).collect();
        assert_eq!(slots, [7, 7]);
        assert_eq!(batch[1].keys.as_slice(), ["k7"]);
        assert!(!batch[1].reply.is_closed(), "the caller gone was left out");
        let rest: Vec<u16> = waiting.iter().map(|j| j.slot).collect();
        assert_eq!(rest, [3, 3, 7], "the others wait, in order");
    }

    /// Numbers in hexadecimal, from the table and past it.
    #[test]
    fn numbers_are_written_in_hexadecimal() {
        for n in [0, 5, 255, 1029, SMALL as u64 - 1, SMALL as u64, 1 << 40] {
            assert_eq!(hex(n), Value::String(format!("{n:x}").into()), "{n}");
        }
    }

    /// A batch reply without its instant first fails every request of the batch.
    #[tokio::test]
    async fn a_reply_without_its_instant_fails_every_request() {
        let (first, second) = (oneshot::channel(), oneshot::channel());
        answer(Vec::new(), vec![first.0, second.0], next_reply);
        for answer in [first.1, second.1] {
            let error = answer.await.unwrap().unwrap_err().to_string();
            assert!(error.contains("no instant first"), "{error}");
        }
    }

    /// A token-bucket rule of one band of `capacity` per second, for requests of `permits`.
    fn one_band(capacity: i64, permits: i64) -> Arc<RuleArgs> {
        let bucket = BucketArgs {
            permits,
            flags: Flags::new(1, ScriptAlgorithm::TokenBucket, false),
            layout: Some(Str::from(format!("b0:{capacity}/1s|"))),
            max_wait_us: 0,
        };
        // Scale 1, an interval of 1 s / capacity.
        let band = BandArgs {
            capacity,
            a: 1,
            b: 1_000_000 / capacity,
        };
        Arc::new(RuleArgs::new(bucket, [band].into_iter().collect()))
    }

    /// A request of `rules`.
    fn of(rules: &[&Arc<RuleArgs>]) -> DecideArgs {
        let mut args = DecideArgs::new();
        for rule in rules {
            args.rule(Arc::clone(rule));
        }
        args
    }

    fn job_of(args: DecideArgs) -> Job {
        Job { args, ..job(1).0 }
    }

    /// A batch of one rule's requests goes to its own batch script with each request's
    /// cost, or one cost when they are all the same; a batch holding besides a request of
    /// another rule, or of two rules, to the shared one.
    #[test]
    fn a_batch_of_one_rule_goes_to_its_own_script() {
        let (one, two, other) = (one_band(2_000, 1), one_band(2_000, 2), one_band(1_000, 1));
        let batch = [of(&[&one]), of(&[&one]), of(&[&one])].map(job_of);
        let (rule, argv) = one_rule(&batch).expect("one rule");
        assert!(Arc::ptr_eq(&rule, of(&[&one]).rule_script().unwrap().0));
        assert_eq!(argv[0], Value::from("2"), "two requests repeat the first one's key");
        assert_eq!(
            argv[1..],
            ["2", "3", "1f4"].map(Value::from),
            "one cost for all: 500 µs"
        );
        let batch = [of(&[&one]), of(&[&two]), of(&[&one])].map(job_of);
        let (same, argv) = one_rule(&batch).expect("one rule, its costs apart");
        assert!(
            Arc::ptr_eq(&rule, &same),
            "one script for the rule's requests of any cost"
        );
        assert_eq!(argv, ["2", "2", "3", "1f4", "3e8", "1f4"].map(Value::from));
        // Another rule's request (another capacity); a request of two rules.
        assert!(one_rule(&[of(&[&one]), of(&[&other])].map(job_of)).is_none());
        assert!(one_rule(&[of(&[&one]), of(&[&one, &other])].map(job_of)).is_none());
        assert!(one_rule(&[]).is_none());
    }

    /// Every request whose key an earlier request of the batch has is named, in small
    /// batches (compared pairwise) and large ones (a set) alike, and no other.
    #[test]
    fn each_repeated_key_is_named_by_its_place() {
        let batch_of = |keys: &[&str]| -> Vec<Job> {
            keys.iter()
                .map(|key| Job {
                    keys: Keys::from_elem((*key).to_owned(), 1),
                    ..job(0).0
                })
                .collect()
        };
        assert!(repeated_keys(&batch_of(&["a", "b", "c"])).is_empty());
        assert_eq!(repeated_keys(&batch_of(&["a", "b", "a", "a", "b", "ab"])), [3, 4, 5]);
        for n in [16, 17, 100] {
            let mut keys: Vec<String> = (0..n).map(|i| format!("k{i}")).collect();
            keys[n - 1] = "k0".into();
            keys[n / 2] = format!("k{}", n / 2 - 1);
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            assert_eq!(repeated_keys(&batch_of(&keys)), [n / 2 + 1, n], "{n} requests");
        }
    }

    /// A rule's batch script replies with each request's debt, or its error.
    #[test]
    fn a_rule_batch_reply_is_each_requests_debt_or_error() {
        let now = 1_700_000_000_000_000;
        let values = vec![
            Value::Integer(now),
            Value::Integer(7),
            Value::String("WRONGTYPE oops".into()),
            Value::Integer(0),
        ];
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..4).map(|_| oneshot::channel()).unzip();
        answer(values, senders, one_rule_reply);
        let mut results = receivers.into_iter().map(|mut r| r.try_recv().expect("answered"));
        assert_eq!(results.next().unwrap().unwrap().as_slice(), [now, 7]);
        let error = results.next().unwrap().unwrap_err().to_string();
        assert!(error.contains("WRONGTYPE oops"), "{error}");
        assert_eq!(results.next().unwrap().unwrap().as_slice(), [now, 0]);
        let cut = results.next().unwrap().unwrap_err().to_string();
        assert!(cut.contains("request 4 of 4") && cut.contains("no debt"), "{cut}");
    }

    /// Each request gets its own reply; an error reaches only its request, and a reply cut
    /// short is an error that names the request.
    #[test]
    fn each_request_reads_its_own_reply() {
        let values = vec![
            Value::Integer(2),
            Value::Integer(10),
            Value::Integer(20),
            Value::Integer(-1),
            Value::String("WRONGTYPE oops".into()),
            Value::Integer(-2),
            Value::Integer(7),
            Value::Integer(1),
            Value::Integer(30),
            Value::Integer(-2),
        ];
        let mut values = values.into_iter();
        let now = 1_700_000_000_000_000;
        assert_eq!(next_reply(&mut values, now, 0, 5).unwrap().as_slice(), [10, 20]);
        let error = next_reply(&mut values, now, 1, 5).unwrap_err().to_string();
        assert!(error.contains("WRONGTYPE oops"), "{error}");
        assert_eq!(
            next_reply(&mut values, now, 2, 5).unwrap().as_slice(),
            [now, 7],
            "a one-band reply gets the batch's instant"
        );
        assert_eq!(next_reply(&mut values, now, 3, 5).unwrap().as_slice(), [30]);
        let cut = next_reply(&mut values, now, 4, 5).unwrap_err().to_string();
        assert!(cut.contains("request 5 of 5") && cut.contains("debt"), "{cut}");
        // A reply of several numbers cut short.
        let mut values = vec![Value::Integer(3), Value::Integer(40)].into_iter();
        let cut = next_reply(&mut values, now, 3, 4).unwrap_err().to_string();
        assert!(cut.contains("request 4 of 4") && cut.contains("fewer numbers"), "{cut}");
    }
}
