"""Start-up: the main job, `hookcli inspect resnet34 sample_images/cat.jpeg`, against the
hand-written hook script that does the same forward and prints the same statistics
(benchmarks/minimal_hook_script.py), each a fresh process, interleaved run after run.

Prints the median wall time of each, their ratio, the median peak RSS of each (the process and
its children: hookcli's supervised worker included) and their ratio; and `hookcli --help`'s
wall time.

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
    commands = {
        "hookcli inspect": [*hookcli, "inspect", "resnet34", CAT],
        "hand-written script": [
            sys.executable,
            str(ROOT / "benchmarks" / "minimal_hook_script.py"),
            CAT,
        ],
    }
    for cmd in commands.values():  # warm the page cache, bytecode and numba's kernel caches
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
    a, b = "hookcli inspect", "hand-written script"
    print(f"ratio hookcli / script: wall {med[a] / med[b]:.2f}x   peak RSS {mem[a] / mem[b]:.2f}x")
    helps = sorted(timed([*hookcli, "--help"])[0] for _ in range(5))
    print(f"hookcli --help: {statistics.median(helps):.2f} s (median of 5)")


if __name__ == "__main__":
    main()
