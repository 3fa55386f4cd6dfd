//! Benchmarks that print tables: `shoal bench codec` and `shoal bench transfer`.
//!
//! A benchmark measures and reports; it never asserts a speed (tests do not fail on timing).

pub mod codec;
pub mod transfer;
