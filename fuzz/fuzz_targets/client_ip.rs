//! Fuzz target `client_ip`: the property check of the same name in `fuzz/checks.rs`.
#![no_main]

#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::client_ip(data));
