//! [`MongoRuleSource`]: the rules of a MongoDB collection, one document per rule, as a
//! [`RuleSource`] for reloads.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use bson::{doc, Bson, Document};
use fluxgate_core::reload::RuleSource;
use fluxgate_core::{BoxError, BoxFuture, RuleSetSpec, RuleSets};
use futures_util::TryStreamExt;
use mongodb::{Client, Collection};

use crate::document::{self, MappingError, WriteError, DEFAULT_COLLECTION};

/// The deadline of each call of the source unless another is given.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the MongoDB rule source failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SourceError {
    /// The connection string is not usable, or MongoDB failed.
    #[error("MongoDB rule source `{namespace}`: {source}")]
    Mongo {
        /// The collection (`database.collection`), or the connection string's place when
        /// there is none yet.
        namespace: String,
        /// The driver's error.
        #[source]
        source: mongodb::error::Error,
    },
    /// MongoDB did not answer within the deadline ([`MongoRuleSource::timeout`]).
    #[error("MongoDB rule source `{namespace}`: no answer to {operation} within {timeout:?}")]
    Timeout {
        /// The collection.
        namespace: String,
        /// What was asked (`find`, `ping`, …).
        operation: &'static str,
        /// The deadline.
        timeout: Duration,
    },
    /// The documents do not make valid rule sets; the rules in force are kept.
    #[error("MongoDB rule source `{namespace}`: {source}")]
    Rules {
        /// The collection.
        namespace: String,
        /// The document at fault, the field and what is wrong.
        #[source]
        source: MappingError,
    },
    /// The rule set cannot be stored; nothing was written.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// The collection (with its filter) holds no rule document. A load refuses it unless
    /// [`allow_empty`](MongoRuleSource::allow_empty) was set: a wrong database or
    /// collection name, or a collection dropped by mistake, must not remove every rule.
    #[error("MongoDB rule source `{namespace}`: no rule document{filter}; the rules in force are kept")]
    Empty {
        /// The collection.
        namespace: String,
        /// The rule set filter, when there is one (` for rule sets [a, b]`).
        filter: String,
    },
}

/// The rules of a MongoDB collection, one document per rule, in the shape the Java
/// FluxGate used (see [`document`](crate::document) for the fields): a
/// [`RuleSource`] for [`ReloadingRuleSetProvider::reload_from`] and [`spawn_polling`].
///
/// - A load reads every document (or those of the rule sets given to
///   [`rule_sets`](Self::rule_sets)) with one `find`, groups the rules by `ruleSetId` and
///   validates them as rule files are validated. A document that is not a valid rule fails
///   the load with an error naming the document (`_id`, `ruleSetId`, `id`) and the field,
///   so that a reload keeps the rules in force; so does an empty collection unless
///   [`allow_empty`](Self::allow_empty).
/// - Each call (a load, a write, the `ping` of [`connect`](Self::connect)) has a deadline,
///   [`DEFAULT_TIMEOUT`] unless [`timeout`](Self::timeout) sets another.
/// - [`put_rule_set`](Self::put_rule_set) and [`delete_rule_set`](Self::delete_rule_set)
///   write the same documents, for tools and tests; `put_rule_set` validates first and
///   never stores an invalid rule set.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use std::sync::Arc;
/// use std::time::Duration;
/// use fluxgate_core::reload::{spawn_polling, ReloadingRuleSetProvider};
/// use fluxgate_core::Engine;
/// use fluxgate_mongodb::MongoRuleSource;
///
/// let source = MongoRuleSource::connect("mongodb://127.0.0.1:27017", "fluxgate").await?;
/// let provider = Arc::new(ReloadingRuleSetProvider::new(source.load_rule_sets().await?));
/// let engine = Engine::builder(provider.clone()).build()?;
/// // Every 10 s: read the collection again and swap in the rule sets that changed.
/// let polling = spawn_polling(provider, Arc::new(source), Duration::from_secs(10));
/// # drop((engine, polling));
/// # Ok(()) }
/// ```
///
/// [`ReloadingRuleSetProvider::reload_from`]: fluxgate_core::reload::ReloadingRuleSetProvider::reload_from
/// [`spawn_polling`]: fluxgate_core::reload::spawn_polling
#[derive(Clone)]
pub struct MongoRuleSource {
    collection: Collection<Document>,
    rule_sets: Option<Vec<String>>,
    timeout: Duration,
    allow_empty: bool,
}

impl fmt::Debug for MongoRuleSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MongoRuleSource")
            .field("collection", &self.namespace())
            .field("rule_sets", &self.rule_sets)
            .field("timeout", &self.timeout)
            .field("allow_empty", &self.allow_empty)
            .finish()
    }
}

impl MongoRuleSource {
    /// Connects to the MongoDB of the connection string `uri` (`mongodb://host:27017`,
    /// with its options; `mongodb+srv://` needs the `dns-resolver` feature) and returns a
    /// source of the collection [`DEFAULT_COLLECTION`] of `database`, once MongoDB has
    /// answered a `ping` within the deadline.
    ///
    /// # Errors
    ///
    /// [`SourceError::Mongo`] for a connection string that cannot be used or a MongoDB
    /// that refuses the `ping`, [`SourceError::Timeout`] when none answers in time.
    pub async fn connect(uri: &str, database: &str) -> Result<Self, SourceError> {
        let client = within(DEFAULT_TIMEOUT, database, "connect", Client::with_uri_str(uri)).await?;
        let source = Self::from_collection(client.database(database).collection(DEFAULT_COLLECTION));
        let db = client.database(database);
        source
            .call("ping", async { db.run_command(doc! { "ping": 1 }).await })
            .await?;
        Ok(source)
    }

    /// A source of `collection`, over a client the application connected.
    pub fn from_collection(collection: Collection<Document>) -> Self {
        Self {
            collection,
            rule_sets: None,
            timeout: DEFAULT_TIMEOUT,
            allow_empty: false,
        }
    }

    /// The collection `name` of the same database, instead of [`DEFAULT_COLLECTION`].
    #[must_use]
    pub fn collection(mut self, name: &str) -> Self {
        let database = self.collection.namespace().db;
        self.collection = self.collection.client().database(&database).collection(name);
        self
    }

    /// Loads only the rules of these rule sets (`ruleSetId` in the list) rather than
    /// every document of the collection. The other rule sets are then not loaded at all:
    /// a reload removes them from the provider.
    #[must_use]
    pub fn rule_sets<I, S>(mut self, ids: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.rule_sets = Some(ids.into_iter().map(Into::into).collect());
        self
    }

    /// The deadline of each call. Default [`DEFAULT_TIMEOUT`] (5 s).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Whether a load may find no rule document at all. Default `false`: an empty
    /// collection fails the load with [`SourceError::Empty`], so that a reload keeps the
    /// rules in force.
    #[must_use]
    pub fn allow_empty(mut self, allow: bool) -> Self {
        self.allow_empty = allow;
        self
    }

    /// The collection read and written.
    pub fn mongo_collection(&self) -> &Collection<Document> {
        &self.collection
    }

    /// The collection as `database.collection`.
    pub fn namespace(&self) -> String {
        self.collection.namespace().to_string()
    }

    /// Every rule document (or those of the selected rule sets), read with one `find`.
    ///
    /// # Errors
    ///
    /// [`SourceError::Mongo`] or [`SourceError::Timeout`].
    pub async fn documents(&self) -> Result<Vec<Document>, SourceError> {
        let filter = match &self.rule_sets {
            Some(ids) => doc! { "ruleSetId": { "$in": ids.clone() } },
            None => Document::new(),
        };
        let find = self.collection.find(filter).max_time(self.timeout);
        self.call("find", async move { find.await?.try_collect::<Vec<Document>>().await })
            .await
    }

    /// The stored rule sets, grouped by `ruleSetId`, not validated.
    ///
    /// # Errors
    ///
    /// As [`documents`](Self::documents), and [`SourceError::Rules`] for a document that
    /// cannot be read as a rule or a rule stored twice.
    pub async fn list(&self) -> Result<Vec<RuleSetSpec>, SourceError> {
        let documents = self.documents().await?;
        document::rule_set_specs_from_documents(&documents).map_err(|source| self.rules_error(source))
    }

    /// The stored rule sets, validated.
    ///
    /// # Errors
    ///
    /// As [`documents`](Self::documents), [`SourceError::Rules`] naming the first
    /// document that is not a valid rule, and [`SourceError::Empty`] when there is no
    /// document and [`allow_empty`](Self::allow_empty) is not set.
    pub async fn load_rule_sets(&self) -> Result<RuleSets, SourceError> {
        let documents = self.documents().await?;
        if documents.is_empty() && !self.allow_empty {
            return Err(SourceError::Empty {
                namespace: self.namespace(),
                filter: match &self.rule_sets {
                    Some(ids) => format!(" for rule sets [{}]", ids.join(", ")),
                    None => String::new(),
                },
            });
        }
        document::rule_sets_from_documents(&documents).map_err(|source| self.rules_error(source))
    }

    /// Validates `spec` and stores it, one document per rule
    /// ([`rule_set_to_documents`](document::rule_set_to_documents)), replacing the rule
    /// set with the same id.
    ///
    /// Without a transaction: each rule's document is replaced (or inserted) in turn, by
    /// `ruleSetId` and `id`, then the documents of the rules the new rule set no longer has
    /// are deleted. A load that runs meanwhile may see some rules old and some new, or
    /// both the old and the new rules, never a rule set emptied; the next load sees the
    /// whole new rule set.
    ///
    /// # Errors
    ///
    /// [`SourceError::Write`] when the rule set is not valid or cannot be stored (nothing
    /// is written), [`SourceError::Mongo`] or [`SourceError::Timeout`] (some rules may
    /// be written).
    pub async fn put_rule_set(&self, spec: &RuleSetSpec) -> Result<(), SourceError> {
        let documents = document::rule_set_to_documents(spec)?;
        for document in documents {
            let rule = document.get_str("id").unwrap_or_default().to_owned();
            let filter = doc! { "ruleSetId": spec.id.as_str(), "id": rule };
            let replace = self.collection.replace_one(filter, document).upsert(true);
            self.call("replaceOne", async move { replace.await }).await?;
        }
        let keep: Vec<Bson> = spec.rules.iter().map(|r| Bson::String(r.id.clone())).collect();
        let stale = doc! { "ruleSetId": spec.id.as_str(), "id": { "$nin": keep } };
        let delete = self.collection.delete_many(stale);
        self.call("deleteMany", async move { delete.await }).await?;
        Ok(())
    }

    /// Deletes every document of the rule set `id`; answers how many there were.
    ///
    /// # Errors
    ///
    /// [`SourceError::Mongo`] or [`SourceError::Timeout`].
    pub async fn delete_rule_set(&self, id: &str) -> Result<u64, SourceError> {
        let delete = self.collection.delete_many(doc! { "ruleSetId": id });
        let result = self.call("deleteMany", async move { delete.await }).await?;
        Ok(result.deleted_count)
    }

    fn rules_error(&self, source: MappingError) -> SourceError {
        SourceError::Rules {
            namespace: self.namespace(),
            source,
        }
    }

    async fn call<T>(
        &self,
        operation: &'static str,
        call: impl Future<Output = mongodb::error::Result<T>>,
    ) -> Result<T, SourceError> {
        within(self.timeout, &self.namespace(), operation, call).await
    }
}

/// Runs `call` within `timeout`.
async fn within<T>(
    timeout: Duration,
    namespace: &str,
    operation: &'static str,
    call: impl Future<Output = mongodb::error::Result<T>>,
) -> Result<T, SourceError> {
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(source)) => Err(SourceError::Mongo {
            namespace: namespace.to_owned(),
            source,
        }),
        Err(_) => Err(SourceError::Timeout {
            namespace: namespace.to_owned(),
            operation,
            timeout,
        }),
    }
}

impl RuleSource for MongoRuleSource {
    fn load(&self) -> BoxFuture<Result<RuleSets, BoxError>> {
        let source = self.clone();
        Box::pin(async move { source.load_rule_sets().await.map_err(BoxError::from) })
    }
}
