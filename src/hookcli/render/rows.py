"""Format-neutral report sections: what a report says, before any format decides how it looks.

A report becomes a list of `Section`s (header lines, the per-call table, predictions, notes,
profile, ablation, checks, ...), each a list of `Line`s and `Table`s of plain strings. The
table renderer (render/table.py: Rich, width fitting, colour) and the Markdown renderer
(render/markdown.py) both lay out these same sections, so a section built here reaches every
text format, and a new format (HTML) starts from them rather than from the records.

Strings are raw: each format escapes them its own way (text.escape, text.markdown). Styles
are meanings ("dim", "bad"), never colours; widths and column dropping are the table's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from hookcli.records import (
    TENSOR_STATS,
    CheckResult,
    LayerCall,
    Prediction,
    Report,
    TensorStats,
    TextInfo,
)
from hookcli.render.channelrows import (
    channels_section,
    experts_section,
    heads_section,
    outliers_section,
)
from hookcli.render.fmt import DASH, count, nonfinite, num, pct, prob, shape, spark, tensor_label
from hookcli.render.memrows import memory_section
from hookcli.render.parts import Line, Part, Row, Section, Style, Table

__all__ = ["Line", "Part", "Row", "Section", "Style", "Table"]

# the statistics a layers table shows (those TensorStats declares with a header), and how
FORMATS: dict[str, Callable[[float | None], str]] = {
    "num": num,
    "pct": pct,
    "int": lambda v: DASH if v is None else str(v),
}
SHOWN_STATS = [s for s in TENSOR_STATS if s.header is not None]
STAT_HEADERS = [s.header or s.name for s in SHOWN_STATS]
# their columns a narrow layers table gives up, in that order
_DROPPED = sorted((s for s in SHOWN_STATS if s.drop is not None), key=lambda s: s.drop or 0)
HEADERS = ["layer", "type", "call", "input", "output", *STAT_HEADERS, "nan/inf"]
GRAD_HEADERS = [
    "layer",
    "type",
    "call",
    "output",
    "mean",
    "std",
    "grad_out norm",
    "grad_out mean",
    "grad_out std",
    "grad_in norm",
    "nan/inf",
]
PARAM_HEADERS = [
    "layer",
    "param",
    "shape",
    "norm",
    "grad norm",
    "grad mean",
    "grad max|abs|",
    "grad/weight",
    "nan/inf",
]
PROFILE_TITLE = (
    "profile (total: from entering the module to its return; self: less the modules it "
    "calls; hookcli's hook work excluded; FLOPs: the modules it calls included)"
)
SAVED_HEADERS = ["key", "shape", "dtype", *STAT_HEADERS, "nan/inf"]
# Numeric columns: aligned right where a format aligns.
RIGHT = {
    "#",
    "index",
    "prob",
    "params",
    "calls",
    "call",
    *STAT_HEADERS,
    "mean",
    "std",
    "min",
    "max",
    "zeros",
    "norm",
    "grad_out norm",
    "grad_out mean",
    "grad_out std",
    "grad_in norm",
    "grad norm",
    "grad mean",
    "grad max|abs|",
    "grad/weight",
    "norm clean",
    "norm ablated",
    "total ms",
    "self ms",
    "% of pass",
    "backward ms",
    "FLOPs",
    "output MB",
    "change",
    "prob ",
    "max|Δ|",
    "rel L2",
    "cosine",
    "SQNR dB",
    "norm Δ",
    "rel L2 A",
    "rel L2 B",
    "own L2",
    "own A",
    "own B",
    "SQNR A",
    "SQNR B",
}

# Columns each table gives up first when the terminal is too narrow, in that order.
DROP: dict[str, tuple[str, ...]] = {
    "layers": (
        "hist",
        "input",
        "type",
        *(s.header or s.name for s in _DROPPED),
    ),
    "grads": ("type", "grad_out mean", "grad_out std", "std", "mean", "output"),
    "params": ("grad mean", "grad max|abs|", "shape", "norm"),
    "profile": ("output MB", "backward ms", "FLOPs", "% of pass"),
    "predictions": ("folder", "index", "id"),
    "per_token": ("id", "call", "mean", "std"),
    "diff": ("norm Δ", "cosine", "max|Δ|", "output", "type", "SQNR A", "SQNR B", "own A"),
}

SHOWN_FAILURES = 20  # failures listed per rule in text; JSON carries them all


# ---------------------------------------------------------------- the per-call tables


def input_label(call: LayerCall) -> str:
    if not call.inputs:
        return DASH
    label = tensor_label(call.inputs[0], "in")
    if label.startswith("[0] "):
        label = label[4:]
    extra = len(call.inputs) - 1
    return f"{label} +{extra}" if extra else label


def nonfinite_cell(*tensors: tuple[str, TensorStats | None], call: LayerCall | None = None) -> str:
    """The NaN/Inf counts of a row's tensors, each labelled with what it is ("out: 72 NaN;
    grad_out: 131072 NaN"); with `call`, its inputs' too ("in: 17 NaN"), so a row whose input
    already held them (made outside the module) says so."""
    flagged = [f"{label}: {nonfinite(t)}" for label, t in tensors if t is not None and t.nonfinite]
    marker = input_nonfinite(call) if call is not None else ""
    if marker:
        flagged.append(marker)
    return "; ".join(flagged) if flagged else DASH


def grad_stat(v: float | None, g: TensorStats | None) -> str:
    """A gradient's statistic: — only when there is no gradient; "not finite" when there is one
    but none of its elements is finite (a NaN gradient is never shown as an absent one)."""
    if g is None:
        return DASH
    if v is None and g.nonfinite:
        return "not finite"
    return num(v)


def input_nonfinite(call: LayerCall) -> str:
    """The call's inputs' NaN/Inf, as "in: 17 NaN, 2 Inf"; "" when they were finite."""
    nan = sum(t.nan for t in call.inputs)
    inf = sum(t.inf for t in call.inputs)
    if not nan and not inf:
        return ""
    return "in: " + nonfinite(TensorStats("in", (), "", 0, nan=nan, inf=inf))


def grad_rows(report: Report) -> Iterable[tuple[list[str], bool]]:
    """grads: one row per (call, output tensor) with its gradient; flag when non-finite."""
    for c in report.layers:
        grads_out = {g.path: g for g in c.grad_outputs or []}
        grad_in = c.grad_inputs[0] if c.grad_inputs else None
        head = [c.name, c.type, str(c.call)]
        if not c.outputs:
            yield [*head, c.error or DASH, *[DASH] * 7], False
            continue
        for i, t in enumerate(c.outputs):
            g = grads_out.get(t.path)
            cells = head if i == 0 else ["", "", ""]
            gin = grad_stat(grad_in.norm, grad_in) if (i == 0 and grad_in is not None) else DASH
            row = [
                *cells,
                tensor_label(t, "out"),
                num(t.mean),
                num(t.std),
                grad_stat(g.norm if g else None, g),
                grad_stat(g.mean if g else None, g),
                grad_stat(g.std if g else None, g),
                gin,
                nonfinite_cell(
                    ("out", t),
                    ("grad_out", g),
                    ("grad_in", grad_in if i == 0 else None),
                    call=c if i == 0 else None,
                ),
            ]
            bad_input = i == 0 and bool(input_nonfinite(c))
            yield row, bad_input or any(x is not None and x.nonfinite for x in (t, g))


def param_rows(report: Report) -> Iterable[list[str]]:
    for c in report.layers:
        for p in c.params or []:
            yield [
                c.name,
                p.name,
                shape(p.shape),
                num(p.norm),
                grad_stat(p.grad_norm, p.grad),
                grad_stat(p.grad_mean, p.grad),
                grad_stat(p.grad_max_abs, p.grad),
                grad_stat(p.ratio, p.grad) if p.norm else num(p.ratio),
                nonfinite_cell(("grad", p.grad)),
            ]


def has_hist(report: Report) -> bool:
    return any(t.hist for c in report.layers for t in c.outputs)


def layer_rows(report: Report) -> Iterable[tuple[list[str], TensorStats | None]]:
    """The cells of every table row, with the tensor the row describes."""
    with_hist = has_hist(report)
    for cells, t in _stat_rows(report):
        yield ([*cells, spark(t.hist if t else None)] if with_hist else cells), t


def stat_cells(t: TensorStats) -> list[str]:
    """A tensor's cells under STAT_HEADERS, each as its statistic says it is shown."""
    return [FORMATS[s.format](getattr(t, s.name)) for s in SHOWN_STATS]


def _stat_rows(report: Report) -> Iterable[tuple[list[str], TensorStats | None]]:
    for c in report.layers:
        head = [c.name, c.type, str(c.call), input_label(c)]
        if not c.outputs:
            yield [*head, c.error or DASH, *[DASH] * (len(SHOWN_STATS) + 1)], None
            continue
        for i, t in enumerate(c.outputs):
            cells = head if i == 0 else ["", "", "", ""]
            flags = nonfinite_cell(("out", t), call=c if i == 0 else None)
            yield [*cells, tensor_label(t, "out"), *stat_cells(t), flags], t


def calls_title(report: Report) -> str:
    calls = len(report.layers)
    return f"{calls} layer call{'s' if calls != 1 else ''}"


def calls_table(report: Report) -> Table:
    """The per-call table: statistics (inspect), or gradients when a backward ran (grads)."""
    title = calls_title(report)
    if report.backward is not None:
        rows = [Row(cells, bad) for cells, bad in grad_rows(report)]
        return Table(title, list(GRAD_HEADERS), rows, DROP["grads"])
    headers = HEADERS + (["hist"] if has_hist(report) else [])
    flags = HEADERS.index("nan/inf")
    rows = [
        Row(
            cells,
            (t is not None and t.nonfinite)
            or any(part.startswith("in: ") for part in cells[flags].split("; ")),
        )
        for cells, t in layer_rows(report)
    ]
    return Table(title, headers, rows, DROP["layers"])


def params_table(report: Report) -> Table:
    rows = [Row(cells) for cells in param_rows(report)]
    return Table("parameter gradients", list(PARAM_HEADERS), rows, DROP["params"])


# ---------------------------------------------------------------- lines around the table


def header_lines(report: Report) -> list[str]:
    m = report.model
    mode = ", train mode" if m.mode == "train" else ""
    # the dtype it ran in, where it is not torch's default (float32 goes without saying)
    dtype = f", {m.dtype}" if m.dtype and m.dtype != "float32" else ""
    lines = [
        f"{report.command}: {m.spec} ({m.task}, {count(m.params)} params{dtype}{mode}) "
        f"on {report.device}",
        f"weights: {m.weights}",
        f"input: {report.input.description} -> " + ", ".join(shape(s) for s in report.input.shapes),
    ]
    if report.input.preprocessing:
        lines.append(f"preprocessing: {report.input.preprocessing}")
    lines += token_lines(report.input.texts or [])
    lines += padding_lines(report)
    for g in report.generated or ():
        shown = repr(g.text) if g.text is not None else " ".join(map(str, g.ids))
        lines.append(f"generated for sequence {g.sequence} ({len(g.ids)} tokens): {shown}")
    if report.config:
        lines.append(f"config: {report.config}")
    if report.backward is not None:
        b = report.backward
        ppl = f", perplexity {num(b.perplexity)}" if b.perplexity is not None else ""
        lines.append(f"backward from: {b.source} = {num(b.value)}{ppl}")
    return lines


TOKENS_SHOWN = 32  # tokens of one sequence the header lists (the JSON has them all)


def token_lines(texts: Sequence[TextInfo]) -> list[str]:
    """Each sequence's tokens as the model sees them: `id:'token'`, in order."""
    lines = []
    for i, t in enumerate(texts):
        shown = " ".join(f"{id_}:{tok!r}" for id_, tok in zip(t.ids, t.tokens, strict=False))
        if len(t.ids) > TOKENS_SHOWN:
            head = t.ids[: TOKENS_SHOWN - 4], t.tokens[: TOKENS_SHOWN - 4]
            tail = t.ids[-4:], t.tokens[-4:]
            shown = " ".join(
                [
                    *(f"{a}:{b!r}" for a, b in zip(*head, strict=True)),
                    f"… ({len(t.ids) - TOKENS_SHOWN} more) …",
                    *(f"{a}:{b!r}" for a, b in zip(*tail, strict=True)),
                ]
            )
        lines.append(f"tokens of sequence {i} ({len(t.ids)}): {shown}")
    return lines


def padding_lines(report: Report) -> list[str]:
    """A padded text batch: how much of it is padding, which no statistic counts."""
    texts, shapes = report.input.texts, report.input.shapes
    if not texts or not shapes or len(shapes[0]) != 2:
        return []
    batch, tokens = shapes[0]
    real = sum(len(t.ids) for t in texts)
    if real >= batch * tokens:
        return []
    return [
        f"padding: {batch * tokens - real} of {batch * tokens} positions; no statistic counts "
        "them (a tensor's leading batch x tokens dimensions are read at the real tokens only)"
    ]


def is_text_task(task: str) -> bool:
    return task in ("causal-lm", "seq2seq-lm")


def output_label(t: TensorStats) -> str:
    """`1x10`, or `1x10 (10 Inf)`: a model output's NaN/Inf are counted where it is named."""
    label = tensor_label(t, "out")
    return f"{label} ({nonfinite(t)})" if t.nonfinite else label


def summary_lines(report: Report) -> list[str]:
    """Modules that never ran and the model's own output."""
    lines = []
    if report.never_called:
        shown = ", ".join(report.never_called[:8])
        more = f" (+{len(report.never_called) - 8} more)" if len(report.never_called) > 8 else ""
        lines.append(
            f"never called ({len(report.never_called)} selected modules did not run as "
            f"modules): {shown}{more}"
        )
    if report.outputs:
        labels = [output_label(t) for t in report.outputs[:6]]
        hidden = report.outputs[6:]
        bad = sum(t.nan + t.inf for t in hidden)
        if bad:  # the NaN/Inf of outputs past the sixth are counted too
            labels.append(f"+{len(hidden)} more ({bad} not finite)")
        lines.append("model output: " + ", ".join(labels))
    return lines


SHOWN_IMAGES = 10  # images listed with their NaN/Inf; JSON carries them all


def origin_lines(report: Report) -> list[str]:
    """Where NaN/Inf first appeared, and in a batch or folder which images hold them."""
    lines = [f"NaN/Inf first appeared — {o.describe()}" for o in report.nonfinite_origins]
    shapes = report.input.shapes
    images = shapes[0][0] if shapes and shapes[0] else 1
    bad = report.nonfinite_images
    if bad and (images > 1 or len(bad) > 1):
        parts = []
        for b in bad[:SHOWN_IMAGES]:
            said = [
                f"{kind} {nonfinite(TensorStats(kind, (), '', 0, nan=nan, inf=inf))}"
                for kind, nan, inf in (
                    ("input", b.input_nan, b.input_inf),
                    ("output", b.output_nan, b.output_inf),
                )
                if nan or inf
            ]
            name = f"image {b.image}" + (f" ({b.source})" if b.source else "")
            parts.append(f"{name}: {', '.join(said)}")
        more = f"; … and {len(bad) - SHOWN_IMAGES} more (all in -f json)" if len(bad) > 10 else ""
        lines.append(f"NaN/Inf by image ({len(bad)} of {images}): {'; '.join(parts)}{more}")
    return lines


def input_grad_lines(report: Report) -> list[str]:
    return [
        f"input gradient {g.path}: {shape(g.shape)} norm {num(g.norm)}, "
        f"mean {num(g.mean)}, std {num(g.std)}, min {num(g.min)}, max {num(g.max)}"
        for g in report.input_grads or []
    ]


def footer_lines(report: Report) -> list[str]:
    """The lines under the per-call table: summary, origins, input gradients."""
    return summary_lines(report) + origin_lines(report) + input_grad_lines(report)


# ---------------------------------------------------------------- predictions


def predictions_table(preds: list[Prediction], tokens: bool = False) -> Table:
    """Top-k per image; several images: which image (its path in the folder) and, in an
    ImageFolder tree, its class folder. A non-finite score is flagged. Every column is
    built; the image column is hidden for one image, the folder column outside a tree.
    `tokens`: a language model's next tokens, per sequence, each token quoted (its spaces
    show)."""
    images = {p.image for p in preds}
    folders = any(p.folder_class for p in preds)
    hidden = (() if len(images) > 1 else ("image",)) + (() if folders else ("folder",))
    rows = [
        Row(
            [
                p.source or str(p.image),
                p.folder_class or DASH,
                str(p.rank),
                (repr(p.label) if tokens else p.label) if p.label is not None else DASH,
                str(p.index),
                prob(p.prob),
            ],
            p.prob is None,
        )
        for p in preds
    ]
    headers = ["image", "folder", "#", "class", "index", "prob"]
    if tokens:
        headers = ["sequence", "folder", "#", "token", "id", "prob"]
        hidden = tuple("sequence" if h == "image" else h for h in hidden)
    return Table("predictions", headers, rows, DROP["predictions"], hidden)


def predictions_section(report: Report) -> Section:
    s = Section("predictions", "predictions")
    if report.predictions == []:
        s.parts.append(Line("predictions: none (nothing detected)"))
    if report.predictions:
        s.parts.append(predictions_table(report.predictions, is_text_task(report.model.task)))
    if report.prediction_note:  # (without predictions: why --topk found none to show)
        s.parts.append(Line(report.prediction_note, "dim"))
    return s


# ---------------------------------------------------------------- profile, ablation, checks


def profile_section(report: Report) -> Section:
    s = Section("profile", "profile")
    prof = report.profile
    if prof is None:
        return s
    backward = prof.unhooked_backward_ms is not None
    headers = ["layer", "call", "total ms", "self ms", "% of pass"]
    headers += ["backward ms"] if backward else []
    headers += ["FLOPs", "output MB"]
    t = Table(PROFILE_TITLE, headers, [], DROP["profile"])
    for c in report.layers:
        p = c.profile
        if p is None:
            continue
        cells = [
            c.name,
            str(c.call),
            f"{p.forward_ms:.3f}",
            f"{p.self_ms:.3f}" if p.self_ms is not None else DASH,
            f"{p.share:.1%}" if p.share is not None else DASH,
        ]
        if backward:
            cells.append(f"{p.backward_ms:.3f}" if p.backward_ms is not None else DASH)
        cells.append(flops_label(p.flops))
        cells.append(f"{p.output_bytes / 2**20:.2f}")
        t.rows.append(Row(cells))
    s.parts.append(t)
    s.parts += [Line(text) for text in profile_lines(report)]
    return s


def flops_label(n: int | None) -> str:
    """A FLOP count with an SI prefix (1.82G), or a dash when not counted."""
    if n is None:
        return DASH
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{prefix}"
    return str(n)


def profile_lines(report: Report) -> list[str]:
    """--profile's footer: where the unhooked forward's time goes — the selected calls, each
    counted once (a call inside another selected call is part of it), the forward's own code
    outside any module, the modules not selected — then FLOPs and the backward."""
    prof = report.profile
    if prof is None:
        return []
    unhooked = prof.unhooked_ms

    def part(ms: float) -> str:
        return f"{ms:.1f} ms = {ms / unhooked:.0%}" if unhooked else f"{ms:.1f} ms"

    what = "the selected calls" if prof.containers else "the selected leaf calls"
    runs = f"median of {prof.runs}"
    if prof.batches > 1:
        runs += f" per batch, added up over {prof.batches} batches"
    head = (
        f"profile: {what} take {part(prof.layers_ms)} of an unhooked forward "
        f"({unhooked:.1f} ms, {runs})"
    )
    if prof.nested:
        head += f"; {prof.nested} of them ran inside another selected call and count in it"
    lines = [head]
    if prof.outside_ms is not None and prof.unselected_ms is not None:
        lines.append(
            f"profile: outside any module (a forward's own code: additions, reshapes) "
            f"{part(prof.outside_ms)}; in modules not selected {part(prof.unselected_ms)}"
        )
    if prof.flops is not None:
        covered = ""
        if prof.layers_flops is not None and prof.flops:
            covered = f" ({prof.layers_flops / prof.flops:.1%} of the model's)"
        text = (
            f"FLOPs: the selected calls {flops_label(prof.layers_flops)}{covered}; the model's "
            f"forward {flops_label(prof.flops)} FLOPs = {flops_label(prof.flops // 2)} MACs"
        )
        if prof.backward_flops is not None:
            text += f", its backward {flops_label(prof.backward_flops)} FLOPs"
        if prof.batches > 1:
            text += f", over {prof.batches} batches"
        lines.append(
            text + " (torch's FlopCounterMode: matrix products, convolutions, attention; "
            "elementwise operations count 0)"
        )
    if prof.flops_note:
        lines.append(f"profile: {prof.flops_note}")
    if prof.unhooked_backward_ms is not None and prof.layers_backward_ms is not None:
        bshare = prof.layers_backward_ms / prof.unhooked_backward_ms
        lines.append(
            f"profile: their backward takes {prof.layers_backward_ms:.1f} ms = "
            f"{bshare:.0%} of an unhooked backward ({prof.unhooked_backward_ms:.1f} ms)"
        )
    return lines


SHOWN_CHANGES = 20  # changed layer outputs listed; JSON carries them all


def ablation_section(report: Report) -> Section:
    s = Section("ablation", "ablation")
    a = report.ablation
    if a is None:
        return s
    s.parts.append(
        Line(
            f"ablation: {', '.join(a.specs)} (a second run, compared with the one above)", "heading"
        )
    )
    before, after = a.predictions_before or [], a.predictions_after or []
    if before or after:
        many = len({p.image for p in (*before, *after)}) > 1
        t = Table(
            "predictions, clean -> ablated",
            [*(["image"] if many else []), "#", "clean", "prob", "ablated", "prob "],
        )
        clean = {(p.image, p.rank): p for p in before}
        ablated = {(p.image, p.rank): p for p in after}
        for key in sorted(clean.keys() | ablated.keys()):  # (paired by image and rank)
            b, f = clean.get(key), ablated.get(key)
            cells = [
                *([str(key[0])] if many else []),
                str(key[1]),
                (b.label or str(b.index)) if b else DASH,
                prob(b.prob) if b else DASH,
                (f.label or str(f.index)) if f else DASH,
                prob(f.prob) if f else DASH,
            ]
            t.rows.append(Row(cells))
        s.parts.append(t)
    if a.changed_layers:
        t = Table(
            "layer outputs that changed (largest move first: of the mean, std, min, max or "
            "norm, in units of the clean output's rms)",
            ["layer", "call", "output", "norm clean", "norm ablated", "change", "moved"],
        )
        for ch in a.changed_layers[:SHOWN_CHANGES]:
            change = (
                f"+{ch.relative:.1%}" if ch.norm_after >= ch.norm_before else f"-{ch.relative:.1%}"
            )
            cells = [
                ch.layer,
                str(ch.call),
                ch.path,
                num(ch.norm_before),
                num(ch.norm_after),
                change,
                DASH if ch.moved is None else num(ch.moved),
            ]
            t.rows.append(Row(cells))
        s.parts.append(t)
    else:
        s.parts.append(Line("no selected layer's output changed"))
    return s


def per_token_section(report: Report) -> Section:
    """--per-token: each selected call's (batch, tokens, C) outputs, position by position."""
    s = Section("per_token", "per token")
    rows: list[Row] = []
    sequences: set[int] = set()
    for c in report.layers:
        for t in c.outputs:
            for r in t.per_token or ():
                sequences.add(r.sequence)
                rows.append(
                    Row(
                        [
                            c.name,
                            str(c.call),
                            t.path.removeprefix("out") or DASH,
                            str(r.sequence),
                            str(r.position),
                            repr(r.token) if r.token is not None else DASH,
                            str(r.id) if r.id is not None else DASH,
                            num(r.norm),
                            num(r.mean),
                            num(r.std),
                            num(r.max_abs),
                            str(r.channel) if r.channel is not None else DASH,
                        ],
                        r.norm is None,
                    )
                )
    if rows:
        headers = ["layer", "call", "out", "seq", "pos", "token", "id", "norm", "mean", "std"]
        headers += ["max|x|", "channel"]
        hidden: tuple[str, ...] = ("seq",) if len(sequences) == 1 else ()
        if all(r.cells[2] == DASH for r in rows):
            hidden += ("out",)
        s.parts.append(Table("per token", headers, rows, DROP["per_token"], hidden))
    return s


def checks_section(report: Report, *, quiet: bool = False) -> Section:
    """Each rule's verdict and its first failures (with quiet, only the rules that failed)."""
    return checks_of(report.checks, quiet=quiet)


def checks_of(checks: Sequence[CheckResult], *, quiet: bool = False) -> Section:
    """checks_section for any list of verdicts (a run log's too)."""
    s = Section("checks", "checks")
    for c in checks:
        if quiet and c.passed:
            continue
        verdict: Style = "good" if c.passed else "bad"
        s.parts.append(Line(f"{c.rule}: {c.message}", verdict, "PASS" if c.passed else "FAIL"))
        s.parts += [Line(f.message, "item") for f in c.failures[:SHOWN_FAILURES]]
        if len(c.failures) > SHOWN_FAILURES:
            more = len(c.failures) - SHOWN_FAILURES
            s.parts.append(Line(f"… and {more} more (all in --format json)", "item"))
    return s


def lines_section(name: str, title: str, texts: list[str], style: Style = "plain") -> Section:
    return Section(name, title, [Line(t, style) for t in texts])


def report_sections(report: Report) -> list[Section]:
    """inspect and grads: every section in the order the table prints them. A section with
    nothing to say is left out."""
    calls = Section("calls", "layer calls", [calls_table(report)])
    if report.backward is not None:
        params = params_table(report)
        if params.rows:
            calls.parts.append(params)
    sections = [
        lines_section("header", "run", header_lines(report), "dim"),
        calls,
        per_token_section(report),
        channels_section(report),
        outliers_section(report),
        heads_section(report),
        experts_section(report),
        lines_section("summary", "summary", summary_lines(report)),
        lines_section("origins", "non-finite origins", origin_lines(report)),
        lines_section("input_grads", "input gradients", input_grad_lines(report)),
        predictions_section(report),
        lines_section("notes", "notes", [f"note: {n}" for n in report.notes], "note"),
        profile_section(report),
        memory_section(report),
        ablation_section(report),
        checks_section(report),
    ]
    return [s for s in sections if s.parts]


def checks_sections(report: Report, *, quiet: bool) -> list[Section]:
    """check: the pass/fail list (with quiet, only failures, and nothing when all pass)."""
    sections = [] if quiet else [lines_section("header", "run", header_lines(report), "dim")]
    sections.append(checks_section(report, quiet=quiet))
    if not quiet or any(not c.passed for c in report.checks):
        sections.append(lines_section("origins", "non-finite origins", origin_lines(report)))
    if not quiet:
        failed = sum(not c.passed for c in report.checks)
        verdict = f"{len(report.checks) - failed} passed, {failed} failed"
        sections.append(Section("verdict", "verdict", [Line(verdict, "bad" if failed else "good")]))
    return [s for s in sections if s.parts]
