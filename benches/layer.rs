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
//!
//! For a breakdown, more apps run beside them: FluxGate's layer with no header at all (the
//! decision alone), a layer that does nothing (what axum's wrapping of a layered route
//! costs), and layers that only add 5, 3, 2 or no rate-limit headers of constant values
//! (FluxGate's default headers, its legacy ones, `tower_governor`'s, none): what writing
//! them into axum's responses costs at least, with no decision made.
//! Before criterion measures each variant on its own, an interleaved comparison runs the
//! variants in turn for 21 rounds and prints the median of each, with each layer's overhead
//! as a multiple of `tower_governor`'s (with as many clients): on a shared machine whose
//! speed drifts, that ratio is the figure to read.

#![allow(missing_docs)]

#[path = "support/apps.rs"]
mod apps;

use std::time::{Duration, Instant};

use apps::{bare, fluxgate, fluxgate_with, governor, headers_only, request, CLIENTS};
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

/// Rounds of the interleaved comparison, and requests per variant per round.
const ROUNDS: usize = 21;
const PER_ROUND: u64 = 20_000;

/// The variants in turn, round after round, so that a machine whose speed drifts (other
/// processes, frequency) slows them all alike; the median time per request of each, and
/// each layer's overhead over the bare app next to `tower_governor`'s with as many
/// clients. Criterion then measures each variant on its own.
fn interleaved(rt: &tokio::runtime::Runtime, apps: &[(&str, Router, u32)]) {
    let mut samples = vec![Vec::with_capacity(ROUNDS); apps.len()];
    for _ in 0..ROUNDS {
        for ((_, app, clients), times) in apps.iter().zip(&mut samples) {
            let t = run(rt, app, *clients, PER_ROUND);
            times.push(t.as_secs_f64() * 1e9 / PER_ROUND as f64);
        }
    }
    let median: Vec<f64> = samples
        .iter_mut()
        .map(|t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect();
    let bare = median[0];
    let governor = |clients: u32| {
        apps.iter()
            .zip(&median)
            .find(|((name, _, c), _)| name.starts_with("c_") && *c == clients)
            .map(|(_, m)| m - bare)
    };
    println!("interleaved: {ROUNDS} rounds of {PER_ROUND} requests per variant, median time per request");
    println!("| variant | clients | ns per request | overhead over the bare app | overhead / tower_governor's |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for ((name, _, clients), m) in apps.iter().zip(&median) {
        let overhead = m - bare;
        let ratio = governor(*clients)
            .filter(|_| !name.starts_with("a_"))
            .map_or(String::new(), |g| format!("{:.2}", overhead / g));
        println!("| {name} | {clients} | {m:.0} | {overhead:.0} | {ratio} |");
    }
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
        ("d_fluxgate_no_headers", fluxgate_with(false, false, false), CLIENTS),
        (
            "d_identity_layer",
            bare().layer(tower::layer::util::Identity::new()),
            CLIENTS,
        ),
        ("d_headers_only_5", headers_only(5), CLIENTS),
        ("d_headers_only_3", headers_only(3), CLIENTS),
        ("d_headers_only_2", headers_only(2), CLIENTS),
        ("d_headers_only_0", headers_only(0), CLIENTS),
        ("c_tower_governor", governor(), CLIENTS),
        ("c_tower_governor_1_client", governor(), 1),
        ("c_tower_governor_10000_clients", governor(), 10_000),
    ];
    // Warm every limiter with all its clients so no variant pays for first inserts.
    for (_, app, clients) in &apps {
        run(&rt, app, *clients, u64::from(*clients));
    }
    interleaved(&rt, &apps);
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
