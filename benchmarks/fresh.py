"""What a command-line user pays: the first hookcli call of a fresh process (issue 37).

(a) For each case — resnet50 batch 8, vit_b_16 batch 8, a GPT-2-small-shaped LM (12 blocks x
    768, random init) at 512 tokens — N rounds of a new process that builds the model, runs a
    plain forward twice, then times one hookcli call: `inspect` on every leaf ÷ the second plain
    forward (no_grad); `grads` ÷ a plain forward + backward from the same target (the sum of
    each row's top-1 logit); `diff --b bfloat16` ÷ the plain pair it compares (the float32
    forward and a bfloat16 copy's), on resnet18 batch 2 (bfloat16 is slow on a CPU without
    native bfloat16 matmuls). Medians over the rounds; each round runs every pair once.
(b) The whole-process CLI: `hookcli inspect resnet50 --input x.pt` (batch 8) on every leaf ÷
    the same command with `--layer fc`, N fresh processes each, interleaved; medians of wall
    time.

Usage: python benchmarks/fresh.py [--rounds N] [--kinds inspect,grads,diff] [--cli-runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "resnet50": "resnet50 b8",
    "vit_b_16": "vit_b_16 b8",
    "gpt2": "GPT-2-small shape, 512 tokens",
    "resnet18": "resnet18 b2",
}
# bfloat16 on a CPU without native bfloat16 matmuls is slow (resnet50 b8: a 20 s plain pair):
# diff is timed on resnet18 batch 2, inspect and grads on the three large cases
LARGE = ("resnet50", "vit_b_16", "gpt2")
KINDS = {"inspect": LARGE, "grads": LARGE, "diff": ("resnet18",)}
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _build(case: str) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    if case == "gpt2":
        import transformers

        config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
        model = transformers.GPT2LMHeadModel(config)
        model.eval()  # type: ignore[no-untyped-call]
        return model, torch.randint(0, config.vocab_size, (1, 512))
    import torchvision

    model = torchvision.models.get_model(case, weights=None).eval()
    batch = 2 if case == "resnet18" else 8
    return model, torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))


def _child(case: str, kind: str) -> None:
    """One fresh process: build, plain twice, then the first hookcli call; prints JSON."""
    import copy

    import torch

    import hookcli

    model, x = _build(case)

    def target(m: Any, inp: Any) -> Any:
        out = m(inp)
        return (out.logits if case == "gpt2" else out).max(dim=-1).values.sum()

    if kind == "inspect":

        def plain() -> None:
            with torch.no_grad():
                model(x)

        def hooked() -> None:
            hookcli.inspect(model, x, device="cpu", topk=0)

    elif kind == "grads":

        def plain() -> None:
            model.zero_grad(set_to_none=True)
            target(model, x).backward()

        # the same target: top-1 logits (a causal LM's default would be the next-token loss)
        chosen = "top1" if case == "gpt2" else None

        def hooked() -> None:
            hookcli.grads(model, x, device="cpu", topk=0, target=chosen)

    else:
        half = copy.deepcopy(model).bfloat16()
        xb = x if case == "gpt2" else x.bfloat16()

        def plain() -> None:
            with torch.no_grad():
                model(x)
                half(xb)

        def hooked() -> None:
            hookcli.diff(model, x, b="bfloat16", device="cpu")

    from hookcli.runtime import preload

    times = []
    loaded = []  # whether the background load had ended before each call
    for fn in (plain, plain, hooked):
        loaded.append(preload.finished())
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"plain": times[1], "hooked": times[2], "loaded": loaded[1]}))


def _run_child(case: str, kind: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", case, kind],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env=ENV,
    )
    if out.returncode:
        sys.exit(f"{case} {kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, cwd=ROOT, env=ENV
    )
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--cli-runs", type=int, default=3)
    ap.add_argument("--child", nargs=2)
    args = ap.parse_args()
    if args.child:
        _child(*args.child)
        return
    pairs = [(k, c) for k in args.kinds.split(",") if k for c in KINDS[k]]
    ratios: dict[tuple[str, str], list[float]] = {}
    overlapped = 0  # timed plain forwards that ran beside the kernels' background load
    for _ in range(args.rounds):
        for kind, case in pairs:
            r = _run_child(case, kind)
            ratios.setdefault((kind, case), []).append(r["hooked"] / r["plain"])
            overlapped += not r.get("loaded", True)
    if args.rounds > 0:
        print(
            f"(a) first hookcli call of a fresh process ÷ plain, medians of {args.rounds} processes"
        )
    for kind, case in pairs if args.rounds > 0 else []:
        each = ", ".join(f"{v:.2f}" for v in ratios[kind, case])
        ratio = statistics.median(ratios[kind, case])
        print(f"  {kind:<8} {CASES[case]:<30} {ratio:.2f}x   ({each})")
    if args.rounds > 0:
        print(f"  timed plain forwards that ran beside the background load: {overlapped}")
    if args.cli_runs <= 0:
        return
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        x = Path(tmp) / "x.pt"
        torch.save(torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(0)), x)
        base = [sys.executable, "-m", "hookcli", "inspect", "resnet50", "--input", str(x)]
        variants = {"every leaf": base, "--layer fc": [*base, "--layer", "fc"]}
        walls: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.cli_runs):
            for name, cmd in variants.items():
                walls[name].append(_wall(cmd))
    med = {k: statistics.median(v) for k, v in walls.items()}
    print(f"(b) CLI `hookcli inspect resnet50 --input x.pt` (b8), medians of {args.cli_runs} runs")
    for name, t in med.items():
        print(f"  {name:<12} {t:6.2f} s")
    print(f"  every leaf ÷ one layer: {med['every leaf'] / med['--layer fc']:.3f}x")


if __name__ == "__main__":
    main()
