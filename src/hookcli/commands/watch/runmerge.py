"""Several rank logs of one run merged into one, and what every reader of a run shares.

Rank logs (torchrun: run.rank0.jsonl, run.rank1.jsonl, …) merge into the log one process over
the whole batch would have written, when each rank's loss is a mean over an equal shard of it:

- activations (`inputs`, `outputs`): each rank's statistics are over its shard, so they combine
  exactly by Chan's parallel update (engine.aggregate.Accumulator);
- activation gradients (`grad_outputs`, `grad_inputs`) are first scaled by 1/W: DDP minimises
  the mean of the W ranks' losses, so d(mean loss)/d(activation) = (1/W) · the rank's local
  gradient (mean, std, min, max and norm scale; zeros and NaN/Inf counts do not), then merged;
- parameters are all-reduced by DDP, so every rank holds the same: rank 0's are taken, and a
  rank that disagrees beyond 1e-5 relative is a note (not one DDP model?), not an error;
- the loss is the mean of the ranks'.

Every log's lines are records (records.StepLine, NonfiniteLine; logread builds them), and a
merged step is a StepLine too: a single process's (world_size 1) with `merged_ranks` set, its
non-finite origins each marked with the rank whose log named it (RankOrigin). No torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hookcli.commands.watch.logread import LogFile, read_log
from hookcli.engine.aggregate import Accumulator
from hookcli.errors import UsageError
from hookcli.records import LoggedCall, NonfiniteLine, Origin, StepLine, TensorStats, rescale
from hookcli.text import escape

PARAM_RTOL = 1e-5  # ranks of one DDP model agree on their parameters within this


@dataclass(slots=True)
class RankOrigin(Origin):
    """A non-finite origin of a merged step: the Origin fields plus the rank whose log said so."""

    rank: int = 0


@dataclass(slots=True)
class Run:
    """A run as one process over the whole batch would have logged it: `steps` are step
    records in step order (merged when several rank logs were given), `events` every rank's
    non-finite events; `ranks` the logs merged, `world_size` the processes of the run."""

    files: list[str]
    ranks: int
    world_size: int
    steps: list[StepLine]
    events: list[NonfiniteLine]
    notes: list[str] = field(default_factory=list)

    @property
    def step_numbers(self) -> list[int]:
        return [s.step for s in self.steps]


def load_run(paths: Sequence[str | Path]) -> Run:
    """One log, or every rank's log of one run merged (see the module docstring)."""
    if not paths:
        raise UsageError("no run log given.", "e.g. hookcli report run.jsonl")
    logs = [read_log(p) for p in paths]
    notes = [n for log in logs for n in log.notes]
    if len(logs) == 1:
        (log,) = logs
        shared = _data_parallel(log)
        if log.world_size > 1 and (shared is None or shared[1] > 1):
            notes.append(
                f"{Path(log.path).name} is rank {log.rank} of {log.world_size}: statistics over "
                "its shard of each batch only (give every rank's log to merge them)"
            )
        return Run([log.path], 1, log.world_size, list(log.steps.values()), log.events, notes)
    return merge_logs(logs, notes)


def merge_logs(logs: Sequence[LogFile], notes: list[str] | None = None) -> Run:
    """The rank logs of one run merged step by step."""
    notes = list(notes or [])
    names = [Path(log.path).name for log in logs]
    worlds = {log.world_size for log in logs}
    world = max(worlds)
    if len(worlds) > 1 or world < len(logs):
        sizes = ", ".join(
            f"{n} rank {log.rank} of {log.world_size}" for n, log in zip(names, logs, strict=True)
        )
        raise UsageError(
            f"{len(logs)} logs given for a run of {world} processes ({sizes}): not one run.",
            "give every rank's log of one run: run.rank0.jsonl run.rank1.jsonl …",
        )
    by_rank: dict[int, LogFile] = {}
    for log, name in zip(logs, names, strict=True):
        other = by_rank.get(log.rank)
        if other is not None:
            raise UsageError(
                f"{Path(other.path).name} and {name} are both rank {log.rank}'s log.",
                "give each rank's log once.",
            )
        by_rank[log.rank] = log
    if len(logs) < world:
        missing = ", ".join(str(r) for r in range(world) if r not in by_rank)
        raise UsageError(
            f"{len(logs)} logs given for a run of {world} processes (rank {missing} missing).",
            "give every rank's log of one run: run.rank0.jsonl run.rank1.jsonl …",
        )
    ordered = [by_rank[r] for r in range(world)]
    every = sorted({s for log in ordered for s in log.steps})
    for log in ordered:
        gone = [s for s in every if s not in log.steps]
        if gone:
            has = next(o for o in ordered if gone[0] in o.steps)
            raise UsageError(
                f"run log {escape(log.path)} (rank {log.rank}) has no step {gone[0]}, which "
                f"{escape(Path(has.path).name)} has"
                + (f" ({len(gone)} steps missing in all)" if len(gone) > 1 else "")
                + ".",
                "give the logs of one run, whole (a rank that stopped early ends its log "
                "early: read the ranks one at a time).",
            )
    # every rank's NaN/Inf events (a tensor-parallel rank's own part may be the one holding it)
    events = sorted((e for log in ordered for e in log.events), key=lambda e: e.step)
    ordered = _one_per_data(ordered, notes)
    steps = []
    for s in every:
        merged, disagree = merge_step([log.steps[s] for log in ordered])
        steps.append(merged)
        notes += disagree
    return Run([log.path for log in ordered], len(ordered), world, steps, events, notes)


def _data_parallel(log: LogFile) -> list[int] | None:
    """A log's [data-parallel index, count] when its ranks share data (tensor parallel)."""
    first = next(iter(log.steps.values()), None)
    return None if first is None else first.data_parallel


def _one_per_data(ordered: list[LogFile], notes: list[str]) -> list[LogFile]:
    """The logs to merge: every rank's, or where ranks share their data (tensor parallel:
    each logs the same, whole activations) the first rank of each data-parallel index."""
    if all(_data_parallel(log) is None for log in ordered):
        return ordered
    first: dict[int, LogFile] = {}
    for log in ordered:
        shared = _data_parallel(log)
        index = log.rank if shared is None else shared[0]
        first.setdefault(index, log)
    picked = [first[i] for i in sorted(first)]
    notes.append(
        f"ranks share their data (tensor parallel): {len(picked)} of {len(ordered)} rank logs "
        f"merged, one per data-parallel index (ranks {', '.join(str(g.rank) for g in picked)})"
    )
    return picked


def merge_step(records: Sequence[StepLine]) -> tuple[StepLine, list[str]]:
    """One step's records from W ranks (rank order) merged into the record one process over
    the whole batch would have written, and notes on what did not agree."""
    w = len(records)
    first = records[0]
    step = first.step
    notes: list[str] = []
    finite = [float(r.loss) for r in records if r.loss is not None]
    # layer calls, in the order rank 0 saw them (then any only other ranks ran)
    calls: dict[tuple[str, int], list[LoggedCall]] = {}
    for r in records:
        for c in r.layers:
            calls.setdefault((c.name, c.call), []).append(c)
    layers = []
    for (name, call), parts in calls.items():
        if len(parts) != w:
            notes.append(
                f"step {step}: {name} call {call} ran on {len(parts)} of {w} ranks; merged "
                "over those"
            )
        layers.append(
            LoggedCall(
                name=parts[0].name,
                type=parts[0].type,
                call=parts[0].call,
                inputs=merge_tensors([c.inputs for c in parts]),
                outputs=merge_tensors([c.outputs for c in parts]),
                grad_outputs=_merge_grads([c.grad_outputs for c in parts], w),
                grad_inputs=_merge_grads([c.grad_inputs for c in parts], w),
                error=next((c.error for c in parts if c.error), None),
            )
        )
    notes += _shapes_agree(records)
    notes += _params_agree(records)
    merged = dataclasses.replace(
        first,
        rank=0,
        world_size=1,
        loss=math.fsum(finite) / w if len(finite) == w else None,
        layers=layers,
        nonfinite_origins=[
            RankOrigin(**{f: getattr(o, f) for f in _ORIGIN_FIELDS}, rank=r.rank)
            for r in records
            for o in r.nonfinite_origins
        ],
        loss_nonfinite=True if any(r.loss_nonfinite for r in records) else first.loss_nonfinite,
        skipped=True if any(r.skipped for r in records) else first.skipped,
        merged_ranks=w,
        memory=None,  # each rank's own: read them in the rank logs
    )
    if any(r.memory is not None for r in records):
        notes.append(f"step {step}: memory is each rank's own and not merged (see the rank logs)")
    return merged, notes


_ORIGIN_FIELDS = tuple(f.name for f in dataclasses.fields(Origin))


def _merge_grads(lists: Sequence[list[TensorStats] | None], w: int) -> list[TensorStats] | None:
    """Activation gradients merged, each rank's first scaled by 1/W; None when no rank had
    any (the call's tensors had no gradient)."""
    if all(x is None for x in lists):
        return None
    return merge_tensors([x or [] for x in lists], 1.0 / w)


def merge_tensors(lists: Sequence[Sequence[TensorStats]], scale: float = 1.0) -> list[TensorStats]:
    """Each path's statistics over every rank's shard (Chan's update), each part's scaled
    statistics (mean, std, min, max, norm; not zeros or NaN/Inf counts) first multiplied by
    `scale` (a gradient's 1/W)."""
    acc: dict[str, Accumulator] = {}
    for tensors in lists:
        for part in tensors:
            t = part if scale == 1.0 else scaled(part, scale)
            a = acc.get(t.path)
            if a is None:
                a = acc[t.path] = Accumulator(t.path, t.dtype, t.shape[1:])
            a.add(t)
    return [a.stats() for a in acc.values()]


def scaled(t: TensorStats, scale: float) -> TensorStats:
    """A copy of a tensor's statistics with the ones that scale with it multiplied by `scale`
    (> 0: records.rescale)."""
    copy = dataclasses.replace(t)
    rescale(copy, scale)
    return copy


def _params_agree(records: Sequence[StepLine]) -> list[str]:
    """DDP all-reduces gradients, so every rank steps the same weights: a parameter whose norm,
    gradient norm or update differs beyond PARAM_RTOL is worth a note (one per step)."""
    step = records[0].step
    base = {p.name: p for p in records[0].params}
    for r in records[1:]:
        for p in r.params:
            q = base.get(p.name)
            if q is None:
                return [f"step {step}: rank {r.rank} has parameter {p.name}, rank 0 has not"]
            for what, a, b in (
                ("norm", q.norm, p.norm),
                ("gradient norm", _grad_norm(q.grad), _grad_norm(p.grad)),
                ("update norm", q.update_norm, p.update_norm),
            ):
                if not _close(a, b):
                    return [
                        f"step {step}: ranks disagree on {p.name}'s {what} (rank 0 "
                        f"{_g(a)}, rank {r.rank} {_g(b)}): not one DistributedDataParallel "
                        "model? parameters are rank 0's"
                    ]
    return []


def _shapes_agree(records: Sequence[StepLine]) -> list[str]:
    """Ranks of one DDP run see each tensor with the same shape after the batch dimension;
    the first that differs is a note for the step (its statistics are merged regardless)."""
    seen: dict[tuple[str, int, str, str], list[tuple[int, tuple[int, ...]]]] = {}
    for r in records:
        for c in r.layers:
            for kind in ("inputs", "outputs", "grad_outputs", "grad_inputs"):
                for t in getattr(c, kind) or []:
                    seen.setdefault((c.name, c.call, kind, t.path), []).append(
                        (r.rank, tuple(t.shape))
                    )
    for (name, call, kind, path), shapes in seen.items():
        if len({x[1:] for _, x in shapes}) > 1:
            listed = ", ".join(f"rank {r} {'x'.join(map(str, x))}" for r, x in shapes[:4])
            return [
                f"step {records[0].step}: the ranks disagree on the shape of {name} call {call} "
                f"{kind[:-1].replace('_', ' ')} {path} ({listed}): statistics merged over all "
                "their elements; not the ranks of one model?"
            ]
    return []


def _grad_norm(t: TensorStats | None) -> float | None:
    return None if t is None else t.norm


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= PARAM_RTOL * max(abs(a), abs(b)) + 1e-30


def _g(v: float | None) -> str:
    return "null" if v is None else f"{v:.6g}"


def nonfinite_in(t: TensorStats | None) -> bool:
    """Whether a tensor's statistics count NaN or Inf."""
    return t is not None and bool(t.nan or t.inf)


def loss_nonfinite(run: Run) -> list[bool]:
    """The steps whose loss was not finite: the recorder marked it (`loss_nonfinite`), a
    non-finite event said so, or (logs without the mark) the loss is null
    where other steps logged one (the log writes NaN/Inf as null)."""
    said = {e.step for e in run.events if "loss" in e.found}
    logged = any(s.loss is not None for s in run.steps)
    return [
        bool(s.loss_nonfinite) or s.step in said or (logged and s.loss is None) for s in run.steps
    ]
