//! The layer's checked options and what they decide for a request: whether the limiter
//! sees it, its context, and what to do with the decision.

use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use fluxgate_core::failure::{CircuitOpen, LogThrottle};
use fluxgate_core::path::{is_too_long, trimmed, with_clamped_views, with_decoded_views, without_trailing_slash};
use fluxgate_core::{
    AddressDecision, Decision, Engine, Error, FailurePolicy, Name, Outcome, PathPattern, RateLimitHandler,
    RequestContext, RequestContextBuilder, AMBIGUOUS_IDENTITY,
};
use http::request::Parts;
use http::{Extensions, HeaderMap, HeaderName, Method, Response};

use crate::client_ip::ClientIpResolver;
use crate::response::Figures;
use crate::{ApiKey, UserId};

/// The customizer: adjusts the context built from each request.
pub type Customizer = dyn Fn(&mut RequestContextBuilder, &Parts) + Send + Sync;

/// Builds the response for a rejected request.
pub type RejectionResponder = dyn Fn(&Decision) -> Response<Bytes> + Send + Sync;

/// The options of a layer, checked by
/// [`RateLimitLayerBuilder::build`](crate::RateLimitLayerBuilder::build) and shared by
/// every service the layer makes.
pub(crate) struct Config {
    pub(crate) handler: Arc<dyn RateLimitHandler>,
    /// The handler's engine, when nothing but the rules reads a request's context (no
    /// customizer, include or exclude patterns, or shadow mode): requests are then
    /// decided by [`Engine::check_address`] when their rule set allows it.
    pub(crate) by_address: Option<Engine>,
    pub(crate) rule_set: Name,
    pub(crate) client_ip: ClientIpResolver,
    pub(crate) user_header: Option<HeaderName>,
    pub(crate) api_key_header: Option<HeaderName>,
    pub(crate) include: Vec<PathPattern>,
    pub(crate) exclude: Vec<PathPattern>,
    pub(crate) legacy_headers: bool,
    pub(crate) ietf_headers: bool,
    pub(crate) shadow: bool,
    pub(crate) on_error: FailurePolicy,
    pub(crate) unavailable_status: http::StatusCode,
    pub(crate) customizer: Option<Arc<Customizer>>,
    pub(crate) rejection: Option<Arc<RejectionResponder>>,
    /// Whether a request of the layer's own rule set admitted because the handler has no
    /// such rule set was logged as a warning.
    pub(crate) warned_unknown: AtomicBool,
    /// The warnings of the failures `on_error` covers (one policy per layer: all admitted,
    /// or all refused).
    pub(crate) failures: LogThrottle,
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitConfig")
            .field("handler", &self.handler)
            .field("by_address", &self.by_address.is_some())
            .field("rule_set", &self.rule_set)
            .field("trusted_proxies", &self.client_ip.trusted)
            .field("forwarded_header", &self.client_ip.header)
            .field("user_header", &self.user_header)
            .field("api_key_header", &self.api_key_header)
            .field("include", &self.include)
            .field("exclude", &self.exclude)
            .field("legacy_headers", &self.legacy_headers)
            .field("ietf_headers", &self.ietf_headers)
            .field("shadow", &self.shadow)
            .field("on_error", &self.on_error)
            .field("unavailable_status", &self.unavailable_status)
            .field("customizer", &self.customizer.is_some())
            .field("rejection", &self.rejection.is_some())
            .finish()
    }
}

/// What happens to a request after its decision.
pub(crate) enum Verdict {
    /// Call the inner service; add these headers to the response.
    Pass(Option<Figures>),
    /// Answer with this response.
    Reject(Response<bytes::Bytes>),
}

impl Config {
    /// Whether the limiter sees the request: included and not excluded, by its normalized
    /// path or by its path as routed. A path is left alone only when both views say so,
    /// so that `/api/x/../../health` (routed to an `/api/{*rest}` handler) is not let
    /// through by an exclusion of `/health`. In the routed view, `include` also matches the
    /// path without its trailing `/`, as rules do (an `/items/{id}/` route runs for
    /// `/items//`, which `/items/*/` includes); `exclude` does not, so that it never leaves
    /// more alone. A path with runs of `/` at its start or end has a third view, without
    /// them, as a trimming middleware between the layer and the router routes it.
    pub(crate) fn limits(&self, ctx: &RequestContext) -> bool {
        if self.include.is_empty() && self.exclude.is_empty() {
            return true;
        }
        if is_too_long(ctx) {
            // Too long to be matched (`LONGEST_MATCHED_PATH`): limited, whatever `include`
            // and `exclude` say.
            return true;
        }
        let normalized = ctx.path();
        let view = |excluded: &dyn Fn(&PathPattern) -> bool, included: &dyn Fn(&PathPattern) -> bool| {
            !self.exclude.iter().any(excluded) && (self.include.is_empty() || self.include.iter().any(included))
        };
        let by_normalized = |p: &PathPattern| p.matches(normalized);
        if view(&by_normalized, &by_normalized) {
            return true;
        }
        let routed = ctx.routed_path();
        // With escapes: the routed segments decoded, as a route's parameters hold them, and
        // with `%2F` decoded too, as a wildcard parameter holds them, each in the forms of
        // the routed view below; and the path with `%2F` decoded, normalized, as a file
        // server reads it. Views of their own, which can only limit more.
        let decoded = || {
            with_decoded_views(routed, |views| {
                // A routed view: an exclusion in it as is, an inclusion also without the
                // trailing `/`, and the trimmed path a view of its own.
                let routed_view = |segments: &[&str]| {
                    let by = |p: &PathPattern| p.matches_segments(segments);
                    view(&by, &|p| {
                        by(p) || without_trailing_slash(segments).is_some_and(|s| p.matches_segments(s))
                    }) || trimmed(segments).is_some_and(|t| {
                        let by_trimmed = |p: &PathPattern| p.matches_segments(t);
                        view(&by_trimmed, &by_trimmed)
                    })
                };
                let by_flattened = |p: &PathPattern| p.matches_segments(views.flattened);
                routed_view(views.routed) || routed_view(views.flattened_routed) || view(&by_flattened, &by_flattened)
            })
            .unwrap_or(false)
        };
        // With a `..` segment: the path resolved at each root a wildcard parameter may have,
        // as a handler that cleans its part of the path reads it (see
        // `with_clamped_views`). Views of their own, which can only limit more.
        let clamped = || {
            with_clamped_views(routed, |views| {
                views.iter().any(|v| {
                    let by_clamped = |p: &PathPattern| p.matches_segments(v);
                    view(&by_clamped, &by_clamped)
                })
            })
        };
        if routed == normalized {
            // The path as routed is the normalized one, but an exclusion matches it only as
            // the pattern is written: a static route written with escapes does not run for
            // their decoded spelling, which the router sends elsewhere.
            return decoded() || clamped() || view(&|p| p.matches_routed_as_written(routed), &by_normalized);
        }
        // A path without a leading `/` (`*` in the asterisk form, the empty path of the
        // authority form, `GET host:80`) reaches no route: the router's fallback answers
        // it, as it answers an unknown top-level path. It is matched as that one segment,
        // so that an exclusion of `/` does not let it through to the fallback.
        if !routed.starts_with('/') {
            // `http` refuses every other path without a leading `/` (`PathAndQuery`). Were
            // one to come (another version, another parser), it is limited: matched as one
            // segment, `health` would be excluded by `/health` while the fallback answers
            // it, and a middleware that puts a `/` in front would route `tenants/../orders`
            // to a route that `include` names.
            if !(routed.is_empty() || routed == "*") {
                return true;
            }
            // No view as written stands beside this one: an exclusion matches it without
            // its `%2F` read as a `/` (`/%2F*` would be `/*`).
            let by_segment = |p: &PathPattern| p.matches_segments(&[routed]);
            let excluded = |p: &PathPattern| p.matches_segments_as_spelled(&[routed]);
            return view(&excluded, &by_segment);
        }
        // In the raw views, an exclusion matches only as the pattern is written (see above).
        view(&|p| p.matches_routed_as_written(routed), &|p| {
            p.matches_routed_or_without_trailing_slash(routed)
        }) || ((routed.starts_with("//") || routed.ends_with('/'))
            // Behind a middleware that trims the runs of `/` at both ends (tower-http's
            // `NormalizePathLayer`), the router routes the path without them: a view of
            // its own, which can only limit more.
            && view(&|p| p.matches_routed_trimmed_as_written(routed), &|p| p.matches_routed_trimmed(routed)))
            || decoded()
            || clamped()
    }

    /// Fills a context from the request, before the customizer; `client_ip` is the
    /// request's client address, as [`ClientIpResolver::resolve`] reads it.
    pub(crate) fn fill(
        &self,
        builder: &mut RequestContextBuilder,
        method: &Method,
        headers: &HeaderMap,
        extensions: &Extensions,
        client_ip: Option<IpAddr>,
    ) {
        let header = |name: &Option<http::HeaderName>| name.as_ref().and_then(|n| identity_header(headers, n));
        let user = extensions
            .get::<UserId>()
            .map(|u| u.0.clone())
            .or_else(|| header(&self.user_header));
        let key = extensions
            .get::<ApiKey>()
            .map(|k| k.0.clone())
            .or_else(|| header(&self.api_key_header));
        builder
            .set_method(method.clone())
            .set_client_ip(client_ip)
            .set_user_id(user)
            .set_api_key(key);
    }

    /// Whether the request's rule set is the layer's own: true without a customizer, which
    /// alone can choose another. A rule set id chosen per request may come from the
    /// request, so only the layer's own id is a metric label.
    pub(crate) fn own_rule_set(&self, ctx: &RequestContext) -> bool {
        self.customizer.is_none() || *ctx.rule_set_id() == *self.rule_set
    }

    /// Logs a failure `on_error` covers: a warning at most once per [`LogThrottle::EVERY`]
    /// for this layer, saying how many it held back, the others at debug level (so that a
    /// handler down without a circuit breaker does not write a warning per request); at
    /// debug level while a circuit breaker is open, which warned when it opened.
    fn log_failure(&self, error: &Error, action: &str) {
        if matches!(error, Error::Backend(e) if e.is::<CircuitOpen>()) {
            tracing::debug!(%error, "rate-limit check failed; {action}");
        } else if let Some(held_back) = self.failures.due() {
            tracing::warn!(
                %error,
                held_back,
                "rate-limit check failed; {action} (warned again in {}s at the earliest, the failures between at debug level)",
                LogThrottle::EVERY.as_secs()
            );
        } else {
            tracing::debug!(%error, "rate-limit check failed; {action}");
        }
    }

    /// What happens to a request [`Engine::check_address`] decided: what
    /// [`verdict`](Self::verdict) makes of the decision [`Engine::check`] gives.
    pub(crate) fn address_verdict(&self, decision: AddressDecision<'_>) -> Verdict {
        match decision {
            AddressDecision::Admitted(band) => Verdict::Pass(Figures::of_admitted(self, &band)),
            AddressDecision::Decided(decision) => self.verdict(Ok(decision), true),
        }
    }

    /// What happens to a request after its decision, or after the handler failed;
    /// `own_rule_set` says whether the request's rule set is the layer's own
    /// ([`own_rule_set`](Self::own_rule_set)).
    pub(crate) fn verdict(&self, result: Result<Decision, Error>, own_rule_set: bool) -> Verdict {
        match result {
            Ok(decision) if decision.allowed() => {
                if own_rule_set
                    && decision.outcome == Outcome::UnknownRuleSetAllowed
                    && !self.warned_unknown.swap(true, Ordering::Relaxed)
                {
                    // Once per layer: the engine warns once for all its layers, and a
                    // remote handler's service in its own log, not the gateway's.
                    tracing::warn!(
                        rule_set = %self.rule_set,
                        "the layer's rule set is not one of the handler's: its requests are admitted \
                         and no rule counts them (a misspelt `rule_set`, or UnknownRuleSet::Allow); logged once"
                    );
                }
                if let Some(rule) = &decision.shadow_rejected_by {
                    tracing::debug!(rule_set = %decision.rule_set, rule = %rule, "shadow rule would reject");
                }
                Verdict::Pass(Figures::of(self, &decision, false))
            }
            Ok(decision) if matches!(decision.outcome, Outcome::BackendUnavailable { .. }) && !self.shadow => {
                Verdict::Reject(crate::response::unavailable(self.unavailable_status))
            }
            Ok(decision) if self.shadow => {
                tracing::debug!(rule_set = %decision.rule_set, rule = ?decision.rule(), "shadow mode: would reject");
                #[cfg(feature = "metrics")]
                metrics::counter!(
                    fluxgate_core::metrics::SHADOW_REJECTIONS_TOTAL,
                    "rule_set" => fluxgate_core::metrics::rule_set_label(&decision),
                    "rule" => fluxgate_core::metrics::rule_label(&decision),
                )
                .increment(1);
                Verdict::Pass(Figures::of(self, &decision, false))
            }
            Ok(decision) => Verdict::Reject(crate::response::rejection(self, &decision)),
            Err(Error::Rule(error)) if self.shadow => {
                tracing::error!(%error, "rate-limit rules cannot be decided; shadow mode: admitting the request");
                Verdict::Pass(None)
            }
            Err(Error::Rule(error)) => {
                // A configuration error: no failure policy admits the request.
                tracing::error!(%error, "rate-limit rules cannot be decided; refusing the request");
                Verdict::Reject(crate::response::misconfigured())
            }
            // A client causes these at will (a method or a value the service bounds): logged
            // at debug level, so that a client cannot flood the log with them.
            Err(Error::Refused(error)) if self.shadow => {
                tracing::debug!(%error, "the request cannot be rate-limited; shadow mode: admitting it");
                Verdict::Pass(None)
            }
            Err(Error::Refused(error)) => {
                // The request cannot be counted: no failure policy admits it.
                tracing::debug!(%error, "the request cannot be rate-limited; refusing it");
                Verdict::Reject(crate::response::refused())
            }
            Err(error @ Error::Overloaded(_)) if self.shadow => {
                self.log_failure(&error, "shadow mode: admitting the request");
                Verdict::Pass(None)
            }
            Err(error @ Error::Overloaded(_)) => {
                // Requests can cause it (a flood of rule set ids): no failure policy admits
                // the request, or the flood would let itself through.
                self.log_failure(&error, "refusing the request (no failure policy admits it)");
                Verdict::Reject(crate::response::unavailable(self.unavailable_status))
            }
            Err(error) => match self.on_error {
                FailurePolicy::FailOpen => {
                    self.log_failure(&error, "admitting the request");
                    #[cfg(feature = "metrics")]
                    metrics::counter!(
                        fluxgate_core::metrics::FAIL_OPEN_TOTAL,
                        "rule_set" => if own_rule_set {
                            metrics::SharedString::from(self.rule_set.to_string())
                        } else {
                            metrics::SharedString::const_str(fluxgate_core::metrics::UNKNOWN)
                        },
                    )
                    .increment(1);
                    Verdict::Pass(None)
                }
                // `fail_closed`; `fallback_local` is refused when the layer is built.
                _ => {
                    self.log_failure(&error, "refusing the request");
                    Verdict::Reject(crate::response::unavailable(self.unavailable_status))
                }
            },
        }
    }
}

/// The value of an identity header (the user id, the API key): its value when every
/// instance of it says the same, else [`AMBIGUOUS_IDENTITY`]. Spaces and tabs around a
/// value are not part of it ([`field_value`]).
///
/// Neither instance of a header sent several times with different values can be trusted:
/// an application reads the first (`HeaderMap::get`, and the extractors built on it),
/// a proxy that appends its own value writes the last. Whichever the layer read, a client
/// could name its counter with the other, one new counter per request (an application
/// that checks the first `X-API-Key` while the layer counted the last). Nor can such
/// requests share one counter: that counter would be a second quota for every client (a
/// valid first key for the application, any second one). An enforced rule keyed by the
/// header refuses them instead (`400`).
fn identity_header(headers: &HeaderMap, name: &HeaderName) -> Option<String> {
    let mut values = headers.get_all(name).iter().map(field_value);
    let first = values.next()?;
    Some(if values.all(|value| value == first) {
        header_text(first)
    } else {
        AMBIGUOUS_IDENTITY.to_owned()
    })
}

/// A header value without the spaces and tabs around it, which are not part of a field
/// value (RFC 9110 section 5.5). An HTTP/1.1 parser (hyper's) drops them; HTTP/2 forbids
/// them (RFC 9113 section 8.2.1), but hyper's HTTP/2 server hands them on. Kept, one API
/// key sent over HTTP/2 as `k1`, `k1 `, ` k1`, `k1\t`… named a new counter with each
/// spelling, all of them the one key to an application that trims it (or a SQL lookup
/// under a `PAD SPACE` collation).
fn field_value(value: &http::HeaderValue) -> &[u8] {
    let bytes = value.as_bytes();
    let ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = bytes.iter().position(|b| !ows(b)).unwrap_or(bytes.len());
    let end = bytes.iter().rposition(|b| !ows(b)).map_or(start, |i| i + 1);
    &bytes[start..end]
}

/// A header value as text, injectively: valid UTF-8 as it is; anything else as `\0` (which
/// no header value can contain) followed by its bytes read as Latin-1. Two different
/// values never give the same text.
fn header_text(value: &[u8]) -> String {
    match std::str::from_utf8(value) {
        Ok(text) => text.to_owned(),
        Err(_) => std::iter::once('\0')
            .chain(value.iter().map(|&b| char::from(b)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use fluxgate_core::{Engine, RequestContextBuilder, RuleSets};

    use crate::RateLimitLayer;

    /// Whether a layer of `include` and `exclude` patterns limits a request of `path`.
    fn limits(path: &str, include: &[&str], exclude: &[&str]) -> bool {
        let engine = Engine::in_memory(RuleSets::from_yaml_str("rule_sets: []").expect("rules"));
        let mut builder = RateLimitLayer::builder(engine);
        if !include.is_empty() {
            builder = builder.include(include.iter().copied());
        }
        if !exclude.is_empty() {
            builder = builder.exclude(exclude.iter().copied());
        }
        let layer = builder.build().expect("a layer");
        let mut context = RequestContextBuilder::with_rule_set(layer.config.rule_set.clone());
        context.set_path(path);
        layer.config.limits(context.peek())
    }

    /// `*` and the empty path are matched as one segment; any other path without a leading
    /// `/` is limited whatever `include` and `exclude` say.
    #[test]
    fn a_path_without_a_leading_slash_other_than_the_asterisk_is_limited() {
        assert!(!limits("*", &[], &["/*"]), "`*` as the one segment `/*` excludes");
        assert!(limits("*", &[], &["/health"]));
        assert!(limits("health", &[], &["/health"]));
        assert!(limits("tenants/../orders", &["/tenants/*/orders"], &[]));
        assert!(!limits("/health", &[], &["/health"]));
    }
}
