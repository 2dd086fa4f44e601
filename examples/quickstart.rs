//! An axum app limited by FluxGate, in memory by default or in Redis with `--redis`.
//!
//! Run with: `cargo run --example quickstart` (options: `--listen ADDR`, `--rules FILE`,
//! `--redis URL` to keep the buckets in Redis instead of memory, `--demo` to send 15
//! requests to itself, print each status and the rate-limit headers, and exit).
//!
//! The rules file is watched: an edit is in force about 100 ms after it is saved, and an
//! edit that does not load leaves the running rules in force (the reason is printed).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::routing::get;
use axum::Router;
use fluxgate::core::reload::{ReloadError, ReloadReport, Watch};
use fluxgate::{Engine, FileRuleSource, RateLimitLayer, ReloadingRuleSetProvider, RuleSet};

struct Args {
    listen: SocketAddr,
    rules: PathBuf,
    redis: Option<String>,
    demo: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        listen: "127.0.0.1:3000".parse().expect("valid default address"),
        rules: PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/rules/quickstart.yaml")),
        redis: None,
        demo: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--listen" => {
                let v = it.next().ok_or("--listen needs an address, e.g. 127.0.0.1:3000")?;
                args.listen = v.parse().map_err(|e| format!("--listen {v}: {e}"))?;
            }
            "--rules" => args.rules = it.next().ok_or("--rules needs a file")?.into(),
            "--redis" => args.redis = Some(it.next().ok_or("--redis needs a URL, e.g. redis://127.0.0.1:6379")?),
            "--demo" => args.demo = true,
            "-h" | "--help" => {
                println!("usage: quickstart [--listen ADDR] [--rules FILE] [--redis URL] [--demo]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument `{other}` (try --help)")),
        }
    }
    Ok(args)
}

fn app(engine: Engine) -> Router {
    Router::new()
        .route("/api/hello", get(|| async { "hello\n" }))
        .route("/api/orders", get(|| async { "[]\n" }).post(|| async { "created\n" }))
        .route("/reports", get(|| async { "report\n" }))
        .route("/health", get(|| async { "ok\n" }))
        .layer(
            RateLimitLayer::builder(engine)
                .exclude(["/health"])
                .build()
                .expect("valid layer"),
        )
}

#[tokio::main]
async fn main() {
    let args = parse_args().unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(2);
    });
    let source = FileRuleSource::new(&args.rules);
    let rules = source.read().unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(1);
    });
    // The engine looks its rule sets up in a provider the file watch below replaces.
    let provider = Arc::new(ReloadingRuleSetProvider::new(rules));
    let engine = match &args.redis {
        None => Engine::builder(provider.clone()).build().unwrap_or_else(|e| {
            eprintln!("error: {e}");
            std::process::exit(1);
        }),
        Some(url) => {
            let limiter = fluxgate::redis::RedisLimiter::builder(url.as_str())
                .connect()
                .await
                .unwrap_or_else(|e| {
                    eprintln!("error: {e}");
                    std::process::exit(1);
                });
            Engine::builder(provider.clone())
                .limiter(limiter)
                .build()
                .unwrap_or_else(|e| {
                    eprintln!("error: {e}");
                    std::process::exit(1);
                })
        }
    };
    let rules_path = args.rules.clone();
    // Weak, as the watch holds the provider: the callback must not keep it alive.
    let provider_in_force = Arc::downgrade(&provider);
    let _watch = Watch::builder(provider, source)
        .on_reload(move |result| {
            if let Some(provider) = provider_in_force.upgrade() {
                reloaded(&rules_path, &provider, result);
            }
        })
        .spawn()
        .map_err(|e| eprintln!("warning: {e}; edits of the rules file will not be seen"))
        .ok();
    let backend = args
        .redis
        .as_deref()
        // Shown without its password: this line goes to the terminal and to logs.
        .map_or_else(
            || "in memory".to_owned(),
            |url| format!("in Redis at {}", fluxgate::redis::redact_url(url)),
        );
    let listener = tokio::net::TcpListener::bind(args.listen).await.unwrap_or_else(|e| {
        eprintln!("error: cannot listen on {}: {e}", args.listen);
        std::process::exit(1);
    });
    let addr = listener.local_addr().expect("bound address");
    // Stops on Ctrl-C once the requests in flight are answered.
    let server = axum::serve(
        listener,
        app(engine.clone()).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    });

    if args.demo {
        tokio::spawn(async move { server.await.expect("server") });
        println!("Buckets {backend}.");
        demo(addr).await;
        give_back_leases(&engine).await;
        return;
    }
    println!(
        "FluxGate quickstart listening on http://{addr} (rules: {}, reloaded when the file changes; buckets {backend})",
        args.rules.display()
    );
    println!("Try it:");
    println!("  curl -i http://{addr}/api/hello                 # 5 per 10 s, 20 per minute per IP");
    println!("  for i in $(seq 8); do curl -s -o /dev/null -w '%{{http_code}}\\n' http://{addr}/api/hello; done");
    println!("  curl -i -X POST http://{addr}/api/orders        # costs 2 permits of 6 per minute");
    println!("  for i in $(seq 5); do curl -s -o /dev/null -w '%{{http_code}} %{{time_total}}s\\n' http://{addr}/reports; done");
    println!("                                                  # 2 per second; the next ones wait for their turn");
    println!("  curl -i http://{addr}/health                    # excluded from limiting");
    server.await.expect("server");
    give_back_leases(&engine).await;
}

/// At shutdown: the permits this instance leased (the `everyone` rule, with `--redis`) and
/// did not spend go back to the shared bucket.
async fn give_back_leases(engine: &Engine) {
    match engine.release_leases().await {
        Ok(0) => {}
        Ok(permits) => println!("{permits} leased permits given back"),
        Err(error) => eprintln!("warning: leased permits not all given back: {error}"),
    }
}

/// Prints what a reload of the rules file did.
fn reloaded(path: &Path, provider: &ReloadingRuleSetProvider, result: &Result<ReloadReport, ReloadError>) {
    let path = path.display();
    match result {
        Ok(report) if report.is_empty() => println!("{path} saved: no rule changed"),
        Ok(report) => {
            println!("{path} reloaded: rule sets {report}");
            let in_force = provider.rule_sets();
            for id in report.added.iter().chain(&report.changed) {
                if let Some(set) = in_force.get(id) {
                    describe(set);
                }
            }
        }
        // The provider kept the rules in force.
        Err(error) => eprintln!("{path}: edit refused: {error}"),
    }
}

/// One line per rule: its id and its bands.
fn describe(set: &RuleSet) {
    for rule in set.rules() {
        let bands: Vec<String> = rule
            .bands()
            .iter()
            .map(|band| format!("{} per {:?}", band.capacity(), band.window()))
            .collect();
        println!("  {}/{}: {}", set.id(), rule.id(), bands.join(", "));
    }
}

/// Sends `GET path` to the running app over a plain TCP connection; returns the response.
async fn get_over_tcp(addr: SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    response
}

/// The status line of `response`, without the protocol.
fn status(response: &str) -> String {
    response
        .lines()
        .next()
        .unwrap_or("")
        .trim_start_matches("HTTP/1.1 ")
        .to_owned()
}

/// Sends requests to the running app and prints what comes back.
async fn demo(addr: SocketAddr) {
    println!("Sending 15 requests to http://{addr}/api/hello (burst: 5 per 10 s):");
    for i in 1..=15 {
        let response = get_over_tcp(addr, "/api/hello").await;
        let status = status(&response);
        let header = |name: &str| {
            response
                .lines()
                .find_map(|l| {
                    l.split_once(':')
                        .filter(|(k, _)| k.eq_ignore_ascii_case(name))
                        .map(|(_, v)| v.trim().to_owned())
                })
                .unwrap_or_else(|| "-".to_owned())
        };
        println!(
            "{i:>2}  {status:<22} limit={} remaining={} reset={} retry-after={}  ratelimit: {}",
            header("x-ratelimit-limit"),
            header("x-ratelimit-remaining"),
            header("x-ratelimit-reset"),
            header("retry-after"),
            header("ratelimit"),
        );
    }
    println!("Sending 5 requests at once to http://{addr}/reports (2 per second; the others wait):");
    let start = std::time::Instant::now();
    let requests: Vec<_> = (0..5)
        .map(|_| tokio::spawn(async move { (status(&get_over_tcp(addr, "/reports").await), start.elapsed()) }))
        .collect();
    for request in requests {
        let (status, after) = request.await.expect("the request's task");
        println!("    {status:<22} after {} ms", after.as_millis());
    }
}
