"""Where `host_cost.py`'s figure goes inside the hooked forward: the same model of N tiny layers
(Linear(8, 8), every one hooked, one process-wide pair of hooks as inspect uses), its pass run
with one more part of the hooks' work switched on at a time, side by side in the same rounds:

    hooks        torch's slow call path with the pair of hooks, which find their target only
    bookkeeping  + each call's records (LayerCall, PendingCall, order), nothing measured
    records      + measure(): a TensorStats per tensor, no statistics
    checks       + StatsCollector.quick's checks and second-sight lookups, no copy
    copies       + each tensor's copy for later (everything the pass does)
    finalize     + the statistics of every copy and each TensorStats filled

printed as µs a layer call over the plain forward, and each part's own share. The garbage
collector is held off around each pass, as every hookcli pass holds it. What it cannot show:
the time outside the forward (the module table, the model left as found, the report), which
`host_cost.py --profile-out` lists.

Usage: python benchmarks/host_parts.py [--layers N] [--rounds R]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import interleaved
from host_cost import model

from hookcli.engine import cpurow, hooks, stats
from hookcli.engine.measure import statistics
from hookcli.engine.prepare import prepare
from hookcli.options import InputOptions, ModelOptions, Selection
from hookcli.records import TensorStats
from hookcli.runtime import preload

PARTS = ("hooks", "bookkeeping", "records", "checks", "copies", "finalize")


@contextmanager
def patched(owner: Any, name: str, value: Any, on: bool) -> Iterator[None]:
    """owner.name replaced by value while the block runs (when `on`)."""
    if not on:
        yield
        return
    kept = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, kept)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _record_only(self: stats.StatsCollector, t: torch.Tensor, path: str) -> TensorStats:
    return TensorStats(path, tuple(t.shape), "float32", t.numel())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args()
    torch.set_num_threads(1)
    preload.wait()
    n: int = args.layers
    m = model(n)
    x = torch.randn(4, 8)
    prepared = prepare(ModelOptions(m, device="cpu"), Selection(), InputOptions(items=(x,)))

    def plain() -> None:
        with torch.no_grad():
            m(x)

    def upto(part: str) -> Callable[[], None]:
        level = PARTS.index(part)

        def run() -> None:
            collector = statistics("kernel")
            session = hooks.HookSession(prepared.targets, collector, dense=True)
            S = hooks.HookSession
            with (
                patched(S, "_on_pre", _nothing, level < 1),
                patched(S, "_on_post", _nothing, level < 1),
                patched(hooks, "measure", _nothing, level < 2),
                patched(stats.StatsCollector, "quick", _record_only, level < 3),
                patched(cpurow.Later, "add", _nothing, level < 4),
            ):
                gc.disable()
                try:
                    with torch.no_grad(), session:
                        m(x)
                    if level >= 5:
                        collector.finalize()
                finally:
                    gc.enable()

        return run

    variants: dict[str, Callable[[], object]] = {"plain": plain}
    variants |= {part: upto(part) for part in PARTS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = interleaved(variants, args.rounds)
    print(
        f"{n} layers of Linear(8, 8), batch 4, 1 thread, medians of {args.rounds} rounds; "
        f"plain forward {t['plain'] * 1e3:.2f} ms"
    )
    before = t["plain"]
    for part in PARTS:
        total = (t[part] - t["plain"]) / n * 1e6
        own = (t[part] - before) / n * 1e6
        print(f"{part:<12} {total:6.1f} µs a layer call (this part {own:+.1f})")
        before = t[part]


if __name__ == "__main__":
    main()
