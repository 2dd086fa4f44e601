//! The rate-limit service over real TCP on loopback: checks, batches, bad requests, rule
//! administration with a real Redis, health, the OpenAPI document, and the binary's
//! graceful shutdown.

#![allow(missing_docs, clippy::unwrap_used)]

/// The workspace's test support: real `redis-server` processes on free ports.
#[path = "../../../tests/support/servers.rs"]
#[allow(dead_code, unreachable_pub)]
mod servers;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use fluxgate_server::{Config, Service};
use serde_json::{json, Value};
use servers::RedisServer;

const TOKEN: &str = "test-token-0123456789";

/// An HTTP/1.1 answer.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: String,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// Sends one request on a new connection and reads the whole answer.
fn call(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Answer {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    // A peer that refuses a large body may close before reading it all.
    let _ = stream.write_all(body);
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    Answer {
        status,
        headers: head.to_ascii_lowercase(),
        body: body.to_owned(),
    }
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> Answer {
    call(
        addr,
        "POST",
        path,
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    )
}

/// A rule file in a fresh directory: rule set `api`, 3 per hour per IP on `/orders/**`;
/// rule set `web`, 2 per hour per user.
fn rule_file(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fluxgate-server-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("rules.yaml");
    std::fs::write(
        &file,
        "rule_sets:
  - id: api
    rules:
      - {id: orders, match: {paths: [\"/orders/**\"]}, bands: [{capacity: 3, window: 1h}]}
  - id: web
    rules:
      - {id: per-user, scope: user, bands: [{capacity: 2, window: 1h}]}
",
    )
    .unwrap();
    file
}

/// Starts a service on a free port; answers its address and the task serving it.
async fn serve(config: Config) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let service = Service::start(&config).await.expect("the service starts");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        service.serve(listener, std::future::pending()).await.unwrap();
    });
    (addr, task)
}

fn config(args: &[&str]) -> Config {
    Config::from_args(args.iter().map(|a| a.to_string())).expect("a valid configuration")
}

/// Runs a blocking HTTP call off the runtime's threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

async fn check_capacity_then_reject(addr: SocketAddr, ip: &str) {
    let request = json!({"ruleSetId": "api", "clientIp": ip, "path": "/orders/7", "method": "POST"});
    for remaining in [2, 1, 0] {
        let answer = blocking({
            let request = request.clone();
            move || post(addr, "/api/ratelimit/check", &request)
        })
        .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        let body = answer.json();
        assert_eq!(body["allowed"], true, "{body}");
        assert_eq!(body["remaining"], remaining, "{body}");
        assert_eq!(body["limit"], 3);
        assert_eq!(body["rule"], "orders");
        assert!(body["retryAfterMs"].is_null());
    }
    let answer = blocking(move || post(addr, "/api/ratelimit/check", &request)).await;
    let body = answer.json();
    assert_eq!(body["allowed"], false, "{body}");
    assert_eq!(body["remaining"], 0);
    let retry = body["retryAfterMs"].as_u64().expect("a retry-after");
    assert!(
        retry > 1_000_000 && retry <= 1_200_000,
        "about 20 min for one permit of 3/h: {retry}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_admits_the_capacity_then_says_when_to_retry_in_memory_and_in_redis() {
    let rules = rule_file("capacity");
    let (addr, _task) = serve(config(&["--rules", rules.to_str().unwrap()])).await;
    check_capacity_then_reject(addr, "192.0.2.1").await;

    let redis = RedisServer::start();
    let (addr, _task) = serve(config(&["--rules", rules.to_str().unwrap(), "--redis", &redis.url()])).await;
    check_capacity_then_reject(addr, "192.0.2.1").await;
    // The Java original's field names are accepted: `endpoint` for `path`.
    let body = json!({"ruleSetId": "api", "clientIp": "192.0.2.2", "endpoint": "/orders/1"});
    let answer = blocking(move || post(addr, "/api/ratelimit/check", &body)).await;
    assert_eq!(answer.json()["remaining"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_agrees_with_single_calls() {
    let rules = rule_file("batch");
    let (batch_addr, _a) = serve(config(&["--rules", rules.to_str().unwrap()])).await;
    let (single_addr, _b) = serve(config(&["--rules", rules.to_str().unwrap()])).await;
    let requests: Vec<Value> = (0..12)
        .map(|i| match i % 3 {
            0 => json!({"ruleSetId": "api", "clientIp": "198.51.100.1", "path": "/orders/1"}),
            1 => json!({"ruleSetId": "web", "userId": format!("user-{}", i % 2)}),
            _ => json!({"ruleSetId": "api", "clientIp": "198.51.100.2", "path": "/other"}),
        })
        .collect();
    let batch = json!({ "requests": requests });
    let answer = blocking(move || post(batch_addr, "/api/ratelimit/check/batch", &batch)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let results = answer.json()["results"].as_array().unwrap().clone();
    assert_eq!(results.len(), requests.len());
    // Requests of one batch may be decided in any order between themselves; requests of
    // one bucket are counted the same: compare per bucket.
    let mut singles = Vec::new();
    for request in requests.clone() {
        singles.push(
            blocking(move || post(single_addr, "/api/ratelimit/check", &request))
                .await
                .json(),
        );
    }
    let summary = |answers: &[Value]| {
        let mut per_bucket: Vec<(String, bool)> = requests
            .iter()
            .zip(answers)
            .map(|(request, answer)| (request.to_string(), answer["allowed"].as_bool().unwrap()))
            .collect();
        per_bucket.sort();
        per_bucket
    };
    assert_eq!(summary(&results), summary(&singles));
    // The fourth request of ip .1 on /orders/** is the one beyond the capacity of 3.
    assert_eq!(
        results.iter().filter(|r| r["allowed"] == false).count(),
        1,
        "{results:?}"
    );
}

/// A request of a batch that cannot be decided (its key holds a list in Redis, and its rule
/// names no failure policy) is an error of its own: the others' decisions, made and
/// counted, reach the caller, the rejection among them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_a_batch_that_fails_takes_none_of_the_others_decisions() {
    let rules = rule_file("batch-errors");
    let redis = RedisServer::start();
    let (addr, _task) = serve(config(&["--rules", rules.to_str().unwrap(), "--redis", &redis.url()])).await;
    redis.cli(&["RPUSH", "fluxgate:{api:orders:ip=192.0.2.9}", "not a bucket"]);
    let request = |ip: &str| json!({"ruleSetId": "api", "clientIp": ip, "path": "/orders/1"});
    let requests: Vec<Value> = std::iter::once(request("192.0.2.9"))
        .chain((0..4).map(|_| request("192.0.2.8")))
        .collect();
    let batch = json!({ "requests": requests });
    let answer = blocking(move || post(addr, "/api/ratelimit/check/batch", &batch)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let results = answer.json()["results"].as_array().unwrap().clone();
    assert_eq!(results.len(), 5);
    assert_eq!(results[0]["allowed"], false);
    assert_eq!(results[0]["outcome"], "error");
    assert!(
        results[0]["error"].as_str().unwrap().contains("WRONGTYPE"),
        "{}",
        results[0]
    );
    let allowed = results[1..].iter().filter(|r| r["allowed"] == true).count();
    assert_eq!(allowed, 3, "the capacity of 3, then the rejection: {results:?}");
    assert!(results[1..].iter().all(|r| r.get("error").is_none()));
}

/// With `[limiter.batching]`, the requests of a batch sent to the service go to Redis in a
/// few script calls instead of one each, and are decided as single calls are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limiter_batching_sends_a_batch_in_a_few_redis_calls() {
    let rules = rule_file("capacity-batched");
    let redis = RedisServer::start();
    let file = std::env::temp_dir().join(format!("fluxgate-server-{}-batching.toml", std::process::id()));
    std::fs::write(
        &file,
        format!(
            "rules = \"{}\"\nredis = \"{}\"\n[limiter.batching]\nmax_requests = 16\nmax_delay_us = 200\n",
            rules.display(),
            redis.url()
        ),
    )
    .unwrap();
    let config = config(&["--config", file.to_str().unwrap()]);
    let batching = config.limiter.batching.as_ref().expect("the table turns batching on");
    assert_eq!(batching.max_requests, Some(16));
    let (addr, _task) = serve(config).await;
    check_capacity_then_reject(addr, "192.0.2.1").await;

    let before = redis.evalsha_calls();
    let requests: Vec<Value> = (0..12)
        .map(|i| json!({"ruleSetId": "api", "clientIp": format!("198.51.100.{}", i % 2 + 1), "path": "/orders/1"}))
        .collect();
    let batch = json!({ "requests": requests });
    let answer = blocking(move || post(addr, "/api/ratelimit/check/batch", &batch)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let results = answer.json()["results"].as_array().unwrap().clone();
    // Two clients of capacity 3: three of each six pass.
    assert_eq!(
        results.iter().filter(|r| r["allowed"] == true).count(),
        6,
        "{results:?}"
    );
    let calls = redis.evalsha_calls() - before;
    assert!(calls < 12, "{calls} script calls for 12 requests");
    let _ = std::fs::remove_file(file);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_their_documented_answer_and_change_nothing() {
    let rules = rule_file("bad");
    let mut config = config(&["--rules", rules.to_str().unwrap()]);
    config.engine.unknown_rule_set = Some(fluxgate_server::config::UnknownRuleSetConfig::Deny);
    let (addr, _task) = serve(config).await;
    let good = json!({"ruleSetId": "api", "clientIp": "203.0.113.9", "path": "/orders/1"});
    let remaining = || {
        let good = good.clone();
        blocking(move || post(addr, "/api/ratelimit/check", &good).json()["remaining"].clone())
    };
    assert_eq!(remaining().await, 2);

    let cases: Vec<(Vec<u8>, u16, Option<&str>, &str)> = vec![
        (b"{not json".to_vec(), 400, None, "key must be a string"),
        (b"[1, 2]".to_vec(), 400, None, "must be a JSON object"),
        (b"".to_vec(), 400, None, "must be a JSON object"),
        (br#"{"clientIp": 7}"#.to_vec(), 400, Some("clientIp"), "invalid type"),
        (
            br#"{"clientIp": "not-an-ip", "ruleSetId": "api"}"#.to_vec(),
            400,
            Some("clientIp"),
            "not an IPv4",
        ),
        (
            br#"{"ruleSetId": "api", "path": "orders"}"#.to_vec(),
            400,
            Some("path"),
            "must start with",
        ),
        (br#"{"ruleSetId": "a b"}"#.to_vec(), 400, Some("ruleSetId"), "a b"),
        (
            br#"{"ruleSetId": "api", "method": "GE T"}"#.to_vec(),
            400,
            Some("method"),
            "not an HTTP method",
        ),
        (br#"{"ruleSetId": "api"} trailing"#.to_vec(), 400, None, "trailing"),
        (
            br#"{"ruleSetId": "api", "clientIp": "203.0.113.9", "path": "/orders/1", "permits": 5}"#.to_vec(),
            400,
            Some("permits"),
            "only 1",
        ),
        (vec![b' '; 10 * 1024 * 1024], 413, None, ""),
    ];
    for (body, status, field, message) in cases {
        let shown = String::from_utf8_lossy(&body[..body.len().min(40)]).into_owned();
        let answer = blocking(move || call(addr, "POST", "/api/ratelimit/check", &[], &body)).await;
        assert_eq!(answer.status, status, "{shown}: {}", answer.body);
        if status == 400 {
            let error = answer.json();
            assert_eq!(error["field"].as_str(), field, "{shown}: {error}");
            assert!(error["error"].as_str().unwrap().contains(message), "{shown}: {error}");
        }
    }
    // An unknown rule set follows the configured policy (deny here): not allowed, 200.
    let unknown = json!({"ruleSetId": "nope", "clientIp": "203.0.113.9"});
    let answer = blocking(move || post(addr, "/api/ratelimit/check", &unknown)).await;
    assert_eq!((answer.status, answer.json()["allowed"].clone()), (200, json!(false)));
    assert_eq!(remaining().await, 1, "nothing above consumed a permit");

    let answer = blocking(move || call(addr, "GET", "/api/nowhere", &[], b"")).await;
    assert_eq!(answer.status, 404);
    let answer = blocking(move || call(addr, "GET", "/api/ratelimit/check", &[], b"")).await;
    assert_eq!(answer.status, 405);
}

/// A batch of more than `[http] max_batch` requests is refused as soon as its reading
/// reaches the one past the bound: the rest of the body is not read (here not even JSON),
/// so that a body of a million `{}` does not become as many requests first. Batches within
/// the bound read as before: other fields ignored, an invalid request named by its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_past_its_bound_is_refused_before_the_rest_is_read() {
    let rules = rule_file("bounded-batch");
    let mut config = config(&["--rules", rules.to_str().unwrap()]);
    config.http.max_batch = Some(5);
    let (addr, _task) = serve(config).await;
    let request = r#"{"ruleSetId": "api", "clientIp": "192.0.2.1", "path": "/elsewhere"}"#;
    let batch = |n: usize, tail: &str| format!(r#"{{"requests": [{}{tail}"#, vec![request; n].join(", "));
    let cases: Vec<(String, u16, Option<&str>, &str)> = vec![
        (
            batch(6, ", !!! not JSON"),
            400,
            Some("requests"),
            "more than 5 requests: at most 5 in one batch",
        ),
        (batch(6, "]}"), 400, Some("requests"), "at most 5 in one batch"),
        (batch(5, r#"], "other": [1, {"x": 2}]}"#), 200, None, ""),
        (r#"{"other": 1}"#.to_owned(), 400, None, "missing field `requests`"),
        (
            format!(r#"{{"requests": [], "requests": [{request}]}}"#),
            400,
            None,
            "duplicate field `requests`",
        ),
        (
            format!(r#"{{"requests": [{request}, {request}, {{"clientIp": "x"}}]}}"#),
            400,
            Some("requests[2].clientIp"),
            "not an IPv4",
        ),
        (
            r#"{"requests": {}}"#.to_owned(),
            400,
            Some("requests"),
            "an array of requests",
        ),
    ];
    for (body, status, field, message) in cases {
        let shown = body.chars().take(60).collect::<String>();
        let answer = blocking(move || call(addr, "POST", "/api/ratelimit/check/batch", &[], body.as_bytes())).await;
        assert_eq!(answer.status, status, "{shown}: {}", answer.body);
        let json = answer.json();
        if status == 400 {
            assert_eq!(json["field"].as_str(), field, "{shown}: {json}");
            assert!(json["error"].as_str().unwrap().contains(message), "{shown}: {json}");
        } else {
            assert_eq!(json["results"].as_array().map(Vec::len), Some(5), "{json}");
        }
    }
}

/// A client that opens connections and sends nothing, part of a request head or part of a
/// body cannot hold them: each is answered or closed within the time limits, so that such
/// clients cannot take every file descriptor of the service (then every gateway's new
/// connection would wait, time out, and leave its requests to the failure policy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_send_no_whole_request_are_closed_in_time() {
    let rules = rule_file("slow");
    let mut config = config(&["--rules", rules.to_str().unwrap()]);
    config.http.header_timeout_ms = Some(300);
    config.http.body_timeout_ms = Some(300);
    let (addr, _task) = serve(config).await;
    // What the server sends on a connection after `sent`, until it closes it (or 10 s).
    let after = |sent: &'static [u8]| {
        blocking(move || {
            let mut stream = TcpStream::connect(addr).unwrap();
            stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            stream.write_all(sent).unwrap();
            let start = Instant::now();
            let mut raw = Vec::new();
            let _ = stream.read_to_end(&mut raw);
            (String::from_utf8_lossy(&raw).to_ascii_lowercase(), start.elapsed())
        })
    };
    for sent in [&b""[..], b"POST /api/ratelimit/check HTTP/1.1\r\nhost: t\r\n"] {
        let (answer, took) = after(sent).await;
        assert!(took < Duration::from_secs(5), "closed after {took:?}: {answer:?}");
        assert!(!answer.contains(" 200 "), "{answer}");
    }
    // A body that does not come: 408, the service's error.
    let (answer, took) = after(b"POST /api/ratelimit/check HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n{").await;
    assert!(took < Duration::from_secs(5), "answered after {took:?}: {answer:?}");
    assert!(answer.starts_with("http/1.1 408"), "{answer}");
    assert!(answer.contains("x-fluxgate-error: 1"), "{answer}");
    // A kept-alive connection is answered, then closed once idle for the head's time.
    let body = r#"{"ruleSetId": "api", "clientIp": "192.0.2.1", "path": "/orders/1"}"#;
    let request = format!(
        "POST /api/ratelimit/check HTTP/1.1\r\nhost: t\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let (answer, took) = after(Box::leak(request.into_bytes().into_boxed_slice())).await;
    assert!(answer.starts_with("http/1.1 200"), "{answer}");
    assert!(took < Duration::from_secs(5), "closed after {took:?}");
    // Whole requests are answered as before.
    let good = json!({"ruleSetId": "api", "clientIp": "192.0.2.1", "path": "/orders/1"});
    let answer = blocking(move || post(addr, "/api/ratelimit/check", &good)).await;
    assert_eq!((answer.status, answer.json()["remaining"].clone()), (200, json!(1)));
}

/// A client of `addr` with a receive buffer of 2 KB that has sent `requests` pipelined
/// requests for the 26 KB `/openapi.json` (far more answers than the sockets' buffers hold)
/// and reads nothing.
async fn unread_client(addr: SocketAddr, requests: usize) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(2048).unwrap();
    let mut stream = socket.connect(addr).await.unwrap();
    let sent = "GET /openapi.json HTTP/1.1\r\nhost: t\r\n\r\n".repeat(requests);
    stream.write_all(sent.as_bytes()).await.unwrap();
    stream
}

/// A client that sends whole requests and then reads nothing cannot hold its connection:
/// once the connection has taken no byte of an answer for `[http] write_timeout_ms`, it is
/// closed (hyper alone waited to write for good, no request head to time, and as many such
/// clients as the process's file descriptors locked every gateway out). Here 1,000 pipelined requests
/// of an [`unread_client`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_read_no_answer_are_closed_in_time() {
    use tokio::io::AsyncReadExt;
    const SENT: usize = 1_000;
    let rules = rule_file("unread");
    let mut config = config(&["--rules", rules.to_str().unwrap()]);
    config.http.header_timeout_ms = Some(300);
    config.http.write_timeout_ms = Some(300);
    let (addr, _task) = serve(config).await;
    let mut stream = unread_client(addr, SENT).await;
    // Five times the write timeout without reading.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let start = Instant::now();
    let mut raw = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut raw)).await;
    let answered = String::from_utf8_lossy(&raw).matches("HTTP/1.1 200").count();
    assert!(
        read.is_ok(),
        "still open after {:?} ({answered} answers read)",
        start.elapsed()
    );
    assert!(
        answered < SENT,
        "every answer was written: the connection waited for its reader ({:?})",
        read
    );
    // The service still answers others.
    let good = json!({"ruleSetId": "api", "clientIp": "192.0.2.1", "path": "/orders/1"});
    let answer = blocking(move || post(addr, "/api/ratelimit/check", &good)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
}

/// A shutdown waits for the answers in flight, and a client that reads nothing of its
/// answer holds it for the write time limit at most, not for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_nothing_holds_a_shutdown_for_the_write_time_limit_at_most() {
    let rules = rule_file("unread-shutdown");
    let mut config = config(&["--rules", rules.to_str().unwrap()]);
    config.http.write_timeout_ms = Some(300);
    let service = Service::start(&config).await.expect("the service starts");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        service
            .serve(listener, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    let stream = unread_client(addr, 1_000).await;
    // The server is writing (and waiting) when the shutdown comes.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let start = Instant::now();
    stop.send(()).unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(20), task).await;
    assert!(ended.is_ok(), "the shutdown still waits after {:?}", start.elapsed());
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "the shutdown took {:?} (the write time limit is 300 ms)",
        start.elapsed()
    );
    drop(stream);
}

/// A config file for a service whose rule sets live in `redis` with the admin API on (the
/// token [`TOKEN`]), the store holding rule set `api` (one rule of 100 per hour); `name`
/// tells the test's file apart.
async fn admin_config(redis: &RedisServer, name: &str) -> std::path::PathBuf {
    let store = fluxgate_redis::RedisRuleSetStore::connect(&redis.url()).await.unwrap();
    let spec: fluxgate_core::RuleSetSpec = serde_json::from_value(json!({
        "id": "api", "rules": [{"id": "per-ip", "bands": [{"capacity": 100, "window": "1h"}]}]
    }))
    .unwrap();
    store.put(&spec).await.unwrap();
    let file = std::env::temp_dir().join(format!("fluxgate-server-{}-{name}.toml", std::process::id()));
    std::fs::write(
        &file,
        format!(
            "redis = \"{}\"\n[store]\nenabled = true\n[admin]\ntoken = \"{TOKEN}\"\n",
            redis.url()
        ),
    )
    .unwrap();
    file
}

/// An admin call with the right token.
async fn admin_call(addr: SocketAddr, method: &'static str, path: &'static str, body: String) -> Answer {
    blocking(move || {
        let bearer = format!("Bearer {TOKEN}");
        call(addr, method, path, &[("authorization", &bearer)], body.as_bytes())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_puts_are_enforced_by_two_instances_and_need_the_token() {
    let redis = RedisServer::start();
    let file = admin_config(&redis, "admin").await;
    let config = || config(&["--config", file.to_str().unwrap()]);
    let (one, _a) = serve(config()).await;
    let (two, _b) = serve(config()).await;
    let tighter = json!({"id": "api", "rules": [{"id": "per-ip", "bands": [{"capacity": 2, "window": "1h"}]}]});

    // Without the token, or with a wrong one: 401, nothing stored.
    for auth in [None, Some("Bearer wrong-token-0123456789"), Some(TOKEN)] {
        let tighter = tighter.to_string();
        let answer = blocking(move || {
            let headers: Vec<(&str, &str)> = auth.map(|a| ("authorization", a)).into_iter().collect();
            call(one, "PUT", "/api/rulesets/api", &headers, tighter.as_bytes())
        })
        .await;
        assert_eq!(answer.status, 401, "{auth:?}: {}", answer.body);
        assert!(answer.headers.contains("www-authenticate: bearer"));
    }
    let limit = |addr: SocketAddr| {
        blocking(move || {
            post(
                addr,
                "/api/ratelimit/check",
                &json!({"ruleSetId": "api", "clientIp": "192.0.2.7"}),
            )
            .json()["limit"]
                .clone()
        })
    };
    assert_eq!(limit(one).await, 100);

    let put = Instant::now();
    let answer = admin_call(one, "PUT", "/api/rulesets/api", tighter.to_string()).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    loop {
        if limit(one).await == 2 && limit(two).await == 2 {
            break;
        }
        assert!(
            put.elapsed() < Duration::from_secs(1),
            "not enforced by both within 1 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!("admin put enforced by both instances after {:?}", put.elapsed());

    // An invalid rule set: 400 naming the problem, nothing stored.
    let invalid = json!({"id": "api", "rules": [{"id": "per-ip", "bands": [{"capacity": 0, "window": "1h"}]}]});
    let answer = admin_call(one, "PUT", "/api/rulesets/api", invalid.to_string()).await;
    assert_eq!(answer.status, 400, "{}", answer.body);
    assert!(
        answer.json()["error"].as_str().unwrap().contains("capacity"),
        "{}",
        answer.body
    );
    // Valid rules the service's engine refuses (a wait for the refill beyond what Redis
    // reserves exactly): 400 naming the rule, nothing stored, the limit in force unchanged.
    let unwaitable = json!({"id": "api", "rules": [
        {"id": "per-ip", "bands": [{"capacity": 1, "window": "1h"}]},
        {"id": "slow", "bands": [{"capacity": 999983, "window": "1h"}],
         "on_limit": {"wait": {"max_wait": "1h", "max_waiters": 1}}}]});
    let answer = admin_call(one, "PUT", "/api/rulesets/api", unwaitable.to_string()).await;
    assert_eq!(answer.status, 400, "{}", answer.body);
    assert!(
        answer.json()["error"].as_str().unwrap().contains("slow"),
        "{}",
        answer.body
    );
    assert_eq!(limit(one).await, 2);
    let mismatch = json!({"id": "other", "rules": []});
    let answer = admin_call(one, "PUT", "/api/rulesets/api", mismatch.to_string()).await;
    assert_eq!((answer.status, answer.json()["field"].clone()), (400, json!("id")));

    let answer = admin_call(two, "GET", "/api/rulesets", String::new()).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.json()[0]["rules"][0]["bands"][0]["capacity"], 2);
    let answer = admin_call(two, "GET", "/api/rulesets/missing", String::new()).await;
    assert_eq!(answer.status, 404);
    // The last rule set deleted: the store is empty, which the instances refuse to load
    // (`allow_empty` is off), so they keep `api` in force. Deleted, and said so.
    let answer = admin_call(two, "DELETE", "/api/rulesets/api", String::new()).await;
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert!(
        answer.json()["error"].as_str().unwrap().contains("names no rule set"),
        "{}",
        answer.body
    );
    assert_eq!(limit(one).await, 2, "still in force");
    let answer = admin_call(two, "GET", "/api/rulesets/api", String::new()).await;
    assert_eq!(answer.status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_are_off_without_a_token_and_refused_for_file_rules() {
    let rules = rule_file("admin-off");
    let (addr, _a) = serve(config(&["--rules", rules.to_str().unwrap()])).await;
    let answer = blocking(move || call(addr, "GET", "/api/rulesets", &[], b"")).await;
    assert_eq!(answer.status, 404);
    let (addr, _b) = serve(config(&["--rules", rules.to_str().unwrap(), "--admin-token", TOKEN])).await;
    // The scheme in any case, as HTTP's authentication schemes are.
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let auth = format!("{scheme}  {TOKEN}");
        let answer = blocking(move || call(addr, "GET", "/api/rulesets", &[("authorization", &auth)], b"")).await;
        assert_eq!(answer.status, 409, "{scheme}: {}", answer.body);
    }
    // Another scheme, or the token without one: 401.
    for auth in [format!("Basic {TOKEN}"), format!("Bearer{TOKEN}"), TOKEN.to_string()] {
        let answer = blocking(move || call(addr, "GET", "/api/rulesets", &[("authorization", &auth)], b"")).await;
        assert_eq!(answer.status, 401, "{}", answer.body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_redis_down_and_back() {
    let mut redis = RedisServer::start();
    let rules = rule_file("health");
    let (addr, _task) = serve(config(&["--rules", rules.to_str().unwrap(), "--redis", &redis.url()])).await;
    let health = move || blocking(move || call(addr, "GET", "/health", &[], b""));
    let up = health().await;
    assert_eq!(up.status, 200, "{}", up.body);
    assert_eq!(up.json()["backend"], "redis");
    assert!(up.json()["latencyMs"].as_f64().is_some());
    redis.kill();
    let down = health().await;
    assert_eq!(down.status, 503, "{}", down.body);
    assert_eq!(down.json()["status"], "down");
    redis.restart();
    let start = Instant::now();
    loop {
        let answer = health().await;
        if answer.status == 200 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "still down: {}", answer.body);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn the_openapi_document_in_the_repository_is_the_one_served() {
    let generated = fluxgate_server::openapi::json();
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("openapi.json");
    if std::env::var_os("FLUXGATE_WRITE_OPENAPI").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let kept = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        kept == generated,
        "crates/fluxgate-server/openapi.json is out of date: run `FLUXGATE_WRITE_OPENAPI=1 cargo test -p fluxgate-server --test api openapi`"
    );
    let document: Value = serde_json::from_str(&generated).unwrap();
    for path in [
        "/api/ratelimit/check",
        "/api/ratelimit/check/batch",
        "/api/rulesets/{id}",
        "/health",
        "/metrics",
    ] {
        assert!(document["paths"][path].is_object(), "{path} is documented");
    }
}

/// Starts the binary on a free port with `args`; answers it and its address.
fn spawn_binary(args: &[&str]) -> (std::process::Child, SocketAddr) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_fluxgate-server"))
        .args(args)
        .args(["--listen", &listen])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let addr: SocketAddr = listen.parse().unwrap();
    let start = Instant::now();
    while TcpStream::connect(addr).is_err() {
        assert!(start.elapsed() < Duration::from_secs(10), "the server did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    (child, addr)
}

/// The samples of a Prometheus text exposition: `(name{labels}, value)`; fails on a line
/// that is not a comment or a sample.
fn samples(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("not a sample: {line}"));
            let value: f64 = value.parse().unwrap_or_else(|_| panic!("not a value: {line}"));
            (series.to_owned(), value)
        })
        .collect()
}

#[test]
fn metrics_are_prometheus_text_and_count_the_checks_sent() {
    let rules = rule_file("metrics");
    let (mut child, addr) = spawn_binary(&["--rules", rules.to_str().unwrap()]);
    let request = json!({"ruleSetId": "api", "clientIp": "192.0.2.5", "path": "/orders/1"});
    for _ in 0..4 {
        assert_eq!(post(addr, "/api/ratelimit/check", &request).status, 200);
    }
    let unknown = json!({"ruleSetId": "attacker-chosen-id", "clientIp": "192.0.2.5"});
    assert_eq!(post(addr, "/api/ratelimit/check", &unknown).status, 200);
    let answer = call(addr, "GET", "/metrics", &[], b"");
    assert_eq!(answer.status, 200);
    assert!(
        answer.headers.contains("content-type: text/plain"),
        "{}",
        answer.headers
    );
    let samples = samples(&answer.body);
    let value = |series: &str| {
        samples
            .iter()
            .filter(|(s, _)| {
                s.starts_with("fluxgate_decisions_total{") && series.split(',').all(|part| s.contains(part))
            })
            .map(|(_, v)| v)
            .sum::<f64>()
    };
    assert_eq!(
        value(r#"rule_set="api",rule="orders",outcome="allowed""#),
        3.0,
        "{}",
        answer.body
    );
    assert_eq!(
        value(r#"rule_set="api",rule="orders",outcome="rejected""#),
        1.0,
        "{}",
        answer.body
    );
    assert!(
        !answer.body.contains("attacker-chosen-id"),
        "a client's id never becomes a label"
    );
    assert!(!answer.body.contains("192.0.2.5"), "nor an address");
    assert!(
        samples
            .iter()
            .any(|(s, _)| s.starts_with("fluxgate_backend_seconds_bucket")),
        "{}",
        answer.body
    );
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn sigterm_lets_the_checks_in_flight_finish() {
    let rules = rule_file("sigterm");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_fluxgate-server"))
        .args([
            "--rules",
            rules.to_str().unwrap(),
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let start = Instant::now();
    while TcpStream::connect(addr).is_err() {
        assert!(start.elapsed() < Duration::from_secs(10), "the server did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    // A check in flight: its head is sent, its body not yet.
    let body = json!({"ruleSetId": "api", "clientIp": "192.0.2.1", "path": "/orders/1"}).to_string();
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let head = format!(
        "POST /api/ratelimit/check HTTP/1.1\r\nhost: t\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    std::thread::sleep(Duration::from_millis(100));
    stream.write_all(body.as_bytes()).unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "the check in flight is answered: {answer:?}"
    );
    assert!(answer.contains("\"allowed\":true"), "{answer}");
    let status = child.wait().unwrap();
    assert!(status.success(), "the server exits cleanly: {status:?}");
    // And it no longer accepts connections.
    assert!(TcpStream::connect(addr).is_err());
}

/// An error answer names what is wrong and where, without the value it refuses: a body
/// of up to `[http] max_body_bytes` was answered with all of it (a string of 900,000
/// characters where a number belongs: 900,093 bytes; twice for a rule's unknown field).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_answers_do_not_echo_the_values_they_refuse() {
    let rules = rule_file("echo");
    let (addr, _task) = serve(config(&["--rules", rules.to_str().unwrap()])).await;
    let long = "A".repeat(900_000);
    let check = "/api/ratelimit/check";
    let cases = [
        (
            check,
            format!(r#"{{"permits": "{long}"}}"#),
            Some("permits"),
            "expected u64",
        ),
        (
            check,
            format!(r#"{{"maxWaitMs": "{long}"}}"#),
            Some("maxWaitMs"),
            "invalid type",
        ),
        (
            check,
            format!(r#"{{"attributes": {{"{long}": 1}}}}"#),
            None,
            "expected a string",
        ),
        (
            check,
            format!(r#"{{"ruleSetId": "{long}"}}"#),
            Some("ruleSetId"),
            "longer than 64",
        ),
        (
            "/api/ratelimit/check/batch",
            format!(r#"{{"requests": [{{"userId": "a"}}, {{"permits": "{long}"}}]}}"#),
            Some("requests[1].permits"),
            "expected u64",
        ),
    ];
    for (path, body, field, message) in cases {
        let answer = blocking(move || call(addr, "POST", path, &[], body.as_bytes())).await;
        assert_eq!(
            answer.status,
            400,
            "{path}: {}",
            &answer.body[..answer.body.len().min(300)]
        );
        assert!(answer.body.len() < 2_048, "{path}: {} bytes", answer.body.len());
        let error = answer.json();
        if let Some(field) = field {
            assert_eq!(error["field"].as_str(), Some(field), "{error}");
        } else {
            assert!(
                error["field"].as_str().unwrap().starts_with("attributes.AAAA"),
                "{error}"
            );
        }
        let text = error["error"].as_str().unwrap();
        assert!(text.contains(message), "{text}");
        if message.starts_with("expected") {
            // Where, at the end of the message: kept.
            assert!(text.contains("at line 1 column"), "{text}");
        }
    }
}

/// The same for the admin endpoints: a rule's unknown field, scope, pattern or window of
/// 900,000 characters is refused in an answer of less than 1 KiB that still names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_error_answers_do_not_echo_the_values_they_refuse() {
    let redis = RedisServer::start();
    let file = admin_config(&redis, "admin-echo").await;
    let (addr, _task) = serve(config(&["--config", file.to_str().unwrap()])).await;
    let long = "A".repeat(900_000);
    let band = json!([{"capacity": 1, "window": "1h"}]);
    let rule = |extra: Value| {
        let mut rule = json!({"id": "r", "bands": band});
        for (name, value) in extra.as_object().unwrap() {
            rule[name] = value.clone();
        }
        json!({"id": "api", "rules": [rule]}).to_string()
    };
    let cases = [
        (rule(json!({ long.clone(): 1 })), "expected one of `id`"),
        (rule(json!({"scope": long})), "expected one of `global`"),
        (
            rule(json!({"match": {"paths": [format!("/a/**{long}")]}})),
            "invalid path pattern `/a/**AAA",
        ),
        (
            json!({"id": "api", "rules": [{"id": "r", "bands": [{"capacity": 1, "window": long}]}]}).to_string(),
            "invalid duration",
        ),
    ];
    for (body, message) in cases {
        let answer = admin_call(addr, "PUT", "/api/rulesets/api", body).await;
        assert_eq!(answer.status, 400, "{}", &answer.body[..answer.body.len().min(300)]);
        assert!(answer.body.len() < 1_024, "{} bytes", answer.body.len());
        let text = answer.json()["error"].as_str().unwrap().to_owned();
        assert!(text.contains(message), "{text}");
    }
}
