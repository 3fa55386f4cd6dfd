"""Helpers shared by the scripts that start swarms of `shoal` processes (soak.py,
first-step.py, nat-lab.py): the tiny run's manifest, free ports, and the JSON events a
process writes with --events."""
import json
import re
import socket
import subprocess
import time


def tiny_run(shoal, w, **keys):
    """Writes configs/tiny.toml with each `key = value` line of `keys` replaced into `w`,
    makes its manifest `w`/run.toml; returns the config's text."""
    cfg = open("configs/tiny.toml").read()
    for k, v in keys.items():
        cfg = re.sub(rf"(?m)^{k} = \d+", f"{k} = {v}", cfg)
    open(f"{w}/run-config.toml", "w").write(cfg)
    subprocess.run([shoal, "run", "new", f"{w}/run-config.toml", "--out", f"{w}/run.toml"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return cfg


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def events(path):
    """Every JSON event written so far to `path` (none if it does not exist yet)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    return out


def wait_for(path, cond, secs):
    """The first event of `path` satisfying `cond`, waiting up to `secs`; None if none."""
    end = time.time() + secs
    while time.time() < end:
        for e in events(path):
            if cond(e):
                return e
        time.sleep(0.3)
    return None
