//! The Redis servers of the test support, for the benchmarks (`benches/redis.rs` mounts
//! this file and uses `redis::RedisServer` alone, hence the `allow`). The test binaries do
//! not mount it: each mounts the modules of this directory it uses, all of each, in its
//! `main.rs`.
#![allow(dead_code)]

pub(crate) mod app;
pub(crate) mod backend;
pub(crate) mod redis;
