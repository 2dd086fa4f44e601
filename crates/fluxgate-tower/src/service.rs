//! [`RateLimit`]: the middleware service.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use fluxgate_core::RequestContextBuilder;
use http::{Request, Response};
use tower_service::Service;

use crate::config::{Config, Verdict};
use crate::future::ResponseFuture;
use crate::layer::RateLimitLayer;

/// Rate-limits requests to an inner service. Built by [`RateLimitLayer`].
///
/// Always ready when the inner service is; never calls the inner service for a rejected
/// request and at most once for any request; the inner service's errors pass through.
/// A request whose decision is not ready at once gives back what the inner service's
/// readiness held, and polls a clone of it ready once admitted: a request waiting for
/// its decision (or for the refill) holds no permit of a concurrency limit inside the
/// layer.
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
        // The client address, once resolved (a request the layer leaves alone never is).
        let mut resolved = None;
        if let Some(engine) = &config.by_address {
            // A rule set that reads nothing but the method and the client address is
            // decided without a context (nothing else of the layer reads one).
            let client_ip = *resolved.insert(config.client_ip.resolve(req.extensions(), req.headers()));
            let verdict = engine.check_address(&config.rule_set, req.method(), client_ip, |decision| {
                config.address_verdict(decision)
            });
            if let Some(verdict) = verdict {
                return match verdict {
                    Verdict::Pass(figures) => ResponseFuture::calling(self.inner.call(req), figures),
                    Verdict::Reject(response) => ResponseFuture::rejected(response),
                };
            }
        }
        let mut builder = RequestContextBuilder::with_rule_set(config.rule_set.clone());
        builder.set_path(req.uri().path());
        if !config.limits(builder.peek()) {
            return ResponseFuture::calling(self.inner.call(req), None);
        }
        let client_ip = resolved.unwrap_or_else(|| config.client_ip.resolve(req.extensions(), req.headers()));
        match &config.customizer {
            None => config.fill(&mut builder, req.method(), req.headers(), req.extensions(), client_ip),
            Some(customize) => {
                // Only a customizer needs the request taken apart into its `Parts`.
                let (parts, body) = req.into_parts();
                config.fill(
                    &mut builder,
                    &parts.method,
                    &parts.headers,
                    &parts.extensions,
                    client_ip,
                );
                customize(&mut builder, &parts);
                req = Request::from_parts(parts, body);
            }
        }
        if config.shadow {
            // A shadow layer changes nothing for the request: no rule makes it wait.
            builder.set_max_wait(Some(Duration::ZERO));
        }
        // The path is set, so the context as built so far is complete: no need to move it.
        let ctx = builder.peek();
        let own_rule_set = config.own_rule_set(ctx);
        match self.config.handler.check(ctx).into_ready() {
            Ok(result) => match self.config.verdict(result, own_rule_set) {
                Verdict::Pass(figures) => ResponseFuture::calling(self.inner.call(req), figures),
                Verdict::Reject(response) => ResponseFuture::rejected(response),
            },
            Err(pending) => {
                // The request may wait for its decision (a backend's answer, the refill)
                // for long. What the service polled ready holds for its call (a
                // concurrency limit's permit, a buffer's slot) is given back now rather
                // than held meanwhile: the ready service is dropped, and a clone is polled
                // ready once the request is admitted.
                let inner = self.inner.clone();
                self.inner = inner.clone();
                ResponseFuture::checking(pending, inner, req, self.config.clone(), own_rule_set)
            }
        }
    }
}
