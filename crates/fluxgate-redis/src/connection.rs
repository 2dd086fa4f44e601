//! The connections to Redis and the deadline of every command sent through them.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use fred::clients::{Client, Pool, WithOptions};
use fred::interfaces::{ClientLike, ClusterInterface};
use fred::types::config::{Options, ReconnectPolicy, Server, ServerConfig, UnresponsiveConfig};
use fred::types::{Builder, ClusterHash, ConnectHandle, CustomCommand, Value};
use futures_util::future::join_all;

use crate::error::RedisError;
use crate::url::{parse_url, redact};

/// The default deadline of one script call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);

/// A client builder for `url` (standalone, Cluster or Sentinel) that reconnects every
/// `reconnect_delay` and counts a connection dead once a command of it has gone
/// `unanswered` that long (see [`unresponsive`]), and whether `url` names a cluster.
///
/// # Errors
///
/// [`RedisError::Url`] for a URL that cannot be used (shown without its password).
pub(crate) fn builder(
    url: &str,
    reconnect_delay: Duration,
    unanswered: Duration,
) -> Result<(Builder, bool), RedisError> {
    let config = parse_url(url).map_err(|reason| RedisError::Url {
        url: redact(url),
        reason,
    })?;
    let cluster = matches!(config.server, ServerConfig::Clustered { .. });
    let mut builder = Builder::from_config(config);
    let delay = u32::try_from(reconnect_delay.as_millis()).unwrap_or(u32::MAX).max(1);
    builder.set_policy(ReconnectPolicy::new_constant(0, delay));
    builder.with_connection_config(|c| {
        // 2 s at most for a new connection's own commands (`HELLO`, `CLUSTER SLOTS`…), not
        // fred's 10 s: after a failover, a reconnection that reaches the old primary, which
        // still accepts connections without answering, asks the sentinels again that soon.
        c.internal_command_timeout = unanswered.min(Duration::from_secs(2));
        c.unresponsive = unresponsive(unanswered);
    });
    Ok((builder, cluster))
}

/// When a connection counts as dead although it is still open: a command of it unanswered
/// for `max_timeout`, checked four times as often. fred then closes it and connects again,
/// asking the sentinels for the primary or the cluster for its slots again. Without it, a
/// primary that stops answering without closing its connections (a frozen process, a host
/// gone, a network partition) keeps every connection to it after a failover has promoted
/// another one, until TCP gives up, minutes later.
/// `client`'s commands sent to `node` of a cluster (`None`: where fred routes them), each
/// timed out by fred after `timeout` (`None`: the pool's default, the decision deadline).
pub(crate) fn on_node(client: &Client, node: Option<Server>, timeout: Option<Duration>) -> WithOptions<Client> {
    client.with_options(&Options {
        cluster_node: node,
        timeout,
        ..Options::default()
    })
}

pub(crate) fn unresponsive(max_timeout: Duration) -> UnresponsiveConfig {
    UnresponsiveConfig {
        max_timeout: Some(max_timeout),
        interval: (max_timeout / 4).max(Duration::from_millis(10)),
    }
}

/// Whether Redis still answers the calls of each hash slot (one on a standalone Redis), to
/// reconnect when it stops, whatever the load.
///
/// fred counts a connection dead when its last write is older than `unanswered` with no
/// reply since ([`unresponsive`]). A connection that is written to more often than that
/// never is: under load (or with a pool of two or three connections and a request every
/// few hundred milliseconds), a primary that stops answering without closing its
/// connections (a frozen process, a host gone, a partition) kept every connection to it
/// after a failover had promoted another, each decision timing out and left to its failure
/// policy, until TCP gave up, minutes later. Here a slot whose calls keep timing out for
/// `unanswered`, counted from the first timeout after an answer, makes the pool reconnect
/// ([`Connection::timed_out`]), at most once per `unanswered` and never while a
/// reconnection it started is under way.
///
/// The same is watched per client of the pool: one connection that stops answering while
/// the pool's others answer (a middlebox dropping one flow's packets) left a share of the
/// decisions to the failure policy, each call on it timing out, while the others' answers
/// kept the slot from ever being silent. A client whose calls of a range of slots (all
/// slots on a standalone server, 64 neighbouring slots on a cluster, where a node holds
/// ranges of them) have all timed out for `unanswered`, while a call of the range was
/// answered on another client after its first timeout, connects again alone
/// ([`Connection::client_saw`]). Until that reconnection ends, the calls of that range go to
/// the pool's other clients ([`Connection::next_placed`]): it is carried out by the client's
/// connection task, which waits on the stuck socket once that socket's buffer is full, and
/// then ends only when TCP gives up. No decision is sent to it as a probe meanwhile: each
/// such call would time out, and every request of a batch with it.
struct Liveness {
    start: Instant,
    /// `unanswered` in [`TICK_MS`] ticks, rounded up.
    unanswered: u32,
    /// Per slot, every client's calls.
    slots: Silence,
    /// Per client of the pool, in the pool's order: its own calls, per range of slots.
    clients: Box<[Silence]>,
    /// Per range of slots: the tick of the last answer to a call of it on any client (as
    /// the client that sent the call counts it, when its reply comes), [`ANSWERED`] for
    /// none yet.
    answered_at: Box<[AtomicU32]>,
}

/// The silences of calls, per hash slot, and the reconnection they start.
struct Silence {
    /// Per slot: [`ANSWERED`] when a call of it was answered since its last timeout, else
    /// the tick of the first timeout since (its silence).
    silent_since: Box<[AtomicU32]>,
    /// When (ticks) the last reconnection it started began.
    reconnected: AtomicU32,
    /// Whether a reconnection it started is under way.
    reconnecting: AtomicBool,
}

/// The unit of [`Liveness`]'s times: a `u32` of them lasts two years, and differences are
/// taken wrapping.
const TICK_MS: u128 = 16;

/// A slot answered since its last timeout (no tick is stored as this value).
const ANSWERED: u32 = u32::MAX;

/// How far a tick may be ahead of a thread's own reading of the clock (another thread
/// read it a moment later) and still be read as just now: about 17 minutes. A tick further
/// ahead is one from long ago, the wrapping difference counted as it is.
const AHEAD: u32 = 1 << 16;

/// The slots of a range watched per client on a cluster (`slot >> RANGE_BITS`): 256
/// ranges of 64 neighbouring slots.
const RANGE_BITS: u16 = 6;

impl Liveness {
    fn new(unanswered: Duration, cluster: bool, clients: usize) -> Self {
        let (slots, ranges) = if cluster {
            (16_384, 16_384 >> RANGE_BITS)
        } else {
            (1, 1)
        };
        // At most a quarter of the ticks' range (about half a year): differences of ticks
        // are read up to all of it but `AHEAD` (see `elapsed`).
        let unanswered = u32::try_from(unanswered.as_millis().div_ceil(TICK_MS))
            .unwrap_or(u32::MAX)
            .clamp(1, u32::MAX / 4);
        Self {
            start: Instant::now(),
            unanswered,
            slots: Silence::new(slots, unanswered),
            clients: (0..clients).map(|_| Silence::new(ranges, unanswered)).collect(),
            answered_at: (0..if clients > 0 { ranges } else { 0 })
                .map(|_| AtomicU32::new(ANSWERED))
                .collect(),
        }
    }

    fn now(&self) -> u32 {
        // Wrapping on purpose (see `TICK_MS`); never `ANSWERED`.
        ((self.start.elapsed().as_millis() / TICK_MS) as u32).min(ANSWERED - 1)
    }

    fn answered(&self, slot: u16) {
        self.slots.answered(slot);
    }

    /// A call of `slot` timed out: whether the pool is to reconnect now (the caller then
    /// does, and calls [`reconnected`](Self::reconnected) when it is done).
    fn timed_out(&self, slot: u16) -> bool {
        self.timed_out_at(slot, self.now())
    }

    /// [`timed_out`](Self::timed_out) at `now` (ticks, below [`ANSWERED`]). The pool's
    /// reconnection reconnects every client: none reconnects alone for a period after.
    fn timed_out_at(&self, slot: u16, now: u32) -> bool {
        let reconnect = self.slots.timed_out_at(slot, now, self.unanswered);
        if reconnect {
            for client in self.clients.iter() {
                client.reconnected.store(now, Ordering::Relaxed);
            }
        }
        reconnect
    }

    /// The reconnection [`timed_out`](Self::timed_out) asked for is over.
    fn reconnected(&self) {
        self.slots.reconnected();
    }

    /// A call of `slot` on the client at `place` was answered.
    fn client_answered(&self, place: usize, slot: u16) {
        self.client_answered_then(place, slot, || self.now());
    }

    /// [`client_answered`](Self::client_answered) at `now` (ticks, below [`ANSWERED`]).
    #[cfg(test)]
    fn client_answered_at(&self, place: usize, slot: u16, now: u32) {
        self.client_answered_then(place, slot, || now);
    }

    /// [`client_answered`](Self::client_answered), the clock read by `now` only when the
    /// answer tells something: while another client of the pool is silent on the range
    /// (an answer before any silence begins is no answer after it), not on every call.
    fn client_answered_then(&self, place: usize, slot: u16, now: impl FnOnce() -> u32) {
        let range = slot >> RANGE_BITS;
        if let Some(client) = self.clients.get(place) {
            client.answered(range);
        }
        let silent = |client: &Silence| client.since(range).is_some_and(|since| since != ANSWERED);
        if !self.clients.iter().any(silent) {
            return;
        }
        if let Some(answered_at) = self.answered_at.get(usize::from(range)) {
            let now = now();
            // Read first: written once per tick at most, whatever the rate of answers.
            if answered_at.load(Ordering::Relaxed) != now {
                answered_at.store(now, Ordering::Relaxed);
            }
        }
    }

    /// A call of `slot` on the client at `place` timed out: whether that client alone is
    /// to connect again now. Its calls of the slot's range have all timed out for
    /// `unanswered`, and a call of the range was answered on another client after its
    /// first timeout: a range silent on every client is the pool's to reconnect
    /// ([`timed_out`](Self::timed_out)), and no client reconnects alone within a period
    /// of the pool's reconnection. The caller calls
    /// [`client_reconnected`](Self::client_reconnected) when it is done.
    fn client_timed_out(&self, place: usize, slot: u16) -> bool {
        self.client_timed_out_at(place, slot, self.now())
    }

    /// [`client_timed_out`](Self::client_timed_out) at `now` (ticks, below [`ANSWERED`]).
    fn client_timed_out_at(&self, place: usize, slot: u16, now: u32) -> bool {
        let range = slot >> RANGE_BITS;
        let Some(client) = self.clients.get(place) else {
            return false;
        };
        let Some(own) = client.silence(range, now) else {
            return false; // its silence begins now
        };
        self.alone_due(client, range, own, now)
    }

    /// Whether `client`, silent on `range` since `since`, is to connect again alone at
    /// `now`: a call of the range was answered after its first timeout (a tick later at
    /// least; on another client, since an answer of its own ends its silence), and its
    /// silence has lasted the period with no reconnection under way nor within a period
    /// ([`Silence::due`]).
    fn alone_due(&self, client: &Silence, range: u16, since: u32, now: u32) -> bool {
        self.answered_since(range, since, now) && client.due(since, now, self.unanswered)
    }

    /// Whether a call of `range` was answered (on any client) after `since`, both read
    /// from `now`: an answer long before it is no later one.
    fn answered_since(&self, range: u16, since: u32, now: u32) -> bool {
        self.answered_at.get(usize::from(range)).is_some_and(|answered_at| {
            let last = answered_at.load(Ordering::Relaxed);
            last != ANSWERED && elapsed(now, last) < elapsed(now, since)
        })
    }

    /// Whether a call of `slot` is better sent on another client than the one at `place`:
    /// its calls of the slot's range have all timed out for `unanswered` (and its
    /// reconnection has not ended well since).
    fn avoids(&self, place: usize, slot: u16) -> bool {
        let Some(since) = self
            .clients
            .get(place)
            .and_then(|client| client.since(slot >> RANGE_BITS))
        else {
            return false;
        };
        // No clock read while it answers.
        since != ANSWERED && elapsed(self.now(), since) >= self.unanswered
    }

    /// Whether the client at `place`, passed over for the calls of `slot`'s range, is to
    /// connect again now: a call of the range was answered on another client after its
    /// silence began (a range silent on every client is the pool's to reconnect), and
    /// neither is its last reconnection under way nor within a period (its own or the
    /// pool's). The caller then does.
    fn reconnection_due(&self, place: usize, slot: u16) -> bool {
        let range = slot >> RANGE_BITS;
        let Some(client) = self.clients.get(place) else {
            return false;
        };
        match client.since(range) {
            Some(since) if since != ANSWERED => self.alone_due(client, range, since, self.now()),
            _ => false,
        }
    }

    /// The client at `place` connected again: its silences are over (its calls go to it
    /// again, and a new silence starts at its next timeout).
    fn client_recovered(&self, place: usize) {
        if let Some(client) = self.clients.get(place) {
            for range in 0..client.silent_since.len() {
                client.answered(range as u16);
            }
        }
    }

    /// The client at `place` answers the calls of these ranges again: their silences are
    /// over.
    fn client_recovered_ranges(&self, place: usize, ranges: &[u16]) {
        if let Some(client) = self.clients.get(place) {
            for &range in ranges {
                client.answered(range);
            }
        }
    }

    /// The reconnection of the client at `place` is over.
    fn client_reconnected(&self, place: usize) {
        if let Some(client) = self.clients.get(place) {
            client.reconnected();
        }
    }
}

/// Whether the node of `slot` answers `client` within `timeout`: a `PING` sent to it. An
/// error reply is an answer too (a user whose ACL refuses `PING`, `NOPERM`; a slot that
/// moved): the connection carries it.
async fn answers(client: &Client, slot: u16, timeout: Duration) -> Result<(), RedisError> {
    let ping = CustomCommand::new_static("PING", ClusterHash::Custom(slot), false);
    match tokio::time::timeout(timeout, client.custom::<Value, Value>(ping, Vec::new())).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(error)) if is_reply(&error) => Ok(()),
        Ok(Err(error)) => Err(RedisError::Command(error)),
        Err(_) => Err(RedisError::Timeout(timeout)),
    }
}

/// Whether `error` is an error reply of Redis (its code first, in capitals: `ERR`,
/// `NOPERM`, `MOVED`…), not one of the client's own (a timeout, a connection lost, a
/// command it could not route).
fn is_reply(error: &fred::error::Error) -> bool {
    use fred::error::ErrorKind;
    let code = error.details().split_whitespace().next().unwrap_or("");
    !matches!(error.kind(), ErrorKind::Timeout | ErrorKind::IO | ErrorKind::Canceled)
        && !code.is_empty()
        && code.bytes().all(|b| b.is_ascii_uppercase())
}

/// Which of a clustered client's silent ranges its reconnection proved (see
/// [`Connection::reconnect_client`]): the nodes of the first and the last slot of `range`
/// (two when the range is split between nodes) answered it, and so every range whose
/// slots those nodes hold is proved too, as fred's routing table has them. An error when a
/// node did not answer.
async fn proven_ranges(client: &Client, range: u16, timeout: Duration) -> Result<Vec<u16>, RedisError> {
    let ends = |range: u16| [range << RANGE_BITS, ((range + 1) << RANGE_BITS) - 1];
    for slot in ends(range) {
        answers(client, slot, timeout).await?;
    }
    let Some(routing) = client.cached_cluster_state() else {
        return Ok(vec![range]);
    };
    let proven: Vec<_> = ends(range)
        .iter()
        .filter_map(|&slot| routing.get_server(slot).cloned())
        .collect();
    let held = |slot: u16| routing.get_server(slot).is_some_and(|server| proven.contains(server));
    Ok((0..16_384 >> RANGE_BITS)
        .filter(|&other| other == range || ends(other).into_iter().all(held))
        .collect())
}

impl Silence {
    fn new(slots: usize, unanswered: u32) -> Self {
        Self {
            silent_since: (0..slots).map(|_| AtomicU32::new(ANSWERED)).collect(),
            // As if it had reconnected long enough ago.
            reconnected: AtomicU32::new(0u32.wrapping_sub(unanswered)),
            reconnecting: AtomicBool::new(false),
        }
    }

    fn answered(&self, slot: u16) {
        if let Some(silent_since) = self.silent_since.get(usize::from(slot)) {
            // Read first: no write to a line the other threads read while Redis answers.
            if silent_since.load(Ordering::Relaxed) != ANSWERED {
                silent_since.store(ANSWERED, Ordering::Relaxed);
            }
        }
    }

    /// Where `slot`'s silence began, [`ANSWERED`] for none; `None` past the slots.
    fn since(&self, slot: u16) -> Option<u32> {
        self.silent_since
            .get(usize::from(slot))
            .map(|since| since.load(Ordering::Relaxed))
    }

    /// Starts `slot`'s silence at `now` (ticks, below [`ANSWERED`]) after an answer; where
    /// the silence under way began, `None` when it begins now (or past the slots).
    fn silence(&self, slot: u16, now: u32) -> Option<u32> {
        let silent_since = self.silent_since.get(usize::from(slot))?;
        let since = silent_since.load(Ordering::Relaxed);
        if since == ANSWERED {
            // The first timeout after an answer: the silence starts now (one thread's).
            let _ = silent_since.compare_exchange(ANSWERED, now, Ordering::Relaxed, Ordering::Relaxed);
            return None;
        }
        Some(since)
    }

    /// A call of `slot` timed out at `now`: starts its silence after an answer; whether it
    /// has lasted `unanswered` and a reconnection is to start now ([`due`](Self::due)).
    fn timed_out_at(&self, slot: u16, now: u32, unanswered: u32) -> bool {
        self.silence(slot, now)
            .is_some_and(|since| self.due(since, now, unanswered))
    }

    /// Whether a silence that began at `since` has lasted `unanswered` at `now` and a
    /// reconnection is to start: at most one per `unanswered`, none while the last is under
    /// way.
    fn due(&self, since: u32, now: u32, unanswered: u32) -> bool {
        // The thread that takes `reconnecting` alone reads and writes `reconnected`.
        if elapsed(now, since) < unanswered
            || self
                .reconnecting
                .compare_exchange(false, true, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return false;
        }
        if elapsed(now, self.reconnected.load(Ordering::Relaxed)) < unanswered {
            self.reconnected();
            return false;
        }
        self.reconnected.store(now, Ordering::Relaxed);
        true
    }

    /// The reconnection [`timed_out_at`](Self::timed_out_at) asked for is over.
    fn reconnected(&self) {
        self.reconnecting.store(false, Ordering::Relaxed);
    }
}

/// The ticks from `then` to `now`, 0 when `then` is later by less than [`AHEAD`]: another
/// thread's reading of the clock, taken a moment after this one's, began a silence or a
/// reconnection.
fn elapsed(now: u32, then: u32) -> u32 {
    let ticks = now.wrapping_sub(then);
    if ticks > u32::MAX - AHEAD {
        0
    } else {
        ticks
    }
}

/// Marks the reconnection over when dropped, however its task ends: the pool's, or that of
/// the client at a place.
struct Reconnecting(Arc<Liveness>, Option<usize>);

impl Drop for Reconnecting {
    fn drop(&mut self) {
        match self.1 {
            None => self.0.reconnected(),
            Some(place) => self.0.client_reconnected(place),
        }
    }
}

/// The client or pool the limiter sends its commands through, and their deadline.
#[derive(Clone)]
pub(crate) struct Connection {
    clients: Clients,
    timeout: Duration,
    /// The timeout fred applies to every command of these clients, when the crate set it.
    fred_timeout: Option<Duration>,
    cluster: bool,
    /// The connection task of each client of a pool the crate connected, in the pool's
    /// order (see [`Connection::revive`]).
    tasks: Option<Arc<Mutex<Vec<ConnectHandle>>>>,
    /// Whether Redis still answers, for a pool the crate connected.
    liveness: Option<Arc<Liveness>>,
}

#[derive(Clone)]
enum Clients {
    One(Client),
    Pool(Pool),
}

impl Connection {
    /// Connections of a pool, used in turn, whose every command fred times out after
    /// `timeout` (its `default_command_timeout`; fred reads zero as no timeout at all).
    pub(crate) fn pool(pool: Pool, timeout: Duration, cluster: bool) -> Self {
        Self {
            clients: Clients::Pool(pool),
            timeout,
            fred_timeout: (!timeout.is_zero()).then_some(timeout),
            cluster,
            tasks: None,
            liveness: None,
        }
    }

    /// The same connections, whose clients' connection tasks (in the pool's order) the
    /// crate started: [`Connection::revive`] starts one again when it ends.
    pub(crate) fn with_tasks(mut self, tasks: Vec<ConnectHandle>) -> Self {
        self.tasks = Some(Arc::new(Mutex::new(tasks)));
        self
    }

    /// The same connections, reconnected when the calls of a slot time out and none of
    /// them has been answered for `unanswered` (see [`Liveness`]).
    pub(crate) fn with_liveness(mut self, unanswered: Duration) -> Self {
        let clients = match &self.clients {
            Clients::Pool(pool) => pool.clients().len(),
            Clients::One(_) => 0,
        };
        self.liveness = Some(Arc::new(Liveness::new(unanswered, self.cluster, clients)));
        self
    }

    /// What a decision call of `slot` came to: answered, timed out (see
    /// [`timed_out`](Self::timed_out)) or another error, which tells nothing of whether
    /// Redis answers.
    pub(crate) fn saw<T>(&self, slot: u16, result: &Result<T, RedisError>) {
        match result {
            Ok(_) => self.answered(slot),
            Err(RedisError::Timeout(_)) => self.timed_out(slot),
            Err(_) => {}
        }
    }

    /// A decision call of `slot` was answered.
    fn answered(&self, slot: u16) {
        if let Some(liveness) = &self.liveness {
            liveness.answered(slot);
        }
    }

    /// A decision call of `slot` timed out: when the slot's calls have kept timing out for
    /// `unanswered` (see [`Liveness`]), the pool reconnects, in a task of its own. On a
    /// standalone or Sentinel-managed server, each client reconnects (asking the sentinels
    /// for the primary again), after fred's reconnection delay; on a cluster, each client
    /// reads the cluster's slots again and connects to the nodes that now own them,
    /// leaving its other connections as they are.
    fn timed_out(&self, slot: u16) {
        let (Some(liveness), Clients::Pool(pool)) = (&self.liveness, &self.clients) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !liveness.timed_out(slot) {
            return;
        }
        tracing::warn!(
            slot,
            "Redis answered no call of this hash slot for {}ms: reconnecting (a primary that stopped \
             answering without closing its connections, or an unreachable one)",
            u128::from(liveness.unanswered) * TICK_MS
        );
        let (pool, cluster, done) = (pool.clone(), self.cluster, Reconnecting(liveness.clone(), None));
        runtime.spawn(async move {
            // Marks the reconnection over when the task ends, however it ends.
            let held = done;
            let result = if cluster {
                join_all(pool.clients().iter().map(|client| client.sync_cluster()))
                    .await
                    .into_iter()
                    .collect::<Result<Vec<()>, _>>()
                    .map(drop)
            } else {
                pool.force_reconnection().await
            };
            match result {
                // Every client connected again (a cluster's reading of its slots leaves
                // the connections to nodes that keep theirs as they were: their silences
                // stay).
                Ok(()) if !cluster => {
                    for place in 0..pool.clients().len() {
                        held.0.client_recovered(place);
                    }
                }
                Ok(()) => {}
                Err(error) => tracing::debug!(%error, "a forced reconnection failed; fred keeps trying"),
            }
        });
    }

    /// What a decision call of `slot` on the client at `place` (see
    /// [`next_placed`](Self::next_placed)) came to, as [`saw`](Self::saw) for the client
    /// alone: when its calls of the slot's range have all timed out for `unanswered` while
    /// a call of the range was answered on another client (see [`Liveness`]), that client
    /// connects again, in a task of its own, after fred's reconnection delay (on a
    /// cluster, reading the cluster's slots again, which keeps every connection that shows
    /// no error: there it ends well for a range only once the range's nodes answer a `PING`
    /// through the client, see [`proven_ranges`]); the other clients' calls are not
    /// interrupted. Until that reconnection ends well,
    /// [`next_placed`](Self::next_placed) sends the range's calls to the others.
    pub(crate) fn client_saw<T>(&self, place: Option<usize>, slot: u16, result: &Result<T, RedisError>) {
        let (Some(liveness), Some(place), Clients::Pool(pool)) = (&self.liveness, place, &self.clients) else {
            return;
        };
        match result {
            Ok(_) => liveness.client_answered(place, slot),
            Err(RedisError::Timeout(_)) => {
                if liveness.client_timed_out(place, slot) {
                    self.reconnect_client(pool, liveness, place, slot);
                }
            }
            Err(_) => {}
        }
    }

    /// Connects the client at `place` again, in a task of its own, its reconnection taken
    /// ([`Liveness::client_timed_out`] or [`Silence::due`]); a success ends its silences (on
    /// a cluster, those of the ranges whose nodes answered it, see [`proven_ranges`]).
    fn reconnect_client(&self, pool: &Pool, liveness: &Arc<Liveness>, place: usize, slot: u16) {
        // A client whose connection task ended reads no command, the reconnection's
        // neither: started again first.
        self.revive();
        let Some(client) = pool.clients().get(place) else {
            liveness.client_reconnected(place);
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            liveness.client_reconnected(place);
            return;
        };
        tracing::warn!(
            client = %client.id(),
            slot,
            "Redis answered no call of this hash slot on this connection for {}ms while it answered \
             the others: connecting it again (a connection whose packets are lost)",
            u128::from(liveness.unanswered) * TICK_MS
        );
        let (client, done) = (client.clone(), Reconnecting(liveness.clone(), Some(place)));
        let liveness = liveness.clone();
        let (cluster, timeout) = (self.cluster, self.timeout);
        // Not bounded: a connection task waiting on a socket that takes no more bytes reads
        // the reconnection's command only once TCP gives up, and a command sent again would
        // only be one more reconnection then. Until it ends the client is passed over (its
        // silence lasts), and no other is asked for; after a failure, the next is asked for
        // a period later, when a call passes it over (`next_placed`).
        runtime.spawn(async move {
            let _done = done;
            let result = match client.force_reconnection().await {
                // A clustered client's reconnection reads the cluster's slots again and keeps
                // every connection that shows no error, a stuck one too: the client is back
                // for a range only once the nodes of the range answer it within the deadline,
                // and for the other ranges of those nodes with it (before, it was sent every
                // range's calls again, which timed out until the period passed once more, a
                // third of them answered by the failure policy for as long as the
                // connection stayed stuck).
                Ok(()) if cluster => proven_ranges(&client, slot >> RANGE_BITS, timeout).await.map(Some),
                Ok(()) => Ok(None),
                Err(error) => Err(RedisError::Command(error)),
            };
            match result {
                Ok(Some(ranges)) => liveness.client_recovered_ranges(place, &ranges),
                Ok(None) => liveness.client_recovered(place),
                Err(error) => tracing::debug!(%error, "a forced reconnection failed; fred keeps trying"),
            }
        });
    }

    /// Starts again the connection task of any client of the pool whose task ended. fred
    /// ends a client's task on some errors of its own (on a cluster, when it gives up
    /// following `ASK`, see `docs/redis.md`), and does not start it again: every later
    /// command of that client would wait in vain for its deadline, and the failure policy
    /// would answer a share of the decisions for as long as the process runs. Called after
    /// a failed call; a client the application connected is its own.
    pub(crate) fn revive(&self) {
        let (Some(tasks), Clients::Pool(pool)) = (&self.tasks, &self.clients) else {
            return;
        };
        let mut tasks = tasks.lock().unwrap_or_else(PoisonError::into_inner);
        for (task, client) in tasks.iter_mut().zip(pool.clients()) {
            if task.is_finished() {
                tracing::warn!(
                    client = %client.id(),
                    "a Redis client's connection task ended; connecting it again"
                );
                *task = client.connect();
            }
        }
    }

    /// A client the application already connected, with the default deadline.
    pub(crate) fn client(client: Client) -> Self {
        let cluster = client.is_clustered();
        Self {
            clients: Clients::One(client),
            timeout: DEFAULT_TIMEOUT,
            fred_timeout: None,
            cluster,
            tasks: None,
            liveness: None,
        }
    }

    /// Whether fred already times out every command after the deadline, so that a command
    /// needs no timeout of its own.
    pub(crate) fn fred_keeps_the_deadline(&self) -> bool {
        self.fred_timeout == Some(self.timeout)
    }

    /// The same connections with another deadline.
    pub(crate) fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The client for the next command.
    pub(crate) fn next(&self) -> &Client {
        match &self.clients {
            Clients::One(c) => c,
            Clients::Pool(p) => p.next(),
        }
    }

    /// The client for a decision call of `slot`, and its place in the pool when its calls
    /// are watched (a pool the crate connected): what the call came to is then told
    /// [`client_saw`](Self::client_saw). The pool's next client, or the next after it not
    /// passed over when that one's calls of the slot have all timed out for the period and
    /// its reconnection has not ended well since (see [`Liveness`]); the next client when
    /// every one is passed over (a primary that stopped answering: the pool's reconnection
    /// is then under way).
    pub(crate) fn next_placed(&self, slot: u16) -> (&Client, Option<usize>) {
        let (Clients::Pool(pool), Some(liveness)) = (&self.clients, &self.liveness) else {
            return (self.next(), None);
        };
        let clients = pool.clients();
        let first = pool.next();
        let Some(place) = clients.iter().position(|c| std::ptr::eq(c, first)) else {
            return (first, None);
        };
        if !liveness.avoids(place, slot) {
            return (first, Some(place));
        }
        let Some(other) = (1..clients.len())
            .map(|step| (place + step) % clients.len())
            .find(|&other| !liveness.avoids(other, slot))
        else {
            return (first, Some(place)); // every client silent: the pool's to reconnect
        };
        // The clients passed over take no call, so no timeout of theirs asks for their
        // reconnection again after one that failed: the call that passes them over does,
        // once per period at most.
        let mut skipped = place;
        while skipped != other {
            if liveness.reconnection_due(skipped, slot) {
                self.reconnect_client(pool, liveness, skipped, slot);
            }
            skipped = (skipped + 1) % clients.len();
        }
        (&clients[other], Some(other))
    }

    /// The deadline of one call.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether the connections go to a Redis Cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// Awaits `command` within the deadline.
    pub(crate) async fn within_deadline<T>(
        &self,
        command: impl Future<Output = Result<T, fred::error::Error>>,
    ) -> Result<T, RedisError> {
        self.within(self.timeout, command).await
    }

    /// Awaits `command` within `bound` (what is left of the deadline); a command that
    /// outlasts it is a [`RedisError::Timeout`] of the deadline.
    pub(crate) async fn within<T>(
        &self,
        bound: Duration,
        command: impl Future<Output = Result<T, fred::error::Error>>,
    ) -> Result<T, RedisError> {
        let result = match tokio::time::timeout(bound, command).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(e)) => RedisError::command(e),
            Err(_) => RedisError::Timeout(self.timeout),
        };
        self.revive();
        Err(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error reply of Redis is an answer (the connection carries it); the client's own
    /// errors are not.
    #[test]
    fn an_error_reply_is_an_answer() {
        use fred::error::{Error, ErrorKind};
        let answered = |kind, details: &str| is_reply(&Error::new(kind, details.to_owned()));
        assert!(answered(
            ErrorKind::Unknown,
            "NOPERM User limiter has no permissions to run the 'ping' command"
        ));
        assert!(answered(ErrorKind::Unknown, "ERR unknown command"));
        assert!(answered(ErrorKind::Cluster, "MOVED 3999 127.0.0.1:6381"));
        assert!(!answered(ErrorKind::Unknown, "Failed to route command."));
        assert!(!answered(ErrorKind::Timeout, "Request timed out."));
        assert!(!answered(ErrorKind::IO, "ERR connection reset"));
        assert!(!answered(ErrorKind::Canceled, "CANCELED"));
        assert!(!answered(ErrorKind::Unknown, ""));
    }

    /// A slot's calls keep timing out for `unanswered`: the pool reconnects, then not again
    /// within `unanswered` nor while that reconnection is under way; an answer starts the
    /// silence over; other slots keep their own.
    #[test]
    fn a_slot_silent_for_the_whole_period_reconnects_the_pool_once_per_period() {
        // 1,600 ms: 100 ticks. The first timeout after answers starts the silence.
        let liveness = Liveness::new(Duration::from_millis(1600), true, 3);
        assert!(!liveness.timed_out_at(7, 1000));
        assert!(!liveness.timed_out_at(7, 1050));
        assert!(!liveness.timed_out_at(7, 1099));
        assert!(liveness.timed_out_at(7, 1100), "silent for the whole period");
        assert!(!liveness.timed_out_at(7, 1150), "reconnected already");
        assert!(!liveness.timed_out_at(7, 1200), "the reconnection is under way");
        liveness.reconnected();
        assert!(liveness.timed_out_at(7, 1201), "still silent once it is over");
        liveness.reconnected();
        // An answer: the next timeout starts the silence over.
        liveness.answered(7);
        assert!(!liveness.timed_out_at(7, 1500));
        assert!(!liveness.timed_out_at(7, 1599));
        assert!(liveness.timed_out_at(7, 1600));
        liveness.reconnected();
        // Another slot, answered meanwhile, starts its own silence at its first timeout.
        assert!(!liveness.timed_out_at(9, 1600));
        assert!(!liveness.timed_out_at(9, 1650));
        // Past the end of the slots: never.
        assert!(!liveness.timed_out_at(16_384, 5000));
    }

    /// One reconnection for all slots per period: a cluster whose primary of many slots
    /// stops answering reconnects once, not once per slot.
    #[test]
    fn silent_slots_reconnect_the_pool_once_per_period_between_them() {
        let liveness = Liveness::new(Duration::from_millis(1600), true, 3);
        for slot in 0..10 {
            assert!(!liveness.timed_out_at(slot, 0));
        }
        let reconnections = (0..10).filter(|&slot| liveness.timed_out_at(slot, 100)).count();
        assert_eq!(reconnections, 1);
        // The standalone server's single slot, and the clock's wrapping.
        let liveness = Liveness::new(Duration::from_millis(1600), false, 3);
        assert!(!liveness.timed_out_at(0, ANSWERED - 51));
        assert!(liveness.timed_out_at(0, 49), "100 ticks later, across the wrap");
        assert!(!liveness.timed_out_at(1, 500), "one slot only");
        // A period not a whole number of ticks is rounded up.
        assert_eq!(Liveness::new(Duration::from_secs(1), false, 3).unanswered, 63);
    }

    /// A client whose calls of a slot keep timing out for the period while the slot's
    /// calls on the others are answered connects again alone, once per period; not while
    /// no call of the slot is answered after its first timeout (the whole slot silent: the
    /// pool's to reconnect), nor after an answer of its own.
    #[test]
    fn a_client_silent_while_the_others_answer_connects_again_alone() {
        let liveness = Liveness::new(Duration::from_millis(1600), false, 3);
        liveness.client_answered_at(1, 0, 990);
        // Client 1's first timeout at 1000; client 0 answers after it.
        assert!(!liveness.client_timed_out_at(1, 0, 1000));
        liveness.client_answered_at(0, 0, 1001);
        assert!(!liveness.client_timed_out_at(1, 0, 1050));
        assert!(
            !liveness.client_timed_out_at(1, 0, 1099),
            "silent for less than the period"
        );
        assert!(
            liveness.client_timed_out_at(1, 0, 1100),
            "silent for the period, the others answered"
        );
        assert!(
            !liveness.client_timed_out_at(1, 0, 1150),
            "its reconnection is under way"
        );
        liveness.client_reconnected(1);
        assert!(!liveness.client_timed_out_at(1, 0, 1160), "once per period");
        assert!(liveness.client_timed_out_at(1, 0, 1200), "still silent a period later");
        liveness.client_reconnected(1);
        // An answer of its own starts its silence over.
        liveness.client_answered_at(1, 0, 1250);
        assert!(!liveness.client_timed_out_at(1, 0, 1300));
        // No answer since, on any client (the slot silent on all): the pool's to reconnect.
        assert!(!liveness.client_timed_out_at(2, 0, 1310));
        assert!(
            !liveness.client_timed_out_at(1, 0, 1400),
            "the slot is silent on every client"
        );
        assert!(!liveness.client_timed_out_at(2, 0, 1410));
        // An answer in the tick the silence began tells nothing: it may be older.
        liveness.client_answered_at(0, 0, 1300);
        assert!(!liveness.client_timed_out_at(1, 0, 1450));
        // Then one after it.
        liveness.client_answered_at(0, 0, 1301);
        assert!(liveness.client_timed_out_at(1, 0, 1460));
        liveness.client_reconnected(1);
        // Places past the pool's: never.
        assert!(!liveness.client_timed_out_at(3, 0, 5000));
        // Without clients (a client the application connected): nothing watched per client.
        let alone = Liveness::new(Duration::from_millis(1600), false, 0);
        alone.client_answered_at(0, 0, 10);
        assert!(!alone.client_timed_out_at(0, 0, 5000));
    }

    /// The pool's reconnection counts as every client's: none reconnects alone during it
    /// nor for a period after, though the first back answers while another still times
    /// out.
    #[test]
    fn no_client_reconnects_alone_during_or_just_after_the_pools_reconnection() {
        let liveness = Liveness::new(Duration::from_millis(1600), false, 3);
        // Every client silent from 1000: the pool reconnects at 1100.
        for place in 0..3 {
            assert!(!liveness.client_timed_out_at(place, 0, 1000));
        }
        assert!(!liveness.timed_out_at(0, 1000));
        assert!(liveness.timed_out_at(0, 1100));
        // Client 0 is back first; client 2 still times out, silent since 1000.
        liveness.client_answered_at(0, 0, 1150);
        assert!(
            !liveness.client_timed_out_at(2, 0, 1160),
            "the pool's reconnection is under way"
        );
        liveness.reconnected();
        assert!(
            !liveness.client_timed_out_at(2, 0, 1170),
            "within a period of the pool's"
        );
        assert!(liveness.client_timed_out_at(2, 0, 1200), "a period after it, alone");
    }

    /// On a cluster a client's calls are watched per range of 64 neighbouring slots: the
    /// slots of one node's range share a silence, another range has its own.
    #[test]
    fn a_clients_calls_are_watched_per_range_of_slots_on_a_cluster() {
        let liveness = Liveness::new(Duration::from_millis(1600), true, 2);
        assert!(!liveness.client_timed_out_at(1, 0, 1000));
        liveness.client_answered_at(0, 63, 1001);
        assert!(!liveness.client_timed_out_at(1, 64, 1050), "another range");
        assert!(liveness.client_timed_out_at(1, 63, 1100), "slots 0 and 63: one range");
        liveness.client_reconnected(1);
        // Range 1 (slot 64) began its silence at 1050 and no call of it was answered since.
        assert!(!liveness.client_timed_out_at(1, 127, 1300));
        // The last slot is in the last range.
        assert!(!liveness.client_timed_out_at(1, 16_383, 1300));
        liveness.client_answered_at(0, 16_320, 1301);
        assert!(liveness.client_timed_out_at(1, 16_383, 1400));
    }

    /// A client whose calls of a range have all timed out for the period is passed over
    /// until its reconnection ends well (or it answers); no decision goes to it as a probe.
    #[test]
    fn a_silent_client_is_passed_over_until_it_connects_again() {
        let liveness = Liveness::new(Duration::from_millis(1600), false, 2);
        assert!(!liveness.avoids(1, 0), "answering");
        let now = liveness.now();
        assert!(!liveness.client_timed_out_at(1, 0, now));
        assert!(!liveness.avoids(1, 0), "silent for less than the period");
        let long_ago = now.wrapping_sub(100);
        liveness.clients[1].silent_since[0].store(long_ago, Ordering::Relaxed);
        assert!(liveness.avoids(1, 0), "silent for the period");
        assert!(liveness.avoids(1, 0), "and still, whatever the calls asking");
        assert!(!liveness.avoids(0, 0), "the other client answers");
        liveness.client_recovered(1);
        assert!(!liveness.avoids(1, 0), "connected again");
        liveness.clients[1].silent_since[0].store(long_ago, Ordering::Relaxed);
        liveness.client_answered_at(1, 0, now);
        assert!(!liveness.avoids(1, 0), "answered");
        assert!(!liveness.avoids(5, 0), "past the pool's places");
    }

    /// A client passed over takes no call, so no timeout of its own asks for its
    /// reconnection after one that failed: the calls passing it over do, once per period,
    /// while another client answers.
    #[test]
    fn a_client_passed_over_is_connected_again_once_per_period() {
        let liveness = Liveness::new(Duration::from_millis(1600), false, 2);
        assert!(!liveness.reconnection_due(1, 0), "answering");
        let now = liveness.now();
        liveness.clients[1].silent_since[0].store(now.wrapping_sub(200), Ordering::Relaxed);
        assert!(
            !liveness.reconnection_due(1, 0),
            "no call answered since its silence began: every client silent, the pool's to reconnect"
        );
        liveness.client_answered_at(0, 0, now.wrapping_sub(100));
        assert!(
            liveness.reconnection_due(1, 0),
            "silent for the period, never reconnected"
        );
        assert!(!liveness.reconnection_due(1, 0), "its reconnection is under way");
        liveness.client_reconnected(1); // it failed
        assert!(!liveness.reconnection_due(1, 0), "within a period of the last");
        let now = liveness.now();
        liveness.clients[1]
            .reconnected
            .store(now.wrapping_sub(100), Ordering::Relaxed);
        assert!(liveness.reconnection_due(1, 0), "a period later");
        liveness.client_reconnected(1);
        liveness.client_recovered(1);
        assert!(!liveness.reconnection_due(1, 0), "connected again");
    }

    /// An answer long before a client's silence began (more than [`AHEAD`] earlier) is no
    /// answer after it.
    #[test]
    fn an_answer_long_before_the_silence_is_not_after_it() {
        let liveness = Liveness::new(Duration::from_millis(1600), false, 2);
        liveness.client_answered_at(0, 0, 1000);
        assert_eq!(
            liveness.answered_at[0].load(Ordering::Relaxed),
            ANSWERED,
            "no client silent: the answer tells nothing, the clock is not read"
        );
        let later = 1000 + AHEAD + 10;
        assert!(!liveness.client_timed_out_at(1, 0, later));
        assert!(
            !liveness.client_timed_out_at(1, 0, later + 100),
            "nothing answered since"
        );
        liveness.client_answered_at(0, 0, later + 101);
        assert!(liveness.client_timed_out_at(1, 0, later + 102));
    }

    /// The watch still reconnects after years without a reconnection: a tick far behind
    /// is read as long ago, not as one a moment ahead.
    #[test]
    fn the_pool_still_reconnects_after_years_without_a_reconnection() {
        let liveness = Liveness::new(Duration::from_millis(1600), false, 1);
        // 2^31 ticks: about 398 days after the start.
        let later = 1u32 << 31;
        assert!(!liveness.timed_out_at(0, later));
        assert!(liveness.timed_out_at(0, later + 100));
        liveness.reconnected();
        // Close to the wrap (about 2.18 years).
        let late = u32::MAX - (1 << 17);
        liveness.answered(0);
        assert!(!liveness.timed_out_at(0, late));
        assert!(liveness.timed_out_at(0, late + 100));
    }

    /// A silence or a reconnection begun at a tick later than a thread's own reading of
    /// the clock (another thread read it a moment after) counts as just begun, not as one
    /// that began two years ago.
    #[test]
    fn a_tick_read_later_by_another_thread_is_no_old_silence() {
        let liveness = Liveness::new(Duration::from_millis(1600), false, 1);
        assert!(!liveness.timed_out_at(0, 1001), "the silence begins at 1001");
        assert!(!liveness.timed_out_at(0, 1000), "a reading of 1000, made before");
        assert!(liveness.timed_out_at(0, 1101));
        liveness.reconnected();
        assert!(
            !liveness.timed_out_at(0, 1100),
            "reconnected at 1101, after this reading"
        );
        assert_eq!(elapsed(5, u32::MAX - 1), 7, "across the wrap");
        assert_eq!(elapsed(5, 6), 0);
    }

    /// fred reads a zero command timeout as none: a zero deadline is then kept by the
    /// limiter's own timer, never left to fred.
    #[test]
    fn fred_keeps_only_a_deadline_it_applies() {
        let pool = || fred::types::Builder::default_centralized().build_pool(1).unwrap();
        assert!(Connection::pool(pool(), Duration::from_millis(50), false).fred_keeps_the_deadline());
        assert!(!Connection::pool(pool(), Duration::ZERO, false).fred_keeps_the_deadline());
        let other = Connection::pool(pool(), Duration::from_millis(50), false).with_timeout(Duration::from_secs(1));
        assert!(!other.fred_keeps_the_deadline());
        assert!(!Connection::client(fred::clients::Client::default()).fred_keeps_the_deadline());
    }
}
