"""A run's per-layer series over its watched steps (`hookcli report run.jsonl`). No torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hookcli.commands.watch.logread import RUN_SCHEMA
from hookcli.commands.watch.runmerge import Run, loss_nonfinite, nonfinite_in
from hookcli.records import LoggedCall, LoggedParam, NonfiniteLine, log_line

LAYER_METRICS = ("out std", "out mean", "zeros", "nan/inf", "grad norm")
PARAM_METRICS = ("grad norm", "update ratio")
LOSS_METRICS = ("loss",)


@dataclass(slots=True)
class Series:
    """One metric over the watched steps: a value per step (None: absent, or not finite) and
    whether NaN/Inf was there at that step."""

    metric: str
    values: list[float | None]
    bad: list[bool]


@dataclass(slots=True)
class Track:
    """The series of one layer call, one parameter, or the loss."""

    kind: str  # "layer" | "param" | "loss"
    name: str
    type: str | None
    call: int | None
    series: list[Series]

    @property
    def bad_steps(self) -> list[int]:
        """Indices of the steps where any of its series held NaN/Inf."""
        n = len(self.series[0].bad) if self.series else 0
        return [i for i in range(n) if any(s.bad[i] for s in self.series)]


@dataclass(slots=True)
class RunSeries:
    """What `hookcli report run.jsonl` shows: every track over the watched steps."""

    files: list[str]
    ranks: int
    world_size: int
    steps: list[int]
    layers: list[Track]
    params: list[Track]
    loss: Track
    events: list[NonfiniteLine]
    notes: list[str]

    @property
    def tracks(self) -> list[Track]:
        return [*self.layers, *self.params, self.loss]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: each track's series as value lists (null: absent or not finite)
        and the steps where it held NaN/Inf; the non-finite events as their log lines."""

        def track(t: Track) -> dict[str, Any]:
            out: dict[str, Any] = {"name": t.name}
            if t.kind == "layer":
                out.update(type=t.type, call=t.call)
            out["series"] = {s.metric: s.values for s in t.series}
            out["nonfinite_steps"] = [self.steps[i] for i in t.bad_steps]
            return out

        return {
            "schema": RUN_SCHEMA,
            "command": "report",
            "run": run_header(self.files, self.ranks, self.world_size, self.steps, self.notes),
            "loss": track(self.loss),
            "layers": [track(t) for t in self.layers],
            "params": [track(t) for t in self.params],
            "nonfinite_events": [log_line(e) for e in self.events],
        }


def run_header(
    files: Sequence[str], ranks: int, world_size: int, steps: Sequence[int], notes: Sequence[str]
) -> dict[str, Any]:
    return {
        "files": list(files),
        "merged_ranks": ranks,
        "world_size": world_size,
        "steps": list(steps),
        "notes": list(notes),
    }


Metric = dict[str, tuple[float | None, bool]]  # metric: (value, NaN/Inf there)


def layer_metrics(c: LoggedCall) -> Metric:
    """A logged layer call's LAYER_METRICS: its first output's std, mean and zero fraction,
    NaN+Inf over its outputs, its first output gradient's norm."""
    outs = c.outputs or []
    grads = c.grad_outputs or []
    out = outs[0] if outs else None
    grad = grads[0] if grads else None
    outs_bad = any(nonfinite_in(t) for t in outs)
    return {
        "out std": (None if out is None else out.std, outs_bad),
        "out mean": (None if out is None else out.mean, outs_bad),
        "zeros": (None if out is None else out.zeros, outs_bad),
        "nan/inf": (float(sum(t.nan + t.inf for t in outs)), outs_bad),
        "grad norm": (None if grad is None else grad.norm, any(nonfinite_in(t) for t in grads)),
    }


def param_metrics(p: LoggedParam) -> Metric:
    """A logged parameter's PARAM_METRICS: its gradient's norm and its update ratio."""
    g = p.grad
    return {
        "grad norm": (None if g is None else g.norm, nonfinite_in(g)),
        "update ratio": (p.update_ratio, False),
    }


def series(run: Run) -> RunSeries:
    """Per layer call: its first output's std, mean and zero fraction, NaN+Inf over its
    outputs, its first output gradient's norm; per parameter: gradient norm and update
    ratio; and the loss — one value per watched step."""
    n = len(run.steps)
    layer_at: dict[tuple[str, int], dict[int, LoggedCall]] = {}
    types: dict[tuple[str, int], str] = {}
    param_at: dict[str, dict[int, LoggedParam]] = {}
    for i, s in enumerate(run.steps):
        for c in s.layers:
            key = (c.name, c.call)
            layer_at.setdefault(key, {})[i] = c
            types.setdefault(key, c.type)
        for p in s.params:
            param_at.setdefault(p.name, {})[i] = p
    layers = []
    for key, at in layer_at.items():
        cols: dict[str, Series] = {m: Series(m, [None] * n, [False] * n) for m in LAYER_METRICS}
        for i, c in at.items():
            for metric, (value, bad) in layer_metrics(c).items():
                cols[metric].values[i] = value
                cols[metric].bad[i] = bad
        layers.append(Track("layer", key[0], types[key], key[1], list(cols.values())))
    params = []
    for name, seen in param_at.items():
        pcols = {m: Series(m, [None] * n, [False] * n) for m in PARAM_METRICS}
        for i, p in seen.items():
            for metric, (value, bad) in param_metrics(p).items():
                pcols[metric].values[i] = value
                pcols[metric].bad[i] = bad
        params.append(Track("param", name, None, None, list(pcols.values())))
    loss = Series("loss", [s.loss for s in run.steps], loss_nonfinite(run))
    return RunSeries(
        run.files,
        run.ranks,
        run.world_size,
        run.step_numbers,
        layers,
        params,
        Track("loss", "loss", None, None, [loss]),
        run.events,
        run.notes,
    )


def run_lines(run: Run | RunSeries) -> list[str]:
    """The header a run's table starts with: its files, steps and ranks."""
    numbers = run.step_numbers if isinstance(run, Run) else run.steps
    names = ", ".join(Path(f).name for f in run.files)
    shown = ", ".join(map(str, numbers[:8])) + (", …" if len(numbers) > 8 else "")
    lines = [f"{names}: {len(numbers)} watched steps ({shown})"]
    if run.ranks > 1:
        lines.append(
            f"{run.ranks} rank logs merged: one process over the whole batch (activation "
            f"gradients scaled by 1/{run.ranks}, parameters rank 0's, loss the ranks' mean)"
        )
    return lines
