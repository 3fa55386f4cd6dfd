#!/usr/bin/env bash
# shoal against a plain PyTorch implementation of the same model, on the same text:
#
#   scripts/parity.sh [TEXT_FILE]
#
# For each family (gpt, llama): byte tokens, d64, 4 layers, 4 heads (llama: 2 key/value
# heads), seq 64, batch 16, AdamW lr 3e-3, weight decay 0.01, no warmup, no decay of the
# rate, no clipping, 300 steps (STEPS), 2 threads (THREADS) each. Both draw the same
# windows of the text in the same order (scripts/parity.py reproduces shoal's sampler), one
# after the other, so the tokens/s are side by side on one machine. PyTorch runs with its
# defaults (its initialisation, AdamW β₂ 0.999, decay on every tensor, the erf GELU).
# Prints one line per family and a JSON file ($OUT, default parity.json).
#
# PyTorch comes from PyPI into a virtualenv outside the repository ($TORCH_VENV, default
# ~/.cache/shoal-torch, several GB with the CUDA libraries PyPI's torch depends on); it is a
# development tool here, not a dependency of shoal. Without a TEXT_FILE, the text is this
# machine's documentation (as ../shared/checks/real-run.sh uses).
#
# Elsewhere (scripts/gpu-check.sh): DEVICE=cuda:0 runs both on a GPU; PYTHON names a python
# that already has torch and xxhash (no virtualenv then); SHOAL a prebuilt binary (no cargo
# build); D_MODEL, LAYERS, HEADS, KV_HEADS, SEQ, BATCH change the shape.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-300}
THREADS=${THREADS:-2}
OUT=${OUT:-parity.json}
DEVICE=${DEVICE:-cpu}
VENV=${TORCH_VENV:-$HOME/.cache/shoal-torch}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
else
  PY=$VENV/bin/python
  if ! "$PY" -c 'import torch, xxhash' 2>/dev/null; then
    echo "installing torch and xxhash into $VENV (once)" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check torch xxhash
  fi
fi
if [ -z "${SHOAL:-}" ]; then
  cargo build --release --quiet
  SHOAL=target/release/shoal
fi

TEXT=${1:-}
if [ -z "$TEXT" ]; then
  TEXT=$W/corpus.txt
  # (head closes the pipe early: the SIGPIPE upstream is expected)
  { find /usr/share/doc /usr/share/common-licenses -type f \( -name '*.txt' -o -name 'README*' -o -name 'copyright' \) \
    ! -name '*.gz' 2>/dev/null | head -400 | xargs cat 2>/dev/null | head -c 4000000 >"$TEXT"; } || true
fi
[ -s "$TEXT" ] || { echo "no text to train on: give a TEXT_FILE" >&2; exit 1; }
TEXT=$(realpath "$TEXT")

config() {  # FAMILY
  local extra=""
  [ "$1" = llama ] && extra=$'family = "llama"\nn_kv_heads = '"${KV_HEADS:-2}"
  cat <<EOF
[model]
$extra
vocab = 256
d_model = ${D_MODEL:-64}
n_layers = ${LAYERS:-4}
n_heads = ${HEADS:-4}
seq_len = ${SEQ:-64}
seed = 1
[stages]
count = 1
[optimizer]
lr = 3e-3
warmup_steps = 0
min_lr_ratio = 1.0
weight_decay = 0.01
grad_clip = 0.0
[training]
batch_size = ${BATCH:-16}
steps = $STEPS
[data]
source = "text"
path = "$TEXT"
EOF
}

echo "[]" >"$W/rows.json"
for fam in gpt llama; do
  config "$fam" >"$W/$fam.toml"
  "$SHOAL" train --local --config "$W/$fam.toml" --threads "$THREADS" --device "$DEVICE" --events "$W/$fam.events" >"$W/$fam.log" 2>&1 \
    || { echo "shoal train failed: $(tail -1 "$W/$fam.log")" >&2; exit 1; }
  "$PY" scripts/parity.py "$W/$fam.toml" --threads "$THREADS" --device "$DEVICE" --json "$W/$fam.torch.json" >"$W/$fam.torch.log" 2>&1 \
    || { echo "the PyTorch reference failed: $(tail -1 "$W/$fam.torch.log")" >&2; exit 1; }
  python3 - "$fam" "$W/$fam.events" "$W/$fam.torch.json" "$W/rows.json" <<'PY'
import json, sys
fam, events, ref, rows = sys.argv[1:]
done = [json.loads(l) for l in open(events) if '"done"' in l][-1]
t = json.load(open(ref))
row = {"family": fam,
       "shoal": {k: done[k] for k in ("train_loss", "eval_loss", "tokens_per_s")},
       "pytorch": {k: t[k] for k in ("train_loss", "eval_loss", "tokens_per_s")}}
row["loss_ratio"] = row["shoal"]["train_loss"] / row["pytorch"]["train_loss"]
row["eval_ratio"] = row["shoal"]["eval_loss"] / row["pytorch"]["eval_loss"]
row["speed_ratio"] = row["shoal"]["tokens_per_s"] / row["pytorch"]["tokens_per_s"]
all_rows = json.load(open(rows)) + [row]
json.dump(all_rows, open(rows, "w"))
s, p = row["shoal"], row["pytorch"]
print(f"{fam:<6} shoal loss {s['train_loss']:.4f} (eval {s['eval_loss']:.4f}), pytorch loss {p['train_loss']:.4f} "
      f"(eval {p['eval_loss']:.4f}): {100 * (row['loss_ratio'] - 1):+.1f}%; "
      f"tokens/s shoal {s['tokens_per_s']:.0f}, pytorch {p['tokens_per_s']:.0f} ({row['speed_ratio']:.2f}x)")
PY
done
cp "$W/rows.json" "$OUT"
