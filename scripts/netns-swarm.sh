#!/usr/bin/env bash
# A kernel-shaped cross-check of shoal's link emulator.
#
# Runs a small sim swarm (bootstrap, 2 stages x 2 replicas, 1 trainer) twice:
#   1. each process in its own Linux network namespace, joined to a bridge by a veth pair
#      whose both ends are rate-limited with `tc qdisc ... tbf` (this kernel has tbf but
#      no netem, so bandwidth only);
#   2. the same swarm on 127.0.0.1 with `--emulate-link bw=RATE` on every process;
# and prints the trainer's samples/s for both. They should agree within a few percent when
# the links bind.
#
# Needs root and `ip netns`; otherwise it says so and exits 0. It only touches the
# namespaces, bridge and veths it creates (names start with "shl"), and removes them on
# exit. Usage: scripts/netns-swarm.sh [RATE_MBIT=20] [SECONDS=20]
set -euo pipefail

RATE=${1:-20}
SECS=${2:-20}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${SHOAL_BIN:-$ROOT/target/release/shoal}

if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    echo "netns-swarm: skipped (needs root, ip and tc)"
    exit 0
fi
if ! ip netns add shl-probe 2>/dev/null; then
    echo "netns-swarm: skipped (cannot create network namespaces here)"
    exit 0
fi
ip netns del shl-probe
if [ ! -x "$BIN" ]; then
    (cd "$ROOT" && cargo build --release --quiet)
fi

WORK=$(mktemp -d)
NAMES=(boot r0 r1 r2 r3 tr)
PIDS=()
cleanup() {
    for p in "${PIDS[@]:-}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    for n in "${NAMES[@]}"; do
        ip netns del "shl-$n" 2>/dev/null || true
        ip link del "shlh-$n" 2>/dev/null || true
    done
    ip link del shl-br 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT
[ -n "${SHOAL_KEEP:-}" ] && trap - EXIT

cat >"$WORK/sim.toml" <<EOF
[model]
vocab = 16
d_model = 64
n_layers = 4
n_heads = 4
seq_len = 64
[stages]
count = 2
kind = "sim"
sim_ms_per_sample = 1.0
[training]
batch_size = 16
steps = 1000000
target_batch_size = 512
EOF
"$BIN" run new "$WORK/sim.toml" --out "$WORK/run.toml" >"$WORK/id"
RUN=$(tail -1 "$WORK/id")

# Reads the trainer's progress lines; prints samples/s between the first line after
# $2 seconds and the last.
rate_of() {
    awk -v warm="$2" '
        /^trainers:/ {
            for (i = 1; i <= NF; i++) if ($i == "completed") c = $(i + 1)
            t = $(NF - 1); gsub(/[(]/, "", t); t = t + 0; c = c + 0
            if (t + 0 >= warm && !have) { c0 = c; t0 = t; have = 1 }
            c1 = c; t1 = t
        }
        END { if (have && t1 > t0) printf "%.1f", (c1 - c0) / (t1 - t0); else print "n/a" }
    ' "$1"
}

start_swarm() { # $1: prefix command per process name ("ns" or "lo"), $2: link args
    local mode=$1 link=$2 boot_addr
    run_in() { # name, args...
        local n=$1; shift
        if [ "$mode" = ns ]; then
            ip netns exec "shl-$n" "$BIN" "$@" >"$WORK/$mode-$n.log" 2>&1 &
        else
            "$BIN" "$@" >"$WORK/$mode-$n.log" 2>&1 &
        fi
        PIDS+=($!)
    }
    local host=127.0.0.1
    [ "$mode" = ns ] && host=10.77.0.1
    run_in boot peer --run "$WORK/run.toml" --stage none --identity "$WORK/$mode-boot.key" \
        --listen "/ip4/$host/tcp/4100" --announce-ttl 6 $link
    sleep 2
    boot_addr=$(grep -o "/ip4/$host/tcp/4100/p2p/[A-Za-z0-9]*" "$WORK/$mode-boot.log" | head -1)
    local i=0
    for n in r0 r1 r2 r3; do
        local h=127.0.0.1
        [ "$mode" = ns ] && h=10.77.0.$((i + 2))
        run_in "$n" peer --run "$RUN" --bootstrap "$boot_addr" --stage $((i % 2)) --allow-sim \
            --trainers 0 --rebalance-every 0 --identity "$WORK/$mode-$n.key" \
            --listen "/ip4/$h/tcp/0" --announce-ttl 6 $link
        i=$((i + 1))
    done
    sleep 4
    run_in tr train --run "$RUN" --bootstrap "$boot_addr" --concurrency 16 --no-sync-steps \
        --report-ms 1000 $link
    sleep "$SECS"
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    PIDS=()
}

# 1. Namespaces on a bridge, tbf on both ends of every veth.
ip link add shl-br type bridge
ip addr add 10.77.0.254/24 dev shl-br
ip link set shl-br up
i=1
for n in "${NAMES[@]}"; do
    ip netns add "shl-$n"
    ip link add "shlh-$n" type veth peer name "shlp-$n"
    ip link set "shlp-$n" netns "shl-$n"
    ip link set "shlh-$n" master shl-br up
    ip netns exec "shl-$n" ip addr add "10.77.0.$i/24" dev "shlp-$n"
    ip netns exec "shl-$n" ip link set "shlp-$n" up
    ip netns exec "shl-$n" ip link set lo up
    tc qdisc add dev "shlh-$n" root tbf rate "${RATE}mbit" burst 32kb latency 100ms
    ip netns exec "shl-$n" tc qdisc add dev "shlp-$n" root tbf rate "${RATE}mbit" burst 32kb latency 100ms
    i=$((i + 1))
done
echo "netns-swarm: namespaces up, links ${RATE} Mbit/s each way (tbf); running ${SECS} s"
start_swarm ns ""
NS=$(rate_of "$WORK/ns-tr.log" 5)

echo "netns-swarm: same swarm on 127.0.0.1 with --emulate-link bw=${RATE}mbit"
start_swarm lo "--emulate-link bw=${RATE}mbit,rtt=0ms"
LO=$(rate_of "$WORK/lo-tr.log" 5)

echo "kernel tbf:    $NS samples/s"
echo "emulator:      $LO samples/s"
