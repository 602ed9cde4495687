"""Overhead of hookcli's statistics hooks, measured side by side in one process.

Prints, for resnet50 batch 4 and resnet18 batch 8 on the CPU (random init, eval), and for time
(a, d) also vit_b_16 batch 2 and timm's vit_small_patch16_224 batch 4:

(a) time: `hookcli.inspect` with full statistics on every leaf module (inputs and outputs)
    ÷ plain `model(x)` under no_grad, and torchinfo's shapes-only `summary` beside it (the same
    rounds, when torchinfo is installed: the test extra has it). Variants run interleaved,
    round after round, and the ratio is of medians, so machine noise hits both sides alike.
    For reference it also times the same statistics with torch ops instead of the fused
    kernel, and a typical hand-written hook script calling `.item()` per statistic; and, as a
    diagnostic in the same rounds, hookcli with every statistics row a constant (no activation
    read): what its hooks, records and saved-and-restored model state cost beside torchinfo;
(b) memory: peak RSS growth during the same runs, each variant in a fresh subprocess, as a
    ratio to the plain forward's;
(c) `hookcli --help` wall time, and whether torch was imported;
(d) grads: `hookcli.grads` with statistics of every leaf call's inputs, outputs and gradients
    and every parameter gradient ÷ a plain forward + backward from the same target (the sum
    of each image's top-1 logit), interleaved the same way;
(e) --profile: the leaf calls' own forward times added up ÷ the unhooked pass it times in the
    same process (100% means the per-layer times account for the whole pass);
(f) --profile's FLOPs: its counting pass (FlopCounterMode, hooks on every module) ÷ a plain
    forward and ÷ a plain inspect, and inspect --profile ÷ inspect, interleaved.

Usage: python benchmarks/overhead.py [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

from _common import PRECISE_MALLOC, interleaved, reset_peak, status_kb

CASES = [("resnet50", 4), ("resnet18", 8)]
# transformers (issue 15): torchvision's ViT-B/16 and a timm ViT, time ratios (a) and (d)
VIT_CASES = [("vit_b_16", 2), ("timm:vit_small_patch16_224", 4)]


def _build(name: str, batch: int) -> tuple[Any, Any]:
    import torch
    import torchvision

    torch.manual_seed(0)
    if name.startswith("timm:"):
        import timm

        model = timm.create_model(name.removeprefix("timm:"), pretrained=False).eval()
    else:
        model = torchvision.models.get_model(name, weights=None).eval()
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    return model, x


_ROW = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0)  # count, mean, var, min, max, ...


def _variants(model: Any, x: Any) -> dict[str, Callable[[], object]]:
    import torch

    import hookcli

    def plain() -> object:
        with torch.no_grad():
            return model(x)

    def hookcli_fused() -> object:
        return hookcli.inspect(model, x, device="cpu", topk=0)

    def hookcli_torch_ops() -> object:
        return hookcli.inspect(model, x, device="cpu", topk=0, stats_backend="torch")

    def hookcli_no_read() -> object:
        # a diagnostic: everything hookcli does but read the activations (each statistics row
        # a constant), to set its other costs against torchinfo's whole summary
        from hookcli.engine import stats

        with (
            mock.patch.object(stats, "kernel_row", return_value=_ROW),
            mock.patch.object(stats, "cpu_row", return_value=_ROW),
            mock.patch.object(stats, "TOGETHER", 0),  # (nothing held for later)
        ):
            return hookcli.inspect(model, x, device="cpu", topk=0)

    def item_script() -> object:
        # What people write by hand: a forward hook per leaf, .item() per statistic.
        rows: list[tuple[float, ...]] = []

        def hook(module: Any, args: Any, out: Any) -> None:
            o = out.detach().float()
            rows.append(
                (
                    o.mean().item(),
                    o.std().item(),
                    o.min().item(),
                    o.max().item(),
                    (o == 0).float().mean().item(),
                    torch.isnan(o).sum().item(),
                    torch.isinf(o).sum().item(),
                    o.norm().item(),
                )
            )

        leaves = [m for m in model.modules() if next(m.children(), None) is None]
        handles = [m.register_forward_hook(hook) for m in leaves]
        try:
            with torch.no_grad():
                model(x)
        finally:
            for h in handles:
                h.remove()
        return rows

    def torchinfo_summary() -> object:
        # the shapes-only tool (issue 19: hookcli should not lose to it): its own hooks, one pass
        import torchinfo

        return torchinfo.summary(model, input_data=x, device="cpu", verbose=0)

    return {
        "plain": plain,
        "hookcli": hookcli_fused,
        "torchinfo summary (shapes only)": torchinfo_summary,
        "hookcli without reading the activations": hookcli_no_read,
        "hookcli (torch ops)": hookcli_torch_ops,
        "hand-written .item() hooks": item_script,
    }


def grads_case(name: str, batch: int, rounds: int) -> dict[str, float]:
    import hookcli

    model, x = _build(name, batch)

    def plain() -> object:
        for p in model.parameters():
            p.grad = None
        model(x).max(dim=1).values.sum().backward()
        return None

    def hooked() -> object:
        return hookcli.grads(model, x, device="cpu", topk=0)

    t = interleaved({"plain": plain, "hookcli": hooked}, rounds)
    return {"hookcli": t["hookcli"] / t["plain"], "plain_ms": t["plain"] * 1e3}


def time_case(name: str, batch: int, rounds: int) -> dict[str, float]:
    """Ratios to plain. The slow reference variants are timed in a block of their own, each
    against its own plain runs, so their large allocations do not disturb the main pair."""
    model, x = _build(name, batch)
    variants = _variants(model, x)
    names = ["plain", "hookcli"]
    if importlib.util.find_spec("torchinfo") is not None:  # in the test extra
        names.append("torchinfo summary (shapes only)")
    names.append("hookcli without reading the activations")
    main = interleaved({k: variants[k] for k in names}, rounds)  # side by side, one process
    out = {k: main[k] / main["plain"] for k in names[1:]}
    out["plain_ms"] = main["plain"] * 1e3
    for ref in ("hookcli (torch ops)", "hand-written .item() hooks"):
        pair = interleaved({"plain": variants["plain"], ref: variants[ref]}, max(3, rounds // 3))
        out[ref] = pair[ref] / pair["plain"]
    return out


def memory_child(name: str, batch: int, variant: str) -> None:
    """Runs in a subprocess: peak RSS growth (KiB) over three runs of one variant.

    After set-up and one warm-up run, the kernel's high-water mark is reset (clear_refs 5),
    so the peak is that of the runs, not of model construction or first-use caches.
    """
    import torch

    from hookcli.engine import stats

    model, x = _build(name, batch)
    stats.tensor_stats(torch.randn(100_000))  # kernels loaded before the baseline
    stats.tensor_stats(torch.randn(1000))
    fn = _variants(model, x)[variant]
    fn()  # one-time allocations (oneDNN primitive caches, thread pools) are not the run's
    base = reset_peak()
    for _ in range(3):
        fn()
    print(json.dumps({"growth_kb": status_kb("VmHWM") - base}))


def memory_case(name: str, batch: int, repeats: int = 3) -> dict[str, float]:
    """Median over `repeats` fresh subprocesses per variant (allocator behaviour varies)."""
    out: dict[str, float] = {}
    for variant in ("plain", "hookcli"):
        growths = []
        for _ in range(repeats):
            res = subprocess.run(
                [sys.executable, __file__, "--memory-child", name, str(batch), variant],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, **PRECISE_MALLOC},
            )
            growths.append(json.loads(res.stdout.strip().splitlines()[-1])["growth_kb"] / 1024)
        out[variant] = statistics.median(growths)
    return out


def help_time(runs: int = 7) -> tuple[float, bool]:
    cmd = [
        sys.executable,
        "-c",
        "import sys; from hookcli.cli import main; sys.argv=['hookcli','--help'];\n"
        "try:\n main()\nexcept SystemExit: pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NOTORCH')",
    ]
    walls = []
    torch_seen = False
    for _ in range(runs):
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        walls.append(time.perf_counter() - t0)
        torch_seen |= res.stdout.strip().endswith("TORCH") and not res.stdout.strip().endswith(
            "NOTORCH"
        )
    return statistics.median(walls), torch_seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="resnet18 only, 5 rounds")
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        name, batch, variant = args.memory_child
        memory_child(name, int(batch), variant)
        return
    cases = [("resnet18", 8)] if args.quick else CASES
    rounds = 5 if args.quick else args.rounds
    import torch

    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, CPU; {rounds} interleaved rounds")
    print("(a) time ratio to plain model(x) under no_grad (median of rounds)")
    for name, batch in cases + VIT_CASES:
        r = time_case(name, batch, rounds)
        plain_ms = r.pop("plain_ms")
        cells = ", ".join(f"{k} {v:.3f}x" for k, v in r.items() if k != "plain")
        print(f"  {name} batch {batch} (plain {plain_ms:.0f} ms): {cells}")
    print("(b) peak memory growth during the run, ratio to plain (median of 3 processes each)")
    for name, batch in cases:
        m = memory_case(name, batch)
        print(
            f"  {name} batch {batch}: plain {m['plain']:.0f} MiB, hookcli {m['hookcli']:.0f} MiB, "
            f"ratio {m['hookcli'] / m['plain']:.3f}x"
        )
    wall, torch_seen = help_time()
    print(
        f"(c) hookcli --help: {wall * 1e3:.0f} ms wall (median of 7), torch imported: {torch_seen}"
    )
    print("(d) grads ÷ plain forward+backward (median of rounds)")
    for name, batch in cases + VIT_CASES:
        g = grads_case(name, batch, rounds)
        print(f"  {name} batch {batch} (plain {g['plain_ms']:.0f} ms): hookcli {g['hookcli']:.3f}x")
    import hookcli

    for name, batch in cases:
        model, x = _build(name, batch)
        shares = []
        for _ in range(3):
            prof = hookcli.inspect(model, x, device="cpu", topk=0, profile=True).profile
            assert prof is not None
            shares.append(prof.layers_ms / prof.unhooked_ms)
        print(
            f"(e) {name} batch {batch}: --profile leaf calls sum to "
            f"{statistics.median(shares):.1%} of the unhooked forward (median of 3)"
        )
    for name, batch in cases:
        f = flops_case(name, batch, min(rounds, 5))
        print(
            f"(f) {name} batch {batch}: FLOPs pass {f['flops'] / f['plain']:.2f}x a plain forward, "
            f"{f['flops'] / f['inspect']:.2f}x a plain inspect; inspect --profile "
            f"{f['profile'] / f['inspect']:.2f}x inspect"
        )


def flops_case(name: str, batch: int, rounds: int) -> dict[str, float]:
    """(f): seconds of a plain forward, the FLOPs pass alone, inspect, inspect --profile."""
    import torch

    import hookcli
    from hookcli.engine.flops import count_flops
    from hookcli.engine.prepare import prepare
    from hookcli.options import InputOptions, ModelOptions, Selection

    model, x = _build(name, batch)
    prepared = prepare(ModelOptions(model, device="cpu"), Selection(), InputOptions((x,)))

    def plain() -> None:
        with torch.no_grad():
            model(x)

    return interleaved(
        {
            "plain": plain,
            "flops": lambda: count_flops(prepared),
            "inspect": lambda: hookcli.inspect(model, x, device="cpu", topk=0),
            "profile": lambda: hookcli.inspect(model, x, device="cpu", topk=0, profile=True),
        },
        rounds,
    )


if __name__ == "__main__":
    main()
