"""What crash isolation costs (issue 13), measured side by side.

(a) end to end: `hookcli inspect resnet18 sample_images/cat.jpeg -f json -o /dev/null` run as a
    user runs it — a forked, supervised worker — ÷ the same command with HOOKCLI_NO_SUPERVISOR=1
    (in-process, as before). Whole processes, interleaved round after round; ratio of medians.
(b) in the hooked pass: `hookcli.inspect` of every leaf of resnet50 (batch 4) and resnet18
    (batch 8) with the crash beacon active (what the worker writes per hooked call) ÷ the same
    with no beacon, interleaved in one process.

Usage: python benchmarks/isolation.py [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from _common import interleaved

ROOT = Path(__file__).resolve().parent.parent
COMMAND = [sys.executable, "-m", "hookcli", "inspect", "resnet18", "sample_images/cat.jpeg"]
COMMAND += ["-f", "json", "-o", os.devnull]


def _process(supervised: bool) -> None:
    env = {**os.environ}
    env.pop("HOOKCLI_NO_SUPERVISOR", None)
    if not supervised:
        env["HOOKCLI_NO_SUPERVISOR"] = "1"
    subprocess.run(
        COMMAND, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def end_to_end(rounds: int) -> None:
    t = interleaved(
        {"supervised": lambda: _process(True), "in-process": lambda: _process(False)}, rounds
    )
    ratio = t["supervised"] / t["in-process"]
    print(
        f"(a) hookcli inspect resnet18 cat.jpeg, whole process: supervised {t['supervised']:.2f} s"
        f" / in-process {t['in-process']:.2f} s = {ratio:.3f}x"
    )


def in_pass(rounds: int, quick: bool) -> None:
    import torch
    import torchvision

    import hookcli
    from hookcli.runtime import beacon

    cases = [("resnet18", 8)] if quick else [("resnet50", 4), ("resnet18", 8)]
    for name, batch in cases:
        torch.manual_seed(0)
        model = torchvision.models.get_model(name, weights=None).eval()
        x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))

        def run(on: bool, model: torch.nn.Module = model, x: torch.Tensor = x) -> object:
            beacon._beacon = beacon.Beacon() if on else None
            try:
                return hookcli.inspect(model, x, device="cpu", topk=0)
            finally:
                beacon._beacon = None

        with_beacon: Callable[[], object] = functools.partial(run, True)
        without: Callable[[], object] = functools.partial(run, False)
        t = interleaved({"beacon": with_beacon, "none": without}, rounds)
        calls = len(run(True).layers)  # type: ignore[attr-defined]
        extra_us = (t["beacon"] - t["none"]) / calls * 1e6
        print(
            f"(b) {name} b{batch}, {calls} hooked calls: beacon {t['beacon'] * 1e3:.1f} ms / "
            f"none {t['none'] * 1e3:.1f} ms = {t['beacon'] / t['none']:.3f}x "
            f"({extra_us:+.2f} us per call)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="fewer rounds, resnet18 only")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    end_to_end(rounds)
    in_pass(rounds * 2, args.quick)


if __name__ == "__main__":
    main()
