//! [`RuleChangeListener`]: reloads rules when a change event arrives on the Redis Pub/Sub
//! channel, resets the changed rule set's buckets once per event, and reloads everything
//! after a reconnection.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use fluxgate_core::reload::{ReloadingRuleSetProvider, RuleSource};
use fred::clients::Client;
use fred::interfaces::{ClientLike, EventInterface, KeysInterface, PubsubInterface};
use fred::types::{Expiration, SetOptions};
use tokio::sync::broadcast::error::RecvError;

use crate::changes::{RuleChange, DEFAULT_CHANGES_CHANNEL};
use crate::connection::{self, Connection};
use crate::error::RedisError;
use crate::key;
use crate::limiter::RedisLimiter;
use crate::reset::ResetScope;
use crate::store::{RedisRuleSetStore, GRANT_EVERYTHING, RESET_GRANT_TTL_MS};

/// How often the listener's connection tries to reconnect.
const RECONNECT_DELAY: Duration = Duration::from_millis(100);

/// How long the listener's `PING` may go unanswered before its connection counts as dead:
/// its connection carries nothing else but the subscription.
const UNANSWERED: Duration = Duration::from_secs(2);

/// How often the listener's connection is sent a `PING`, when the last one was answered
/// (see `Listen::run`).
const HEARTBEAT: Duration = Duration::from_secs(1);

/// How long a reset claim lives: listeners that receive the same event later than this
/// after the first one would reset again.
const CLAIM_TTL: Duration = Duration::from_secs(10);

/// How long a listener that did not win the claim waits for the reset to finish before it
/// forgets its remembered denials anyway.
const CLAIM_WAIT: Duration = Duration::from_secs(5);

/// The deadline of the claim's commands.
const CLAIM_TIMEOUT: Duration = Duration::from_secs(1);

/// Reloads a [`ReloadingRuleSetProvider`] from a [`RuleSource`] whenever a rule change
/// event ([`RuleChange`]) is published on a Redis channel (`fluxgate:rule-changes` by
/// default), and after every reconnection of its subscription.
///
/// For each valid event, in the order they arrive:
///
/// 1. **Reload**: every rule set is loaded from the source and the changed ones swapped in
///    (a bad load keeps the rules in force; it is logged and counted by the provider).
/// 2. **Reset**, when the event asks for it (a bare id does; see [`RuleChange`]):
///    - on this instance: the in-memory counters of the rule set
///      ([`ReloadingRuleSetProvider::reset_buckets`]) and, with a Redis limiter
///      ([`RuleChangeListenerBuilder::reset`]), its remembered denials;
///    - in Redis, **once per event** however many instances listen: each listener tries to
///      claim the event (`SET <channel>:reset:<event key> … NX PX 10000`); the one that
///      wins deletes the rule set's bucket keys ([`RedisLimiter::reset_buckets`]: `SCAN`
///      on every primary) and marks the claim done; the others wait for that mark (at
///      most 5 s) and forget their remembered denials again.
///
/// Change messages are not authenticated: whoever may publish on the channel can ask for
/// resets. A listener that [requires reset grants](RuleChangeListenerBuilder::require_reset_grants)
/// resets only for events a [`RuleAdmin`](crate::RuleAdmin) of its store published (each
/// leaves a grant in the store), once each; other events reload and reset nothing.
///
/// An invalid message is logged, counted ([`ListenerStats::invalid`]) and ignored. When
/// the subscription's connection comes back after a failure, or when events were dropped
/// because the listener fell behind, every rule set is reloaded (events may have been
/// missed) and counted ([`ListenerStats::resyncs`]).
///
/// The listener holds the provider weakly and stops once it is dropped, as does dropping
/// the listener (its task is aborted and its connection closed).
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use std::sync::Arc;
/// use fluxgate_core::reload::ReloadingRuleSetProvider;
/// use fluxgate_core::{Engine, RuleSets};
/// use fluxgate_redis::{RedisLimiter, RedisRuleSetStore, RuleChangeListener};
///
/// let url = "redis://127.0.0.1:6379";
/// let store = Arc::new(RedisRuleSetStore::connect(url).await?);
/// let limiter = RedisLimiter::builder(url).connect().await?;
/// let provider = Arc::new(ReloadingRuleSetProvider::new(store.load_rule_sets().await?));
/// let engine = Engine::builder(provider.clone()).limiter(limiter.clone()).build()?;
/// // Keep `listener`: dropping it stops listening.
/// let listener = RuleChangeListener::builder(provider, store)
///     .reset(limiter)
///     .subscribe(url)
///     .await?;
/// # drop((engine, listener));
/// # Ok(())
/// # }
/// ```
pub struct RuleChangeListener {
    task: tokio::task::JoinHandle<()>,
    client: Client,
    stats: Arc<Stats>,
    channel: String,
}

/// Builds a [`RuleChangeListener`].
pub struct RuleChangeListenerBuilder {
    provider: Arc<ReloadingRuleSetProvider>,
    source: Arc<dyn RuleSource>,
    channel: String,
    redis: Option<RedisLimiter>,
    grants: Option<RedisRuleSetStore>,
    on_event: Option<OnEvent>,
}

/// A callback run after each valid event is handled.
type OnEvent = Arc<dyn Fn(&RuleChange) + Send + Sync>;

/// What a [`RuleChangeListener`] has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListenerStats {
    /// Valid events handled: reloaded, and reset if asked.
    pub events: u64,
    /// Messages that were not valid events, ignored.
    pub invalid: u64,
    /// Full reloads after a reconnection or after events were dropped.
    pub resyncs: u64,
    /// Redis bucket resets this listener claimed and ran.
    pub redis_resets: u64,
    /// Redis bucket resets that failed (the claim or the deletion).
    pub reset_failures: u64,
    /// Events asking for a reset that reset nothing for want of a grant, when grants are
    /// [required](RuleChangeListenerBuilder::require_reset_grants): no grant in the store
    /// (a message another publisher sent), a grant for another scope, the event's grant
    /// used already, or the store unreachable.
    pub ungranted_resets: u64,
}

#[derive(Default)]
struct Stats {
    events: AtomicU64,
    invalid: AtomicU64,
    resyncs: AtomicU64,
    redis_resets: AtomicU64,
    reset_failures: AtomicU64,
    ungranted_resets: AtomicU64,
}

impl RuleChangeListener {
    /// A builder: `provider` is reloaded from `source` on every event.
    pub fn builder(provider: Arc<ReloadingRuleSetProvider>, source: Arc<dyn RuleSource>) -> RuleChangeListenerBuilder {
        RuleChangeListenerBuilder {
            provider,
            source,
            channel: DEFAULT_CHANGES_CHANNEL.to_owned(),
            redis: None,
            grants: None,
            on_event: None,
        }
    }

    /// What the listener has done so far.
    pub fn stats(&self) -> ListenerStats {
        let get = |n: &AtomicU64| n.load(Ordering::Relaxed);
        ListenerStats {
            events: get(&self.stats.events),
            invalid: get(&self.stats.invalid),
            resyncs: get(&self.stats.resyncs),
            redis_resets: get(&self.stats.redis_resets),
            reset_failures: get(&self.stats.reset_failures),
            ungranted_resets: get(&self.stats.ungranted_resets),
        }
    }

    /// The channel listened to.
    pub fn channel(&self) -> &str {
        &self.channel
    }

    /// Whether the listener's task has ended (the provider was dropped).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

impl Drop for RuleChangeListener {
    fn drop(&mut self) {
        self.task.abort();
        let client = self.client.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = client.quit().await;
            });
        }
    }
}

impl fmt::Debug for RuleChangeListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RuleChangeListener")
            .field("channel", &self.channel)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for RuleChangeListenerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RuleChangeListenerBuilder")
            .field("source", &self.source)
            .field("channel", &self.channel)
            .field("reset", &self.redis)
            .field("require_reset_grants", &self.grants)
            .field("on_event", &self.on_event.is_some())
            .finish_non_exhaustive()
    }
}

impl RuleChangeListenerBuilder {
    /// The channel. Default [`DEFAULT_CHANGES_CHANNEL`], `fluxgate:rule-changes`.
    pub fn channel(mut self, channel: impl Into<String>) -> Self {
        self.channel = channel.into();
        self
    }

    /// Resets buckets in Redis through this limiter (its prefix, its connections) when an
    /// event asks for it, once per event across all listeners, and forgets this
    /// instance's remembered denials. Without it, a reset reaches only the in-memory
    /// counters.
    pub fn reset(mut self, limiter: RedisLimiter) -> Self {
        self.redis = Some(limiter);
        self
    }

    /// Resets buckets only for events whose reset grant is in `store`: those a
    /// [`RuleAdmin`](crate::RuleAdmin) of the store published (with a change, a delete,
    /// or [`RuleAdmin::publish`](crate::RuleAdmin::publish) of a change with a reset and
    /// an event id), within a minute of their publication, for the scope they were
    /// published with, and each once. Any other event asking for a reset (a bare rule set
    /// id, JSON without a grant, from a user that may publish on the channel but not write
    /// the store's keys; an event heard again, or its id with another scope) reloads
    /// and resets nothing, logged and counted ([`ListenerStats::ungranted_resets`]). Off by
    /// default, so that a plain `redis-cli PUBLISH` resets: turn it on wherever anyone but
    /// the admins can publish on the channel.
    pub fn require_reset_grants(mut self, store: RedisRuleSetStore) -> Self {
        self.grants = Some(store);
        self
    }

    /// Calls `callback` after each valid event has been handled (reloaded, and reset if
    /// asked), and after each full reload that follows a reconnection (with
    /// [`RuleChange::everything`]): to invalidate a
    /// [`CachingRuleSetProvider`](fluxgate_core::CachingRuleSetProvider) in front of
    /// another store, say, or to log. A panic in the callback is caught and logged.
    pub fn on_event(mut self, callback: impl Fn(&RuleChange) + Send + Sync + 'static) -> Self {
        self.on_event = Some(Arc::new(callback));
        self
    }

    /// Connects a connection of its own to the Redis at `url` (standalone, Cluster or
    /// Sentinel, as [`RedisLimiter::builder`]), subscribes, and starts listening on the
    /// caller's tokio runtime.
    ///
    /// # Errors
    ///
    /// [`RedisError::Url`], [`RedisError::Connect`], or [`RedisError::Command`] when the
    /// subscription fails.
    pub async fn subscribe(self, url: &str) -> Result<RuleChangeListener, RedisError> {
        let (builder, _) = connection::builder(url, RECONNECT_DELAY, UNANSWERED)?;
        let client = builder.build().map_err(RedisError::Connect)?;
        client.init().await.map_err(RedisError::Connect)?;
        self.subscribe_with(client).await
    }

    /// Subscribes with `client`, a connected client used for nothing else (a subscribed
    /// connection takes no other command), and starts listening on the caller's tokio
    /// runtime. Give the client a reconnect policy: the listener reloads everything and
    /// subscribes again after each reconnection. The listener keeps a `PING` in flight on
    /// it; with fred's `ConnectionConfig::unresponsive` set, as [`subscribe`](Self::subscribe)
    /// sets it, a primary that stops answering without closing the connection is then left
    /// for the new one after a failover.
    ///
    /// # Errors
    ///
    /// [`RedisError::Command`] when the subscription fails.
    pub async fn subscribe_with(self, client: Client) -> Result<RuleChangeListener, RedisError> {
        // Receivers first: no message published once the subscription holds is missed.
        let messages = client.message_rx();
        let reconnects = client.reconnect_rx();
        client
            .subscribe(self.channel.as_str())
            .await
            .map_err(RedisError::Command)?;
        let stats = Arc::new(Stats::default());
        let listen = Listen {
            provider: Arc::downgrade(&self.provider),
            source: self.source,
            channel: self.channel.clone(),
            redis: self.redis,
            grants: self.grants.map(|store| Grants {
                store,
                used: Mutex::new(VecDeque::new()),
            }),
            client: client.clone(),
            stats: stats.clone(),
            on_event: self.on_event,
        };
        let task = tokio::spawn(listen.run(messages, reconnects));
        Ok(RuleChangeListener {
            task,
            client,
            stats,
            channel: self.channel,
        })
    }
}

/// The listening task's state.
struct Listen {
    provider: Weak<ReloadingRuleSetProvider>,
    source: Arc<dyn RuleSource>,
    channel: String,
    redis: Option<RedisLimiter>,
    grants: Option<Grants>,
    client: Client,
    stats: Arc<Stats>,
    on_event: Option<OnEvent>,
}

/// The store whose reset grants a listener requires, and the events it reset for in the
/// grants' lifetime (each grant is used once).
struct Grants {
    store: RedisRuleSetStore,
    used: Mutex<VecDeque<(tokio::time::Instant, String)>>,
}

impl Grants {
    /// Whether `change` may reset: its grant is in the store, for the scope of the change,
    /// and was not used by this listener. A grant found is marked used.
    async fn allow(&self, change: &RuleChange) -> Result<(), &'static str> {
        let Some(event_id) = &change.event_id else {
            return Err("the event has no id, so no grant");
        };
        let lifetime = Duration::from_millis(RESET_GRANT_TTL_MS);
        {
            let mut used = self.used.lock().unwrap_or_else(PoisonError::into_inner);
            while used.front().is_some_and(|(at, _)| at.elapsed() > lifetime) {
                used.pop_front();
            }
            if used.iter().any(|(_, id)| id == event_id) {
                return Err("the event's grant was used already");
            }
        }
        // The listener handles one event at a time: nothing marks this grant used meanwhile.
        // The grant names what the admin's event resets: an event heard with its id and
        // another scope (a publisher that heard the admin's event) resets nothing.
        let scope = change.rule_set.as_deref().unwrap_or(GRANT_EVERYTHING);
        match self.store.reset_grant(event_id).await {
            Ok(Some(granted)) if granted != scope => Err("the event's grant is for another rule set"),
            Ok(Some(_)) => {
                let mut used = self.used.lock().unwrap_or_else(PoisonError::into_inner);
                used.push_back((tokio::time::Instant::now(), event_id.clone()));
                Ok(())
            }
            Ok(None) => {
                Err("no grant in the store (not published by an admin of the store, or more than a minute ago)")
            }
            Err(_) => Err("the store cannot be read"),
        }
    }
}

/// The first wait before a failed reload or subscription is tried again.
const RETRY_FIRST: Duration = Duration::from_millis(100);
/// The longest wait between two tries.
const RETRY_MOST: Duration = Duration::from_secs(5);

/// What the listener tries again: the reload (when the last one failed) and the
/// subscription (when it was lost), with the wait before the next try.
struct Retry {
    /// When to try again, if anything is to be tried.
    at: Option<tokio::time::Instant>,
    wait: Duration,
    subscribed: bool,
}

impl Default for Retry {
    fn default() -> Self {
        Self {
            at: None,
            wait: RETRY_FIRST,
            subscribed: true,
        }
    }
}

impl Retry {
    /// After a reload that succeeded or not: nothing more to try once the rules are
    /// reloaded and the channel subscribed; otherwise the next try, waiting longer.
    fn after(&mut self, reloaded: bool) {
        if reloaded && self.subscribed {
            *self = Self::default();
        } else {
            self.at = Some(tokio::time::Instant::now() + self.wait);
            self.wait = (self.wait * 2).min(RETRY_MOST);
        }
    }
}

/// Sleeps until `due`; never ends without one.
async fn sleep_until_due(due: Option<tokio::time::Instant>) {
    match due {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl Listen {
    fn notify(&self, change: &RuleChange) {
        if let Some(callback) = &self.on_event {
            let call = std::panic::AssertUnwindSafe(|| callback(change));
            if std::panic::catch_unwind(call).is_err() {
                tracing::error!("the rule change listener's callback panicked");
            }
        }
    }

    async fn run(
        self,
        mut messages: tokio::sync::broadcast::Receiver<fred::types::Message>,
        mut reconnects: tokio::sync::broadcast::Receiver<fred::types::config::Server>,
    ) {
        // A reload or a subscription that failed is tried again, after RETRY_FIRST, then
        // twice as long each time up to RETRY_MOST, until it succeeds: the instance never
        // stays on the rules it had when a change reached it, nor deaf to the next ones.
        let mut retry = Retry::default();
        // A subscribed connection receives without asking, so that nothing tells a primary
        // that stopped answering without closing it (frozen, gone, cut off) from a quiet
        // channel. A `PING` kept in flight on it, the next one only once it is answered,
        // goes unanswered there: fred counts the connection dead and connects again (to the
        // new primary after a failover), and the listener subscribes and reloads everything.
        let mut heartbeat = tokio::time::interval(HEARTBEAT);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut ping: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            let due = retry.at;
            let outcome = tokio::select! {
                _ = heartbeat.tick() => {
                    if ping.as_ref().is_none_or(tokio::task::JoinHandle::is_finished) {
                        let client = self.client.clone();
                        // Its reply does not matter. A task of its own, not to hold the
                        // events back while it waits.
                        ping = Some(tokio::spawn(async move {
                            let _ = client.ping::<fred::types::Value>(None).await;
                        }));
                    }
                    continue;
                }
                message = messages.recv() => match message {
                    Ok(message) if *message.channel == *self.channel => {
                        let bytes = message.value.as_bytes().map(<[u8]>::to_vec);
                        self.event(bytes.as_deref()).await
                    }
                    Ok(_) => continue,
                    Err(RecvError::Lagged(missed)) => {
                        tracing::warn!(missed, channel = %self.channel, "rule change events dropped: reloading everything");
                        self.resync().await.map(Some)
                    }
                    Err(RecvError::Closed) => return,
                },
                reconnect = reconnects.recv() => match reconnect {
                    Ok(_) | Err(RecvError::Lagged(_)) => {
                        // A new connection holds no subscription.
                        retry.subscribed = self.subscribe().await;
                        tracing::info!(channel = %self.channel, "rule change listener reconnected: reloading everything");
                        self.resync().await.map(Some)
                    }
                    Err(RecvError::Closed) => return,
                },
                () = sleep_until_due(due) => {
                    if !retry.subscribed {
                        retry.subscribed = self.subscribe().await;
                    }
                    tracing::info!(channel = %self.channel, "trying the rule reload again");
                    self.resync().await.map(Some)
                }
            };
            match outcome {
                None => return,
                Some(None) => {}
                Some(Some(reloaded)) => retry.after(reloaded),
            }
        }
    }

    /// Subscribes to the channel again; answers whether it did.
    async fn subscribe(&self) -> bool {
        match self.client.subscribe(self.channel.as_str()).await {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(%error, channel = %self.channel, "cannot subscribe again to the rule change channel: trying again");
                false
            }
        }
    }

    /// Reloads every rule set; answers whether it did (`None` when the provider is gone).
    async fn resync(&self) -> Option<bool> {
        let provider = self.provider.upgrade()?;
        self.stats.resyncs.fetch_add(1, Ordering::Relaxed);
        let reloaded = self.reload(&provider).await;
        self.notify(&RuleChange::everything());
        Some(reloaded)
    }

    /// Handles one message; answers whether the rules were reloaded (`Some(None)` for a
    /// message that reloads nothing, `None` when the provider is gone).
    async fn event(&self, bytes: Option<&[u8]>) -> Option<Option<bool>> {
        let provider = self.provider.upgrade()?;
        let parsed = match bytes {
            Some(bytes) => RuleChange::parse_bytes(bytes),
            None => Err(crate::changes::ChangeError::NotText),
        };
        let change = match parsed {
            Ok(change) => change,
            Err(error) => {
                self.stats.invalid.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, channel = %self.channel, "rule change message ignored");
                return Some(None);
            }
        };
        tracing::info!(%change, "rule change event");
        let reloaded = self.reload(&provider).await;
        if change.reset_buckets {
            let granted = match &self.grants {
                Some(grants) if reloaded => grants.allow(&change).await,
                _ => Ok(()),
            };
            if let Err(reason) = granted {
                self.stats.ungranted_resets.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%change, reason, "rule change event without a reset grant: its buckets are not reset");
            } else if reloaded {
                let message = bytes.map(String::from_utf8_lossy).unwrap_or_default();
                self.reset(&provider, &change, &message).await;
            } else {
                // The rules in force are the ones the counts were made under: a reset now
                // would only refill them.
                tracing::warn!(%change, "rules not reloaded: their buckets are not reset");
            }
        }
        self.stats.events.fetch_add(1, Ordering::Relaxed);
        self.notify(&change);
        Some(Some(reloaded))
    }

    /// Reloads the provider from the source; a failure (a panic of the source included)
    /// is logged and counted by the provider.
    async fn reload(&self, provider: &ReloadingRuleSetProvider) -> bool {
        provider.reload_from(&*self.source).await.is_ok()
    }

    async fn reset(&self, provider: &ReloadingRuleSetProvider, change: &RuleChange, message: &str) {
        let scope = match &change.rule_set {
            Some(id) => {
                provider.reset_buckets(id);
                ResetScope::RuleSet(id)
            }
            None => {
                provider.reset_all_buckets();
                ResetScope::All
            }
        };
        let Some(limiter) = &self.redis else {
            return;
        };
        let start = key::buckets_start(limiter.prefix(), scope.id());
        limiter.forget_denials(&start);
        let claim = format!("{}:reset:{}", self.channel, change.event_key(message));
        match self.claim(limiter, &claim).await {
            Ok(true) => match limiter.reset_buckets(scope).await {
                Ok(_) => {
                    self.stats.redis_resets.fetch_add(1, Ordering::Relaxed);
                    self.mark_done(limiter, &claim).await;
                }
                Err(error) => {
                    self.stats.reset_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%error, ?scope, "bucket reset failed");
                }
            },
            Ok(false) => {
                self.wait_done(limiter, &claim).await;
                limiter.forget_denials(&start);
            }
            Err(error) => {
                self.stats.reset_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, ?scope, "bucket reset: cannot claim the event");
            }
        }
    }

    /// Claims the reset of an event: answers whether this listener runs it.
    async fn claim(&self, limiter: &RedisLimiter, claim: &str) -> Result<bool, RedisError> {
        set_claim(limiter, claim, "running", SetOptions::NX, CLAIM_TTL).await
    }

    /// Marks the claim done: for [`CLAIM_TTL`], or, when resets need grants, for as long
    /// as the event's grant lives, so that the event heard again within that time by a
    /// listener that did not hear it (an instance started since) resets its rule set's
    /// buckets in Redis no second time.
    async fn mark_done(&self, limiter: &RedisLimiter, claim: &str) {
        let ttl = match &self.grants {
            Some(_) => CLAIM_TTL.max(Duration::from_millis(RESET_GRANT_TTL_MS)),
            None => CLAIM_TTL,
        };
        if let Err(error) = set_claim(limiter, claim, "done", SetOptions::XX, ttl).await {
            tracing::warn!(%error, "bucket reset done, but the claim cannot say so");
        }
    }

    /// Waits until the listener that won the claim has reset the buckets (or the claim is
    /// gone, or 5 s passed).
    async fn wait_done(&self, limiter: &RedisLimiter, claim: &str) {
        let connection = claim_connection(limiter);
        let waited = tokio::time::timeout(CLAIM_WAIT, async {
            loop {
                let state = connection.next().get::<Option<String>, _>(claim);
                match connection.within_deadline(state).await {
                    Ok(Some(state)) if state == "running" => {}
                    _ => return,
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        if waited.is_err() {
            tracing::warn!(claim, "bucket reset by another instance did not finish within 5 s");
        }
    }
}

/// The limiter's connections, with the claim's deadline.
fn claim_connection(limiter: &RedisLimiter) -> Connection {
    limiter.connection().clone().with_timeout(CLAIM_TIMEOUT)
}

/// Sets the claim key to `state` if `option` allows, for `ttl`; answers whether it was set.
async fn set_claim(
    limiter: &RedisLimiter,
    claim: &str,
    state: &str,
    option: SetOptions,
    ttl: Duration,
) -> Result<bool, RedisError> {
    let connection = claim_connection(limiter);
    let ttl = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
    let set =
        connection
            .next()
            .set::<Option<String>, _, _>(claim, state, Some(Expiration::PX(ttl)), Some(option), false);
    Ok(connection.within_deadline(set).await?.is_some())
}
