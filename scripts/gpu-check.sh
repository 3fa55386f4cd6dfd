#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, with the binary scripts/cuda-build.sh made:
#   scripts/gpu-check.sh [SHOAL]        (default target/cuda/release/shoal)
# 1. on cuda:0, staged gradients equal the unsplit model's (gpt and llama families), and
#    one stage of gpt2-124m trains forward+backward at N tokens/s in f32 and bf16;
# 2. a 2-peer swarm on the GPU (llama-tiny, one stage per peer on cuda:0, a trainer) trains
#    30 steps and its loss falls.
# Prints the figures; exits non-zero when a check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
SHOAL=${1:-target/cuda/release/shoal}
DEV=${DEVICE:-cuda:0}
[ -x "$SHOAL" ] || { echo "no $SHOAL (build it with scripts/cuda-build.sh)" >&2; exit 1; }
W=$(mktemp -d)
PIDS=()
trap 'for p in "${PIDS[@]:-}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$W"' EXIT
echo "== stage throughput and gradient check on $DEV"
"$SHOAL" bench stage --config configs/gpt2-124m.toml --stage 1 --device "$DEV" --dtypes f32,bf16 --seconds 10
"$SHOAL" bench stage --config configs/llama-tiny.toml --stage 0 --device "$DEV" --dtypes f32,bf16 --seconds 5
echo "== a 2-peer swarm on $DEV"
sed 's/^steps = .*/steps = 30/' configs/llama-tiny.toml >"$W/cfg.toml"
"$SHOAL" run new "$W/cfg.toml" --out "$W/run.toml" >/dev/null 2>&1
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
P0=$(port)
"$SHOAL" peer --run "$W/run.toml" --listen "/ip4/127.0.0.1/tcp/$P0" --identity "$W/a.key" --stage 0 \
  --device "$DEV" --trainers 0 --events "$W/a.events" >"$W/a.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 120); do grep -q '"event":"ready"' "$W/a.events" 2>/dev/null && break; sleep 0.5; done
ID=$(python3 -c 'import json,sys;print([json.loads(l)["peer"] for l in open(sys.argv[1]) if "\"ready\"" in l][0])' "$W/a.events")
BOOT=/ip4/127.0.0.1/tcp/$P0/p2p/$ID
"$SHOAL" peer --run "$W/run.toml" --listen /ip4/127.0.0.1/tcp/0 --identity "$W/b.key" --stage 1 \
  --device "$DEV" --trainers 0 --bootstrap "$BOOT" --events "$W/b.events" >"$W/b.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 120); do grep -q '"event":"ready"' "$W/b.events" 2>/dev/null && break; sleep 0.5; done
SECONDS=0
timeout 600 "$SHOAL" train --run "$W/run.toml" --bootstrap "$BOOT" --events "$W/t.events" >"$W/t.log" 2>&1
python3 - "$W/t.events" "$SECONDS" <<'PY'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
done = [e for e in ev if e.get("event") == "done"]
prog = [e for e in ev if e.get("event") == "progress"]
if not done:
    sys.exit("the trainer did not finish")
p = done[-1]["progress"]
losses = [e["progress"]["loss"] for e in prog if e["progress"].get("completed", 0) > 0]
first, last = (losses[0], p["loss"]) if losses else (float("nan"), p["loss"])
print(f"swarm on the GPU: {p['completed']} samples, step {p['step']}, in {sys.argv[2]} s; loss {first:.3f} -> {last:.3f}")
if not last < first:
    sys.exit("the swarm's loss did not fall")
PY
