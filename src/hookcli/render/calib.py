"""calib as sections (table, markdown, HTML) and CSV: each layer's input channels, and its
outlier ratios before and after SmoothQuant's smoothing. No torch here."""

from __future__ import annotations

import csv
import io
from typing import TYPE_CHECKING

from hookcli.render.fmt import num
from hookcli.render.rows import Row, Section, Table, lines_section

if TYPE_CHECKING:
    from hookcli.records import CalibLayer, CalibReport

DROP = ("type", "weight ratio", "smoothed weight")
HEADERS = [
    "layer", "type", "channels", "values", "max|x|", "act ratio", "smoothed act",
    "weight ratio", "smoothed weight",
]  # fmt: skip


def _peak(layer: CalibLayer) -> float | None:
    return max((a for a in layer.channels.absmax if a is not None), default=None)


def _cells(layer: CalibLayer) -> list[str]:
    ch = layer.channels
    return [
        layer.name,
        layer.type,
        str(len(ch.count)),
        str(ch.count[0] if ch.count else 0),
        num(_peak(layer)),
        num(layer.act_ratio),
        num(layer.smoothed_act_ratio),
        num(layer.weight_ratio),
        num(layer.smoothed_weight_ratio),
    ]


def calib_sections(report: CalibReport) -> list[Section]:
    m = report.model
    header = [
        f"calib: {m.spec} ({m.task}) on {report.device}",
        f"weights: {m.weights}",
        f"input: {report.input.description}",
        f"smoothing: SmoothQuant, alpha {report.alpha:g} (ratio: largest channel max|x| ÷ "
        "the median channel's)",
    ]
    table = Table("layers", HEADERS, [Row(_cells(layer)) for layer in report.layers], DROP)
    skipped = [f"not calibrated: {k.name} ({k.type}): {k.reason}" for k in report.skipped]
    sections = [
        lines_section("header", "run", header, "dim"),
        Section("layers", f"{len(report.layers)} layers", [table]),
        lines_section("skipped", f"{len(skipped)} layers not calibrated", skipped, "bad"),
        lines_section("notes", "notes", [f"note: {n}" for n in report.notes], "note"),
    ]
    return [s for s in sections if s.parts]


def calib_csv(report: CalibReport) -> str:
    """One row per layer and input channel: its count, min, max, max|x|, mean and std."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["layer", "type", "channel", "count", "min", "max", "absmax", "mean", "std"])
    for layer in report.layers:
        ch = layer.channels
        for k, n in enumerate(ch.count):
            w.writerow(
                [layer.name, layer.type, k, n, *(
                    "" if v is None else repr(v)
                    for v in (ch.min[k], ch.max[k], ch.absmax[k], ch.mean[k], ch.std[k])
                )]
            )  # fmt: skip
    return out.getvalue()
