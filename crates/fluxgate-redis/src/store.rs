//! [`RedisRuleSetStore`]: rule sets kept in Redis, one JSON document per rule set and an
//! index of their ids, read back as a [`RuleSource`] for reloads.

use std::fmt;
use std::time::Duration;

use fluxgate_core::reload::RuleSource;
use fluxgate_core::rule::check_id;
use fluxgate_core::{BoxError, BoxFuture, RuleError, RuleSet, RuleSetSpec, RuleSets};
use fred::clients::Client;
use fred::interfaces::{ClientLike, KeysInterface};
use fred::types::scripts::Script;
use fred::types::Value;

use crate::changes::RuleChange;
use crate::connection::{self, Connection};
use crate::error::RedisError;

/// The deadline of each call of the store unless another is given.
const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a call of a store connected from a URL may wait for a reply before its
/// connection counts as dead and is made again (following a failover from a primary that
/// stopped answering without closing it): a store deadline beyond it buys nothing.
const UNANSWERED: Duration = Duration::from_secs(5);

/// How often a store connected from a URL tries to reconnect.
const RECONNECT_DELAY: Duration = Duration::from_millis(100);

/// The namespace of the store's keys unless another is given.
pub const DEFAULT_RULES_NAMESPACE: &str = "fluxgate:rules";

/// Writes a rule set's document and adds its id to the index, in one step; answers 0 when
/// both already held it (the same document, the id indexed), 1 otherwise.
const PUT: &str = "local old = redis.call('GET', KEYS[1]); redis.call('SET', KEYS[1], ARGV[2]);
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 and old == ARGV[2] then return 0 end
return 1";

/// Removes a rule set's document and its id from the index, in one step; answers whether
/// there was one.
const DELETE: &str = "local n = redis.call('DEL', KEYS[1]); redis.call('SREM', KEYS[2], ARGV[1]); return n";

/// Whether the caller may publish `ARGV[4]` on the channel `ARGV[3]`, checked before
/// anything is written (Redis 7 and later; an earlier Redis has no such check, and a
/// refused `PUBLISH` there comes after the write); then [`PUT`] (`ARGV[2]` the document) or
/// [`DELETE`] (`ARGV[2]` empty), and the change published in the same step: `ARGV[4]` when
/// the store changed, `ARGV[5]` when it did not (a put of the rule set as stored; nothing
/// when empty). When the store changed and `KEYS[3]` is given, the reset grant of the
/// change's event is written there first, for `ARGV[6]` ms: the rule set id `ARGV[1]`, the
/// one scope the grant lets the event reset. Answers whether the store
/// changed and the subscribers reached, or `-1` and the error of a `PUBLISH` refused after
/// the write.
const ANNOUNCED: &str = "if redis.acl_check_cmd and not redis.acl_check_cmd('PUBLISH', ARGV[3], ARGV[4]) then
  return redis.error_reply('NOPERM this user has no permission to publish on channel ' .. ARGV[3] .. ': nothing was stored')
end
local changed
if ARGV[2] == '' then
  changed = redis.call('DEL', KEYS[1]) == 1
  redis.call('SREM', KEYS[2], ARGV[1])
else
  local old = redis.call('GET', KEYS[1])
  redis.call('SET', KEYS[1], ARGV[2])
  changed = redis.call('SADD', KEYS[2], ARGV[1]) == 1 or old ~= ARGV[2]
end
local message = ARGV[5]
if changed then
  message = ARGV[4]
  if KEYS[3] then redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[6]) end
elseif message == '' then
  return {0, 0}
end
local sent = redis.pcall('PUBLISH', ARGV[3], message)
if type(sent) == 'table' then return {changed and 1 or 0, -1, sent.err} end
return {changed and 1 or 0, sent}";

/// The reset grant `KEYS[1]` written for `ARGV[3]` ms (the scope it resets, `ARGV[4]`: a rule
/// set id, or `*` for every rule set), then `ARGV[2]` published on the channel `ARGV[1]`, in
/// one step.
const GRANTED: &str =
    "redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[3]); return redis.call('PUBLISH', ARGV[1], ARGV[2])";

/// The indexed ids.
const INDEX: &str = "return redis.call('SMEMBERS', KEYS[1])";

/// The documents of the ids in `ARGV` (their keys in `KEYS[2..]`), read in one step, if
/// the index (`KEYS[1]`) still names exactly those ids; `false` otherwise. A missing
/// document is `false` in the reply.
const LOAD: &str = "if redis.call('SCARD', KEYS[1]) ~= #ARGV then return false end
for _, id in ipairs(ARGV) do
  if redis.call('SISMEMBER', KEYS[1], id) == 0 then return false end
end
local out = {}
for i = 2, #KEYS do out[#out + 1] = redis.call('GET', KEYS[i]) end
return out";

/// How many times a load reads the index again when it changed in between.
const LOAD_ATTEMPTS: usize = 5;

/// How long a change's reset grant stays in the store: a listener that requires grants
/// resets for an event heard within this time of its publication, and at most once.
pub(crate) const RESET_GRANT_TTL_MS: u64 = 60_000;

/// The scope of a reset grant of an event that resets every rule set (no rule set id is
/// `*`, see [`check_id`]).
pub(crate) const GRANT_EVERYTHING: &str = "*";

/// The largest rule set document read: 16 MiB, as a rule file.
const MAX_DOCUMENT: usize = 16 * 1024 * 1024;

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
/// - As a [`RuleSource`], the store reads the index, then every indexed rule set in one
///   script call that checks the index did not change meanwhile (one
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
    index: Script,
    load: Script,
    announced: Script,
    granted: Script,
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
        let (builder, _) = connection::builder(url, RECONNECT_DELAY, UNANSWERED)?;
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
            index: Script::from_lua(INDEX),
            load: Script::from_lua(LOAD),
            announced: Script::from_lua(ANNOUNCED),
            granted: Script::from_lua(GRANTED),
        })
    }

    /// The client the store sends its commands through.
    pub fn client(&self) -> &Client {
        self.connection.next()
    }

    /// The store's connections, with its deadline.
    pub(crate) fn connection(&self) -> &Connection {
        &self.connection
    }

    /// The deadline of each call. Default 1 s. A store connected from a URL
    /// ([`connect`](Self::connect)) counts its connection dead once a call has waited 5 s
    /// for a reply: a longer deadline does not let a call wait longer.
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

    /// `spec` validated, and its document.
    fn document(&self, spec: &RuleSetSpec) -> Result<(RuleSet, String), StoreError> {
        let set = RuleSet::from_spec(spec.clone())?;
        let json = serde_json::to_string(spec).map_err(|e| StoreError::Document {
            id: set.id().to_string(),
            key: self.document_key(set.id()),
            reason: e.to_string(),
        })?;
        Ok((set, json))
    }

    /// Validates `spec` and stores it, replacing the rule set with the same id. Answers
    /// whether the store changed: `false` when it held this rule set already, as stored.
    ///
    /// # Errors
    ///
    /// [`StoreError::Rule`] when the rule set is not valid (nothing is stored), or
    /// [`StoreError::Redis`].
    pub async fn put(&self, spec: &RuleSetSpec) -> Result<bool, StoreError> {
        let (set, json) = self.document(spec)?;
        let keys = vec![self.document_key(set.id()), self.index_key()];
        let args = vec![set.id().to_string(), json];
        let changed: i64 = self.call(&self.put, keys, args).await?;
        Ok(changed != 0)
    }

    /// The key of the reset grant of the change event `event_id`: written by a
    /// [`RuleAdmin`](crate::RuleAdmin) of this store with each change that resets, read by
    /// the listeners that [require it](crate::RuleChangeListenerBuilder::require_reset_grants).
    pub fn reset_grant_key(&self, event_id: &str) -> String {
        format!("{}:reset-grant:{event_id}", self.tag)
    }

    /// The scope the reset grant of the change event `event_id` lets it reset (a rule set
    /// id, or [`GRANT_EVERYTHING`]), if the grant is in the store.
    pub(crate) async fn reset_grant(&self, event_id: &str) -> Result<Option<String>, StoreError> {
        let scope = self
            .connection
            .next()
            .get::<Option<String>, _>(self.reset_grant_key(event_id));
        Ok(self.connection.within_deadline(scope).await?)
    }

    /// Writes the reset grant of `change` (which has an event id) and publishes it on
    /// `channel`, in one step; answers the subscribers reached.
    pub(crate) async fn publish_granted(
        &self,
        channel: &str,
        change: &RuleChange,
        event_id: &str,
    ) -> Result<u64, RedisError> {
        let keys = vec![self.reset_grant_key(event_id)];
        let scope = change.rule_set.as_deref().unwrap_or(GRANT_EVERYTHING).to_owned();
        let args = vec![
            channel.to_owned(),
            change.to_json(),
            RESET_GRANT_TTL_MS.to_string(),
            scope,
        ];
        let call = self.granted.evalsha_with_reload(self.connection.next(), keys, args);
        self.connection.within_deadline(call).await
    }

    /// Stores `spec` (validated) as [`put`](Self::put) does and publishes, in the same
    /// step, `changed` on `channel` when the store changed (with its reset grant when it
    /// resets), `unchanged` otherwise. Nothing is stored when Redis (7 or later) says the
    /// store's user may not publish there.
    pub(crate) async fn put_announced(
        &self,
        spec: &RuleSetSpec,
        channel: &str,
        changed: &RuleChange,
        unchanged: &RuleChange,
    ) -> Result<Announced, StoreError> {
        let (set, json) = self.document(spec)?;
        self.announced(set.id(), json, channel, changed, unchanged.to_json())
            .await
    }

    /// Removes the rule set `id` as [`delete`](Self::delete) does and, when it was stored,
    /// publishes `change` on `channel` in the same step (with its reset grant when it
    /// resets).
    pub(crate) async fn delete_announced(
        &self,
        id: &str,
        channel: &str,
        change: &RuleChange,
    ) -> Result<Announced, StoreError> {
        self.announced(id, String::new(), channel, change, String::new()).await
    }

    /// One call of [`ANNOUNCED`]: the document `json` stored for `id` (removed when empty).
    async fn announced(
        &self,
        id: &str,
        json: String,
        channel: &str,
        changed: &RuleChange,
        unchanged: String,
    ) -> Result<Announced, StoreError> {
        let mut keys = vec![self.document_key(id), self.index_key()];
        if let (true, Some(event_id)) = (changed.reset_buckets, &changed.event_id) {
            keys.push(self.reset_grant_key(event_id));
        }
        let args = vec![
            id.to_owned(),
            json,
            channel.to_owned(),
            changed.to_json(),
            unchanged,
            RESET_GRANT_TTL_MS.to_string(),
        ];
        let reply: Vec<Value> = self.call(&self.announced, keys, args).await?;
        let mut reply = reply.into_iter();
        let changed = reply.next().and_then(|v| v.as_i64()) == Some(1);
        let published = match reply.next().and_then(|v| v.as_i64()) {
            Some(-1) => Err(reply.next().and_then(|v| v.into_string()).unwrap_or_default()),
            sent => Ok(sent.unwrap_or(0).max(0) as u64),
        };
        Ok(Announced { changed, published })
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

    /// The stored rule sets, by id: the index, then the documents in one script call
    /// that checks the index is unchanged (read again if it changed), so the rule sets
    /// are one consistent snapshot. Every key a script touches is declared.
    ///
    /// # Errors
    ///
    /// [`StoreError::Redis`], or [`StoreError::Document`] / [`StoreError::Missing`] for the
    /// first stored rule set (in id order) that cannot be read.
    pub async fn list(&self) -> Result<Vec<RuleSetSpec>, StoreError> {
        for _ in 0..LOAD_ATTEMPTS {
            // Read as bytes: a member that is not UTF-8 is named as the invalid id it is.
            let members: Vec<Value> = self.call(&self.index, vec![self.index_key()], vec![]).await?;
            let mut ids: Vec<String> = members
                .into_iter()
                .map(|member| match member {
                    Value::Bytes(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
                    other => other.into_string().unwrap_or_default(),
                })
                .collect();
            ids.sort();
            if let Some(bad) = ids.iter().find(|id| check_id(id).is_err()) {
                let shown: String = bad.chars().take(64).collect();
                return Err(StoreError::Document {
                    id: format!("{shown:?}"),
                    key: self.index_key(),
                    reason: "the index holds an id that is not a valid rule set id".into(),
                });
            }
            let mut keys = Vec::with_capacity(ids.len() + 1);
            keys.push(self.index_key());
            keys.extend(ids.iter().map(|id| self.document_key(id)));
            let reply: Value = self.call(&self.load, keys, ids.clone()).await?;
            if let Value::Array(documents) = reply {
                let documents = documents.into_iter().map(|document| match document {
                    Value::Null => Ok(None),
                    // Not UTF-8: the position of the first byte that is not.
                    Value::Bytes(bytes) => std::str::from_utf8(&bytes)
                        .map(|text| Some(text.to_owned()))
                        .map_err(|e| e.valid_up_to()),
                    other => Ok(other.into_string()),
                });
                return ids
                    .into_iter()
                    .zip(documents)
                    .map(|(id, document)| self.read_document(id, document))
                    .collect();
            }
            // The index changed between the two reads: read it again.
        }
        Err(StoreError::Document {
            id: "*".into(),
            key: self.index_key(),
            reason: format!("the index kept changing during {LOAD_ATTEMPTS} reads"),
        })
    }

    fn read_document(&self, id: String, document: Result<Option<String>, usize>) -> Result<RuleSetSpec, StoreError> {
        let key = self.document_key(&id);
        let document = match document {
            Ok(Some(document)) => document,
            Ok(None) => return Err(StoreError::Missing { id, key }),
            Err(at) => {
                return Err(StoreError::Document {
                    id,
                    key,
                    reason: format!("not UTF-8 text (byte {at} is not)"),
                })
            }
        };
        if document.len() > MAX_DOCUMENT {
            return Err(StoreError::Document {
                id,
                key,
                reason: format!(
                    "{} bytes, more than the {MAX_DOCUMENT} a rule set may hold",
                    document.len()
                ),
            });
        }
        let spec: RuleSetSpec = serde_json::from_str(&document).map_err(|e| StoreError::Document {
            id: id.clone(),
            key: key.clone(),
            reason: e.to_string(),
        })?;
        if spec.id != id {
            return Err(StoreError::Document {
                id,
                key,
                reason: format!("it holds rule set `{}`", spec.id.chars().take(64).collect::<String>()),
            });
        }
        Ok(spec)
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

/// What a change stored and announced in one step did.
#[derive(Debug)]
pub(crate) struct Announced {
    /// Whether the store changed.
    pub(crate) changed: bool,
    /// The subscribers the change reached, or why `PUBLISH` was refused after the write
    /// (only with a Redis older than 7, which cannot check the permission first).
    pub(crate) published: Result<u64, String>,
}

impl RuleSource for RedisRuleSetStore {
    fn load(&self) -> BoxFuture<Result<RuleSets, BoxError>> {
        let store = self.clone();
        Box::pin(async move { store.load_rule_sets().await.map_err(BoxError::from) })
    }
}
