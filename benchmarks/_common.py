"""What the benchmarks share: interleaved timing and peak-RSS measurement.

Imported as `_common`: each benchmark runs as a script (its folder first on sys.path), and its
memory children run the same script again.
"""

from __future__ import annotations

import statistics
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
