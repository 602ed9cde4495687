"""torchrun: a folder run spread over processes, merged into the report one process writes.
(`hookcli diff` over a folder spreads its batches the same way: commands/diff/report.py.)

Under `torchrun --nproc-per-node N -m hookcli inspect MODEL FOLDER` (or from Python under an
initialised process group) every rank runs the same command. The folder's images are cut into
the batches one process would run (`--batch-size`, after `--limit`), and global batch k goes to
rank k mod N: each image is read once, by one rank, on that rank's device. Histogram edges are
fixed by batch 0, as in one process: rank 0 runs it first and broadcasts them. At the end every
rank gathers every rank's accumulators (engine.aggregate: Chan's exact merge), counts,
per-image rows (placed by their global batch), origins and profile, and builds the same report;
rank 0 alone writes it. The report says how many processes ran and how many images each read.

With no process group and no torchrun environment (WORLD_SIZE unset or 1) nothing here runs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from hookcli.errors import UsageError


@dataclass(frozen=True, slots=True)
class Group:
    """This process's place: rank, world size, backend, and whether hookcli started the group
    (and so ends it)."""

    rank: int
    world: int
    backend: str
    owned: bool

    def batches(self, total: int) -> list[int]:
        """The global batches this rank runs: k ≡ rank (mod world)."""
        return list(range(self.rank, total, self.world))


def join() -> Group | None:
    """The process group this run is part of: the caller's (already initialised), or the one
    torchrun's environment describes (started here: gloo, or NCCL when CUDA is there); None for
    a run of one process."""
    if not torch.distributed.is_available():
        return None
    dist = torch.distributed
    if dist.is_initialized():
        world = dist.get_world_size()
        if world < 2:
            return None
        return Group(dist.get_rank(), world, str(dist.get_backend()), False)
    from hookcli.runtime.ranks import launched

    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    if world < 2 or "RANK" not in os.environ or not launched():
        return None  # WORLD_SIZE/RANK without torchrun: no other rank will come (issue 32)
    cuda = torch.cuda.is_available()
    if cuda and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # "cuda" is this rank's GPU
    backend = "nccl" if cuda and dist.is_nccl_available() else "gloo"
    try:
        dist.init_process_group(backend)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(
            f"torchrun's process group could not start ({backend}): {exc}",
            "check MASTER_ADDR/MASTER_PORT, or run without torchrun.",
        ) from exc
    return Group(dist.get_rank(), world, backend, True)


def spread_note(group: Group, images: Sequence[tuple[int, int]]) -> str:
    """The report's note on how the work was spread: `images` is (rank, images it read)."""
    share = ", ".join(f"rank {rank}: {n}" for rank, n in images)
    return (
        f"torchrun: {group.world} processes ({group.backend}), each on its own batches "
        f"(batch k on rank k mod {group.world}); images read by {share}"
    )


def leave(group: Group | None) -> None:
    if group is not None and group.owned and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def share_edges(group: Group, edges: dict[Any, Any], device: torch.device) -> None:
    """Rank 0's histogram edges (fixed by global batch 0) to every rank, in place."""
    plain = {
        k: tuple(v.cpu() if isinstance(v, torch.Tensor) else v for v in span)
        for k, span in edges.items()
    }
    box: list[Any] = [plain if group.rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    if group.rank != 0:
        edges.clear()
        for k, span in box[0].items():
            edges[k] = tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in span)


@dataclass(slots=True)
class Part:
    """What one rank saw, to be merged: its accumulators and everything placed by global
    batch (k) and position in it."""

    rank: int
    agg: Any
    model_out: Any
    counts: list[int]
    seen: dict[int, int]  # global batch → images read in it
    predictions: list[tuple[int, int, Any]] = field(default_factory=list)  # k, position, row
    nonfinite: list[tuple[int, Any]] = field(default_factory=list)  # k, ImageNonfinite
    origins: tuple[int, int, list[Any]] | None = None  # k, batch size, origins
    skipped: list[tuple[int, str, str]] = field(default_factory=list)  # file index, name, why
    notes: list[str] = field(default_factory=list)
    unhooked: dict[str, str] = field(default_factory=dict)
    timing: Any = None
    shape: tuple[int, ...] | None = None
    interrupted: bool = False
    value: float = 0.0  # grads: the sum of this rank's backward scalars
    orders: dict[tuple[str, int], tuple[int | None, int | None]] = field(default_factory=dict)


def sum_tensors(
    group: Group, tensors: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """Each tensor summed over the ranks (all-reduce), in list order on every rank, on the
    backend's device (this rank's GPU for NCCL, the CPU for gloo) whatever device each one is
    on; a rank without one adds float64 zeros shaped like `like`; None where no rank has one."""
    dist = torch.distributed
    nccl = group.backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    have = torch.tensor([t is not None for t in tensors], dtype=torch.int64, device=device)
    dist.all_reduce(have)
    out: list[torch.Tensor | None] = []
    for t, ref, n in zip(tensors, like, have.tolist(), strict=True):
        if not n:
            out.append(None)
            continue
        if t is None:
            total = torch.zeros(ref.shape, dtype=torch.float64, device=device)
        else:
            total = t.to(device, torch.float64)
        dist.all_reduce(total)
        out.append(total)
    return out


_P = TypeVar("_P")


def gather(part: _P, group: Group) -> list[_P]:
    """Every rank's part (anything with a `rank`), on every rank, in rank order."""
    parts: list[Any] = [None] * group.world
    torch.distributed.all_gather_object(parts, part)
    return sorted(parts, key=lambda p: int(p.rank))
