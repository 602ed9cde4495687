"""Exact statistics over many batches (or many processes) from per-batch statistics alone.

A TensorStats already holds what an exact merge needs: element count, NaN/Inf counts, mean and
population std of the finite elements, min, max, zero fraction and L2 norm; each statistic
declares how it merges (records/statfields.py), and the accumulator keeps one running number for
each. Two such summaries combine by Chan et al.'s parallel update (count-weighted means,
M2 = M2a + M2b + δ²·na·nb/n),
so activations are never kept — memory stays flat however many images pass — and JSON reports
written by different processes (e.g. the ranks of a torchrun job, each on its own shard of the
data) merge into the report one process would have written: see `merge_reports`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hookcli.engine.outliers import summary
from hookcli.engine.routing import merge_experts
from hookcli.io.recordjson import from_json
from hookcli.records import (
    TENSOR_STATS,
    ChannelStats,
    ExpertStats,
    LayerCall,
    Massive,
    Stat,
    TensorStats,
)

MASSIVE_KEPT = 16  # massive activations kept per tensor over a folder run (largest |x|)

Key = tuple[str, int, str, str]  # layer, call, kind (inputs/outputs/…), path

# the statistics merged from the moments (count, mean, M2) …
_MOMENTS = ("mean", "std")
# … and the others, each by its own running number: a least, a greatest, a sum of squares (a
# norm), a count of elements (a fraction's, times numel; a count's)
_RUNNING = tuple(s for s in TENSOR_STATS if s.merge not in _MOMENTS)
_START: dict[str, float] = {"min": math.inf, "max": -math.inf, "norm": 0.0, "fraction": 0.0}


def _add(a: float, b: float) -> float:
    return a + b


_COMBINE: dict[str, Callable[[float, float], float]] = {"min": min, "max": max}
_COMBINERS = tuple(_COMBINE.get(s.merge, _add) for s in _RUNNING)  # each of _RUNNING's


def _running(s: Stat, t: TensorStats) -> float:
    """A part's running number for statistic s (what merging adds up, or keeps the least or
    greatest of)."""
    v: float | None = getattr(t, s.name)
    if s.merge == "min":
        return v if v is not None else math.inf
    if s.merge == "max":
        return v if v is not None else -math.inf
    if s.merge == "norm":
        return (v or 0.0) ** 2
    if s.fraction:
        return (v or 0.0) * t.numel
    return v or 0  # a count


def _merged(s: Stat, running: float, acc: Accumulator) -> float | int | None:
    """Statistic s of the merged parts from its running number."""
    if s.count:
        return running
    if s.fraction:
        return running / acc.numel if acc.numel else None
    if acc.count <= 0:
        return None
    return math.sqrt(running) if s.merge == "norm" else running


@dataclass(slots=True)
class Accumulator:
    """Running exact statistics of one (layer, call, kind, path) across batches."""

    path: str
    dtype: str
    sample_shape: tuple[int, ...]  # the shape without its batch dimension
    numel: int = 0
    count: int = 0  # finite elements
    mean: float = 0.0
    m2: float = 0.0  # sum of squared deviations from the mean (finite elements)
    # each of _RUNNING's running number (_running: a least, a greatest, a sum)
    running: list[float] = field(default_factory=lambda: [_START.get(s.merge, 0) for s in _RUNNING])
    rows: int = 0  # batch rows (images) seen
    notes: set[str] = field(default_factory=set)
    hist_counts: list[float] | None = None  # merged when every part used the same edges
    hist_edges: list[float] | None = None
    layout: str | None = None  # the same in every batch: the layer's, not the data's
    channels: ChannelStats | None = None  # --channels: merged channel by channel
    channels_lost: bool = False  # a part without them, or of another width: none reported
    # shapes after the batch dimension that differ from the first part's (ranks of another
    # model, texts padded to other lengths): said in the merged statistics' note
    other_shapes: set[tuple[int, ...]] = field(default_factory=set)

    def add(self, t: TensorStats) -> None:
        n = t.numel - t.nan - t.inf
        other = Accumulator(
            t.path, t.dtype, t.shape[1:], t.numel, n, t.mean or 0.0, (t.std or 0.0) ** 2 * n,
            [_running(s, t) for s in _RUNNING], t.shape[0] if t.shape else 1,
        )  # fmt: skip
        if t.note:
            self.notes.add(t.note)
        other.layout = t.layout
        if t.hist:
            other.hist_counts = list(t.hist["counts"])
            other.hist_edges = list(t.hist["edges"])
        if t.channels is not None:
            other.channels = merge_channels(None, t.channels, 0)
        else:
            other.channels_lost = True
        self.merge(other)

    def merge(self, o: Accumulator) -> None:
        n = self.count + o.count
        if o.count:
            delta = o.mean - self.mean
            self.mean += delta * o.count / n
            self.m2 += o.m2 + delta * delta * self.count * o.count / n
        self.count = n
        self.numel += o.numel
        self.running = [
            f(a, b) for f, a, b in zip(_COMBINERS, self.running, o.running, strict=True)
        ]
        first = self.rows == 0
        if first:
            self.channels, self.channels_lost = o.channels, o.channels_lost
        elif not self.channels_lost:
            mine, theirs = self.channels, o.channels
            if mine is None or theirs is None or len(mine.count) != len(theirs.count):
                self.channels, self.channels_lost = None, True
            else:
                self.channels = merge_channels(mine, theirs, self.rows)
        if first:
            self.layout = o.layout
            self.sample_shape = o.sample_shape if o.rows else self.sample_shape
        elif o.rows and o.sample_shape != self.sample_shape:
            self.other_shapes.add(o.sample_shape)
        self.other_shapes |= {x for x in o.other_shapes if x != self.sample_shape}
        self.rows += o.rows
        self.notes |= o.notes
        if first:
            self.hist_counts, self.hist_edges = o.hist_counts, o.hist_edges
        elif self.hist_counts is not None and o.hist_edges == self.hist_edges and o.hist_counts:
            self.hist_counts = [a + b for a, b in zip(self.hist_counts, o.hist_counts, strict=True)]
        else:  # edges differ: counts cannot be added exactly, so none are reported
            self.hist_counts = self.hist_edges = None

    def _shapes_note(self) -> list[str]:
        """The merged parts' shapes after the batch dimension, when they differ."""
        if not self.other_shapes:
            return []
        others = sorted(self.other_shapes)
        listed = ", ".join(map(_shape_text, others[:4])) + (", …" if len(others) > 4 else "")
        return [
            "the parts merged differ in shape after the batch dimension "
            f"({_shape_text(self.sample_shape)} and {listed}): statistics over all their "
            "elements, the shape shown is the first's"
        ]

    def stats(self) -> TensorStats:
        has = self.count > 0
        merged: dict[str, Any] = {
            s.name: _merged(s, v, self) for s, v in zip(_RUNNING, self.running, strict=True)
        }
        return TensorStats(
            path=self.path,
            shape=(self.rows, *self.sample_shape),
            dtype=self.dtype,
            numel=self.numel,
            mean=self.mean if has else None,
            std=math.sqrt(max(self.m2 / self.count, 0.0)) if has else None,
            **merged,
            note="; ".join(sorted(self.notes) + self._shapes_note()) or None,
            layout=self.layout,
            channels=self.channels,
            hist=(
                {"counts": self.hist_counts, "edges": self.hist_edges}
                if self.hist_counts is not None and self.hist_edges is not None
                else None
            ),
        )


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "one value"


def merge_channels(a: ChannelStats | None, b: ChannelStats, offset: int) -> ChannelStats:
    """Two parts' per-channel statistics as one (Chan's update per channel; `offset`: the rows
    of the first part, added to the second's massive activations' batch index). Kurtosis
    does not merge from these numbers: the merged value is the largest of the parts', and the
    median |x| is left out; each part's massive activations were found against its own median.
    """
    moved = [
        Massive(m.channel, [m.index[0] + offset, *m.index[1:]], m.value, m.ratio, m.position,
                None if m.sequence is None else m.sequence + offset)
        for m in b.massive
    ]  # fmt: skip
    if a is None:
        return ChannelStats(
            b.axis, list(b.count), list(b.mean), list(b.std), list(b.min), list(b.max),
            list(b.absmax), list(b.zeros), list(b.large), b.masked, b.kurtosis, b.median_abs,
            moved, None if b.abs_hist is None else list(b.abs_hist),
        )  # fmt: skip
    mean: list[float | None] = []
    std: list[float | None] = []
    for na, ma, sa, nb, mb, sb in zip(a.count, a.mean, a.std, b.count, b.mean, b.std, strict=True):
        n = na + nb
        if not n:
            mean.append(None)
            std.append(None)
            continue
        xa, xb = ma or 0.0, mb or 0.0
        delta = xb - xa
        m2 = (sa or 0.0) ** 2 * na + (sb or 0.0) ** 2 * nb + delta * delta * na * nb / n
        mean.append(xa + delta * nb / n)
        std.append(math.sqrt(max(m2 / n, 0.0)))

    def pick(x: list[float | None], y: list[float | None], f: Any) -> list[float | None]:
        return [u if v is None else v if u is None else f(u, v) for u, v in zip(x, y, strict=True)]

    kurt = [k for k in (a.kurtosis, b.kurtosis) if k is not None]
    massive = sorted([*a.massive, *moved], key=lambda m: -abs(m.value))[:MASSIVE_KEPT]
    return ChannelStats(
        axis=a.axis,
        count=[x + y for x, y in zip(a.count, b.count, strict=True)],
        mean=mean,
        std=std,
        min=pick(a.min, b.min, min),
        max=pick(a.max, b.max, max),
        absmax=pick(a.absmax, b.absmax, max),
        zeros=[x + y for x, y in zip(a.zeros, b.zeros, strict=True)],
        large=[x + y for x, y in zip(a.large, b.large, strict=True)],
        masked=a.masked + b.masked,
        kurtosis=max(kurt) if kurt else None,
        median_abs=None,
        massive=massive,
        abs_hist=(
            [x + y for x, y in zip(a.abs_hist, b.abs_hist, strict=True)]
            if a.abs_hist is not None and b.abs_hist is not None
            else None
        ),
    )


class Aggregate:
    """Per-(layer, call) accumulators for every tensor kind, in first-seen order."""

    def __init__(self) -> None:
        self.acc: dict[Key, Accumulator] = {}
        self.order: dict[tuple[str, int], None] = {}  # (layer, call) in first-seen order
        self.types: dict[str, str] = {}

    def add(
        self, name: str, type_: str, call: int, kind: str, tensors: Iterable[TensorStats]
    ) -> None:
        self.order.setdefault((name, call), None)
        self.types[name] = type_
        for t in tensors:
            key = (name, call, kind, t.path)
            acc = self.acc.get(key)
            if acc is None:
                acc = self.acc[key] = Accumulator(t.path, t.dtype, t.shape[1:])
            acc.add(t)

    def absorb(self, other: Aggregate) -> None:
        """Another process's aggregate merged in (its calls after this one's, in its order)."""
        for call in other.order:
            self.order.setdefault(call, None)
        self.types.update(other.types)
        for key, acc in other.acc.items():
            mine = self.acc.get(key)
            if mine is None:
                mine = self.acc[key] = Accumulator(acc.path, acc.dtype, acc.sample_shape)
            mine.merge(acc)

    def tensors(self, name: str, call: int, kind: str) -> list[TensorStats]:
        return [
            a.stats() for (n, c, k, _), a in self.acc.items() if (n, c, k) == (name, call, kind)
        ]


def merge_reports(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Merge JSON reports of the same model and layers run on different data (shards): the
    result is what one run over all the data would report, statistics exact.

        import json, hookcli.engine.aggregate as agg
        parts = [json.load(open(f"rank{r}.json")) for r in range(world_size)]
        json.dump(agg.merge_reports(parts), open("all.json", "w"))
    """
    if not reports:
        raise ValueError("nothing to merge")
    specs = {r["model"]["spec"] for r in reports}
    if len(specs) != 1:
        raise ValueError(f"reports of different models: {sorted(specs)}")
    agg = Aggregate()
    for r in reports:
        for c in r["layers"]:
            for kind in ("inputs", "outputs", "grad_inputs", "grad_outputs"):
                agg.add(
                    c["name"], c["type"], c["call"], kind, [_stats(t) for t in c.get(kind) or []]
                )
    merged = dict(reports[0])
    layers = []
    for c in reports[0]["layers"]:
        entry = dict(c)
        for kind in ("inputs", "outputs", "grad_inputs", "grad_outputs"):
            if c.get(kind) is not None:
                entry[kind] = [_plain(s) for s in agg.tensors(c["name"], c["call"], kind)]
        layers.append(entry)
    merged["layers"] = layers
    if any(r.get("outliers") is not None for r in reports):
        calls = [
            LayerCall(
                c["name"], c["type"], c["call"],
                inputs=agg.tensors(c["name"], c["call"], "inputs"),
                outputs=agg.tensors(c["name"], c["call"], "outputs"),
            )
            for c in reports[0]["layers"]
        ]  # fmt: skip
        merged["outliers"] = dataclasses.asdict(summary(calls))
    if any(r.get("experts") for r in reports):
        parts = [[from_json(ExpertStats, e) for e in r.get("experts") or []] for r in reports]
        merged["experts"] = [dataclasses.asdict(e) for e in merge_experts(parts)]
    if any(r.get("heads") for r in reports):
        merged["heads"] = merge_heads([r.get("heads") or [] for r in reports])
    merged["predictions"] = [p for r in reports for p in r.get("predictions") or []] or None
    merged["input"] = dict(reports[0]["input"])
    merged["input"]["description"] = f"{len(reports)} merged reports"
    merged["input"]["sources"] = [s for r in reports for s in r["input"].get("sources") or []]
    return merged


def merge_heads(parts: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """--heads of several runs (ranks' reports) as one: each sequence keeps its own numbers,
    numbered after the previous parts' sequences (as one run over all the data numbers them),
    each call's rows together. Reports from before heads were per sequence (no `sequence`)
    merge per head as then: sink, entropy and the top key's share are means over queries,
    weighted by each part's queries; the top key kept where every part agrees on it."""
    if all(h.get("sequence") is not None for part in parts for h in part):
        calls: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        offset = 0
        for part in parts:
            for h in part:
                key = (h["layer"], h["module"], h["call"])
                calls.setdefault(key, []).append(dict(h, sequence=h["sequence"] + offset))
            offset += 1 + max((h["sequence"] for h in part), default=-1)
        return [h for rows in calls.values() for h in rows]
    merged: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for part in parts:
        for h in part:
            merged.setdefault((h["layer"], h["module"], h["call"], h["head"]), []).append(h)
    out = []
    for group in merged.values():
        n = sum(h["queries"] for h in group)

        def mean(key: str, group: list[dict[str, Any]] = group, n: int = n) -> float | None:
            if not n or any(h[key] is None for h in group if h["queries"]):
                return None
            return math.fsum(h[key] * h["queries"] for h in group) / n

        tops = {h["top_key"] for h in group if h["queries"]}
        agree = len(tops) == 1 and None not in tops
        out.append(
            dict(group[0], sink=mean("sink"), entropy=mean("entropy"), queries=n,
                 top_key=tops.pop() if agree else None,
                 top_share=mean("top_share") if agree else None)
        )  # fmt: skip
    return out


# given below (counts absent from older reports are 0), or not merged
_NOT_READ = ("shape", "values", "hist", "channels", *(s.name for s in TENSOR_STATS if s.count))


def _stats(d: dict[str, Any]) -> TensorStats:
    fields = {
        f.name: d.get(f.name) for f in dataclasses.fields(TensorStats) if f.name not in _NOT_READ
    }
    counts = {s.name: d.get(s.name, 0) for s in TENSOR_STATS if s.count}
    channels = d.get("channels")
    return TensorStats(
        shape=tuple(d["shape"]),
        channels=None if channels is None else from_json(ChannelStats, channels),
        **counts,
        **fields,  # type: ignore[arg-type]
    )


def _plain(s: TensorStats) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(s)
