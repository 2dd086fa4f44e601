//! The rules, the fuzz properties and the in-memory backend, with no server to start.

/// The shared test support: the modules of `tests/support/` this binary uses. Like the tests,
/// it panics on what it does not expect.
#[path = "../support"]
#[allow(clippy::unwrap_used)]
mod support {
    pub(crate) mod app;
    pub(crate) mod backend;
    pub(crate) mod conformance;
    pub(crate) mod rng;
    pub(crate) mod scenarios;
    pub(crate) mod telemetry;
}

mod conformance;
mod fairness;
mod fuzz_regressions;
mod idle;
mod memory;
mod metrics;
mod mongodb;
mod one_band;
mod outage;
mod paths;
mod reload;
mod rule_files;
mod spans;
mod typed_keys;
mod wait;
mod watch;
