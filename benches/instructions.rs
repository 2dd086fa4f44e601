//! A fixed workload for instruction counts: run under `valgrind --tool=callgrind` by
//! `scripts/instructions.sh`, which runs each variant twice with different request counts
//! and divides the difference by the difference of the counts (so the set-up and warm-up
//! cancel out).
//!
//! Usage: `instructions <variant> <requests>`, with the variants
//! - `engine_1x1`, `engine_3x2`: `Engine::check` in memory, the rule sets of
//!   `benches/engine.rs`, over 10,000 client addresses;
//! - `floor_1x1`: the least a decision of `engine_1x1` can cost (`support/floor.rs`), over
//!   the same addresses;
//! - `layer_bare`, `layer_identity`, `layer_fluxgate`, `layer_fluxgate_legacy`,
//!   `layer_governor`: one request through the axum apps of `benches/layer.rs` (bare; with
//!   a layer that does nothing, which is what axum's wrapping of a layered route costs;
//!   FluxGate's layer with the default options and with the legacy headers only;
//!   `tower_governor` with `use_headers()`), over 1,000 client addresses;
//! - `layer_fluxgate_no_headers`: FluxGate's layer with no header at all and no user or
//!   API-key header read (the decision alone);
//! - `layer_headers_5`, `layer_headers_3`, `layer_headers_2`, `layer_headers_0`: the bare
//!   app behind a layer that only adds 5, 3, 2 or no rate-limit headers of constant values
//!   (FluxGate's default headers, its legacy ones, `tower_governor`'s, none): what writing
//!   them costs at least.
//!
//! Without arguments (as `cargo bench` runs it) it runs every variant briefly and prints
//! the time per request: a smoke test, not a measurement.

#![allow(missing_docs)]

#[path = "support/apps.rs"]
mod apps;

#[path = "support/floor.rs"]
mod floor;

use std::hint::black_box;
use std::time::Instant;

use axum::body::Body;
use axum::Router;
use fluxgate::{Engine, RequestContext};
use http::Request;
use tower::{Service, ServiceExt};

const VARIANTS: [&str; 6] = [
    "engine_1x1",
    "engine_3x2",
    "floor_1x1",
    "layer_bare",
    "layer_fluxgate",
    "layer_governor",
];

fn engine_loop(engine: &Engine, ctxs: &[RequestContext], n: usize) {
    for i in 0..n {
        let d = engine
            .check(&ctxs[i % ctxs.len()])
            .into_ready()
            .expect("in memory")
            .expect("decision");
        assert!(d.allowed());
        black_box(d);
    }
}

fn layer_loop(rt: &tokio::runtime::Runtime, app: &Router, clients: u32, n: usize) {
    rt.block_on(async {
        let mut svc = app.clone();
        for i in 0..n {
            let resp = ServiceExt::<Request<Body>>::ready(&mut svc)
                .await
                .expect("ready")
                .call(apps::request(i as u32, clients))
                .await
                .expect("response");
            assert!(resp.status().is_success());
            black_box(resp);
        }
    });
}

/// Warms the variant up (every key seen once), then runs `n` requests.
fn run(variant: &str, n: usize) {
    match variant {
        "engine_1x1" | "engine_3x2" => {
            let yaml = if variant == "engine_1x1" {
                apps::ONE_RULE
            } else {
                apps::THREE_RULES
            };
            let engine = apps::engine(yaml, 1_000_000);
            let ctxs = apps::contexts(10_000);
            engine_loop(&engine, &ctxs, ctxs.len());
            engine_loop(&engine, &ctxs, n);
        }
        "floor_1x1" => {
            let floor = floor::Floor::new(1_000_000_000, 3_600_000_000_000);
            let ctxs = apps::contexts(10_000);
            for ctx in &ctxs {
                floor.decide(ctx);
            }
            for i in 0..n {
                let figures = floor.decide(&ctxs[i % ctxs.len()]);
                assert!(figures.allowed);
                black_box(figures);
            }
        }
        _ => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            let app = match variant {
                "layer_bare" => apps::bare(),
                "layer_identity" => apps::bare().layer(tower::layer::util::Identity::new()),
                "layer_fluxgate" => apps::fluxgate(true, true),
                "layer_fluxgate_legacy" => apps::fluxgate(false, true),
                "layer_governor" => apps::governor(),
                "layer_fluxgate_no_headers" => apps::fluxgate_with(false, false, false),
                "layer_headers_5" => apps::headers_only(5),
                "layer_headers_3" => apps::headers_only(3),
                "layer_headers_2" => apps::headers_only(2),
                "layer_headers_0" => apps::headers_only(0),
                other => panic!("unknown variant `{other}`; the variants are {VARIANTS:?}"),
            };
            layer_loop(&rt, &app, apps::CLIENTS, apps::CLIENTS as usize);
            layer_loop(&rt, &app, apps::CLIENTS, n);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    match args.as_slice() {
        [variant, n] => run(variant, n.parse().expect("a request count")),
        _ => {
            for variant in VARIANTS {
                let start = Instant::now();
                run(variant, 100_000);
                println!("{variant}: {:?} for warm-up and 100,000 requests", start.elapsed());
            }
        }
    }
}
