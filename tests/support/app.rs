//! The application under test, wrapped in the layer, and helpers to send it requests.

use std::net::{IpAddr, SocketAddr};

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::{get, post};
use axum::Router;
use fluxgate::core::{Engine, RuleSets};
use fluxgate::tower::{RateLimitLayer, RateLimitLayerBuilder};
use http::{HeaderMap, Request, StatusCode};
use tower::ServiceExt;

/// The five algorithms, as rule files name them.
#[allow(dead_code)] // Not every test binary draws rules.
pub(crate) const ALGORITHMS: [&str; 5] = [
    "token_bucket",
    "leaky_bucket",
    "fixed_window",
    "sliding_window_log",
    "sliding_window_counter",
];

/// The rule sets of a YAML text.
pub(crate) fn rules(yaml: &str) -> RuleSets {
    RuleSets::from_yaml_str(yaml).unwrap_or_else(|e| panic!("test rules: {e}"))
}

/// The application under test: a few routes, wrapped in the layer.
pub(crate) fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/api/users", get(|| async { "users" }))
        .route("/api/orders", get(|| async { "orders" }).post(|| async { "created" }))
        .route("/api/{*rest}", get(|| async { "other" }))
        .route("/health", get(|| async { "ok" }))
        .route("/metrics/{*rest}", get(|| async { "metrics" }))
        .route("/upload", post(|| async { "uploaded" }))
        .layer(layer)
}

pub(crate) fn layer(engine: Engine) -> RateLimitLayerBuilder {
    RateLimitLayer::builder(engine)
}

/// A request from `peer` with optional headers.
pub(crate) fn request(method: &str, path: &str, peer: &str, headers: &[(&str, &str)]) -> Request<Body> {
    let mut req = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut req = req.body(Body::empty()).unwrap();
    let ip: IpAddr = peer.parse().unwrap();
    req.extensions_mut().insert(ConnectInfo(SocketAddr::new(ip, 40000)));
    req
}

pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: String,
}

impl Reply {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
    pub(crate) fn num(&self, name: &str) -> u64 {
        self.header(name)
            .unwrap_or_else(|| panic!("no {name} header"))
            .parse()
            .unwrap()
    }
}

pub(crate) async fn send(app: &Router, req: Request<Body>) -> Reply {
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

pub(crate) async fn get_from(app: &Router, path: &str, peer: &str) -> Reply {
    send(app, request("GET", path, peer, &[])).await
}

/// A rule of each algorithm (two of the token bucket), global, of two bands of different
/// windows but one, in two versions: the second changes `tb1`'s first window (a token-bucket
/// rule's layout then differs: its bands of the other version are kept beside) and `fw`'s
/// capacity.
#[allow(dead_code)] // the core and Redis tests'
pub(crate) fn five_algorithms_in_two_versions() -> [std::sync::Arc<fluxgate::core::RuleSet>; 2] {
    let yaml = |tb1: &str, fw: u64| {
        format!(
            r#"
rule_sets:
  - id: default
    rules:
      - {{ id: tb1, scope: global, bands: [{{ capacity: 3, window: {tb1} }}, {{ capacity: 5, window: 3s }}] }}
      - {{ id: tb2, scope: global, bands: [{{ capacity: 2, window: 700ms }}] }}
      - {{ id: lb, scope: global, algorithm: leaky_bucket, bands: [{{ capacity: 3, window: 1s }}, {{ capacity: 4, window: 2s }}] }}
      - {{ id: fw, scope: global, algorithm: fixed_window, bands: [{{ capacity: {fw}, window: 1s }}, {{ capacity: 5, window: 2s }}] }}
      - {{ id: swl, scope: global, algorithm: sliding_window_log, bands: [{{ capacity: 3, window: 1s }}, {{ capacity: 5, window: 2s }}] }}
      - {{ id: swc, scope: global, algorithm: sliding_window_counter, bands: [{{ capacity: 3, window: 1s }}, {{ capacity: 5, window: 2s }}] }}
"#
        )
    };
    let set = |text: String| rules(&text).get("default").expect("a rule set `default`").clone();
    [set(yaml("1s", 3)), set(yaml("2s", 4))]
}
