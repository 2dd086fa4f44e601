//! The Redis backend against real `redis-server` processes that the tests start on free
//! loopback ports: the decision scenarios and the conformance suite on a standalone server
//! and on a 3-primary cluster, the differential test against the reference model,
//! refunds across cluster slots, outages and a Sentinel failover.

#[path = "../support/mod.rs"]
mod support;

mod backend;
mod cluster;
mod conformance;
mod differential;
mod outage;
mod sentinel;
