"""A tiny training run for tests/commands/watch/test_watch_ddp.py, watched by hookcli.watch.

    python -m torch.distributed.run --nproc_per_node 2 tests/support/ddp_train.py OUT_DIR
        DistributedDataParallel (gloo, CPU): each rank trains on its half of every batch and
        logs to OUT_DIR/run.rank{r}.jsonl (--nan-step K: a NaN in rank 1's shard at step K)
    python tests/support/ddp_train.py OUT_DIR --single
        the same training in one process over the whole batches, logged to OUT_DIR/single.jsonl

Both start from the same weights (seeded), see the same batches and take the same SGD steps,
so the merged rank logs must equal the single process's log. No BatchNorm: its batch
statistics would differ between a shard and the whole batch.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hookcli.runtime import isa

isa.ensure()  # before torch runs a kernel, as the CLI and the test suite do

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import hookcli  # noqa: E402
from tests.support.watch import Tiny  # noqa: E402

STEPS = 4
EVERY = 1
BATCH = 8


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--nan-step", type=int, default=-1, help="NaN in rank 1's shard then")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Tiny()  # the same weights on every rank and in the single process
    if args.single:
        rank, world = 0, 1
        trained: nn.Module = model
        log = args.out / "single.jsonl"
    else:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        trained = nn.parallel.DistributedDataParallel(model)
        log = args.out / "run.jsonl"  # the recorder names each rank's file run.rank{r}.jsonl
    opt = torch.optim.SGD(trained.parameters(), lr=0.1, momentum=0.9)
    shard = BATCH // world
    # the DDP wrapper itself: the recorder hooks the module it wraps (names without "module.")
    with hookcli.watch(trained, optimizer=opt, every=EVERY, log=log) as w:
        for step, (x, y) in enumerate(batches()):
            xs, ys = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
            if step == args.nan_step and rank == 1:
                xs = xs.clone()
                xs[0, 0, 0, 0] = float("nan")  # rank 1's data only
            opt.zero_grad()
            loss = F.cross_entropy(trained(xs), ys)  # a mean over the rank's shard
            w.loss(loss)
            loss.backward()  # DDP averages the parameter gradients over the ranks
            opt.step()
    if not args.single:
        dist.barrier()
        dist.destroy_process_group()
    print(f"rank {rank} of {world}: {STEPS} steps, log {os.fspath(w.log_path)}")


if __name__ == "__main__":
    main()
