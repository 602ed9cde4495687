"""A training run's series (`hookcli report run.jsonl`) and its checks (`hookcli check
run.jsonl`) in every format: format-neutral sections for the table and Markdown, CSV rows, and
a PNG grid of tiny line plots (Pillow, as images.py). `SeriesReport` and `ChecksReport` are the
two as reports, for the one door (render.writers: every format's writer takes them).

It reads what commands.watch.runseries computes through the protocols below (numbers and
strings, and the non-finite events as records.NonfiniteLine), never torch and never a command
module.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hookcli.records import CheckResult, NonfiniteLine
from hookcli.render.fmt import DASH, SPARKS, num, pct
from hookcli.render.rows import Line, Row, Section, Table, checks_of, lines_section
from hookcli.text import csv_cell

SPARK_WIDTH = 24  # characters of a sparkline; longer series are averaged into this many
NONFINITE_MARK = "!"  # a step (or group of steps) that held NaN/Inf
DROP = ("type", "nan/inf", "out mean", "zeros", "call")


class SeriesLike(Protocol):
    @property
    def metric(self) -> str: ...
    @property
    def values(self) -> Sequence[float | None]: ...
    @property
    def bad(self) -> Sequence[bool]: ...


class TrackLike(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def type(self) -> str | None: ...
    @property
    def call(self) -> int | None: ...
    @property
    def series(self) -> Sequence[SeriesLike]: ...


class RunLike(Protocol):
    @property
    def steps(self) -> Sequence[int]: ...
    @property
    def layers(self) -> Sequence[TrackLike]: ...
    @property
    def params(self) -> Sequence[TrackLike]: ...
    @property
    def loss(self) -> TrackLike: ...
    @property
    def events(self) -> Sequence[NonfiniteLine]: ...
    @property
    def notes(self) -> Sequence[str]: ...


class SeriesData(RunLike, Protocol):
    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class SeriesReport:
    """`hookcli report run.jsonl`: a run's series (commands.watch.runseries.RunSeries) and
    the lines over them; its JSON is the series' own."""

    run: SeriesData
    header: Sequence[str]

    def to_dict(self) -> dict[str, Any]:
        return self.run.to_dict()

    def sections(self) -> list[Section]:
        return series_sections(self.run, self.header)


@dataclass(frozen=True, slots=True)
class ChecksReport:
    """`hookcli check run.jsonl`: each rule's verdict over a run, the lines over them, the
    run's non-finite events and notes, and `data`, its JSON (commands.watch.runrules)."""

    header: Sequence[str]
    checks: Sequence[CheckResult]
    events: Sequence[NonfiniteLine]
    notes: Sequence[str]
    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def sections(self, *, quiet: bool) -> list[Section]:
        return run_checks_sections(self.header, self.checks, self.events, self.notes, quiet=quiet)


# ---------------------------------------------------------------- sparklines


def sparkline(values: Sequence[float | None], bad: Sequence[bool], width: int = SPARK_WIDTH) -> str:
    """One character per step (steps averaged into `width` groups when there are more): the
    value's height between the series' finite min and max, `!` where NaN/Inf was, a space
    where there is no value."""
    n = len(values)
    if n == 0:
        return DASH
    k = min(n, width)
    groups = [range(i * n // k, (i + 1) * n // k) for i in range(k)]
    points: list[float | str] = []
    for g in groups:
        if any(bad[j] for j in g):
            points.append(NONFINITE_MARK)
            continue
        finite = [v for j in g if (v := values[j]) is not None and math.isfinite(v)]
        points.append(sum(finite) / len(finite) if finite else " ")
    numbers = [p for p in points if isinstance(p, float)]
    if not numbers:
        return "".join(p if isinstance(p, str) else " " for p in points)
    lo, hi = min(numbers), max(numbers)
    top = len(SPARKS) - 1
    return "".join(
        p
        if isinstance(p, str)
        else SPARKS[0]
        if hi == lo
        else SPARKS[min(top, int((p - lo) / (hi - lo) * top + 0.5))]
        for p in points
    )


def _ends(s: SeriesLike, fmt: Any = num) -> str:
    """first → last finite value (— when none)."""
    finite = [v for v, b in zip(s.values, s.bad, strict=True) if v is not None and not b]
    if not finite:
        return "not finite" if any(s.bad) else DASH
    if len(finite) == 1:
        return str(fmt(finite[0]))
    return f"{fmt(finite[0])} → {fmt(finite[-1])}"


def _cell(s: SeriesLike) -> str:
    fmt = pct if s.metric == "zeros" else num
    if s.metric == "nan/inf":
        counts = [int(v) for v in s.values if v is not None]
        if not any(counts):
            return "0"
        return f"{max(counts)} max {sparkline(s.values, [False] * len(s.values))}"
    return f"{_ends(s, fmt)} {sparkline(s.values, s.bad)}"


# ---------------------------------------------------------------- sections


def event_lines(events: Sequence[NonfiniteLine]) -> list[str]:
    """Each non-finite event: its step, what held NaN/Inf, where it began, its repro bundle."""
    lines = []
    for e in events:
        found = ", ".join(e.found) or "the run"
        text = f"NaN/Inf at step {e.step}"
        if e.world_size > 1:
            text += f" (rank {e.rank})"
        text += f" in: {found}"
        if e.origins:
            text += f"; first appeared — {e.origins[0].describe()}"
        if e.bundle:
            text += f"; repro bundle: {e.bundle} (hookcli replay)"
        lines.append(text)
    return lines


def series_sections(run: RunLike, header: Sequence[str]) -> list[Section]:
    """`hookcli report run.jsonl`: the run, the loss, one row per layer call and one per
    parameter, each metric as its first → last value and a sparkline over the steps."""
    loss = run.loss.series[0]
    head = [*header, f"loss: {_ends(loss)} {sparkline(loss.values, loss.bad)}"]
    sections = [lines_section("header", "run", head, "dim")]
    if run.layers:
        metrics = [s.metric for s in run.layers[0].series]
        layers = Table(
            f"layer calls over {len(run.steps)} watched steps (first output; "
            f"{NONFINITE_MARK} = NaN/Inf at that step)",
            ["layer", "type", "call", *metrics],
            drop=DROP,
        )
        for t in run.layers:
            cells = [t.name, t.type or DASH, str(t.call), *(_cell(s) for s in t.series)]
            layers.rows.append(Row(cells, flagged=any(any(s.bad) for s in t.series)))
        sections.append(Section("series", "layer calls", [layers]))
    if run.params:
        metrics = [s.metric for s in run.params[0].series]
        params = Table("parameters", ["param", *metrics])
        for t in run.params:
            cells = [t.name, *(_cell(s) for s in t.series)]
            params.rows.append(Row(cells, flagged=any(any(s.bad) for s in t.series)))
        sections.append(Section("params", "parameters", [params]))
    sections.append(lines_section("origins", "non-finite", event_lines(run.events), "note"))
    sections.append(lines_section("notes", "notes", [f"note: {n}" for n in run.notes], "note"))
    return [s for s in sections if s.parts]


def checks_part(checks: Sequence[CheckResult], *, quiet: bool) -> Section:
    """Each rule's verdict and its first failures, as for a model's run."""
    return checks_of(checks, quiet=quiet)


def run_checks_sections(
    header: Sequence[str],
    checks: Sequence[CheckResult],
    events: Sequence[NonfiniteLine],
    notes: Sequence[str],
    *,
    quiet: bool,
) -> list[Section]:
    """`hookcli check run.jsonl`: the run, the pass/fail list, the non-finite events and the
    verdict (with quiet, only failures: nothing when every rule passed)."""
    failed = sum(not c.passed for c in checks)
    sections = [] if quiet else [lines_section("header", "run", list(header), "dim")]
    sections.append(checks_part(checks, quiet=quiet))
    if not quiet or failed:
        sections.append(lines_section("origins", "non-finite", event_lines(events), "note"))
    if not quiet:
        sections.append(lines_section("notes", "notes", [f"note: {n}" for n in notes], "note"))
        verdict = f"{len(checks) - failed} passed, {failed} failed"
        sections.append(Section("verdict", "verdict", [Line(verdict, "bad" if failed else "good")]))
    return [s for s in sections if s.parts]


# ---------------------------------------------------------------- CSV

SERIES_FIELDS = ["step", "kind", "name", "type", "call", "metric", "value", "nonfinite"]
CHECK_FIELDS = ["rule", "passed", "step", "rank", "layer", "call", "path", "value", "limit"]


def _num_cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return repr(v)
    return csv_cell(str(v)) if isinstance(v, str) else str(v)


def series_csv(run: RunLike) -> str:
    """One row per (step, layer call or parameter or loss, metric): the value (empty when
    absent or not finite) and whether NaN/Inf was there."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(SERIES_FIELDS)
    tracks = [*run.layers, *run.params, run.loss]
    for i, step in enumerate(run.steps):
        for t in tracks:
            for s in t.series:
                w.writerow(
                    [
                        step,
                        t.kind,
                        csv_cell(t.name),
                        csv_cell(t.type or ""),
                        "" if t.call is None else t.call,
                        s.metric,
                        _num_cell(s.values[i]),
                        "true" if s.bad[i] else "false",
                    ]
                )
    return buf.getvalue()


def checks_csv(checks: Sequence[CheckResult]) -> str:
    """One row per failure of every rule (a rule that passed: one row, its verdict), with the
    step where it was and its line."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([*CHECK_FIELDS, "message"])
    for c in checks:
        if not c.failures:
            w.writerow([c.rule, str(c.passed).lower(), *[""] * 7, csv_cell(c.message)])
            continue
        for f in c.failures:
            w.writerow(
                [
                    c.rule,
                    str(c.passed).lower(),
                    _num_cell(getattr(f, "step", None)),
                    _num_cell(getattr(f, "rank", None)),
                    csv_cell(f.layer or ""),
                    _num_cell(f.call),
                    csv_cell(f.path or ""),
                    _num_cell(f.value),
                    _num_cell(f.limit),
                    csv_cell(f.message),
                ]
            )
    return buf.getvalue()


# ---------------------------------------------------------------- the PNG grid

CELL_W, CELL_H = 132, 40  # one tiny plot
GAP = 6
MARGIN = 10
LABEL_MAX = 260  # pixels of a row's label (longer names are cut, with …)
WHITE, INK, FAINT = (255, 255, 255), (20, 20, 20), (110, 110, 110)
GRID, LINE, RED = (200, 200, 200), (30, 70, 160), (220, 0, 0)  # RED marks NaN/Inf only


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _fit(draw: Any, text: str, font: Any, width: int) -> str:
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…"


def series_png(run: RunLike, title: str) -> tuple[Any, dict[str, Any]]:
    """A grid of tiny line plots: a row per layer call, parameter and the loss, a column per
    metric; each plot scaled to its own finite range (printed at its left edge), a step where
    NaN/Inf was marked by a red bar, the steps labelled under each column. Returns the PIL
    image and the PNG's `hookcli` metadata (each plot's box and its non-finite steps)."""
    from PIL import Image, ImageDraw

    tracks = [*run.layers, *run.params, run.loss]
    columns: list[str] = []
    for t in tracks:
        columns += [s.metric for s in t.series if s.metric not in columns]
    font, small = _font(12), _font(10)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    labels = [_label(t) for t in tracks]
    label_w = min(LABEL_MAX, max(int(probe.textlength(x, font=font)) for x in labels) + 8)
    line_h = 16
    top = MARGIN + line_h + 4 + line_h  # title, column names
    width = MARGIN * 2 + label_w + len(columns) * (CELL_W + GAP)
    height = top + len(tracks) * (CELL_H + GAP) + 2 * line_h + MARGIN
    image = Image.new("RGB", (width, height), WHITE)
    draw = ImageDraw.Draw(image)
    draw.text((MARGIN, MARGIN), _fit(draw, title, font, width - 2 * MARGIN), fill=INK, font=font)
    x0 = MARGIN + label_w
    for j, metric in enumerate(columns):
        draw.text((x0 + j * (CELL_W + GAP), top - line_h), metric, fill=INK, font=font)
    cells = []
    steps = list(run.steps)
    for r, (t, label) in enumerate(zip(tracks, labels, strict=True)):
        y = top + r * (CELL_H + GAP)
        draw.text(
            (MARGIN, y + CELL_H // 2 - 7), _fit(draw, label, font, label_w - 8), fill=INK, font=font
        )
        for s in t.series:
            x = x0 + columns.index(s.metric) * (CELL_W + GAP)
            box = (x, y, x + CELL_W, y + CELL_H)
            bad = _plot(draw, box, s, small)
            cells.append(
                {
                    "row": label,
                    "column": s.metric,
                    "box": list(box),
                    "nonfinite_steps": [steps[i] for i in bad],
                }
            )
    axis_y = top + len(tracks) * (CELL_H + GAP)
    first, last = (steps[0], steps[-1]) if steps else (0, 0)
    for j in range(len(columns)):
        x = x0 + j * (CELL_W + GAP)
        draw.line((x, axis_y, x + CELL_W, axis_y), fill=INK)
        for tick, at in ((first, x), (last, x + CELL_W)):
            draw.line((at, axis_y, at, axis_y + 3), fill=INK)
            text = str(tick)
            tx = at - (draw.textlength(text, font=small) if at != x else 0)
            draw.text((tx, axis_y + 4), text, fill=INK, font=small)
        mid = "step"
        draw.text(
            (x + (CELL_W - draw.textlength(mid, font=small)) / 2, axis_y + 4),
            mid,
            fill=INK,
            font=small,
        )
    meta = {"title": title, "steps": steps, "columns": columns, "rows": labels, "cells": cells}
    return image, meta


def _label(t: TrackLike) -> str:
    if t.kind == "layer":
        return f"{t.name} call {t.call}" if t.call else t.name
    return t.name


def _plot(draw: Any, box: tuple[int, int, int, int], s: SeriesLike, font: Any) -> list[int]:
    """One series in its box: the finite values as a line (broken where a value is absent),
    red bars at NaN/Inf steps. Returns the indices of those steps."""
    x0, y0, x1, y1 = box
    draw.rectangle(box, outline=GRID)
    n = len(s.values)
    bad = [i for i in range(n) if s.bad[i]]
    pad = 4

    def x_at(i: int) -> float:
        return x0 + pad + (x1 - x0 - 2 * pad) * (i / (n - 1) if n > 1 else 0.5)

    for i in bad:
        draw.rectangle((x_at(i) - 1, y0 + 1, x_at(i) + 1, y1 - 1), fill=RED)
    finite = [
        (i, float(v))
        for i, v in enumerate(s.values)
        if v is not None and math.isfinite(v) and not s.bad[i]
    ]
    if not finite:
        return bad
    lo = min(v for _, v in finite)
    hi = max(v for _, v in finite)

    def y_at(v: float) -> float:
        if hi == lo:
            return (y0 + y1) / 2
        return y1 - pad - (y1 - y0 - 2 * pad) * (v - lo) / (hi - lo)

    run: list[tuple[float, float]] = []
    for i in range(n):
        v = s.values[i]
        if v is None or s.bad[i] or not math.isfinite(v):
            if len(run) > 1:
                draw.line(run, fill=LINE, width=2)
            run = []
            continue
        run.append((x_at(i), y_at(float(v))))
    if len(run) > 1:
        draw.line(run, fill=LINE, width=2)
    for i, v in finite:
        if len(finite) == 1 or n == 1:
            x, y = x_at(i), y_at(v)
            draw.ellipse((x - 2, y - 2, x + 2, y + 2), fill=LINE)
    draw.text((x0 + 2, y0 + 1), num(hi), fill=FAINT, font=font)
    if hi != lo:
        draw.text((x0 + 2, y1 - 12), num(lo), fill=FAINT, font=font)
    return bad
