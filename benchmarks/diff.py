"""hookcli diff: its cost against the two plain passes it compares, and flat memory.

Prints, measured side by side in one process (time) and in fresh subprocesses (memory):

(a) time of a diff ÷ the two plain passes (model_a(x_a) + model_b(x_b)), medians of
    interleaved rounds; target at most 1.5x. A diff runs the sides side by side: the reference
    side's hooked pass, a greenlet beside the other side's in one thread, hands each leaf call's
    output to the other side's hooked pass, which measures its own output against it
    (commands/diff/lockstep.py). Beside it, the same with the passes as threads (as they run
    where the greenlet package is missing), and the same diff through the spill (the reference
    side's outputs written to disk, then read back by the other side's pass), which a diff
    falls back to when the sides cannot keep step. And both again for the default diff, which
    also measures each layer's own error: a second round in which the other side is fed the
    reference's inputs (--no-own skips it);
(b) peak RSS growth of a diff of a chain of N linear layers (1 MiB activations) for growing N:
    flat means the reference side's activations are not held in memory.

Usage: python benchmarks/diff.py [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from _common import PRECISE_MALLOC, interleaved, reset_peak, status_kb


def time_ratio(model_name: str, batch: int, side_b: str, rounds: int) -> dict[str, float]:
    import torch

    from hookcli.commands.diff import lockstep
    from hookcli.commands.diff.measure import Compared, Spill
    from hookcli.commands.diff.passes import compared_pass, reference_pass
    from hookcli.commands.diff.sides import parse_side, prepare_side
    from hookcli.options import InputOptions, ModelOptions, Selection

    model = ModelOptions(model_name, device="cpu")
    inputs = InputOptions(specs=(f"randn:{batch}x3x224x224",))
    ref = prepare_side(model, Selection(), parse_side("float32", "--a"), with_input=inputs)
    other = prepare_side(model, Selection(), parse_side(side_b, "--b"), with_input=None)
    assert ref.prepared.model_input is not None
    x_a = ref.prepared.model_input
    x_b = other.side.cast(x_a, other.prepared.device)
    model_a, model_b = ref.prepared.loaded.module.eval(), other.prepared.loaded.module.eval()

    def plain() -> None:
        with torch.no_grad():
            model_a(*x_a.args)
            model_b(*x_b.args)

    def through_spill(own: bool) -> None:
        spill = Spill()
        try:
            reference_pass(ref, x_a, spill, isolate=own)
            compared_pass(other, x_b, spill, isolate=False, compared=Compared())
            if own:
                compared_pass(other, x_b, spill, isolate=True, compared=Compared())
        finally:
            spill.close()

    def side_by_side(own: bool) -> None:
        consumers = [lockstep.Consumer("B", other, x_b, False, Compared())]
        if own:
            consumers.append(lockstep.Consumer("B, own", other, x_b, True, Compared()))
        assert lockstep.run(ref, "A", x_a, consumers) is not None, "the sides did not keep step"

    def as_threads() -> None:
        lockstep.GREENLETS = False
        try:
            side_by_side(False)
        finally:
            lockstep.GREENLETS = True

    t = interleaved(
        {
            "plain": plain,
            "diff": lambda: side_by_side(False),
            "threads": as_threads,
            "own": lambda: side_by_side(True),
            "spill": lambda: through_spill(False),
            "spill_own": lambda: through_spill(True),
        },
        rounds,
    )
    return {
        "plain_ms": t["plain"] * 1e3,
        "diff_ms": t["diff"] * 1e3,
        "ratio": t["diff"] / t["plain"],
        "threads_ratio": t["threads"] / t["plain"],
        "own_ratio": t["own"] / t["plain"],
        "spill_ratio": t["spill"] / t["plain"],
        "spill_own_ratio": t["spill_own"] / t["plain"],
    }


def memory_child(layers: int) -> None:
    """In a fresh process: peak RSS growth of one diff of a Chain of `layers` layers."""
    import torch
    from torch import nn

    from hookcli.commands.diff import diff_report, parse_side
    from hookcli.options import InputOptions, ModelOptions, Selection

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)]).eval()  # 16 KiB each
    x = torch.randn(4096, 64)  # each activation 1 MiB in float32

    def once() -> None:
        diff_report(
            ModelOptions(model, device="cpu"),
            Selection(),
            InputOptions(items=(x,)),
            parse_side("float32", "--a"),
            parse_side("bfloat16", "--b"),
        )

    once()  # warm-up: imports, kernels, allocator pools
    base = reset_peak()
    once()
    print(json.dumps({"growth_kb": status_kb("VmHWM") - base}))


def memory(layers: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", str(layers)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **PRECISE_MALLOC},
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["growth_kb"]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="resnet18 only, 3 rounds")
    parser.add_argument("--memory-child", type=int, metavar="N", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child)
        return
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    cases = [("resnet18", 8)] if args.quick else [("resnet18", 8), ("resnet50", 4)]
    rounds = 3 if args.quick else args.rounds
    print("(a) diff ÷ the two plain passes (median of interleaved rounds)")
    for name, batch in cases:
        for side in ("bfloat16", "channels_last"):
            r = time_ratio(name, batch, side, rounds)
            print(
                f"  {name} batch {batch}, float32 vs {side}: plain {r['plain_ms']:.0f} ms, "
                f"diff {r['diff_ms']:.0f} ms, ratio {r['ratio']:.2f}x (passes as threads "
                f"{r['threads_ratio']:.2f}x, through the spill {r['spill_ratio']:.2f}x); "
                "with own error (the default) "
                f"{r['own_ratio']:.2f}x (through the spill {r['spill_own_ratio']:.2f}x)"
            )
    print("(b) peak RSS growth of a diff, chain of N linear layers with 1 MiB activations")
    for n in (8, 64, 256):
        print(f"  N = {n:3d}: {memory(n):.1f} MiB (the activations: {n} MiB per side)")


if __name__ == "__main__":
    main()
