//! [`RateLimitLayer`] and its configuration.

use std::any::Any;
use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use bytes::Bytes;
use fluxgate_core::{
    Decision, Engine, FailurePolicy, Name, PathPattern, RateLimitHandler, RequestContextBuilder, DEFAULT_RULE_SET,
};
use http::request::Parts;
use http::{HeaderName, Response};
use tower_layer::Layer;

use crate::client_ip::{ClientIpResolver, IpNet};
use crate::config::{Config, Customizer, RejectionResponder};
use crate::service::RateLimit;

/// Applies rate limiting to a service. See the [crate documentation](crate).
#[derive(Clone)]
pub struct RateLimitLayer {
    pub(crate) config: Arc<Config>,
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer").field("config", &self.config).finish()
    }
}

/// Why a layer configuration was rejected: the option and the bad value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A trusted proxy is not an address or CIDR.
    #[error("rate-limit layer option `trusted_proxies`: invalid trusted proxy `{value}`: {reason}")]
    TrustedProxy {
        /// The value given.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// An include or exclude pattern is malformed.
    #[error("rate-limit layer option `{option}`: {message}")]
    Pattern {
        /// `include` or `exclude`.
        option: &'static str,
        /// What is wrong, naming the pattern.
        message: String,
    },
    /// A header name is not valid.
    #[error("rate-limit layer option `{option}`: `{name}` is not a valid header name")]
    HeaderName {
        /// The option being set.
        option: &'static str,
        /// The name given.
        name: String,
    },
    /// The failure policy needs what the layer does not have.
    #[error("rate-limit layer option `on_error`: {policy:?} {reason}")]
    FailurePolicy {
        /// The policy given.
        policy: FailurePolicy,
        /// Why the layer cannot apply it.
        reason: &'static str,
    },
    /// The status of the answer to a request refused by a failure is not an error status.
    #[error("rate-limit layer option `unavailable_status`: {status} is not a 4xx or 5xx status")]
    UnavailableStatus {
        /// The status given.
        status: http::StatusCode,
    },
}

/// Builds a [`RateLimitLayer`]; every option is checked in [`build`](Self::build).
///
/// ```
/// use fluxgate_core::{Engine, RuleSets};
/// use fluxgate_tower::RateLimitLayer;
///
/// let layer = RateLimitLayer::builder(Engine::in_memory(RuleSets::default()))
///     .rule_set("api")
///     .trusted_proxies(["10.0.0.0/8", "::1"])
///     // Set by the gateway in front on every request after authenticating it (and removed
///     // from what clients send): read from a client, it would name its own counter.
///     .user_header("x-user-id")
///     .exclude(["/health", "/metrics/**"])
///     .ietf_headers(false)
///     .customizer(|ctx, parts| {
///         // Set by the same gateway, from the authenticated identity.
///         if let Some(tenant) = parts.headers.get("x-tenant-id").and_then(|v| v.to_str().ok()) {
///             ctx.set_attribute("tenant", tenant);
///         }
///     })
///     .build()
///     .expect("valid configuration");
/// ```
pub struct RateLimitLayerBuilder {
    handler: Arc<dyn RateLimitHandler>,
    /// The handler, when it is an [`Engine`] itself.
    engine: Option<Engine>,
    rule_set: Name,
    trusted: Vec<String>,
    forwarded_for: String,
    user_header: Option<String>,
    api_key_header: Option<String>,
    include: Vec<String>,
    exclude: Vec<String>,
    legacy_headers: bool,
    ietf_headers: bool,
    shadow: bool,
    on_error: FailurePolicy,
    unavailable_status: http::StatusCode,
    customizer: Option<Arc<Customizer>>,
    rejection: Option<Arc<RejectionResponder>>,
}

impl fmt::Debug for RateLimitLayerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("rule_set", &self.rule_set)
            .field("trusted", &self.trusted)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// A layer with the default options around a handler (an [`Engine`](fluxgate_core::Engine),
    /// or any other [`RateLimitHandler`]).
    pub fn new(handler: impl RateLimitHandler) -> Self {
        Self::builder(handler).build().expect("the default options are valid")
    }

    /// A builder around a handler.
    pub fn builder(handler: impl RateLimitHandler) -> RateLimitLayerBuilder {
        // An engine itself (or an `Arc` of one), and no wrapper around it, whose `check`
        // may decide otherwise: the layer may then ask it `Engine::check_address`.
        let any = &handler as &dyn Any;
        let engine = any
            .downcast_ref::<Engine>()
            .or_else(|| any.downcast_ref::<Arc<Engine>>().map(|engine| &**engine))
            .cloned();
        RateLimitLayerBuilder {
            engine,
            handler: Arc::new(handler),
            rule_set: Name::new(DEFAULT_RULE_SET),
            trusted: Vec::new(),
            forwarded_for: "x-forwarded-for".to_owned(),
            user_header: Some("x-user-id".to_owned()),
            api_key_header: Some("x-api-key".to_owned()),
            include: Vec::new(),
            exclude: Vec::new(),
            legacy_headers: true,
            ietf_headers: true,
            shadow: false,
            on_error: FailurePolicy::FailOpen,
            unavailable_status: http::StatusCode::SERVICE_UNAVAILABLE,
            customizer: None,
            rejection: None,
        }
    }
}

impl RateLimitLayerBuilder {
    /// The rule set of every request, unless the customizer picks another. Default `default`.
    /// An id the handler has no rule set for is admitted unlimited under the engine's
    /// default [`UnknownRuleSet::Allow`](fluxgate_core::UnknownRuleSet::Allow); the layer
    /// logs a warning at its first such request.
    pub fn rule_set(mut self, id: impl Into<Arc<str>>) -> Self {
        self.rule_set = Name::new(&id.into());
        self
    }

    /// Proxies (addresses or CIDRs) whose forwarding header
    /// ([`forwarded_for_header`](Self::forwarded_for_header)) is believed. Default: none,
    /// so no forwarding header is ever read. Every address (`0.0.0.0/0`, `::/0`, or networks
    /// that together hold every address of a family) is refused by [`build`](Self::build):
    /// behind it every client would name its own address.
    pub fn trusted_proxies<I, S>(mut self, proxies: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.trusted.extend(proxies.into_iter().map(Into::into));
        self
    }

    /// The one forwarding header read from trusted proxies: the one they maintain.
    /// Default `X-Forwarded-For`; `Forwarded` is read as RFC 7239 `for=` elements. Any
    /// other forwarding header is ignored, because a proxy passes the headers it does not
    /// own through from the client untouched (see
    /// [`ClientIpResolver`](crate::ClientIpResolver)).
    pub fn forwarded_for_header(mut self, name: impl Into<String>) -> Self {
        self.forwarded_for = name.into();
        self
    }

    /// The header carrying the user id. Default `X-User-Id`. A [`UserId`](crate::UserId)
    /// extension wins over it. Sent several times with different values, the header names
    /// no counter (an application reads the first instance, a proxy that appends writes the
    /// last, and a client could choose its counter with the other): the user id is then
    /// [`AMBIGUOUS_IDENTITY`](fluxgate_core::AMBIGUOUS_IDENTITY), and an enforced rule keyed
    /// by it refuses the request (`400`).
    ///
    /// A client can send any value in it: a rule keyed by the user counts what the client
    /// claims, one counter per claimed id. Read it only behind a gateway that sets it for
    /// every request; when an authentication layer provides the [`UserId`](crate::UserId),
    /// turn the header off ([`no_user_header`](Self::no_user_header)), so that an
    /// unauthenticated request falls back as the rule says (`on_missing_key`) instead of
    /// choosing its own counter.
    pub fn user_header(mut self, name: impl Into<String>) -> Self {
        self.user_header = Some(name.into());
        self
    }

    /// Reads the user id from extensions only.
    pub fn no_user_header(mut self) -> Self {
        self.user_header = None;
        self
    }

    /// The header carrying the API key. Default `X-API-Key`. An [`ApiKey`](crate::ApiKey)
    /// extension wins over it; sent several times with different values, it is read as
    /// [`user_header`](Self::user_header) is (an enforced rule keyed by it refuses the
    /// request). As
    /// with [`user_header`](Self::user_header), a client chooses its value: a rule keyed
    /// by it counts per key the client sends, checked or not.
    pub fn api_key_header(mut self, name: impl Into<String>) -> Self {
        self.api_key_header = Some(name.into());
        self
    }

    /// Reads the API key from extensions only.
    pub fn no_api_key_header(mut self) -> Self {
        self.api_key_header = None;
        self
    }

    /// Limits only paths matching one of these Ant patterns. Default: every path.
    pub fn include<I, S>(mut self, patterns: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.include.extend(patterns.into_iter().map(Into::into));
        self
    }

    /// Never limits paths matching one of these Ant patterns (e.g. `/health`,
    /// `/metrics/**`): they bypass the limiter entirely. A pattern of every path (`/**`), or
    /// patterns that together match every path (`/` and `/*/**`), are refused by
    /// [`build`](Self::build): the layer would limit nothing.
    pub fn exclude<I, S>(mut self, patterns: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.exclude.extend(patterns.into_iter().map(Into::into));
        self
    }

    /// Emits `X-RateLimit-Limit`, `-Remaining` and `-Reset`. Default on.
    pub fn legacy_headers(mut self, on: bool) -> Self {
        self.legacy_headers = on;
        self
    }

    /// Emits the IETF draft `RateLimit-Policy` and `RateLimit` headers. Default on.
    pub fn ietf_headers(mut self, on: bool) -> Self {
        self.ietf_headers = on;
        self
    }

    /// Shadow mode: decide and report (headers, metrics, logs) but never reject.
    pub fn shadow(mut self, on: bool) -> Self {
        self.shadow = on;
        self
    }

    /// What to do when the handler makes no decision (the backend failed and no failure
    /// policy of the rules or the engine covered it). Default [`FailurePolicy::FailOpen`]:
    /// admit without rate-limit headers and log a warning. [`FailurePolicy::FailClosed`]
    /// answers [`unavailable_status`](Self::unavailable_status). A rule set that could
    /// not be looked up in time ([`Error::Overloaded`](fluxgate_core::Error::Overloaded),
    /// which requests can cause) is answered with the unavailable status whatever the
    /// policy.
    /// [`FailurePolicy::FallbackLocal`] is refused by [`build`](Self::build): the local
    /// fallback belongs to the engine
    /// ([`EngineBuilder::fallback`](fluxgate_core::EngineBuilder::fallback)).
    pub fn on_error(mut self, policy: FailurePolicy) -> Self {
        self.on_error = policy;
        self
    }

    /// The status of the answer to a request that a failure refuses (a `fail_closed` rule,
    /// or `on_error(FailurePolicy::FailClosed)`). Default `503 Service Unavailable`.
    pub fn unavailable_status(mut self, status: http::StatusCode) -> Self {
        self.unavailable_status = status;
        self
    }

    /// Adjusts every request's context: set the client IP from `CF-Connecting-IP`, a
    /// tenant header as an attribute, the rule set, a JWT claim…
    ///
    /// A header the customizer reads is the client's to write unless the proxy in front
    /// sets it on every request: believe `CF-Connecting-IP` only from Cloudflare's
    /// addresses, and take a tenant from what the authentication layer proved (a request
    /// extension), or a client sending a new value with each request gets a fresh counter
    /// each time.
    ///
    /// A rule set id taken from the request is the client's to choose. An id that names no
    /// rule set is decided by the engine's
    /// [`UnknownRuleSet`](fluxgate_core::UnknownRuleSet) policy, which admits it by
    /// default: no rule counts it, so a client that sends a new tenant id with each request
    /// is never limited. Pick the id from a fixed list (and check that the rule sets
    /// exist), or build the engine with `unknown_rule_set(UnknownRuleSet::Deny)`.
    pub fn customizer(mut self, f: impl Fn(&mut RequestContextBuilder, &Parts) + Send + Sync + 'static) -> Self {
        self.customizer = Some(Arc::new(f));
        self
    }

    /// Replaces the `429` JSON response. The layer still adds the rate-limit headers
    /// (and `Retry-After`) unless the response already has them.
    pub fn on_rejection(mut self, f: impl Fn(&Decision) -> Response<Bytes> + Send + Sync + 'static) -> Self {
        self.rejection = Some(Arc::new(f));
        self
    }

    /// Checks the options and builds the layer.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] naming the option and the bad value.
    pub fn build(self) -> Result<RateLimitLayer, ConfigError> {
        let trusted = self
            .trusted
            .iter()
            .map(|s| {
                s.parse::<IpNet>().map_err(|e| ConfigError::TrustedProxy {
                    value: e.value,
                    reason: e.reason,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Behind a trusted peer the client is the nearest untrusted hop of the forwarding
        // header; when every address is trusted there is none, and the client is whatever
        // it wrote at the left end: a fresh per-IP counter with every request.
        if let Some(everything) = self.trusted.iter().zip(&trusted).find(|(_, net)| net.is_everything()) {
            return Err(ConfigError::TrustedProxy {
                value: everything.0.clone(),
                reason: "trusts every address, so that every client names its own address in the \
                         forwarding header and per-IP rules count nothing; list the proxies' own addresses",
            });
        }
        // So do networks that together hold every address of a family.
        if let Some(covering) = crate::client_ip::covering_every_address(&trusted) {
            let value = covering
                .iter()
                .map(|&i| self.trusted[i].as_str())
                .collect::<Vec<_>>()
                .join(", ");
            return Err(ConfigError::TrustedProxy {
                value,
                reason: "together trust every address of a family, so that every client names its own address in \
                         the forwarding header and per-IP rules count nothing; list the proxies' own addresses",
            });
        }
        let header = |option: &'static str, name: &str| {
            HeaderName::from_bytes(name.as_bytes()).map_err(|_| ConfigError::HeaderName {
                option,
                name: name.to_owned(),
            })
        };
        let patterns = |option: &'static str, list: &[String]| {
            list.iter()
                .map(|p| {
                    p.parse::<PathPattern>().map_err(|e| ConfigError::Pattern {
                        option,
                        message: e.to_string(),
                    })
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let exclude = patterns("exclude", &self.exclude)?;
        if let Some(every) = exclude.iter().find(|p| p.matches_every_path()) {
            return Err(ConfigError::Pattern {
                option: "exclude",
                message: format!(
                    "`{}` matches every path: the layer would limit no request (leave the layer out, or use `shadow(true)` to decide without refusing)",
                    every.as_str()
                ),
            });
        }
        if PathPattern::together_match_every_path(&exclude) {
            return Err(ConfigError::Pattern {
                option: "exclude",
                message: format!(
                    "`{}` together match every path: the layer would limit no request (leave the layer out, or use `shadow(true)` to decide without refusing)",
                    self.exclude.join("`, `")
                ),
            });
        }
        if self.on_error == FailurePolicy::FallbackLocal {
            return Err(ConfigError::FailurePolicy {
                policy: self.on_error,
                reason: "needs a local limiter: give the engine one with `EngineBuilder::fallback`",
            });
        }
        if !(self.unavailable_status.is_client_error() || self.unavailable_status.is_server_error()) {
            return Err(ConfigError::UnavailableStatus {
                status: self.unavailable_status,
            });
        }
        let include = patterns("include", &self.include)?;
        let by_address = self
            .engine
            .filter(|_| self.customizer.is_none() && !self.shadow && include.is_empty() && exclude.is_empty());
        Ok(RateLimitLayer {
            config: Arc::new(Config {
                by_address,
                handler: self.handler,
                rule_set: self.rule_set,
                client_ip: ClientIpResolver::new(trusted, header("forwarded_for_header", &self.forwarded_for)?),
                user_header: self
                    .user_header
                    .as_deref()
                    .map(|n| header("user_header", n))
                    .transpose()?,
                api_key_header: self
                    .api_key_header
                    .as_deref()
                    .map(|n| header("api_key_header", n))
                    .transpose()?,
                include,
                exclude,
                legacy_headers: self.legacy_headers,
                ietf_headers: self.ietf_headers,
                shadow: self.shadow,
                on_error: self.on_error,
                unavailable_status: self.unavailable_status,
                customizer: self.customizer,
                rejection: self.rejection,
                warned_unknown: AtomicBool::new(false),
                failures: Default::default(),
            }),
        })
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit {
            inner,
            config: self.config.clone(),
        }
    }
}
