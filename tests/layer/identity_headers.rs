//! The user and API key a rule counts by: from headers, extensions and a customizer, a
//! forged user header when the header is turned off, and an identity header sent more than
//! once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::response::IntoResponse;
use fluxgate::tower::{ApiKey, UserId};
use http::StatusCode;

use crate::engine;
use crate::support::app::{app, layer, request, send};

#[tokio::test]
async fn customizer_user_and_api_key_sources() {
    let rules = r#"
rule_sets:
  - id: default
    rules:
      - id: per-tenant
        scope: attribute
        attribute: tenant
        on_missing_key: skip
        bands: [{ capacity: 1, window: 1h }]
      - id: per-key
        scope: api_key
        on_missing_key: skip
        bands: [{ capacity: 1, window: 1h }]
  - id: partners
    rules:
      - id: per-user
        scope: user
        on_missing_key: skip
        bands: [{ capacity: 1, window: 1h }]
"#;
    let app = app(layer(engine(rules))
        .customizer(|ctx, parts| {
            if let Some(t) = parts.headers.get("x-tenant-id").and_then(|v| v.to_str().ok()) {
                ctx.set_attribute("tenant", t);
            }
            if parts.headers.contains_key("x-partner") {
                ctx.set_rule_set_id("partners");
            }
        })
        .build()
        .unwrap());
    let tenant = |t: &'static str| request("GET", "/api/users", "192.0.2.40", &[("x-tenant-id", t)]);
    assert_eq!(send(&app, tenant("acme")).await.status, StatusCode::OK);
    assert_eq!(send(&app, tenant("acme")).await.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(send(&app, tenant("globex")).await.status, StatusCode::OK);

    // API key from the header, then from an extension, which wins.
    let keyed = request("GET", "/api/users", "192.0.2.41", &[("x-api-key", "k1")]);
    assert_eq!(send(&app, keyed).await.status, StatusCode::OK);
    let mut ext = request("GET", "/api/users", "192.0.2.41", &[("x-api-key", "k2")]);
    ext.extensions_mut().insert(ApiKey("k1".into()));
    assert_eq!(send(&app, ext).await.status, StatusCode::TOO_MANY_REQUESTS);

    // The customizer picks the partners rule set; the user comes from an extension.
    let partner = |user: &str| {
        let mut r = request(
            "GET",
            "/api/users",
            "192.0.2.42",
            &[("x-partner", "1"), ("x-user-id", "ignored")],
        );
        r.extensions_mut().insert(UserId(user.into()));
        r
    };
    assert_eq!(send(&app, partner("p1")).await.status, StatusCode::OK);
    assert_eq!(send(&app, partner("p1")).await.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(send(&app, partner("p2")).await.status, StatusCode::OK);
}

/// The user header is the client's to write: with the header turned off, as when an
/// authentication layer provides the user, a client's own `X-User-Id` chooses no counter
/// and the rule falls back to the address.
#[tokio::test]
async fn a_forged_user_header_chooses_no_counter_when_the_header_is_off() {
    const PER_USER: &str = "rule_sets: [{id: default, rules: [{id: per-user, scope: user, \
        on_missing_key: fallback_ip, bands: [{capacity: 2, window: 1h}]}]}]";
    let app_with = |on: bool| {
        let builder = layer(engine(PER_USER));
        app((if on { builder } else { builder.no_user_header() }).build().unwrap())
    };
    let open = app_with(true);
    let req = request("GET", "/api/users", "192.0.2.92", &[("x-user-id", "alice")]);
    assert_eq!(
        send(&open, req).await.num("x-ratelimit-remaining"),
        1,
        "alice's counter"
    );
    // Turned off: ten forged ids are one client, its address.
    let closed = app_with(false);
    let mut admitted = 0;
    for i in 0..10 {
        let user = format!("forged-{i}");
        let r = send(
            &closed,
            request("GET", "/api/users", "192.0.2.90", &[("x-user-id", &user)]),
        )
        .await;
        admitted += usize::from(r.status == StatusCode::OK);
    }
    assert_eq!(admitted, 2, "ten forged X-User-Id values counted as one address");
}

/// An identity header sent several times with different values names no counter: an
/// application reads the first instance (`HeaderMap::get`, as the API-key check below does)
/// and a proxy that appends writes the last, so whichever the layer read, the client would
/// choose its counter with the other; and a counter all such requests shared would be a
/// second quota for every client. An enforced rule keyed by the header refuses such a
/// request (`400`), and the handler never runs for it.
#[tokio::test]
async fn a_repeated_identity_header_is_refused_by_the_rules_that_count_by_it() {
    const RULES: &str = "rule_sets: [{id: default, rules: [\
        {id: per-key, match: {paths: [\"/api/**\"]}, scope: api_key, bands: [{capacity: 2, window: 1h}]}, \
        {id: per-user, match: {paths: [\"/user\"]}, scope: user, bands: [{capacity: 2, window: 1h}]}, \
        {id: per-ip-user, match: {paths: [\"/both\"]}, scope: composite, fields: [ip, user], bands: [{capacity: 2, window: 1h}]}, \
        {id: watched, mode: shadow, match: {paths: [\"/watched\"]}, scope: api_key, bands: [{capacity: 1, window: 1h}]}, \
        {id: per-ip, match: {paths: [\"/open\", \"/watched\"]}, bands: [{capacity: 100, window: 1h}]}]}]";
    // One rule alone: the engine's path for a rule set of one rule of one band.
    const ONE_RULE: &str =
        "rule_sets: [{id: default, rules: [{id: per-key, scope: api_key, bands: [{capacity: 2, window: 1h}]}]}]";
    let runs = Arc::new(AtomicUsize::new(0));
    let app_of = |rules: &str| {
        let counted = runs.clone();
        axum::Router::new()
            .route(
                "/api/data",
                axum::routing::get(move || {
                    counted.fetch_add(1, Ordering::SeqCst);
                    async { "data" }
                }),
            )
            .route("/user", axum::routing::get(|| async { "user" }))
            .route("/both", axum::routing::get(|| async { "both" }))
            .route("/open", axum::routing::get(|| async { "open" }))
            .route("/watched", axum::routing::get(|| async { "watched" }))
            // The application's own API-key check: the first instance, as `HeaderMap::get`
            // reads.
            .layer(axum::middleware::from_fn(
                |req: axum::extract::Request, next: axum::middleware::Next| async move {
                    match req.headers().get("x-api-key").map(|v| v.as_bytes()) {
                        Some(b"valid-key") | None => next.run(req).await,
                        Some(_) => StatusCode::UNAUTHORIZED.into_response(),
                    }
                },
            ))
            .layer(layer(engine(rules)).build().unwrap())
    };
    let with = |path: &str, peer: &str, name: &'static str, values: &[&str]| {
        let mut req = request("GET", path, peer, &[]);
        for v in values {
            req.headers_mut().append(name, v.parse().expect("a header value"));
        }
        req
    };
    for (rules, peer) in [(RULES, "192.0.2.95"), (ONE_RULE, "192.0.2.105")] {
        runs.store(0, Ordering::SeqCst);
        let app = app_of(rules);
        // The key's own quota: two, then refused.
        let mut statuses = Vec::new();
        for _ in 0..3 {
            statuses.push(
                send(&app, with("/api/data", peer, "x-api-key", &["valid-key"]))
                    .await
                    .status,
            );
        }
        // A fresh second `X-API-Key` with each request: refused, not a second quota.
        for i in 0..3 {
            let fresh = format!("fresh-{i}");
            let r = send(&app, with("/api/data", peer, "x-api-key", &["valid-key", &fresh])).await;
            statuses.push(r.status);
        }
        use StatusCode as S;
        assert_eq!(
            statuses,
            [
                S::OK,
                S::OK,
                S::TOO_MANY_REQUESTS,
                S::BAD_REQUEST,
                S::BAD_REQUEST,
                S::BAD_REQUEST
            ],
            "{rules}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{rules}");
        // The same value repeated is that value: another key's counter, spent by one.
        let other = "192.0.2.200";
        let once = send(&app, with("/api/data", other, "x-api-key", &["valid-key"])).await;
        assert_eq!(
            once.status,
            S::TOO_MANY_REQUESTS,
            "the key's counter is spent, whatever the address"
        );
        let twice = send(&app, with("/api/data", other, "x-api-key", &["valid-key", "valid-key"])).await;
        assert_eq!(twice.status, S::TOO_MANY_REQUESTS, "a repeated value is that value");
    }
    let app = app_of(RULES);
    // The user header likewise, alone and in a composite key: a forged first `X-User-Id`
    // before alice's (a proxy that appends) neither spends alice's counter nor opens a new
    // one.
    for path in ["/user", "/both"] {
        for i in 0..3 {
            let forged = format!("forged-{i}");
            let r = send(&app, with(path, "192.0.2.98", "x-user-id", &[&forged, "alice"])).await;
            assert_eq!(
                r.status,
                StatusCode::BAD_REQUEST,
                "{path}: request {i} with a forged X-User-Id"
            );
        }
        let alice = send(&app, with(path, "192.0.2.98", "x-user-id", &["alice"])).await;
        assert_eq!(alice.num("x-ratelimit-remaining"), 1, "{path}: alice's counter");
    }
    // A rule that does not count by the header, and a shadow rule that does, leave such a
    // request alone.
    for path in ["/open", "/watched"] {
        for _ in 0..3 {
            let r = send(&app, with(path, "192.0.2.99", "x-api-key", &["valid-key", "other"])).await;
            assert_eq!(r.status, StatusCode::OK, "{path}");
        }
    }
}
