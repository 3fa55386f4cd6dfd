//! Benchmarks that print tables: `shoal bench codec` lives here.
//!
//! A benchmark measures and reports; it never asserts a speed (tests do not fail on timing).

pub mod codec;
