"""CSV: one row per tensor of every layer call (inputs and outputs).

Text cells (names, paths, notes) go through text.csv_cell: control characters escaped and a
cell a spreadsheet would run as a formula (`=cmd|…`) prefixed with `'`; numbers stay numbers.
"""

from __future__ import annotations

import csv
import io

from hookcli.records import CallProfile, DiffReport, Report, TensorStats
from hookcli.text import csv_cell

FIELDS = [
    "layer",
    "type",
    "call",
    "kind",
    "path",
    "shape",
    "dtype",
    "numel",
    "mean",
    "std",
    "min",
    "max",
    "zeros",
    "nan",
    "inf",
    "norm",
]


def _cell(v: float | int | None) -> str:
    return "" if v is None else repr(v) if isinstance(v, float) else str(v)


def report_csv(report: Report) -> str:
    """One row per tensor of every layer call; with --profile, each row also carries its
    call's forward_ms, self_ms, backward_ms and flops (empty when not measured)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    timed = report.profile is not None
    w.writerow(FIELDS + (["forward_ms", "self_ms", "backward_ms", "flops"] if timed else []))

    def row(
        layer: str,
        type_: str,
        call: int,
        kind: str,
        t: TensorStats,
        *,
        p: CallProfile | None = None,
    ) -> None:
        w.writerow(
            [
                csv_cell(layer),
                csv_cell(type_),
                call,
                kind,
                csv_cell(t.path),
                "x".join(map(str, t.shape)),
                csv_cell(t.dtype),
                t.numel,
                _cell(t.mean),
                _cell(t.std),
                _cell(t.min),
                _cell(t.max),
                _cell(t.zeros),
                t.nan,
                t.inf,
                _cell(t.norm),
            ]
            + (_profile_cells(p) if timed else [])
        )

    for c in report.layers:
        for kind, tensors in (
            ("input", c.inputs),
            ("output", c.outputs),
            ("grad_input", c.grad_inputs or []),
            ("grad_output", c.grad_outputs or []),
        ):
            for t in tensors:
                row(c.name, c.type, c.call, kind, t, p=c.profile)
    for t in report.outputs:
        row("(model)", "output", 0, "model_output", t)
    return buf.getvalue()


def _profile_cells(p: CallProfile | None) -> list[str]:
    if p is None:
        return ["", "", "", ""]
    return [_cell(p.forward_ms), _cell(p.self_ms), _cell(p.backward_ms), _cell(p.flops)]


DIFF_FIELDS = [
    "layer",
    "type",
    "call",
    "side",
    "path",
    "shape",
    "numel",
    "max_abs",
    "rel_l2",
    "cosine",
    "sqnr_db",
    "norm_rel",
    "nonfinite",
    "over",
    "note",
    "own_rel_l2",
    "type_b",
    "fused_into",
]


def diff_csv(report: DiffReport) -> str:
    """One row per (layer call, side, tensor); side B against the reference, and side A too
    with --ref. The model's own output is layer `(model)`. `norm_rel` is signed, `own_rel_l2`
    the layer's own error, `type_b` side B's module type when it differs from `type`."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(DIFF_FIELDS)
    for c in [*report.calls, *report.outputs]:
        for side, diffs in (("A", c.a or []), ("B", c.b)):
            for d in diffs:
                w.writerow(
                    [csv_cell(c.name), csv_cell(c.type), c.call, side, csv_cell(d.path)]
                    + ["x".join(map(str, d.shape)), d.numel]
                    + [_cell(v) for v in (d.max_abs, d.rel_l2, d.cosine, d.sqnr_db, d.norm_rel)]
                    + [d.nonfinite, "yes" if d.over else "", csv_cell(d.note or "")]
                    + [_cell(d.own_rel_l2), csv_cell(c.type_b or ""), csv_cell(c.fused_into or "")]
                )
    return buf.getvalue()
