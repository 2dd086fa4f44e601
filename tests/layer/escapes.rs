//! Percent-escapes against the router: axum hands a route's parameters to its handler
//! decoded, so `/wiki/Caf%C3%A9`, `/wiki/Café` and `/wiki/Caf%c3%a9` are one page to a
//! `/wiki/{page}` handler. A rule, an `include` or an `exclude` that names the page must
//! treat every spelling alike, or a client walks around it by spelling the page anew.
//! Static routes are matched on the raw path, so an `exclude` must not reach a spelling
//! that the excluded route does not serve.

use std::sync::{Arc, Mutex};

use axum::extract::Path;
use axum::routing::get;
use axum::Router;
use fluxgate::tower::RateLimitLayer;
use http::StatusCode;

use crate::engine;
use crate::support::app::get_from;

/// What each handler was given, in order: `(handler, value)`.
type Runs = Arc<Mutex<Vec<(&'static str, String)>>>;

/// A `GET /wiki/{page}` route, a `GET /files/{*rest}` route, a static `GET /static/Café/x`
/// route and a catch-all fallback, each recording what it was given, behind `layer`.
fn wiki_app(layer: RateLimitLayer) -> (Router, Runs) {
    let runs: Runs = Arc::default();
    let record = |name: &'static str| {
        let runs = runs.clone();
        move |Path(value): Path<String>| {
            runs.lock().expect("runs").push((name, value.clone()));
            std::future::ready(value)
        }
    };
    let fixed = {
        let runs = runs.clone();
        move || {
            runs.lock().expect("runs").push(("static", String::new()));
            std::future::ready("static")
        }
    };
    let router = Router::new()
        .route("/wiki/{page}", get(record("wiki")))
        .route("/files/{*rest}", get(record("files")))
        .route("/static/Café/x", get(fixed))
        .fallback(by_uri(&runs, "fallback"))
        .layer(layer);
    (router, runs)
}

/// A handler recording its `name` and the path it ran for.
fn by_uri(
    runs: &Runs,
    name: &'static str,
) -> impl Fn(http::Uri) -> std::future::Ready<&'static str> + Clone + Send + Sync + 'static {
    let runs = runs.clone();
    move |uri: http::Uri| {
        runs.lock().expect("runs").push((name, uri.path().to_owned()));
        std::future::ready(name)
    }
}

/// A layer counting every request once, but those `exclude` leaves alone.
fn excluding(exclude: &str) -> RateLimitLayer {
    RateLimitLayer::builder(engine(EVERY_REQUEST_ONCE))
        .exclude([exclude])
        .build()
        .expect("a layer")
}

fn one_rule(pattern: &str) -> String {
    format!(
        "rule_sets:\n  - id: default\n    rules:\n      - id: page\n        match: {{ paths: [\"{pattern}\"] }}\n        bands: [{{ capacity: 1, window: 1h }}]\n"
    )
}

const EVERY_REQUEST_ONCE: &str =
    "rule_sets:\n  - id: default\n    rules:\n      - id: all\n        bands: [{ capacity: 1, window: 1h }]\n";

/// Sends `target` five times; how many times a handler ran, and what it was given.
async fn five_times(app: &Router, runs: &Runs, target: &str) -> (usize, Vec<(&'static str, String)>) {
    runs.lock().expect("runs").clear();
    let mut admitted = 0;
    for _ in 0..5 {
        let reply = get_from(app, target, "192.0.2.10").await;
        admitted += usize::from(reply.status != StatusCode::TOO_MANY_REQUESTS);
    }
    let ran = runs.lock().expect("runs").clone();
    assert_eq!(admitted, ran.len(), "{target}: every admitted request runs a handler");
    (ran.len(), ran)
}

/// A rule naming one page counts it however the page is spelled, the rule as well.
#[tokio::test]
async fn a_page_a_rule_names_is_counted_whatever_its_spelling() {
    for (pattern, spelling, value) in [
        ("/wiki/Café", "/wiki/Caf%C3%A9", "Café"),
        ("/wiki/Café", "/wiki/Caf%c3%a9", "Café"),
        ("/wiki/Caf%C3%A9", "/wiki/Café", "Café"),
        ("/wiki/Caf%c3%a9", "/wiki/Caf%C3%A9", "Café"),
        ("/wiki/Help:Contents", "/wiki/Help%3AContents", "Help:Contents"),
        ("/wiki/a+b", "/wiki/a%2Bb", "a+b"),
        ("/wiki/a@b,c;d=e", "/wiki/a%40b%2Cc%3Bd%3De", "a@b,c;d=e"),
        ("/wiki/~admin", "/wiki/%7Eadmin", "~admin"),
        ("/wiki/%7Eadmin", "/wiki/~admin", "~admin"),
        ("/wiki/a%2fb", "/wiki/a%2Fb", "a/b"),
        ("/wiki/a b", "/wiki/a%20b", "a b"),
        ("/wiki/Caf?", "/wiki/Caf%C3%A9", "Café"),
        ("/wiki/*:Contents", "/wiki/Help%3aContents", "Help:Contents"),
        // One character to the handler, though it stays an escape in every view.
        ("/wiki/?", "/wiki/%3F", "?"),
        ("/wiki/?", "/wiki/%25", "%"),
        ("/wiki/?", "/wiki/%23", "#"),
        // A control character past ASCII, raw or escaped, is one character too.
        ("/wiki/?", "/wiki/%C2%85", "\u{85}"),
        ("/wiki/?", "/wiki/%c2%9f", "\u{9f}"),
        ("/wiki/a?b", "/wiki/a%C2%80b", "a\u{80}b"),
        ("/wiki/%C2%85", "/wiki/\u{85}", "\u{85}"),
        ("/wiki/x%C2%9B", "/wiki/x\u{9b}", "x\u{9b}"),
    ] {
        let pattern = pattern.replace(' ', "%20");
        let (app, runs) = wiki_app(RateLimitLayer::new(engine(&one_rule(&pattern))));
        let (ran, given) = five_times(&app, &runs, spelling).await;
        assert_eq!(ran, 1, "rule `{pattern}`, request `{spelling}`: {given:?}");
        assert_eq!(
            given,
            [("wiki", value.to_owned())],
            "rule `{pattern}`, request `{spelling}`"
        );
    }
}

/// A handler of a wildcard parameter reads `%2F` as a `/` like any other: the rule of a
/// part of the tree counts `/files/private%2Fx` as it counts `/files/private/x`.
#[tokio::test]
async fn an_escaped_slash_under_a_wildcard_route_is_counted_as_a_slash() {
    for spelling in [
        "/files/private/x",
        "/files/private%2Fx",
        "/files/private%2fx",
        "/files/public%2F..%2Fprivate%2Fx",
        "/files/Priv%61te/../private%2Fx",
        // The handler gets `private/x/../y`, as from `/files/private/x/../y`.
        "/files/private%2Fx/../y",
        "/files/private%2F/../y",
        // The handler gets `../private/x` (and the like), which one that cleans it against
        // its own root serves as `private/x`.
        "/files/../private/x",
        "/files/%2e%2e/private/x",
        "/files/a%2F..%2F..%2Fprivate/x",
        "/files/x/../../private/x",
    ] {
        let (app, runs) = wiki_app(RateLimitLayer::new(engine(&one_rule("/files/private/**"))));
        let (ran, given) = five_times(&app, &runs, spelling).await;
        assert_eq!(ran, 1, "request `{spelling}`: {given:?}");
    }
}

/// `include` is matched as rules are: an included page is limited whatever its spelling.
#[tokio::test]
async fn an_included_page_is_limited_whatever_its_spelling() {
    for (include, spelling) in [
        ("/wiki/Café", "/wiki/Caf%C3%A9"),
        ("/wiki/Caf%C3%A9", "/wiki/Café"),
        ("/wiki/Help:*", "/wiki/Help%3AContents"),
        ("/files/private/**", "/files/private%2Fx"),
        ("/files/private/**", "/files/private%2Fx/../y"),
        ("/files/private/**", "/files/../private/x"),
        ("/files/private/**", "/files/a%2F..%2F..%2Fprivate/x"),
    ] {
        let layer = RateLimitLayer::builder(engine(EVERY_REQUEST_ONCE))
            .include([include])
            .build()
            .expect("a layer");
        let (app, runs) = wiki_app(layer);
        let (ran, given) = five_times(&app, &runs, spelling).await;
        assert_eq!(ran, 1, "include `{include}`, request `{spelling}`: {given:?}");
    }
}

/// An `exclude` lets a request through only when every view of its path is excluded,
/// the path as routed among them: static routes are matched on the raw path, so the
/// static route `/static/Café/x` runs for that spelling alone (and for the spelling an
/// exclusion names, were the route written so), and any other spelling reaches the
/// fallback, which stays limited. The same holds for a page of a parameter route, which
/// an exclusion leaves alone only as it spells it: more limited, never less.
#[tokio::test]
async fn an_exclusion_reaches_no_handler_it_does_not_name() {
    for (exclude, spelling, handler, excluded) in [
        ("/static/Café/x", "/static/Café/x", "static", true),
        ("/static/Café/x", "/static/Caf%C3%A9/x", "fallback", false),
        ("/static/Café/x", "/static/Caf%c3%a9/x", "fallback", false),
        // The layer cannot know how the route is written: a pattern written with escapes
        // excludes only that spelling in the raw view, and the static route's own spelling
        // stays limited (list both to leave it alone).
        ("/static/Caf%C3%A9/x", "/static/Café/x", "static", false),
        ("/static/Caf%C3%A9/x", "/static/Caf%C3%A9/x", "fallback", true),
        ("/static/Caf%C3%A9/x", "/static/Caf%c3%a9/x", "fallback", false),
        ("/wiki/Café", "/wiki/Café", "wiki", true),
        ("/wiki/Café", "/wiki/Caf%C3%A9", "wiki", false),
        ("/wiki/Caf%C3%A9", "/wiki/Caf%C3%A9", "wiki", true),
        // A `%2F` makes no new segment for an exclusion.
        ("/files/*", "/files/a%2Fb", "files", false),
        ("/files/a/*", "/files/a%2Fb", "files", false),
    ] {
        let (app, runs) = wiki_app(excluding(exclude));
        let (ran, given) = five_times(&app, &runs, spelling).await;
        let what = format!("exclude `{exclude}`, request `{spelling}`: {given:?}");
        assert_eq!(given.first().map(|g| g.0), Some(handler), "{what}");
        assert_eq!(ran, if excluded { 5 } else { 1 }, "{what}");
    }
}

/// A pattern cannot name a literal `*`: `%2A` would be decoded into a wildcard.
#[test]
fn an_escaped_wildcard_in_a_pattern_is_refused() {
    let error = RateLimitLayer::builder(engine(EVERY_REQUEST_ONCE))
        .include(["/wiki/%2A"])
        .build()
        .expect_err("refused");
    assert!(error.to_string().contains("%2A"), "{error}");
    let rules = fluxgate::core::RuleSets::from_yaml_str(&one_rule("/wiki/a%2ab"));
    let error = rules.expect_err("refused").to_string();
    assert!(error.contains("/wiki/a%2ab") && error.contains("wildcard"), "{error}");
}

/// A static route written with escapes runs for that spelling alone; its decoded spelling
/// reaches the fallback, which an exclusion written like the route must not leave alone.
#[tokio::test]
async fn an_exclusion_written_with_escapes_leaves_only_that_spelling_alone() {
    for (route, spelling) in [
        ("/wiki/Help%3AContents", "/wiki/Help:Contents"),
        ("/static/Caf%C3%A9/x", "/static/Café/x"),
    ] {
        let runs: Runs = Arc::default();
        let record = |name| by_uri(&runs, name);
        let layer = excluding(route);
        let app = Router::new()
            .route(route, get(record("static")))
            .fallback(record("fallback"))
            .layer(layer);
        let (ran, given) = five_times(&app, &runs, route).await;
        assert_eq!((ran, given.first().map(|g| g.0)), (5, Some("static")), "{route}");
        let (ran, given) = five_times(&app, &runs, spelling).await;
        assert_eq!(given.first().map(|g| g.0), Some("fallback"), "{spelling}");
        assert_eq!(ran, 1, "exclude `{route}`, request `{spelling}`: {given:?}");
    }
}

/// An exclusion's own trailing `/` and empty segments count in the raw view: `/docs/` and
/// `/docs` are two routes to the router, and `//health` is no spelling of `/health` it
/// routes to the same handler (the fallback answers it).
#[tokio::test]
async fn an_exclusion_keeps_its_trailing_slash_and_empty_segments() {
    for (exclude, target, handler, excluded) in [
        ("/docs/", "/docs/", "docs/", true),
        ("/docs/", "/docs", "docs", false),
        ("/docs", "/docs/", "docs/", false),
        ("/docs", "/docs", "docs", true),
        ("//docs", "/docs", "docs", false),
        ("/items/*/", "/items/5", "item", false),
        ("/items/*/", "/items/5/", "item/", true),
    ] {
        let runs: Runs = Arc::default();
        let record = |name| by_uri(&runs, name);
        let layer = excluding(exclude);
        let app = Router::new()
            .route("/docs", get(record("docs")))
            .route("/docs/", get(record("docs/")))
            .route("/items/{id}", get(record("item")))
            .route("/items/{id}/", get(record("item/")))
            .fallback(record("fallback"))
            .layer(layer);
        let (ran, given) = five_times(&app, &runs, target).await;
        let what = format!("exclude `{exclude}`, request `{target}`: {given:?}");
        assert_eq!(given.first().map(|g| g.0), Some(handler), "{what}");
        assert_eq!(ran, if excluded { 5 } else { 1 }, "{what}");
    }
}
