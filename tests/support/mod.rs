//! Test support shared by the integration tests: backends, an app, request helpers.
#![allow(dead_code, unreachable_pub, missing_docs, clippy::unwrap_used)]

pub mod conformance;
pub mod model;
pub mod redis;
pub mod scenarios;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::{get, post};
use axum::Router;
use fluxgate::core::{
    Decision, Engine, MemoryLimiter, RateLimiter, RequestContext, RuleSets, StaticRuleSetProvider, TokioClock,
};
use fluxgate::tower::{RateLimitLayer, RateLimitLayerBuilder};
use http::{HeaderMap, Request, StatusCode};
use tower::ServiceExt;

/// A limiter backend under test: each call gives a fresh, isolated limiter.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    fn limiter(&self) -> Arc<dyn RateLimiter>;
    /// How many admissions the exact-refill scenario may be off by.
    fn refill_tolerance(&self) -> usize;
    /// Whether every rule of a request is decided in one atomic step (not so for rules in
    /// different slots of a Redis Cluster, which are refunded instead).
    fn atomic_across_rules(&self) -> bool {
        true
    }
}

/// The in-memory backend on tokio's clock (controlled by `start_paused`).
pub struct Memory;

impl Backend for Memory {
    fn name(&self) -> &'static str {
        "memory"
    }
    fn limiter(&self) -> Arc<dyn RateLimiter> {
        Arc::new(MemoryLimiter::builder().clock(TokioClock::new()).build())
    }
    fn refill_tolerance(&self) -> usize {
        1
    }
}

pub fn rules(yaml: &str) -> RuleSets {
    RuleSets::from_yaml_str(yaml).unwrap_or_else(|e| panic!("test rules: {e}"))
}

pub fn engine(backend: &dyn Backend, yaml: &str) -> Engine {
    Engine::builder(StaticRuleSetProvider::new(rules(yaml)))
        .shared_limiter(backend.limiter())
        .build()
        .expect("the backend decides every rule")
}

pub fn ctx(ip: &str) -> RequestContext {
    RequestContext::builder()
        .path("/api/users")
        .client_ip(ip.parse().unwrap())
        .build()
}

pub async fn check(engine: &Engine, ctx: &RequestContext) -> Decision {
    engine.check(ctx).await.expect("decision")
}

/// The application under test: a few routes, wrapped in the layer.
pub fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/api/users", get(|| async { "users" }))
        .route("/api/orders", get(|| async { "orders" }).post(|| async { "created" }))
        .route("/api/{*rest}", get(|| async { "other" }))
        .route("/health", get(|| async { "ok" }))
        .route("/metrics/{*rest}", get(|| async { "metrics" }))
        .route("/upload", post(|| async { "uploaded" }))
        .layer(layer)
}

pub fn layer(engine: Engine) -> RateLimitLayerBuilder {
    RateLimitLayer::builder(engine)
}

/// A request from `peer` with optional headers.
pub fn request(method: &str, path: &str, peer: &str, headers: &[(&str, &str)]) -> Request<Body> {
    let mut req = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut req = req.body(Body::empty()).unwrap();
    let ip: IpAddr = peer.parse().unwrap();
    req.extensions_mut().insert(ConnectInfo(SocketAddr::new(ip, 40000)));
    req
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
    pub fn num(&self, name: &str) -> u64 {
        self.header(name)
            .unwrap_or_else(|| panic!("no {name} header"))
            .parse()
            .unwrap()
    }
}

pub async fn send(app: &Router, req: Request<Body>) -> Reply {
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX).await.unwrap();
    Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

pub async fn get_from(app: &Router, path: &str, peer: &str) -> Reply {
    send(app, request("GET", path, peer, &[])).await
}
