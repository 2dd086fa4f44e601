//! The shared decision scenarios, run against the in-memory backend on a paused clock.

use crate::support::backend::Memory;
use crate::support::scenarios::scenario_tests;

scenario_tests!(
    #[tokio::test(start_paused = true)]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    Memory::tokio()
);
