//! [`RuleAdmin`]: puts, deletes and lists rule sets in the Redis rule store, validating
//! first, and publishes each change for the listeners.

use std::fmt;

use fluxgate_core::limiter::{validate_rule_set, RateLimiter};
use fluxgate_core::{Engine, RuleError, RuleSet, RuleSetSpec};
use fred::interfaces::PubsubInterface;

use crate::changes::{RuleChange, DEFAULT_CHANGES_CHANNEL};
use crate::error::RedisError;
use crate::store::{RedisRuleSetStore, StoreError};

/// Administers the rule sets of a [`RedisRuleSetStore`]: every change is validated, then
/// stored and published as a [`RuleChange`] (JSON, with a new event id and source `admin`)
/// on the change channel in one script call, where
/// [`RuleChangeListener`](crate::RuleChangeListener)s reload.
///
/// - A rule set is validated as rules ([`RuleSet::from_spec`]) and by every limiter or
///   engine given to [`validate_with`](Self::validate_with) or
///   [`validate_with_engine`](Self::validate_with_engine) (the Redis limiter refuses a
///   band beyond its exact range, or a wait for the refill it cannot reserve, for example)
///   before anything is stored: a rule set that fails is never stored, and nothing is
///   published.
/// - Changes reset the changed rule set's buckets by default, as the original did
///   ([`reset_on_change`](Self::reset_on_change)); the listeners run the reset once per
///   change. A put of the rule set as it is stored already changes nothing and resets
///   nothing: a tool that applies the same rules again (a deploy step, a sync) does not
///   give every client a full quota each time.
/// - A change is not stored without being published: the script first checks that the
///   store's user may publish on the channel (Redis 7 and later), so a put refused there
///   stores nothing, and putting it again later stores, publishes and resets. (A retry
///   after a change stored and published whose reply was lost finds it stored: it resets
///   nothing more, the first publication did.)
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use fluxgate_core::RuleSetSpec;
/// use fluxgate_redis::{RedisLimiter, RedisRuleSetStore, RuleAdmin};
///
/// let url = "redis://127.0.0.1:6379";
/// let limiter = RedisLimiter::builder(url).connect().await?;
/// let admin = RuleAdmin::new(RedisRuleSetStore::connect(url).await?).validate_with(limiter);
/// let spec: RuleSetSpec = serde_json::from_str(r#"{"id": "api", "rules": [
///     {"id": "per-ip", "bands": [{"capacity": 100, "window": "1m"}]}]}"#)?;
/// admin.put(&spec).await?; // validated, stored, published
/// # Ok(()) }
/// ```
pub struct RuleAdmin {
    store: RedisRuleSetStore,
    channel: String,
    reset_on_change: bool,
    validators: Vec<Validator>,
}

/// Why a [`RuleAdmin`] call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// The rule set is invalid, or a limiter cannot decide it: nothing was stored.
    #[error(transparent)]
    Rule(#[from] RuleError),
    /// The store failed: nothing was published.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The change was stored and published, but the store as a whole does not load: an
    /// index entry without its document, a document that is not a valid rule set, or no
    /// rule set left (the last one deleted, and the store does not
    /// [`allow_empty`](RedisRuleSetStore::allow_empty)). Every instance refuses such a
    /// load and keeps the rules in force, this change's and every later one's left out,
    /// until the store is repaired.
    #[error("rule set `{rule_set}` changed and published, but the rule store does not load, so no instance applies the change: {source}")]
    Unloadable {
        /// The rule set.
        rule_set: String,
        /// Why the store does not load.
        #[source]
        source: StoreError,
    },
    /// The change was stored but Redis refused to publish it: only with a Redis older than
    /// 7, which cannot check the permission before the write (Redis 7 and later refuse
    /// such a change before storing it, [`AdminError::Store`]). Listeners learn of it at
    /// their next reconnection or poll, or when [`RuleAdmin::publish`] is called with a
    /// change that resets.
    #[error("rule set `{rule_set}` stored, but the change event could not be published: {source}")]
    Publish {
        /// The rule set.
        rule_set: String,
        /// Why.
        #[source]
        source: RedisError,
    },
}

/// What a rule set is validated with before it is stored.
#[derive(Debug)]
enum Validator {
    Limiter(Box<dyn RateLimiter>),
    Engine(Engine),
}

impl fmt::Debug for RuleAdmin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RuleAdmin")
            .field("store", &self.store)
            .field("channel", &self.channel)
            .field("reset_on_change", &self.reset_on_change)
            .field("validators", &self.validators)
            .finish()
    }
}

impl RuleAdmin {
    /// An admin of `store`, publishing on [`DEFAULT_CHANGES_CHANNEL`].
    pub fn new(store: RedisRuleSetStore) -> Self {
        Self {
            store,
            channel: DEFAULT_CHANGES_CHANNEL.to_owned(),
            reset_on_change: true,
            validators: Vec::new(),
        }
    }

    /// The channel changes are published on.
    #[must_use]
    pub fn channel(mut self, channel: impl Into<String>) -> Self {
        self.channel = channel.into();
        self
    }

    /// Whether a change resets the changed rule set's buckets. Default `true`.
    #[must_use]
    pub fn reset_on_change(mut self, reset: bool) -> Self {
        self.reset_on_change = reset;
        self
    }

    /// Validates rule sets with this limiter too, before storing them: its bands and the
    /// waits for the refill rules ask for ([`validate_rule_set`]). Pass the limiter the
    /// engines use; when an engine has a default wait
    /// ([`wait_on_limit`](fluxgate_core::EngineBuilder::wait_on_limit)), prefer
    /// [`validate_with_engine`](Self::validate_with_engine), which checks it too.
    #[must_use]
    pub fn validate_with(mut self, limiter: impl RateLimiter) -> Self {
        self.validators.push(Validator::Limiter(Box::new(limiter)));
        self
    }

    /// Validates rule sets as `engine` checks every rule set it loads
    /// ([`Engine::validate`]), before storing them: a rule set stored past this check
    /// would be refused by every engine like it, and the rules in force would stay as
    /// they were.
    #[must_use]
    pub fn validate_with_engine(mut self, engine: Engine) -> Self {
        self.validators.push(Validator::Engine(engine));
        self
    }

    /// The store.
    pub fn store(&self) -> &RedisRuleSetStore {
        &self.store
    }

    /// Validates `spec` (rules, then every limiter), then stores it and publishes the change
    /// in one script call. Answers the event published.
    ///
    /// # Errors
    ///
    /// [`AdminError::Rule`] (nothing stored), [`AdminError::Store`] (nothing stored or
    /// published, unless the reply was lost: a timeout after the call ran),
    /// [`AdminError::Publish`] (stored, not published: Redis 6), or [`AdminError::Unloadable`]
    /// (stored and published, but the store does not load: no instance applies it).
    pub async fn put(&self, spec: &RuleSetSpec) -> Result<RuleChange, AdminError> {
        let set = RuleSet::from_spec(spec.clone())?;
        for validator in &self.validators {
            match validator {
                Validator::Limiter(limiter) => validate_rule_set(&**limiter, &set, None)?,
                Validator::Engine(engine) => engine.validate(&set)?,
            }
        }
        let change = RuleChange::rule_set(&spec.id).with_source("admin").with_new_event_id();
        let reset = change.clone().with_reset(self.reset_on_change);
        let keep = change.with_reset(false);
        // Stored and announced in one step, either way (a reload of what is stored is
        // harmless); a reset only when something changed. A change is never stored
        // without its announcement, so a put retried after a failure finds either nothing
        // stored (and resets) or the change announced already.
        let announced = self.store.put_announced(spec, &self.channel, &reset, &keep).await?;
        let change = if announced.changed { reset } else { keep };
        if let Err(message) = announced.published {
            return Err(publish_refused(&spec.id, message));
        }
        self.loads(&spec.id).await?;
        Ok(change)
    }

    /// Deletes the rule set `id` and, when it was stored, publishes the change. Answers
    /// the event published, `None` when there was no such rule set.
    ///
    /// # Errors
    ///
    /// [`AdminError::Store`], [`AdminError::Publish`] (deleted, not published: Redis 6), or
    /// [`AdminError::Unloadable`] (deleted and published, but the store does not load: the
    /// last rule set deleted from a store that does not allow an empty one, say).
    pub async fn delete(&self, id: &str) -> Result<Option<RuleChange>, AdminError> {
        let change = RuleChange::rule_set(id)
            .with_reset(self.reset_on_change)
            .with_source("admin")
            .with_new_event_id();
        let announced = self.store.delete_announced(id, &self.channel, &change).await?;
        if !announced.changed {
            return Ok(None);
        }
        if let Err(message) = announced.published {
            return Err(publish_refused(id, message));
        }
        self.loads(id).await?;
        Ok(Some(change))
    }

    /// Whether the store, changed for `id`, loads as the listeners load it: a store that
    /// does not keeps every instance on the rules in force, which the caller must learn.
    /// A Redis failure of this read is not the change's: it passes.
    async fn loads(&self, id: &str) -> Result<(), AdminError> {
        match self.store.load_rule_sets().await {
            Ok(_) | Err(StoreError::Redis(_)) => Ok(()),
            Err(source) => Err(AdminError::Unloadable {
                rule_set: id.to_owned(),
                source,
            }),
        }
    }

    /// The stored rule sets, by id.
    ///
    /// # Errors
    ///
    /// See [`RedisRuleSetStore::list`].
    pub async fn list(&self) -> Result<Vec<RuleSetSpec>, AdminError> {
        Ok(self.store.list().await?)
    }

    /// Publishes `change` on the channel as JSON; answers how many subscribers received
    /// it (on a cluster, those of the node that took the command). A change that resets
    /// buckets and has an event id ([`RuleChange::with_new_event_id`]) is published with
    /// its reset grant, in one script call: listeners that
    /// [require grants](crate::RuleChangeListenerBuilder::require_reset_grants) reset for
    /// it.
    ///
    /// # Errors
    ///
    /// [`RedisError::Command`] or [`RedisError::Timeout`].
    pub async fn publish(&self, change: &RuleChange) -> Result<u64, RedisError> {
        if let (true, Some(event_id)) = (change.reset_buckets, &change.event_id) {
            return self.store.publish_granted(&self.channel, change, event_id).await;
        }
        let connection = self.store.connection();
        let publish = connection
            .next()
            .publish::<u64, _, _>(self.channel.as_str(), change.to_json());
        connection.within_deadline(publish).await
    }
}

/// The error of a change stored whose `PUBLISH` Redis refused after the write.
fn publish_refused(id: &str, message: String) -> AdminError {
    AdminError::Publish {
        rule_set: id.to_owned(),
        source: RedisError::Command(fred::error::Error::new(fred::error::ErrorKind::Auth, message)),
    }
}
