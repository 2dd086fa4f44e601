//! Heap allocations per admitted request on the in-memory path, counted by a counting
//! global allocator: through `Engine::check` alone (1 rule × 1 band, and 3 rules × 2
//! bands), and through the layer on an axum app (less what the same app allocates without
//! the layer).
//!
//! Run without the test harness (`harness = false`), as one function on the main thread:
//! the harness's own main thread, waiting for a test's thread, allocates at moments of its
//! own (4 allocations, in about one run of ten), and no other test may allocate on another
//! thread while this one counts.

#[path = "../../benches/support/apps.rs"]
mod apps;

use std::alloc::System;
use std::net::{IpAddr, Ipv4Addr};

use axum::body::Body;
use axum::Router;
use fluxgate::{Engine, RateLimitLayer, RequestContext, RuleSets};
use http::Request;
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use tower::{Service, ServiceExt};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Requests counted after the warm-up.
const COUNTED: u32 = 2_000;
/// Client addresses the requests rotate over.
const CLIENTS: u32 = 100;

fn engine() -> Engine {
    Engine::in_memory(RuleSets::from_yaml_str(apps::ONE_RULE).expect("rules"))
}

fn ip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i % CLIENTS))
}

/// Allocations and reallocations while `f` runs.
fn allocations(f: impl FnOnce()) -> usize {
    let region = Region::new(GLOBAL);
    f();
    let change = region.change();
    change.allocations + change.reallocations
}

fn request(i: u32) -> Request<Body> {
    apps::request(i, CLIENTS)
}

/// Sends requests `from..to` through `app`, every one admitted.
fn send<S>(rt: &tokio::runtime::Runtime, app: &S, from: u32, to: u32)
where
    S: Service<Request<Body>, Response = http::Response<Body>> + Clone,
    S::Error: std::fmt::Debug,
{
    rt.block_on(async {
        let mut svc = app.clone();
        for i in from..to {
            let resp = ServiceExt::<Request<Body>>::ready(&mut svc)
                .await
                .expect("ready")
                .call(request(i))
                .await
                .expect("response");
            assert!(resp.status().is_success(), "request {i}: {}", resp.status());
        }
    });
}

/// Allocations per request through `app`, after a warm-up of the same length.
fn per_request<S>(rt: &tokio::runtime::Runtime, app: &S) -> f64
where
    S: Service<Request<Body>, Response = http::Response<Body>> + Clone,
    S::Error: std::fmt::Debug,
{
    send(rt, app, 0, COUNTED);
    let n = allocations(|| send(rt, app, COUNTED, 2 * COUNTED));
    n as f64 / f64::from(COUNTED)
}

fn main() {
    admitted_requests_allocate_nothing_but_the_growth_of_the_header_map();
    // As the harness reports a test, for the suite's count.
    println!("test admitted_requests_allocate_nothing_but_the_growth_of_the_header_map ... ok");
    println!("test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out");
}

fn admitted_requests_allocate_nothing_but_the_growth_of_the_header_map() {
    // The engine alone: contexts are built first, so only decisions are counted.
    let engine = engine();
    let ctxs: Vec<RequestContext> = (0..CLIENTS)
        .map(|i| RequestContext::builder().path("/api/items").client_ip(ip(i)).build())
        .collect();
    let decide = |n: u32| {
        for i in 0..n {
            let d = engine
                .check(&ctxs[(i % CLIENTS) as usize])
                .into_ready()
                .expect("in memory")
                .expect("decision");
            assert!(d.allowed());
        }
    };
    decide(COUNTED);
    let engine_allocations = allocations(|| decide(COUNTED));
    println!("engine: {engine_allocations} allocations in {COUNTED} admitted decisions");
    assert_eq!(engine_allocations, 0, "allocations in {COUNTED} decisions");

    // Three rules of two bands (per IP, per user, global; path patterns), with a user.
    let three = Engine::in_memory(RuleSets::from_yaml_str(apps::THREE_RULES).expect("rules"));
    let ctxs: Vec<RequestContext> = (0..CLIENTS)
        .map(|i| {
            RequestContext::builder()
                .path("/api/items")
                .client_ip(ip(i))
                .user_id(format!("user-{}", i % 7))
                .build()
        })
        .collect();
    let decide = |n: u32| {
        for i in 0..n {
            let d = three
                .check(&ctxs[(i % CLIENTS) as usize])
                .into_ready()
                .expect("in memory")
                .expect("decision");
            assert!(d.allowed());
            assert_eq!(d.bands.len(), 6);
        }
    };
    decide(COUNTED);
    let three_allocations = allocations(|| decide(COUNTED));
    println!("engine, 3 rules x 2 bands: {three_allocations} allocations in {COUNTED} admitted decisions");
    assert_eq!(three_allocations, 0, "allocations in {COUNTED} decisions of 3 x 2");

    // The layer around the app, with its default options and with the legacy headers
    // only, against the app alone.
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    let bare = apps::bare();
    let around = |layer: RateLimitLayer| tower::Layer::layer(&layer, bare.clone());
    let bare_per_request = per_request(&rt, &bare);
    let default = per_request(&rt, &around(RateLimitLayer::new(engine.clone()))) - bare_per_request;
    let legacy_layer = RateLimitLayer::builder(engine.clone())
        .ietf_headers(false)
        .build()
        .expect("layer");
    let legacy = per_request(&rt, &around(legacy_layer)) - bare_per_request;
    println!("layer: {default:.3} allocations per admitted request with the default options, {legacy:.3} with the legacy headers only");
    // With the legacy headers only, nothing is allocated but, about once per hundred
    // responses, a new chunk for the header values.
    assert!(
        legacy < 0.05,
        "{legacy:.3} allocations per request with the legacy headers only"
    );
    // With both header families, the response's header map grows once (its table is
    // allocated anew and its entries reallocated): the five rate-limit headers and axum's
    // `content-length` take it past the six entries of its first allocation.
    assert!(
        default < 2.05,
        "{default:.3} allocations per request with the default options (expected the header map's growth only)"
    );

    // For comparison, per route (`Router::layer`), where axum boxes and clones the layered
    // route for each request, whatever the layer.
    let per_route = |app: Router| per_request(&rt, &app) - bare_per_request;
    let identity = per_route(bare.clone().layer(tower::layer::util::Identity::new()));
    let ours = per_route(bare.clone().layer(RateLimitLayer::new(engine.clone())));
    let governor = per_route(apps::governor());
    println!(
        "per route (Router::layer): a layer that does nothing {identity:.3}, FluxGate {ours:.3}, tower_governor {governor:.3} allocations per request"
    );
}
