"""CSV: one row per tensor of every layer call (inputs and outputs)."""

from __future__ import annotations

import csv
import io

from hookcli.records import DiffReport, Report, TensorStats

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
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(FIELDS)

    def row(layer: str, type_: str, call: int, kind: str, t: TensorStats) -> None:
        w.writerow(
            [
                layer,
                type_,
                call,
                kind,
                t.path,
                "x".join(map(str, t.shape)),
                t.dtype,
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
        )

    for c in report.layers:
        for kind, tensors in (
            ("input", c.inputs),
            ("output", c.outputs),
            ("grad_input", c.grad_inputs or []),
            ("grad_output", c.grad_outputs or []),
        ):
            for t in tensors:
                row(c.name, c.type, c.call, kind, t)
    for t in report.outputs:
        row("(model)", "output", 0, "model_output", t)
    return buf.getvalue()


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
]


def diff_csv(report: DiffReport) -> str:
    """One row per (layer call, side, tensor); side B against the reference, and side A too
    with --ref. The model's own output is layer `(model)`."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(DIFF_FIELDS)
    for c in [*report.calls, *report.outputs]:
        for side, diffs in (("A", c.a or []), ("B", c.b)):
            for d in diffs:
                w.writerow(
                    [c.name, c.type, c.call, side, d.path, "x".join(map(str, d.shape)), d.numel]
                    + [_cell(v) for v in (d.max_abs, d.rel_l2, d.cosine, d.sqnr_db, d.norm_rel)]
                    + [d.nonfinite, "yes" if d.over else "", d.note or ""]
                )
    return buf.getvalue()
