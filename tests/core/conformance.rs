//! The algorithm conformance suite (`tests/support/conformance.rs`) on the in-memory
//! limiter, on a clock that moves only when a step says so.

use fluxgate::core::ManualClock;

use crate::support::backend::Memory;
use crate::support::conformance::{conformance_tests, START_NANOS};

conformance_tests!(
    #[tokio::test]
    Memory::manual(ManualClock::new(START_NANOS))
);
