"""CSV: one row per tensor of every layer call (inputs and outputs)."""

from __future__ import annotations

import csv
import io

from hookcli.records import Report, TensorStats

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
