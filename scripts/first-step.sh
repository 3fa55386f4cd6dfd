#!/usr/bin/env bash
# Time to the first step of a fresh, hand-started swarm on 127.0.0.1:
#
#   scripts/first-step.sh [STAGES [REPLICAS]]     (default 3 stages x 2 replicas)
#
# A bootstrap peer, then the other peers together with --stage auto --trainers 0, and one
# `shoal train`; prints one JSON line with the seconds from launch to the last peer's
# `ready`, to the first step applied on every stage, and between the two. Builds nothing:
# run `cargo build --release` first (or set SHOAL).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 scripts/first-step.py "$@"
