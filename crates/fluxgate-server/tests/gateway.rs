//! The gateway: an axum app whose limits the service decides (`RemoteHandler`), over real
//! TCP on loopback: the service's "no" is a 429 with the headers, and a service that is down
//! follows the gateway's failure policy.

#![allow(missing_docs, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use fluxgate_core::{CircuitBreaker, FailurePolicy, FallbackHandler};
use fluxgate_server::{Config, Service};
use fluxgate_tower::remote::RemoteHandler;
use fluxgate_tower::RateLimitLayer;

/// The service on a runtime of its own, so that stopping it closes every connection
/// (kept-alive ones included): answers its address and what stops it.
fn service() -> (SocketAddr, std::sync::mpsc::Sender<()>) {
    service_with(
        "per-ip",
        "rule_sets: [{id: default, rules: [{id: per-ip, match: {paths: [\"/api/**\"]}, bands: [{capacity: 2, window: 1h, label: hourly}]}]}]",
    )
}

/// [`service`] deciding by `yaml`, its file named after `name`.
fn service_with(name: &str, yaml: &str) -> (SocketAddr, std::sync::mpsc::Sender<()>) {
    service_configured(name, yaml, "")
}

/// [`service_with`], its config file holding `toml`.
fn service_configured(name: &str, yaml: &str, toml: &str) -> (SocketAddr, std::sync::mpsc::Sender<()>) {
    let dir = std::env::temp_dir().join(format!("fluxgate-gateway-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rules = dir.join("rules.yaml");
    std::fs::write(&rules, yaml).unwrap();
    let config = dir.join("config.toml");
    std::fs::write(&config, toml).unwrap();
    let (ready, address) = std::sync::mpsc::channel();
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async {
            let config = Config::from_args([
                "--config".to_owned(),
                config.to_str().unwrap().to_owned(),
                "--rules".to_owned(),
                rules.to_str().unwrap().to_owned(),
            ])
            .unwrap();
            let service = Service::start(&config).await.unwrap();
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            ready.send(listener.local_addr().unwrap()).unwrap();
            tokio::spawn(async move { service.serve(listener, std::future::pending()).await.unwrap() });
        });
        let _ = stopped.recv();
        // Dropping the runtime ends every task and closes every socket.
        drop(runtime);
    });
    (address.recv().unwrap(), stop)
}

async fn gateway(service: SocketAddr, on_error: FailurePolicy) -> SocketAddr {
    let remote = RemoteHandler::builder(&format!("http://{service}"))
        .unwrap()
        .timeout(Duration::from_secs(2))
        .build();
    let layer = RateLimitLayer::builder(CircuitBreaker::new(remote))
        .on_error(on_error)
        .build()
        .unwrap();
    app(layer).await
}

/// The same app as [`gateway`]'s, its limits decided by a local engine on `yaml`.
async fn local(yaml: &str, on_error: FailurePolicy) -> SocketAddr {
    let engine = fluxgate_core::Engine::in_memory(fluxgate_core::RuleSets::from_yaml_str(yaml).unwrap());
    let layer = RateLimitLayer::builder(CircuitBreaker::new(engine))
        .on_error(on_error)
        .build()
        .unwrap();
    app(layer).await
}

/// The app behind `layer`, served on loopback.
async fn app(layer: RateLimitLayer) -> SocketAddr {
    let app = Router::new()
        .route("/api/hello", get(|| async { "hello\n" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
            .await
            .unwrap()
    });
    addr
}

/// `GET path` on a new connection: the status line and headers, lowercased.
async fn get_head(addr: SocketAddr, path: &'static str) -> String {
    exchange(
        addr,
        format!("GET {path} HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n"),
    )
    .await
}

/// `request` as it is on a new connection: the status line and headers, lowercased.
async fn exchange(addr: SocketAddr, request: String) -> String {
    let answer = answer(addr, request).await;
    answer.split("\r\n\r\n").next().unwrap_or("").to_ascii_lowercase()
}

/// `request` as it is on a new connection: the whole answer.
async fn answer(addr: SocketAddr, request: String) -> String {
    tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        answer
    })
    .await
    .unwrap()
}

/// A request the service would make wait for the refill longer than the gateway's
/// deadline is refused at once, rather than timed out and admitted early by `fail_open`
/// while the service still held its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_at_the_service_never_outlasts_the_gateways_deadline() {
    let (service_addr, _stop_service) = service_with(
        "waits",
        "rule_sets: [{id: default, rules: [{id: w, match: {paths: [\"/api/**\"]}, bands: [{capacity: 1, window: 2s}], \
         on_limit: {wait: {max_wait: 2s, max_waiters: 10}}}]}]",
    );
    // A deadline of 2 s: the service lets the request wait at most 1 s.
    let gateway = gateway(service_addr, FailurePolicy::FailOpen).await;
    let head = get_head(gateway, "/api/hello").await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    // The next would wait 2 s at the service.
    let head = get_head(gateway, "/api/hello").await;
    assert!(
        head.starts_with("http/1.1 429"),
        "refused at once, not admitted early: {head}"
    );
}

/// A 400 that is not the service's own error (a proxy on the way, a wrong base path) is a
/// failure of the service, which the failure policy decides, not a refusal of the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_400_from_something_else_than_the_service_follows_the_policy() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let not_the_service = listener.local_addr().unwrap();
    let proxy = Router::new().fallback(|| async { (axum::http::StatusCode::BAD_REQUEST, "<html>bad request</html>") });
    tokio::spawn(async move { axum::serve(listener, proxy).await.unwrap() });
    let closed = gateway(not_the_service, FailurePolicy::FailClosed).await;
    let head = get_head(closed, "/api/hello").await;
    assert!(
        head.starts_with("http/1.1 503"),
        "fail closed, as for a service down: {head}"
    );
    let open = gateway(not_the_service, FailurePolicy::FailOpen).await;
    let head = get_head(open, "/api/hello").await;
    assert!(head.starts_with("http/1.1 200"), "fail open: {head}");
}

/// Requests whose values the service bounds (a long user id) are decided and counted like
/// any other; requests with no rule of theirs (`OPTIONS *`) are decided; and a request the
/// service refuses to decide (a method of more than 32 characters) is refused, not
/// admitted uncounted, and none of them opens the circuit for everyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_the_service_bounds_are_counted_and_open_no_circuit() {
    let (service_addr, _stop_service) = service();
    let gateway = gateway(service_addr, FailurePolicy::FailOpen).await;
    let long_user = |path: &str| {
        format!(
            "GET {path} HTTP/1.1\r\nhost: t\r\nx-user-id: {}\r\nconnection: close\r\n\r\n",
            "u".repeat(5_000)
        )
    };
    for expected in ["200", "200", "429"] {
        let head = exchange(gateway, long_user("/api/hello")).await;
        assert!(head.starts_with(&format!("http/1.1 {expected}")), "{head}");
    }
    // Five answers in a row of each kind, with no decision between them: were they
    // failures, the circuit would open after three and fail open would admit the next
    // request.
    for _ in 0..5 {
        let head = exchange(
            gateway,
            "OPTIONS * HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n".to_owned(),
        )
        .await;
        assert!(!head.starts_with("http/1.1 5"), "decided, no failure: {head}");
    }
    let head = get_head(gateway, "/api/hello").await;
    assert!(
        head.starts_with("http/1.1 429"),
        "still limited, the circuit closed: {head}"
    );
    let method = "X".repeat(40);
    for _ in 0..5 {
        let head = exchange(
            gateway,
            format!("{method} /api/hello HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n"),
        )
        .await;
        assert!(
            head.starts_with("http/1.1 400"),
            "refused, never admitted uncounted: {head}"
        );
    }
    let head = get_head(gateway, "/api/hello").await;
    assert!(
        head.starts_with("http/1.1 429"),
        "still limited, the circuit closed: {head}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_services_no_is_a_429_with_the_headers_and_a_service_down_follows_the_policy() {
    let (service_addr, stop_service) = service();
    let open = gateway(service_addr, FailurePolicy::FailOpen).await;
    let closed = gateway(service_addr, FailurePolicy::FailClosed).await;

    for remaining in ["1", "0"] {
        let head = get_head(open, "/api/hello").await;
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(head.contains("x-ratelimit-limit: 2"), "{head}");
        assert!(head.contains(&format!("x-ratelimit-remaining: {remaining}")), "{head}");
        assert!(head.contains("ratelimit-policy:"), "the IETF headers too: {head}");
    }
    let head = get_head(open, "/api/hello").await;
    assert!(head.starts_with("http/1.1 429"), "{head}");
    let retry: u64 = head
        .lines()
        .find_map(|l| l.strip_prefix("retry-after: "))
        .and_then(|v| v.trim().parse().ok())
        .expect("a retry-after");
    assert!(
        (1700..=1800).contains(&retry),
        "about 30 min for one permit of 2/h: {retry}"
    );
    assert!(head.contains("x-ratelimit-remaining: 0"), "{head}");

    // The service goes away: fail open admits, fail closed answers 503.
    stop_service.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let head = get_head(open, "/api/hello").await;
    assert!(head.starts_with("http/1.1 200"), "fail open: {head}");
    assert!(!head.contains("x-ratelimit-limit"), "no decision, no headers: {head}");
    let head = get_head(closed, "/api/hello").await;
    assert!(head.starts_with("http/1.1 503"), "fail closed: {head}");
}

/// With the service's rules in a local engine (`FallbackHandler`), a gateway whose service
/// stops answering keeps limiting, per instance: not every request admitted (`fail_open`),
/// nor every one refused (`fail_closed`). The local engine was charged with what the
/// service admitted through this gateway: it gives the client the rest of its limit, not a
/// full one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_with_the_rules_keeps_limiting_while_the_service_fails() {
    let yaml = "rule_sets: [{id: default, rules: [{id: per-ip, match: {paths: [\"/api/**\"]}, bands: [{capacity: 2, window: 1h}]}]}]";
    let (service_addr, stop_service) = service_with("fallback", yaml);
    let remote = RemoteHandler::builder(&format!("http://{service_addr}"))
        .unwrap()
        .timeout(Duration::from_secs(2))
        .build();
    let local = fluxgate_core::Engine::in_memory(fluxgate_core::RuleSets::from_yaml_str(yaml).unwrap());
    let handler = FallbackHandler::new(CircuitBreaker::new(remote), local);
    let layer = RateLimitLayer::builder(handler)
        .on_error(FailurePolicy::FailOpen)
        .build()
        .unwrap();
    let gateway = app(layer).await;
    // The service decides while it answers: one of the client's 2.
    let head = get_head(gateway, "/api/hello").await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("x-ratelimit-remaining: 1"), "{head}");
    stop_service.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Then the local engine, charged with the service's admission: the one left, with the
    // headers, and no more.
    let head = get_head(gateway, "/api/hello").await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("x-ratelimit-remaining: 0"), "{head}");
    for _ in 0..5 {
        let head = get_head(gateway, "/api/hello").await;
        assert!(head.starts_with("http/1.1 429"), "the local limit holds: {head}");
    }
}

/// A local engine without the request's rule set decides nothing for it: while the service
/// fails, the request follows the layer's `on_error` (here 503), not the local engine's
/// `UnknownRuleSet::Allow`, which would admit it unlimited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_set_the_local_engine_lacks_follows_the_policy_while_the_service_fails() {
    let yaml = "rule_sets: [{id: default, rules: [{id: per-ip, bands: [{capacity: 2, window: 1h}]}]}]";
    let (service_addr, stop_service) = service_with("fallback-other", yaml);
    let remote = RemoteHandler::builder(&format!("http://{service_addr}"))
        .unwrap()
        .timeout(Duration::from_secs(2))
        .build();
    let other = "rule_sets: [{id: other, rules: [{id: per-ip, bands: [{capacity: 2, window: 1h}]}]}]";
    let local = fluxgate_core::Engine::in_memory(fluxgate_core::RuleSets::from_yaml_str(other).unwrap());
    let layer = RateLimitLayer::builder(FallbackHandler::new(CircuitBreaker::new(remote), local))
        .on_error(FailurePolicy::FailClosed)
        .build()
        .unwrap();
    let gateway = app(layer).await;
    let head = get_head(gateway, "/api/hello").await;
    assert!(head.starts_with("http/1.1 200"), "the service decides: {head}");
    stop_service.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    for _ in 0..3 {
        let head = get_head(gateway, "/api/hello").await;
        assert!(
            head.starts_with("http/1.1 503"),
            "fail closed, not admitted unlimited: {head}"
        );
    }
}

/// A limiter that cannot decide any rule it is given, found when a request comes (as a
/// rule set an engine never validated is): a configuration error.
#[derive(Debug)]
struct CannotDecide;

impl fluxgate_core::RateLimiter for CannotDecide {
    fn acquire(
        &self,
        request: &fluxgate_core::limiter::AcquireRequest,
    ) -> fluxgate_core::MaybeReady<Result<fluxgate_core::limiter::AcquireOutcome, fluxgate_core::BoxError>> {
        let rule = &request.rule_set().rules()[0];
        fluxgate_core::MaybeReady::ready(Err(Box::new(fluxgate_core::RuleError::Unsupported {
            backend: "test",
            rule_set: request.rule_set().id().to_string(),
            rule: rule.id().to_string(),
            band: "b0".to_owned(),
            message: "no rule is decided here".to_owned(),
        })))
    }
}

/// The service's 500 for a rule it cannot decide is a configuration error at the gateway
/// too: refused whatever the failure policy (never admitted uncounted by `fail_open`), and
/// no failure of the service, so the circuit stays closed for the requests it decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_the_service_cannot_decide_is_refused_whatever_the_policy() {
    let rules = fluxgate_core::RuleSets::from_yaml_str(
        "rule_sets: [{id: default, rules: [{id: broken, match: {paths: [\"/api/**\"]}, bands: [{capacity: 5, window: 1h}]}]}]",
    )
    .unwrap();
    let engine = fluxgate_core::Engine::builder(fluxgate_core::StaticRuleSetProvider::new(rules))
        .limiter(CannotDecide)
        .build()
        .expect("the engine is built: the limiter validates nothing");
    let state = std::sync::Arc::new(fluxgate_server::AppState {
        engine,
        redis: None,
        admin: None,
        admin_token: None,
        max_batch: 100,
        max_body_bytes: 64 * 1024,
        metrics: None,
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let service_addr = listener.local_addr().unwrap();
    let service = fluxgate_server::router(state);
    tokio::spawn(async move { axum::serve(listener, service).await.unwrap() });

    for policy in [FailurePolicy::FailOpen, FailurePolicy::FailClosed] {
        let gateway = gateway(service_addr, policy).await;
        // More than the breaker's failures in a row, each refused as misconfigured: not
        // admitted by fail_open, not a 503 of fail_closed.
        for _ in 0..5 {
            let head = get_head(gateway, "/api/hello").await;
            assert!(head.starts_with("http/1.1 500"), "{policy:?}: {head}");
        }
        // A request without a rule is still decided by the service and routed (an open
        // circuit would answer 503 with fail_closed).
        let head = get_head(gateway, "/hello").await;
        assert!(head.starts_with("http/1.1 404"), "{policy:?}: {head}");
    }
}

/// A 400 or 500 with a JSON error that does not come from the service (a proxy's, another
/// framework's) is a failure of the service, which the failure policy decides: only the
/// service's own errors (marked, or a 400 of exactly its fields) refuse the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_error_from_something_else_than_the_service_follows_the_policy() {
    use axum::http::StatusCode;
    let cases = [
        (StatusCode::BAD_REQUEST, r#"{"error": "Bad Request", "status": 400}"#),
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            r#"{"error": "Internal Server Error", "status": 500}"#,
        ),
        (StatusCode::INTERNAL_SERVER_ERROR, r#"{"error": "Bad Gateway"}"#),
    ];
    for (status, body) in cases {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let not_the_service = listener.local_addr().unwrap();
        let proxy =
            Router::new().fallback(move || async move { (status, [("content-type", "application/json")], body) });
        tokio::spawn(async move { axum::serve(listener, proxy).await.unwrap() });
        let open = gateway(not_the_service, FailurePolicy::FailOpen).await;
        let head = get_head(open, "/api/hello").await;
        assert!(head.starts_with("http/1.1 200"), "{status} {body}, fail open: {head}");
        let closed = gateway(not_the_service, FailurePolicy::FailClosed).await;
        let head = get_head(closed, "/api/hello").await;
        assert!(head.starts_with("http/1.1 503"), "{status} {body}, fail closed: {head}");
    }
}

/// The status of each request, in order, each on a new connection.
async fn statuses(addr: SocketAddr, requests: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for request in requests {
        let head = exchange(addr, request.clone()).await;
        out.push(head.get(9..12).unwrap_or(&head).to_owned());
    }
    out
}

const PER_USER: &str = "rule_sets: [{id: default, rules: [{id: per-user, match: {paths: [\"/api/**\"]}, \
     scope: user, on_missing_key: skip, bands: [{capacity: 2, window: 1h}]}]}]";

/// A user id longer than the service takes goes as its digest, `~sha256:…`; a client that
/// sends that text itself is another user, as with a local engine: it neither spends the
/// long id's permits nor shares its counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_written_as_a_digest_shares_no_counter_with_the_long_value() {
    let long = "u".repeat(5_000);
    let digest = fluxgate_core::api::CheckRequest::from_context(
        &fluxgate_core::RequestContext::builder().user_id(long.clone()).build(),
    )
    .user_id
    .unwrap();
    assert!(digest.starts_with("~sha256:"), "{digest}");
    let as_user =
        |user: &str| format!("GET /api/hello HTTP/1.1\r\nhost: t\r\nx-user-id: {user}\r\nconnection: close\r\n\r\n");
    // The digest's writer twice, then the long id's owner twice: two users, two counters.
    let requests = [as_user(&digest), as_user(&digest), as_user(&long), as_user(&long)];
    let (service_addr, _stop_service) = service_with("digest", PER_USER);
    let through_gateway = statuses(gateway(service_addr, FailurePolicy::FailOpen).await, &requests).await;
    let locally = statuses(local(PER_USER, FailurePolicy::FailOpen).await, &requests).await;
    assert_eq!(locally, ["200", "200", "200", "200"]);
    assert_eq!(through_gateway, locally, "the gateway counts as the local engine does");
}

/// A user id sent twice with different values names no counter: refused (`400`) by the
/// rule that counts by it, at the service as with a local engine, whatever the gateway's
/// failure policy; neither a second quota nor a `fail_open` admission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_user_header_is_refused_as_by_a_local_engine() {
    let as_users = |users: &[&str]| {
        let lines: String = users.iter().map(|user| format!("x-user-id: {user}\r\n")).collect();
        format!("GET /api/hello HTTP/1.1\r\nhost: t\r\n{lines}connection: close\r\n\r\n")
    };
    let requests = [
        as_users(&["alice"]),
        as_users(&["alice", "forged-1"]),
        as_users(&["forged-2", "alice"]),
        as_users(&["alice", "alice"]),
        as_users(&["alice"]),
    ];
    let (service_addr, _stop_service) = service_with("repeated-user", PER_USER);
    let through_gateway = statuses(gateway(service_addr, FailurePolicy::FailOpen).await, &requests).await;
    let locally = statuses(local(PER_USER, FailurePolicy::FailOpen).await, &requests).await;
    assert_eq!(locally, ["200", "400", "400", "200", "429"]);
    assert_eq!(through_gateway, locally, "the gateway decides as the local engine does");
}

/// A service whose bodies are bounded lower than a check can be (`[http] max_body_bytes`,
/// a bound that a service of an earlier release started with) would answer a long path's
/// check with 413: a failure of the service, which `fail_open` admits uncounted and which
/// opens the circuit for every client. Such a bound still starts the service, raised to
/// the largest check.
#[test]
fn a_body_bound_below_the_largest_check_is_raised() {
    let dir = std::env::temp_dir().join(format!("fluxgate-gateway-{}-small-body", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rules = dir.join("rules.yaml");
    std::fs::write(&rules, PER_USER).unwrap();
    let config = dir.join("config.toml");
    let with = |bytes: usize| {
        std::fs::write(&config, format!("[http]\nmax_body_bytes = {bytes}\n")).unwrap();
        Config::from_args([
            "--config".to_owned(),
            config.to_str().unwrap().to_owned(),
            "--rules".to_owned(),
            rules.to_str().unwrap().to_owned(),
        ])
    };
    let small = with(64 * 1024).expect("an earlier release's bound still starts the service");
    assert_eq!(small.max_body_bytes(), fluxgate_core::api::MAX_CHECK_BYTES);
    let large = with(4 * fluxgate_core::api::MAX_CHECK_BYTES).unwrap();
    assert_eq!(large.max_body_bytes(), 4 * fluxgate_core::api::MAX_CHECK_BYTES);
}

/// The longest path a request can have, decided at the service as with a local engine:
/// the check describing it is within the body bound the service takes, even where
/// `[http] max_body_bytes` is set lower (an earlier release's 64 KiB). Past
/// `LONGEST_MATCHED_PATH`, a rule set whose rules match paths refuses it (`400`) on both
/// sides, and counts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_longest_paths_are_counted_as_by_a_local_engine() {
    const PER_IP: &str = "rule_sets: [{id: default, rules: [{id: per-ip, match: {paths: [\"/api/**\"]}, \
         bands: [{capacity: 2, window: 1h}]}]}]";
    // `\` and `"` take two bytes each in JSON: the longest body a path makes.
    let long = format!("/api/{}", "\\\"".repeat(32_700));
    let request = format!("GET {long} HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n");
    let hello = "GET /api/hello HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n".to_owned();
    let requests = [
        request.clone(),
        request.clone(),
        request.clone(),
        request.clone(),
        request,
        hello,
    ];
    let (service_addr, _stop_service) = service_configured(
        "long-path",
        PER_IP,
        &format!("[http]\nmax_body_bytes = {}\n", 64 * 1024),
    );
    let through_gateway = statuses(gateway(service_addr, FailurePolicy::FailOpen).await, &requests).await;
    let locally = statuses(local(PER_IP, FailurePolicy::FailOpen).await, &requests).await;
    assert_eq!(locally, ["400", "400", "400", "400", "400", "200"]);
    assert_eq!(through_gateway, locally, "the gateway decides as the local engine does");
}

/// A TCP relay to `upstream` that can be cut: while `down` holds, every connection through
/// it is closed, those open included. Answers its address and `down`.
async fn relay(upstream: SocketAddr) -> (SocketAddr, tokio::sync::watch::Sender<bool>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (down, watch) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                return;
            };
            let mut watch = watch.clone();
            tokio::spawn(async move {
                if *watch.borrow_and_update() {
                    return;
                }
                let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await else {
                    return;
                };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                    _ = watch.wait_for(|down| *down) => {}
                }
            });
        }
    });
    (addr, down)
}

/// What a gateway's local engine admits while the service fails, the service counts when it
/// answers again: the gateway replays those requests to it before the next one that counts
/// in the same bucket, on any path. A client of 3 per hour: 1 admitted by the service, 2 by
/// the local engine while the service cannot be reached, then none: not 2 more from the
/// service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_gateways_local_engine_admitted_the_service_counts_when_it_answers_again() {
    let yaml = "rule_sets: [{id: default, rules: [{id: per-ip, match: {paths: [\"/api/**\"]}, bands: [{capacity: 3, window: 1h}]}]}]";
    let (service_addr, _stop_service) = service_with("replayed", yaml);
    let (relayed, down) = relay(service_addr).await;
    let remote = RemoteHandler::builder(&format!("http://{relayed}"))
        .unwrap()
        .timeout(Duration::from_secs(2))
        .build();
    let local = fluxgate_core::Engine::in_memory(fluxgate_core::RuleSets::from_yaml_str(yaml).unwrap());
    let breaker = CircuitBreaker::new(remote).cool_down(Duration::from_millis(100));
    let layer = RateLimitLayer::builder(FallbackHandler::new(breaker, local))
        .on_error(FailurePolicy::FailOpen)
        .build()
        .unwrap();
    let gateway = app(layer).await;
    let head = get_head(gateway, "/api/hello").await;
    assert!(head.contains("x-ratelimit-remaining: 2"), "the service: {head}");
    down.send(true).unwrap();
    let mut local = 0;
    for _ in 0..5 {
        if get_head(gateway, "/api/hello").await.starts_with("http/1.1 200") {
            local += 1;
        }
    }
    assert_eq!(local, 2, "the local engine admits the rest of 3");
    down.send(false).unwrap();
    // The service's own count, asked directly for the gateway's client (127.0.0.1): a
    // refusal consumes nothing.
    let service_says = || {
        let body = r#"{"clientIp": "127.0.0.1", "path": "/api/hello"}"#;
        answer(
            service_addr,
            format!(
                "POST /api/ratelimit/check HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            ),
        )
    };
    let start = std::time::Instant::now();
    let mut admitted_after = 0;
    loop {
        // Past the circuit's cool-down: the gateway asks the service again, for another
        // path of the same client (a 404 of the router when admitted).
        tokio::time::sleep(Duration::from_millis(150)).await;
        if !get_head(gateway, "/api/other").await.starts_with("http/1.1 429") {
            admitted_after += 1;
        }
        let full = service_says().await;
        if full.contains("\"remaining\":0") || start.elapsed() > Duration::from_secs(10) {
            println!(
                "after {:?}: the service answers {full}, the gateway admitted {admitted_after} more",
                start.elapsed()
            );
            assert!(full.contains("\"allowed\":false"), "the service counted 3: {full}");
            break;
        }
    }
    assert_eq!(admitted_after, 0, "3 in all, not 3 more");
}

/// A rule store with a pool of 4 connections and 5 ms per lookup, the tenants `acme` and
/// `globex` (5 per hour per address each).
#[derive(Debug)]
struct PooledStore {
    sets: fluxgate_core::RuleSets,
    pool: std::sync::Arc<tokio::sync::Semaphore>,
}

impl fluxgate_core::RuleSetProvider for PooledStore {
    fn rule_set(&self, id: &str) -> fluxgate_core::MaybeReady<fluxgate_core::RuleSetLookup> {
        let found = self.sets.get(id).cloned();
        let pool = self.pool.clone();
        fluxgate_core::MaybeReady::boxed(async move {
            match tokio::time::timeout(Duration::from_millis(50), pool.acquire()).await {
                Ok(Ok(_connection)) => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    Ok(found)
                }
                _ => Err("rule store: no connection of its pool in time".into()),
            }
        })
    }
}

/// A service built on `fluxgate_server::router` whose engine looks rule sets up through
/// `provider`, refusing unknown ids, behind a gateway (`RemoteHandler` of `deadline` in a
/// circuit breaker, `fail_open`) that takes the rule set from `X-Tenant`: the gateway's
/// address.
async fn tenant_gateway(provider: impl fluxgate_core::RuleSetProvider, deadline: Duration) -> SocketAddr {
    let engine = fluxgate_core::Engine::builder(provider)
        .unknown_rule_set(fluxgate_core::UnknownRuleSet::Deny)
        .build()
        .unwrap();
    let state = fluxgate_server::AppState {
        engine,
        redis: None,
        admin: None,
        admin_token: None,
        max_batch: 100,
        max_body_bytes: 1 << 20,
        metrics: None,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let service = listener.local_addr().unwrap();
    let router = fluxgate_server::router(std::sync::Arc::new(state));
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let remote = RemoteHandler::builder(&format!("http://{service}"))
        .unwrap()
        .timeout(deadline)
        .build();
    let layer = RateLimitLayer::builder(CircuitBreaker::new(remote))
        .customizer(|ctx, parts| {
            if let Some(tenant) = parts.headers.get("x-tenant").and_then(|v| v.to_str().ok()) {
                ctx.set_rule_set_id(tenant);
            }
        })
        .build()
        .unwrap();
    app(layer).await
}

/// `GET /api/hello` of `tenant` (`X-Tenant`) on a new connection: the status code.
async fn status_of_tenant(addr: SocketAddr, tenant: String) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET /api/hello HTTP/1.1\r\nhost: t\r\nx-tenant: {tenant}\r\nconnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer).await;
    let text = String::from_utf8_lossy(&answer);
    text.split(' ').nth(1).and_then(|code| code.parse().ok()).unwrap_or(0)
}

/// A service built on `fluxgate_server::router` whose engine looks rule sets up through a
/// `CachingRuleSetProvider` (its lookup timeout below the gateway's deadline), refusing
/// unknown ids, behind a gateway (`RemoteHandler` in a circuit breaker, `fail_open`) that
/// takes the rule set from `X-Tenant`. A flood of made-up ids
/// made the service answer late or `503`, which the gateway read as the service's failure:
/// its `fail_open` admitted 89 to 149 of 200 uncounted, and a real tenant looked up during
/// the flood was admitted up to 20 times under a limit of 5. The service now answers a
/// request whose rule set was not looked up in time with a `503` marked `overloaded`, which
/// the gateway refuses whatever its failure policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_rule_set_ids_through_a_gateway_stay_refused() {
    const TENANTS: &str = "rule_sets: [{id: acme, rules: [{id: per-ip, bands: [{capacity: 5, window: 1h}]}]}, \
                           {id: globex, rules: [{id: per-ip, bands: [{capacity: 5, window: 1h}]}]}]";
    let store = PooledStore {
        sets: fluxgate_core::RuleSets::from_yaml_str(TENANTS).unwrap(),
        pool: std::sync::Arc::new(tokio::sync::Semaphore::new(4)),
    };
    let provider = fluxgate_core::CachingRuleSetProvider::builder(store)
        .max_lookups(4)
        .lookup_timeout(Duration::from_millis(30))
        .build();
    // A deadline far beyond the service's lookup timeout, so that a busy machine makes
    // no check late: what the gateway reads is the service's answer.
    let gateway = tenant_gateway(provider, Duration::from_secs(2)).await;
    assert_eq!(
        status_of_tenant(gateway, "made-up-0".into()).await,
        429,
        "Deny, one at a time"
    );
    let flood: Vec<_> = (0..200)
        .map(|i| tokio::spawn(status_of_tenant(gateway, format!("flood-{i:05}"))))
        .collect();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let tenant: Vec<_> = (0..20)
        .map(|_| tokio::spawn(status_of_tenant(gateway, "globex".into())))
        .collect();
    let mut globex = Vec::new();
    for task in tenant {
        globex.push(task.await.unwrap());
    }
    let mut statuses = Vec::new();
    for task in flood {
        statuses.push(task.await.unwrap());
    }
    let count = |statuses: &[u16], code: u16| statuses.iter().filter(|&&s| s == code).count();
    assert_eq!(count(&statuses, 200), 0, "made-up ids admitted: {statuses:?}");
    assert_eq!(count(&statuses, 429) + count(&statuses, 503), 200, "{statuses:?}");
    assert!(count(&statuses, 503) > 0, "some not looked up in time: {statuses:?}");
    assert!(count(&globex, 200) <= 5, "globex: {globex:?}");
}

/// A rule store that answers every lookup after 400 ms: `acme`, 2 per hour per address.
#[derive(Debug)]
struct SlowStore(fluxgate_core::RuleSets);

impl fluxgate_core::RuleSetProvider for SlowStore {
    fn rule_set(&self, id: &str) -> fluxgate_core::MaybeReady<fluxgate_core::RuleSetLookup> {
        let found = self.0.get(id).cloned();
        fluxgate_core::MaybeReady::boxed(async move {
            tokio::time::sleep(Duration::from_millis(400)).await;
            Ok(found)
        })
    }
}

/// A request that waited for its turn to look its rule set up has what is left of the
/// lookup timeout, counted from its arrival, not the whole timeout again: the service
/// answers it within that timeout, marked `overloaded` when its time went in the queue,
/// and the gateway refuses it. Before, such a request could take twice the timeout, and its
/// lookup's timeout was the source's failure (an unmarked `503`): a made-up id under
/// `UnknownRuleSet::Deny` was admitted by the gateway's `fail_open`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_waited_for_a_lookup_is_answered_within_the_lookup_timeout() {
    let store = SlowStore(
        fluxgate_core::RuleSets::from_yaml_str(
            "rule_sets: [{id: acme, rules: [{id: per-ip, bands: [{capacity: 2, window: 1h}]}]}]",
        )
        .unwrap(),
    );
    let provider = fluxgate_core::CachingRuleSetProvider::builder(store)
        .max_lookups(1)
        .lookup_timeout(Duration::from_millis(450))
        .build();
    // A deadline above the lookup timeout (with room for a busy machine) and below twice
    // it, where an answer came before.
    let gateway = tenant_gateway(provider, Duration::from_millis(700)).await;
    // One lookup at a time, 400 ms each: the first is looked up (unknown: 429); the two
    // sent 10 and 20 ms later get their turns after most of their 450 ms has gone, and are
    // answered `overloaded` when it has (before, after up to 800 ms, past the gateway's
    // deadline).
    let tasks: Vec<_> = (0..3u64)
        .map(|i| {
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(10 * i)).await;
                status_of_tenant(gateway, format!("made-up-{i}")).await
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.unwrap());
    }
    assert!(!statuses.contains(&200), "a made-up id admitted: {statuses:?}");
    assert!(statuses.iter().all(|s| [429, 503].contains(s)), "{statuses:?}");
}
