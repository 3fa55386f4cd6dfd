#!/usr/bin/env bash
# Prints the codec table that BENCHMARKS.md records (release build, one thread, 16M floats).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
exec target/release/shoal bench codec "$@"
