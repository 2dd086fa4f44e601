//! A wildcard parameter's part of the path, as a handler that cleans it against its own
//! root reads it: the dots and empty segments in it resolved, never above the wildcard,
//! whatever a parameter before it holds, and behind a middleware that trims the path's
//! runs of `/`. A rule or an `include` naming what the handler serves must count every
//! spelling of it.

use std::sync::{Arc, Mutex};

use axum::extract::Path;
use axum::routing::get;
use axum::Router;
use fluxgate::tower::RateLimitLayer;
use http::{Request, StatusCode};
use tower::{ServiceBuilder, ServiceExt};
use tower_http::normalize_path::NormalizePathLayer;

use crate::engine;

/// What each handler served, in order.
type Served = Arc<Mutex<Vec<String>>>;

const EVERY_REQUEST_ONCE: &str =
    "rule_sets:\n  - id: default\n    rules:\n      - id: all\n        bands: [{ capacity: 1, window: 1h }]\n";

fn one_rule(pattern: &str) -> String {
    format!(
        "rule_sets:\n  - id: default\n    rules:\n      - id: page\n        match: {{ paths: [\"{pattern}\"] }}\n        bands: [{{ capacity: 1, window: 1h }}]\n"
    )
}

/// What a handler that cleans `rest` against its own root serves.
fn cleaned(rest: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    for segment in rest.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            segment => out.push(segment),
        }
    }
    out.join("/")
}

/// A router whose wildcard handler records what it serves: `/api/{version}/files/{*rest}`
/// and `/files/{*rest}`.
fn router(served: &Served) -> Router {
    let (versioned, plain) = (served.clone(), served.clone());
    Router::new()
        .route(
            "/api/{version}/files/{*rest}",
            get(move |Path((_, rest)): Path<(String, String)>| {
                versioned.lock().expect("served").push(cleaned(&rest));
                std::future::ready("files")
            }),
        )
        .route(
            "/files/{*rest}",
            get(move |Path(rest): Path<String>| {
                plain.lock().expect("served").push(cleaned(&rest));
                std::future::ready("files")
            }),
        )
}

/// The layers to try: the rule on `pattern`, and `include` of it.
fn layers(pattern: &str) -> [(&'static str, RateLimitLayer); 2] {
    let include = RateLimitLayer::builder(engine(EVERY_REQUEST_ONCE))
        .include([pattern])
        .build()
        .expect("a layer");
    [
        ("rule", RateLimitLayer::new(engine(&one_rule(pattern)))),
        ("include", include),
    ]
}

/// Sends `target` five times through `app`; how many were admitted.
async fn admitted<S>(app: &S, target: &str) -> usize
where
    S: tower::Service<Request<axum::body::Body>, Response = axum::response::Response> + Clone,
    S::Error: std::fmt::Debug,
{
    let statuses = statuses(app, target).await;
    statuses
        .iter()
        .filter(|&&status| status != StatusCode::TOO_MANY_REQUESTS.as_u16())
        .count()
}

/// Sends `target` five times through `app`: the wildcard handler must serve `private/x`,
/// and once only, the limit being one.
async fn served_private_once<S>(app: &S, served: &Served, target: &str, what: &str)
where
    S: tower::Service<Request<axum::body::Body>, Response = axum::response::Response> + Clone,
    S::Error: std::fmt::Debug,
{
    let admitted = admitted(app, target).await;
    let served = served.lock().expect("served").clone();
    assert_eq!(
        served.first().map(String::as_str),
        Some("private/x"),
        "{what}, {target}"
    );
    assert_eq!(admitted, 1, "{what}, {target}: ran {served:?}");
}

/// A parameter before the wildcard may be `.`, `..`, empty or hold a `%2F`; the wildcard's
/// own part may need cleaning without climbing above its root.
#[tokio::test]
async fn a_wildcard_after_a_parameter_is_counted_as_its_handler_cleans_it() {
    for target in [
        "/api/v1/files/../private/x",
        "/api/./files/a/../private/x",
        "/api/../files/a/../private/x",
        "/api//files/a/../private/x",
        "/api/./files/./private/x",
        "/api//files//private/x",
        "/api/%2e/files/%2e/private/x",
        "/api/a%2Fb/files/../private/x",
        "/api/a%2Fb/files/x/../../private/x",
        // A `%2F` in both parameters, no dots.
        "/api/a%2Fb/files/private%2Fx",
        "/api/a%2fb/files/%2Fprivate%2Fx",
    ] {
        for (what, layer) in layers("/api/*/files/private/**") {
            let served = Served::default();
            let app = router(&served).layer(layer);
            served_private_once(&app, &served, target, what).await;
        }
    }
}

/// Behind tower-http's `NormalizePathLayer`, which trims the runs of `/` at both ends, the
/// router routes `//files/../private/x` as `/files/../private/x`.
#[tokio::test]
async fn a_wildcards_dots_are_counted_behind_a_trimming_middleware() {
    for target in [
        "/files/../private/x",
        "//files/../private/x",
        "//files/a/../../private/x",
        "//files/%2e%2e/private/x",
        "///files/..%2Fprivate%2Fx",
    ] {
        for (what, layer) in layers("/files/private/**") {
            let served = Served::default();
            let app = ServiceBuilder::new()
                .layer(layer)
                .layer(NormalizePathLayer::trim_trailing_slash())
                .service(router(&served));
            served_private_once(&app, &served, target, what).await;
        }
    }
}

/// An exclusion's `%2F` is read as a `/` nowhere an exclusion decides alone: `/%2F*` is no
/// `/*` for the asterisk form, which reaches the fallback.
#[tokio::test]
async fn an_exclusions_escaped_slash_leaves_the_asterisk_form_limited() {
    for exclude in ["/%2F*", "/%2F/**"] {
        let layer = RateLimitLayer::builder(engine(EVERY_REQUEST_ONCE))
            .exclude([exclude])
            .build()
            .expect("a layer");
        let app = Router::new().fallback(|| std::future::ready("fallback")).layer(layer);
        assert_eq!(admitted(&app, "*").await, 1, "exclude `{exclude}`");
    }
}

/// A path longer than `LONGEST_MATCHED_PATH` is never matched, so that matching it costs
/// nothing: the engine refuses it when rules match paths (the layer answers `400`), and
/// the layer limits it whatever `include` and `exclude` say. A shorter one is matched as
/// usual.
#[tokio::test]
async fn a_path_too_long_to_match_is_refused_or_limited() {
    let longest = fluxgate::core::path::LONGEST_MATCHED_PATH;
    let long = format!("/x/{}", "a".repeat(longest));
    let short = format!("/x/{}", "a".repeat(longest - 3));
    let layer = |include: &[&str], exclude: &[&str]| {
        RateLimitLayer::builder(engine(EVERY_REQUEST_ONCE))
            .include(include.iter().copied())
            .exclude(exclude.iter().copied())
            .build()
            .expect("a layer")
    };
    // What the fallback saw of five requests of each path: how many ran it, and the
    // statuses.
    for (what, layer, long_ran, short_ran) in [
        ("rule", RateLimitLayer::new(engine(&one_rule("/other/**"))), 0, 5),
        ("include", layer(&["/other/**"], &[]), 1, 5),
        ("exclude", layer(&[], &["/x/**"]), 1, 5),
    ] {
        let ran = Served::default();
        let seen = ran.clone();
        let app = Router::new()
            .fallback(move || {
                seen.lock().expect("ran").push(String::new());
                std::future::ready("fallback")
            })
            .layer(layer);
        for (path, expected) in [(&long, long_ran), (&short, short_ran)] {
            ran.lock().expect("ran").clear();
            let statuses = statuses(&app, path).await;
            let count = ran.lock().expect("ran").len();
            assert_eq!(count, expected, "{what}, {} bytes: {statuses:?}", path.len());
        }
    }
}

/// A long path cannot pull in a rule whose failure policy is looser than its own rule's:
/// with the backend down, a `fallback_local` rule keeps limiting, and the long path is
/// refused rather than matched by a rule without a policy.
#[tokio::test]
async fn a_long_path_brings_in_no_looser_failure_policy() {
    let yaml = r#"
rule_sets:
  - id: default
    rules:
      - id: api
        match: { paths: ["/api/**"] }
        on_backend_failure: fallback_local
        scope: ip
        bands: [{ capacity: 2, window: 1h }]
      - id: admin
        match: { paths: ["/admin/**"] }
        bands: [{ capacity: 100, window: 1h }]
"#;
    let engine = fluxgate::core::Engine::builder(crate::support::app::rules(yaml))
        .limiter(crate::Down)
        .build()
        .expect("an engine");
    let app = Router::new()
        .fallback(|| std::future::ready("fallback"))
        .layer(RateLimitLayer::new(engine));
    assert_eq!(statuses(&app, "/api/x").await, [200, 200, 429, 429, 429]);
    let long = format!("/api/{}", "a".repeat(fluxgate::core::path::LONGEST_MATCHED_PATH));
    assert_eq!(statuses(&app, &long).await, [400; 5]);
}

/// The statuses of five requests of `target` through `app`.
async fn statuses<S>(app: &S, target: &str) -> Vec<u16>
where
    S: tower::Service<Request<axum::body::Body>, Response = axum::response::Response> + Clone,
    S::Error: std::fmt::Debug,
{
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let mut request = Request::builder()
            .uri(target)
            .body(axum::body::Body::empty())
            .expect("a request");
        request
            .extensions_mut()
            .insert(axum::extract::ConnectInfo(std::net::SocketAddr::from((
                [192, 0, 2, 10],
                4000,
            ))));
        statuses.push(app.clone().oneshot(request).await.expect("a reply").status().as_u16());
    }
    statuses
}
