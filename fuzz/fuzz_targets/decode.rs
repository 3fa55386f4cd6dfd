//! libFuzzer target: the tensor frame decoder (`fuzz/targets.rs`). Run:
//! `cargo +nightly fuzz run decode`.
#![no_main]

// Each target binary uses one of the shared targets.
#[allow(dead_code)]
#[path = "../targets.rs"]
mod targets;

libfuzzer_sys::fuzz_target!(|data: &[u8]| targets::frame(data));
