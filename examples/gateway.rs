//! A gateway: an axum app whose rate limits are decided by a rate-limit service
//! (`fluxgate-server`) over HTTP, through `RemoteHandler`.
//!
//! Run the service, then the gateway:
//!
//! ```sh
//! cargo run -p fluxgate-server -- --rules examples/rules/quickstart.yaml            # on 127.0.0.1:8082
//! cargo run --example gateway --features remote -- --service http://127.0.0.1:8082 \
//!     --rules examples/rules/quickstart.yaml                                        # on 127.0.0.1:3001
//! curl -i localhost:3001/api/hello
//! ```
//!
//! Options: `--listen ADDR` (default 127.0.0.1:3001), `--service URL` (default
//! http://127.0.0.1:8082), `--rules FILE` (the service's rules: while the service does not
//! answer in time, the gateway decides by them in memory, per instance), `--fail-closed`
//! (answer 503 while the service does not answer, for what `--rules` does not decide; by
//! default requests then pass, fail open). A check that misses its deadline counts as the service being down,
//! whatever made it late: a burst that overloads the gateway opens its circuit, and with
//! fail open every request then passes uncounted for 250 ms. Give the gateway `--rules`, or
//! `--fail-closed`, where the limits must hold under load (see `docs/security.md`,
//! section 10).

use std::net::SocketAddr;
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use fluxgate::core::{CircuitBreaker, Engine, FailurePolicy, FallbackHandler, RuleSets};
use fluxgate::tower::remote::RemoteHandler;
use fluxgate::RateLimitLayer;

/// The gateway's routes, limited by the service at `service`; while it fails, by `rules` in
/// memory when given, else as `on_error` says.
fn app(service: &str, rules: Option<RuleSets>, on_error: FailurePolicy) -> Result<Router, Box<dyn std::error::Error>> {
    let remote = RemoteHandler::builder(service)?
        .timeout(Duration::from_millis(100))
        .build();
    // After 3 failures in a row, stop waiting for the service for 250 ms.
    let handler = CircuitBreaker::new(remote);
    // With the rules, what the local engine cannot decide (a rule set it lacks) still
    // follows `on_error`.
    let layer = match rules {
        Some(rules) => RateLimitLayer::builder(FallbackHandler::new(handler, Engine::in_memory(rules))),
        None => RateLimitLayer::builder(handler),
    }
    .on_error(on_error)
    .build()?;
    Ok(Router::new()
        .route("/api/hello", get(|| async { "hello\n" }))
        .route("/api/orders", get(|| async { "[]\n" }))
        .layer(layer))
}

#[tokio::main]
async fn main() {
    let mut listen: SocketAddr = "127.0.0.1:3001".parse().expect("a valid default address");
    let mut service = "http://127.0.0.1:8082".to_owned();
    let mut on_error = FailurePolicy::FailOpen;
    let mut rules = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" => match args.next().map(|v| v.parse()) {
                Some(Ok(addr)) => listen = addr,
                _ => exit("--listen needs an address, e.g. 127.0.0.1:3001"),
            },
            "--service" => service = args.next().unwrap_or_else(|| exit("--service needs a URL")),
            "--rules" => {
                let path = args.next().unwrap_or_else(|| exit("--rules needs a rule file"));
                match RuleSets::from_file(&path) {
                    Ok(loaded) => rules = Some(loaded),
                    Err(e) => exit(&e.to_string()),
                }
            }
            "--fail-closed" => on_error = FailurePolicy::FailClosed,
            "-h" | "--help" => {
                println!("usage: gateway [--listen ADDR] [--service URL] [--rules FILE] [--fail-closed]");
                return;
            }
            other => exit(&format!("unknown argument `{other}` (try --help)")),
        }
    }
    let app = app(&service, rules, on_error).unwrap_or_else(|e| exit(&e.to_string()));
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .unwrap_or_else(|e| exit(&format!("cannot listen on {listen}: {e}")));
    println!("gateway on http://{listen}, limits decided by {service}");
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
        .await
        .unwrap_or_else(|e| exit(&e.to_string()));
}

fn exit(message: &str) -> ! {
    eprintln!("error: {message}");
    std::process::exit(2);
}
