//! [`RedisRuleSetStore`]: rule sets kept in Redis, one JSON document per rule set and an
//! index of their ids, read back as a [`RuleSource`] for reloads.

use std::fmt;
use std::time::Duration;

use fluxgate_core::reload::RuleSource;
use fluxgate_core::{BoxError, BoxFuture, RuleError, RuleSet, RuleSetSpec, RuleSets};
use fred::clients::Client;
use fred::interfaces::ClientLike;
use fred::types::scripts::Script;

use crate::connection::{self, Connection};
use crate::error::RedisError;

/// The deadline of each call of the store unless another is given.
const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(1);

/// How often a store connected from a URL tries to reconnect.
const RECONNECT_DELAY: Duration = Duration::from_millis(100);

/// The namespace of the store's keys unless another is given.
pub const DEFAULT_RULES_NAMESPACE: &str = "fluxgate:rules";

/// Writes a rule set's document and adds its id to the index, in one step.
const PUT: &str = "redis.call('SET', KEYS[1], ARGV[2]); redis.call('SADD', KEYS[2], ARGV[1]); return 1";

/// Removes a rule set's document and its id from the index, in one step; answers whether
/// there was one.
const DELETE: &str = "local n = redis.call('DEL', KEYS[1]); redis.call('SREM', KEYS[2], ARGV[1]); return n";

/// Every indexed id with its document (`false` when missing), read in one step:
/// `id1, doc1, id2, doc2, …`.
const LOAD: &str = "local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  out[#out + 1] = id
  out[#out + 1] = redis.call('GET', ARGV[1] .. id)
end
return out";

/// Why the rule store failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Redis failed or did not answer in time.
    #[error(transparent)]
    Redis(#[from] RedisError),
    /// The rule set is not valid; nothing was stored.
    #[error(transparent)]
    Rule(#[from] RuleError),
    /// A stored document is not a rule set.
    #[error("rule store: the document of rule set `{id}` (key `{key}`) is not a valid rule set: {reason}")]
    Document {
        /// The rule set id of the index.
        id: String,
        /// The document's key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The index names a rule set whose document is missing.
    #[error("rule store: rule set `{id}` is in the index but its document (key `{key}`) is missing")]
    Missing {
        /// The rule set id of the index.
        id: String,
        /// The document's key.
        key: String,
    },
    /// The store holds no rule set. A load refuses it unless
    /// [`allow_empty`](RedisRuleSetStore::allow_empty) was set: an index lost to eviction,
    /// a flush or a failover to an empty replica must not remove every rule.
    #[error("rule store: the index `{index}` names no rule set; the rules in force are kept")]
    Empty {
        /// The index key.
        index: String,
    },
    /// The namespace cannot hold the store's keys.
    #[error("rule store namespace `{namespace}`: {reason}")]
    Namespace {
        /// The namespace given.
        namespace: String,
        /// What is wrong.
        reason: &'static str,
    },
}

/// Rule sets kept in Redis: one JSON document per rule set (the file format's
/// [`RuleSetSpec`]) under `{<namespace>}:set:<id>`, and the set of ids under
/// `{<namespace>}:index`.
///
/// - Every key carries the hash tag `{<namespace>}`, so that on a Redis Cluster they all
///   live in one slot and each write is one atomic script call; listing reads the index,
///   never `KEYS` or `SCAN`.
/// - The keys begin with `{`, while the limiter's bucket keys begin with its prefix
///   (`fluxgate:` by default), so no pattern over bucket keys matches a key of the store.
/// - [`put`](Self::put) validates the rule set before it stores anything: an invalid rule
///   set is never stored.
/// - As a [`RuleSource`], the store loads every indexed rule set in one script call (one
///   consistent snapshot); a stored document that is not a valid rule set fails the load,
///   so that a reload keeps the rules in force, and so does an empty store (unless
///   [`allow_empty`](Self::allow_empty)): the Redis that holds the rules should not evict
///   keys (`noeviction` or a `volatile-*` policy) and should persist them.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use fluxgate_core::reload::{spawn_polling, ReloadingRuleSetProvider};
/// use fluxgate_core::{RuleSets, RuleSetSpec};
/// use fluxgate_redis::RedisRuleSetStore;
///
/// let store = Arc::new(RedisRuleSetStore::connect("redis://127.0.0.1:6379").await?);
/// let spec: RuleSetSpec = serde_json::from_str(r#"{"id": "api", "rules": [
///     {"id": "per-ip", "bands": [{"capacity": 100, "window": "1m"}]}]}"#)?;
/// store.put(&spec).await?;
/// let provider = Arc::new(ReloadingRuleSetProvider::new(RuleSets::default()));
/// provider.reload_from(&*store).await?;
/// let _poll = spawn_polling(provider, store, std::time::Duration::from_secs(5));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisRuleSetStore {
    connection: Connection,
    tag: String,
    allow_empty: bool,
    put: Script,
    delete: Script,
    load: Script,
}

impl fmt::Debug for RedisRuleSetStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisRuleSetStore")
            .field("namespace", &self.tag)
            .field("timeout", &self.connection.timeout())
            .finish_non_exhaustive()
    }
}

impl RedisRuleSetStore {
    /// Connects to the Redis at `url` (the same URL forms as
    /// [`RedisLimiter::builder`](crate::RedisLimiter::builder): standalone, Cluster,
    /// Sentinel) and returns a store in the [`DEFAULT_RULES_NAMESPACE`].
    ///
    /// # Errors
    ///
    /// [`RedisError::Url`] for a URL that cannot be used, [`RedisError::Connect`] when
    /// Redis cannot be reached.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let (builder, _) = connection::builder(url, RECONNECT_DELAY)?;
        let client = builder.build().map_err(RedisError::Connect)?;
        client.init().await.map_err(RedisError::Connect)?;
        Self::new(client)
    }

    /// A store in the [`DEFAULT_RULES_NAMESPACE`], over a client the application connected.
    ///
    /// # Errors
    ///
    /// Never for the default namespace; see [`with_namespace`](Self::with_namespace).
    pub fn new(client: Client) -> Result<Self, StoreError> {
        Self::with_namespace(client, DEFAULT_RULES_NAMESPACE)
    }

    /// A store whose keys are tagged `{<namespace>}`.
    ///
    /// # Errors
    ///
    /// [`StoreError::Namespace`] when the namespace is empty or holds `{` or `}` (it would
    /// change the keys' hash tag).
    pub fn with_namespace(client: Client, namespace: impl Into<String>) -> Result<Self, StoreError> {
        let namespace = namespace.into();
        let reason = if namespace.is_empty() {
            Some("it is empty")
        } else if namespace.contains(['{', '}']) {
            Some("it holds `{` or `}`, which would change the keys' hash tag")
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(StoreError::Namespace { namespace, reason });
        }
        Ok(Self {
            connection: Connection::client(client).with_timeout(DEFAULT_STORE_TIMEOUT),
            tag: format!("{{{namespace}}}"),
            allow_empty: false,
            put: Script::from_lua(PUT),
            delete: Script::from_lua(DELETE),
            load: Script::from_lua(LOAD),
        })
    }

    /// The client the store sends its commands through.
    pub fn client(&self) -> &Client {
        self.connection.next()
    }

    /// The deadline of each call.
    pub(crate) fn call_timeout(&self) -> Duration {
        self.connection.timeout()
    }

    /// The deadline of each call. Default 1 s.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.connection = self.connection.with_timeout(timeout);
        self
    }

    /// Whether a load may find no rule set at all. Default `false`: an empty store fails
    /// the load with [`StoreError::Empty`], so that a reload keeps the rules in force.
    #[must_use]
    pub fn allow_empty(mut self, allow: bool) -> Self {
        self.allow_empty = allow;
        self
    }

    /// The key of a rule set's document.
    pub fn document_key(&self, id: &str) -> String {
        format!("{}:set:{id}", self.tag)
    }

    /// The key of the index of rule set ids.
    pub fn index_key(&self) -> String {
        format!("{}:index", self.tag)
    }

    /// Validates `spec` and stores it, replacing the rule set with the same id.
    ///
    /// # Errors
    ///
    /// [`StoreError::Rule`] when the rule set is not valid (nothing is stored), or
    /// [`StoreError::Redis`].
    pub async fn put(&self, spec: &RuleSetSpec) -> Result<(), StoreError> {
        let set = RuleSet::from_spec(spec.clone())?;
        let json = serde_json::to_string(spec).map_err(|e| StoreError::Document {
            id: set.id().to_string(),
            key: self.document_key(set.id()),
            reason: e.to_string(),
        })?;
        let keys = vec![self.document_key(set.id()), self.index_key()];
        let args = vec![set.id().to_string(), json];
        let _: i64 = self.call(&self.put, keys, args).await?;
        Ok(())
    }

    /// Removes the rule set `id`; answers whether it was stored.
    ///
    /// # Errors
    ///
    /// [`StoreError::Redis`].
    pub async fn delete(&self, id: &str) -> Result<bool, StoreError> {
        let keys = vec![self.document_key(id), self.index_key()];
        let removed: i64 = self.call(&self.delete, keys, vec![id.to_owned()]).await?;
        Ok(removed > 0)
    }

    /// The stored rule sets, by id, read in one script call.
    ///
    /// # Errors
    ///
    /// [`StoreError::Redis`], or [`StoreError::Document`] / [`StoreError::Missing`] for the
    /// first stored rule set (in id order) that cannot be read.
    pub async fn list(&self) -> Result<Vec<RuleSetSpec>, StoreError> {
        let args = vec![format!("{}:set:", self.tag)];
        let flat: Vec<Option<String>> = self.call(&self.load, vec![self.index_key()], args).await?;
        let mut specs = Vec::with_capacity(flat.len() / 2);
        let mut pairs: Vec<(String, Option<String>)> = flat
            .chunks(2)
            .map(|pair| (pair[0].clone().unwrap_or_default(), pair.get(1).cloned().flatten()))
            .collect();
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        for (id, document) in pairs {
            let key = self.document_key(&id);
            let Some(document) = document else {
                return Err(StoreError::Missing { id, key });
            };
            let spec: RuleSetSpec = serde_json::from_str(&document).map_err(|e| StoreError::Document {
                id: id.clone(),
                key: key.clone(),
                reason: e.to_string(),
            })?;
            if spec.id != id {
                return Err(StoreError::Document {
                    id,
                    key,
                    reason: format!("it holds rule set `{}`", spec.id),
                });
            }
            specs.push(spec);
        }
        Ok(specs)
    }

    /// The stored rule sets, validated.
    ///
    /// # Errors
    ///
    /// As [`list`](Self::list), [`StoreError::Rule`] for a stored rule set that is not
    /// valid, and [`StoreError::Empty`] when the store holds none and
    /// [`allow_empty`](Self::allow_empty) is not set.
    pub async fn load_rule_sets(&self) -> Result<RuleSets, StoreError> {
        let specs = self.list().await?;
        if specs.is_empty() && !self.allow_empty {
            return Err(StoreError::Empty {
                index: self.index_key(),
            });
        }
        Ok(RuleSets::from_specs(specs)?)
    }

    async fn call<R: fred::types::FromValue>(
        &self,
        script: &Script,
        keys: Vec<String>,
        args: Vec<String>,
    ) -> Result<R, StoreError> {
        let call = script.evalsha_with_reload(self.connection.next(), keys, args);
        Ok(self.connection.within_deadline(call).await?)
    }
}

impl RuleSource for RedisRuleSetStore {
    fn load(&self) -> BoxFuture<Result<RuleSets, BoxError>> {
        let store = self.clone();
        Box::pin(async move { store.load_rule_sets().await.map_err(BoxError::from) })
    }
}
