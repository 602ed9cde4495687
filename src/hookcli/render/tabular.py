"""A report as rows of typed values: one row per measured tensor. CSV (render/csv.py), a pandas
DataFrame (`Report.to_pandas()`) and Parquet (`-o FILE.parquet`) are the same rows, so the
three never disagree. Values are plain Python (str, int, float, None, tuples and lists);
pandas and pyarrow are imported only by `frame` and `parquet`. No torch.

A layers report (inspect, grads, check, folder runs, a saved report) has a row per tensor of
every layer call (`kind`: input, output, grad_input, grad_output), one per parameter gradient
(`param_grad`: `path` the parameter's name, the gradient's statistics, `weight_norm` and
`grad_weight` its ratio to the weight's norm) and one per tensor of the model's own output
(`model_output`, layer `(model)`). A diff report has a row per (layer call, side, tensor).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from hookcli.records import CallProfile, DiffReport, ParamStats, Report, TensorStats

Value = str | int | float | bool | None | tuple[int, ...] | list[float | None]

STATS = ["mean", "std", "min", "max", "zeros", "nan", "inf", "norm"]
FIELDS = [
    "layer", "type", "call", "kind", "path", "shape", "dtype", "numel", *STATS,
    "weight_norm", "grad_weight", "values", "note",
]  # fmt: skip
PROFILE_FIELDS = ["forward_ms", "self_ms", "backward_ms", "flops"]
DIFF_FIELDS = [
    "layer", "type", "call", "side", "path", "shape", "numel", "max_abs", "rel_l2", "cosine",
    "sqnr_db", "norm_rel", "nonfinite", "over", "note", "own_rel_l2", "type_b", "fused_into",
]  # fmt: skip
# the columns that hold text (CSV escapes them), counts, and flags; the others are float
# statistics, `shape` (ints) and `values` (floats)
TEXT = {"layer", "type", "kind", "side", "path", "dtype", "note", "type_b", "fused_into"}
COUNTS = {"call", "numel", "nan", "inf", "nonfinite", "flops"}
FLAGS = {"over"}


def _tensor(t: TensorStats) -> list[Value]:
    return [
        t.path, tuple(t.shape), t.dtype, t.numel,
        t.mean, t.std, t.min, t.max, t.zeros, t.nan, t.inf, t.norm,
    ]  # fmt: skip


def _profile(p: CallProfile | None) -> list[Value]:
    if p is None:
        return [None, None, None, None]
    return [p.forward_ms, p.self_ms, p.backward_ms, p.flops]


def _param(p: ParamStats) -> tuple[list[Value], str | None]:
    """A parameter gradient's cells from `path` to `norm`, and a note when it has none."""
    if p.grad is not None:
        return [p.name, *_tensor(p.grad)[1:]], p.grad.note
    cells: list[Value] = [p.name, tuple(p.shape), None, p.numel, *([None] * len(STATS))]
    cells[4 + STATS.index("nan")] = cells[4 + STATS.index("inf")] = 0
    return cells, "no gradient reached it" if p.requires_grad else "frozen (requires_grad=False)"


def report_rows(report: Report) -> tuple[list[str], list[list[Value]]]:
    """The columns and rows of a layers report; with --profile, each row also carries its
    call's forward_ms, self_ms, backward_ms and flops (None where not measured)."""
    timed = report.profile is not None
    rows: list[list[Value]] = []

    def add(
        head: list[Value], cells: list[Value], extra: list[Value], p: CallProfile | None
    ) -> None:
        rows.append(head + cells + extra + (_profile(p) if timed else []))

    def plain(t: TensorStats) -> list[Value]:  # weight_norm, grad_weight, values, note
        return [None, None, t.values, t.note]

    for c in report.layers:
        for kind, tensors in (
            ("input", c.inputs),
            ("output", c.outputs),
            ("grad_input", c.grad_inputs or []),
            ("grad_output", c.grad_outputs or []),
        ):
            for t in tensors:
                add([c.name, c.type, c.call, kind], _tensor(t), plain(t), c.profile)
        for p in c.params or []:
            cells, note = _param(p)
            values = p.grad.values if p.grad else None
            add(
                [c.name, c.type, c.call, "param_grad"],
                cells,
                [p.norm, p.ratio, values, note],
                c.profile,
            )
    for t in report.outputs:  # no call of their own to time
        add(["(model)", "output", 0, "model_output"], _tensor(t), plain(t), None)
    return FIELDS + (PROFILE_FIELDS if timed else []), rows


def diff_rows(report: DiffReport) -> tuple[list[str], list[list[Value]]]:
    """One row per (layer call, side, tensor); side B against the reference, and side A too
    with --ref. The model's own output is layer `(model)`. `norm_rel` is signed, `own_rel_l2`
    the layer's own error, `type_b` side B's module type when it differs from `type`."""
    rows: list[list[Value]] = []
    for c in [*report.calls, *report.outputs]:
        for side, diffs in (("A", c.a or []), ("B", c.b)):
            for d in diffs:
                rows.append([
                    c.name, c.type, c.call, side, d.path, tuple(d.shape), d.numel,
                    d.max_abs, d.rel_l2, d.cosine, d.sqnr_db, d.norm_rel,
                    d.nonfinite, d.over, d.note, d.own_rel_l2, c.type_b, c.fused_into,
                ])  # fmt: skip
    return DIFF_FIELDS, rows


def rows_of(obj: Report | DiffReport) -> tuple[list[str], list[list[Value]]]:
    return diff_rows(obj) if isinstance(obj, DiffReport) else report_rows(obj)


def frame(obj: Report | DiffReport) -> Any:
    """The rows as a pandas DataFrame (pandas is an optional extra: hookcli[pandas]). Counts
    are integers, statistics floats with NaN where a statistic does not exist, `shape` a
    tuple of ints, `values` the elements of a tensor of at most 16 (else None)."""
    pd = _need("pandas")
    columns, rows = rows_of(obj)
    df = pd.DataFrame(
        {name: pd.Series([r[i] for r in rows], dtype=object) for i, name in enumerate(columns)}
    )
    for name in columns:
        if name in TEXT or name in ("shape", "values"):
            continue  # Python objects: None stays None (not NaN, not pandas' string dtype)
        if name in COUNTS:
            df[name] = df[name].astype("Int64")  # nullable: a missing count stays missing
        elif name in FLAGS:
            df[name] = df[name].astype(bool)
        else:
            df[name] = pd.to_numeric(df[name], errors="raise").astype("float64")
    return df


def _arrow_type(pa: Any, name: str) -> Any:
    if name in TEXT:
        return pa.string()
    if name in COUNTS:
        return pa.int64()
    if name in FLAGS:
        return pa.bool_()
    if name == "shape":
        return pa.list_(pa.int64())
    if name == "values":
        return pa.list_(pa.float64())
    return pa.float64()


def parquet(obj: Report | DiffReport) -> bytes:
    """The rows as a Parquet file (pyarrow) with a fixed schema, whatever the data: text as
    string, counts int64, statistics float64, `shape` a list of int64, `values` a list of
    float64 (null elements for NaN/Inf), so files of many runs read back as one table."""
    pa = _need("pyarrow")
    pq = _need("pyarrow.parquet")
    df = frame(obj)
    schema = pa.schema([pa.field(name, _arrow_type(pa, name)) for name in df.columns])
    table = pa.Table.from_pandas(df, schema=schema, preserve_index=False)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def _need(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        from hookcli.errors import UsageError

        raise UsageError(
            f"{module} is not installed; DataFrames and Parquet need pandas and pyarrow.",
            "pip install 'hookcli[pandas]'.",
        ) from exc


def available() -> bool:
    """Whether `frame` and `parquet` can run here (checked before a run, not after it)."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("pandas", "pyarrow"))


def csv_cells(columns: Sequence[str], row: Sequence[Value]) -> list[str]:
    """A row's CSV cells: text escaped (text.csv_cell), shapes `8x3x224x224`, numbers as
    Python writes them (repr: every digit), None empty, `values` as a JSON list."""
    import json

    from hookcli.text import csv_cell

    out = []
    for name, v in zip(columns, row, strict=True):
        if v is None:
            out.append("")
        elif name in TEXT:
            out.append(csv_cell(str(v)))
        elif name == "shape":
            out.append("x".join(str(n) for n in v))  # type: ignore[union-attr]
        elif name == "values":
            out.append(json.dumps(v, allow_nan=False))
        elif isinstance(v, bool):
            out.append("yes" if v else "")
        else:
            out.append(repr(v) if isinstance(v, float) else str(v))
    return out
