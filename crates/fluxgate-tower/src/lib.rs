//! Rate limiting for axum, hyper and any tower HTTP service, with the FluxGate engine.
//!
//! Wrap a service in [`RateLimitLayer`]. For every request the layer builds a
//! [`RequestContext`](fluxgate_core::RequestContext) (normalized path, method, client IP,
//! user, API key, rule set, attributes), lets an optional customizer closure adjust it,
//! and asks its [`RateLimitHandler`](fluxgate_core::RateLimitHandler) — usually an
//! [`Engine`](fluxgate_core::Engine) — for a decision. Admitted requests reach the inner
//! service and their responses carry `X-RateLimit-Limit`, `X-RateLimit-Remaining`,
//! `X-RateLimit-Reset` and the IETF draft `RateLimit-Policy` / `RateLimit` headers;
//! rejected ones are answered `429 Too Many Requests` with `Retry-After` and a JSON body,
//! without calling the inner service.
//!
//! ```
//! use axum::{routing::get, Router};
//! use fluxgate_core::{Engine, RuleSets};
//! use fluxgate_tower::RateLimitLayer;
//!
//! let rules = RuleSets::from_yaml_str(r#"
//! rule_sets:
//!   - id: default
//!     rules:
//!       - id: per-ip
//!         match: { paths: ["/api/**"] }
//!         bands: [{ capacity: 100, window: 1m }]
//! "#).unwrap();
//! let app: Router = Router::new()
//!     .route("/api/hello", get(|| async { "hello" }))
//!     .layer(RateLimitLayer::new(Engine::in_memory(rules)));
//! // Serve it with the peer address: without `ConnectInfo`, no client address is known and
//! // every request counts as the one client `ip=unknown`.
//! // axum::serve(listener, app.into_make_service_with_connect_info::<std::net::SocketAddr>())
//! let _service = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
//! ```
//!
//! # Where the client address comes from
//!
//! A [`ClientIp`] extension (set by an earlier layer), else axum's
//! `ConnectInfo<SocketAddr>` (feature `axum`, on by default), else a `SocketAddr`
//! extension. One forwarding header, the configured one (`X-Forwarded-For` by default, or
//! `Forwarded`), is read, and only when that peer is one of the configured
//! [trusted proxies](RateLimitLayerBuilder::trusted_proxies): right to left, skipping
//! trusted hops (see [`ClientIpResolver`]). The user id and API key come from [`UserId`] and
//! [`ApiKey`] extensions (set by an authentication layer), else from the `X-User-Id` and
//! `X-API-Key` headers (configurable).
//!
//! # Failures
//!
//! When the handler fails (a backend error that no failure policy of the rules or the
//! engine covers), the layer's [`FailurePolicy`](fluxgate_core::FailurePolicy)
//! ([`RateLimitLayerBuilder::on_error`]) decides: admit without headers and log a warning
//! (`FailOpen`, the default), or answer `503` (`FailClosed`; another status with
//! [`RateLimitLayerBuilder::unavailable_status`]). Three errors are never admitted by the
//! policy, since a request can cause them at will or a configuration error would pass
//! unseen: a request that cannot be rate-limited (`Error::Refused`: `400`), a rule the
//! backend cannot decide (`Error::Rule`: `500`), and a rule set that could not be looked up
//! in time (`Error::Overloaded`: the unavailable status). Errors of the inner service pass
//! through untouched. While a circuit breaker is open, such failures are logged at debug level (the
//! breaker warned when it opened), so that an outage does not log a warning per request.
//!
//! # Metrics
//!
//! The engine counts its decisions (`fluxgate_core::metrics::MetricsRecorder`). With the
//! `metrics` feature the layer counts, through the `metrics` facade, what it decides on its
//! own: requests admitted by `on_error(FailOpen)` in `fluxgate_fail_open_total{rule_set}`,
//! and rejections let through in shadow mode in
//! `fluxgate_shadow_rejections_total{rule_set, rule}`. The `rule_set` label of a failure is
//! the layer's rule set, or `(unknown)` when a customizer chose another id for the request
//! (such an id may come from the request itself).

#![deny(unsafe_code)]

mod client_ip;
mod config;
mod future;
mod layer;
#[cfg(feature = "remote")]
pub mod remote;
mod response;
mod service;
mod values;

pub use client_ip::{ClientIp, ClientIpResolver, IpNet, IpNetError};
pub use config::{Customizer, RejectionResponder};
pub use future::ResponseFuture;
pub use layer::{ConfigError, RateLimitLayer, RateLimitLayerBuilder};
pub use response::{RATELIMIT, RATELIMIT_POLICY, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET};
pub use service::RateLimit;

/// The authenticated user, as a request extension: an authentication layer earlier in
/// the stack inserts it, and it wins over the user header.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UserId(pub String);

/// The caller's API key, as a request extension; it wins over the API key header.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ApiKey(pub String);
