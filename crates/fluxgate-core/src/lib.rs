//! The core of FluxGate: distributed rate limiting for Rust HTTP services.
//!
//! This crate holds everything that does not depend on HTTP middleware or a network
//! backend:
//!
//! - [`RequestContext`]: what is known about a request (path, method, client IP, user,
//!   API key, rule set, attributes).
//! - The rule model ([`RuleSets`], [`RuleSet`], [`Rule`], [`Band`], [`Scope`]) with its
//!   YAML / TOML / JSON file format and validation.
//! - [`PathPattern`] (Ant-style) and the two views of a request path ([`path`]).
//! - [`key`]: a rule's key for a request, encoded so that no user value can collide with
//!   another or grow without bound.
//! - [`RateLimiter`] (backend trait) and [`MemoryLimiter`], the exact in-memory limiter of
//!   every algorithm; the [`limiter`] module holds the algorithms and the
//!   [`AcquireRequest`](limiter::AcquireRequest) backends receive.
//! - [`RuleSetProvider`] with [`StaticRuleSetProvider`] and [`CachingRuleSetProvider`];
//!   fixed [`RuleSets`] are a provider too.
//! - [`reload`]: hot reload, with [`ReloadingRuleSetProvider`] (rule sets replaced while
//!   engines use them, only those that changed) and [`FileRuleSource`] (a rule file or a
//!   directory of them), polled on a period or, with the `watch` feature, reloaded when
//!   the files change.
//! - [`Engine`] (a [`RateLimitHandler`], with an optional [`RateLimitMetricsRecorder`])
//!   and [`Decision`]. Each decision runs in a `fluxgate.decision` span at debug level.
//! - `metrics` (feature `metrics`): `MetricsRecorder`, the engine's decisions, errors and
//!   backend calls as metrics of the [`metrics`](https://docs.rs/metrics) facade, and the
//!   reload counters.
//!
//! ```
//! use fluxgate_core::{Engine, RequestContext, RuleSets};
//!
//! let rules = RuleSets::from_yaml_str(r#"
//! rule_sets:
//!   - id: default
//!     rules:
//!       - id: per-ip
//!         match: { paths: ["/api/**"] }
//!         bands: [{ capacity: 100, window: 1m }]
//! "#)?;
//! let engine = Engine::in_memory(rules);
//! let ctx = RequestContext::builder()
//!     .path("/api/users")
//!     .client_ip("192.0.2.7".parse()?)
//!     .build();
//! let decision = engine.check(&ctx).into_ready().expect("in memory").expect("decided");
//! assert!(decision.allowed());
//! assert_eq!(decision.remaining(), Some(99));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(unsafe_code)]

pub mod api;
mod bands;
mod clock;
mod context;
mod decision;
mod engine;
mod error;
pub mod failure;
mod future;
mod handler;
pub mod key;
mod lease;
pub mod limiter;
#[cfg(feature = "metrics")]
pub mod metrics;
mod name;
pub mod num;
pub mod path;
mod provider;
pub mod reload;
pub mod rule;
mod text;
mod wait;

pub use clock::{Clock, ManualClock, SystemClock, TokioClock};
pub use context::{RequestContext, RequestContextBuilder, AMBIGUOUS_IDENTITY, DEFAULT_RULE_SET};
pub use decision::{AdmittedBand, BandReport, Bands, Decision, Outcome};
pub use engine::{AddressDecision, Engine, EngineBuilder, UnknownRuleSet};
pub use error::{BoxError, Error, RuleError};
pub use failure::{CircuitBreaker, FailurePolicy, FallbackHandler};
pub use future::{BoxFuture, MaybeReady};
pub use handler::{RateLimitHandler, RateLimitMetricsRecorder};
pub use limiter::{MemoryLimiter, RateLimiter};
pub use name::Name;
pub use path::PathPattern;
pub use provider::{
    CachingRuleSetProvider, CachingRuleSetProviderBuilder, CheckFn, LookupsBusy, RuleCheck, RuleSetLookup,
    RuleSetProvider, StaticRuleSetProvider,
};
pub use reload::{FileRuleSource, ReloadingRuleSetProvider};
pub use rule::{
    Algorithm, Band, BandSpec, Format, KeyField, Lease, LeaseSpec, MatchSpec, Mode, OnLimitSpec, OnMissingKey, Rule,
    RuleSet, RuleSetSpec, RuleSets, RuleSpec, RulesFileSpec, Scope, ScopeKind, WaitPolicy, WaitSpec,
};
pub use text::{Shown, Text};
