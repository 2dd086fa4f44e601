//! The scripts, joined from the files of `lua/`, and how they run: `EVALSHA` within the
//! deadline; after `NOSCRIPT`, the script loaded again and the call made again within the
//! rest of it.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use fred::clients::Client;
use fred::error::ErrorKind;
use fred::interfaces::{ClientLike, LuaInterface, TransactionInterface};
use fred::types::scripts::Script;
use fred::types::{ClusterHash, CustomCommand, Key, Value};

use crate::connection::Connection;
use crate::error::RedisError;
use crate::protocol::{DecideArgs, Numbers, RefundArgs, RefundReply, Reply, Shape};
use crate::request::Keys;
use crate::rule_script::{Loaded, RuleScript};

/// The general decision script (see `lua/README.md`): every band of every rule of a
/// request, of any algorithm, all or nothing. The build script joins it from the files of
/// `lua/`.
pub const DECIDE_LUA: &str = include_str!(concat!(env!("OUT_DIR"), "/decide.lua"));

/// The decision script of a request of one token-bucket rule of one band
/// (`lua/one_token_bucket.lua`): the common case, decided as [`DECIDE_LUA`] would, with
/// fewer arguments and at less cost.
pub const ONE_TOKEN_BUCKET_LUA: &str = include_str!(concat!(env!("OUT_DIR"), "/one_token_bucket.lua"));

/// The decision script of a request whose rules are all token buckets
/// (`lua/token_buckets.lua`, after `lua/layout.lua`): decided as [`DECIDE_LUA`] would, at
/// less cost.
pub const TOKEN_BUCKETS_LUA: &str = include_str!(concat!(env!("OUT_DIR"), "/token_buckets.lua"));

/// The batch script (`lua/batch.lua`, after the three decision scripts, each made a
/// function): the requests of one batch, each decided in turn as its own script would
/// decide it, in one call. See [`Batching`](crate::Batching).
pub const BATCH_LUA: &str = include_str!(concat!(env!("OUT_DIR"), "/batch.lua"));

/// The refund script, for requests that a cluster's hash slots decided differently: the
/// general script's parts, with `refund.lua` last.
pub const REFUND_LUA: &str = include_str!(concat!(env!("OUT_DIR"), "/refund.lua"));

/// Loads `script` on `client`'s server; on a cluster, on each primary with a command of
/// its own. Not with fred's command to every primary (`Script::load`): fred's client waits
/// for its other commands' replies before it, then for each primary's answer to it, and
/// sends nothing else meanwhile, so that a primary that does not answer holds the client's
/// calls to every other primary as well, past their deadline. Each load is timed out by
/// fred after `bound`, or after the decision deadline (the pool's default) without one.
async fn load_on_each_primary(
    client: &Client,
    script: &Script,
    bound: Option<Duration>,
) -> Result<(), fred::error::Error> {
    use fred::interfaces::ClusterInterface;
    // Each primary of a cluster, or the server alone. A cluster whose slots fred has not
    // read yet (never after `connect`) gets fred's command to every primary.
    let nodes = match client.cached_cluster_state() {
        _ if !client.is_clustered() => vec![None],
        Some(state) => state.unique_primary_nodes().into_iter().map(Some).collect(),
        None => Vec::new(),
    };
    let Some(lua) = script.lua().filter(|_| !nodes.is_empty()) else {
        return script.load(client).await;
    };
    let loads = nodes.into_iter().map(|cluster_node| {
        let node = crate::connection::on_node(client, cluster_node, bound);
        let args = vec![Value::from_static_str("LOAD"), Value::String(lua.clone())];
        async move {
            node.custom::<Value, _>(CustomCommand::new_static("SCRIPT", ClusterHash::Random, false), args)
                .await
        }
    });
    for loaded in futures_util::future::join_all(loads).await {
        loaded?;
    }
    Ok(())
}

/// Loads `script` where `key` lives: on a cluster, on the primary of its hash slot alone,
/// with a command of its own (see [`load_on_each_primary`]), so that a call made again
/// after `NOSCRIPT` waits for no other primary; elsewhere on the server.
async fn load_where(client: &Client, script: &Script, key: Option<&str>) -> Result<(), fred::error::Error> {
    use fred::interfaces::ClusterInterface;
    let primary = key.filter(|_| client.is_clustered()).and_then(|key| {
        let slot = fred::util::redis_keyslot(key.as_bytes());
        client.cached_cluster_state()?.get_server(slot).cloned()
    });
    match (primary, script.lua()) {
        (Some(primary), Some(lua)) => {
            let args = vec![Value::from_static_str("LOAD"), Value::String(lua.clone())];
            let load = CustomCommand::new_static("SCRIPT", ClusterHash::Random, false);
            client.with_cluster_node(primary).custom::<Value, _>(load, args).await?;
            Ok(())
        }
        _ => script.load(client).await,
    }
}

/// Whether Redis failed a call for want of its script (`NOSCRIPT`: a restart, a failover,
/// `SCRIPT FLUSH`).
pub(crate) fn missing_script(error: &RedisError) -> bool {
    matches!(error, RedisError::Command(e) if e.details().starts_with("NOSCRIPT"))
}

/// Whether fred could not take a call to its node: on a cluster, a slot being migrated
/// answers `ASK` for a key it no longer holds, and fred 10 sends `ASKING` to the slot's new
/// node but the call again to the old one, until it gives up. No node ran the call.
fn lost_redirection(error: &RedisError) -> bool {
    matches!(error, RedisError::Command(e) if *e.kind() == ErrorKind::Routing)
}

/// Whether a decision call that failed with `error` is made again on its own within the
/// rest of the deadline ([`Scripts::decide_again`]): after `NOSCRIPT`; on a cluster, after
/// a redirection fred did not follow, and after `TRYAGAIN` (a call of several keys of a
/// migrating slot, some moved already: a batch's, or a rule's bands'), which no node ran
/// either. Alone, a request of one key is run where its key is.
pub(crate) fn decided_again(error: &RedisError, cluster: bool) -> bool {
    let try_again = matches!(error, RedisError::Command(e) if e.details().starts_with("TRYAGAIN"));
    missing_script(error) || (cluster && (lost_redirection(error) || try_again))
}

/// The scripts and the connections they run on.
pub(crate) struct Scripts {
    connection: Connection,
    decide: Script,
    one_token_bucket: Script,
    token_buckets: Script,
    refund: Script,
    batch: Script,
    /// The rules' own scripts loaded on `connection` (see [`crate::rule_script`]).
    rule_scripts: Arc<Loaded>,
    migrating: Migrating,
}

/// The hash slots of a cluster found migrating (a call of theirs failed with a redirection
/// fred did not follow), each until an instant: their calls go in a transaction
/// ([`asking`]) meanwhile, not as commands of their own, which fred would send to the
/// slot's old node until it gave up and ended its client's connection task.
#[derive(Default)]
struct Migrating {
    /// How many slots are listed: what a call of another slot reads, and no lock.
    count: AtomicUsize,
    slots: Mutex<Vec<(u16, Instant)>>,
}

impl Migrating {
    /// How long a slot found migrating is taken as migrating: then one call of its own
    /// finds out again.
    const FOR: Duration = Duration::from_secs(5);

    fn lock(&self) -> MutexGuard<'_, Vec<(u16, Instant)>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lists the slot of `key` from now.
    fn found(&self, key: &str) {
        let slot = fred::util::redis_keyslot(key.as_bytes());
        let now = Instant::now();
        let mut slots = self.lock();
        slots.retain(|&(s, end)| s != slot && end > now);
        slots.push((slot, now + Self::FOR));
        self.count.store(slots.len(), Ordering::Relaxed);
    }

    /// Whether the slot of `key` is listed.
    fn holds(&self, key: Option<&String>) -> bool {
        if self.count.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let Some(key) = key else { return false };
        let slot = fred::util::redis_keyslot(key.as_bytes());
        let now = Instant::now();
        let mut slots = self.lock();
        slots.retain(|&(_, end)| end > now);
        self.count.store(slots.len(), Ordering::Relaxed);
        slots.iter().any(|&(s, _)| s == slot)
    }
}

impl Scripts {
    /// The scripts over `connection`, not loaded yet.
    pub(crate) fn new(connection: Connection) -> Self {
        Self {
            connection,
            decide: Script::from_lua(DECIDE_LUA),
            one_token_bucket: Script::from_lua(ONE_TOKEN_BUCKET_LUA),
            token_buckets: Script::from_lua(TOKEN_BUCKETS_LUA),
            refund: Script::from_lua(REFUND_LUA),
            batch: Script::from_lua(BATCH_LUA),
            rule_scripts: Arc::default(),
            migrating: Migrating::default(),
        }
    }

    /// Whether the hash slot of `keys` was found migrating lately: its calls then go in a
    /// transaction of their own ([`Scripts::decide`]), not in a batch.
    pub(crate) fn migrating(&self, keys: &Keys) -> bool {
        self.migrating.holds(keys.first())
    }

    /// Loads the scripts (on every primary of a cluster), each load within `bound`: a
    /// script is compiled as it loads, which a busy server may take longer to do than a
    /// decision's deadline allows.
    ///
    /// # Errors
    ///
    /// [`RedisError::Connect`] when Redis does not take them.
    pub(crate) async fn load(&self, bound: Duration) -> Result<(), RedisError> {
        for script in [
            &self.decide,
            &self.one_token_bucket,
            &self.token_buckets,
            &self.refund,
            &self.batch,
        ] {
            load_on_each_primary(self.connection.next(), script, Some(bound))
                .await
                .map_err(RedisError::Connect)?;
        }
        Ok(())
    }

    /// The connections the scripts run on.
    pub(crate) fn connection(&self) -> &Connection {
        &self.connection
    }

    /// The SHA-1 of the general decision script.
    pub(crate) fn decide_sha1(&self) -> &str {
        self.decide.sha1()
    }

    /// One decision call: `keys` (one per token-bucket rule, one per band of the other
    /// algorithms) and their arguments, sent to the script of their [`Shape`], bounded by
    /// the deadline. The keys and arguments go to Redis as they are, not copied for a
    /// second try: after `NOSCRIPT` ([`missing_script`]) the caller makes them again and
    /// calls [`Scripts::decide_again`].
    ///
    /// # Errors
    ///
    /// [`RedisError::Command`] when Redis fails the call (`NOSCRIPT` among them),
    /// [`RedisError::Timeout`] when it does not answer in time, and [`RedisError::Reply`]
    /// for a reply of the wrong shape.
    pub(crate) async fn decide(&self, slot: u16, keys: Keys, args: &DecideArgs) -> Result<Reply, RedisError> {
        let timeout = self.connection.timeout();
        if self.migrating(&keys) {
            let (script, argv) = self.decision(args);
            let (client, place) = self.connection.next_placed(slot);
            let call = Box::pin(asking_again(client, script, keys, argv));
            let reply = self.connection.within(timeout, call).await;
            self.connection.client_saw(place, slot, &reply);
            return Self::read(args, &numbers(reply?)?);
        }
        let (script, argv) = match self.own_script(args) {
            // A rule's own script not loaded on this limiter's connections yet: loaded in a
            // task of its own ([`Scripts::load_later`]), and meanwhile the call goes to the
            // shared one-band script with its arguments, as a rule past the process's rule
            // scripts does; and so do the rule's later calls when Redis refused the user
            // the load (`NOPERM`, see [`Scripts::own_script`]).
            Some((rule, _)) if !self.rule_scripts.holds(rule) => {
                self.load_later(rule, false);
                let argv = args.one_token_bucket_argv().unwrap_or_default();
                (&self.one_token_bucket, argv)
            }
            _ => self.decision(args),
        };
        // fred's future is large: boxed once here (as in `run`), so that the futures around
        // it stay small.
        let (client, place) = self.connection.next_placed(slot);
        let call = Box::pin(client.evalsha::<Value, _, _, _>(script.sha1().clone(), fred_keys(keys), argv));
        let reply = self.bounded(call, timeout).await;
        self.connection.client_saw(place, slot, &reply);
        Self::read(args, &numbers(reply?)?)
    }

    /// A decision call after `error` ([`decided_again`]), made again within `remaining`,
    /// what is left of the deadline:
    /// - after `NOSCRIPT` (a restart, a failover, `SCRIPT FLUSH`), the script loaded (on a
    ///   cluster, on the primary of the call's slot alone, [`load_where`]), then the call;
    /// - on a cluster, after a redirection fred did not follow (its slot migrating, `ASK`)
    ///   or `TRYAGAIN`, the call alone in a transaction ([`asking`]), which fred sends
    ///   after `ASKING` to the slot's new node; the slot's calls go so for a while
    ///   ([`Scripts::migrating`]).
    ///
    /// # Errors
    ///
    /// As [`Scripts::decide`].
    pub(crate) async fn decide_again(
        &self,
        slot: u16,
        keys: Keys,
        args: &DecideArgs,
        remaining: Duration,
        error: &RedisError,
    ) -> Result<Reply, RedisError> {
        let (script, argv) = self.decision(args);
        // A client passed over is passed over here too (see `Connection::next_placed`).
        let (client, _) = self.connection.next_placed(slot);
        let reply = if missing_script(error) {
            let first = keys.first().cloned();
            let again = async {
                load_where(client, script, first.as_deref()).await?;
                client
                    .evalsha::<Value, _, _, _>(script.sha1().clone(), fred_keys(keys), argv)
                    .await
            };
            self.connection.within(remaining, Box::pin(again)).await?
        } else {
            if let Some(key) = keys.first() {
                self.migrating.found(key);
            }
            let again = asking_again(client, script, keys, argv);
            self.connection.within(remaining, Box::pin(again)).await?
        };
        Self::read(args, &numbers(reply)?)
    }

    /// A decision call with keys the caller keeps: [`Scripts::decide`], then after
    /// `NOSCRIPT` [`Scripts::decide_again`] within the rest of the deadline.
    ///
    /// # Errors
    ///
    /// As [`Scripts::decide`].
    pub(crate) async fn decide_kept(&self, slot: u16, keys: &[String], args: &DecideArgs) -> Result<Reply, RedisError> {
        let start = Instant::now();
        match self.decide(slot, Keys::from(keys), args).await {
            Err(e) if decided_again(&e, self.connection.is_cluster()) => {
                let remaining = self.connection.timeout().saturating_sub(start.elapsed());
                self.decide_again(slot, Keys::from(keys), args, remaining, &e).await
            }
            result => result,
        }
    }

    /// The number of the batch script's function for `args` (`lua/batch.lua`) and its
    /// `ARGV`.
    pub(crate) fn batch_entry(args: &DecideArgs) -> (i64, Vec<Value>) {
        match args.shape() {
            Shape::OneTokenBucket | Shape::TokenBuckets => match args.one_token_bucket_argv() {
                Some(argv) => (1, argv),
                None => (2, args.token_buckets_argv()),
            },
            Shape::General => (3, args.general_argv()),
        }
    }

    /// One call of a batch script: of the shared one (`rule` `None`), `keys` and `argv` of
    /// every request of a batch, laid out as `lua/batch.lua` reads them; of `rule`'s own
    /// batch script, each request's key and its cost (or one cost for all), as
    /// `lua/rule_batch.lua` reads them. On a pool the crate built, bounded by fred's own
    /// command timeout, as [`Scripts::decide`] (a call that timed out before it was written
    /// is never written); on the application's client, by `remaining`, what is left of the
    /// deadline of the batch's oldest request.
    ///
    /// # Errors
    ///
    /// As [`Scripts::decide`]. After `NOSCRIPT` the caller answers the requests, which are
    /// then decided one by one as after `NOSCRIPT` on a call of their own, and calls
    /// [`Scripts::reload_batch`].
    pub(crate) async fn decide_batch(
        &self,
        slot: u16,
        rule: Option<&RuleScript>,
        keys: Vec<Key>,
        argv: Vec<Value>,
        remaining: Duration,
    ) -> Result<Vec<Value>, RedisError> {
        let script = rule.map_or(&self.batch, |rule| &rule.batch);
        let (client, place) = self.connection.next_placed(slot);
        let call = Box::pin(client.evalsha::<Vec<Value>, _, _, _>(script.sha1().clone(), keys, argv));
        let result = self.bounded(call, remaining).await;
        self.connection.client_saw(place, slot, &result);
        result
    }

    /// Whether a batch of `rule`'s requests alone may go to its own batch script: Redis did
    /// not refuse the user its load, and it is loaded on this limiter's connections (on
    /// every primary of a cluster). When it is not loaded yet, it is loaded in a task of its
    /// own ([`Scripts::load_later`]) and the batch goes to the shared batch script, as a
    /// rule past the process's rule scripts does; after `NOPERM` so do the rule's later
    /// batches and calls, without trying the load again.
    pub(crate) fn rule_batch_ready(&self, rule: &Arc<RuleScript>) -> bool {
        if self.rule_scripts.refuses(rule) {
            return false;
        }
        if self.rule_scripts.holds_batch(rule) {
            return true;
        }
        self.load_later(rule, true);
        false
    }

    /// Loads `rule`'s own script (`batch`: its batch script) on this limiter's connections,
    /// on every primary of a cluster, in a task of its own, unless a load of it is under
    /// way. No call waits for the load: on a cluster it waits for every primary, and a
    /// primary that does not answer would hold every call of the rule, on the other
    /// primaries too, past its deadline (each then answered by the failure policy). After
    /// `NOPERM` (a user who may run scripts but not load them) the rule's calls and batches
    /// go to the shared scripts for good; after another failure a later call tries again.
    fn load_later(&self, rule: &Arc<RuleScript>, batch: bool) {
        if !self.rule_scripts.start_load(rule, batch) {
            return;
        }
        let (loaded, rule) = (self.rule_scripts.clone(), rule.clone());
        let client = self.connection.next().clone();
        let timeout = self.connection.timeout();
        tokio::spawn(async move {
            let script = if batch { &rule.batch } else { &rule.script };
            match tokio::time::timeout(timeout, load_on_each_primary(&client, script, None)).await {
                Ok(Ok(())) if batch => loaded.add_batch(&rule),
                Ok(Ok(())) => loaded.add(&rule),
                Ok(Err(e)) if e.details().starts_with("NOPERM") => loaded.refuse(&rule),
                _ => {}
            }
            loaded.end_load(&rule, batch);
        });
    }

    /// Awaits a decision call. On a pool the crate made, whose every command fred times out
    /// after the deadline, fred's timer is the only one: it also keeps a call that timed
    /// out before it was written from being written. On a client the application made,
    /// fred may time out nothing (and its per-call options do not reach `EVALSHA`): a timer
    /// of our own, of `bound`.
    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, fred::error::Error>>,
        bound: Duration,
    ) -> Result<T, RedisError> {
        let timeout = self.connection.timeout();
        if self.connection.fred_keeps_the_deadline() {
            let error = match call.await {
                Ok(reply) => return Ok(reply),
                Err(e) if *e.kind() == ErrorKind::Timeout => RedisError::Timeout(timeout),
                Err(e) => RedisError::command(e),
            };
            self.connection.revive();
            Err(error)
        } else {
            self.connection.within(bound, call).await
        }
    }

    /// Loads the batch script again (after `NOSCRIPT`): the shared one (`rule` `None`), or
    /// `rule`'s own; within the deadline. Best effort: a failed load leaves the next batch
    /// to find it missing.
    pub(crate) async fn reload_batch(&self, rule: Option<&RuleScript>) {
        let script = rule.map_or(&self.batch, |rule| &rule.batch);
        let load = load_on_each_primary(self.connection.next(), script, None);
        let _ = tokio::time::timeout(self.connection.timeout(), load).await;
    }

    /// The rule's own script for `args` and its `ARGV`, when it has one that Redis did not
    /// refuse to load.
    fn own_script<'a>(&self, args: &'a DecideArgs) -> Option<(&'a Arc<RuleScript>, &'a [Value])> {
        args.rule_script().filter(|(rule, _)| !self.rule_scripts.refuses(rule))
    }

    /// The script for `args` and its `ARGV`: a rule's own script when it has one.
    fn decision<'a>(&'a self, args: &'a DecideArgs) -> (&'a Script, Vec<Value>) {
        if let Some((rule, argv)) = self.own_script(args) {
            return (&rule.script, argv.to_vec());
        }
        let (entry, argv) = Self::batch_entry(args);
        let script = match entry {
            1 => &self.one_token_bucket,
            2 => &self.token_buckets,
            _ => &self.decide,
        };
        (script, argv)
    }

    /// The reply of the script for `args`, read.
    pub(crate) fn read(args: &DecideArgs, reply: &[i64]) -> Result<Reply, RedisError> {
        match args.shape() {
            Shape::OneTokenBucket | Shape::TokenBuckets => args.token_reply(reply),
            Shape::General => Reply::decode(reply, args.band_count(), args.marks_places()),
        }
    }

    /// One refund call: `keys`, one per band to refund, and their arguments.
    ///
    /// Each call is given once, however often it is written: fred writes a command again on
    /// a new connection when the connection it was written on drops before the reply (and
    /// follows a cluster's `MOVED` and `ASK` the same way), and a refund run twice would
    /// give the same permits back twice, freeing what others took since. The call carries
    /// a key of its own, its mark, in its keys' hash slot, that the script sets (`SET NX`)
    /// before it gives anything back, and that a second run finds set. The mark lives as
    /// long as fred may write the call again ([`Scripts::refund_mark_ttl`]).
    ///
    /// Without a mark: a key whose hash tag is empty (a prefix holding `{}`) on a cluster,
    /// where no other key shares its slot; and a call that Redis answers `TRYAGAIN` (its
    /// slot migrating, with the mark, which exists nowhere, on neither side), made again
    /// without its mark within the deadline, as it was before marks.
    ///
    /// # Errors
    ///
    /// [`RedisError::Command`] when Redis fails the call, [`RedisError::Timeout`] when it
    /// does not answer in time, and [`RedisError::Reply`] for a reply of the wrong shape.
    pub(crate) async fn refund(&self, keys: Vec<String>, args: RefundArgs) -> Result<RefundReply, RedisError> {
        let bands = keys.len();
        let Some(first) = keys.first() else {
            return RefundReply::decode(Vec::new(), 0);
        };
        let mark = refund_mark(first, self.connection.is_cluster());
        let (start, deadline) = (Instant::now(), self.connection.timeout());
        let argv = args.into_argv();
        // The mark's life in ms, the last argument; 0 for a call without a mark.
        let unmarked = |argv: Vec<Value>| argv.into_iter().chain([Value::Integer(0)]).collect();
        let reply = match mark {
            Some(mark) => {
                let ttl = i64::try_from(self.refund_mark_ttl().as_millis()).unwrap_or(i64::MAX);
                let marked_keys = keys.iter().cloned().chain([mark]).collect();
                let marked_argv = argv.iter().cloned().chain([Value::Integer(ttl)]).collect();
                match self.run_refund(marked_keys, marked_argv, deadline).await {
                    // The slot is migrating and the mark, which exists nowhere, is on
                    // neither side: Redis ran nothing.
                    Err(RedisError::Command(e)) if e.details().starts_with("TRYAGAIN") => {
                        let rest = deadline.saturating_sub(start.elapsed());
                        self.run_refund(keys, unmarked(argv), rest).await?
                    }
                    result => result?,
                }
            }
            None => self.run_refund(keys, unmarked(argv), deadline).await?,
        };
        RefundReply::decode(reply, bands)
    }

    /// A refund call within `within`, what is left of the deadline.
    async fn run_refund(&self, keys: Vec<String>, argv: Vec<Value>, within: Duration) -> Result<Vec<i64>, RedisError> {
        // fred's future is large: boxed once here, the futures around it (the deadline, the
        // decision, the limiter's) stay small, and moving them copies a pointer instead of
        // kilobytes.
        let call = Box::pin(self.refund.evalsha_with_reload(self.connection.next(), keys, argv));
        self.connection.within(within, call).await
    }

    /// How long a refund's mark lives: as long as fred may write the call again. fred drops
    /// a command at its own command timeout only while its future is polled; a call the
    /// deadline abandons first stays in fred's buffer and may be written again after a
    /// reconnection. Twice the deadline, ten seconds at least, a day at most.
    pub(crate) fn refund_mark_ttl(&self) -> Duration {
        self.connection
            .timeout()
            .saturating_mul(2)
            .max(Duration::from_secs(10))
            .min(Duration::from_secs(86_400))
    }
}

/// The key marking one refund call as made (see [`Scripts::refund`]): in the hash slot of
/// `key`, one of the call's keys, as Redis finds it: the key's text up to the end of its
/// hash tag (the first `{` and the first `}` after it), then `:refund:` and an id unique to
/// this process and call. No bucket key ends so: a band's part is
/// `:<name>:<capacity>/<window>`. `None` on a cluster when the key has no hash tag (an
/// empty one, `{}`): Redis then hashes the whole key, which no other key shares.
fn refund_mark(key: &str, cluster: bool) -> Option<String> {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static SEQUENCE: AtomicU64 = AtomicU64::new(0);
    static SALT: OnceLock<u64> = OnceLock::new();
    let salt = *SALT.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish()
    });
    let tag_end = key.find('{').and_then(|open| {
        key[open + 1..]
            .find('}')
            .filter(|&len| len > 0)
            .map(|len| open + 1 + len)
    });
    let tagged = match tag_end {
        Some(close) => &key[..=close],
        None if cluster => return None,
        None => key,
    };
    let sequence = SEQUENCE.fetch_add(1, Ordering::Relaxed);
    Some(format!("{tagged}:refund:{salt:016x}{sequence:x}"))
}

/// The keys of a call as fred sends them: one vector, made here rather than from another.
fn fred_keys(keys: Keys) -> Vec<Key> {
    keys.into_iter().map(Key::from).collect()
}

/// [`asking`], and again after loading the script when the node lacked it (a node new to
/// the cluster, which the scripts were not loaded on).
async fn asking_again(
    client: &Client,
    script: &Script,
    keys: Keys,
    argv: Vec<Value>,
) -> Result<Value, fred::error::Error> {
    match asking(client, script, keys.clone(), argv.clone()).await {
        Err(e) if e.details().starts_with("NOSCRIPT") => {
            script.load(client).await?;
            asking(client, script, keys, argv).await
        }
        result => result,
    }
}

/// `EVALSHA` of `script` alone in a transaction, in the hash slot of its first key: fred
/// follows a cluster's `ASK` for a transaction (it sends `ASKING`, then the transaction, to
/// the slot's new node), where for a command of its own it sends the command to the old
/// node again. The call's reply, from `EXEC`'s.
async fn asking(client: &Client, script: &Script, keys: Keys, argv: Vec<Value>) -> Result<Value, fred::error::Error> {
    let slot = keys.first().map_or(0, |key| fred::util::redis_keyslot(key.as_bytes()));
    let mut args: Vec<Value> = Vec::with_capacity(2 + keys.len() + argv.len());
    args.push(Value::from(script.sha1().clone()));
    args.push(Value::Integer(i64::try_from(keys.len()).unwrap_or(i64::MAX)));
    args.extend(keys.into_iter().map(Value::from));
    args.extend(argv);
    let transaction = client.multi();
    transaction
        .custom::<(), _>(CustomCommand::new("EVALSHA", ClusterHash::Custom(slot), false), args)
        .await?;
    match transaction.exec::<Value>(true).await? {
        Value::Array(mut replies) if replies.len() == 1 => Ok(replies.swap_remove(0)),
        other => Err(fred::error::Error::new(
            ErrorKind::Protocol,
            format!("a transaction of one call answered {other:?}"),
        )),
    }
}

/// The numbers of a decision script's reply (an array of integers), read in place: no
/// vector on the heap for the few numbers of a request of one or two bands.
///
/// # Errors
///
/// [`RedisError::Reply`] for a reply that is not an array of integers.
fn numbers(reply: Value) -> Result<Numbers, RedisError> {
    let wrong = |what: &Value| RedisError::Reply(format!("a decision reply of numbers, not {what:?}"));
    match &reply {
        Value::Array(values) => values
            .iter()
            .map(|value| match value {
                Value::Integer(n) => Ok(*n),
                other => Err(wrong(other)),
            })
            .collect(),
        other => Err(wrong(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refund's mark is in its keys' hash slot, found as Redis finds a hash tag, and each
    /// is another key; a key hashed whole has none on a cluster.
    #[test]
    fn a_refund_mark_shares_the_slot_of_its_keys() {
        let slot = |key: &str| fred::util::redis_keyslot(key.as_bytes());
        for key in [
            "fluxgate:{default:per-ip:ip=10.0.0.1}",
            "p:{s:r:user=a}:b0:10/1s:fw",
            "a}b:{s:r:ip=1}",
            "x}{t}:{s:r:ip=1}",
            "{fluxgate}:{s:r:ip=1}",
            "a{b:{s:r:ip=1}",
        ] {
            let (one, two) = (refund_mark(key, true).unwrap(), refund_mark(key, true).unwrap());
            assert_ne!(one, two);
            assert_eq!(slot(&one), slot(key), "{key} → {one}");
            assert!(one.contains(":refund:"), "{one}");
        }
        assert_eq!(refund_mark("app{}:{s:r:ip=1}", true), None);
        assert!(refund_mark("app{}:{s:r:ip=1}", false).is_some());
    }

    /// A reply is read as its numbers; anything else is an error that shows it.
    #[test]
    fn a_reply_is_its_numbers() {
        let reply = Value::Array(vec![Value::Integer(1_700_000_000_000_000), Value::Integer(-3)]);
        assert_eq!(numbers(reply).unwrap().as_slice(), [1_700_000_000_000_000, -3]);
        assert!(numbers(Value::Array(Vec::new())).unwrap().is_empty());
        let error = numbers(Value::Array(vec![Value::Integer(1), Value::String("x".into())]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("String"), "{error}");
        assert!(numbers(Value::Null).is_err());
    }

    /// The future of a decision stays small, whatever fred's futures weigh: the limiter
    /// boxes it once per request, and a large one costs a copy of all of it.
    #[test]
    fn a_decision_future_is_small() {
        let scripts = Scripts::new(Connection::client(fred::clients::Client::default()));
        let args = DecideArgs::new();
        let future = scripts.decide(0, Keys::new(), &args);
        let size = std::mem::size_of_val(&future);
        assert!(size <= 512, "{size} bytes");
    }
}
