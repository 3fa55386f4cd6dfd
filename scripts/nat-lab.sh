#!/usr/bin/env bash
# The NAT lab: shoal peers at "home", each behind its own NAT router, built from network
# namespaces on this machine, training with peers on the "internet".
#
#   scripts/nat-lab.sh            (root; builds nothing: run `cargo build --release` first,
#                                  or set SHOAL to a binary)
#
#   internet (namespace shl-pub, bridge 10.77.0.0/24, all at 10.77.0.1): the bootstrap
#       peer, a relay (--relay-server, no stage: homes find it through the DHT), and one
#       replica of each stage
#   home i = 1, 2, 3: a router (shl-r$i: WAN 10.77.0.1$i, LAN 192.168.$i.1) doing
#       MASQUERADE and dropping unsolicited inbound connections, as home routers do, with
#       `tc` shaping the uplink and downlink (LAB_RATE, default 50mbit; LAB_DELAY one way,
#       default 20ms); behind it the home (shl-h$i, 192.168.$i.2)
#   home 1 serves stage 0, home 2 stage 1, home 3 runs the trainer, for LAB_S seconds
#       (default 90) after both home peers are reachable through the relay.
#   LAB_NAT=symmetric makes the routers pick a random outside port for every connection
#   (MASQUERADE --random-fully): hole punching cannot work, every home-to-home connection
#   stays on the relay (to measure training through a relay; D is then 0).
#
# Prints one line, `nat-lab: direct D relayed R samples S failed F`: pairs of home peers
# whose connection ended direct after hole punching, pairs still only relayed, samples the
# trainer completed and failed. Exits non-zero if training did not advance; exits 0 with a
# message and no result line where the lab cannot be built (not root, no `ip netns`, no
# iptables and no way to install it).
# Everything is torn down on exit; KEEP=1 keeps the processes' logs (the path is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
SHOAL=${SHOAL:-$PWD/target/release/shoal}
LAB_RATE=${LAB_RATE:-50mbit}
LAB_DELAY=${LAB_DELAY:-20ms}
export LAB_S=${LAB_S:-90}
P=shl

[ -x "$SHOAL" ] || { echo "nat-lab: no $SHOAL: cargo build --release first (or set SHOAL)" >&2; exit 1; }
if [ "$(id -u)" -ne 0 ] || ! ip netns add ${P}-probe 2>/dev/null; then
  echo "nat-lab: skipped: cannot create network namespaces here (needs root and ip netns)"
  exit 0
fi
ip netns del ${P}-probe
if ! command -v iptables >/dev/null; then
  echo "nat-lab: installing iptables from Debian" >&2
  (apt-get install -y iptables >/dev/null 2>&1 ||
    { apt-get update >/dev/null 2>&1 && apt-get install -y iptables >/dev/null 2>&1; }) ||
    { echo "nat-lab: skipped: cannot install iptables (apt-get install iptables)"; exit 0; }
fi

teardown() {
  for n in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${P}-" || true); do
    # Kill what still runs in it, then the namespace (its veths go with it).
    for pid in $(ip netns pids "$n" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$n" 2>/dev/null || true
  done
}
teardown
trap teardown EXIT

nsx() { local ns=$1; shift; ip netns exec "${P}-$ns" "$@"; }

ip netns add ${P}-pub
nsx pub ip link set lo up
nsx pub ip link add br0 type bridge
nsx pub ip addr add 10.77.0.1/24 dev br0
nsx pub ip link set br0 up
for i in 1 2 3; do
  ip netns add ${P}-r$i
  ip netns add ${P}-h$i
  nsx r$i ip link set lo up
  nsx h$i ip link set lo up
  # Router WAN <-> the internet's bridge.
  ip link add ${P}w$i netns ${P}-r$i type veth peer name ${P}p$i netns ${P}-pub
  nsx pub ip link set ${P}p$i master br0 up
  nsx r$i ip addr add 10.77.0.1$i/24 dev ${P}w$i
  nsx r$i ip link set ${P}w$i up
  # Router LAN <-> the home.
  ip link add ${P}l$i netns ${P}-r$i type veth peer name eth0 netns ${P}-h$i
  nsx r$i ip addr add 192.168.$i.1/24 dev ${P}l$i
  nsx r$i ip link set ${P}l$i up
  nsx h$i ip addr add 192.168.$i.2/24 dev eth0
  nsx h$i ip link set eth0 up
  nsx h$i ip route add default via 192.168.$i.1
  nsx r$i sysctl -qw net.ipv4.ip_forward=1
  # NAT, and nothing unsolicited from the WAN side: neither to the router nor forwarded.
  if [ "${LAB_NAT:-cone}" = symmetric ]; then
    nsx r$i iptables -t nat -A POSTROUTING -o ${P}w$i -j MASQUERADE --random-fully
  else
    nsx r$i iptables -t nat -A POSTROUTING -o ${P}w$i -j MASQUERADE
  fi
  for chain in INPUT FORWARD; do
    nsx r$i iptables -A $chain -i ${P}w$i -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
    nsx r$i iptables -A $chain -i ${P}w$i -j DROP
  done
  # The home's access link: upload shaped on the WAN side, download on the LAN side.
  # Kernels without netem (containers) get the rate from tbf and the delay from the home
  # peers' own link emulation (--emulate-link, TCP only), said in the output.
  for dev in ${P}w$i ${P}l$i; do
    if ! nsx r$i tc qdisc add dev $dev root netem delay "$LAB_DELAY" rate "$LAB_RATE" 2>/dev/null; then
      nsx r$i tc qdisc add dev $dev root tbf rate "$LAB_RATE" burst 64kb latency 100ms
      export LAB_APP_DELAY=$LAB_DELAY
    fi
  done
done
[ -n "${LAB_APP_DELAY:-}" ] &&
  echo "nat-lab: no netem in this kernel: home links shaped by tbf at $LAB_RATE, delay $LAB_DELAY each way added by the home peers (--emulate-link)" >&2

# A home reaches the internet through its router (bash's /dev/tcp: no ping needed); the
# home peers then find out for themselves that the internet cannot reach them.
nsx pub bash -c 'exec 3<>/dev/null; python3 -c "import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((\"10.77.0.1\", 4999)); s.listen(); time.sleep(5)"' &
sleep 0.5
nsx h1 timeout 3 bash -c 'exec 3<>/dev/tcp/10.77.0.1/4999' ||
  { echo "nat-lab: home 1 cannot reach the internet" >&2; exit 1; }
if nsx pub timeout 2 bash -c 'exec 3<>/dev/tcp/192.168.1.2/22' 2>/dev/null; then
  echo "nat-lab: the lab is wrong: a home is reachable from the internet" >&2; exit 1
fi

export SHOAL NS_PREFIX=$P
python3 scripts/nat-lab.py
