//! Rate-limit headers and the rejection response.

use std::fmt::Write as _;
use std::sync::OnceLock;

use bytes::Bytes;
use fluxgate_core::{ceil_secs, BandReport, Decision};
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use crate::layer::Config;

/// `X-RateLimit-Limit`.
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`.
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset` (Unix seconds).
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
/// `RateLimit-Policy` (IETF draft).
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (IETF draft).
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// A header value for a number; small numbers are shared, not allocated per response.
fn number(n: u64) -> HeaderValue {
    static SMALL: OnceLock<Box<[HeaderValue]>> = OnceLock::new();
    let small = SMALL.get_or_init(|| (0..=1024u64).map(HeaderValue::from).collect());
    usize::try_from(n)
        .ok()
        .and_then(|i| small.get(i))
        .cloned()
        .unwrap_or_else(|| HeaderValue::from(n))
}

/// The name of a band in the IETF headers: its label, else the rule id (one band) or
/// `rule.bN`. Ids and labels only hold `A-Z a-z 0-9 _ - .`, so no quoting is needed.
fn policy_name(out: &mut String, band: &BandReport, single: bool) {
    out.push('"');
    if band.labeled {
        out.push_str(&band.band);
    } else if single {
        out.push_str(&band.rule);
    } else {
        out.push_str(&band.rule);
        out.push('.');
        out.push_str(&band.band);
    }
    out.push('"');
}

/// Adds the headers of a decision (the binding band and the policy of every band).
pub(crate) fn apply_headers(config: &Config, decision: &Decision, headers: &mut HeaderMap, rejected: bool) {
    let Some(binding) = decision.binding() else {
        return;
    };
    headers.reserve(3 * usize::from(config.legacy_headers) + 2 * usize::from(config.ietf_headers) + 1);
    if config.legacy_headers {
        headers.insert(X_RATELIMIT_LIMIT, number(binding.limit));
        headers.insert(X_RATELIMIT_REMAINING, number(binding.remaining));
        if let Some(reset) = decision.reset_unix_secs() {
            headers.insert(X_RATELIMIT_RESET, HeaderValue::from(reset));
        }
    }
    if config.ietf_headers {
        let single = |rule: &str| decision.bands.iter().filter(|b| &*b.rule == rule).count() == 1;
        let mut policy = String::new();
        for band in &decision.bands {
            if !policy.is_empty() {
                policy.push_str(", ");
            }
            policy_name(&mut policy, band, single(&band.rule));
            let _ = write!(policy, ";q={};w={}", band.limit, ceil_secs(band.window).max(1));
        }
        let mut current = String::new();
        policy_name(&mut current, binding, single(&binding.rule));
        let _ = write!(current, ";r={};t={}", binding.remaining, ceil_secs(binding.reset_after));
        if let Ok(v) = HeaderValue::from_str(&policy) {
            headers.insert(RATELIMIT_POLICY, v);
        }
        if let Ok(v) = HeaderValue::from_str(&current) {
            headers.insert(RATELIMIT, v);
        }
    }
    if rejected {
        if let Some(secs) = decision.retry_after_secs() {
            headers.insert(RETRY_AFTER, number(secs));
        }
    }
}

/// The `429` response: the user's, or the JSON body of the Java original.
pub(crate) fn rejection(config: &Config, decision: &Decision) -> Response<Bytes> {
    let mut response = match &config.rejection {
        Some(f) => f(decision),
        None => {
            let body = serde_json::json!({
                "error": "Rate limit exceeded",
                "retryAfter": decision.retry_after_secs(),
                "retryAfterMs": decision.retry_after.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)),
                "rule": decision.rule().map(|r| &**r),
            });
            let mut response = Response::new(Bytes::from(body.to_string()));
            *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            response
        }
    };
    let mut headers = HeaderMap::new();
    apply_headers(config, decision, &mut headers, true);
    for (name, value) in headers {
        if let Some(name) = name {
            response.headers_mut().entry(name).or_insert(value);
        }
    }
    response
}
