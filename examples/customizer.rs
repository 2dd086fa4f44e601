//! The customizer closure: the tenant of the authenticated user becomes an attribute,
//! `CF-Connecting-IP` becomes the client IP when the request comes from Cloudflare, and
//! the user comes from an authentication layer's extension.
//!
//! Run with: `cargo run --example customizer` (add `--demo` to exercise it and exit).
//!
//! Every value a rule counts by is one the client cannot choose: the user and the tenant
//! come from the authentication layer (a client's own `X-User-Id` or `X-Tenant-Id` would
//! name a fresh counter with each request), and `CF-Connecting-IP` is believed only from
//! Cloudflare's addresses (from anyone else it is the client's to write).

use std::net::{IpAddr, SocketAddr};

use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use fluxgate::tower::{ClientIpResolver, IpNet, UserId};
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
        bands: [{ capacity: 5, window: 1m }]
      - id: per-user
        scope: user
        on_missing_key: fallback_ip
        bands: [{ capacity: 3, window: 1m }]
"#;

/// Cloudflare's address ranges, whose `CF-Connecting-IP` is believed: the list published at
/// <https://www.cloudflare.com/ips/> (keep it current). Behind another proxy, use the
/// layer's `trusted_proxies` and `forwarded_for_header` instead.
const CLOUDFLARE: &[&str] = &[
    "173.245.48.0/20",
    "103.21.244.0/22",
    "103.22.200.0/22",
    "103.31.4.0/22",
    "141.101.64.0/18",
    "108.162.192.0/18",
    "190.93.240.0/20",
    "188.114.96.0/20",
    "197.234.240.0/22",
    "198.41.128.0/17",
    "162.158.0.0/15",
    "104.16.0.0/13",
    "104.24.0.0/14",
    "172.64.0.0/13",
    "131.0.72.0/22",
    "2400:cb00::/32",
    "2606:4700::/32",
    "2803:f800::/32",
    "2405:b500::/32",
    "2405:8100::/32",
    "2a06:98c0::/29",
    "2c0f:f248::/32",
];

/// The tenant of the authenticated user, as a request extension.
#[derive(Debug, Clone)]
struct Tenant(String);

/// A stand-in authentication layer: `Authorization: Bearer <name>` names one of its
/// accounts, and the account names its tenant (a real one checks a token and reads its
/// claims). A name that is no account authenticates nothing: were it a user, a client
/// sending a new name with each request would get a fresh per-user counter each time.
async fn auth(mut req: Request, next: Next) -> Response {
    let user = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    let tenant = match user.as_deref() {
        Some("alice" | "bob") => Some("acme"),
        Some("carol") => Some("globex"),
        _ => None,
    };
    if let (Some(user), Some(tenant)) = (user, tenant) {
        req.extensions_mut().insert(Tenant(tenant.to_owned()));
        req.extensions_mut().insert(UserId(user));
    }
    next.run(req).await
}

/// Whether `peer` is one of Cloudflare's addresses.
fn is_cloudflare(cloudflare: &[IpNet], peer: IpAddr) -> bool {
    cloudflare.iter().any(|net| net.contains(peer))
}

fn app() -> Router {
    let rules = RuleSets::from_yaml_str(RULES).expect("valid rules");
    let cloudflare: Vec<IpNet> = CLOUDFLARE.iter().map(|net| net.parse().expect("a network")).collect();
    let limiter = RateLimitLayer::builder(Engine::in_memory(rules))
        // The user comes from `auth` alone: a client's own X-User-Id must not choose its
        // counter (an unauthenticated request falls back to its address).
        .no_user_header()
        .no_api_key_header()
        .customizer(move |ctx, parts| {
            // The tenant of the authenticated user, never a header the client writes.
            if let Some(Tenant(tenant)) = parts.extensions.get::<Tenant>() {
                ctx.set_attribute("tenant", tenant);
            }
            // Cloudflare writes the client's address in CF-Connecting-IP. Believe it only
            // when the peer is Cloudflare: from anyone else it is the client's to write, and
            // a new address with each request would be a new per-IP counter.
            let from_cloudflare =
                ClientIpResolver::peer(&parts.extensions).is_some_and(|peer| is_cloudflare(&cloudflare, peer));
            if from_cloudflare {
                if let Some(ip) = parts
                    .headers
                    .get("cf-connecting-ip")
                    .and_then(|v| v.to_str().ok()?.trim().parse().ok())
                {
                    ctx.set_client_ip(Some(ip));
                }
            }
        })
        .build()
        .expect("valid layer");
    // Layers wrap from the bottom up: `auth` runs first, then the limiter sees its extensions.
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
    println!("  curl -i -H 'authorization: Bearer alice' http://127.0.0.1:3000/api/data   # 3 per minute per user, 5 per tenant");
    println!("  curl -i http://127.0.0.1:3000/api/data   # unauthenticated: 3 per minute per address");
    axum::serve(listener, app().into_make_service_with_connect_info::<SocketAddr>())
        .await
        .expect("server");
}

async fn demo() {
    let app = app();
    let send = |peer: [u8; 4], headers: &'static [(&'static str, &'static str)]| {
        let app = app.clone();
        async move {
            let mut req = axum::http::Request::builder().uri("/api/data");
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            let mut req = req.body(axum::body::Body::empty()).expect("request");
            req.extensions_mut()
                .insert(axum::extract::ConnectInfo(SocketAddr::from((peer, 5000))));
            let resp = app.oneshot(req).await.expect("infallible");
            let header = |name: &str| {
                resp.headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("-")
                    .to_owned()
            };
            format!(
                "{} remaining={} ratelimit={}",
                resp.status().as_u16(),
                header("x-ratelimit-remaining"),
                header("ratelimit")
            )
        }
    };
    const CLIENT: [u8; 4] = [192, 0, 2, 1];
    for i in 1..=4 {
        println!(
            "alice (acme) #{i}:  {}",
            send(CLIENT, &[("authorization", "Bearer alice")]).await
        );
    }
    for i in 1..=3 {
        println!(
            "bob (acme) #{i}:    {}",
            send(CLIENT, &[("authorization", "Bearer bob")]).await
        );
    }
    println!(
        "carol (globex):   {}",
        send(CLIENT, &[("authorization", "Bearer carol")]).await
    );
    // A client's own X-User-Id and X-Tenant-Id choose nothing: these count against its address.
    for i in 1..=4 {
        println!(
            "forged ids #{i}:    {}",
            send(
                [192, 0, 2, 2],
                &[("x-user-id", "someone-else"), ("x-tenant-id", "globex")]
            )
            .await
        );
    }
    // A bearer name that is no account authenticates nothing: these count against the address.
    const UNKNOWN: [&[(&str, &str)]; 4] = [
        &[("authorization", "Bearer mallory1")],
        &[("authorization", "Bearer mallory2")],
        &[("authorization", "Bearer mallory3")],
        &[("authorization", "Bearer mallory4")],
    ];
    for (i, headers) in UNKNOWN.into_iter().enumerate() {
        println!("unknown name #{}: {}", i + 1, send([192, 0, 2, 4], headers).await);
    }
    // CF-Connecting-IP from a peer that is not Cloudflare is the client's own: ignored.
    for i in 1..=4 {
        println!(
            "forged CF #{i}:     {}",
            send([192, 0, 2, 3], &[("cf-connecting-ip", "198.51.100.7")]).await
        );
    }
    println!(
        "via Cloudflare:   {}",
        send([173, 245, 48, 1], &[("cf-connecting-ip", "198.51.100.7")]).await
    );
}
