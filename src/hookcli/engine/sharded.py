"""Tensors sharded by torch's distributed engine (DTensor: FSDP2's parameters and gradients, a
tensor-parallel module's weights, inputs and outputs), measured as the global tensor each
stands for, without gathering it.

Each rank measures its own shard (its local tensor) into a row, as any tensor. When the pass
ends (`StatsCollector.finalize`), the rows of every sharded tensor are exchanged over the
process group of each mesh dimension the tensor is sharded on — every row of the pass packed
into one buffer, one `all_gather` per group — and merged into the row of the whole tensor:
counts and sums added, means and variances by Chan et al.'s parallel update (the merge folder
runs and torchrun use, engine/aggregate.py), least and greatest kept, norms by their squares.
A placement `Replicate` is counted once (every rank holds the same values); `Partial` is
reduced first (its values are a sum not yet taken), which moves one shard's worth of data.

Every rank of the group must measure the same sharded tensors in the same order (one program
on every rank, as torch's distributed engine assumes); the shapes recorded are the global
shapes. Nothing here imports torch.distributed unless a DTensor exists.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hookcli.engine.statrow import COUNT, INF, MAX, MEAN, MIN, NAN, NORM, ROW, VAR, ZEROS
from hookcli.engine.tplayout import NONE, UNKNOWN, Declared, Layouts, tp_layouts
from hookcli.records import TENSOR_STATS, TensorStats, rescale
from hookcli.tree import map_tensors

# the row's counts of elements, added: the one pass's, and each AFTER_PASS statistic's that
# is a count or a fraction (another kind of value does not merge from the parts: NaN, unknown)
_SUMMED = (ZEROS, NAN, INF)
_AFTER = tuple(s.count or s.fraction for s in TENSOR_STATS[ROW - 1 :])


def is_sharded(t: torch.Tensor) -> bool:
    """Whether t is a DTensor (cheap: torch.distributed.tensor is imported once one exists)."""
    if type(t) is torch.Tensor:
        return False
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (this rank's values, as they are), any other tensor itself."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]


def whole_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value as a plain tensor (replicated: its local part, no exchange;
    else gathered, a collective every rank makes), any other tensor itself."""
    if not is_sharded(t):
        return t
    if all(p.is_replicate() for p in t.placements):  # type: ignore[attr-defined]
        return t.to_local()  # type: ignore[attr-defined,no-any-return]
    return t.full_tensor()  # type: ignore[attr-defined,no-any-return]


def groups_of(t: torch.Tensor) -> tuple[Any, ...]:
    """The process groups over which a DTensor's other parts lie, one per mesh dimension it
    is sharded on (a plain tensor, or a replicated one: none)."""
    if not is_sharded(t):
        return ()
    placements, mesh = t.placements, t.device_mesh  # type: ignore[attr-defined]
    return tuple(mesh.get_group(d) for d, p in enumerate(placements) if _split(p))


@dataclass(slots=True)
class Shards:
    """A measured row that stands for one shard: its place among the collector's rows and the
    process groups its shards lie over (one per mesh dimension it is sharded on)."""

    row: int
    groups: tuple[Any, ...]
    # a data-parallel rank's batch: its size (dimension 0) and element count, each added over
    # `over` (the data-parallel groups among `groups`; the others hold the same rows)
    batch: tuple[int, int] | None = None
    over: tuple[Any, ...] = ()
    who: Any = None  # whose tensor (layer, call, kind): the ranks' rows agree by it too


@dataclass(slots=True)
class Squares:
    """Squared norms of local parts (`values`), each part's others lying over `groups` (none:
    the whole, kept as it is): added over the groups in the pass's gather, in place."""

    values: list[float]
    groups: list[tuple[Any, ...]]  # (as many as values)
    added: bool = False  # False: the ranks did not agree, and the values are this rank's


def local_part(t: Any) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """A DTensor's local values to measure, and the process groups over which the other
    parts lie (none: every rank holds the whole tensor). A Partial placement is reduced first
    (to Replicate): its local values are not yet the tensor's."""
    from torch.distributed.tensor import Replicate

    placements = tuple(t.placements)
    if any(p.is_partial() for p in placements):
        # a row-wise embedding's partial (_MaskPartial) holds the mask its one reduction
        # uses up: kept for the style's own reduction, which follows this hook
        masks = [
            (b, b.data, getattr(b, "refcount", None))
            for p in placements
            if (b := getattr(p, "mask_buffer", None)) is not None
            and getattr(b, "data", None) is not None
        ]
        try:
            t = t.redistribute(
                t.device_mesh, [Replicate() if p.is_partial() else p for p in placements]
            )
        finally:
            for buffer, data, count in masks:
                buffer.data = data
                if count is not None:
                    buffer.refcount = count
        placements = tuple(t.placements)
    mesh = t.device_mesh
    groups = tuple(mesh.get_group(d) for d, p in enumerate(placements) if _split(p))
    return t.to_local(), groups


def _split(placement: Any) -> bool:
    """Whether a placement splits the tensor over its mesh dimension (Shard, and FSDP2's
    _StridedShard over tensor parallel): neither Replicate nor Partial."""
    return not placement.is_replicate() and not placement.is_partial()


_NO = Shards(-1, ())  # a row that is no shard's
Key = tuple[int, int, tuple[int, ...]]  # where a tensor's values lie: storage, offset, layout
_HELD = 8  # shards of the last dimension held for their views (a module's next few calls)


class ShardBook:
    """One pass's sharded tensors: each shard's row (`shards`), and what a tensor-parallel
    style hands on as a plain local tensor (use_local_output). Such a tensor is found by where
    its values lie (the DTensor's own local tensor still alive: never a reused address), so
    the next module's input is measured as the global tensor too. A module fed one and not
    itself parallel (an activation between two parallel Linears) makes new tensors from this
    rank's part: their rows say so (`suspect`), never a shard shown as the tensor without a
    word — unless a parallel style later in the pass declares their values a DTensor's shard
    (the next module's input), which makes them the whole tensor's after all (`merge`)."""

    def __init__(self) -> None:
        self.shards: list[Shards] = []
        # a data-parallel model's groups (engine/sharded.data_parallel_groups): each rank's
        # batch of activations and their gradients merged into the global batch
        self.batch_groups: tuple[Any, ...] = ()
        # each sharded local's place: its DTensor's local tensor (weakly), groups, global shape
        self.local_shards: dict[Key, tuple[weakref.ref[torch.Tensor], tuple[Any, ...], Any]] = {}
        self.fed: dict[Any, str] = {}  # (module, call) fed a local shard: the whole it is of
        # rows of a fed module's tensors, by where their values lie: (the tensor, weakly; its
        # row; the note), and those a parallel style declared a shard: row → (groups, shape)
        self._suspects: dict[Key, tuple[weakref.ref[torch.Tensor], int, str]] = {}
        self._declared: dict[int, tuple[tuple[Any, ...], Any, str]] = {}
        # transformers' tensor-parallel styles (engine/tplayout.py), set for each pass; the
        # layout each placed plain tensor got, by (module, call, side, path): its gradient's;
        # a fed module call's shard (groups, local shape, global shape); the last few shards
        # of the last dimension by where their values start (their views: heads split out of
        # features), held, so that their place is not another tensor's while they are here
        self.layouts: Layouts = NONE
        # a tensor-parallel model's groups: the rows of the pass not split over them are
        # compared over them (engine/sharded.tensor_parallel_groups)
        self.checked: tuple[Any, ...] = ()
        self.distributed = False  # a pass of a model of more than one rank (arm_*)
        # squared norms of local parts riding along in the pass's gather, added over their
        # groups there (watch's weights and updates: engine/sharded.Squares)
        self.squares: list[Squares] = []
        # rows of activation gradients merged over the batch's groups, and after the merge,
        # the factor each is scaled by (`scale_gradients`)
        self._batch_grads: set[int] = set()
        self._dp: tuple[Any, ...] = ()  # the data-parallel groups (arm_tensor_parallel)
        # each sharded local's DTensor, by where its values lie: (its local tensor, weakly;
        # mesh, placements, shape, stride): what the backward target and the predictions read
        # the model's output as (`as_whole`)
        self._dtensors: dict[
            Key, tuple[weakref.ref[torch.Tensor], Any, tuple[Any, ...], Any, tuple[int, ...]]
        ] = {}
        self._grad_scale: dict[int, float] = {}
        self._placed: dict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] = {}
        self._fed_as: dict[Any, tuple[tuple[Any, ...], Any, Any]] = {}
        self._starts: dict[tuple[int, int], tuple[torch.Tensor, Any, Any]] = {}

    def arm_tensor_parallel(self, model: Any, dp: Sequence[Any] | None = None) -> None:
        """For a pass of `model`: transformers' tensor-parallel styles (which plain tensors are
        one rank's shard), and the groups over which every row not split is compared: those
        its parameters are split over, but the data-parallel ones (`dp`; default: the batch's
        groups). (No walk of the model outside a process group: no DTensor exists there.)"""
        self._dp = tuple(self.batch_groups if dp is None else dp)
        self.distributed = _world() > 1
        self.checked = tensor_parallel_groups(model, self._dp)
        self.layouts = tp_layouts(model) if self.checked else NONE

    def part(
        self, t: torch.Tensor, context: Any = None, path: str = ""
    ) -> tuple[torch.Tensor, tuple[Any, ...], Any] | None:
        """(the values to measure, the groups of the other parts, the global shape) of a
        DTensor, of a known DTensor's local tensor (`context`: whose tensor it is, noted as
        fed a shard), or of a plain tensor a tensor-parallel style declares a shard (`path`:
        which of the call's tensors); None for any other tensor."""
        sharded = is_sharded(t)
        if self.layouts and not sharded and t.device.type != "meta" and isinstance(context, tuple):
            placed = self._place(t, context, path)
            if placed is not None:
                return placed
        if sharded:
            local, groups = local_part(t)
            own: torch.Tensor | None = getattr(t, "_local_tensor", None)
            key = None if own is None or own.device.type == "meta" else values_key(own)
            if groups and own is not None and key is not None:
                self.local_shards[key] = (weakref.ref(own), groups, t.shape)
                mesh, placements = t.device_mesh, tuple(t.placements)  # type: ignore[attr-defined]
                if not any(p.is_partial() for p in placements):  # (its values: this shard's)
                    self._dtensors[key] = (weakref.ref(own), mesh, placements, t.shape, t.stride())
                was = self._suspects.pop(key, None)  # both alive: the same values
                if was is not None and was[0]() is not None:
                    self._declared[was[1]] = (groups, t.shape, was[2])
            return local, groups, t.shape
        if self.local_shards and t.device.type != "meta":
            found = self._known(t)
            if found is not None:
                if isinstance(context, tuple) and len(context) >= 3:
                    n = math.prod(g.size() for g in found[0])
                    self.fed[context[:2]] = (
                        "made from its shard of a tensor-parallel tensor "
                        f"({'x'.join(map(str, found[1]))} over {n} ranks)"
                    )
                    if context[2] == "in":
                        self._fed_as[context[:2]] = (found[0], tuple(t.shape), found[1])
                    self._placed[(*context[:2], _side(context[2]), path)] = found
                return t, found[0], found[1]
        return None

    def _known(self, t: torch.Tensor) -> tuple[tuple[Any, ...], Any] | None:
        key = values_key(t)
        found = None if key is None else self.local_shards.get(key)
        if found is None or found[0]() is None:  # its DTensor's values gone: not that tensor
            return self._viewed(t, key)
        return found[1], found[2]

    def _viewed(self, t: torch.Tensor, key: Key | None) -> tuple[tuple[Any, ...], Any] | None:
        """A view of a known shard of the last dimension, as heads split out of a colwise
        projection's features (`q.view(b, s, heads, d)` into a per-head norm): the same
        values, whose dimension that splits the features is the one split over the ranks.
        Registered, so the module it feeds is fed a shard."""
        start = self._starts.get(key[:2]) if key is not None else None
        whole = None if start is None else start[0]
        if whole is None or whole.numel() != t.numel():
            return None
        if not (t.is_contiguous() and whole.is_contiguous()):
            return None
        assert start is not None
        assert key is not None
        _, groups, shape = start
        outer = math.prod(whole.shape[:-1])
        # the dimension where the features begin: past the others kept as they were, or the
        # one place where the dimensions before it hold as many elements as those others
        lead = whole.dim() - 1
        starts = [j for j in range(t.dim()) if math.prod(t.shape[:j]) == outer]
        if t.dim() > lead and t.shape[:lead] == whole.shape[:lead]:
            starts = [lead]
        n = shape[-1] // whole.shape[-1] if whole.shape[-1] else 0
        if len(starts) != 1 or n < 1 or shape[-1] != n * whole.shape[-1]:
            return None
        j = starts[0]
        size = torch.Size((*t.shape[:j], t.shape[j] * n, *t.shape[j + 1 :]))
        self.local_shards[key] = (weakref.ref(t), groups, size)
        return groups, size

    def _place(
        self, t: torch.Tensor, context: tuple[Any, ...], path: str
    ) -> tuple[torch.Tensor, tuple[Any, ...], Any] | None:
        """A plain tensor's layout under a tensor-parallel plan: its gradient's is its tensor's;
        a module's first input or output, as the module's style declares; the output of a leaf
        fed a shard, of the shape it was fed, that shard's layout."""
        name, call, kind = context[0], context[1], context[2]
        side = _side(kind)
        found = self._placed.get((name, call, side, path))
        if found is not None or kind not in ("in", "out"):
            return None if found is None else (t, *found)
        first = path in (side, f"{side}[0]")
        layout = self.layouts.sides.get(name, {}).get(side) if first else None
        if layout == UNKNOWN:
            said = "made by a tensor-parallel style hookcli does not know"
            self.fed.setdefault((name, call), said)
            return None
        last = False  # a declared shard of the last dimension: its views are looked for
        if isinstance(layout, Declared):
            if not t.dim():
                return None
            shape = list(t.shape)
            dim = layout.dim % t.dim()
            shape[dim] = layout.size or shape[dim] * layout.group.size()
            found = ((layout.group,), torch.Size(shape))
            last = dim == t.dim() - 1
        else:
            fed = self._fed_as.get((name, call)) if layout is None and side == "out" else None
            if fed is None or name not in self.layouts.leaves or tuple(t.shape) != fed[1]:
                return None
            split = [d for d, (a, b) in enumerate(zip(fed[1], fed[2], strict=True)) if a != b]
            within = bool(split) and max(split) < len(fed[1]) - 1  # whole last-dimension rows
            if name not in self.layouts.elementwise and not within:
                return None
            found = (fed[0], fed[2])
        self._placed[(name, call, side, path)] = found
        key = values_key(t)
        if key is not None:
            self.local_shards[key] = (weakref.ref(t), *found)
            if last:
                self._starts[key[:2]] = (t, *found)
                while len(self._starts) > _HELD:  # the oldest goes
                    del self._starts[next(iter(self._starts))]
        return (t, *found)

    def plain(self, t: torch.Tensor, stats: TensorStats, row: int, context: Any) -> str | None:
        """A plain tensor's row (an activation or its gradient, measured as `stats`): a
        data-parallel rank's batch merged into the global batch; else `suspect`'s note."""
        said = self.suspect(t, row, context) if self.fed else None
        if self.batch_groups and t.dim() >= 1:
            self.sharded(row, (), stats, context)
        elif self.batch_groups:  # (a 0-d tensor: no batch dimension to merge over the ranks)
            own = "this rank's own value (a 0-d tensor: no batch to merge over the ranks)"
            said = f"{said}; {own}" if said else own
        return said

    def sharded(
        self, row: int, groups: tuple[Any, ...], stats: TensorStats | None, context: Any = None
    ) -> None:
        """Row `row` merged over `groups` (a DTensor's shards) and, for an activation or its
        gradient (`stats` given; `context`, the collector's: which) of a data-parallel model,
        over the batch's groups too."""
        who = context if isinstance(context, tuple) else None
        if stats is None or not self.batch_groups or not stats.shape:
            self.shards.append(Shards(row, groups, who=who))
            return
        batch = (stats.shape[0], stats.numel)
        over = tuple(g for g in self.batch_groups if g not in groups)  # (dim 0 split over dp)
        self.shards.append(Shards(row, groups + over, batch, over, who))
        if over and isinstance(context, tuple) and context[-1] in _GRADIENTS:
            self._batch_grads.add(row)

    def suspect(self, t: torch.Tensor, row: int, context: Any) -> str | None:
        """A note for a plain tensor (row `row`) of a module call fed a local shard, and not
        itself one: this rank's part only, its layout not known. None for any other."""
        whole = self.fed.get(context[:2]) if isinstance(context, tuple) else None
        key = None if whole is None else values_key(t)
        if whole is None or key is None:
            return None
        said = f"this rank's part only: {whole}, and how it lies over the ranks cannot be told here"
        self._suspects[key] = (weakref.ref(t), row, said)
        return said

    def merge(
        self, rows: list[Sequence[float]], handed: Sequence[tuple[TensorStats, int]]
    ) -> set[int]:
        """Every shard's row replaced by its whole tensor's (`rows`), and the statistics of
        a suspect that turned out a known shard made the whole tensor's (`handed`); the book
        emptied for the next pass. Returns the rows a plain tensor's statistics were made the
        whole tensor's from (a rank's batch, a declared shard)."""
        found = self._declared
        by_row = {s.row: s for s in self.shards}
        for row, (groups, shape, _) in found.items():
            known = by_row.get(row)
            if known is None:
                self.shards.append(by_row.setdefault(row, Shards(row, groups)))
                continue
            known.groups = groups + known.groups  # a rank's batch of a declared shard
            if known.batch is not None:
                known.batch = (shape[0], math.prod(shape))
        # tensor parallel: every row not split over its group is compared over it (the same
        # on every rank, or one rank's part no style declared, said)
        dp = (*self.batch_groups, *self._dp)  # (a data-parallel split: no TP part's)
        split = {g for s in self.shards for g in s.groups if g not in dp}
        split.update(self.checked)
        compare = (
            [i for i in range(len(rows)) if not any(g in split for g in by_row.get(i, _NO).groups)]
            if split
            else []
        )
        # a distributed model's ranks always meet here, a rank that measured nothing too
        joined = self.shards or compare or self.batch_groups or self.checked or self.squares
        riding = sum(len(sq.values) for sq in self.squares)
        labels: dict[int, str] = {}
        for stats, row in handed if joined else ():
            labels.setdefault(row, stats.path)
        if joined and not agreed(self.shards, labels, len(compare), riding):
            _unmerged(self.shards, handed)
            self.clear()
            return set()
        batches, differ = (
            merge_shards(
                self.shards,
                rows,
                compare,
                checked=self.checked,
                squares=self.squares,
                batch_groups=self.batch_groups,
            )
            if self.shards or compare or self.squares
            else ({}, set())
        )
        for stats, row in handed if differ else ():
            if row in differ:
                said = (
                    "this rank's part only: its values differ between the tensor-parallel "
                    "ranks, and how they lie over them cannot be told here"
                )
                stats.note = f"{stats.note}; {said}" if stats.note else said
        for stats, row in handed if found or batches else ():
            if row in found:
                _, shape, said = found[row]
                stats.shape, stats.numel = tuple(shape), math.prod(shape)
                left = [n for n in (stats.note or "").split("; ") if n and n != said]
                stats.note = "; ".join(left) or None
            if row in batches:  # the global batch: every data-parallel rank's, in rank order
                stats.shape = (batches[row][0], *stats.shape[1:])
                stats.numel = batches[row][1]
        ranks = data_parallel_size(self.batch_groups)
        self._grad_scale = {r: 1.0 / ranks for r in self._batch_grads if r in batches}
        made = set(found) | set(batches)
        self.clear()
        return made

    def scale_gradients(self, handed: Sequence[tuple[TensorStats, int]]) -> None:
        """The activation gradients merged over a data-parallel batch (their TensorStats
        filled), each made the gradient of the mean of the ranks' losses: ÷ W, as DDP and
        FSDP average the parameters' gradients over the W ranks (the two then belong to one
        loss, and watch's merged logs give the same numbers)."""
        scale, self._grad_scale = self._grad_scale, {}
        for stats, row in handed if scale else ():
            factor = scale.get(row)
            if factor is not None:
                rescale(stats, factor)

    @staticmethod
    def tidy(handed: Sequence[tuple[TensorStats, int]], made: set[int], small: int) -> None:
        """A row made the whole tensor's from this rank's part keeps none of the part's own
        extras (its element values, histogram, per-token rows, per-channel numbers), which
        do not merge over the ranks: they are left out, and the note says so. Element values
        are said missing where the whole tensor is `small` (one process would list them),
        whatever this rank's part held: every rank's note the same."""
        for stats, row in handed if made else ():
            if row not in made:
                continue
            extras = [
                name
                for name, value in (
                    ("element values", True if 0 < stats.numel <= small else None),
                    ("histogram", stats.hist),
                    ("per-token rows", stats.per_token),
                    ("per-channel numbers", stats.channels),
                )
                if value is not None
            ]
            stats.values = None
            if extras:
                stats.hist = stats.per_token = stats.channels = None
                said = f"merged over ranks: no {', '.join(extras)} (only this rank's part had them)"
                stats.note = f"{stats.note}; {said}" if stats.note else said

    def as_whole(self, obj: Any) -> Any:
        """obj (the model's output) with each local shard a tensor-parallel style handed on
        as a plain tensor (use_local_output), and each DTensor, made the whole tensor on every
        rank (differentiably, from this rank's part: gathered): a backward target or the
        predictions then read the whole output (its top-1 over every class, not this
        rank's), as one process would, and a loss takes plain targets as it does there."""
        if not self._dtensors and "torch.distributed.tensor" not in sys.modules:
            return obj  # (no DTensor was ever made)
        from torch.distributed.tensor import DTensor

        def whole(_path: str, t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, DTensor):  # an output left a DTensor (use_local_output=False)
                return t.full_tensor()
            key = values_key(t) if type(t) is torch.Tensor and self._dtensors else None
            found = self._dtensors.get(key) if key is not None else None
            if found is None:
                return t
            own, mesh, placements, shape, stride = found
            local = own()  # (alive, and t its values: never another tensor at its address)
            if local is None or not (t is local or t._base is local):
                return t
            made = DTensor.from_local(
                t, mesh, placements, run_check=False, shape=shape, stride=stride
            )
            return made.full_tensor()

        return map_tensors(obj, whole, "out")

    def clear(self) -> None:
        self.shards.clear()
        self._batch_grads.clear()
        self._dtensors.clear()
        self.local_shards.clear()
        self.fed.clear()
        self._suspects.clear()
        self._declared.clear()
        self._placed.clear()
        self._fed_as.clear()
        self._starts.clear()
        self.squares = []


def not_merged(note: str | None, *, channels: bool, hist: bool) -> str | None:
    """A sharded tensor's note, saying which asked-for numbers its shards do not give."""
    wants = [w for w, on in (("per-channel", channels), ("histogram", hist)) if on]
    if not wants:
        return note
    lost = f"sharded: no {' or '.join(wants)} numbers (they do not merge from its shards)"
    return f"{note}; {lost}" if note else lost


_GRADIENTS = ("grad_input", "grad_output")  # a layer call's activation gradients, by kind


def data_parallel_size(groups: Sequence[Any]) -> int:
    """How many data-parallel ranks the batch is split over (1: none)."""
    return math.prod(g.size() for g in groups) if groups else 1


def mean_over_ranks(value: torch.Tensor, groups: Sequence[Any]) -> float:
    """A scalar's mean over a data-parallel model's ranks (every rank calls this, in the same
    order): the loss DDP and FSDP minimise, whose parameter gradients they average; with no
    groups, the value itself."""
    import torch.distributed as dist

    if not groups:
        return float(value.detach().double())
    total = value.detach().reshape(1).to(torch.float64).clone()
    for group in groups:
        dist.all_reduce(total, group=group)
    return float(total) / data_parallel_size(groups)


def data_parallel_groups(module: Any) -> tuple[Any, ...]:
    """The process groups over which a model's ranks each run their own batch: FSDP2's (its
    own mesh's, every dimension: HSDP's replicate and shard both), DistributedDataParallel's;
    none for any other model, or one not in a process group of more than one rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return ()
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return (module.process_group,)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return ()
    shards = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not shards:
        return ()
    try:  # FSDP2's own mesh (of a module holding parameters): every dimension data parallel
        groups = (m._get_fsdp_state()._fsdp_param_group for m in shards)
        mesh = next(g for g in groups if g is not None).mesh_info.mesh
    except (AttributeError, StopIteration):  # another torch: the parameters' mesh, if 1-D
        params: list[Any] = list(module.parameters())
        meshes = {id(p.device_mesh): p.device_mesh for p in params if is_sharded(p)}
        if len(meshes) != 1 or next(iter(meshes.values())).ndim != 1:
            return ()
        (mesh,) = meshes.values()
    return tuple(mesh.get_group(d) for d in range(mesh.ndim))


def _world() -> int:
    """The processes of the default group (1 outside one)."""
    if "torch.distributed" not in sys.modules:
        return 1
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tensor_parallel_groups(model: Any, dp: Sequence[Any]) -> tuple[Any, ...]:
    """The process groups a model's parameters are split over that are not data parallel
    (`dp`): tensor parallel's, whether torch's parallelize_module or transformers' plan made
    them; none for any other model."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor was ever made
        return ()
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():  # (a mesh needs a group)
        return ()
    found: list[Any] = []
    for p in torch.nn.Module.parameters(model):
        found += [g for g in groups_of(p) if g not in dp and g not in found]
    return tuple(found)


def data_parallel_position(model: Any) -> list[int] | None:
    """Where this rank's data lies when ranks share it (tensor parallel, alone or under FSDP2
    or DDP): [its data-parallel index, how many indices]; None when every rank runs its own
    data (DDP, FSDP2 alone) or there is one process. A log's ranks of one index hold the
    same activations (runmerge counts one of them)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    dp = data_parallel_groups(model)
    if not tensor_parallel_groups(model, dp):
        return None
    index, count = 0, 1
    for g in dp:
        index = index * g.size() + dist.get_group_rank(g, dist.get_rank())
        count *= g.size()
    return [index, count]


def _side(kind: Any) -> str:
    """Which side of a module call a tensor of `kind` lies on: its inputs' (and their
    gradients') or its outputs'."""
    return "in" if kind in ("in", "grad_input") else "out"


def values_key(t: torch.Tensor) -> Key | None:
    """Where t's values lie, and how (None: an empty tensor, whose address says nothing, or a
    tensor with no storage of its own, a wrapper subclass). The strides are part of it: a
    transpose of a square shard lies in the same place and is not that shard."""
    if t.numel() == 0:
        return None
    try:
        where = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        return (*where, (*t.shape, -1, *t.stride()))
    except (RuntimeError, NotImplementedError):
        return None


def agreed(
    shards: Sequence[Shards], labels: dict[int, str], compared: int = 0, riding: int = 0
) -> bool:
    """Whether every rank measured the same sharded tensors in the same order this pass (their
    count, and a checksum of each one's layer, call, path, groups and kind), found by one small
    all_gather over the world: rows are merged by their order, so ranks that differ (a module
    run on one rank only — another on the others, its tensors of the same paths —, a hook
    that failed on one) must not exchange them."""
    import zlib

    import torch.distributed as dist

    said = repr([(labels.get(s.row), s.who, len(s.groups), s.batch is not None) for s in shards])
    numbers = [len(shards), zlib.crc32(said.encode()), compared, riding]
    head = torch.tensor(numbers, dtype=torch.float64)
    head = head.to(_device_of(None))
    heads = [torch.empty_like(head) for _ in range(dist.get_world_size())]
    dist.all_gather(heads, head)
    return all(bool(torch.equal(h, head)) for h in heads)


def _unmerged(shards: Sequence[Shards], handed: Sequence[tuple[TensorStats, int]]) -> None:
    """The ranks measured other tensors: no row is merged, and each says so."""
    rows = {s.row for s in shards}
    said = (
        "not merged over the ranks, which measured other tensors in this pass (a module run "
        "on some ranks only?): this rank's part only"
    )
    for stats, row in handed:
        if row in rows:
            stats.note = f"{stats.note}; {said}" if stats.note else said


def merge_shards(
    shards: Sequence[Shards],
    rows: list[Sequence[float]],
    compare: Sequence[int] = (),
    *,
    checked: Sequence[Any] = (),
    squares: Sequence[Squares] = (),
    batch_groups: Sequence[Any] = (),
) -> tuple[dict[int, tuple[int, int]], set[int]]:
    """Replace each sharded row in `rows` (host numbers, every rank's pass in one order) by
    the row of the whole tensor: one all_gather per process group, the group's rows packed
    (each with its batch size, summed for a data-parallel batch's rows: returned by row).
    The rows `compare` ride along over every group that is not data parallel (and over each
    of `checked`, a tensor-parallel model's); returned too: those of them whose numbers are
    not the same on every rank of such a group. `squares` ride along too, each added over
    its groups in place."""
    import torch.distributed as dist

    sizes = {s.row: s.batch for s in shards if s.batch is not None}
    over = {s.row: s.over for s in shards}
    dp = {g for s in shards for g in s.over} | set(batch_groups)
    none = (0, 0)
    differ: set[int] = set()

    order: list[Any] = []  # the groups in the order the pass met them (the same on every rank)
    for s in shards:
        for g in s.groups:
            if g not in order:
                order.append(g)
    order += [g for g in checked if g not in order]
    for sq in squares:
        order += [g for gs in sq.groups for g in gs if g not in order]
    for group in order:
        mine = [s.row for s in shards if group in s.groups]
        ride = [] if group in dp else list(compare)
        adds = [(sq, j) for sq in squares for j, gs in enumerate(sq.groups) if group in gs]
        if not mine + ride + adds:
            continue
        width = len(rows[(mine + ride)[0]]) if mine + ride else 1
        device = _device_of(group)
        added = [sq.values[j] for sq, j in adds]  # packed width + 2 to a row
        added += [0.0] * (-len(added) % (width + 2))
        packed = torch.tensor(
            [[*rows[i], *sizes.get(i, none)] for i in mine]
            + [[*rows[i], *none][: width + 2] for i in ride]
            + [added[k : k + width + 2] for k in range(0, len(added), width + 2)],
            dtype=torch.float64,
            device=device,
        )
        parts = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, packed, group=group)
        every = torch.stack(parts).to("cpu").tolist()  # (ranks, rows, width + 2)
        for k, i in enumerate(mine):
            rows[i] = merged_row([rank[k] for rank in every], width)
            if i in sizes and group in over[i]:
                sizes[i] = (
                    int(sum(rank[k][width] for rank in every)),
                    int(sum(rank[k][width + 1] for rank in every)),
                )
        for k, i in enumerate(ride, len(mine)):
            if not all(_same(rank[k][:width], every[0][k][:width]) for rank in every):
                differ.add(i)
        first = len(mine) + len(ride)
        for k, (sq, j) in enumerate(adds):
            at, col = first + k // (width + 2), k % (width + 2)
            sq.values[j] = sum(rank[at][col] for rank in every)
    for sq in squares:
        sq.added = True
    return sizes, differ


def _same(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two rows hold the same numbers (to a float's rounding; NaN the same as NaN)."""
    return all(
        x == y
        or (math.isnan(x) and math.isnan(y))
        or math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-12)
        for x, y in zip(a, b, strict=True)
    )


def _device_of(group: Any) -> torch.device:
    """Where a collective over `group` takes its buffers: the CPU for gloo, this process's
    CUDA device for NCCL."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group) if group is not None else dist.get_backend())
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def merged_row(parts: Sequence[Sequence[float]], width: int) -> tuple[float, ...]:
    """The row of the union of disjoint parts' elements from the parts' rows (count, mean,
    population variance, min, max, zeros, NaN, Inf, norm, then counted AFTER_PASS
    statistics): Chan et al.'s update for the moments, the rest added or compared."""
    count = sum(p[COUNT] for p in parts)
    out = [0.0] * width
    out[COUNT] = count
    for i in _SUMMED:
        out[i] = sum(p[i] for p in parts)
    for i, summed in enumerate(_AFTER[: width - ROW], ROW):
        out[i] = sum(p[i] for p in parts) if summed else math.nan
    live = [p for p in parts if p[COUNT] > 0]
    if not live:
        out[MEAN] = out[VAR] = out[MIN] = out[MAX] = out[NORM] = math.nan
        return tuple(out)
    mean = sum(p[COUNT] * p[MEAN] for p in live) / count
    m2 = sum(p[COUNT] * p[VAR] + p[COUNT] * (p[MEAN] - mean) ** 2 for p in live)
    out[MIN] = min(p[MIN] for p in live)
    out[MAX] = max(p[MAX] for p in live)
    if out[MIN] == out[MAX]:  # a constant, exactly (as one tensor's row says it)
        mean, m2 = out[MIN], 0.0
    out[MEAN] = mean
    out[VAR] = max(m2 / count, 0.0)
    out[NORM] = math.sqrt(sum(p[NORM] ** 2 for p in live))
    return tuple(out)
