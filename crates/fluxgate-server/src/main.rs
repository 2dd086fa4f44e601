//! `fluxgate-server`: the FluxGate rate-limit service. See `docs/service.md`.

use fluxgate_server::config::LogFormat;
use fluxgate_server::{Config, Service};

const USAGE: &str =
    "usage: fluxgate-server [--config FILE] [--listen ADDR] [--rules FILE] [--redis URL] [--admin-token TOKEN]

  --config FILE        a TOML configuration file (see docs/service.md); flags override it
  --listen ADDR        the address to listen on (default 127.0.0.1:8082)
  --rules FILE         a rule file or directory, reloaded when it changes
  --redis URL          keep the buckets in Redis (redis://, redis-cluster://, redis-sentinel://)
  --admin-token TOKEN  turn on the rule administration endpoints, with this bearer token";

fn init_logs(config: &Config) {
    // `RUST_LOG`, its directives trimmed as the configured level's are; else that level,
    // checked with the configuration (`Config::check`).
    let from_env = std::env::var("RUST_LOG")
        .ok()
        .map(|env| fluxgate_server::config::normalized_filter(&env))
        .filter(|env| !env.is_empty())
        .map(|env| {
            tracing_subscriber::EnvFilter::try_new(env)
                .inspect_err(|error| eprintln!("warning: RUST_LOG ignored ({error}): the configured level applies"))
        });
    let filter = match from_env {
        Some(Ok(filter)) => filter,
        _ => tracing_subscriber::EnvFilter::new(config.log_filter()),
    };
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match config.log.format {
        Some(LogFormat::Json) => logs.json().init(),
        _ => logs.init(),
    }
}

/// Completes on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(signal) => signal,
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM");
                let _ = interrupt.await;
                return;
            }
        };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
    tracing::info!("shutting down: the checks in flight finish first");
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return;
    }
    let config = match Config::from_args(args) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("error: {error}");
            std::process::exit(2);
        }
    };
    init_logs(&config);
    // The backend's latency as a histogram (buckets from 10 µs to 100 ms).
    let buckets = [0.000_01, 0.000_1, 0.000_5, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1];
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full(fluxgate_core::metrics::BACKEND_SECONDS.to_owned()),
            &buckets,
        )
        .and_then(|builder| builder.install_recorder());
    let prometheus = match prometheus {
        Ok(handle) => Some(handle),
        Err(error) => {
            tracing::warn!(%error, "cannot install the metrics recorder: /metrics is off");
            None
        }
    };
    fluxgate_core::metrics::describe();
    let service = match Service::start(&config).await {
        Ok(service) => match prometheus {
            Some(handle) => service.with_metrics(move || handle.render()),
            None => service,
        },
        Err(error) => {
            tracing::error!(%error, "cannot start");
            std::process::exit(1);
        }
    };
    let listener = match tokio::net::TcpListener::bind(config.listen()).await {
        Ok(listener) => listener,
        Err(error) => {
            tracing::error!(%error, listen = %config.listen(), "cannot listen");
            std::process::exit(1);
        }
    };
    let address = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    tracing::info!(%address, "fluxgate-server listening");
    if let Err(error) = service.serve(listener, shutdown_signal()).await {
        tracing::error!(%error, "server failed");
        std::process::exit(1);
    }
    tracing::info!("stopped");
}
