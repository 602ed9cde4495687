"""Rich tables for people, and Markdown tables of the same rows.

One row per (layer call, output tensor): structured outputs get one row per tensor, labelled
by path. NaN/Inf are flagged in red; under NO_COLOR or when not a terminal no escape codes
are written and boxes are plain ASCII.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from hookcli.records import (
    DiffReport,
    LayerCall,
    LayersReport,
    ModelEntry,
    Prediction,
    Report,
    SavedFile,
    TensorDiff,
    TensorStats,
)
from hookcli.render.fmt import DASH, count, nonfinite, num, pct, prob, shape, spark, tensor_label
from hookcli.text import escape, markdown

HEADERS = [
    "layer",
    "type",
    "call",
    "input",
    "output",
    "mean",
    "std",
    "min",
    "max",
    "zeros",
    "nan/inf",
]
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
]
RIGHT = {
    "call",
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
    "SQNR A",
    "SQNR B",
}


def _t(text: str, style: str = "") -> Text:
    """A line or cell for Rich: user text escaped (text.escape), never read as markup."""
    return Text(escape(text), style=style)


def _input_label(call: LayerCall) -> str:
    if not call.inputs:
        return DASH
    label = tensor_label(call.inputs[0], "in")
    if label.startswith("[0] "):
        label = label[4:]
    extra = len(call.inputs) - 1
    return f"{label} +{extra}" if extra else label


def _nonfinite_cell(*tensors: TensorStats | None) -> str:
    flagged = [nonfinite(t) for t in tensors if t is not None and t.nonfinite]
    return "; ".join(flagged) if flagged else DASH


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
            gin = num(grad_in.norm) if (i == 0 and grad_in is not None) else DASH
            row = [
                *cells,
                tensor_label(t, "out"),
                num(t.mean),
                num(t.std),
                num(g.norm) if g else DASH,
                num(g.mean) if g else DASH,
                num(g.std) if g else DASH,
                gin,
                _nonfinite_cell(t, g, grad_in if i == 0 else None),
            ]
            yield row, any(x is not None and x.nonfinite for x in (t, g))


def param_rows(report: Report) -> Iterable[list[str]]:
    for c in report.layers:
        for p in c.params or []:
            yield [
                c.name,
                p.name,
                shape(p.shape),
                num(p.norm),
                num(p.grad_norm),
                num(p.grad_mean),
                num(p.grad_max_abs),
                num(p.ratio),
            ]


def _has_hist(report: Report) -> bool:
    return any(t.hist for c in report.layers for t in c.outputs)


def layer_rows(report: Report) -> Iterable[tuple[list[str], TensorStats | None]]:
    """The cells of every table row, with the tensor the row describes."""
    with_hist = _has_hist(report)
    for cells, t in _layer_rows(report):
        yield ([*cells, spark(t.hist if t else None)] if with_hist else cells), t


def _layer_rows(report: Report) -> Iterable[tuple[list[str], TensorStats | None]]:
    for c in report.layers:
        head = [c.name, c.type, str(c.call), _input_label(c)]
        if not c.outputs:
            yield [*head, c.error or DASH, *[DASH] * 6], None
            continue
        for i, t in enumerate(c.outputs):
            cells = head if i == 0 else ["", "", "", ""]
            stats = [num(t.mean), num(t.std), num(t.min), num(t.max), pct(t.zeros)]
            yield [*cells, tensor_label(t, "out"), *stats, nonfinite(t) or DASH], t


def _console(color: bool, width: int | None) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    console = Console(
        file=buf,
        width=width or 200,
        force_terminal=color,
        no_color=not color,
        color_system="standard" if color else None,
        highlight=False,
        soft_wrap=False,
    )
    return console, buf


# Columns each table gives up first when the terminal is too narrow, in that order.
DROP: dict[str, tuple[str, ...]] = {
    "layers": ("hist", "input", "type", "min", "max", "zeros"),
    "grads": ("type", "grad_out mean", "grad_out std", "std", "mean", "output"),
    "params": ("grad mean", "grad max|abs|", "shape", "norm"),
    "profile": ("output MB", "backward ms", "% of pass"),
    "predictions": ("folder", "index"),
}
_NAME_MIN = 16  # the first column (a layer or file name) may fold down to this width


class Grid:
    """A table that fits the terminal without ever splitting a number across lines.

    Every column but the first (a name, which may fold) keeps its cells whole. When the
    table is wider than the console, columns are given up in the table's DROP order, and a
    line says which; when even that does not fit, each row becomes a block of `header value`
    pairs (a vertical layout)."""

    def __init__(
        self, title: str | None, headers: Sequence[str], color: bool, drop: Sequence[str] = ()
    ) -> None:
        self.title = title
        self.headers = list(headers)
        self.color = color
        self.drop = [h for h in drop if h in self.headers]
        self.rows: list[tuple[list[str], str | None]] = []

    def add_row(self, *cells: str, style: str | None = None) -> None:
        """A row; each cell escaped (names can hold ESC, newlines, markup)."""
        self.rows.append(([escape(c) for c in cells], style))

    def _widths(self, wrap_headers: bool) -> list[int]:
        """Each column's width: its widest cell, and its header whole or (wrap_headers) its
        header's longest word, the header then laid out one word per line."""
        widths = [
            max(cell_len(w) for w in h.split()) if wrap_headers else cell_len(h)
            for h in self.headers
        ]
        for cells, _ in self.rows:
            for i, c in enumerate(cells):
                lines = c.split("\n")
                widths[i] = max(widths[i], *(cell_len(line) for line in lines))
        return widths

    def _fits(self, keep: list[int], widths: list[int], width: int) -> bool:
        need = sum(min(widths[i], _NAME_MIN) if i == 0 else widths[i] for i in keep)
        return need + 3 * (len(keep) - 1) <= width

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        keep = list(range(len(self.headers)))
        widths = self._widths(wrap_headers=False)
        wrap = not self._fits(keep, widths, width)
        if wrap:  # first, headers over two lines; then fewer columns
            widths = self._widths(wrap_headers=True)
        hidden: list[str] = []
        for name in self.drop:
            if self._fits(keep, widths, width):
                break
            keep.remove(self.headers.index(name))
            hidden.append(name)
        if not self._fits(keep, widths, width):
            yield from self._vertical(width)
            return
        headers = [self.headers[i] for i in keep]
        yield self._table(headers, keep, widths, width, wrap)
        if hidden:
            note = f"(columns left out at {width} characters: {', '.join(hidden)}; widen the "
            note += "terminal, set COLUMNS, or use -f json)"
            yield _t(note, style="dim" if self.color else "")

    def _table(
        self, headers: list[str], keep: list[int], widths: list[int], width: int, wrap: bool
    ) -> Table:
        t = Table(
            title=_t(self.title) if self.title else None,
            box=box.SIMPLE_HEAD if self.color else box.ASCII2,
            show_edge=False,
            title_justify="left",
            header_style="bold" if self.color else "",
            pad_edge=False,
        )
        rest = sum(widths[i] for i in keep[1:]) + 3 * (len(keep) - 1)
        for n, (h, i) in enumerate(zip(headers, keep, strict=True)):
            right = h in RIGHT or h in ("prob", "params", "#", "index", "calls")
            label = h.replace(" ", "\n") if wrap else h
            if n == 0:  # the name: folds when it must
                t.add_column(label, overflow="fold", max_width=max(_NAME_MIN, width - rest))
            else:
                t.add_column(
                    label, justify="right" if right else "left", no_wrap=True, min_width=widths[i]
                )
        for cells, style in self.rows:
            t.add_row(*(Text(cells[i]) for i in keep), style=style if self.color else None)
        return t

    def _vertical(self, width: int) -> Iterable[Text]:
        """Each row as its name, then `header value` pairs packed into lines of the width."""
        if self.title:
            yield _t(self.title, style="bold" if self.color else "")
        for cells, style in self.rows:
            look = (style or "") if self.color else ""
            pairs = [f"{h} {c}" for h, c in zip(self.headers[1:], cells[1:], strict=True) if c]
            if cells[0]:
                yield _t(cells[0], style=(style or "bold") if self.color else "")
            line = ""
            for pair in pairs:
                if line and cell_len(line) + 2 + cell_len(pair) > width:
                    yield _t(line, style=look)
                    line = ""
                line += "  " + pair
            if line:
                yield _t(line, style=look)


def _table(
    title: str | None, headers: Sequence[str], color: bool, drop: Sequence[str] = ()
) -> Grid:
    return Grid(title, headers, color, drop)


def header_lines(report: Report) -> list[str]:
    m = report.model
    mode = ", train mode" if m.mode == "train" else ""
    lines = [
        f"{report.command}: {m.spec} ({m.task}, {count(m.params)} params{mode}) on {report.device}",
        f"weights: {m.weights}",
        f"input: {report.input.description} -> " + ", ".join(shape(s) for s in report.input.shapes),
    ]
    if report.input.preprocessing:
        lines.append(f"preprocessing: {report.input.preprocessing}")
    if report.config:
        lines.append(f"config: {report.config}")
    if report.backward is not None:
        lines.append(f"backward from: {report.backward.source} = {num(report.backward.value)}")
    return lines


def _output_label(t: TensorStats) -> str:
    """`1x10`, or `1x10 (10 Inf)`: a model output's NaN/Inf are counted where it is named."""
    label = tensor_label(t, "out")
    return f"{label} ({nonfinite(t)})" if t.nonfinite else label


def _footer_lines(report: Report) -> list[str]:
    lines = []
    if report.never_called:
        shown = ", ".join(report.never_called[:8])
        more = f" (+{len(report.never_called) - 8} more)" if len(report.never_called) > 8 else ""
        lines.append(
            f"never called ({len(report.never_called)} selected modules did not run as "
            f"modules): {shown}{more}"
        )
    if report.outputs:
        labels = [_output_label(t) for t in report.outputs[:6]]
        hidden = report.outputs[6:]
        bad = sum(t.nan + t.inf for t in hidden)
        if bad:  # the NaN/Inf of outputs past the sixth are counted too
            labels.append(f"+{len(hidden)} more ({bad} not finite)")
        lines.append("model output: " + ", ".join(labels))
    for o in report.nonfinite_origins:
        lines.append(f"NaN/Inf first appeared — {o.describe()}")
    for g in report.input_grads or []:
        lines.append(
            f"input gradient {g.path}: {shape(g.shape)} norm {num(g.norm)}, "
            f"mean {num(g.mean)}, std {num(g.std)}, min {num(g.min)}, max {num(g.max)}"
        )
    return lines


def report_table(report: Report, *, color: bool, width: int | None) -> str:
    console, buf = _console(color, width)
    for line in header_lines(report):
        console.print(_t(line, style="dim" if color else ""))
    calls = len(report.layers)
    title = f"{calls} layer call{'s' if calls != 1 else ''}"
    if report.backward is not None:
        table = _table(title, GRAD_HEADERS, color, DROP["grads"])
        for cells, bad in grad_rows(report):
            table.add_row(*cells, style="red" if (bad and color) else None)
        console.print(table)
        params = list(param_rows(report))
        if params:
            ptable = _table("parameter gradients", PARAM_HEADERS, color, DROP["params"])
            for cells in params:
                ptable.add_row(*cells)
            console.print(ptable)
    else:
        headers = HEADERS + (["hist"] if _has_hist(report) else [])
        table = _table(title, headers, color, DROP["layers"])
        for cells, t in layer_rows(report):
            style = "red" if (t is not None and t.nonfinite) else None
            table.add_row(*cells, style=style if color else None)
        console.print(table)
    for line in _footer_lines(report):
        console.print(_t(line))
    if report.predictions == []:
        console.print(_t("predictions: none (nothing detected)"))
    if report.predictions:
        console.print(predictions_table(report.predictions, color))
    if report.predictions is not None and report.prediction_note:
        console.print(_t(report.prediction_note, style="dim" if color else ""))
    for note in report.notes:
        console.print(_t(f"note: {note}", style="yellow" if color else ""))
    if report.profile is not None:
        _print_profile(console, report, color)
    if report.ablation is not None:
        _print_ablation(console, report, color)
    _print_checks(console, report, color, quiet=False)
    return _text(buf)


def _print_profile(console: Console, report: Report, color: bool) -> None:
    prof = report.profile
    assert prof is not None
    backward = prof.unhooked_backward_ms is not None
    headers = ["layer", "call", "total ms", "self ms", "% of pass"]
    headers += ["backward ms"] if backward else []
    headers += ["output MB"]
    title = (
        "profile (total: from entering the module to its return; self: less the modules it "
        "calls; hookcli's hook work excluded)"
    )
    t = _table(title, headers, color, DROP["profile"])
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
        cells.append(f"{p.output_bytes / 2**20:.2f}")
        t.add_row(*cells)
    console.print(t)
    share = prof.layers_ms / prof.unhooked_ms if prof.unhooked_ms else 0.0
    line = (
        f"profile: the selected leaf calls take {prof.layers_ms:.1f} ms = {share:.0%} of an "
        f"unhooked forward ({prof.unhooked_ms:.1f} ms, median of {prof.runs}); the rest runs "
        "outside modules (additions, reshapes) or in unselected ones"
    )
    console.print(_t(line))
    if prof.unhooked_backward_ms is not None and prof.layers_backward_ms is not None:
        bshare = prof.layers_backward_ms / prof.unhooked_backward_ms
        console.print(
            _t(
                f"profile: their backward takes {prof.layers_backward_ms:.1f} ms = "
                f"{bshare:.0%} of an unhooked backward ({prof.unhooked_backward_ms:.1f} ms)"
            )
        )


def _print_ablation(console: Console, report: Report, color: bool) -> None:
    a = report.ablation
    assert a is not None
    console.print(
        _t(
            f"ablation: {', '.join(a.specs)} (a second run, compared with the one above)",
            style="bold" if color else "",
        )
    )
    before, after = a.predictions_before or [], a.predictions_after or []
    if before or after:
        t = _table(
            "predictions, clean -> ablated", ["#", "clean", "prob", "ablated", "prob "], color
        )
        for i in range(max(len(before), len(after))):
            b = before[i] if i < len(before) else None
            f = after[i] if i < len(after) else None
            t.add_row(
                str(i + 1),
                (b.label or str(b.index)) if b else DASH,
                prob(b.prob) if b else DASH,
                (f.label or str(f.index)) if f else DASH,
                prob(f.prob) if f else DASH,
            )
        console.print(t)
    if a.changed_layers:
        t = _table(
            "layer outputs that changed (largest relative change of the norm first)",
            ["layer", "call", "output", "norm clean", "norm ablated", "change"],
            color,
        )
        for ch in a.changed_layers[:20]:
            t.add_row(
                ch.layer,
                str(ch.call),
                ch.path,
                num(ch.norm_before),
                num(ch.norm_after),
                f"{ch.relative:+.1%}" if ch.norm_after >= ch.norm_before else f"-{ch.relative:.1%}",
            )
        console.print(t)
    else:
        console.print(_t("no selected layer's output changed"))


_SHOWN = 20  # failures listed per rule in text; JSON carries them all


def _print_checks(console: Console, report: Report, color: bool, *, quiet: bool) -> None:
    for c in report.checks:
        if quiet and c.passed:
            continue
        mark, style = ("PASS", "green") if c.passed else ("FAIL", "bold red")
        line = _t(f"{mark} ", style=style if color else "")
        line.append(escape(f"{c.rule}: {c.message}"))
        console.print(line)
        for f in c.failures[:_SHOWN]:
            console.print(_t(f"    {f}"))
        if len(c.failures) > _SHOWN:
            console.print(_t(f"    … and {len(c.failures) - _SHOWN} more (all in --format json)"))


def checks_table(report: Report, *, color: bool, width: int | None, quiet: bool) -> str:
    """check: the pass/fail list (with --quiet, only failures: nothing when all pass)."""
    console, buf = _console(color, width)
    if not quiet:
        for line in header_lines(report):
            console.print(_t(line, style="dim" if color else ""))
    _print_checks(console, report, color, quiet=quiet)
    if not quiet or any(not c.passed for c in report.checks):
        for o in report.nonfinite_origins:
            console.print(_t(f"NaN/Inf first appeared — {o.describe()}"))
    if not quiet:
        failed = sum(not c.passed for c in report.checks)
        total = len(report.checks)
        verdict = f"{total - failed} passed, {failed} failed"
        console.print(_t(verdict, style=("bold red" if failed else "bold green") if color else ""))
    out = _text(buf)
    return "" if out.strip() == "" else out


def _text(buf: io.StringIO) -> str:
    """The rendered text without Rich's trailing padding."""
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


def predictions_table(preds: list[Prediction], color: bool) -> Grid:
    """Top-k per image; several images: which image (its path in the folder) and, in an
    ImageFolder tree, its class folder. A non-finite score is flagged."""
    images = {p.image for p in preds}
    folders = any(p.folder_class for p in preds)
    headers = (["image"] if len(images) > 1 else []) + (["folder"] if folders else [])
    t = _table("predictions", [*headers, "#", "class", "index", "prob"], color, DROP["predictions"])
    for p in preds:
        cells = [p.label or DASH, str(p.index), prob(p.prob)]
        img = [p.source or str(p.image)] if len(images) > 1 else []
        folder = [p.folder_class or DASH] if folders else []
        style = "red" if color and p.prob is None else None
        t.add_row(*img, *folder, str(p.rank), *cells, style=style)
    return t


def layers_table(report: LayersReport, *, color: bool, width: int | None) -> str:
    console, buf = _console(color, width)
    m = report.model
    console.print(
        _t(f"{m.spec} ({m.task}): {count(m.params)} parameters, {len(report.modules)} modules")
    )
    if report.input is not None:
        console.print(_t(f"shapes from one forward pass; input: {report.input.description}"))
    headers = ["layer", "type", "params", "leaf", "also named"]
    if report.input is not None:
        headers += ["calls", "output shape"]
    t = _table(None, headers, color)
    for r in report.modules:
        indent = "  " * max(r.depth - 1, 0)
        cells = [
            indent + r.name,
            r.type if r.hookable else f"{r.type} (TorchScript, not hookable)",
            count(r.params),
            "yes" if r.leaf else "",
            ", ".join(r.aliases),
        ]
        if report.input is not None:
            cells += [str(r.calls or 0), "; ".join(r.output_shapes or []) or DASH]
        t.add_row(*cells)
    console.print(t)
    console.print(
        _t(
            "select with -l NAME (exact or glob, e.g. -l 'layer1.*'), -t TYPE, --depth N;"
            " default: every leaf module"
        )
    )
    return _text(buf)


def models_table(entries: list[ModelEntry], *, color: bool, width: int | None) -> str:
    console, buf = _console(color, width)
    t = _table(
        f"{len(entries)} torchvision models",
        ["name", "task", "params", "input", "weights", "metric (DEFAULT)"],
        color,
    )
    for e in entries:
        weights = ", ".join(w + ("*" if w == e.default else "") for w in e.weights) or DASH
        t.add_row(
            e.name,
            e.task,
            count(e.params) if e.params else DASH,
            e.input_size or DASH,
            weights,
            e.metric or DASH,
        )
    console.print(t)
    console.print(_t("* = DEFAULT. Use: hookcli inspect NAME [IMAGE] --weights DEFAULT|ENUM|none"))
    return _text(buf)


def _md_table(headers: list[str], rows: Iterable[list[str]]) -> list[str]:
    out = [
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---:" if h in RIGHT else "---" for h in headers) + "|",
    ]
    out += ["| " + " | ".join(markdown(c) for c in cells) + " |" for cells in rows]
    return out


def report_markdown(report: Report) -> str:
    out = [
        f"**{markdown(line)}**  " if i == 0 else f"{markdown(line)}  "
        for i, line in enumerate(header_lines(report))
    ]
    if report.backward is not None:
        out += _md_table(GRAD_HEADERS, (cells for cells, _ in grad_rows(report)))
        params = list(param_rows(report))
        if params:
            out += ["", "parameter gradients:", *_md_table(PARAM_HEADERS, params)]
    else:
        headers = HEADERS + (["hist"] if _has_hist(report) else [])
        out += _md_table(headers, (cells for cells, _ in layer_rows(report)))
    footer = _footer_lines(report)
    if footer:
        out += ["", *(f"{markdown(line)}  " for line in footer)]
    if report.predictions:
        out += [
            "",
            f"predictions ({markdown(str(report.prediction_note))}):",
            "",
            "| image | # | class | index | prob |",
            "|---|---:|---|---:|---:|",
        ]
        for p in report.predictions:
            label = markdown(p.label or DASH)
            image = markdown(p.source) if p.source else str(p.image)
            if p.folder_class:
                image += f" ({markdown(p.folder_class)})"
            out.append(f"| {image} | {p.rank} | {label} | {p.index} | {prob(p.prob)} |")
    out += [f"\nnote: {markdown(n)}" for n in report.notes]
    return "\n".join(out) + "\n"


SAVED_HEADERS = ["key", "shape", "dtype", "mean", "std", "min", "max", "zeros", "nan/inf"]


def saved_table(saved: SavedFile, *, color: bool, width: int | None) -> str:
    console, buf = _console(color, width)
    console.print(_t(f"{saved.path}: {len(saved.tensors)} tensors", style="bold" if color else ""))
    for key, value in sorted(saved.metadata.items()):
        console.print(_t(f"{key}: {value}", style="dim" if color else ""))
    t = _table(None, SAVED_HEADERS, color)
    for s in saved.tensors:
        style = "red" if (s.nonfinite and color) else None
        t.add_row(
            s.path,
            shape(s.shape),
            s.dtype,
            num(s.mean),
            num(s.std),
            num(s.min),
            num(s.max),
            pct(s.zeros),
            nonfinite(s) or DASH,
            style=style,
        )
    console.print(t)
    return _text(buf)


# ---------------------------------------------------------------- hookcli diff


def _db(v: float | None, rel: float | None) -> str:
    if v is None:
        return "inf" if rel == 0 else DASH  # identical: infinite signal-to-noise
    return f"{v:.1f}"


def _flag(d: TensorDiff) -> str:
    if d.nonfinite:
        return f"{d.nonfinite} not finite"
    if d.note:
        return d.note
    return "over tol" if d.over else ""


def diff_rows(report: DiffReport) -> Iterable[tuple[list[str], bool]]:
    with_ref = report.ref is not None
    for c in [*report.calls, *report.outputs]:
        a_by_path = {d.path: d for d in c.a or []}
        for i, d in enumerate(c.b):
            head = [c.name, str(c.call)] if i == 0 else ["", ""]
            label = f"{d.path.removeprefix('out')} {shape(d.shape)}".strip()
            if with_ref:
                a = a_by_path.get(d.path)
                worse = DASH
                if a is not None and a.rel_l2 is not None and d.rel_l2 is not None:
                    worse = "A" if a.rel_l2 > d.rel_l2 else "B" if d.rel_l2 > a.rel_l2 else "="
                cells = [
                    num(a.rel_l2) if a else DASH,
                    num(d.rel_l2),
                    _db(a.sqnr_db, a.rel_l2) if a else DASH,
                    _db(d.sqnr_db, d.rel_l2),
                    worse,
                    "; ".join(f for f in (_flag(a) if a else "", _flag(d)) if f) or DASH,
                ]
                over = d.over or (a is not None and a.over)
            else:
                cells = [
                    num(d.max_abs),
                    num(d.rel_l2),
                    DASH if d.cosine is None else f"{d.cosine:.6f}",
                    _db(d.sqnr_db, d.rel_l2),
                    num(d.norm_rel),
                    _flag(d) or DASH,
                ]
                over = d.over
            yield [*head, label, *cells], over


DIFF_HEADERS = [
    "layer",
    "call",
    "output",
    "max|Δ|",
    "rel L2",
    "cosine",
    "SQNR dB",
    "norm Δ",
    "flag",
]
DIFF_REF_HEADERS = [
    "layer",
    "call",
    "output",
    "rel L2 A",
    "rel L2 B",
    "SQNR A",
    "SQNR B",
    "worse",
    "flag",
]
DROP["diff"] = ("norm Δ", "cosine", "max|Δ|", "output", "SQNR A", "SQNR B")


def diff_table(report: DiffReport, *, color: bool, width: int | None) -> str:
    console, buf = _console(color, width)
    m = report.model
    dim = "dim" if color else ""
    console.print(
        _t(f"diff: {m.spec} ({m.task}, {count(m.params)} params) on {report.device}", style=dim)
    )
    console.print(_t(f"weights: {m.weights}", style=dim))
    console.print(_t(f"input: {report.input.description}", style=dim))
    if report.ref is not None:
        console.print(
            _t(f"A: {report.a}   B: {report.b}   both against --ref {report.ref}", style=dim)
        )
    else:
        console.print(_t(f"A (reference): {report.a}   B: {report.b}", style=dim))
    headers = DIFF_REF_HEADERS if report.ref is not None else DIFF_HEADERS
    rel = "relative L2 = |B-A|/|A|" if report.ref is None else "relative L2 against the reference"
    t = _table(
        f"{len(report.calls)} layer calls ({rel}; tol {report.tol:g})", headers, color, DROP["diff"]
    )
    for cells, over in diff_rows(report):
        t.add_row(*cells, style="red" if over and color else None)
    console.print(t)
    for line in diff_footer(report):
        console.print(
            _t(
                line,
                style=("bold red" if report.failed else "bold green")
                if color and line.startswith(("first", "no call"))
                else "",
            )
        )
    return _text(buf)


def diff_footer(report: DiffReport) -> list[str]:
    lines = [f"note: {n}" for n in report.notes]
    lines += [f"missing: {m}" for m in report.missing[:10]]
    if len(report.missing) > 10:
        lines.append(f"missing: … and {len(report.missing) - 10} more (all in -f json)")
    if report.first_over is not None:
        lines.append(f"first past tolerance: {report.first_over}")
    else:
        lines.append(f"no call past tolerance ({report.tol:g})")
    return lines


def diff_markdown(report: DiffReport) -> str:
    m = report.model
    headers = DIFF_REF_HEADERS if report.ref is not None else DIFF_HEADERS
    out = [
        markdown(
            f"**diff** `{m.spec}` on {report.device}: A = {report.a}, B = {report.b}"
            + (f", reference = {report.ref}" if report.ref else " (A is the reference)")
        ),
        "",
        f"input: {markdown(report.input.description)}; tol {report.tol:g}",
        "",
        *_md_table(headers, (cells for cells, _ in diff_rows(report))),
        "",
        *(f"{markdown(line)}  " for line in diff_footer(report)),
    ]
    return "\n".join(out) + "\n"
