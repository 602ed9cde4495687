"""Start-up: the main job, `hookcli inspect resnet34 sample_images/cat.jpeg`, against the
hand-written hook script that does the same forward and prints the same statistics
(benchmarks/minimal_hook_script.py), each a fresh process, interleaved run after run.

Prints the median wall time of each, their ratio, the median peak RSS of each (the process and
its children: hookcli's supervised worker included) and their ratio; and `hookcli --help`'s
wall time. hookcli's worker ends with os._exit once its output is flushed and its atexit
handlers have run, skipping the interpreter's ~0.7 s teardown of torch, which the plain script
pays; the script is also timed ending the same way (`--quick-exit`), and the ratio against that
is hookcli's own cost, the saving set aside.

Usage: python benchmarks/startup.py [--runs N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CAT = str(ROOT / "sample_images" / "cat.jpeg")


# as on a user's machine: Python keeps its bytecode caches (a sandbox may turn them off, and
# then every run compiles hookcli's sources again, which no installed copy does)
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one run: the child and its descendants."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=ENV
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} exited {proc.returncode}")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    runs = parser.parse_args().runs
    hookcli = [sys.executable, "-m", "hookcli"]
    script = [sys.executable, str(ROOT / "benchmarks" / "minimal_hook_script.py"), CAT]
    commands = {
        "hookcli inspect": [*hookcli, "inspect", "resnet34", CAT],
        "hand-written script": script,
        "script, quick exit": [*script, "--quick-exit"],
    }
    for cmd in commands.values():  # warm the page cache and bytecode
        timed(cmd)
    walls: dict[str, list[float]] = {k: [] for k in commands}
    rss: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(runs):
        for name, cmd in commands.items():
            w, m = timed(cmd)
            walls[name].append(w)
            rss[name].append(m)
    med = {k: statistics.median(v) for k, v in walls.items()}
    mem = {k: statistics.median(v) for k, v in rss.items()}
    for k in commands:
        print(f"{k:22} wall {med[k]:6.2f} s (median of {runs})   peak RSS {mem[k]:6.0f} MiB")
    a = "hookcli inspect"
    for b in ("hand-written script", "script, quick exit"):
        print(
            f"ratio hookcli / {b + ':':20} wall {med[a] / med[b]:.2f}x   "
            f"peak RSS {mem[a] / mem[b]:.2f}x"
        )
    helps = sorted(timed([*hookcli, "--help"])[0] for _ in range(5))
    print(f"hookcli --help: {statistics.median(helps):.2f} s (median of 5)")


if __name__ == "__main__":
    main()
