"""The NAT lab's processes (scripts/nat-lab.sh builds the namespaces and calls this): on
the internet a bootstrap peer, a relay (a peer with --relay-server that serves no stage:
the home peers find it only through the DHT) and one replica per stage; a replica in home
1 (stage 0) and home 2 (stage 1), the trainer in home 3; then one result line from their
events."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from swarmlib import events, tiny_run, wait_for  # noqa: E402

SHOAL = os.environ["SHOAL"]
P = os.environ.get("NS_PREFIX", "shl")
LAB_S = float(os.environ.get("LAB_S", "90"))
PUB = "10.77.0.1"
# Set by nat-lab.sh where the kernel has no netem: the home peers delay their own traffic.
APP_DELAY = os.environ.get("LAB_APP_DELAY")


def home_args():
    """Link emulation for a home process where tc cannot delay (TCP only then)."""
    if not APP_DELAY:
        return []
    ms = int(APP_DELAY.rstrip("ms"))
    return ["--emulate-link", f"rtt={2 * ms}ms"]


def main():
    w = tempfile.mkdtemp(prefix="shoal-nat-lab-")
    tiny_run(SHOAL, w, steps=100000000)
    procs = {}

    def start(name, ns, args):
        cmd = ["ip", "netns", "exec", f"{P}-{ns}", SHOAL] + args + [
            "--events", f"{w}/{name}.events"]
        procs[name] = subprocess.Popen(cmd, stdout=open(f"{w}/{name}.log", "w"),
                                       stderr=subprocess.STDOUT)

    def peer(name, ns, listen, stage, boot=None, extra=()):
        addrs = [f"/ip4/{listen}/tcp/{port_of[name]}"]
        if not (APP_DELAY and ns != "pub"):
            addrs.append(f"/ip4/{listen}/udp/{port_of[name]}/quic-v1")
        args = ["peer", "--run", f"{w}/run.toml", "--identity", f"{w}/{name}.key",
                "--listen", *addrs,
                "--stage", stage, "--trainers", "0", "--rebalance-every", "0"] + list(extra)
        if boot:
            args += ["--bootstrap", boot]
        start(name, ns, args)

    def ready(name, secs=90):
        e = wait_for(f"{w}/{name}.events", lambda e: e.get("event") == "ready", secs)
        if e is None:
            raise SystemExit(f"nat-lab: {name} did not start (see {w}/{name}.log)")
        return e["peer"]

    port_of = {"boot": 4001, "pub0": 4002, "pub1": 4003, "relay": 4004, "home1": 4101,
               "home2": 4102}
    ids = {}
    try:
        peer("boot", "pub", PUB, "none")
        ids["boot"] = ready("boot")
        boot = f"/ip4/{PUB}/tcp/4001/p2p/{ids['boot']}"
        peer("relay", "pub", PUB, "none", boot, ["--relay-server"])
        ids["relay"] = ready("relay")
        peer("pub0", "pub", PUB, "0", boot)
        peer("pub1", "pub", PUB, "1", boot)
        peer("home1", "h1", "0.0.0.0", "0", boot, home_args())
        peer("home2", "h2", "0.0.0.0", "1", boot, home_args())
        for n in ("pub0", "pub1", "home1", "home2"):
            ids[n] = ready(n)
        # The home peers learn they are behind NAT (a dial-back fails) and take a relay
        # slot; training starts once both are reachable through it.
        for n in ("home1", "home2"):
            e = wait_for(f"{w}/{n}.events",
                         lambda e: e.get("event") == "net" and e.get("net") == "relay_reserved",
                         90)
            if e is None:
                raise SystemExit(f"nat-lab: {n} reserved no relay slot (see {w}/{n}.log)")
            print(f"nat-lab: {n} reachable through the relay: {e['addr']}", file=sys.stderr)
        start("trainer", "h3",
              ["train", "--run", f"{w}/run.toml", "--bootstrap", boot] + home_args())
        t0 = time.time()
        while time.time() < t0 + LAB_S:
            if procs["trainer"].poll() is not None:
                raise SystemExit(f"nat-lab: the trainer exited early (see {w}/trainer.log)")
            time.sleep(1)
        seconds = time.time() - t0
        procs["trainer"].send_signal(signal.SIGINT)
        try:
            procs["trainer"].wait(timeout=60)
        except subprocess.TimeoutExpired:
            procs["trainer"].kill()
        done = [e for e in events(f"{w}/trainer.events") if e.get("event") == "done"]
        if not done:
            raise SystemExit(f"nat-lab: the trainer reported no totals (see {w}/trainer.log)")
        prog = done[-1]["progress"]
        ids["trainer"] = next((e["addr"].rsplit("/p2p/", 1)[1]
                               for e in events(f"{w}/trainer.events")
                               if e.get("event") == "listening"), None)
        homes = {ids[n]: n for n in ("home1", "home2", "trainer") if ids.get(n)}
        punched, relayed, failed_punches = set(), set(), []
        for n in ("home1", "home2", "trainer"):
            for e in events(f"{w}/{n}.events"):
                if e.get("event") != "net" or e.get("peer") not in homes:
                    continue
                pair = frozenset((n, homes[e["peer"]]))
                if e.get("net") == "relayed":
                    relayed.add(pair)
                elif e.get("net") == "hole_punch":
                    if e.get("ok"):
                        punched.add(pair)
                    else:
                        failed_punches.append((n, homes[e["peer"]], e.get("error")))
        for a, b, err in failed_punches:
            print(f"nat-lab: a hole punch {a} -> {b} failed: {err}", file=sys.stderr)
        print(json.dumps({"progress": prog, "seconds": round(seconds, 1),
                          "samples_per_s": round(prog["completed"] / seconds, 1),
                          "punched": sorted(map(sorted, punched)),
                          "relayed": sorted(map(sorted, relayed)), "work": w}),
              file=sys.stderr)
        d, r = len(punched), len(relayed - punched)
        print(f"nat-lab: direct {d} relayed {r} samples {prog['completed']} "
              f"failed {prog['failed']}")
        return 0 if prog["completed"] > 0 else 1
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        if not os.environ.get("KEEP"):
            subprocess.run(["rm", "-rf", w])
        else:
            print(f"nat-lab: logs kept in {w}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
