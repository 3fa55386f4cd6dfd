//! libFuzzer target: a joiner reading a state chunk's response (`fuzz/targets.rs`). Run:
//! `cargo +nightly fuzz run chunk`.
#![no_main]

// Each target binary uses one of the shared targets.
#[allow(dead_code)]
#[path = "../targets.rs"]
mod targets;

libfuzzer_sys::fuzz_target!(|data: &[u8]| targets::chunk(data));
