"""A report as rows of typed values. CSV (render/csv.py), a pandas DataFrame
(`Report.to_pandas()`) and Parquet (`-o FILE.parquet`) are the same rows, so the three never
disagree. Values are plain Python (str, int, float, None, tuples and lists); pandas and pyarrow
are imported only by `frame` and `parquet`. No torch.

A layers report (inspect, grads, check, folder runs, a saved report) has a row per tensor of
every layer call (`kind`: input, output, grad_input, grad_output), one per parameter gradient
(`param_grad`: `path` the parameter's name, the gradient's statistics, `weight_norm` and
`grad_weight` its ratio to the weight's norm) and one per tensor of the model's own output
(`model_output`, layer `(model)`). After them, in this order, a row for each number of the
families a run can measure (none of them changes the rows above, and every report has the same
columns, a family it did not measure leaving its columns null):

- `token` (--per-token): one position of one sequence of a tensor (`sequence`, `position`, its
  `token` and `token_id`), its `norm`, `mean`, `std`, `max_abs` and the `channel` holding it;
- `channel` (--channels): one channel of a tensor (`channel` along `axis`): `count` values,
  their `mean`, `std`, `min`, `max`, `max_abs`, `zeros` (a fraction, as elsewhere), `large`
  (|x| >= 6) and `ratio` (its max|x| ÷ the median channel's). The tensor's own row gains its
  `width` (channels), `axis`, `masked`, `kurtosis` and `ratio` (the outlier ratio: the
  largest channel max|x| ÷ the median channel's);
- `massive` (--channels): a massive activation: the call and tensor holding it, its `channel`,
  `index`, `sequence` and `position` (a tokens tensor), `value` and `ratio` (|value| ÷ the
  tensor's median |x|), largest first;
- `outlier_feature` (--channels): a channel of `width` at |x| >= 6 in up to `share` of its
  values in `count` of the `total` layers of that width (no layer of its own);
- `head` (--heads): one head (`head`) of one attention call over one sequence: `layer` the
  block, `path` the attention module, `sink`, `entropy`, `top_key`, `share` (its mean
  probability) and `count` (the queries counted);
- `expert` (a MoE model): one expert of one router (`layer`), over the run: `count` tokens
  routed to it, of `total` the router routed (`top_k` each), its `share` of the load,
  `ratio` (its count ÷ the mean: the router's imbalance is the largest) and the router's load
  `entropy`.

A diff report has a row per (layer call, side, tensor).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from hookcli.records import (
    TENSOR_STATS,
    CallProfile,
    ChannelStats,
    DiffReport,
    ExpertStats,
    HeadStats,
    LayerCall,
    MassiveAt,
    OutlierFeature,
    ParamStats,
    Report,
    TensorStats,
)

Value = str | int | float | bool | None | tuple[int, ...] | list[float | None]

STATS = [s.name for s in TENSOR_STATS]  # records.TensorStats declares them (statfields.py)
# what the families (token, channel, massive, outlier_feature, head, expert) add: every report
# has these columns, null where it measured none
FAMILY_FIELDS = [
    "sequence", "position", "token", "token_id", "channel", "axis", "width", "head", "expert",
    "count", "total", "top_k", "max_abs", "large", "masked", "kurtosis", "value", "index",
    "ratio", "share", "sink", "entropy", "top_key",
]  # fmt: skip
FIELDS = [
    "layer", "type", "call", "kind", "path", "shape", "dtype", "numel", *STATS,
    "weight_norm", "grad_weight", "values", "note", *FAMILY_FIELDS,
]  # fmt: skip
PROFILE_FIELDS = ["forward_ms", "self_ms", "backward_ms", "flops"]
DIFF_FIELDS = [
    "layer", "type", "call", "side", "path", "shape", "numel", "max_abs", "rel_l2", "cosine",
    "sqnr_db", "norm_rel", "nonfinite", "over", "note", "own_rel_l2", "type_b", "fused_into",
]  # fmt: skip
# the columns that hold text (CSV escapes them), counts, flags and lists of ints; the others
# are float statistics and `values` (floats)
TEXT = {"layer", "type", "kind", "side", "path", "dtype", "note", "type_b", "fused_into", "token"}
COUNTS = {
    "call", "numel", "nonfinite", "flops", "sequence", "position", "token_id",
    "channel", "axis", "width", "head", "expert", "count", "total", "top_k", "large", "masked",
    "top_key", *(s.name for s in TENSOR_STATS if s.count),
}  # fmt: skip
FLAGS = {"over"}
INT_LISTS = {"shape", "index"}
_AT = {name: i for i, name in enumerate(FIELDS)}


def _row(**cells: Value) -> list[Value]:
    """A row of FIELDS from the cells named (the others None)."""
    row: list[Value] = [None] * len(FIELDS)
    for name, v in cells.items():
        row[_AT[name]] = v
    return row


def _tensor(t: TensorStats) -> list[Value]:
    return [t.path, tuple(t.shape), t.dtype, t.numel, *[getattr(t, name) for name in STATS]]


def _measured(ch: ChannelStats | None) -> list[Value]:
    """A tensor row's family cells: with --channels, its width, axis, masked values, kurtosis
    and outlier ratio."""
    cells: list[Value] = [None] * len(FAMILY_FIELDS)
    if ch is not None:
        for name, v in (
            ("width", len(ch.count)),
            ("axis", ch.axis),
            ("masked", ch.masked),
            ("kurtosis", ch.kurtosis),
            ("ratio", ch.outlier_ratio),
        ):
            cells[FAMILY_FIELDS.index(name)] = v
    return cells


def _profile(p: CallProfile | None) -> list[Value]:
    if p is None:
        return [None, None, None, None]
    return [p.forward_ms, p.self_ms, p.backward_ms, p.flops]


def _param(p: ParamStats) -> tuple[list[Value], str | None]:
    """A parameter gradient's cells from `path` to `norm`, and a note when it has none."""
    if p.grad is not None:
        return [p.name, *_tensor(p.grad)[1:]], p.grad.note
    none = [None for _ in TENSOR_STATS]  # no gradient: null, as its JSON (never a count of 0)
    cells: list[Value] = [p.name, tuple(p.shape), None, p.numel, *none]
    return cells, "no gradient reached it" if p.requires_grad else "frozen (requires_grad=False)"


def _tensors(c: LayerCall) -> list[tuple[str, TensorStats]]:
    """A call's tensors with their `kind`, in row order."""
    return [
        (kind, t)
        for kind, tensors in (
            ("input", c.inputs),
            ("output", c.outputs),
            ("grad_input", c.grad_inputs or []),
            ("grad_output", c.grad_outputs or []),
        )
        for t in tensors
    ]


def _token_rows(layer: str, type_: str, call: int, t: TensorStats) -> list[list[Value]]:
    return [
        _row(
            layer=layer,
            type=type_,
            call=call,
            kind="token",
            path=t.path,
            sequence=r.sequence,
            position=r.position,
            token=r.token,
            token_id=r.id,
            norm=r.norm,
            mean=r.mean,
            std=r.std,
            max_abs=r.max_abs,
            channel=r.channel,
        )
        for r in t.per_token or ()
    ]


def _channel_rows(layer: str, type_: str, call: int, t: TensorStats) -> list[list[Value]]:
    ch = t.channels
    if ch is None:
        return []
    median = ch.median_absmax
    rows = []
    for k, n in enumerate(ch.count):
        peak = ch.absmax[k]
        rows.append(
            _row(
                layer=layer,
                type=type_,
                call=call,
                kind="channel",
                path=t.path,
                channel=k,
                axis=ch.axis,
                count=n,
                mean=ch.mean[k],
                std=ch.std[k],
                min=ch.min[k],
                max=ch.max[k],
                max_abs=peak,
                zeros=ch.zeros[k] / n if n else None,
                large=ch.large[k],
                ratio=peak / median if peak is not None and median else None,
            )
        )
    return rows


def _massive_row(m: MassiveAt, types: dict[tuple[str, int], str]) -> list[Value]:
    return _row(
        layer=m.layer, type=types.get((m.layer, m.call)), call=m.call, kind="massive",
        path=m.path, channel=m.channel, index=tuple(m.index), sequence=m.sequence,
        position=m.position, value=m.value, ratio=m.ratio,
    )  # fmt: skip


def _feature_row(f: OutlierFeature) -> list[Value]:
    return _row(
        kind="outlier_feature", channel=f.channel, width=f.width, count=f.layers, total=f.of,
        share=f.share,
    )  # fmt: skip


def _head_row(h: HeadStats) -> list[Value]:
    return _row(
        layer=h.layer, call=h.call, kind="head", path=h.module, sequence=h.sequence,
        head=h.head, sink=h.sink, entropy=h.entropy, top_key=h.top_key, share=h.top_share,
        count=h.queries,
    )  # fmt: skip


def _expert_rows(e: ExpertStats, types: dict[str, str]) -> list[list[Value]]:
    routed = sum(e.counts)
    mean = routed / e.experts if e.experts else 0.0  # as ExpertStats.imbalance's
    return [
        _row(
            layer=e.layer,
            type=types.get(e.layer),
            kind="expert",
            expert=k,
            count=n,
            total=e.tokens,
            top_k=e.top_k,
            share=n / routed if routed else None,
            ratio=n / mean if mean else None,
            entropy=e.entropy,
        )
        for k, n in enumerate(e.counts)
    ]


def family_rows(report: Report) -> list[list[Value]]:
    """The rows of what --per-token, --channels, --heads and a MoE model's routing measured
    (FIELDS, no profile columns): the token rows of every call (the calls in the report's
    order, their tensors in row order, the model's output last), then the channel rows in the
    same order, then the report's massive activations, outlier features, heads and experts."""
    calls = [(c.name, c.type, c.call, [t for _, t in _tensors(c)]) for c in report.layers] + [
        ("(model)", "output", 0, list(report.outputs))
    ]
    rows = [
        row
        for layer, type_, call, tensors in calls
        for t in tensors
        for row in _token_rows(layer, type_, call, t)
    ]
    rows += [
        row
        for layer, type_, call, tensors in calls
        for t in tensors
        for row in _channel_rows(layer, type_, call, t)
    ]
    found = report.outliers
    if found is not None:
        types = {(c.name, c.call): c.type for c in report.layers}
        rows += [_massive_row(m, types) for m in found.massive]
        rows += [_feature_row(f) for f in found.features]
    rows += [_head_row(h) for h in report.heads or ()]
    named = {c.name: c.type for c in report.layers}
    rows += [row for e in report.experts or () for row in _expert_rows(e, named)]
    return rows


def report_rows(report: Report) -> tuple[list[str], list[list[Value]]]:
    """The columns and rows of a layers report: every measured tensor, then the families'
    rows (family_rows). With --profile, each tensor row also carries its call's forward_ms,
    self_ms, backward_ms and flops (None where not measured, and on the families' rows)."""
    timed = report.profile is not None
    rows: list[list[Value]] = []

    def add(
        head: list[Value], cells: list[Value], extra: list[Value], p: CallProfile | None
    ) -> None:
        rows.append(head + cells + extra + (_profile(p) if timed else []))

    def plain(t: TensorStats) -> list[Value]:  # weight_norm, grad_weight, values, note, …
        return [None, None, t.values, t.note, *_measured(t.channels)]

    for c in report.layers:
        for kind, t in _tensors(c):
            add([c.name, c.type, c.call, kind], _tensor(t), plain(t), c.profile)
        for p in c.params or []:
            cells, note = _param(p)
            values = p.grad.values if p.grad else None
            add(
                [c.name, c.type, c.call, "param_grad"],
                cells,
                [p.norm, p.ratio, values, note, *_measured(None)],
                c.profile,
            )
    for t in report.outputs:  # no call of their own to time
        add(["(model)", "output", 0, "model_output"], _tensor(t), plain(t), None)
    untimed = _profile(None) if timed else []
    rows += [row + untimed for row in family_rows(report)]
    return FIELDS + (PROFILE_FIELDS if timed else []), rows


def diff_rows(report: DiffReport) -> tuple[list[str], list[list[Value]]]:
    """One row per (layer call, side, tensor); side B against the reference, and side A too
    with --ref. The model's own output is layer `(model)`. `norm_rel` is signed, `own_rel_l2`
    the layer's own error, `type_b` side B's module type when it differs from `type`. Then a
    row per layer whose weight differs between the sides: path `weight`, no call, its
    `rel_l2` and `sqnr_db` (DiffReport.weights)."""
    rows: list[list[Value]] = []
    for c in [*report.calls, *report.outputs]:
        for side, diffs in (("A", c.a or []), ("B", c.b)):
            for d in diffs:
                rows.append([
                    c.name, c.type, c.call, side, d.path, tuple(d.shape), d.numel,
                    d.max_abs, d.rel_l2, d.cosine, d.sqnr_db, d.norm_rel,
                    d.nonfinite, d.over, d.note, d.own_rel_l2, c.type_b, c.fused_into,
                ])  # fmt: skip
    for w in report.weights:  # each layer's weight, B against the reference (path `weight`)
        rows.append([
            w.layer, w.type, None, "B", "weight", None, w.numel, None, w.rel_l2, None,
            w.sqnr_db, None, 0, False, None, None, w.type_b, None,
        ])  # fmt: skip
    return DIFF_FIELDS, rows


def rows_of(obj: Report | DiffReport) -> tuple[list[str], list[list[Value]]]:
    return diff_rows(obj) if isinstance(obj, DiffReport) else report_rows(obj)


def frame(obj: Report | DiffReport) -> Any:
    """The rows as a pandas DataFrame (pandas is an optional extra: hookcli[pandas]). Counts
    are nullable integers (Int64), statistics floats with NaN where a statistic does not
    exist, `shape` and `index` tuples of ints, `values` the elements of a tensor of at most
    16 (else None): the same columns and dtypes whatever the report measured."""
    pd = _need("pandas")
    columns, rows = rows_of(obj)
    df = pd.DataFrame(
        {name: pd.Series([r[i] for r in rows], dtype=object) for i, name in enumerate(columns)}
    )
    for name in columns:
        if name in TEXT or name in INT_LISTS or name == "values":
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
    if name in INT_LISTS:
        return pa.list_(pa.int64())
    if name == "values":
        return pa.list_(pa.float64())
    return pa.float64()


def parquet(obj: Report | DiffReport) -> bytes:
    """The rows as a Parquet file (pyarrow) with a fixed schema, whatever the data: text as
    string, counts int64, statistics float64, `shape` and `index` lists of int64, `values` a
    list of float64 (null elements for NaN/Inf), so files of many runs read back as one
    table."""
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
    Python writes them (repr: every digit), None empty, `values` and `index` as JSON lists."""
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
        elif name in ("values", "index"):
            out.append(json.dumps(list(v), allow_nan=False))  # type: ignore[arg-type]
        elif isinstance(v, bool):
            out.append("yes" if v else "")
        else:
            out.append(repr(v) if isinstance(v, float) else str(v))
    return out
