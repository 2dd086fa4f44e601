//! [`RateLimit`]: the middleware service.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use fluxgate_core::{Decision, Error, Outcome, PathPattern, RequestContext, RequestContextBuilder};
use http::{Extensions, HeaderMap, Method, Request, Response};
use tower_service::Service;

use crate::future::ResponseFuture;
use crate::layer::{Config, FailurePolicy, RateLimitLayer};
use crate::response::Figures;
use crate::{ApiKey, UserId};

/// Rate-limits requests to an inner service. Built by [`RateLimitLayer`].
///
/// Always ready when the inner service is; never calls the inner service for a rejected
/// request and at most once for any request; the inner service's errors pass through.
///
/// The inner service's response body type is kept: the `429` body is made with
/// `ResBody::from(Bytes)`, which axum's `Body` and `http_body_util::Full<Bytes>` provide.
/// For other body types, map the inner service's body first (for example with
/// `tower::ServiceBuilder::map_response`).
#[derive(Debug, Clone)]
pub struct RateLimit<S> {
    pub(crate) inner: S,
    pub(crate) config: Arc<Config>,
}

impl<S> RateLimit<S> {
    /// Wraps `inner` with the configuration of `layer`.
    pub fn new(inner: S, layer: &RateLimitLayer) -> Self {
        Self {
            inner,
            config: layer.config.clone(),
        }
    }

    /// A layer with the default options around a handler: the same as
    /// [`RateLimitLayer::new`].
    pub fn layer(handler: impl fluxgate_core::RateLimitHandler) -> RateLimitLayer {
        RateLimitLayer::new(handler)
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
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
    /// through by an exclusion of `/health`.
    fn limits(&self, ctx: &RequestContext) -> bool {
        let normalized = ctx.path();
        let view = |matches: &dyn Fn(&PathPattern) -> bool| {
            !self.exclude.iter().any(matches) && (self.include.is_empty() || self.include.iter().any(matches))
        };
        if view(&|p| p.matches(normalized)) {
            return true;
        }
        let routed = ctx.routed_path();
        routed != normalized && view(&|p| p.matches_routed(routed))
    }

    /// Fills a context from the request, before the customizer.
    fn fill(&self, builder: &mut RequestContextBuilder, method: &Method, headers: &HeaderMap, extensions: &Extensions) {
        let header = |name: &Option<http::HeaderName>| name.as_ref().and_then(|n| headers.get(n)).map(header_text);
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
            .set_client_ip(self.client_ip.resolve(extensions, headers))
            .set_user_id(user)
            .set_api_key(key);
    }

    pub(crate) fn verdict(&self, result: Result<Decision, Error>) -> Verdict {
        match result {
            Ok(decision) if decision.allowed() => {
                if let Some(rule) = &decision.shadow_rejected_by {
                    tracing::debug!(rule_set = %decision.rule_set, rule = %rule, "shadow rule would reject");
                }
                Verdict::Pass(Figures::of(self, &decision, false))
            }
            Ok(decision) if matches!(decision.outcome, Outcome::BackendUnavailable { .. }) && !self.shadow => {
                let status = match self.on_error {
                    FailurePolicy::FailClosed(status) => status,
                    _ => http::StatusCode::SERVICE_UNAVAILABLE,
                };
                Verdict::Reject(crate::response::unavailable(status))
            }
            Ok(decision) if self.shadow => {
                tracing::debug!(rule_set = %decision.rule_set, rule = ?decision.rule(), "shadow mode: would reject");
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
            Err(error) => match self.on_error {
                FailurePolicy::FailOpen => {
                    tracing::warn!(%error, "rate-limit check failed; admitting the request");
                    Verdict::Pass(None)
                }
                FailurePolicy::FailClosed(status) => {
                    tracing::warn!(%error, "rate-limit check failed; refusing the request");
                    Verdict::Reject(crate::response::unavailable(status))
                }
            },
        }
    }
}

/// A header value as text, injectively: valid UTF-8 as it is; anything else as `\0` (which
/// no header value can contain) followed by its bytes read as Latin-1. Two different
/// values never give the same text.
fn header_text(value: &http::HeaderValue) -> String {
    match std::str::from_utf8(value.as_bytes()) {
        Ok(text) => text.to_owned(),
        Err(_) => std::iter::once('\0')
            .chain(value.as_bytes().iter().map(|&b| char::from(b)))
            .collect(),
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ResBody: From<Bytes>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        let config = &self.config;
        let mut builder = RequestContextBuilder::with_rule_set(config.rule_set.clone());
        builder.set_path(req.uri().path());
        if !config.limits(builder.peek()) {
            return ResponseFuture::calling(self.inner.call(req), None);
        }
        match &config.customizer {
            None => config.fill(&mut builder, req.method(), req.headers(), req.extensions()),
            Some(customize) => {
                // Only a customizer needs the request taken apart into its `Parts`.
                let (parts, body) = req.into_parts();
                config.fill(&mut builder, &parts.method, &parts.headers, &parts.extensions);
                customize(&mut builder, &parts);
                req = Request::from_parts(parts, body);
            }
        }
        // The path is set, so the context as built so far is complete: no need to move it.
        let ctx = builder.peek();
        match self.config.handler.check(ctx).into_ready() {
            Ok(result) => match self.config.verdict(result) {
                Verdict::Pass(figures) => ResponseFuture::calling(self.inner.call(req), figures),
                Verdict::Reject(response) => ResponseFuture::rejected(response),
            },
            Err(pending) => {
                // Keep the service that was polled ready; leave a clone for the next call.
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::checking(pending, inner, req, self.config.clone())
            }
        }
    }
}
