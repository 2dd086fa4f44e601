//! Rate-limit headers and the rejection response.

use std::cell::RefCell;

use bytes::Bytes;
use fluxgate_core::num::ceil_secs;
use fluxgate_core::{AdmittedBand, BandReport, Decision};
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use crate::config::Config;
use crate::values::{self, ValueBuf};

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

/// Header values that repeat from one response to the next (a band's capacity, the reset
/// second): each thread keeps the last value of each kind and reuses it while it matches,
/// which costs a reference count instead of writing a new value. Other numbers are
/// written afresh (see [`values`](crate::values)).
#[derive(Clone, Copy)]
enum Repeating {
    Limit = 0,
    Reset = 1,
}

fn repeating(kind: Repeating, n: u64) -> HeaderValue {
    if n < values::SMALL {
        // From the table, cheaper still.
        return values::number(n);
    }
    thread_local! {
        static LAST: RefCell<[Option<(u64, HeaderValue)>; 2]> = const { RefCell::new([None, None]) };
    }
    LAST.with(|last| {
        let slot = &mut last.borrow_mut()[kind as usize];
        match slot {
            Some((m, v)) if *m == n => v.clone(),
            _ => {
                let v = values::number(n);
                *slot = Some((n, v.clone()));
                v
            }
        }
    })
}

/// The headers of one decision, computed when the decision is made and added to the
/// response when it arrives.
#[derive(Debug)]
pub(crate) struct Figures {
    legacy: bool,
    limit: u64,
    remaining: u64,
    reset: u64,
    retry_after: Option<u64>,
    /// `RateLimit-Policy` and `RateLimit`.
    ietf: Option<[HeaderValue; 2]>,
}

impl Figures {
    /// The figures of a decision, or `None` when no band took part or no header is on.
    pub(crate) fn of(config: &Config, decision: &Decision, rejected: bool) -> Option<Self> {
        let binding = decision.binding()?;
        let retry_after = if rejected { decision.retry_after_secs() } else { None };
        Self::of_bands(config, &decision.bands, binding, retry_after, rejected)
    }

    /// The figures of a request admitted by its only band (see
    /// [`Engine::check_address`](fluxgate_core::Engine::check_address)): what [`of`](Self::of)
    /// gives for the decision with that one band.
    pub(crate) fn of_admitted(config: &Config, band: &AdmittedBand<'_>) -> Option<Self> {
        if !config.legacy_headers && !config.ietf_headers {
            return None;
        }
        let ietf = config.ietf_headers.then(|| one_band_ietf_headers(band));
        Some(Self {
            legacy: config.legacy_headers,
            limit: band.limit(),
            remaining: band.remaining(),
            reset: band.reset_unix_secs(),
            retry_after: None,
            ietf,
        })
    }

    /// The figures of a decision's enforced bands, `binding` among them.
    fn of_bands(
        config: &Config,
        bands: &[BandReport],
        binding: &BandReport,
        retry_after: Option<u64>,
        rejected: bool,
    ) -> Option<Self> {
        if !config.legacy_headers && !config.ietf_headers && !rejected {
            return None;
        }
        // The least remaining over the enforced bands (`Decision::remaining`).
        let remaining = bands.iter().map(|b| b.remaining).min().unwrap_or(binding.remaining);
        let ietf = config.ietf_headers.then(|| ietf_headers(bands, binding, remaining));
        Some(Self {
            legacy: config.legacy_headers,
            limit: binding.limit,
            remaining,
            reset: binding.reset_unix_secs(),
            retry_after,
            ietf,
        })
    }

    /// Adds the headers. Existing headers of the same name are kept when `keep_existing`
    /// is set.
    pub(crate) fn apply(self, headers: &mut HeaderMap, keep_existing: bool) {
        // One copy per case: the common one (an admitted response) inserts without a
        // branch per header.
        if keep_existing {
            self.apply_with::<true>(headers);
        } else {
            self.apply_with::<false>(headers);
        }
    }

    fn apply_with<const KEEP_EXISTING: bool>(self, headers: &mut HeaderMap) {
        let legacy = self.legacy;
        headers.reserve(
            3 * usize::from(legacy) + 2 * usize::from(self.ietf.is_some()) + usize::from(self.retry_after.is_some()),
        );
        let mut put = |name: HeaderName, value: HeaderValue| {
            if KEEP_EXISTING {
                headers.entry(name).or_insert(value);
            } else {
                headers.insert(name, value);
            }
        };
        if legacy {
            put(X_RATELIMIT_LIMIT, repeating(Repeating::Limit, self.limit));
            put(X_RATELIMIT_REMAINING, values::number(self.remaining));
            put(X_RATELIMIT_RESET, repeating(Repeating::Reset, self.reset));
        }
        if let Some([policy, current]) = self.ietf {
            put(RATELIMIT_POLICY, policy);
            put(RATELIMIT, current);
        }
        if let Some(secs) = self.retry_after {
            put(RETRY_AFTER, values::number(secs));
        }
    }
}

/// `RateLimit-Policy` lists every enforced band; `RateLimit` gives the binding one.
fn ietf_headers(bands: &[BandReport], binding: &BandReport, remaining: u64) -> [HeaderValue; 2] {
    let (policy, distinct) = policy_header(bands);
    let current = values::value(|current| {
        policy_name(current, bands, binding, distinct);
        push_current(current, remaining, binding.reset_after);
    });
    [policy, current]
}

/// A band's `RateLimit-Policy` parameters, after its name: `;q=<capacity>;w=<window s>`.
fn push_quota(out: &mut ValueBuf<'_>, limit: u64, window: std::time::Duration) {
    out.push(b";q=");
    out.push_u64(limit);
    out.push(b";w=");
    out.push_u64(ceil_secs(window).max(1));
}

/// The binding band's `RateLimit` parameters, after its name: `;r=<remaining>;t=<reset s>`.
fn push_current(out: &mut ValueBuf<'_>, remaining: u64, reset_after: std::time::Duration) {
    out.push(b";r=");
    out.push_u64(remaining);
    out.push(b";t=");
    out.push_u64(ceil_secs(reset_after));
}

/// [`ietf_headers`] for a request admitted by its only band, written from the rule set
/// rather than from a report: the band's preferred name is its label, else its rule's id.
fn one_band_ietf_headers(admitted: &AdmittedBand<'_>) -> [HeaderValue; 2] {
    /// The last `RateLimit-Policy` of one band, with the name, capacity and window it was
    /// written for.
    type Last = Option<(fluxgate_core::Name, u64, std::time::Duration, HeaderValue)>;
    thread_local! {
        static LAST: RefCell<Last> = const { RefCell::new(None) };
    }
    let band = admitted.band();
    let name = if band.label().is_some() {
        band.name()
    } else {
        admitted.rule().id()
    };
    let (limit, window) = (band.capacity(), band.window());
    let policy = LAST.with(|last| {
        let mut last = last.borrow_mut();
        match &*last {
            Some((n, l, w, value)) if n == name && *l == limit && *w == window => value.clone(),
            _ => {
                let value = values::value(|policy| {
                    quoted(policy, name, None);
                    push_quota(policy, limit, window);
                });
                *last = Some((name.clone(), limit, window, value.clone()));
                value
            }
        }
    });
    let current = values::value(|current| {
        quoted(current, name, None);
        push_current(current, admitted.remaining(), admitted.reset_after());
    });
    [policy, current]
}

/// What `RateLimit-Policy` is made of, to reuse the last value while the rules are the same.
type PolicyKey = Vec<(fluxgate_core::Name, fluxgate_core::Name, bool, u64, std::time::Duration)>;

/// `RateLimit-Policy`, and whether the bands' preferred names are distinct (see
/// [`policy_name`]): both depend only on the bands, so both are kept with the last value.
fn policy_header(bands: &[BandReport]) -> (HeaderValue, bool) {
    thread_local! {
        static LAST: RefCell<Option<(PolicyKey, HeaderValue, bool)>> = const { RefCell::new(None) };
    }
    let same = |key: &PolicyKey| {
        key.len() == bands.len()
            && key.iter().zip(bands).all(|((rule, band, labeled, limit, window), b)| {
                *rule == b.rule && *band == b.band && *labeled == b.labeled && *limit == b.limit && *window == b.window
            })
    };
    LAST.with(|last| {
        let mut last = last.borrow_mut();
        if let Some((key, value, distinct)) = &*last {
            if same(key) {
                return (value.clone(), *distinct);
            }
        }
        let names: Vec<_> = bands.iter().map(|b| preferred_name(bands, b)).collect();
        let distinct = names.iter().enumerate().all(|(i, name)| !names[..i].contains(name));
        let value = values::value(|policy| {
            for (i, band) in bands.iter().enumerate() {
                if i > 0 {
                    policy.push(b", ");
                }
                policy_name(policy, bands, band, distinct);
                push_quota(policy, band.limit, band.window);
            }
        });
        let key = bands
            .iter()
            .map(|b| (b.rule.clone(), b.band.clone(), b.labeled, b.limit, b.window))
            .collect();
        *last = Some((key, value.clone(), distinct));
        (value, distinct)
    })
}

/// A band's preferred name in the IETF headers: its label, else the rule id for a rule's
/// only band, else `rule:band`.
fn preferred_name<'a>(bands: &[BandReport], band: &'a BandReport) -> (&'a str, Option<&'a str>) {
    if band.labeled {
        (&band.band, None)
    } else if bands.iter().filter(|b| b.rule == band.rule).count() == 1 {
        (&band.rule, None)
    } else {
        (&band.rule, Some(&band.band))
    }
}

/// Writes a band's name, quoted: its preferred name when the decision's bands all have
/// distinct ones (`distinct`, from [`policy_header`]), else `rule:band` for every band:
/// ids and labels never contain `:`, so those names are distinct.
fn policy_name(out: &mut ValueBuf<'_>, bands: &[BandReport], band: &BandReport, distinct: bool) {
    let (first, second) = if distinct {
        preferred_name(bands, band)
    } else {
        (&*band.rule, Some(&*band.band))
    };
    quoted(out, first, second);
}

/// Writes `"first"`, or `"first:second"`.
fn quoted(out: &mut ValueBuf<'_>, first: &str, second: Option<&str>) {
    out.push(b"\"");
    out.push(first.as_bytes());
    if let Some(second) = second {
        out.push(b":");
        out.push(second.as_bytes());
    }
    out.push(b"\"");
}

/// The response when no decision could be made and the policy is to fail closed.
pub(crate) fn unavailable(status: StatusCode) -> Response<Bytes> {
    json_error(status, b"{\"error\":\"Rate limiter unavailable\"}")
}

/// The response when a rule cannot be decided (a configuration error): `500`, without
/// details for the client; the log names the rule.
pub(crate) fn misconfigured() -> Response<Bytes> {
    json_error(
        StatusCode::INTERNAL_SERVER_ERROR,
        b"{\"error\":\"Rate limiter misconfigured\"}",
    )
}

/// The response when the rate-limit service or the engine refused to decide the request as
/// described (a value beyond its bounds, a path too long to match): `400`, since it cannot
/// be counted.
pub(crate) fn refused() -> Response<Bytes> {
    json_error(
        StatusCode::BAD_REQUEST,
        b"{\"error\":\"Request cannot be rate-limited\"}",
    )
}

/// A JSON error `body` with `status`.
fn json_error(status: StatusCode, body: &'static [u8]) -> Response<Bytes> {
    let mut response = Response::new(Bytes::from_static(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The `429` response: the user's, or the JSON body of the Java original.
pub(crate) fn rejection(config: &Config, decision: &Decision) -> Response<Bytes> {
    let mut response = match &config.rejection {
        Some(f) => f(decision),
        None => {
            let retry_after_ms = decision.retry_after.map(|d| {
                let ms = d.as_nanos().div_ceil(1_000_000);
                u64::try_from(ms).unwrap_or(u64::MAX).max(1)
            });
            let body = serde_json::json!({
                "error": "Rate limit exceeded",
                "retryAfter": decision.retry_after_secs(),
                "retryAfterMs": retry_after_ms,
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
    if let Some(figures) = Figures::of(config, decision, true) {
        figures.apply(response.headers_mut(), true);
    }
    response
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;

    use super::*;

    fn figures(limit: u64, remaining: u64, reset: u64, retry_after: Option<u64>) -> Figures {
        Figures {
            legacy: true,
            limit,
            remaining,
            reset,
            retry_after,
            ietf: None,
        }
    }

    #[test]
    fn numbers_are_written_in_decimal() {
        for n in [0u64, 7, 10, 99, 100, 999, 1000, 1024, 1025, 1_700_000_000, u64::MAX] {
            // Twice: the second time, the limit and the reset are the thread's last ones.
            for _ in 0..2 {
                let mut headers = HeaderMap::new();
                figures(n, n, n, Some(n)).apply(&mut headers, false);
                for name in [X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET, RETRY_AFTER] {
                    assert_eq!(headers[&name].to_str().unwrap(), n.to_string(), "{name}");
                }
            }
        }
    }

    #[test]
    fn existing_headers_are_kept_only_when_asked() {
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_static("120"));
        figures(10, 0, 1_700_000_000, Some(5)).apply(&mut headers, true);
        assert_eq!(headers[RETRY_AFTER], "120");
        assert_eq!(headers[X_RATELIMIT_LIMIT], "10");
        figures(10, 0, 1_700_000_000, Some(5)).apply(&mut headers, false);
        assert_eq!(headers[RETRY_AFTER], "5");
    }
}
