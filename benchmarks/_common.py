"""What the benchmarks share: interleaved timing and peak-RSS measurement.

Imported as `_common`: each benchmark runs as a script (its folder first on sys.path), and its
memory children run the same script again.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

# Large blocks mmapped and unmapped on free: RSS then follows live memory instead of glibc's
# heap-trimming decisions, which otherwise swing the peak by tens of MiB between runs.
PRECISE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def interleaved(variants: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each variant, run in turn, round after round, after one warm-up."""
    for fn in variants.values():  # warm-up: kernels compiled/loaded, allocator primed
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for key, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def status_kb(field: str) -> int:
    """A /proc/self/status figure in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Reset the kernel's RSS high-water mark; the current RSS (KiB), to measure growth from."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kb("VmRSS")


def run_child(code: str, argv: list[str], name: str, timeout: float) -> dict[str, object]:
    """Run `code` in a fresh Python with `argv`; the JSON object its last stdout line prints,
    or a row saying it timed out or crashed (with stderr's last line). Each model of a sweep
    runs this way, so that its peak memory is its own and a crash is one row."""
    t0 = time.perf_counter()
    try:
        res = subprocess.run(
            [sys.executable, "-c", code, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {
            "name": name,
            "status": f"timeout after {timeout:.0f} s",
            "seconds": time.perf_counter() - t0,
        }
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return {
            "name": name,
            "status": f"crashed (exit {res.returncode})",
            "message": tail[:200],
            "seconds": time.perf_counter() - t0,
        }
    try:
        return dict(json.loads(lines[-1]))
    except json.JSONDecodeError:
        return {
            "name": name,
            "status": "crashed (no result line)",
            "message": lines[-1][:200],
            "seconds": time.perf_counter() - t0,
        }
