"""Rich tables for people, and Markdown tables of the same rows.

One row per (layer call, output tensor): structured outputs get one row per tensor, labelled
by path. NaN/Inf are flagged in red; under NO_COLOR or when not a terminal no escape codes
are written and boxes are plain ASCII.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from hookcli.records import LayerCall, LayersReport, ModelEntry, Prediction, Report, TensorStats
from hookcli.render.fmt import DASH, count, nonfinite, num, pct, shape, tensor_label

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
RIGHT = {"call", "mean", "std", "min", "max", "zeros"}


def _input_label(call: LayerCall) -> str:
    if not call.inputs:
        return DASH
    label = tensor_label(call.inputs[0], "in")
    if label.startswith("[0] "):
        label = label[4:]
    extra = len(call.inputs) - 1
    return f"{label} +{extra}" if extra else label


def layer_rows(report: Report) -> Iterable[tuple[list[str], TensorStats | None]]:
    """The cells of every table row, with the tensor the row describes."""
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


def _table(title: str | None, headers: Sequence[str], color: bool) -> Table:
    t = Table(
        title=title,
        box=box.SIMPLE_HEAD if color else box.ASCII2,
        show_edge=False,
        title_justify="left",
        header_style="bold" if color else "",
        pad_edge=False,
    )
    for h in headers:
        t.add_column(
            h,
            justify="right"
            if h in RIGHT or h in ("prob", "params", "#", "index", "calls")
            else "left",
            overflow="fold",
        )
    return t


def header_lines(report: Report) -> list[str]:
    m = report.model
    lines = [
        f"{report.command}: {m.spec} ({m.task}, {count(m.params)} params) on {report.device}",
        f"weights: {m.weights}",
        f"input: {report.input.description} -> " + ", ".join(shape(s) for s in report.input.shapes),
    ]
    if report.input.preprocessing:
        lines.append(f"preprocessing: {report.input.preprocessing}")
    return lines


def report_table(report: Report, *, color: bool, width: int | None) -> str:
    console, buf = _console(color, width)
    for line in header_lines(report):
        console.print(Text(line, style="dim" if color else ""))
    calls = len(report.layers)
    table = _table(f"{calls} layer call{'s' if calls != 1 else ''}", HEADERS, color)
    for cells, t in layer_rows(report):
        style = "red" if (t is not None and t.nonfinite) else None
        table.add_row(*cells, style=style if color else None)
    console.print(table)
    if report.never_called:
        shown = ", ".join(report.never_called[:8])
        more = f" (+{len(report.never_called) - 8} more)" if len(report.never_called) > 8 else ""
        console.print(
            f"never called ({len(report.never_called)} selected modules did not run as "
            f"modules): {shown}{more}"
        )
    if report.outputs:
        outs = ", ".join(tensor_label(t, "out") for t in report.outputs[:6])
        console.print(f"model output: {outs}")
    if report.predictions == []:
        console.print("predictions: none (nothing detected)")
    if report.predictions:
        console.print(predictions_table(report.predictions, color))
    if report.predictions is not None and report.prediction_note:
        console.print(Text(report.prediction_note, style="dim" if color else ""))
    for note in report.notes:
        console.print(Text(f"note: {note}", style="yellow" if color else ""))
    return _text(buf)


def _text(buf: io.StringIO) -> str:
    """The rendered text without Rich's trailing padding."""
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


def predictions_table(preds: list[Prediction], color: bool) -> Table:
    images = {p.image for p in preds}
    headers = (["image"] if len(images) > 1 else []) + ["#", "class", "index", "prob"]
    t = _table("predictions", headers, color)
    for p in preds:
        cells = [p.label or DASH, str(p.index), f"{p.prob:.4f}"]
        img = [p.source.rsplit("/", 1)[-1] if p.source else str(p.image)] if len(images) > 1 else []
        t.add_row(*img, str(p.rank), *cells)
    return t


def layers_table(report: LayersReport, *, color: bool, width: int | None) -> str:
    console, buf = _console(color, width)
    m = report.model
    console.print(
        f"{m.spec} ({m.task}): {count(m.params)} parameters, {len(report.modules)} modules"
    )
    if report.input is not None:
        console.print(f"shapes from one forward pass; input: {report.input.description}")
    headers = ["layer", "type", "params", "leaf", "also named"]
    if report.input is not None:
        headers += ["calls", "output shape"]
    t = _table(None, headers, color)
    for r in report.modules:
        indent = "  " * max(r.depth - 1, 0)
        cells = [
            indent + r.name,
            r.type,
            count(r.params),
            "yes" if r.leaf else "",
            ", ".join(r.aliases),
        ]
        if report.input is not None:
            cells += [str(r.calls or 0), "; ".join(r.output_shapes or []) or DASH]
        t.add_row(*cells)
    console.print(t)
    console.print(
        "select with -l NAME (exact or glob, e.g. -l 'layer1.*'), -t TYPE, --depth N;"
        " default: every leaf module"
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
    console.print("* = DEFAULT. Use: hookcli inspect NAME [IMAGE] --weights DEFAULT|ENUM|none")
    return _text(buf)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|")


def report_markdown(report: Report) -> str:
    out = [
        f"**{line}**  " if i == 0 else f"{line}  " for i, line in enumerate(header_lines(report))
    ]
    out += [
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "|".join("---:" if h in RIGHT else "---" for h in HEADERS) + "|",
    ]
    for cells, _ in layer_rows(report):
        out.append("| " + " | ".join(_md_escape(c) for c in cells) + " |")
    if report.never_called:
        out += ["", "never called: " + ", ".join(f"`{n}`" for n in report.never_called)]
    if report.predictions:
        out += [
            "",
            f"predictions ({report.prediction_note}):",
            "",
            "| image | # | class | index | prob |",
            "|---:|---:|---|---:|---:|",
        ]
        for p in report.predictions:
            label = _md_escape(p.label or DASH)
            out.append(f"| {p.image} | {p.rank} | {label} | {p.index} | {p.prob:.4f} |")
    out += [f"\nnote: {n}" for n in report.notes]
    return "\n".join(out) + "\n"
