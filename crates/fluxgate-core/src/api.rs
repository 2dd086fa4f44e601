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
use std::time::UNIX_EPOCH;

use http::Method;
use serde::{Deserialize, Serialize};

use crate::context::{RequestContext, DEFAULT_RULE_SET};
use crate::decision::Decision;
use crate::rule::check_id;

/// The longest path accepted, in bytes.
pub const MAX_PATH: usize = 8 * 1024;

/// The longest user id, API key or attribute value accepted, in bytes.
pub const MAX_VALUE: usize = 1024;

/// The most attributes accepted in one request.
pub const MAX_ATTRIBUTES: usize = 64;

/// One request to decide.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct CheckRequest {
    /// The rule set; `default` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule_set_id: Option<String>,
    /// The client's IP address, IPv4 or IPv6.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ip: Option<String>,
    /// The user id, for rules scoped per user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_id: Option<String>,
    /// The API key, for rules scoped per API key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    /// The request path, starting with `/` (`endpoint` is accepted too); `/` when absent.
    #[serde(default, alias = "endpoint", skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The HTTP method; `GET` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// Attributes, for rules scoped per attribute.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, String>,
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
    /// The request describing `ctx` (its normalized path).
    pub fn from_context(ctx: &RequestContext) -> Self {
        Self {
            rule_set_id: Some(ctx.rule_set_id().to_owned()),
            client_ip: ctx.client_ip().map(|ip| ip.to_string()),
            user_id: ctx.user_id().map(str::to_owned),
            api_key: ctx.api_key().map(str::to_owned),
            path: Some(ctx.path().to_owned()),
            method: Some(ctx.method().as_str().to_owned()),
            attributes: ctx.attributes().clone(),
        }
    }

    /// The context to decide, after checking every field.
    ///
    /// # Errors
    ///
    /// An [`ApiError`] naming the field: a rule set id that is not a valid id, an address
    /// that is not an IP address, a path not starting with `/` or longer than
    /// [`MAX_PATH`], a method that is not an HTTP method, a user id, API key or attribute
    /// value longer than [`MAX_VALUE`], an attribute name that is not a valid id, more than
    /// [`MAX_ATTRIBUTES`] attributes.
    pub fn to_context(&self) -> Result<RequestContext, ApiError> {
        let mut builder = RequestContext::builder();
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
            Some(v) if v.len() > MAX_VALUE => Err(ApiError::field(field, format!("longer than {MAX_VALUE} bytes"))),
            _ => Ok(value.clone()),
        };
        builder.set_user_id(value("userId", &self.user_id)?);
        builder.set_api_key(value("apiKey", &self.api_key)?);
        let path = self.path.as_deref().unwrap_or("/");
        if !path.starts_with('/') {
            return Err(ApiError::field("path", "must start with `/`"));
        }
        if path.len() > MAX_PATH {
            return Err(ApiError::field("path", format!("longer than {MAX_PATH} bytes")));
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
            if value.len() > MAX_VALUE {
                return Err(ApiError::field(
                    format!("attributes.{name}"),
                    format!("longer than {MAX_VALUE} bytes"),
                ));
            }
            builder.set_attribute(name.clone(), value.clone());
        }
        Ok(builder.build())
    }
}

impl CheckResponse {
    /// The answer describing `decision`.
    pub fn from_decision(decision: &Decision) -> Self {
        let reset_at_ms = decision.binding().map(|band| {
            let since_epoch = band.reset_at.duration_since(UNIX_EPOCH).unwrap_or_default();
            u64::try_from(since_epoch.as_millis()).unwrap_or(u64::MAX)
        });
        let retry_after_ms = decision.retry_after.filter(|_| !decision.allowed()).map(|wait| {
            let ms = wait.as_nanos().div_ceil(1_000_000).max(1);
            u64::try_from(ms).unwrap_or(u64::MAX)
        });
        Self {
            allowed: decision.allowed(),
            remaining: decision.remaining(),
            limit: decision.limit(),
            reset_at_ms,
            retry_after_ms,
            rule: decision.rule().map(|rule| rule.to_string()),
            rule_set_id: decision.rule_set.to_string(),
            degraded: decision.degraded,
        }
    }
}
