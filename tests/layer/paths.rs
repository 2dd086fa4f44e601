//! Paths and methods: dot segments, doubled slashes and escapes in the path, `HEAD` and
//! `CONNECT` under a `GET` rule, parameter routes and a trailing `/`, and the `include` and
//! `exclude` patterns, with exclusions that would leave no path limited refused.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use fluxgate::tower::{ConfigError, RateLimitLayer};
use http::StatusCode;

use crate::support::app::{app, get_from, layer, request, send};
use crate::{engine, support, LOGIN_GET_ONE_PER_HOUR};

const API_ONE_PER_HOUR: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: users
        match: { paths: ["/api/users"] }
        bands: [{ capacity: 1, window: 1h }]
      - id: all
        bands: [{ capacity: 1000, window: 1h }]
"#;

#[tokio::test]
async fn dot_segments_and_double_slashes_hit_the_same_rule() {
    let app = app(layer(engine(API_ONE_PER_HOUR)).build().unwrap());
    let r = get_from(&app, "/api/users", "192.0.2.10").await;
    assert_eq!(r.status, StatusCode::OK);
    for path in [
        "/api//users",
        "/api/./users",
        "/api/x/../users",
        "/api/%75sers",
        "/api/users?x=1",
    ] {
        let r = get_from(&app, path, "192.0.2.10").await;
        assert_eq!(
            r.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{path} escaped the /api/users rule"
        );
        assert_eq!(r.header("x-ratelimit-limit"), Some("1"), "{path}");
    }
}

/// An app with a `GET` handler behind a path parameter, counting the handler's runs.
fn login_app(rules: &str, runs: Arc<AtomicUsize>) -> axum::Router {
    axum::Router::new()
        .route(
            "/api/{version}/login",
            axum::routing::get(move |axum::extract::Path(_version): axum::extract::Path<String>| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    "login"
                }
            }),
        )
        .layer(RateLimitLayer::new(engine(rules)))
}

/// axum runs `GET` handlers for `HEAD`: a `GET` rule limits `HEAD` too.
#[tokio::test]
async fn head_requests_are_limited_by_get_rules() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = login_app(LOGIN_GET_ONE_PER_HOUR, runs.clone());
    // GET, then HEAD on the same client: the HEAD is the second request of the rule.
    assert_eq!(
        send(&app, request("GET", "/api/v1/login", "192.0.2.30", &[]))
            .await
            .status,
        StatusCode::OK
    );
    let r = send(&app, request("HEAD", "/api/v1/login", "192.0.2.30", &[])).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "HEAD escaped the GET rule");
    // HEAD alone is limited like GET.
    let r = send(&app, request("HEAD", "/api/v1/login", "192.0.2.31", &[])).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-ratelimit-limit"), Some("1"));
    for _ in 0..5 {
        let r = send(&app, request("HEAD", "/api/v1/login", "192.0.2.31", &[])).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the handler ran for a rejected request");
    // Methods the rule does not name stay outside it (axum answers 405 for them here).
    let r = send(&app, request("POST", "/api/v1/login", "192.0.2.31", &[])).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.header("x-ratelimit-limit"), None);
}

/// A WebSocket route is an `any` route in axum (a handshake over HTTP/2 is a `CONNECT`,
/// RFC 8441): a `GET` rule on it limits the `CONNECT` handshake too.
#[tokio::test]
async fn a_get_rule_on_an_any_route_limits_connect() {
    let rules = "rule_sets: [{id: default, rules: [{id: ws, match: {paths: [\"/ws\"], methods: [GET]}, \
        bands: [{capacity: 1, window: 1h}]}]}]";
    let app = axum::Router::new()
        .route("/ws", axum::routing::any(|| async { "ws" }))
        .layer(layer(engine(rules)).build().unwrap());
    assert_eq!(
        send(&app, request("GET", "/ws", "192.0.2.70", &[])).await.status,
        StatusCode::OK
    );
    let r = send(&app, request("CONNECT", "/ws", "192.0.2.70", &[])).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "CONNECT escaped the GET rule");
}

/// axum routes the raw path: `/api/../login` and its kin reach `/api/{version}/login`
/// with `version` set to `..`, `.` or the empty string. The rule `/api/*/login` applies
/// to each of them, though their normalized paths (`/login`, `/api/login`) do not match it.
#[tokio::test]
async fn dot_segments_cannot_walk_around_a_rule_on_a_parameter_route() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = login_app(LOGIN_GET_ONE_PER_HOUR, runs.clone());
    let variants = [
        "/api/../login",
        "/api/./login",
        "/api/%2e%2e/login",
        "/api/%2E/login",
        "/api/%2e/login",
        "/api//login",
        "/api/../login?x=1",
    ];
    for (i, path) in variants.iter().enumerate() {
        let peer = format!("192.0.2.{}", 40 + i);
        let r = send(&app, request("GET", path, &peer, &[])).await;
        assert_eq!(r.status, StatusCode::OK, "{path}: the handler is reached");
        assert_eq!(r.header("x-ratelimit-limit"), Some("1"), "{path}: no rule applied");
        for _ in 0..3 {
            let r = send(&app, request("GET", path, &peer, &[])).await;
            assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{path} got around the rule");
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), variants.len());
    // One client mixing the forms shares one bucket.
    assert_eq!(
        send(&app, request("GET", "/api/v2/login", "192.0.2.60", &[]))
            .await
            .status,
        StatusCode::OK
    );
    for path in variants {
        let r = send(&app, request("GET", path, "192.0.2.60", &[])).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{path}");
    }
}

/// A route that ends in `/` after a parameter (`/items/{id}/`) runs for `/items//`,
/// `/items/./` and `/items/../` (`id` empty, `.` and `..`), whose normalized paths (`/items`,
/// `/`) its rule does not match. Found by the differential test (`routes.rs`): the routed view
/// counts them, the request's trailing `/` ignored as the pattern's own is (`/items/*/` and
/// `/items/*` are one pattern).
#[tokio::test]
async fn a_parameter_before_a_trailing_slash_cannot_walk_around_its_rule() {
    for pattern in ["/items/*/", "/items/*"] {
        let rules = format!(
            "rule_sets: [{{id: default, rules: [{{id: item, match: {{paths: [\"{pattern}\"], methods: [GET]}}, \
             bands: [{{capacity: 1, window: 1h}}]}}]}}]"
        );
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = runs.clone();
        let app = axum::Router::new()
            .route(
                "/items/{id}/",
                axum::routing::get(move || {
                    counted.fetch_add(1, Ordering::SeqCst);
                    async { "item" }
                }),
            )
            .layer(RateLimitLayer::new(engine(&rules)));
        assert_eq!(get_from(&app, "/items/5/", "192.0.2.80").await.status, StatusCode::OK);
        let variants = [
            "/items//",
            "/items/./",
            "/items/../",
            "/items/%2e%2e/",
            "/items/.%2E/?x=1",
        ];
        for (i, path) in variants.iter().enumerate() {
            let r = get_from(&app, path, "192.0.2.80").await;
            assert_eq!(
                r.status,
                StatusCode::TOO_MANY_REQUESTS,
                "{path} reached /items/{{id}}/ past the rule `{pattern}`"
            );
            // A client that starts with it is counted by the rule from its first request.
            let peer = format!("192.0.2.{}", 90 + i);
            let r = get_from(&app, path, &peer).await;
            assert_eq!(r.status, StatusCode::OK, "{path}: the handler is reached");
            assert_eq!(r.header("x-ratelimit-limit"), Some("1"), "{path}: no rule applied");
            let r = get_from(&app, "/items/5/", &peer).await;
            assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{path}");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 6, "{pattern}");
    }
}

#[tokio::test]
async fn excluded_paths_bypass_the_limiter_and_include_narrows_it() {
    let rules = r#"
rule_sets:
  - id: default
    rules:
      - id: everything
        bands: [{ capacity: 1, window: 1h }]
"#;
    let app = app(layer(engine(rules))
        .exclude(["/health", "/metrics/**"])
        .build()
        .unwrap());
    for _ in 0..5 {
        let r = get_from(&app, "/health", "192.0.2.20").await;
        assert_eq!(r.status, StatusCode::OK);
        assert!(r.header("x-ratelimit-limit").is_none());
        assert_eq!(
            get_from(&app, "/metrics/a/b", "192.0.2.20").await.status,
            StatusCode::OK
        );
    }
    // An exclusion holds only when the path as routed is excluded too: normalization never
    // takes a request out of the limiter. `/api/x/../../health` normalizes to `/health`
    // but axum routes it to `/api/{*rest}`.
    for (path, status) in [
        ("/api/x/../../health", StatusCode::OK),
        ("//health/", StatusCode::NOT_FOUND),
    ] {
        let peer = if status == StatusCode::OK {
            "192.0.2.22"
        } else {
            "192.0.2.23"
        };
        let r = get_from(&app, path, peer).await;
        assert_eq!(r.status, status, "{path}");
        assert_eq!(r.header("x-ratelimit-limit"), Some("1"), "{path} bypassed the limiter");
        let r = get_from(&app, path, peer).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{path}");
    }
    assert_eq!(get_from(&app, "/api/users", "192.0.2.20").await.status, StatusCode::OK);
    assert_eq!(
        get_from(&app, "/api/users", "192.0.2.20").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );

    let app = support::app::app(layer(engine(rules)).include(["/api/orders"]).build().unwrap());
    for _ in 0..3 {
        assert_eq!(get_from(&app, "/api/users", "192.0.2.21").await.status, StatusCode::OK);
    }
    assert_eq!(get_from(&app, "/api/orders", "192.0.2.21").await.status, StatusCode::OK);
    assert_eq!(
        get_from(&app, "/api/orders", "192.0.2.21").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// `include` matches the routed path without its trailing `/`, as rules do: an
/// `/items/{id}/` route runs for `/items//` and `/items/../` (normalized to `/items` and `/`),
/// which an inclusion of `/items/*/` must not leave alone. Found by the differential test
/// (`routes.rs`). An exclusion does not widen so: `/items/x/` stays limited under an
/// exclusion of `/items/*`, by its routed path.
#[tokio::test]
async fn an_included_route_ending_in_a_slash_is_limited_for_every_parameter() {
    let rules = "rule_sets: [{id: default, rules: [{id: everything, bands: [{capacity: 1, window: 1h}]}]}]";
    let items = || {
        axum::Router::new()
            .route("/items/{id}/", axum::routing::get(|| async { "item" }))
            .route("/other", axum::routing::get(|| async { "other" }))
    };
    let app = items().layer(layer(engine(rules)).include(["/items/*/"]).build().unwrap());
    for _ in 0..3 {
        assert_eq!(get_from(&app, "/other", "192.0.2.100").await.status, StatusCode::OK);
    }
    let variants = ["/items/5/", "/items//", "/items/./", "/items/../", "/items/%2e%2e/"];
    for (i, path) in variants.iter().enumerate() {
        let peer = format!("192.0.2.{}", 101 + i);
        let r = get_from(&app, path, &peer).await;
        assert_eq!(r.status, StatusCode::OK, "{path}: the handler is reached");
        assert_eq!(r.header("x-ratelimit-limit"), Some("1"), "{path} was not included");
        let r = get_from(&app, path, &peer).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{path}");
    }

    let app = items().layer(layer(engine(rules)).exclude(["/items/*"]).build().unwrap());
    for _ in 0..3 {
        let r = get_from(&app, "/items/5", "192.0.2.110").await;
        assert!(r.header("x-ratelimit-limit").is_none(), "excluded");
    }
    assert_eq!(get_from(&app, "/items/5/", "192.0.2.111").await.status, StatusCode::OK);
    assert_eq!(
        get_from(&app, "/items/5/", "192.0.2.111").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// Exclude patterns that between them match every path leave the layer limiting nothing,
/// as `/**` alone does: refused, naming them. Patterns that leave paths out stay allowed.
#[tokio::test]
async fn exclude_patterns_that_together_match_every_path_are_refused() {
    let engine = engine("rule_sets: [{id: default, rules: [{id: per-ip, bands: [{capacity: 1, window: 1h}]}]}]");
    for every in [
        &["/", "/*/**"][..],
        &["/health", "/", "/**/*"][..],
        &["/", "/*", "/?*/*/**"][..],
    ] {
        let err = RateLimitLayer::builder(engine.clone())
            .exclude(every.iter().copied())
            .build()
            .unwrap_err();
        assert!(
            matches!(&err, ConfigError::Pattern { option: "exclude", .. })
                && err.to_string().contains("together match every path"),
            "{every:?}: {err}"
        );
    }
    // What was refused lets every request through: `/` and `/*/**` leave no path limited.
    for partial in [
        &["/*/**"][..],
        &["/", "/*"][..],
        &["/", "/?/**"][..],
        &["/", "/api/**", "/*/*/**"][..],
    ] {
        assert!(
            layer(engine.clone()).exclude(partial.iter().copied()).build().is_ok(),
            "{partial:?}"
        );
    }
}
