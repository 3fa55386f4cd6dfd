#!/usr/bin/env python3
"""A soak: a demo-sized swarm with churn for MINUTES, every process's memory and open files
sampled. See scripts/soak.sh for the usage; this file does the work.

The swarm: the tiny run (steps raised so it never ends) in its stages x 2 replicas of real
`shoal peer` processes and one `shoal train`, on 127.0.0.1. Every CHURN_S seconds (default
120) one replica other than the bootstrap is killed with SIGKILL and a fresh one (new
identity) starts for its stage. Every SAMPLE_S seconds (default 15) each live process's
VmRSS and open file descriptors are read from /proc. At the end the trainer is stopped and
its `done` event gives fed, completed and failed samples.

Prints one JSON line: minutes, kills, rss growth of the longest-lived processes after
warm-up (the first fifth of the run, at least a minute; median RSS of the first third of the
later samples against the last third), their fd counts at warm-up and at the end, and the vanished samples (fed - completed - failed). Exits non-zero when a goal is
missed: RSS growth >= 5%, an fd count that grew by more than 8, vanished != 0.
"""
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

from swarmlib import events, free_port, tiny_run, wait_for

SHOAL = os.environ.get("SHOAL", os.path.abspath("target/release/shoal"))
CHURN_S = float(os.environ.get("CHURN_S", "120"))
SAMPLE_S = float(os.environ.get("SAMPLE_S", "15"))


def proc_stats(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return rss, fds
    except (OSError, AttributeError):
        return None


def main():
    if len(sys.argv) != 2:
        print("usage: soak.py MINUTES", file=sys.stderr)
        return 2
    minutes = float(sys.argv[1])
    if not os.access(SHOAL, os.X_OK):
        print(f"no {SHOAL}: cargo build --release first", file=sys.stderr)
        return 1
    w = tempfile.mkdtemp(prefix="shoal-soak-")
    cfg = tiny_run(SHOAL, w, steps=100000000)
    stages = int(re.search(r"(?m)^count = (\d+)", cfg).group(1))
    procs = {}  # name -> (Popen, stage or None, started)
    boot = None
    serial = 0

    def start_peer(stage):
        nonlocal serial
        serial += 1
        name = f"p{serial}s{stage}"
        port = free_port()
        cmd = [SHOAL, "peer", "--run", f"{w}/run.toml", "--listen", f"/ip4/127.0.0.1/tcp/{port}",
               "--identity", f"{w}/{name}.key", "--stage", str(stage), "--trainers", "0",
               "--rebalance-every", "0", "--throughput", "10", "--events", f"{w}/{name}.events"]
        if boot:
            cmd += ["--bootstrap", boot]
        p = subprocess.Popen(cmd, stdout=open(f"{w}/{name}.log", "w"), stderr=subprocess.STDOUT)
        procs[name] = (p, stage, time.time())
        e = wait_for(f"{w}/{name}.events", lambda e: e.get("event") == "serving", 60)
        if e is None:
            raise SystemExit(f"soak: {name} did not start serving (see {w}/{name}.log)")
        return name, port

    try:
        name, port = start_peer(0)
        e = wait_for(f"{w}/{name}.events", lambda e: e.get("event") == "ready", 30)
        peer_id = e["peer"] if e else None
        if not peer_id:
            raise SystemExit("soak: the bootstrap peer reported no id")
        boot = f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}"
        bootstrap_name = name
        for s in range(stages):
            for _ in range(2 if s else 1):
                start_peer(s)
        trainer = subprocess.Popen(
            [SHOAL, "train", "--run", f"{w}/run.toml", "--bootstrap", boot, "--events",
             f"{w}/trainer.events"],
            stdout=open(f"{w}/trainer.log", "w"), stderr=subprocess.STDOUT)
        procs["trainer"] = (trainer, None, time.time())
        t0 = time.time()
        end = t0 + minutes * 60
        warm = t0 + max(60.0, minutes * 60 / 5)
        next_churn = t0 + CHURN_S
        samples = {}  # name -> [(t, rss, fds)]
        kills = 0
        rng = random.Random(1)
        while time.time() < end:
            now = time.time()
            for n, (p, _, _) in list(procs.items()):
                st = proc_stats(p.pid) if p.poll() is None else None
                if st:
                    samples.setdefault(n, []).append((now - t0, *st))
            if trainer.poll() is not None:
                raise SystemExit(f"soak: the trainer exited early (see {w}/trainer.log)")
            if now >= next_churn:
                next_churn = now + CHURN_S
                victims = [n for n, (_, s, _) in procs.items()
                           if s is not None and n != bootstrap_name and procs[n][0].poll() is None]
                if victims:
                    v = rng.choice(victims)
                    p, s, _ = procs.pop(v)
                    p.send_signal(signal.SIGKILL)
                    p.wait()
                    kills += 1
                    start_peer(s)
            time.sleep(SAMPLE_S)
        trainer.send_signal(signal.SIGINT)
        try:
            trainer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            trainer.kill()
        done = [e for e in events(f"{w}/trainer.events") if e.get("event") == "done"]
        prog = done[-1]["progress"] if done else None
        # Processes that lived through the whole run (the bootstrap, the trainer, and any
        # replica never killed): growth of the median RSS from the first third of the
        # samples after warm-up to the last third (single samples swing with the
        # allocator), and fds at the start and end of that span.
        growth, fds = {}, {}
        last_t = end - t0
        for n, rows in samples.items():
            after = [r for r in rows if r[0] >= warm - t0]
            lived = rows[0][0] <= SAMPLE_S + 5 and rows[-1][0] >= last_t - 2 * SAMPLE_S - 5
            if len(after) >= 3 and lived:
                k = max(1, len(after) // 3)
                med = lambda xs: sorted(xs)[len(xs) // 2]
                first, last = med([r[1] for r in after[:k]]), med([r[1] for r in after[-k:]])
                growth[n] = (last - first) / first
                fds[n] = (after[0][2], after[-1][2])
        vanished = None if prog is None else prog["fed"] - prog["completed"] - prog["failed"]
        out = {
            "minutes": minutes,
            "kills": kills,
            "rss_growth_after_warmup": {n: round(g, 4) for n, g in growth.items()},
            "fds_warm_end": fds,
            "rss_kb_end": {n: rows[-1][1] for n, rows in samples.items()},
            "fed": prog and prog["fed"],
            "completed": prog and prog["completed"],
            "failed": prog and prog["failed"],
            "vanished": vanished,
            "step": prog and prog["step"],
        }
        print(json.dumps(out))
        with open(f"{w}/samples.json", "w") as f:
            json.dump(samples, f)
        bad = []
        if not growth:
            bad.append("no process lived long enough to measure")
        if any(g >= 0.05 for g in growth.values()):
            bad.append("RSS grew 5% or more after warm-up")
        if any(b - a > 8 for a, b in fds.values()):
            bad.append("open file descriptors grew")
        if vanished != 0:
            bad.append(f"vanished samples: {vanished}")
        if bad:
            print("soak: FAILED: " + "; ".join(bad), file=sys.stderr)
            return 1
        return 0
    finally:
        for p, _, _ in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        time.sleep(2)
        for p, _, _ in procs.values():
            if p.poll() is None:
                p.kill()
        if not os.environ.get("KEEP"):
            subprocess.run(["rm", "-rf", w])
        else:
            print(f"soak: files kept in {w} (samples.json: per process [t, rss kB, fds])",
                  file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
