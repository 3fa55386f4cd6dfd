//! Benchmarks that print tables: `shoal bench codec`, `shoal bench transfer`,
//! `shoal bench allreduce` and `shoal bench swarm`.
//!
//! A benchmark measures and reports; it never asserts a speed (tests do not fail on timing).

pub mod allreduce;
pub mod codec;
pub mod swarm;
pub mod transfer;
