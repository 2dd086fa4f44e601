//! The customizer closure: a tenant header becomes an attribute, `CF-Connecting-IP`
//! becomes the client IP, and the user comes from an authentication layer's extension.
//!
//! Run with: `cargo run --example customizer` (add `--demo` to exercise it and exit).

use std::net::SocketAddr;

use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use fluxgate::tower::UserId;
use fluxgate::{Engine, RateLimitLayer, RuleSets};
use tower::ServiceExt;

const RULES: &str = r#"
rule_sets:
  - id: default
    rules:
      - id: per-tenant
        scope: attribute
        attribute: tenant
        on_missing_key: skip
        bands: [{ capacity: 3, window: 1m }]
      - id: per-user
        scope: user
        on_missing_key: fallback_ip
        bands: [{ capacity: 5, window: 1m }]
"#;

/// A stand-in authentication layer: `Authorization: Bearer <name>` identifies the user.
async fn auth(mut req: Request, next: Next) -> Response {
    let user = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    if let Some(user) = user {
        req.extensions_mut().insert(UserId(user));
    }
    next.run(req).await
}

fn app() -> Router {
    let rules = RuleSets::from_yaml_str(RULES).expect("valid rules");
    let limiter = RateLimitLayer::builder(Engine::in_memory(rules))
        // The user comes from `auth` alone: a client's own X-User-Id must not choose its
        // counter (an unauthenticated request falls back to its address).
        .no_user_header()
        .customizer(|ctx, parts| {
            if let Some(tenant) = parts.headers.get("x-tenant-id").and_then(|v| v.to_str().ok()) {
                ctx.set_attribute("tenant", tenant);
            }
            // Behind Cloudflare, the client address is in CF-Connecting-IP. Only trust it
            // when every request really comes through Cloudflare.
            if let Some(ip) = parts
                .headers
                .get("cf-connecting-ip")
                .and_then(|v| v.to_str().ok()?.parse().ok())
            {
                ctx.set_client_ip(Some(ip));
            }
        })
        .build()
        .expect("valid layer");
    // Layers wrap from the bottom up: `auth` runs first, then the limiter sees its extension.
    Router::new()
        .route("/api/data", get(|| async { "data\n" }))
        .layer(limiter)
        .layer(middleware::from_fn(auth))
}

#[tokio::main]
async fn main() {
    if std::env::args().any(|a| a == "--demo") {
        demo().await;
        return;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000")
        .await
        .expect("listen on 127.0.0.1:3000");
    println!("listening on http://127.0.0.1:3000");
    println!("  curl -i -H 'x-tenant-id: acme' http://127.0.0.1:3000/api/data   # 3 per minute per tenant");
    println!("  curl -i -H 'authorization: Bearer alice' http://127.0.0.1:3000/api/data   # 5 per minute per user");
    axum::serve(listener, app().into_make_service_with_connect_info::<SocketAddr>())
        .await
        .expect("server");
}

async fn demo() {
    let app = app();
    let send = |headers: &'static [(&'static str, &'static str)]| {
        let app = app.clone();
        async move {
            let mut req = axum::http::Request::builder().uri("/api/data");
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            let mut req = req.body(axum::body::Body::empty()).expect("request");
            req.extensions_mut()
                .insert(axum::extract::ConnectInfo(SocketAddr::from(([192, 0, 2, 1], 5000))));
            let resp = app.oneshot(req).await.expect("infallible");
            (
                resp.status().as_u16(),
                resp.headers()
                    .get("x-ratelimit-remaining")
                    .map(|v| v.to_str().unwrap_or("").to_owned()),
            )
        }
    };
    for i in 1..=4 {
        println!("tenant acme #{i}: {:?}", send(&[("x-tenant-id", "acme")]).await);
    }
    println!("tenant globex:   {:?}", send(&[("x-tenant-id", "globex")]).await);
    for i in 1..=6 {
        println!(
            "user alice #{i}:  {:?}",
            send(&[("authorization", "Bearer alice")]).await
        );
    }
    println!(
        "CF client 198.51.100.7: {:?}",
        send(&[("cf-connecting-ip", "198.51.100.7")]).await
    );
}
