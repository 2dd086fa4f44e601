//! The rules, the fuzz properties and the in-memory backend, with no server to start.

#[path = "../support/mod.rs"]
mod support;

mod fuzz_regressions;
mod memory;
mod rule_files;
