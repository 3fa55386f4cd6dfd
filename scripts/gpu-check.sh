#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, with the binary scripts/cuda-build.sh made:
#   scripts/gpu-check.sh [SHOAL]        (default target/cuda/release/shoal)
# 1. on cuda:0, staged gradients equal the unsplit model's (gpt and llama families), and
#    one stage of gpt2-124m trains forward+backward at N tokens/s in f32 and bf16;
# 2. a 3-peer swarm on the GPU (llama-tiny: stage 0, and two replicas of stage 1 that
#    average their gradients, all on cuda:0; a trainer) trains 30 steps, its loss falls, and
#    the two replicas end bit-identical (same step and parameter hash in their checkpoints);
# 3. where python3 has torch: shoal against PyTorch on the GPU (scripts/parity.sh at a GPU
#    shape: d768, 12 layers, seq 1024, batch 8, byte tokens; STEPS, default 40);
# 4. unless NO_BIG is set: one stage of configs/llama-1b.toml (264M parameters), f32 and bf16.
# 5. unless NO_BIG is set: GPT-2 small in 4 stages (one a pair of replicas), 10 synchronous
#    steps of 4 microbatches (target 32, microbatch 8), samples/s against the stages' own.
# ONLY="stages swarm versus-torch big-stage big-swarm" (any of them) runs those alone.
# Prints the figures; exits non-zero when a check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
SHOAL=${1:-target/cuda/release/shoal}
DEV=${DEVICE:-cuda:0}
[ -x "$SHOAL" ] || { echo "no $SHOAL (build it with scripts/cuda-build.sh)" >&2; exit 1; }
# The binary links the CUDA runtime, cuBLAS and cuRAND (13.x). Where no toolkit is installed,
# take them from a python's nvidia wheels (PyTorch's, say) when it has them.
if ldd "$SHOAL" | grep -q 'not found'; then
  LIBS=$(python3 - <<'PY' 2>/dev/null || true
import glob, os
try:
    import nvidia
except ImportError:
    raise SystemExit
print(":".join(sorted({os.path.dirname(p) for base in nvidia.__path__
                       for p in glob.glob(os.path.join(base, "**", "lib*.so.*"), recursive=True)})))
PY
)
  export LD_LIBRARY_PATH=${LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  if ldd "$SHOAL" | grep -q 'not found'; then
    echo "$SHOAL is missing libraries: $(ldd "$SHOAL" | grep 'not found' | awk '{print $1}' | tr '\n' ' ')" >&2
    exit 1
  fi
fi
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
FAILS=()
# Each check runs on its own (a failed one does not stop the next) and with set -e.
check() {  # NAME FUNCTION
  "$2" &
  wait $! || FAILS+=("$1")
}

stages() {
  echo "== stage throughput and gradient check on $DEV"
  "$SHOAL" bench stage --config configs/gpt2-124m.toml --stage 1 --device "$DEV" --dtypes f32,bf16 --seconds 10
  "$SHOAL" bench stage --config configs/llama-tiny.toml --stage 0 --device "$DEV" --dtypes f32,bf16 --seconds 5
}

# A swarm on $DEV: one peer per entry of STAGES (the stage it serves; a stage listed twice
# gets two replicas, which average), then a trainer until the run's last step. Passes when
# the loss fell and every stage's replicas end bit-identical (same step and parameter hash in
# the checkpoints they write on SIGTERM).
swarm_of() {  # CONFIG STAGES...
  local cfg=$1
  shift
  PIDS=()
  trap 'rc=$?; kill "${PIDS[@]}" 2>/dev/null || true; [ $rc -eq 0 ] || tail -n 3 "$W"/*.log 2>/dev/null || true' EXIT
  "$SHOAL" run new "$cfg" --out "$W/run.toml" >/dev/null 2>&1
  local p0 i=0 boot="" st
  p0=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
  for st in "$@"; do
    local listen=/ip4/127.0.0.1/tcp/0 extra=()
    [ $i -eq 0 ] && listen=/ip4/127.0.0.1/tcp/$p0
    [ -n "$boot" ] && extra=(--bootstrap "$boot")
    "$SHOAL" peer --run "$W/run.toml" --listen "$listen" --identity "$W/p$i.key" --stage "$st" \
      --device "$DEV" --trainers 0 --events "$W/p$i.events" --checkpoint "$W/p$i.ckpt" "${extra[@]}" >"$W/p$i.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 240); do grep -q '"event":"ready"' "$W/p$i.events" 2>/dev/null && break; sleep 0.5; done
    if [ $i -eq 0 ]; then
      boot=/ip4/127.0.0.1/tcp/$p0/p2p/$(python3 -c 'import json,sys;print([json.loads(l)["peer"] for l in open(sys.argv[1]) if "\"ready\"" in l][0])' "$W/p0.events")
    fi
    i=$((i + 1))
  done
  SECONDS=0
  timeout "${SWARM_TIMEOUT:-240}" "$SHOAL" train --run "$W/run.toml" --bootstrap "$boot" --events "$W/t.events" --report-ms 100 >"$W/t.log" 2>&1
  local took=$SECONDS
  # The replicas finish the last round, then write their checkpoints on SIGTERM.
  sleep 3
  kill -TERM "${PIDS[@]}"
  wait "${PIDS[@]}" || true
  python3 - "$W" "$took" "$@" <<'PY'
import json, sys
w, took, stages = sys.argv[1], sys.argv[2], sys.argv[3:]
ev = [json.loads(l) for l in open(f"{w}/t.events")]
done = [e for e in ev if e.get("event") == "done"]
prog = [e for e in ev if e.get("event") == "progress"]
if not done:
    sys.exit("the trainer did not finish")
p = done[-1]["progress"]
losses = [e["progress"]["loss"] for e in prog if e["progress"].get("completed", 0) > 0]
first, last = (losses[0], p["loss"]) if losses else (float("nan"), p["loss"])
print(f"swarm on the GPU: {p['completed']} samples, step {p['step']}, in {took} s "
      f"({p['completed'] / max(float(took), 1e-9):.1f} samples/s); loss {first:.3f} -> {last:.3f}")
by_stage = {}
for i, st in enumerate(stages):
    c = [json.loads(l) for l in open(f"{w}/p{i}.events") if '"checkpointed"' in l]
    by_stage.setdefault(st, []).append((c[-1]["step"], c[-1]["params_hash"]) if c else None)
print(f"replicas at exit (step, parameter hash) by stage: {by_stage}")
# Each stage's own throughput (what its replicas measured and announced, summed over them):
# the swarm against its slowest stage.
tp = {}
for i, st in enumerate(stages):
    s = [json.loads(l) for l in open(f"{w}/p{i}.events") if '"serving"' in l]
    if s:
        tp[st] = tp.get(st, 0.0) + s[-1]["samples_per_s"]
if tp:
    slowest = min(tp.values())
    rate = p["completed"] / max(float(took), 1e-9)
    print(f"stages' own throughput (samples/s): {dict(sorted(tp.items()))}; the swarm at "
          f"{rate / slowest:.2f} of the slowest stage (goal >= 0.6; startup included)")
if not last < first:
    sys.exit("the swarm's loss did not fall")
for st, ck in by_stage.items():
    if None in ck or len(set(ck)) != 1:
        sys.exit(f"stage {st}'s replicas differ (or did not checkpoint)")
PY
}

swarm() {
  echo "== a 3-peer swarm on $DEV (stage 0, and two replicas of stage 1 averaging on the GPU)"
  sed 's/^steps = .*/steps = 30/' configs/llama-tiny.toml >"$W/cfg.toml"
  swarm_of "$W/cfg.toml" 0 1 1
}

big_swarm() {
  echo "== GPT-2 small in 4 stages on $DEV (5 peers: stage 3 twice), 10 synchronous steps of 32 sequences (4 x microbatch 8)"
  sed -e 's/^steps = .*/steps = 10/' -e 's/^target_batch_size = .*/target_batch_size = 32/' \
    -e 's/^warmup_steps = .*/warmup_steps = 0/' configs/gpt2-124m.toml >"$W/big.toml"
  swarm_of "$W/big.toml" 0 1 2 3 3
}

versus_torch() {
  echo "== shoal vs PyTorch on $DEV"
  local lib
  lib=$(python3 -c 'import os;print(os.path.dirname(os.__file__))')
  find "$lib" -name '*.py' -size +8k 2>/dev/null | sort | head -3000 | xargs cat 2>/dev/null | head -c 8000000 >"$W/text.txt" || true
  DEVICE=$DEV SHOAL=$SHOAL PYTHON=python3 D_MODEL=768 LAYERS=12 HEADS=12 KV_HEADS=4 SEQ=1024 BATCH=8 \
    STEPS=${STEPS:-40} OUT=${PARITY_OUT:-$W/parity.json} scripts/parity.sh "$W/text.txt"
}

big_stage() {
  echo "== a 1.1B Llama's stage on $DEV"
  "$SHOAL" bench stage --config configs/llama-1b.toml --stage 1 --device "$DEV" --dtypes f32,bf16 --seconds 5
}

# ONLY="swarm stages" (say) runs those alone.
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
want stages && check stages stages
want swarm && check swarm swarm
if ! want versus-torch; then
  :
elif python3 -c 'import torch, xxhash; assert torch.cuda.is_available()' 2>/dev/null; then
  check versus-torch versus_torch
else
  echo "== (no torch with CUDA in python3: the side-by-side with PyTorch is skipped)"
fi
want big-stage && [ -z "${NO_BIG:-}" ] && check big-stage big_stage
want big-swarm && [ -z "${NO_BIG:-}" ] && check big-swarm big_swarm
if [ ${#FAILS[@]} -gt 0 ]; then
  echo "FAILED: ${FAILS[*]}" >&2
  exit 1
fi
echo "gpu check passed"
