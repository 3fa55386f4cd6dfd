#!/usr/bin/env bash
# A real run, end to end, on this machine:
#   scripts/real-run-check.sh TOKENIZER DATA_DIR OUT_DIR
# A llama-tiny swarm (2 stages x 2 replicas, one trainer) trains on DATA_DIR (from
# `shoal data prepare` with TOKENIZER); every process is stopped (each replica writes its
# checkpoint) and restarted with --resume; each replica must report that it resumed at the
# step and parameter hash it saved ("resumed at step N"); training goes on for a few more
# steps; the trainer stops and OUT_DIR/live.safetensors is exported from the live swarm
# (`shoal export --run`); then every peer stops again, OUT_DIR/model.safetensors is
# exported from one checkpoint per stage, and the two files must be identical. Exits non-zero, with one line saying why, when anything fails.
# Environment: SHOAL (default target/release/shoal), STEPS (default 6: averaging rounds
# before the stop).
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 TOKENIZER DATA_DIR OUT_DIR" >&2; exit 2; }
TOK=$1 DATA=$2 OUT=$3
SHOAL=${SHOAL:-$PWD/target/release/shoal}
STEPS=${STEPS:-6}
[ -x "$SHOAL" ] || { echo "no $SHOAL: cargo build --release first" >&2; exit 1; }
[ -f "$DATA/meta.json" ] || { echo "$DATA is not prepared data (no meta.json)" >&2; exit 1; }
mkdir -p "$OUT"
W=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  sleep 1
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill -9 "$p" 2>/dev/null || true; done
  [ -n "${KEEP:-}" ] || rm -rf "$W"
}
trap cleanup EXIT
fail() { echo "FAILED: $*"; exit 1; }
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }

"$SHOAL" run new configs/llama-tiny.toml --data "$DATA" --out "$W/run.toml" >"$W/run.id" 2>"$W/run.log" \
  || fail "run new: $(tail -1 "$W/run.log")"
echo "run $(cat "$W/run.id") on $DATA"
NAMES=(s0a s0b s1a s1b)
declare -A STAGE=([s0a]=0 [s0b]=0 [s1a]=1 [s1b]=1) PORT
for n in "${NAMES[@]}"; do PORT[$n]=$(port); done
BOOT=""

# start_peer NAME ROUND [EXTRA...]: one stage replica, its events in $W/NAME.ROUND.events
start_peer() {
  local n=$1 r=$2; shift 2
  "$SHOAL" peer --run "$W/run.toml" --listen "/ip4/127.0.0.1/tcp/${PORT[$n]}" \
    --identity "$W/$n.key" --stage "${STAGE[$n]}" --trainers 0 --rebalance-every 0 \
    --throughput 10 --checkpoint "$W/$n.ckpt" --counters-ms 500 \
    --events "$W/$n.$r.events" ${BOOT:+--bootstrap "$BOOT"} \
    ${RESUME:+--resume "$W/$n.ckpt"} "$@" >"$W/$n.$r.log" 2>&1 &
  PIDS+=($!)
  eval "PID_$n=$!"
}

# wait_event FILE PY_COND SECS: waits until a JSON line of FILE satisfies the condition.
wait_event() {
  python3 - "$@" <<'PY'
import json, sys, time
path, cond, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
end = time.time() + secs
while time.time() < end:
    try:
        for line in open(path):
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if eval(cond):
                sys.exit(0)
    except FileNotFoundError:
        pass
    time.sleep(0.3)
sys.exit(1)
PY
}

# rounds NAME ROUND: averaging rounds the replica reported last
rounds() {
  python3 - "$W/$1.$2.events" <<'PY'
import json, sys
r = 0
for line in open(sys.argv[1]):
    e = json.loads(line)
    if e.get("event") == "counters" and e.get("averaging"):
        r = e["averaging"]["rounds"]
print(r)
PY
}

start_swarm() {  # ROUND [EXTRA...]
  local r=$1; shift
  BOOT=""
  start_peer s0a "$r" "$@"
  wait_event "$W/s0a.$r.events" 'e.get("event")=="listening"' 30 || fail "the first peer did not listen: $(tail -1 "$W/s0a.$r.log")"
  local id
  id=$(python3 -c 'import json,sys;[print(json.loads(l)["peer"]) for l in open(sys.argv[1]) if json.loads(l).get("event")=="ready"]' "$W/s0a.$r.events" 2>/dev/null | head -1)
  if [ -z "$id" ]; then
    wait_event "$W/s0a.$r.events" 'e.get("event")=="ready"' 60 || fail "the first peer is not ready: $(tail -1 "$W/s0a.$r.log")"
    id=$(python3 -c 'import json,sys;[print(json.loads(l)["peer"]) for l in open(sys.argv[1]) if json.loads(l).get("event")=="ready"]' "$W/s0a.$r.events" | head -1)
  fi
  BOOT="/ip4/127.0.0.1/tcp/${PORT[s0a]}/p2p/$id"
  for n in s0b s1a s1b; do start_peer "$n" "$r" "$@"; done
  for n in "${NAMES[@]}"; do
    wait_event "$W/$n.$r.events" 'e.get("event")=="ready"' 120 || fail "$n is not ready: $(tail -1 "$W/$n.$r.log")"
  done
  "$SHOAL" train --run "$W/run.toml" --bootstrap "$BOOT" --data "$DATA" --events "$W/trainer.$r.events" >"$W/trainer.$r.log" 2>&1 &
  PIDS+=($!)
  TRAINER=$!
}

# train_until ROUND N: every replica averaged at least N rounds in this start
train_until() {
  local r=$1 want=$2 t=0
  while :; do
    local low=999999
    for n in "${NAMES[@]}"; do
      local k; k=$(rounds "$n" "$r" 2>/dev/null || echo 0)
      [ "$k" -lt "$low" ] && low=$k
    done
    [ "$low" -ge "$want" ] && return 0
    t=$((t + 1))
    [ $t -le 600 ] || fail "after 300 s the replicas averaged only $low of $want rounds (see $W)"
    sleep 0.5
  done
}

stop_all() {  # ROUND
  kill -TERM "$TRAINER" 2>/dev/null || true
  wait "$TRAINER" 2>/dev/null || true
  for n in "${NAMES[@]}"; do eval "kill -TERM \$PID_$n"; done
  for n in "${NAMES[@]}"; do eval "wait \$PID_$n" || fail "$n did not stop cleanly: $(tail -1 "$W/$n.$1.log")"; done
  for n in "${NAMES[@]}"; do
    wait_event "$W/$n.$1.events" 'e.get("event")=="checkpointed"' 1 || fail "$n wrote no checkpoint: $(tail -1 "$W/$n.$1.log")"
  done
}

start_swarm 1
train_until 1 "$STEPS"
stop_all 1
echo "stopped every process after $STEPS+ rounds; checkpoints written"

# The saved (step, hash) of each replica, from its checkpoint event.
saved() {
  python3 - "$W/$1.$2.events" <<'PY'
import json, sys
s = [json.loads(l) for l in open(sys.argv[1])]
c = [e for e in s if e.get("event") == "checkpointed"][-1]
print(c["step"], c["params_hash"])
PY
}
declare -A SAVED
for n in "${NAMES[@]}"; do SAVED[$n]=$(saved "$n" 1); done

RESUME=1 start_swarm 2
for n in "${NAMES[@]}"; do
  wait_event "$W/$n.2.events" 'e.get("event")=="resumed"' 60 || fail "$n did not resume: $(tail -1 "$W/$n.2.log")"
  got=$(python3 -c 'import json,sys;e=[json.loads(l) for l in open(sys.argv[1]) if json.loads(l).get("event")=="resumed"][0];print(e["step"],e["params_hash"],e["kept"])' "$W/$n.2.events")
  read -r step hash kept <<<"$got"
  [ "$step $hash" = "${SAVED[$n]}" ] || fail "$n resumed at $step $hash, but saved ${SAVED[$n]}"
  echo "$n (stage ${STAGE[$n]}): resumed at step $step with parameters $hash, as saved$([ "$kept" = True ] || echo '; a replica ahead of it was downloaded')"
done
before=$(for n in "${NAMES[@]}"; do echo "${SAVED[$n]%% *}"; done | sort -n | head -1)
train_until 2 2
kill -TERM "$TRAINER" 2>/dev/null || true
wait "$TRAINER" 2>/dev/null || true
sleep 2
"$SHOAL" export --run "$(cat "$W/run.id")" --bootstrap "$BOOT" --out "$OUT/live.safetensors" >"$W/live.log" 2>&1 \
  || fail "export from the live swarm: $(tail -1 "$W/live.log")"
cat "$W/live.log"
stop_all 2
after=$(for n in "${NAMES[@]}"; do s=$(saved "$n" 2); echo "${s%% *}"; done | sort -n | head -1)
[ "$after" -gt "$before" ] || fail "training did not go on after the restart (step $before, then $after)"
echo "training went on after the restart: step $before -> $after"
"$SHOAL" export --checkpoints "$W/s0a.ckpt" "$W/s1a.ckpt" --out "$OUT/model.safetensors" >"$W/export.log" 2>&1 \
  || fail "export: $(tail -1 "$W/export.log")"
cat "$W/export.log"
# Same tensors, same bytes, same metadata (the metadata's key order is not fixed).
python3 - "$OUT/live.safetensors" "$OUT/model.safetensors" <<'PY' || fail "the live export differs from the export of the checkpoints the replicas wrote when stopped"
import json, struct, sys
def load(p):
    b = open(p, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    meta = h.pop("__metadata__", {})
    return meta, {k: b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]] for k, v in h.items()}
a, b = load(sys.argv[1]), load(sys.argv[2])
sys.exit(0 if a == b and a[1] else 1)
PY
echo "the live export equals the export of the stopped replicas' checkpoints"
