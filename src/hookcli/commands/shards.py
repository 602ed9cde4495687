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

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from hookcli.errors import ModelError, UsageError, one_line
from hookcli.options import ModelOptions


@dataclass(frozen=True, slots=True)
class Group:
    """This process's place: rank, world size, backend, and whether hookcli started the group
    (and so ends it)."""

    rank: int
    world: int
    backend: str
    owned: bool
    # NCCL: a gloo group of the same ranks for the monitored barrier (`arrive`), made in join()
    # while every rank is there (making it later would wait for a hung rank too)
    side: Any = None

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
        backend = str(dist.get_backend())
        return Group(dist.get_rank(), world, backend, False, _side_group(backend))
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
    wait = _wait_s()
    try:
        if wait is not None:  # every collective bounded, not only the final gather
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=wait))
        else:
            dist.init_process_group(backend)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(
            f"torchrun's process group could not start ({backend}): {exc}",
            "check MASTER_ADDR/MASTER_PORT, or run without torchrun.",
        ) from exc
    return Group(dist.get_rank(), world, backend, True, _side_group(backend))


@contextlib.contextmanager
def spread_model(model: ModelOptions) -> Iterator[None]:
    """--tp: torchrun's process group joined for the run, which loads the model spread over it
    (sources/hf.py) and runs every batch on every rank; left after it."""
    if not model.tp:
        yield
        return
    group = join()
    if group is None:
        raise UsageError(
            "--tp spreads the model over torchrun's processes; this is one process.",
            "run under torchrun: torchrun --nproc-per-node 2 -m hookcli … --tp",
        )
    try:
        yield
    finally:
        leave(group)


def _side_group(backend: str) -> Any:
    """A gloo group of every rank for the monitored barrier, where the backend is not gloo."""
    if backend == "gloo":
        return None
    return collective(lambda: torch.distributed.new_group(backend="gloo"), "made a side group")


def _wait_s() -> float | None:
    """HOOKCLI_RANK_WAIT_S: how long a rank that is done waits for the others (None: unset)."""
    raw = os.environ.get("HOOKCLI_RANK_WAIT_S", "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value > 0 and value < 1e9):
        raise UsageError(
            f"HOOKCLI_RANK_WAIT_S={raw!r} is not a number of seconds above 0.",
            "e.g. HOOKCLI_RANK_WAIT_S=600, or unset it.",
        )
    return value


# what `agree` compares, as users name it
SETTINGS = {
    "command": "the command (inspect, grads, check, diff …)",
    "model": "the model, its weights or seed",
    "selection": "the layer selection (--layer, --type, --depth)",
    "run": "the run's options (--hist, --save, --profile, --train …)",
    "backward": "the backward (--target, --loss)",
    "folder": "the batching (--batch-size, --limit, --per-image)",
    "inputs": "the input options (--strict …)",
}


def agree(group: Group, settings: Mapping[str, Any], files: Sequence[str]) -> None:
    """Every rank was started with the same command and lists the same images, or the run is
    refused on every rank before any batch (issue 32: ranks started with other arguments, or a
    folder two nodes hold in different states, were merged into one wrong report). A setting
    that is a dataclass is compared field by field, so the message names the field."""
    flat: dict[str, tuple[str, str]] = {}  # key → (what it is, its value as text)
    for key, value in settings.items():
        what = SETTINGS.get(key, key)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                flat[f"{key}.{f.name}"] = (f"{what}: {f.name}", repr(getattr(value, f.name)))
        else:
            flat[key] = (what, repr(value))
    digest = hashlib.sha256("\0".join(files).encode("utf-8", "surrogatepass")).hexdigest()
    mine = ({k: v for k, (_, v) in flat.items()}, digest, len(files))
    every: list[Any] = [None] * group.world
    collective(lambda: torch.distributed.all_gather_object(every, mine), "compared their runs")
    base, base_digest, base_n = every[0]
    for rank, (other, other_digest, n) in enumerate(every[1:], 1):
        for key, (what, _) in flat.items():
            if other.get(key) != base.get(key):
                raise UsageError(
                    f"torchrun: rank {rank} was started with other arguments than rank 0 "
                    f"({what} {_short(other.get(key))} vs {_short(base.get(key))}); ranks of "
                    "different runs cannot be merged into one report.",
                    "start every rank with the same command line.",
                )
        if other_digest != base_digest:
            raise UsageError(
                f"torchrun: rank {rank} lists the images differently from rank 0 ({n} vs "
                f"{base_n} images): the folder changed, or two nodes hold different copies.",
                "give every rank the same folder, unchanged while the run goes.",
            )


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "…"


def collective(call: Callable[[], Any], what: str) -> Any:
    """A collective call; a process group broken under it (a rank that died, was stopped or
    timed out) is one line naming what the ranks were doing, never a traceback."""
    try:
        return call()
    except RuntimeError as exc:  # DistBackendError and gloo's own errors included
        raise ModelError(
            f"torchrun: the ranks' process group broke while they {what} ({one_line(exc)}): "
            "a rank died, was stopped or never came.",
            "the failing rank's own output says why; rerun when every rank can finish.",
        ) from exc


_RANKS = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def arrive(group: Group, elapsed: float) -> None:
    """Wait for every rank to finish its batches, for a bounded time: HOOKCLI_RANK_WAIT_S, or
    twice this rank's own time plus two minutes (the shares differ by at most a batch). A rank
    still not there (hung in its forward, or dead) is named in one line, exit 3, instead of
    the others waiting at the gather for ever."""
    wait = _wait_s()
    timeout = wait if wait is not None else 2 * elapsed + 120
    dist = torch.distributed
    try:  # monitored_barrier is gloo's: NCCL ranks meet in their gloo side group
        dist.monitored_barrier(
            group=group.side, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True
        )
    except RuntimeError as exc:
        found = _RANKS.search(str(exc))
        if found:
            late = found.group(1).strip().rstrip(",")
            raise ModelError(
                f"torchrun: rank {late} did not finish its batches within {timeout:.0f} s of "
                f"rank {group.rank} (hung or dead); the run ends without a report.",
                "look at that rank's output; HOOKCLI_RANK_WAIT_S sets how long ranks wait.",
            ) from exc
        raise ModelError(
            f"torchrun: rank {group.rank} lost the others while waiting for them "
            f"({one_line(exc)}); the run ends without a report.",
            "the other ranks' output says why (rank 0 names a rank that did not finish).",
        ) from exc


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
    collective(lambda: torch.distributed.broadcast_object_list(box, src=0), "shared --hist edges")
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
    collective(lambda: dist.all_reduce(have), "summed gradients")
    out: list[torch.Tensor | None] = []
    for t, ref, n in zip(tensors, like, have.tolist(), strict=True):
        if not n:
            out.append(None)
            continue
        if t is None:
            total = torch.zeros(ref.shape, dtype=torch.float64, device=device)
        else:
            total = t.to(device, torch.float64)
        collective(functools.partial(dist.all_reduce, total), "summed gradients")
        out.append(total)
    return out


_P = TypeVar("_P")


def gather(part: _P, group: Group, elapsed: float) -> list[_P]:
    """Every rank's part (anything with a `rank`), on every rank, in rank order, once every
    rank has arrived (`arrive`: `elapsed` is this rank's own time on its batches)."""
    arrive(group, elapsed)
    parts: list[Any] = [None] * group.world
    collective(lambda: torch.distributed.all_gather_object(parts, part), "gathered results")
    return sorted(parts, key=lambda p: int(p.rank))
