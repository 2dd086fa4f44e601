//! Per-request overhead of the rate-limit layer on an axum app, next to `tower_governor`.
//!
//! Run with: `cargo bench --bench layer`
//!
//! Three apps with the same trivial handler: (a) bare, (b) FluxGate's layer with one
//! per-IP rule of one band in memory, (c) `tower_governor` with the same per-IP quota
//! (10^9 per hour; both with their rate-limit headers on). FluxGate runs with its default
//! options (legacy and IETF headers, user and API-key headers read), with the legacy
//! headers only, and with the legacy headers only and no user / API-key headers read (a
//! per-IP limiter like `tower_governor`'s). Every request is admitted (the quota is far
//! above the request rate); clients rotate over 1,000 addresses, and FluxGate with its
//! default options also runs with one client and with 10,000 (one address repeats the same
//! header values from one response to the next; many addresses rarely do), and so does
//! `tower_governor`. The overhead of a layer is its time per request minus the bare app's.

#![allow(missing_docs)]

#[path = "support/apps.rs"]
mod apps;

use std::time::{Duration, Instant};

use apps::{bare, fluxgate, governor, request, CLIENTS};
use axum::body::Body;
use axum::Router;
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use http::Request;
use tower::{Service, ServiceExt};

fn run(rt: &tokio::runtime::Runtime, app: &Router, clients: u32, iters: u64) -> Duration {
    rt.block_on(async {
        let mut svc = app.clone();
        let start = Instant::now();
        for i in 0..iters {
            let resp = ServiceExt::<Request<Body>>::ready(&mut svc)
                .await
                .expect("ready")
                .call(request(i as u32, clients))
                .await
                .expect("response");
            assert!(resp.status().is_success());
            black_box(resp);
        }
        start.elapsed()
    })
}

fn layers(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let apps = [
        ("a_bare", bare(), CLIENTS),
        ("b_fluxgate", fluxgate(true, true), CLIENTS),
        ("b_fluxgate_1_client", fluxgate(true, true), 1),
        ("b_fluxgate_10000_clients", fluxgate(true, true), 10_000),
        ("b_fluxgate_legacy_headers_only", fluxgate(false, true), CLIENTS),
        (
            "b_fluxgate_legacy_headers_no_identity_headers",
            fluxgate(false, false),
            CLIENTS,
        ),
        ("c_tower_governor", governor(), CLIENTS),
        ("c_tower_governor_1_client", governor(), 1),
        ("c_tower_governor_10000_clients", governor(), 10_000),
    ];
    // Warm every limiter with all its clients so no variant pays for first inserts.
    for (_, app, clients) in &apps {
        run(&rt, app, *clients, u64::from(*clients));
    }
    let mut group = c.benchmark_group("layer_per_request");
    for (name, app, clients) in &apps {
        group.bench_function(*name, |b| b.iter_custom(|iters| run(&rt, app, *clients, iters)));
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    targets = layers
}
criterion_main!(benches);
