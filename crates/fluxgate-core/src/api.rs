//! The JSON of the rate-limit service's check API (`POST /api/ratelimit/check`), shared by
//! the service and its clients.
//!
//! Field names are camelCase, as the Java original's `RateLimitRequest` /
//! `RateLimitResponse`: a request `{"ruleSetId","clientIp","userId","apiKey","path","method",
//! "attributes"}` (`endpoint` is accepted for `path`), an answer
//! `{"allowed","remaining","limit","resetAtMs","retryAfterMs","rule","ruleSetId","degraded"}`.
//!
//! ```
//! use fluxgate_core::api::CheckRequest;
//!
//! let request: CheckRequest = serde_json::from_str(
//!     r#"{"ruleSetId": "api", "clientIp": "192.0.2.1", "endpoint": "/orders", "method": "POST"}"#,
//! )?;
//! let ctx = request.to_context().expect("a valid request");
//! assert_eq!((ctx.rule_set_id(), ctx.path(), ctx.method().as_str()), ("api", "/orders", "POST"));
//! # Ok::<(), serde_json::Error>(())
//! ```

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::Method;
use serde::{Deserialize, Serialize};

use crate::context::{RequestContext, DEFAULT_RULE_SET};
use crate::decision::{BandReport, Decision, Outcome};
use crate::limiter::Wait;
use crate::name::Name;
use crate::rule::check_id;

/// The longest path accepted, in characters: the longest an HTTP request's path can be
/// (`http` refuses a URI of more than 65,534 bytes), so that every request a layer sees can
/// be described.
pub const MAX_PATH: usize = 64 * 1024;

/// The longest user id, API key or attribute value accepted, in characters.
/// [`CheckRequest::from_context`] sends a longer value as its digest (see there).
pub const MAX_VALUE: usize = 1024;

/// The most attributes accepted in one request.
pub const MAX_ATTRIBUTES: usize = 64;

/// The largest JSON body of one check the service accepts ([`CheckRequest::to_context`]):
/// every field at its bound, every character of it escaped, is less. A service bounding
/// its bodies lower (`[http] max_body_bytes`) would answer some checks a gateway sends with
/// `413`, a failure of the service that a failure policy decides: it raises such a bound.
pub const MAX_CHECK_BYTES: usize = 1024 * 1024;

/// What starts a digest sent for a value ([`CheckRequest::from_context`]).
const DIGEST_PREFIX: &str = "~sha256:";

/// The longest `maxWaitMs` accepted: a day.
pub const MAX_WAIT_MS: u64 = 86_400_000;

/// The header the service puts on each of its error answers (value `1`), so that a client
/// tells them from the errors of whatever else is on the way (a proxy's `500`, a wrong
/// base path).
pub const ERROR_HEADER: &str = "x-fluxgate-error";

/// The value of [`ERROR_HEADER`] on the service's `503` for a request whose rule set could
/// not be looked up in time ([`Error::Overloaded`](crate::Error::Overloaded)): the service
/// is up, and requests can cause it (a flood of rule set ids), so a gateway refuses such a
/// request whatever its failure policy, rather than reading it as the service's failure.
pub const ERROR_OVERLOADED: &str = "overloaded";

/// One request to decide.
///
/// Read from a JSON object only (not from an array of fields by position); fields it does
/// not know are ignored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct CheckRequest {
    /// The rule set; `default` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(pattern = "^[A-Za-z0-9_.-]{1,64}$"))]
    pub rule_set_id: Option<String>,
    /// The client's IP address, IPv4 or IPv6.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::ip_address))]
    pub client_ip: Option<String>,
    /// The user id, for rules scoped per user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(max_length = 1024))]
    pub user_id: Option<String>,
    /// The API key, for rules scoped per API key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(max_length = 1024))]
    pub api_key: Option<String>,
    /// The request's path as the router sees it, starting with `/` (`endpoint` is
    /// accepted too); `/` when absent; `*` for `OPTIONS *` and empty for a `CONNECT` to an
    /// authority. Send it raw (`/api/../login`, not `/login`): the service normalizes it
    /// and matches rules against both forms, as the layer does.
    #[serde(default, alias = "endpoint", skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(pattern = "^(/|\\*$|$)", max_length = 65536))]
    pub path: Option<String>,
    /// The HTTP method; `GET` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(pattern = "^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}$"))]
    pub method: Option<String>,
    /// Attributes, for rules scoped per attribute: at most 64, names ids, values at most
    /// 1024 characters.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[cfg_attr(feature = "openapi", schema(schema_with = openapi::attributes))]
    pub attributes: BTreeMap<String, String>,
    /// The cost of the request (the Java original's `permits`). Only 1 is accepted: a
    /// request's cost is its rules' `permits`, and a caller's other figure is refused
    /// rather than silently counted as 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 1))]
    pub permits: Option<u64>,
    /// The longest the caller waits for the answer, in ms: a rule that waits for the refill
    /// (`on_limit.wait`) makes the request wait at most this long before the answer, and
    /// refuses it at once when it would have to wait longer. A caller with a deadline sends
    /// it, so that a wait does not outlast the deadline (`RemoteHandler` sends half its
    /// own, the other half left for the exchange). No bound when absent; at most [`MAX_WAIT_MS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 86_400_000))]
    pub max_wait_ms: Option<u64>,
}

/// [`CheckRequest`]'s fields, read by serde's derived code (which also reads arrays).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct CheckRequestFields {
    #[serde(default)]
    rule_set_id: Option<String>,
    #[serde(default)]
    client_ip: Option<String>,
    #[serde(default)]
    user_id: Option<String>,
    #[serde(default)]
    api_key: Option<String>,
    #[serde(default, alias = "endpoint")]
    path: Option<String>,
    #[serde(default)]
    method: Option<String>,
    #[serde(default)]
    attributes: Option<BTreeMap<String, String>>,
    #[serde(default)]
    permits: Option<u64>,
    /// A JSON number: a whole one, written as an integer or not (`52400.0`).
    #[serde(default)]
    max_wait_ms: Option<f64>,
}

impl<'de> Deserialize<'de> for CheckRequest {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Object;
        impl<'de> serde::de::Visitor<'de> for Object {
            type Value = CheckRequest;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a check request object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<CheckRequest, A::Error> {
                let fields = CheckRequestFields::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                Ok(CheckRequest {
                    rule_set_id: fields.rule_set_id,
                    client_ip: fields.client_ip,
                    user_id: fields.user_id,
                    api_key: fields.api_key,
                    path: fields.path,
                    method: fields.method,
                    attributes: fields.attributes.unwrap_or_default(),
                    permits: fields.permits,
                    max_wait_ms: match fields.max_wait_ms {
                        None => None,
                        Some(ms) if ms.is_finite() && ms >= 0.0 && ms.fract() == 0.0 && ms <= MAX_WAIT_MS as f64 => {
                            // Whole and within the bound: exact as an integer.
                            Some(ms as u64)
                        }
                        Some(ms) => {
                            return Err(serde::de::Error::custom(format_args!(
                                "maxWaitMs: {ms} is not a whole number of ms from 0 to {MAX_WAIT_MS}"
                            )))
                        }
                    },
                })
            }
        }
        deserializer.deserialize_map(Object)
    }
}

/// The schemas serde's attributes cannot state.
#[cfg(feature = "openapi")]
mod openapi {
    use utoipa::openapi::schema::{AnyOfBuilder, KnownFormat, ObjectBuilder, SchemaFormat, Type};
    use utoipa::openapi::RefOr;

    /// An IPv4 or IPv6 address, or null.
    pub(super) fn ip_address() -> impl Into<RefOr<utoipa::openapi::schema::Schema>> {
        let format = |format| {
            ObjectBuilder::new()
                .schema_type(Type::String)
                .format(Some(SchemaFormat::KnownFormat(format)))
        };
        AnyOfBuilder::new()
            .item(format(KnownFormat::Ipv4))
            .item(format(KnownFormat::Ipv6))
            .item(ObjectBuilder::new().schema_type(Type::Null))
            .description(Some("The client's IP address, IPv4 or IPv6."))
    }

    /// At most 64 attributes, named by ids, with values of at most 1024 characters; or null.
    pub(super) fn attributes() -> impl Into<RefOr<utoipa::openapi::schema::Schema>> {
        let object = ObjectBuilder::new()
            .schema_type(Type::Object)
            .property_names(Some(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .pattern(Some("^[A-Za-z0-9_.-]{1,64}$")),
            ))
            .additional_properties(Some(
                ObjectBuilder::new().schema_type(Type::String).max_length(Some(1024)),
            ))
            .max_properties(Some(64));
        AnyOfBuilder::new()
            .item(object)
            .item(ObjectBuilder::new().schema_type(Type::Null))
            .description(Some("Attributes, for rules scoped per attribute."))
    }
}

/// The decision on one request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct CheckResponse {
    /// Whether the request may pass.
    pub allowed: bool,
    /// The least remaining permits over the enforced bands; absent when no rule applied.
    #[serde(default)]
    pub remaining: Option<u64>,
    /// The binding band's capacity.
    #[serde(default)]
    pub limit: Option<u64>,
    /// When the binding band is full again, in Unix milliseconds.
    #[serde(default)]
    pub reset_at_ms: Option<u64>,
    /// How long to wait before retrying, in milliseconds (rounded up); absent when allowed.
    #[serde(default)]
    pub retry_after_ms: Option<u64>,
    /// The binding rule's id.
    #[serde(default)]
    pub rule: Option<String>,
    /// The rule set decided.
    #[serde(default)]
    pub rule_set_id: String,
    /// Whether the decision came from the fallback because the backend failed.
    #[serde(default)]
    pub degraded: bool,
    /// Why, as the `outcome` label of the metrics ([`Decision::outcome_name`]): `allowed`,
    /// `shadow_rejected` (allowed, but a shadow-mode rule would have rejected),
    /// `rejected`, `no_matching_rule`, `unknown_rule_set_allowed`, `unknown_rule_set_denied`,
    /// `missing_key`, `unavailable`.
    #[serde(default)]
    pub outcome: String,
    /// Every band of the enforced rules, in rule priority order: what a client needs to
    /// write the same rate-limit headers as the layer.
    #[serde(default)]
    pub bands: Vec<BandAnswer>,
    /// The first rule in shadow mode that would have rejected the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow_rejected_by: Option<String>,
    /// In a batch's results only: why this request could not be decided (the backend
    /// failed and no failure policy of its rules covered it); `allowed` is then false,
    /// `outcome` is `error`, and the caller's own failure policy decides the request, as
    /// after a single call's `503`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One band of a [`CheckResponse`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct BandAnswer {
    /// The rule.
    pub rule: String,
    /// The band's name: its label, or `b<position>`.
    pub band: String,
    /// Whether the band has a label.
    #[serde(default)]
    pub labeled: bool,
    /// The capacity.
    pub limit: u64,
    /// Permits left.
    pub remaining: u64,
    /// The window, in milliseconds.
    pub window_ms: u64,
    /// Time until the band is full again, in milliseconds.
    pub reset_after_ms: u64,
    /// When this band would admit the request, in milliseconds: 0 now; absent when never.
    #[serde(default)]
    pub wait_ms: Option<u64>,
}

/// Many requests decided in one call, each on its own, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct BatchCheckRequest {
    /// The requests.
    pub requests: Vec<CheckRequest>,
}

/// The decisions of a [`BatchCheckRequest`], in its order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct BatchCheckResponse {
    /// One decision per request.
    pub results: Vec<CheckResponse>,
}

/// Why the service refused a call: what is wrong, and the field at fault when there is one
/// (`clientIp`, `requests[3].method`, …).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
#[error("{}{error}", field.as_ref().map(|f| format!("{f}: ")).unwrap_or_default())]
#[non_exhaustive]
pub struct ApiError {
    /// What is wrong.
    pub error: String,
    /// The field at fault.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

impl BatchCheckResponse {
    /// The answer holding `results`.
    pub fn new(results: Vec<CheckResponse>) -> Self {
        Self { results }
    }
}

impl BatchCheckRequest {
    /// A batch of `requests`.
    pub fn new(requests: Vec<CheckRequest>) -> Self {
        Self { requests }
    }
}

impl ApiError {
    /// An error about `field`.
    pub fn field(field: impl Into<String>, error: impl Into<String>) -> Self {
        Self {
            error: error.into(),
            field: Some(field.into()),
        }
    }

    /// An error about the call as a whole.
    pub fn general(error: impl Into<String>) -> Self {
        Self {
            error: error.into(),
            field: None,
        }
    }

    /// The same error, its field inside `outer` (`requests[3]` + `method` →
    /// `requests[3].method`).
    #[must_use]
    pub fn within(mut self, outer: &str) -> Self {
        self.field = Some(match self.field {
            Some(field) => format!("{outer}.{field}"),
            None => outer.to_owned(),
        });
        self
    }
}

impl CheckRequest {
    /// The request describing `ctx`, as [`to_context`](Self::to_context) accepts it.
    ///
    /// A user id, API key or attribute value longer than [`MAX_VALUE`] characters (a
    /// client's header can be much longer) is sent as `~sha256:` and the 64 hexadecimal
    /// digits of its SHA-256: the service counts it under that digest, one counter per
    /// value as for any other, where it would refuse the value itself. So is a value that
    /// starts with `~sha256:` itself, however short: a client writing the digest of another
    /// client's long value is counted apart from it, as by a local engine.
    pub fn from_context(ctx: &RequestContext) -> Self {
        Self {
            rule_set_id: Some(ctx.rule_set_id().to_owned()),
            client_ip: ctx.client_ip().map(|ip| ip.to_string()),
            user_id: ctx.user_id().map(bounded),
            api_key: ctx.api_key().map(bounded),
            // The raw path: rules match it as well as its normalized form.
            path: Some(ctx.routed_path().to_owned()),
            method: Some(ctx.method().as_str().to_owned()),
            attributes: ctx
                .attributes()
                .iter()
                .map(|(name, value)| (name.clone(), bounded(value)))
                .collect(),
            permits: None,
            max_wait_ms: ctx
                .max_wait()
                .map(|wait| u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).min(MAX_WAIT_MS)),
        }
    }

    /// The context to decide, after checking every field.
    ///
    /// # Errors
    ///
    /// An [`ApiError`] naming the field: a rule set id that is not a valid id, an address
    /// that is not an IP address, a path not starting with `/` (but `*` or empty) or longer than
    /// [`MAX_PATH`], a method that is not an HTTP method, a user id, API key or attribute
    /// value longer than [`MAX_VALUE`], an attribute name that is not a valid id, more than
    /// [`MAX_ATTRIBUTES`] attributes.
    pub fn to_context(&self) -> Result<RequestContext, ApiError> {
        if self.permits.is_some_and(|permits| permits != 1) {
            return Err(ApiError::field(
                "permits",
                "only 1 is accepted: a request costs its rules' `permits`",
            ));
        }
        let mut builder = RequestContext::builder();
        if self.max_wait_ms.is_some_and(|ms| ms > MAX_WAIT_MS) {
            return Err(ApiError::field("maxWaitMs", format!("more than {MAX_WAIT_MS} ms")));
        }
        builder.set_max_wait(self.max_wait_ms.map(Duration::from_millis));
        let rule_set = self.rule_set_id.as_deref().unwrap_or(DEFAULT_RULE_SET);
        check_id(rule_set).map_err(|e| ApiError::field("ruleSetId", e.to_string()))?;
        builder.set_rule_set_id(rule_set);
        if let Some(ip) = &self.client_ip {
            let ip: IpAddr = ip
                .trim()
                .parse()
                .map_err(|_| ApiError::field("clientIp", "not an IPv4 or IPv6 address"))?;
            builder.set_client_ip(Some(ip));
        }
        let value = |field: &str, value: &Option<String>| match value {
            Some(v) if v.chars().count() > MAX_VALUE => {
                Err(ApiError::field(field, format!("longer than {MAX_VALUE} characters")))
            }
            _ => Ok(value.clone()),
        };
        builder.set_user_id(value("userId", &self.user_id)?);
        builder.set_api_key(value("apiKey", &self.api_key)?);
        let path = self.path.as_deref().unwrap_or("/");
        // `*` is the path of `OPTIONS *`, and the empty path that of a `CONNECT` to an
        // authority: requests a layer sees, and decides by the rules without patterns.
        if !(path.starts_with('/') || path == "*" || path.is_empty()) {
            return Err(ApiError::field("path", "must start with `/` (or be `*` or empty)"));
        }
        if path.chars().count() > MAX_PATH {
            return Err(ApiError::field("path", format!("longer than {MAX_PATH} characters")));
        }
        builder.set_path(path);
        if let Some(method) = &self.method {
            let method = Method::from_bytes(method.as_bytes())
                .ok()
                .filter(|_| method.len() <= 32)
                .ok_or_else(|| ApiError::field("method", "not an HTTP method"))?;
            builder.set_method(method);
        }
        if self.attributes.len() > MAX_ATTRIBUTES {
            return Err(ApiError::field(
                "attributes",
                format!("more than {MAX_ATTRIBUTES} attributes"),
            ));
        }
        for (name, value) in &self.attributes {
            check_id(name).map_err(|e| ApiError::field("attributes", format!("name {e}")))?;
            if value.chars().count() > MAX_VALUE {
                return Err(ApiError::field(
                    format!("attributes.{name}"),
                    format!("longer than {MAX_VALUE} characters"),
                ));
            }
            builder.set_attribute(name.clone(), value.clone());
        }
        Ok(builder.build())
    }
}

/// `value`, or its digest when it is longer than the service accepts or could be taken for
/// a digest (see [`CheckRequest::from_context`]): two values never give the same text.
fn bounded(value: &str) -> String {
    if !value.starts_with(DIGEST_PREFIX) && value.chars().count() <= MAX_VALUE {
        return value.to_owned();
    }
    let mut out = String::with_capacity(DIGEST_PREFIX.len() + 64);
    out.push_str(DIGEST_PREFIX);
    crate::key::push_digest(&mut out, value, 32);
    out
}

impl CheckResponse {
    /// The answer describing `decision`.
    pub fn from_decision(decision: &Decision) -> Self {
        let reset_at_ms = decision.binding().map(|band| {
            let since_epoch = band.reset_at.duration_since(UNIX_EPOCH).unwrap_or_default();
            u64::try_from(since_epoch.as_millis()).unwrap_or(u64::MAX)
        });
        let retry_after_ms = decision.retry_after.filter(|_| !decision.allowed()).map(millis_up);
        let bands = decision
            .bands
            .iter()
            .map(|band| BandAnswer {
                rule: band.rule.to_string(),
                band: band.band.to_string(),
                labeled: band.labeled,
                limit: band.limit,
                remaining: band.remaining,
                window_ms: millis(band.window),
                reset_after_ms: millis(band.reset_after),
                wait_ms: match band.wait {
                    Wait::None => Some(0),
                    Wait::After(wait) => Some(millis_up(wait)),
                    Wait::Never => None,
                },
            })
            .collect();
        Self {
            outcome: decision.outcome_name().to_owned(),
            bands,
            shadow_rejected_by: decision.shadow_rejected_by.as_ref().map(|r| r.to_string()),
            allowed: decision.allowed(),
            remaining: decision.remaining(),
            limit: decision.limit(),
            reset_at_ms,
            retry_after_ms,
            rule: decision.rule().map(|rule| rule.to_string()),
            rule_set_id: decision.rule_set.to_string(),
            degraded: decision.degraded,
            error: None,
        }
    }

    /// A batch's result for a request of the rule set `rule_set_id` that could not be
    /// decided: `error` says why (see [`CheckResponse::error`]).
    pub fn failed(rule_set_id: &str, error: impl Into<String>) -> Self {
        Self {
            allowed: false,
            rule_set_id: rule_set_id.to_owned(),
            outcome: "error".to_owned(),
            error: Some(error.into()),
            ..Self::default()
        }
    }
}

impl CheckResponse {
    /// The decision this answer describes, as the engine would have returned it: its
    /// outcome, its bands (reset instants counted from now) and its retry-after. An
    /// outcome this version does not know is read as a rejection by the rule named, or as
    /// an admission when `allowed`. An answer whose outcome admits while `allowed` is
    /// false is read as a rejection: the two never disagree in a service's answer, and a
    /// reply that makes them disagree (a proxy's, a broken one) errs towards refusing.
    pub fn to_decision(&self) -> Decision {
        // Names from an answer are not interned (see `Name`).
        let name = |text: &str| Name::from(Arc::<str>::from(text));
        let rule_set = name(&self.rule_set_id);
        let rule = || name(self.rule.as_deref().unwrap_or(""));
        let outcome = match self.outcome.as_str() {
            "allowed" | "shadow_rejected" => Outcome::Admitted,
            "no_matching_rule" => Outcome::NoMatchingRule,
            "unknown_rule_set_allowed" => Outcome::UnknownRuleSetAllowed,
            "unknown_rule_set_denied" => Outcome::UnknownRuleSetDenied,
            "rejected" => Outcome::RateLimited,
            "missing_key" => Outcome::MissingKey { rule: rule() },
            "unavailable" => Outcome::BackendUnavailable { rule: rule() },
            _ if self.allowed && self.bands.is_empty() => Outcome::NoMatchingRule,
            _ if self.allowed => Outcome::Admitted,
            _ => Outcome::RateLimited,
        };
        let outcome = if outcome.allows() && !self.allowed {
            Outcome::RateLimited
        } else {
            outcome
        };
        let mut decision = Decision::without_bands(rule_set, outcome);
        let now = SystemTime::now();
        decision.bands = self
            .bands
            .iter()
            .map(|band| {
                let reset_after = Duration::from_millis(band.reset_after_ms);
                let wait = match band.wait_ms {
                    Some(0) => Wait::None,
                    Some(ms) => Wait::After(Duration::from_millis(ms)),
                    None => Wait::Never,
                };
                BandReport {
                    rule: name(&band.rule),
                    band: name(&band.band),
                    labeled: band.labeled,
                    limit: band.limit,
                    remaining: band.remaining,
                    window: Duration::from_millis(band.window_ms),
                    reset_after,
                    reset_at: now + reset_after,
                    allowed: wait == Wait::None,
                    shadow: false,
                    wait,
                }
            })
            .collect();
        decision.binding_index = self.binding_index(&decision.bands);
        decision.retry_after = self.retry_after_ms.map(Duration::from_millis);
        decision.degraded = self.degraded;
        decision.shadow_rejected_by = self.shadow_rejected_by.as_deref().map(name);
        decision
    }

    /// The binding band's position: the one the engine would choose of these `bands`
    /// ([`Decision::binding`]) when it is of the answer's `rule`, else the one the answer's
    /// `rule`, `limit` and `remaining` describe (a service that chose otherwise).
    fn binding_index(&self, bands: &[BandReport]) -> Option<usize> {
        let rule = self.rule.as_deref()?;
        let (chosen, _) = crate::decision::binding(bands, self.allowed);
        if let Some(i) = chosen.filter(|&i| *bands[i].rule == *rule && Some(bands[i].limit) == self.limit) {
            return Some(i);
        }
        self.bands
            .iter()
            .position(|b| b.rule == rule && Some(b.limit) == self.limit && Some(b.remaining) == self.remaining)
            .or_else(|| self.bands.iter().position(|b| b.rule == rule))
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Milliseconds rounded up, at least 1: a wait is never shortened.
fn millis_up(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos().div_ceil(1_000_000).max(1)).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Engine, RuleSets};

    /// `maxWaitMs`: a whole number of ms, written as an integer or not, up to a day.
    #[test]
    fn max_wait_is_a_whole_number_of_ms_up_to_a_day() {
        let read = |json: &str| serde_json::from_str::<CheckRequest>(json).map(|r| r.max_wait_ms);
        assert_eq!(read(r#"{"maxWaitMs": 52400}"#).unwrap(), Some(52_400));
        assert_eq!(read(r#"{"maxWaitMs": 52400.0}"#).unwrap(), Some(52_400));
        assert_eq!(read(r#"{}"#).unwrap(), None);
        for bad in ["1.5", "-1", "86400001", "9223372036854775808", "\"5\""] {
            assert!(read(&format!(r#"{{"maxWaitMs": {bad}}}"#)).is_err(), "{bad}");
        }
        let ctx = CheckRequest::from_context(&RequestContext::builder().max_wait(Duration::from_millis(75)).build());
        assert_eq!(ctx.max_wait_ms, Some(75));
        assert_eq!(ctx.to_context().unwrap().max_wait(), Some(Duration::from_millis(75)));
    }

    /// Every request a layer sees can be described to the service: a gateway would
    /// otherwise have no decision for it (and must not admit it uncounted).
    #[test]
    fn every_context_a_layer_builds_is_accepted() {
        let long = "u".repeat(MAX_VALUE + 1);
        let contexts = [
            RequestContext::builder().path("*").method(Method::OPTIONS).build(),
            RequestContext::builder().path("").method(Method::CONNECT).build(),
            RequestContext::builder().user_id(long.clone()).build(),
            RequestContext::builder().api_key(long.clone()).build(),
            RequestContext::builder().attribute("tenant", long.clone()).build(),
            RequestContext::builder()
                .path(&format!("/api/{}", "a".repeat(65_000)))
                .build(),
        ];
        for ctx in contexts {
            let request = CheckRequest::from_context(&ctx);
            assert!(request.to_context().is_ok(), "{request:?}");
        }
    }

    /// A value too long for the service goes as its digest: one per value, never the
    /// same for two values, and a value within bounds goes as it is.
    #[test]
    fn a_long_value_is_sent_as_its_digest() {
        let (a, b) = ("a".repeat(MAX_VALUE + 1), format!("{}b", "a".repeat(MAX_VALUE)));
        let digest =
            |v: &str| CheckRequest::from_context(&RequestContext::builder().user_id(v.to_owned()).build()).user_id;
        let (da, db) = (digest(&a).unwrap(), digest(&b).unwrap());
        assert!(da.starts_with("~sha256:") && da.len() == 8 + 64, "{da}");
        assert_ne!(da, db);
        assert_eq!(digest(&a).unwrap(), da, "the same value, the same digest");
        let within = "a".repeat(MAX_VALUE);
        assert_eq!(digest(&within).unwrap(), within);
        // A value written as a digest is digested in turn: it never meets the long value's.
        assert_ne!(digest(&da).unwrap(), da);
        assert!(digest(&da).unwrap().starts_with("~sha256:"));
        assert_eq!(digest("~sha256").unwrap(), "~sha256", "only the whole prefix");
    }

    /// A request with every field at its bound and every character escaped in JSON is
    /// within [`MAX_CHECK_BYTES`], and is accepted.
    #[test]
    fn the_largest_check_is_within_the_body_bound() {
        let value = "\u{1}".repeat(MAX_VALUE);
        let mut request = CheckRequest {
            rule_set_id: Some("r".repeat(64)),
            client_ip: Some("ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255".to_owned()),
            user_id: Some(value.clone()),
            api_key: Some(value.clone()),
            path: Some(format!("/{}", "\u{1}".repeat(MAX_PATH - 1))),
            method: Some("M".repeat(32)),
            permits: Some(1),
            max_wait_ms: Some(MAX_WAIT_MS),
            ..CheckRequest::default()
        };
        for i in 0..MAX_ATTRIBUTES {
            request.attributes.insert(format!("{i:0>64}"), value.clone());
        }
        assert!(request.to_context().is_ok());
        let body = serde_json::to_vec(&request).unwrap();
        assert!(body.len() <= MAX_CHECK_BYTES, "{}", body.len());
    }

    #[test]
    fn a_request_is_read_from_an_object_only() {
        let error = serde_json::from_str::<CheckRequest>(r#"["api", "192.0.2.1"]"#).unwrap_err();
        assert!(error.to_string().contains("expected a check request object"), "{error}");
        let batch = serde_json::from_str::<BatchCheckRequest>(r#"{"requests": [[null, null]]}"#);
        assert!(batch.is_err());
        let request: CheckRequest =
            serde_json::from_str(r#"{"endpoint": "/x", "attributes": null, "unknown": [1]}"#).unwrap();
        assert_eq!(request.path.as_deref(), Some("/x"));
        assert!(request.attributes.is_empty());
        // A cost other than 1 is refused, never counted as 1.
        let costly: CheckRequest = serde_json::from_str(r#"{"permits": 5}"#).unwrap();
        assert_eq!(costly.to_context().unwrap_err().field.as_deref(), Some("permits"));
        let one: CheckRequest = serde_json::from_str(r#"{"permits": 1}"#).unwrap();
        assert!(one.to_context().is_ok());
    }

    /// An answer whose outcome admits while `allowed` is false is a rejection, whatever
    /// the outcome names; one whose outcome refuses while `allowed` is true stays refused.
    #[test]
    fn an_answer_whose_allowed_and_outcome_disagree_is_a_rejection() {
        let admitting = [
            "allowed",
            "shadow_rejected",
            "no_matching_rule",
            "unknown_rule_set_allowed",
        ];
        for outcome in admitting {
            let json = format!(r#"{{"allowed":false,"outcome":"{outcome}","ruleSetId":"api","bands":[]}}"#);
            let answer: CheckResponse = serde_json::from_str(&json).unwrap();
            let decision = answer.to_decision();
            assert!(!decision.allowed(), "{json}");
            assert_eq!(decision.outcome, Outcome::RateLimited, "{json}");
            let json = json.replace("false", "true");
            let answer: CheckResponse = serde_json::from_str(&json).unwrap();
            assert!(answer.to_decision().allowed(), "{json}");
        }
        for outcome in ["rejected", "unknown_rule_set_denied", "missing_key", "unavailable"] {
            let json = format!(r#"{{"allowed":true,"outcome":"{outcome}","ruleSetId":"api","bands":[]}}"#);
            let answer: CheckResponse = serde_json::from_str(&json).unwrap();
            assert!(!answer.to_decision().allowed(), "{json}");
        }
    }

    #[test]
    fn a_decision_survives_the_trip_through_json() {
        let rules = RuleSets::from_yaml_str(
            "rule_sets: [{id: api, rules: [
                {id: burst, bands: [{capacity: 2, window: 1s, label: burst}, {capacity: 5, window: 1m}]},
                {id: watch, mode: shadow, bands: [{capacity: 1, window: 1h}]}]}]",
        )
        .unwrap();
        let engine = Engine::in_memory(rules);
        let ctx = RequestContext::builder()
            .rule_set_id("api")
            .client_ip("192.0.2.1".parse().unwrap())
            .path("/a/../b")
            .build();
        assert_eq!(
            CheckRequest::from_context(&ctx).path.as_deref(),
            Some("/a/../b"),
            "the raw path"
        );
        for _ in 0..3 {
            let decision = engine.check(&ctx).into_ready().unwrap().unwrap();
            let answer = CheckResponse::from_decision(&decision);
            let json = serde_json::to_string(&answer).unwrap();
            let back: CheckResponse = serde_json::from_str(&json).unwrap();
            assert_eq!(back, answer);
            let remote = back.to_decision();
            assert_eq!(remote.outcome, decision.outcome, "{json}");
            assert_eq!(remote.allowed(), decision.allowed());
            assert_eq!(
                (remote.limit(), remote.remaining()),
                (decision.limit(), decision.remaining())
            );
            assert_eq!(remote.rule(), decision.rule());
            assert_eq!(remote.retry_after_secs(), decision.retry_after_secs());
            assert_eq!(remote.shadow_rejected_by, decision.shadow_rejected_by);
            assert_eq!(remote.bands.len(), decision.bands.len());
            for (r, d) in remote.bands.iter().zip(&decision.bands) {
                assert_eq!(
                    (&r.rule, &r.band, r.labeled, r.limit, r.remaining, r.window),
                    (&d.rule, &d.band, d.labeled, d.limit, d.remaining, d.window)
                );
            }
        }
    }
}
