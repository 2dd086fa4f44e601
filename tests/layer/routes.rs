//! The rules against the router: many request targets, random and hostile, are sent through
//! a real axum `Router` with routes of every kind (static, parameters, wildcards, nested
//! routers, `nest_service`, `route_service`, trailing-slash variants, method routers, a
//! nested and a top-level fallback), each handler answering with its name, and each with
//! the rule a user would write for its route. Whenever a handler runs, the rule written for
//! it must have counted the request: a target that reaches a handler its rule does not
//! count is a way around the limiter.
//!
//! The rule for a route is its path with each parameter (`{id}`) written `*` and a
//! wildcard (`{*rest}`) written `**`, and the route's methods: `/api/users/{id}` is
//! `/api/users/*` for `GET`, `/files/{*path}` is `/files/**`, a router nested at `/static`
//! is `/static/**`, the fallback is `/**` (as in docs/configuration.md's examples); a route
//! that ends in `/` keeps it (`/items/{id}/` is `/items/*/`).
//!
//! The targets come from a fixed seed; `FLUXGATE_ROUTES_SEED=<n> FLUXGATE_ROUTES_CASES=<n>
//! cargo test --test layer routes` searches further. This test found the routed view
//! missing a trailing `/`: `/items//` and `/items/../` ran `/items/{id}/` uncounted
//! (`a_parameter_before_a_trailing_slash_cannot_walk_around_its_rule`,
//! `an_included_route_ending_in_a_slash_is_limited_for_every_parameter`). The same targets
//! also go through the layer placed outside tower-http's `NormalizePathLayer`, which trims
//! the runs of `/` at both ends of the path before the router sees it.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::Router;
use fluxgate::core::{Decision, RateLimitMetricsRecorder};
use fluxgate::tower::RateLimitLayer;
use http::{Method, Request, Uri};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::util::BoxCloneSyncService;
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_http::normalize_path::NormalizePathLayer;

use crate::serve;
use crate::support::rng::Rng;

/// The header each handler names itself in (the body is dropped for `HEAD`).
const HANDLER: &str = "x-handler";

fn reply(name: &'static str) -> Response {
    ([(HANDLER, name)], name).into_response()
}

/// A handler answering with its name.
fn named(name: &'static str) -> impl Fn() -> std::future::Ready<Response> + Clone + Send + Sync + 'static {
    move || std::future::ready(reply(name))
}

/// A service answering with its name, for `nest_service` and `route_service`.
fn service(
    name: &'static str,
) -> impl tower::Service<
    Request<Body>,
    Response = Response,
    Error = Infallible,
    Future = std::future::Ready<Result<Response, Infallible>>,
> + Clone
       + Send
       + Sync
       + 'static {
    service_fn(move |_: Request<Body>| std::future::ready(Ok(reply(name))))
}

/// Each handler: its name (also its rule's id), the pattern a user would write for its
/// route, and the methods its rule names (none: every method).
const RULES: &[(&str, &str, &[&str])] = &[
    ("root", "/", &["GET"]),
    ("login_form", "/login", &["GET"]),
    ("login", "/login", &["POST"]),
    ("health", "/health", &["GET"]),
    ("files", "/files/**", &["GET"]),
    ("docs", "/docs", &["GET"]),
    ("docs_slash", "/docs/", &["GET"]),
    ("item", "/items/*", &["GET"]),
    ("item_slash", "/items/*/", &["GET"]),
    ("webhook", "/webhook", &[]),
    ("ws", "/ws", &[]),
    ("static", "/static/**", &[]),
    ("tenant", "/tenants/*", &["GET"]),
    ("tenant_orders", "/tenants/*/orders", &["GET", "POST"]),
    ("users_list", "/api/users", &["GET"]),
    ("users_create", "/api/users", &["POST"]),
    ("users_me", "/api/users/me", &["GET"]),
    ("user_get", "/api/users/*", &["GET"]),
    ("user_delete", "/api/users/*", &["DELETE"]),
    ("user_post", "/api/users/*/posts/*", &["GET"]),
    ("api_login", "/api/*/login", &["POST"]),
    ("api_fallback", "/api/**", &[]),
    ("admin_home", "/admin", &["GET"]),
    ("admin_settings", "/admin/settings", &["GET", "PUT"]),
    ("about", "/*/about", &["GET"]),
    ("report", "/reports/*/*", &["GET"]),
    ("fallback", "/**", &[]),
];

/// The application: the routes of `RULES`, the layer on the outermost router.
fn routes() -> Router {
    let api = Router::new()
        .route("/users", get(named("users_list")).post(named("users_create")))
        .route("/users/me", get(named("users_me")))
        .route("/users/{id}", get(named("user_get")).delete(named("user_delete")))
        .route("/users/{id}/posts/{post}", get(named("user_post")))
        .route("/{version}/login", post(named("api_login")))
        .fallback(named("api_fallback"));
    let tenant = Router::new()
        .route("/", get(named("tenant")))
        .route("/orders", get(named("tenant_orders")).post(named("tenant_orders")));
    let admin = Router::new()
        .route("/", get(named("admin_home")))
        .route("/settings", get(named("admin_settings")).put(named("admin_settings")));
    Router::new()
        .route("/", get(named("root")))
        .route("/login", get(named("login_form")).post(named("login")))
        .route("/health", get(named("health")))
        .route("/files/{*path}", get(named("files")))
        .route("/docs", get(named("docs")))
        .route("/docs/", get(named("docs_slash")))
        .route("/items/{id}", get(named("item")))
        .route("/items/{id}/", get(named("item_slash")))
        .route("/webhook", any(named("webhook")))
        .route_service("/ws", service("ws"))
        .nest_service("/static", service("static"))
        .nest("/tenants/{tenant}", tenant)
        .nest("/api", api)
        .nest("/admin", admin)
        .merge(
            Router::new()
                .route("/{lang}/about", get(named("about")))
                .route("/reports/{year}/{month}", get(named("report"))),
        )
        .fallback(named("fallback"))
}

/// The rules of `RULES`, each with a capacity no test reaches, counted globally.
fn rules_yaml() -> String {
    let mut yaml = String::from("rule_sets:\n  - id: default\n    rules:\n");
    for (name, pattern, methods) in RULES {
        let methods = match methods {
            [] => String::new(),
            m => format!(", methods: [{}]", m.join(", ")),
        };
        yaml.push_str(&format!(
            "      - {{ id: {name}, scope: global, match: {{ paths: [\"{pattern}\"]{methods} }}, \
             bands: [{{ capacity: 1000000000, window: 1h }}] }}\n"
        ));
    }
    yaml
}

/// The rules that counted each decision since the last `take`.
#[derive(Debug, Default)]
struct Counted(Mutex<Vec<String>>);

impl RateLimitMetricsRecorder for Counted {
    fn record_decision(&self, decision: &Decision) {
        let mut counted = self.0.lock().unwrap_or_else(|e| e.into_inner());
        counted.extend(decision.bands.iter().map(|b| b.rule.as_str().to_owned()));
    }
}

impl Counted {
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// The layer (with `exclude` and `include` patterns) and what its rules count.
fn limiter(exclude: &[&str], include: &[&str]) -> (RateLimitLayer, Arc<Counted>) {
    let counted = Arc::new(Counted::default());
    let engine = super::builder(&rules_yaml())
        .recorder(counted.clone())
        .build()
        .expect("the in-memory limiter decides every rule");
    let mut layer = RateLimitLayer::builder(engine);
    if !exclude.is_empty() {
        layer = layer.exclude(exclude.iter().copied());
    }
    if !include.is_empty() {
        layer = layer.include(include.iter().copied());
    }
    (layer.build().expect("valid layer options"), counted)
}

/// The application in the layer (with `exclude` and `include` patterns), and what its
/// rules count.
fn layered(exclude: &[&str], include: &[&str]) -> (Router, Arc<Counted>) {
    let (layer, counted) = limiter(exclude, include);
    (routes().layer(layer), counted)
}

/// The layer around tower-http's `NormalizePathLayer` around the application: the router
/// routes a path the layer did not see (`//api/../login` as `/api/../login`).
fn trimmed_behind() -> (BoxCloneSyncService<Request<Body>, Response, Infallible>, Arc<Counted>) {
    let (layer, counted) = limiter(&[], &[]);
    let app = ServiceBuilder::new()
        .layer(layer)
        .layer(NormalizePathLayer::trim_trailing_slash())
        .service(routes());
    (BoxCloneSyncService::new(app), counted)
}

/// A request that reaches each handler.
const PATHS: &[(&str, &str)] = &[
    ("GET", "/"),
    ("GET", "/login"),
    ("POST", "/login"),
    ("GET", "/health"),
    ("GET", "/files/a/b.txt"),
    ("GET", "/files/x"),
    ("GET", "/docs"),
    ("GET", "/docs/"),
    ("GET", "/items/5"),
    ("GET", "/items/5/"),
    ("PATCH", "/webhook"),
    ("GET", "/ws"),
    ("GET", "/static"),
    ("GET", "/static/"),
    ("PUT", "/static/css/site.css"),
    ("GET", "/tenants/acme"),
    ("GET", "/tenants/acme/orders"),
    ("POST", "/tenants/acme/orders"),
    ("GET", "/api/users"),
    ("POST", "/api/users"),
    ("GET", "/api/users/me"),
    ("GET", "/api/users/42"),
    ("DELETE", "/api/users/42"),
    ("GET", "/api/users/42/posts/7"),
    ("POST", "/api/v1/login"),
    ("GET", "/api/unknown/x"),
    ("GET", "/admin"),
    ("PUT", "/admin/settings"),
    ("GET", "/nowhere"),
    ("GET", "/en/about"),
    ("GET", "/reports/2024/05"),
];

/// Segments with a meaning for a router or for normalization.
const HOSTILE: &[&str] = &[
    "",
    ".",
    "..",
    "%2e",
    "%2E",
    "%2e%2e",
    ".%2e",
    "%2E.",
    "%2f",
    "%2F",
    "a%2Fb",
    "%5c",
    "\\",
    "%00",
    "%25",
    "%",
    "%zz",
    "%2",
    ";",
    ";x=1",
    "x;y",
    "..;",
    "%3B",
    "%C3%A9",
    "%E2%80%AE",
    "~",
    "-",
    "*",
    "**",
    "%2A",
    "%3F",
    "%23",
    "{id}",
    ":id",
    "me",
    "v1",
    "login",
    "users",
    "api",
    "static",
    "files",
    "docs",
    "items",
    "tenants",
    "orders",
    "admin",
    "settings",
    "health",
    "ws",
    "webhook",
    "posts",
    "LOGIN",
    "Api",
    "%61pi",
    "%6c%6f%67%69%6e",
    "%75sers",
];

const METHODS: &[&str] = &[
    "GET", "GET", "GET", "GET", "POST", "POST", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT",
];

/// `%XX` (upper or lower case hex) for a byte.
fn escape(rng: &mut Rng, byte: u8) -> String {
    if rng.percent(50) {
        format!("%{byte:02X}")
    } else {
        format!("%{byte:02x}")
    }
}

/// One segment changed: escaped characters, a case change, a `;` parameter, or something
/// else entirely.
fn mutate_segment(rng: &mut Rng, segment: &str) -> String {
    match rng.below(8) {
        0 => segment
            .bytes()
            .map(|b| match rng.percent(40) {
                true => escape(rng, b),
                false => (b as char).to_string(),
            })
            .collect(),
        1 => {
            let mut s: Vec<char> = segment.chars().collect();
            if !s.is_empty() {
                let i = rng.below(s.len());
                s[i] = match s[i].is_ascii_lowercase() {
                    true => s[i].to_ascii_uppercase(),
                    false => s[i].to_ascii_lowercase(),
                };
            }
            s.into_iter().collect()
        }
        2 => format!("{segment};jsessionid=1"),
        3 => {
            let byte = rng.next() as u8;
            escape(rng, byte)
        }
        4 => format!("{segment}{}", rng.pick(HOSTILE)),
        5 => match rng.percent(50) {
            true => "a".repeat(1 + rng.below(400)),
            // Many segments at once: more than a router keeps on the stack.
            false => {
                let segment: &str = rng.pick(&["x", "", ".", ".."]);
                vec![segment; 10 + rng.below(30)].join("/")
            }
        },
        _ => rng.pick(HOSTILE).to_owned(),
    }
}

/// A request target: a handler's path changed a few times, or segments at random; then
/// perhaps a query, a fragment, or the absolute form.
fn target(rng: &mut Rng) -> String {
    let mut segments: Vec<String> = if rng.percent(75) {
        let path = PATHS[rng.below(PATHS.len())].1;
        path.strip_prefix('/')
            .unwrap_or(path)
            .split('/')
            .map(str::to_owned)
            .collect()
    } else {
        (0..rng.below(6)).map(|_| rng.pick(HOSTILE).to_owned()).collect()
    };
    for _ in 0..rng.below(4) {
        let at = rng.below(segments.len() + 1);
        match rng.below(6) {
            0 if at < segments.len() => {
                segments.remove(at);
            }
            1 => segments.insert(at, rng.pick(HOSTILE).to_owned()),
            2 => {
                // A detour: `x/..` or an escaped form of it.
                segments.insert(at, rng.pick(&["..", "%2e%2e", ".%2E", "%2E%2e"]).to_owned());
                segments.insert(at, rng.pick(HOSTILE).to_owned());
            }
            3 => segments.insert(at, rng.pick(&["", "."]).to_owned()),
            _ if at < segments.len() => segments[at] = mutate_segment(rng, &segments[at]),
            _ => segments.push(String::new()),
        }
    }
    let mut path = match rng.below(20) {
        0 => String::new(),
        1 => "//".to_owned(),
        _ => "/".to_owned(),
    };
    path.push_str(&segments.join("/"));
    if rng.percent(10) {
        path.push('/');
    }
    if rng.percent(10) {
        path.push_str(rng.pick(&["?", "?a=1", "?x=/../login", "?%2e%2e"]));
    }
    if rng.percent(3) {
        path.push_str("#/../login");
    }
    match rng.below(10) {
        0 if path.starts_with('/') => format!("http://example.com{path}"),
        1 if path.starts_with('/') => format!("https://other.example:8443{path}"),
        _ => path,
    }
}

/// What a request met: the handler that ran (if one did) and the rules that counted it.
struct Met {
    handler: Option<String>,
    counted: Vec<String>,
}

async fn send<S>(app: &S, counted: &Counted, method: &str, target: &str) -> Option<Met>
where
    S: tower::Service<Request<Body>, Response = Response, Error = Infallible> + Clone,
{
    let uri: Uri = target.parse().ok()?;
    let method: Method = method.parse().ok()?;
    let req = Request::builder().method(method).uri(uri).body(Body::empty()).ok()?;
    counted.take();
    let response = app.clone().oneshot(req).await.unwrap_or_else(|e| match e {});
    let handler = response
        .headers()
        .get(HANDLER)
        .map(|v| v.to_str().unwrap_or("?").to_owned());
    Some(Met {
        handler,
        counted: counted.take(),
    })
}

/// The handlers that a request reached without being counted by their rule, with the
/// targets that did it (the first few of each).
#[derive(Default)]
struct Escapes(BTreeMap<String, Vec<String>>);

impl Escapes {
    /// Notes `met` if it reached a handler that `limited` says the layer limits, and its
    /// rule did not count it.
    fn check(&mut self, met: &Met, method: &str, target: &str, limited: impl Fn(&str) -> bool) {
        let Some(handler) = &met.handler else { return };
        if !limited(handler) || met.counted.contains(handler) {
            return;
        }
        let found = self.0.entry(handler.clone()).or_default();
        if found.len() < 5 {
            found.push(format!("{method} {target}"));
        }
    }

    fn assert_none(&self, what: &str) {
        assert!(
            self.0.is_empty(),
            "{what}: targets reached a handler that its rule did not count:\n{}",
            self.0
                .iter()
                .map(|(handler, targets)| format!("  {handler}: {targets:?}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// The number of targets each run: a few seconds in a debug build.
const CASES: usize = 20_000;

/// The seed and the number of targets: fixed, unless `FLUXGATE_ROUTES_SEED` and
/// `FLUXGATE_ROUTES_CASES` say otherwise (to search further by hand).
fn seed_and_cases(seed: u64) -> (u64, usize) {
    let var = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
    (
        var("FLUXGATE_ROUTES_SEED").unwrap_or(seed),
        var("FLUXGATE_ROUTES_CASES").map_or(CASES, |n: u64| n as usize),
    )
}

/// Every path in `PATHS` reaches the handler it is listed for, and is counted by its rule:
/// the table and the routes agree.
#[tokio::test]
async fn each_route_is_counted_by_its_rule() {
    let (app, counted) = layered(&[], &[]);
    let mut reached = Vec::new();
    for (method, path) in PATHS {
        let met = send(&app, &counted, method, path).await.expect("a valid target");
        let handler = met
            .handler
            .unwrap_or_else(|| panic!("{method} {path} reached no handler"));
        assert!(
            met.counted.contains(&handler),
            "{method} {path}: {handler} not counted by its rule"
        );
        reached.push(handler);
    }
    for (name, _, _) in RULES {
        assert!(reached.iter().any(|h| h == name), "no path reaches {name}");
    }
}

/// The layer's `exclude` in the differential test: the health check and the static files.
const EXCLUDE: &[&str] = &["/health", "/static/**"];

/// The layer's `include` in the differential test, and the handlers whose routes it holds
/// whole: those must be counted, the others may not be.
const INCLUDE: &[&str] = &["/login", "/items/*/", "/tenants/*/orders", "/api/**"];
const INCLUDED: &[&str] = &[
    "login_form",
    "login",
    "item",
    "item_slash",
    "tenant_orders",
    "users_list",
    "users_create",
    "users_me",
    "user_get",
    "user_delete",
    "user_post",
    "api_login",
    "api_fallback",
];

/// The differential test: seeded random and hostile targets, through the layered router;
/// then through the same router with some paths excluded, with some paths included, and
/// with the layer outside a middleware that trims the path's runs of `/`.
#[tokio::test]
async fn no_target_reaches_a_handler_its_rule_does_not_count() {
    let (app, counted) = layered(&[], &[]);
    let (excluding, counted_excluding) = layered(EXCLUDE, &[]);
    let (including, counted_including) = layered(&[], INCLUDE);
    let (trimming, counted_trimming) = trimmed_behind();
    let (seed, cases) = seed_and_cases(0x5EED_F1A7_6A7E_0001);
    let mut rng = Rng(seed | 1);
    let mut escapes: [Escapes; 4] = Default::default();
    let mut reached: BTreeMap<String, usize> = BTreeMap::new();
    let mut sent = 0;
    for _ in 0..cases {
        let method = rng.pick(METHODS);
        let target = target(&mut rng);
        let Some(met) = send(&app, &counted, method, &target).await else {
            continue;
        };
        sent += 1;
        escapes[0].check(&met, method, &target, |_| true);
        if let Some(handler) = &met.handler {
            *reached.entry(handler.clone()).or_default() += 1;
        }
        if let Some(met) = send(&excluding, &counted_excluding, method, &target).await {
            escapes[1].check(&met, method, &target, |h| !["health", "static"].contains(&h));
        }
        if let Some(met) = send(&including, &counted_including, method, &target).await {
            escapes[2].check(&met, method, &target, |h| INCLUDED.contains(&h));
        }
        if let Some(met) = send(&trimming, &counted_trimming, method, &target).await {
            escapes[3].check(&met, method, &target, |_| true);
        }
    }
    escapes[0].assert_none(&format!("seed {seed}"));
    escapes[1].assert_none(&format!("seed {seed}, excluding {EXCLUDE:?}"));
    escapes[2].assert_none(&format!("seed {seed}, including {INCLUDE:?}"));
    escapes[3].assert_none(&format!("seed {seed}, a trimming middleware behind the layer"));
    // The generator reaches every handler, and most targets are valid URIs.
    for (name, _, _) in RULES {
        assert!(reached.contains_key(*name), "no target reached {name}: {reached:?}");
    }
    assert!(sent > cases / 2, "only {sent} of {cases} targets were valid URIs");
}

/// Writes `method target` as an HTTP/1.1 request line, raw bytes as they are, and returns
/// the handler that answered, if any.
async fn handler_over_http(addr: SocketAddr, method: &str, target: &[u8]) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connected");
    let mut head = format!("{method} ").into_bytes();
    head.extend_from_slice(target);
    head.extend_from_slice(b" HTTP/1.1\r\nHost: example.com\r\nConnection: close\r\n\r\n");
    stream.write_all(&head).await.expect("request written");
    let mut answer = Vec::new();
    // A server may close at once on a request it cannot parse.
    let _ = stream.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer);
    let head = answer.split("\r\n\r\n").next().unwrap_or("");
    head.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.eq_ignore_ascii_case(HANDLER).then(|| value.trim().to_owned())
    })
}

/// Request targets as hyper parses them from the request line, raw bytes included (`é`
/// unescaped, a raw `%`, `"`, `{`): what reaches a handler is counted by its rule.
#[tokio::test]
async fn targets_over_a_real_server_are_counted_by_their_rule() {
    let (app, counted) = layered(&[], &[]);
    let addr = serve(app).await;
    let (seed, cases) = seed_and_cases(0x5EED_F1A7_6A7E_0002);
    let mut rng = Rng(seed | 1);
    let mut escapes = Escapes::default();
    let mut reached = 0;
    // One connection each: a few hundred.
    for i in 0..cases / 50 {
        let method = rng.pick(METHODS);
        let mut target = target(&mut rng).into_bytes();
        if i % 3 == 0 {
            // A raw byte that no URI should hold, somewhere after the first `/`.
            let at = 1 + rng.below(target.len().max(1));
            let raw: &[u8] = rng.pick(&[&b"\xC3\xA9"[..], b"\"", b"{", b"}", b"|", b"\\", b"^", b"`", b"\x7f"]);
            let at = at.min(target.len());
            target.splice(at..at, raw.iter().copied());
        }
        counted.take();
        let handler = handler_over_http(addr, method, &target).await;
        let met = Met {
            handler,
            counted: counted.take(),
        };
        reached += usize::from(met.handler.is_some());
        escapes.check(&met, method, &String::from_utf8_lossy(&target), |_| true);
    }
    escapes.assert_none(&format!("seed {seed}, over HTTP/1.1"));
    assert!(reached > cases / 200, "only {reached} targets reached a handler");
}
