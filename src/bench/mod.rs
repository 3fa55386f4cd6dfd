//! Benchmarks that print tables and run in one process: `shoal bench codec`,
//! `shoal bench transfer`, `shoal bench allreduce`, `shoal bench stage` and `shoal bench streams`. (`shoal bench swarm` starts `shoal`
//! processes, so it lives in the binary's harness, not here.)
//!
//! A benchmark measures and reports; it never asserts a speed (tests do not fail on timing).

pub mod allreduce;
pub mod codec;
pub mod stage;
pub mod streams;
pub mod transfer;
