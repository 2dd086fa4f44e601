//! The rate-limit service under load: checks per second of `fluxgate-server` (release
//! build) with Redis behind it, driven over loopback by this process at 64 keep-alive
//! connections, single checks and batches; latency p50 / p99; the server's CPU time per
//! 1,000 checks (from `/proc/<pid>/stat`).
//!
//! Run with: `cargo build --release -p fluxgate-server && cargo bench --bench service`
//! (needs `redis-server`; `BENCH_SECS` sets the seconds per measurement, default 5;
//! `BATCH` the requests per batch call, default 10).
//!
//! Every check is admitted (quotas far above the rate), over 100,000 distinct clients.

#![allow(missing_docs, clippy::unwrap_used)]

/// The test support's `redis-server` processes.
#[path = "../tests/support/servers.rs"]
#[allow(dead_code)]
mod servers;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use servers::RedisServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CONNECTIONS: usize = 64;
const CLIENTS: u64 = 100_000;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The release server binary next to this benchmark's (`target/release/fluxgate-server`).
fn server_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let binary = exe.parent().unwrap().parent().unwrap().join("fluxgate-server");
    assert!(
        binary.exists(),
        "{} is missing: run `cargo build --release -p fluxgate-server` first",
        binary.display()
    );
    binary
}

/// The server's user + system CPU time so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces), from `) `.
    let fields: Vec<&str> = stat.rsplit_once(") ").unwrap().1.split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // The clock tick is 100 Hz on Linux.
    Duration::from_millis(ticks * 10)
}

fn check_body(client: u64) -> String {
    format!(
        r#"{{"ruleSetId":"api","clientIp":"10.{}.{}.{}","path":"/orders/1","method":"POST"}}"#,
        (client >> 16) & 0xff,
        (client >> 8) & 0xff,
        client & 0xff
    )
}

/// Sends `body` to `path` on a kept-alive connection and reads the whole answer; answers
/// whether it was a 200.
async fn exchange(stream: &mut TcpStream, buffer: &mut Vec<u8>, path: &str, body: &str) -> bool {
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    buffer.clear();
    loop {
        let mut chunk = [0u8; 16 * 1024];
        let n = stream.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the server closed the connection");
        buffer.extend_from_slice(&chunk[..n]);
        let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = std::str::from_utf8(&buffer[..end]).unwrap().to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        if buffer.len() >= end + 4 + length {
            return head.starts_with("http/1.1 200");
        }
    }
}

struct Run {
    checks_per_sec: f64,
    calls_per_sec: f64,
    p50: Duration,
    p99: Duration,
    cpu_per_1000: Duration,
}

async fn load(port: u16, pid: u32, secs: u64, batch: u64) -> Run {
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..CONNECTIONS as u64 {
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            stream.set_nodelay(true).unwrap();
            let mut buffer = Vec::new();
            let mut latencies = Vec::new();
            let mut client = c * 7919;
            while !stop.load(Ordering::Relaxed) {
                let (path, body) = if batch <= 1 {
                    client = (client + 64) % CLIENTS;
                    ("/api/ratelimit/check", check_body(client))
                } else {
                    let requests: Vec<String> = (0..batch)
                        .map(|_| {
                            client = (client + 64) % CLIENTS;
                            check_body(client)
                        })
                        .collect();
                    (
                        "/api/ratelimit/check/batch",
                        format!(r#"{{"requests":[{}]}}"#, requests.join(",")),
                    )
                };
                let start = Instant::now();
                assert!(exchange(&mut stream, &mut buffer, path, &body).await, "a failed call");
                latencies.push(start.elapsed());
            }
            latencies
        }));
    }
    // Warm up, then measure.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let cpu_before = cpu_time(pid);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let elapsed = started.elapsed();
    let cpu = cpu_time(pid) - cpu_before;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    // The calls of the measured period: all but the warm-up's share, estimated by time.
    let total_time = elapsed + Duration::from_millis(500);
    let calls = all.len() as f64 * elapsed.as_secs_f64() / total_time.as_secs_f64();
    all.sort();
    let at = |q: f64| all[((all.len() as f64 - 1.0) * q) as usize];
    let checks = calls * batch.max(1) as f64;
    Run {
        checks_per_sec: checks / elapsed.as_secs_f64(),
        calls_per_sec: calls / elapsed.as_secs_f64(),
        p50: at(0.5),
        p99: at(0.99),
        cpu_per_1000: cpu.mul_f64(1000.0 / checks),
    }
}

fn start_server(redis: &RedisServer, dir: &std::path::Path) -> (Child, u16) {
    let rules = dir.join("rules.yaml");
    std::fs::write(
        &rules,
        "rule_sets: [{id: api, rules: [{id: per-ip, match: {paths: [\"/orders/**\"]}, bands: [{capacity: 100000000, window: 1h}]}]}]",
    )
    .unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = dir.join("server.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:{port}\"\nrules = \"{}\"\nredis = \"{}\"\n[limiter]\npool_size = 8\n[log]\nlevel = \"warn\"\n",
            rules.display(),
            redis.url()
        ),
    )
    .unwrap();
    let child = Command::new(server_binary())
        .args(["--config", config.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(start.elapsed() < Duration::from_secs(10), "the server did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    (child, port)
}

fn main() {
    let secs = env_u64("BENCH_SECS", 5);
    let batch = env_u64("BATCH", 10);
    let dir = std::env::temp_dir().join(format!("fluxgate-service-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    for (name, size) in [("single", 1), ("batch", batch)] {
        let redis = RedisServer::start();
        let (mut child, port) = start_server(&redis, &dir);
        let run = runtime.block_on(load(port, child.id(), secs, size));
        println!(
            "service {name}{}: {:.0} checks/s ({:.0} calls/s) at {CONNECTIONS} connections; call latency p50 {:.2} ms, p99 {:.2} ms; server CPU {:.1} ms per 1,000 checks",
            if size > 1 { format!(" of {size}") } else { String::new() },
            run.checks_per_sec,
            run.calls_per_sec,
            run.p50.as_secs_f64() * 1e3,
            run.p99.as_secs_f64() * 1e3,
            run.cpu_per_1000.as_secs_f64() * 1e3,
        );
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = std::fs::remove_dir_all(&dir);
}
