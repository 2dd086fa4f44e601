//! The tower layer, a module a topic: paths and methods, client addresses, identity headers,
//! options and headers, plain tower services, failure policies, rule sets, and the modules
//! that draw requests at random or send them through real sockets. Here, the helpers several
//! modules share.

/// The shared test support: the modules of `tests/support/` this binary uses. Like the tests,
/// it panics on what it does not expect.
#[path = "../support"]
#[allow(clippy::unwrap_used)]
mod support {
    pub(crate) mod app;
    pub(crate) mod rng;
    pub(crate) mod telemetry;
}

mod by_address;
mod client_addresses;
mod composition;
mod escapes;
mod failure_policies;
mod identity_headers;
mod metrics;
mod options;
mod param_values;
mod paths;
mod protocol;
mod routes;
mod rule_sets;
mod targets;
mod tower_services;
mod wildcards;

use std::net::SocketAddr;

use fluxgate::core::{Engine, EngineBuilder, MemoryLimiter, TokioClock};
use fluxgate::tower::RateLimitLayer;
use support::app::*;

/// An engine over the rules of `yaml` and a fresh in-memory limiter on tokio's clock (the
/// engine's own: a layer decides rule sets of one address rule of one band without a
/// context, `Engine::check_address`).
fn builder(yaml: &str) -> EngineBuilder {
    Engine::builder(rules(yaml)).limiter(MemoryLimiter::builder().clock(TokioClock::new()).build())
}

fn engine(yaml: &str) -> Engine {
    builder(yaml).build().expect("the in-memory limiter decides every rule")
}

const LOGIN_GET_ONE_PER_HOUR: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: login
        match: { paths: ["/api/*/login"], methods: [GET] }
        bands: [{ capacity: 1, window: 1h }]
"#;

/// A backend that always fails.
#[derive(Debug)]
struct Down;

impl fluxgate::core::RateLimiter for Down {
    fn acquire(
        &self,
        _: &fluxgate::core::limiter::AcquireRequest,
    ) -> fluxgate::core::MaybeReady<Result<fluxgate::core::limiter::AcquireOutcome, fluxgate::core::BoxError>> {
        fluxgate::core::MaybeReady::ready(Err("backend down".into()))
    }
}

trait LayerService {
    fn layer_service<S>(&self, inner: S) -> fluxgate::tower::RateLimit<S>;
}

impl LayerService for RateLimitLayer {
    fn layer_service<S>(&self, inner: S) -> fluxgate::tower::RateLimit<S> {
        tower::Layer::layer(self, inner)
    }
}

/// Serves `app` on a loopback port (HTTP/1.1, and HTTP/2 with prior knowledge), with the
/// peer address as `ConnectInfo`.
async fn serve(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let addr = listener.local_addr().expect("a bound address");
    tokio::spawn(async move {
        let app = app.into_make_service_with_connect_info::<SocketAddr>();
        axum::serve(listener, app).await.expect("the server runs");
    });
    addr
}
