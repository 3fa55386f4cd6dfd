#!/usr/bin/env bash
# Runs the stable-toolchain fuzzers of tests/fuzz.rs (the tensor frame decoder, a replica
# reading a request, a joiner reading a state chunk) for SECS seconds each and prints one
# line per target with its executions and crashes:
#
#   scripts/fuzz.sh [SECS]      # default 60
#
# CI runs the same targets for 3 s each inside `cargo test`. A crash fails the run and
# leaves its input under target/tmp/../fuzz-crashes/.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-60}
SHOAL_FUZZ_SECS=$SECS cargo test --release --test fuzz -- --nocapture --test-threads 1 fuzz_ 2>&1 |
  grep -oE 'fuzz [a-z]+: .*crashes|panicked.*|test result.*'
