"""What measuring a sharded model costs: hookcli's own collectives, the bytes they move, and the
time ÷ an unhooked step, under torchrun (gloo, CPU; it launches itself with 2 processes).

For a tensor-parallel MLP (ColwiseParallel then RowwiseParallel, 4 blocks of 512 → 2048 →
512, batch 8 x 32 tokens) and the same MLP under FSDP2 (each rank its own 8 x 32 rows):

- collectives: hookcli's own calls of all_gather / all_reduce (the model's own collectives —
  TP's, FSDP's — are not counted) in one `grads` pass, and in one watched training step;
- bytes: what those calls send from this rank (the packed rows: 11 float64 per measured row);
- time: `hookcli.grads` ÷ a plain forward + backward, and a watched step ÷ an unwatched SGD
  step, medians of interleaved rounds (rank 0's clock; the ranks wait on each other anyway).

Usage: python benchmarks/sharded.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import interleaved

WIDTH, HIDDEN, BLOCKS, BATCH, TOKENS = 512, 2048, 4, 8, 32


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))
        for _ in range(BLOCKS)
    ]
    return nn.Sequential(*blocks)


def _sharded(kind: str) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    model = _model()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    if kind == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            ParallelStyle,
            RowwiseParallel,
            parallelize_module,
        )

        plan: dict[str, ParallelStyle] = {}
        for i in range(BLOCKS):
            plan[f"{i}.0"], plan[f"{i}.2"] = ColwiseParallel(), RowwiseParallel()
        parallelize_module(model, mesh, plan)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


class Counted:
    """hookcli's own collectives while inside: calls and bytes sent, by function."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0

    def __enter__(self) -> Counted:
        import torch.distributed as dist

        from hookcli.engine import sharded

        self._saved = (dist.all_gather, dist.all_reduce)
        counted = self

        def gather(parts: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
            counted.calls += 1
            counted.bytes += tensor.numel() * tensor.element_size()
            return self._saved[0](parts, tensor, *args, **kwargs)

        def reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            counted.calls += 1
            counted.bytes += tensor.numel() * tensor.element_size()
            return self._saved[1](tensor, *args, **kwargs)

        # hookcli calls them through `torch.distributed` imported inside engine/sharded.py
        assert sharded is not None
        dist.all_gather, dist.all_reduce = gather, reduce  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.all_gather, dist.all_reduce = self._saved


def child(rounds: int) -> None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # a Sequential's view
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    x = torch.randn(BATCH, TOKENS, WIDTH)
    for kind in ("tp", "fsdp"):
        line = measure(kind, x, rounds)
        dist.barrier()
        if dist.get_rank() == 0:
            print(line, flush=True)
    dist.destroy_process_group()


def measure(kind: str, x: Any, rounds: int) -> str:
    """One sharding kind's line: collectives, bytes and time ratios."""
    import torch.distributed as dist
    from torch.optim import SGD

    import hookcli

    model = _sharded(kind)
    opt = SGD(model.parameters(), lr=1e-4)

    def plain() -> None:
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)

    def grads() -> None:
        hookcli.grads(model, x, target="sum", topk=0)
        model.zero_grad(set_to_none=True)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    with Counted() as in_grads:
        grads()
    watch = hookcli.watch(model, optimizer=opt, every=1)
    with watch, Counted() as in_step:
        step()
    t = interleaved({"plain": plain, "grads": grads}, rounds)
    plain_step = interleaved({"step": step}, rounds)["step"]
    with watch:
        watched = interleaved({"step": step}, rounds)["step"]
    rows = sum(len(c.inputs) + len(c.outputs) for c in watch.records[-1].layers)
    return (
        f"{kind} ({dist.get_world_size()} ranks, gloo, CPU): grads pass {in_grads.calls} "
        f"collectives, {in_grads.bytes / 1024:.1f} KiB sent; a watched step {in_step.calls} "
        f"collectives, {in_step.bytes / 1024:.1f} KiB sent ({rows} activation rows); grads "
        f"{t['grads'] / t['plain']:.2f}x forward+backward ({t['plain'] * 1e3:.0f} ms); watched "
        f"step {watched / plain_step:.2f}x an unwatched one ({plain_step * 1e3:.0f} ms)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        child(args.rounds)
        return
    print(f"2 processes, {args.rounds} interleaved rounds each (medians)", flush=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", "29671", __file__, "--rounds", str(args.rounds),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.run(cmd, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
