//! Metrics for Prometheus: the engine's `MetricsRecorder` reports through the `metrics`
//! facade (feature `metrics`), a Prometheus exporter installed by the application collects,
//! and the application serves the text at `/metrics`, a path the limiter leaves alone.
//!
//! Run with: `cargo run --example metrics` (add `--demo` to send a few requests and print
//! what Prometheus would scrape).

use std::net::SocketAddr;

use axum::routing::get;
use axum::Router;
use fluxgate::core::metrics::{describe, MetricsRecorder, BACKEND_SECONDS};
use fluxgate::{Engine, RateLimitLayer, RuleSets};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tower::ServiceExt;

const RULES: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-ip
        match: { paths: ["/api/**"] }
        bands: [{ capacity: 3, window: 1m }]
      # Tried in shadow mode before enforcing it: counted, never blocks.
      - id: stricter
        mode: shadow
        match: { paths: ["/api/**"] }
        bands: [{ capacity: 2, window: 1m }]
"#;

/// Installs the Prometheus exporter as the process's `metrics` recorder, without an HTTP
/// listener of its own, with histogram buckets for the backend's latency.
fn install_prometheus() -> PrometheusHandle {
    let buckets = [0.000_01, 0.000_1, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(BACKEND_SECONDS.to_owned()), &buckets)
        .expect("buckets")
        .install_recorder()
        .expect("the first metrics recorder of the process");
    describe();
    handle
}

fn app(prometheus: PrometheusHandle) -> Router {
    let rules = RuleSets::from_yaml_str(RULES).expect("valid rules");
    let engine = Engine::builder(rules)
        .recorder(MetricsRecorder::new())
        .build()
        .expect("the in-memory limiter decides every rule");
    let limiter = RateLimitLayer::builder(engine)
        .exclude(["/metrics"])
        .build()
        .expect("valid layer");
    Router::new()
        .route("/api/hello", get(|| async { "hello\n" }))
        .route("/metrics", get(move || std::future::ready(prometheus.render())))
        .layer(limiter)
}

#[tokio::main]
async fn main() {
    let app = app(install_prometheus());
    if std::env::args().any(|a| a == "--demo") {
        demo(app).await;
        return;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000")
        .await
        .expect("listen on 127.0.0.1:3000");
    println!("listening on http://127.0.0.1:3000");
    println!("  curl -i http://127.0.0.1:3000/api/hello   # 3 per minute per client");
    println!("  curl http://127.0.0.1:3000/metrics");
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
        .await
        .expect("server");
}

async fn demo(app: Router) {
    let get = |path: &'static str| {
        let app = app.clone();
        async move {
            let mut req = axum::http::Request::builder()
                .uri(path)
                .body(axum::body::Body::empty())
                .expect("request");
            req.extensions_mut()
                .insert(axum::extract::ConnectInfo(SocketAddr::from(([192, 0, 2, 1], 5000))));
            let resp = app.oneshot(req).await.expect("infallible");
            let status = resp.status().as_u16();
            let body = axum::body::to_bytes(resp.into_body(), usize::MAX).await.expect("body");
            (status, String::from_utf8_lossy(&body).into_owned())
        }
    };
    for i in 1..=5 {
        println!("GET /api/hello #{i}: {}", get("/api/hello").await.0);
    }
    let (status, text) = get("/metrics").await;
    println!("GET /metrics: {status}");
    for line in text
        .lines()
        .filter(|l| l.contains("fluxgate_") && !l.starts_with("# TYPE"))
    {
        println!("  {line}");
    }
}
