#!/usr/bin/env bash
# The dashboard in a real browser:
#
#   scripts/dashboard-check.sh [SCREENSHOT]      (default docs/dashboard.png)
#
# Installs Chromium from Debian when it is missing, starts a small swarm on 127.0.0.1 (the
# tiny run: a peer on stage 0, two on stage 1, and `shoal train --dashboard`, whose trainer
# gives the loss curve its points), loads the page
# headless, and passes when the rendered page shows a box for every replica of the swarm
# and the loss curve has points; then saves a screenshot. Builds nothing: run
# `cargo build --release` first (or set SHOAL).
set -euo pipefail
cd "$(dirname "$0")/.."
SHOT=${1:-docs/dashboard.png}
SHOAL=${SHOAL:-$PWD/target/release/shoal}
[ -x "$SHOAL" ] || { echo "no $SHOAL: cargo build --release first" >&2; exit 1; }
browser() { command -v chromium || command -v chromium-browser || command -v google-chrome || true; }
if [ -z "$(browser)" ]; then
  echo "installing chromium from Debian..."
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends chromium >/dev/null \
    || { echo "dashboard-check: cannot install chromium" >&2; exit 1; }
fi
CHROME=$(browser)
W=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done; [ -n "${KEEP:-}" ] || rm -rf "$W"; }
trap cleanup EXIT
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }

"$SHOAL" run new configs/tiny.toml --out "$W/run.toml" >/dev/null 2>&1
P0=$(port); DASH=$(port)
"$SHOAL" peer --run "$W/run.toml" --listen "/ip4/127.0.0.1/tcp/$P0" --identity "$W/a.key" \
  --stage 0 --trainers 0 >"$W/a.log" 2>&1 & PIDS+=($!)
BOOT=""
for _ in $(seq 60); do
  BOOT=$(grep -oE "/ip4/127\.0\.0\.1/tcp/$P0/p2p/12D3Koo[1-9A-HJ-NP-Za-km-z]+" "$W/a.log" | head -1 || true)
  [ -n "$BOOT" ] && break; sleep 0.5
done
[ -n "$BOOT" ] || { echo "dashboard-check: the first peer did not start: $(tail -1 "$W/a.log")" >&2; exit 1; }
for n in b c; do
  "$SHOAL" peer --run "$W/run.toml" --bootstrap "$BOOT" --identity "$W/$n.key" --stage 1 \
    --trainers 0 >"$W/$n.log" 2>&1 & PIDS+=($!)
done
"$SHOAL" train --run "$W/run.toml" --bootstrap "$BOOT" --dashboard "127.0.0.1:$DASH" --eval-every 3 \
  >"$W/trainer.log" 2>&1 & PIDS+=($!)
URL="http://127.0.0.1:$DASH/"
# The page polls every 2 s; give the swarm and the history a moment, then render.
dom=""; ok=""
for _ in $(seq 20); do
  sleep 3
  want=$(curl -sf "${URL}api/status" | python3 -c 'import json,sys; v=json.load(sys.stdin); print(sum(len(s["replicas"]) for r in (v["swarm"] or []) for s in r["stages"]))' 2>/dev/null || echo 0)
  dom=$(timeout 60 "$CHROME" --headless --no-sandbox --disable-gpu --virtual-time-budget=6000 --dump-dom "$URL" 2>/dev/null || true)
  boxes=$(grep -o 'class="replica [a-z]*"' <<<"$dom" | wc -l)
  points=$(grep -oE 'id="losschart"[^>]*data-points="[0-9]+"' <<<"$dom" | grep -oE '[0-9]+"$' | tr -d '"' || true)
  if [ "$want" -ge 3 ] && [ "$boxes" -ge "$want" ] && [ "${points:-0}" -gt "${MIN_POINTS:-8}" ]; then ok=1; break; fi
done
[ -n "$ok" ] || { echo "dashboard-check: the page shows $boxes replica boxes of $want and ${points:-0} loss points" >&2; exit 1; }
mkdir -p "$(dirname "$SHOT")"
timeout 60 "$CHROME" --headless --no-sandbox --disable-gpu --hide-scrollbars --virtual-time-budget=6000 \
  --window-size=1400,900 --screenshot="$SHOT" "$URL" >/dev/null 2>&1 || true
[ -s "$SHOT" ] || { echo "dashboard-check: no screenshot written" >&2; exit 1; }
echo "dashboard-check: $boxes replica boxes of $want, $points loss points; screenshot $SHOT"
