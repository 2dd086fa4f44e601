//! FluxGate as a service: the rate-limit engine over HTTP, for gateways and services in any
//! language (the Java original's HTTP API mode).
//!
//! - `POST /api/ratelimit/check` decides one request, `POST /api/ratelimit/check/batch`
//!   many (JSON, see [`fluxgate_core::api`]);
//! - `GET/PUT/DELETE /api/rulesets/{id}` and `GET /api/rulesets` administer the rule sets
//!   of the Redis rule store (bearer token; off without one);
//! - `GET /health`, `GET /metrics`, `GET /openapi.json`.
//!
//! The binary `fluxgate-server` reads a TOML file (`--config`) and flags; see
//! `docs/service.md`. The library runs the same service inside a program (and its tests):
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let config = fluxgate_server::Config::from_args(["--rules".to_owned(), "rules.yaml".to_owned()])?;
//! let service = fluxgate_server::Service::start(&config).await?;
//! let listener = tokio::net::TcpListener::bind(config.listen()).await?;
//! service.serve(listener, std::future::pending()).await?;
//! # Ok(()) }
//! ```

#![deny(unsafe_code)]

mod app;
pub mod config;
pub mod openapi;
mod serve;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use fluxgate_core::reload::{spawn_polling, spawn_watching, ReloadingRuleSetProvider, Watch};
use fluxgate_core::{BoxError, CircuitBreaker, Engine, FileRuleSource, MemoryLimiter};
use fluxgate_redis::{RedisLimiter, RedisRuleSetStore, RuleAdmin, RuleChangeListener};

pub use app::{router, AppState};
pub use config::{Config, ConfigError};

/// A running service: the state the routes share, and the tasks that keep its rules
/// current (a file watch, or a change listener and a poll). Dropping it stops them.
#[derive(Debug)]
pub struct Service {
    state: Arc<AppState>,
    timeouts: serve::Timeouts,
    _watch: Option<Watch>,
    _listener: Option<RuleChangeListener>,
    _polling: Option<AbortOnDrop>,
}

/// Aborts a task when dropped.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Service {
    /// Connects to Redis (when configured), loads the rules and starts keeping them
    /// current: a watch on the rule file, or a listener of the rule store's change events.
    ///
    /// # Errors
    ///
    /// Why the service cannot start: the rules do not load, Redis cannot be reached, a
    /// rule cannot be decided by the limiter.
    pub async fn start(config: &Config) -> Result<Self, BoxError> {
        config.check()?;
        let redis = match &config.redis {
            Some(url) => {
                let mut builder = RedisLimiter::builder(url.clone());
                let limiter = &config.limiter;
                if let Some(prefix) = &limiter.prefix {
                    builder = builder.prefix(prefix.clone());
                }
                if let Some(timeout) = config.limiter_timeout() {
                    builder = builder.timeout(timeout);
                }
                if let Some(size) = limiter.pool_size {
                    builder = builder.pool_size(size);
                }
                if let Some(on) = limiter.deny_cache {
                    builder = builder.deny_cache(on);
                }
                if let Some(most) = limiter.calls_in_flight_per_key {
                    builder = builder.calls_in_flight_per_key(most);
                }
                if let Some(batching) = &limiter.batching {
                    builder = builder.batching(batching.batching());
                }
                if let Some(ms) = limiter.reconnect_delay_ms {
                    builder = builder.reconnect_delay(Duration::from_millis(ms));
                }
                Some(builder.connect().await?)
            }
            None => None,
        };
        let (provider, watch, store) = match (&config.rules, &config.redis) {
            (Some(path), _) => {
                let source = FileRuleSource::new(path);
                let provider = Arc::new(ReloadingRuleSetProvider::new(source.read()?));
                let watch = spawn_watching(provider.clone(), source)?;
                (provider, Some(watch), None)
            }
            (None, Some(url)) => {
                let mut store = RedisRuleSetStore::connect(url).await?;
                if let Some(namespace) = &config.store.namespace {
                    store = RedisRuleSetStore::with_namespace(store.client().clone(), namespace.clone())?;
                }
                let store = store.allow_empty(config.store.allow_empty);
                let provider = Arc::new(ReloadingRuleSetProvider::new(store.load_rule_sets().await?));
                (provider, None, Some(store))
            }
            (None, None) => return Err(ConfigError::Inconsistent("no rules".into()).into()),
        };
        // Reports through the `metrics` facade: to the exporter the binary installs, to
        // nothing otherwise.
        let mut engine = Engine::builder(provider.clone()).recorder(fluxgate_core::metrics::MetricsRecorder::new());
        if let Some(limiter) = &redis {
            // A Redis that is down costs one deadline per check only until the breaker opens.
            let mut breaker = CircuitBreaker::new(limiter.clone());
            if let Some(failures) = config.limiter.circuit_failures {
                breaker = breaker.failure_threshold(failures);
            }
            if let Some(ms) = config.limiter.circuit_cool_down_ms {
                breaker = breaker.cool_down(Duration::from_millis(ms));
            }
            engine = engine.limiter(breaker);
        }
        if let Some(policy) = config.engine.unknown_rule_set {
            engine = engine.unknown_rule_set(policy.into());
        }
        if let Some(policy) = config.engine.on_backend_failure {
            engine = engine.on_backend_failure(policy.into());
            if policy == config::FailurePolicyConfig::FallbackLocal {
                engine = engine.fallback(MemoryLimiter::default());
            }
        }
        if let Some(bits) = config.engine.ipv6_prefix {
            engine = engine.ipv6_prefix(bits);
        }
        if let Some(prefix) = config.engine.nat64_prefix {
            engine = engine.nat64_prefix(prefix);
        }
        let engine = engine.build()?;
        let (listener, polling, admin) = match (store, &config.redis) {
            (Some(store), Some(url)) => {
                let store = Arc::new(store);
                let mut listener = RuleChangeListener::builder(provider.clone(), store.clone());
                // What the admin stores, this engine (and engines like it) must load.
                let mut admin = RuleAdmin::new((*store).clone()).validate_with_engine(engine.clone());
                if let Some(channel) = &config.store.channel {
                    listener = listener.channel(channel.clone());
                    admin = admin.channel(channel.clone());
                }
                if let Some(limiter) = &redis {
                    listener = listener.reset(limiter.clone());
                }
                if config.store.require_reset_grants {
                    listener = listener.require_reset_grants((*store).clone());
                }
                let listener = listener.subscribe(url).await?;
                let polling = config.store.poll_interval_ms.map(|ms| {
                    AbortOnDrop(spawn_polling(
                        provider.clone(),
                        store.clone(),
                        Duration::from_millis(ms),
                    ))
                });
                (Some(listener), polling, Some(admin))
            }
            _ => (None, None, None),
        };
        if let Some(bytes) = config
            .http
            .max_body_bytes
            .filter(|&bytes| bytes < fluxgate_core::api::MAX_CHECK_BYTES)
        {
            tracing::warn!(
                max_body_bytes = bytes,
                taken = fluxgate_core::api::MAX_CHECK_BYTES,
                "`[http] max_body_bytes` is below the largest check a gateway sends: raised to it"
            );
        }
        let state = AppState {
            engine,
            redis,
            admin,
            admin_token: config.admin.token.clone(),
            max_batch: config.max_batch(),
            max_body_bytes: config.max_body_bytes(),
            metrics: None,
        };
        Ok(Self {
            state: Arc::new(state),
            timeouts: serve::Timeouts {
                header: config.header_timeout(),
                body: config.body_timeout(),
                write: config.write_timeout(),
            },
            _watch: watch,
            _listener: listener,
            _polling: polling,
        })
    }

    /// The state the routes share.
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// Sets the `/metrics` renderer (before serving).
    pub fn with_metrics(mut self, render: impl Fn() -> String + Send + Sync + 'static) -> Self {
        if let Some(state) = Arc::get_mut(&mut self.state) {
            state.metrics = Some(Arc::new(render));
        }
        self
    }

    /// Serves the API on `listener` until `shutdown` completes; then stops accepting
    /// connections, waits for the requests in flight to finish, and gives back the permits
    /// the engine holds in local leases (rules with a `lease`).
    ///
    /// A connection must send each request head within `[http] header_timeout_ms` (from
    /// when it opens, or from the previous answer: an idle connection is closed then), and
    /// each body within `[http] body_timeout_ms` of its head (else `408`); a connection that
    /// takes no byte of an answer for `[http] write_timeout_ms` is closed. So clients that
    /// send nothing or part of a request, or read nothing of the answers, cannot hold
    /// connections for good.
    ///
    /// # Errors
    ///
    /// An I/O error of the listener.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let app = router(self.state.clone());
        // As `router` takes it: never below the largest check a gateway sends.
        let max_body_bytes = self.state.max_body_bytes.max(fluxgate_core::api::MAX_CHECK_BYTES);
        let served = serve::serve(listener, app, max_body_bytes, self.timeouts, shutdown).await;
        match self.state.engine.release_leases().await {
            Ok(0) => {}
            Ok(permits) => tracing::info!(permits, "leased permits given back"),
            Err(error) => tracing::warn!(%error, "leased permits not all given back"),
        }
        served
    }
}
