//! The Redis backend against real `redis-server` processes that the tests start on free
//! loopback ports: the decision scenarios and the conformance suite on a standalone server
//! and on a 3-primary cluster, the differential test against the reference model,
//! refunds across cluster slots, outages and a Sentinel failover.

/// The shared test support: the modules of `tests/support/` this binary uses. Like the tests,
/// it panics on what it does not expect.
#[path = "../support"]
#[allow(clippy::unwrap_used)]
mod support {
    pub(crate) mod app;
    pub(crate) mod backend;
    pub(crate) mod conformance;
    pub(crate) mod lateness;
    pub(crate) mod model;
    pub(crate) mod proxy;
    pub(crate) mod redis;
    pub(crate) mod rng;
    pub(crate) mod scenarios;
    pub(crate) mod servers;
    pub(crate) mod telemetry;
}

mod backend;
mod batching;
mod calls_in_flight;
mod changes;
mod client_failures;
mod clock;
mod cluster;
mod conformance;
mod differential;
mod expiry;
mod fairness;
mod leases;
mod memory;
mod metrics;
mod outage;
mod secrets;
mod sentinel;
mod store;
mod waiting;
