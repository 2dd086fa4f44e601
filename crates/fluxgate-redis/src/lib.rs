//! The Redis backend of FluxGate: one atomic Lua script call decides every band of every
//! rule of a request, so that many application instances sharing one Redis enforce one
//! limit exactly.
//!
//! [`RedisLimiter`] implements [`RateLimiter`](fluxgate_core::limiter::RateLimiter): plug it into an
//! [`Engine`](fluxgate_core::Engine) in place of the in-memory limiter.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use fluxgate_core::{Engine, RuleSets};
//! use fluxgate_redis::RedisLimiter;
//!
//! let limiter = RedisLimiter::builder("redis://127.0.0.1:6379/0").prefix("myapp").connect().await?;
//! let rules = RuleSets::from_file("rules.yaml")?;
//! let engine = Engine::builder(rules).limiter(limiter).build()?; // refuses a rule Redis cannot decide
//! # Ok(()) }
//! ```
//!
//! # The script
//!
//! [`DECIDE_LUA`], joined from one file per algorithm in `lua/` (`lua/README.md` states
//! the `KEYS` / `ARGV` / reply protocol, field by field), reads Redis `TIME` in microseconds, evaluates
//! every band of every rule, whatever their algorithms, and writes only when every
//! enforced band admits the request. Requests of token buckets alone go to scripts of
//! their own that decide alike at less cost: [`ONE_TOKEN_BUCKET_LUA`] for one band,
//! [`TOKEN_BUCKETS_LUA`] for several. The scripts are loaded with `SCRIPT LOAD` when the
//! limiter connects and called with `EVALSHA`; after `NOSCRIPT` (a restart, a failover,
//! `SCRIPT FLUSH`) a script is loaded again and the call retried, so no request fails for it.
//!
//! # Keys
//!
//! A token-bucket rule is one key, `<prefix>:{<rule set>:<rule>:<key value>}`, for all its
//! bands: its value names them, `<band>:<capacity>/<window>` each (the window as in rule
//! files: `500ms`, `1m`, `1h`), then holds their states, so that a band whose name, capacity
//! or window changes starts full and the others keep their counts. The other algorithms
//! keep a key per band, `<prefix>:{<rule set>:<rule>:<key value>}:<band>:<capacity>/<window>`
//! followed by `:lb`, `:fw`, `:swl` or `:swc` for the leaky bucket, fixed window, sliding
//! window log and sliding window counter. Rule set and rule ids and band names are
//! validated ids, and key values are encoded by [`fluxgate_core::key`] so that no user value
//! contains `{`, `}` or `:`, nor grows without bound. The braces make all keys of one rule
//! share a hash slot. A key expires one second after its state stops counting (see
//! `docs/algorithms.md` and `lua/README.md`).
//!
//! # Deployments
//!
//! A standalone Redis (`redis://`, with database, user and password; `rediss://` for TLS
//! only when fred is built with a TLS client, see `docs/redis.md`, "Deployment"), or a
//! Redis Cluster named by several comma-separated nodes (`redis://h1:7000,h2:7001`) or a
//! `redis-cluster://` URL. On a cluster the buckets of a request are grouped by hash slot,
//! one call per slot goes out concurrently, and when a slot rejects, the slots that
//! admitted give back what they consumed (each algorithm's refund, next to its decision in its file of `lua/`). Sentinel: a
//! `redis-sentinel://` URL with the sentinels and `sentinelServiceName`; after a failover
//! the client follows the new primary and reloads the scripts on `NOSCRIPT`.
//!
//! # Rules in Redis
//!
//! [`RedisRuleSetStore`] keeps rule sets in Redis (one JSON document per rule set, and an
//! index), a [`RuleSource`](fluxgate_core::reload::RuleSource) for reloads. [`RuleAdmin`]
//! validates, stores and publishes each change as a [`RuleChange`] on
//! [`DEFAULT_CHANGES_CHANNEL`]; a [`RuleChangeListener`] on every instance reloads and
//! resets the changed rule set's buckets once per change ([`RedisLimiter::reset_buckets`]).
//!
//! # Metrics
//!
//! The engine's `fluxgate_core::metrics::MetricsRecorder` times every call of the limiter
//! in `fluxgate_backend_seconds{backend="redis"}` and counts its failures in
//! `fluxgate_backend_errors_total{backend="redis"}`. With the `metrics` feature, the
//! requests the deny cache rejects without a Redis call count in
//! `fluxgate_deny_cache_hits_total`.

#![deny(unsafe_code)]

mod admin;
mod band;
mod batch;
mod builder;
mod changes;
mod cluster;
mod connection;
mod deny_cache;
mod error;
mod health;
mod in_flight;
mod key;
mod limiter;
mod listener;
mod memory;
mod plan;
mod protocol;
mod request;
mod reset;
mod rule_script;
mod script;
mod store;
mod url;

pub use admin::{AdminError, RuleAdmin};
pub use band::{MAX_LOG_CAPACITY, MAX_SCALED_CAPACITY};
pub use batch::Batching;
pub use builder::RedisLimiterBuilder;
pub use changes::{ChangeError, RuleChange, DEFAULT_CHANGES_CHANNEL, MAX_CHANGE_MESSAGE};
pub use connection::DEFAULT_TIMEOUT;
pub use error::RedisError;
pub use health::Health;
pub use limiter::RedisLimiter;
pub use listener::{ListenerStats, RuleChangeListener, RuleChangeListenerBuilder};
pub use memory::MemoryPolicy;
pub use reset::ResetScope;
pub use script::{BATCH_LUA, DECIDE_LUA, ONE_TOKEN_BUCKET_LUA, REFUND_LUA, TOKEN_BUCKETS_LUA};
pub use store::{RedisRuleSetStore, StoreError, DEFAULT_RULES_NAMESPACE};
pub use url::redact_url;
