//! FluxGate: distributed rate limiting for Rust HTTP services.
//!
//! This is the crate applications depend on. It re-exports the engine
//! ([`fluxgate_core`], as [`core`]) and, with the default `tower` feature, the middleware
//! ([`fluxgate_tower`], as [`tower`]).
//!
//! ```
//! use axum::{routing::get, Router};
//! use fluxgate::{Engine, RateLimitLayer, RuleSets};
//!
//! let rules = RuleSets::from_yaml_str(r#"
//! rule_sets:
//!   - id: default
//!     rules:
//!       - id: per-ip
//!         match: { paths: ["/api/**"] }
//!         bands:
//!           - { capacity: 10, window: 1s, label: burst }
//!           - { capacity: 100, window: 1m, label: sustained }
//! "#)?;
//! let app: Router = Router::new()
//!     .route("/api/hello", get(|| async { "hello" }))
//!     .layer(RateLimitLayer::new(Engine::in_memory(rules)));
//! // Serve it with the peer address: without `ConnectInfo`, no client address is known and
//! // every request counts as the one client `ip=unknown`.
//! // axum::serve(listener, app.into_make_service_with_connect_info::<std::net::SocketAddr>())
//! let _service = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
//! # Ok::<(), fluxgate::RuleError>(())
//! ```
//!
//! | feature | default | what it adds |
//! | --- | --- | --- |
//! | `tower` | yes | [`RateLimitLayer`] and the rest of [`fluxgate_tower`] |
//! | `axum` | yes | the client address from axum's `ConnectInfo` |
//! | `remote` | no | `tower`, and `fluxgate::tower::remote::RemoteHandler`: decisions asked of a rate-limit service (see `docs/service.md`) |
//! | `redis` | no | the Redis backend (the `fluxgate-redis` crate, as `fluxgate::redis`) |
//! | `watch` | no | `fluxgate::core::reload::spawn_watching`: rule files reloaded when they change |
//! | `mongodb` | no | rules kept in MongoDB, one document per rule (the `fluxgate-mongodb` crate, as `fluxgate::mongodb`); needs Rust 1.88 |
//! | `metrics` | no | metrics through the `metrics` facade: `fluxgate::core::metrics::MetricsRecorder` for the engine, reload counts, Redis deny-cache hits, the layer's fail-open admissions (see `docs/operations.md`) |

#![deny(unsafe_code)]

pub use fluxgate_core as core;
pub use fluxgate_core::{
    Algorithm, Band, CachingRuleSetProvider, CircuitBreaker, Decision, Engine, EngineBuilder, Error, FailurePolicy,
    FileRuleSource, MemoryLimiter, Mode, Outcome, RateLimitHandler, RateLimitMetricsRecorder, RateLimiter,
    ReloadingRuleSetProvider, RequestContext, RequestContextBuilder, Rule, RuleError, RuleSet, RuleSetProvider,
    RuleSets, Scope, StaticRuleSetProvider, UnknownRuleSet, WaitPolicy,
};

#[cfg(feature = "mongodb")]
pub use fluxgate_mongodb as mongodb;
#[cfg(feature = "redis")]
pub use fluxgate_redis as redis;
#[cfg(feature = "tower")]
pub use fluxgate_tower as tower;
#[cfg(feature = "tower")]
pub use fluxgate_tower::{RateLimit, RateLimitLayer};

/// The examples of the README and of the guides in `docs/`, compiled (and run, unless
/// marked `no_run`) as doc tests, so that they keep up with the API.
#[cfg(doctest)]
mod guides {
    #[doc = include_str!("../README.md")]
    struct Readme;
    #[doc = include_str!("../docs/acquisition.md")]
    struct Acquisition;
    #[doc = include_str!("../docs/configuration.md")]
    struct Configuration;
    #[doc = include_str!("../docs/reload.md")]
    struct Reload;
}
