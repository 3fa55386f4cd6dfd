#!/usr/bin/env python3
"""Time to the first step of a fresh swarm. See scripts/first-step.sh for the usage.

A hand-started swarm as a user starts one: the tiny run cut in STAGES stages, a bootstrap
peer (stage 0) and then STAGES*REPLICAS-1 more peers started together with `--stage auto
--trainers 0`, and one `shoal train`, all on 127.0.0.1, each writing its events (`--events`,
counters every 100 ms). Measures, from the moment the last peer reported `ready`, the time
until every stage has applied a step (a replica's averaging rounds >= 1), and the same from
the launch of the first process. Prints one JSON line and exits non-zero if no step came
within the time limit.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from swarmlib import events, free_port, tiny_run

SHOAL = os.environ.get("SHOAL", os.path.abspath("target/release/shoal"))
LIMIT_S = float(os.environ.get("LIMIT_S", "120"))


def main():
    stages = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    replicas = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    if not os.access(SHOAL, os.X_OK):
        print(f"no {SHOAL}: cargo build --release first", file=sys.stderr)
        return 1
    w = tempfile.mkdtemp(prefix="shoal-first-step-")
    tiny_run(SHOAL, w, count=stages)
    procs = []
    t0 = time.time()

    def peer(name, extra):
        port = free_port()
        cmd = [SHOAL, "peer", "--run", f"{w}/run.toml", "--listen", f"/ip4/127.0.0.1/tcp/{port}",
               "--identity", f"{w}/{name}.key", "--trainers", "0", "--counters-ms", "100",
               "--events", f"{w}/{name}.events"] + extra
        procs.append(subprocess.Popen(cmd, stdout=open(f"{w}/{name}.log", "w"),
                                      stderr=subprocess.STDOUT))
        return port

    names = [f"p{i}" for i in range(stages * replicas)]
    ready_at, first_step_at = {}, {}
    try:
        port = peer(names[0], ["--stage", "0"])
        boot = None
        while boot is None and time.time() - t0 < 30:
            for e in events(f"{w}/{names[0]}.events"):
                if e.get("event") == "ready":
                    boot = f"/ip4/127.0.0.1/tcp/{port}/p2p/{e['peer']}"
            time.sleep(0.05)
        if boot is None:
            raise SystemExit(f"first-step: the bootstrap peer did not get ready (see {w})")
        for n in names[1:]:
            peer(n, ["--stage", "auto", "--bootstrap", boot])
        procs.append(subprocess.Popen(
            [SHOAL, "train", "--run", f"{w}/run.toml", "--bootstrap", boot],
            stdout=open(f"{w}/trainer.log", "w"), stderr=subprocess.STDOUT))
        while time.time() - t0 < LIMIT_S:
            now = time.time() - t0
            for n in names:
                for e in events(f"{w}/{n}.events"):
                    if e.get("event") == "ready":
                        ready_at.setdefault(n, now)
                    if e.get("event") == "counters" and (e.get("averaging") or {}).get("rounds", 0) >= 1:
                        first_step_at.setdefault(e["stage"], now)
            if len(ready_at) == len(names) and len(first_step_at) == stages:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
    last_ready = max(ready_at.values()) if ready_at else None
    all_stepped = max(first_step_at.values()) if len(first_step_at) == stages else None
    out = {
        "stages": stages,
        "replicas": replicas,
        "last_ready_s": last_ready and round(last_ready, 2),
        "first_step_every_stage_s": all_stepped and round(all_stepped, 2),
        "ready_to_first_step_s": all_stepped and last_ready and round(all_stepped - last_ready, 2),
        "dir": w,
    }
    print(json.dumps(out))
    return 0 if all_stepped else 1


if __name__ == "__main__":
    sys.exit(main())
