#!/usr/bin/env bash
# A soak of a demo-sized swarm with churn:
#
#   scripts/soak.sh MINUTES
#
# The tiny run in its stages x 2 replicas of `shoal peer` and one `shoal train` on
# 127.0.0.1; a replica killed (SIGKILL) and replaced every CHURN_S seconds (default 120);
# every process's RSS and open file descriptors sampled every SAMPLE_S seconds (default
# 15). Prints one JSON line (RSS growth after warm-up, fd counts, fed/completed/failed and
# vanished samples) and exits non-zero when RSS grew 5% or more after warm-up, fds grew,
# or a sample vanished. Builds nothing: run `cargo build --release` first (or set SHOAL).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { echo "usage: $0 MINUTES" >&2; exit 2; }
exec python3 scripts/soak.py "$1"
