"""HTML: one self-contained file to share — the report's JSON, a static table, and a script.

The page holds the report's JSON verbatim (`<script type="application/json" id="hookcli-data">`,
parsed it equals `-f json`), so the file is also the data. The per-call table, one row per
layer call, is plain HTML written here from the records with the text formats' own number
formatting (render/fmt.py), and reads with JavaScript off and on paper. With JavaScript
(assets/report.js), every number the script shows — sort keys, the module tree's colours, the
detail of a call, its histogram — is read from that JSON, never recomputed: sort, filter by
layer glob and type, deep links (`#layer=layer4.1.conv2&call=0`), a module tree coloured by a
metric, the distributions as inline SVG. Pictures (maps, CAMs, attention) are embedded PNGs.

Nothing is fetched: a Content-Security-Policy forbids any request (images only from data:
URLs), there is no font, library or CDN. What user code controls (layer names, paths, labels)
is escaped for HTML here and set as text, never as markup, by the script.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from hookcli._version import __version__
from hookcli.records import (
    TENSOR_STATS,
    DiffCall,
    DiffReport,
    LayerCall,
    Report,
    Stat,
    TensorDiff,
    TensorStats,
)
from hookcli.render import diffrows, rows
from hookcli.render.fmt import DASH, num, shape, tensor_label
from hookcli.render.rows import RIGHT, Line, Part, Section, Table
from hookcli.text import escape

MB = 1_000_000
BUDGET = 1 * MB  # a report without pictures (resnet50 grads with --hist fits in it)
PICTURE_BUDGET = 3 * MB // 16  # each embedded picture adds this much (16 pictures: 4 MB)
_CSP = (
    "default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
    "script-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
)


@dataclass(frozen=True, slots=True)
class EmbeddedPicture:
    """An image to embed (`embed_image` encodes it): what it shows (`title`), the command that
    draws it alone, its notes."""

    title: str
    data: bytes
    width: int
    height: int
    mime: str = "image/png"
    command: str = ""
    notes: list[str] = field(default_factory=list)


PICTURE_BYTES = PICTURE_BUDGET * 3 // 4  # base64 adds a third


def embed_image(image: Any) -> tuple[bytes, str, str | None]:
    """A PIL image as the bytes to embed, their MIME type, and a note when they are not the
    exact pixels: lossless PNG when it fits PICTURE_BYTES; else WebP (quality 90, then 80),
    then WebP at a smaller scale, said in the note."""
    import io

    def encode(img: Any, fmt: str, **kw: Any) -> bytes:
        buf = io.BytesIO()
        img.save(buf, format=fmt, **kw)
        return buf.getvalue()

    png = encode(image, "PNG", optimize=True)
    if len(png) <= PICTURE_BYTES:
        return png, "image/png", None
    from PIL import features

    if not features.check("webp"):
        return png, "image/png", "larger than a picture's share of the budget (no WebP here)"
    rgb = image.convert("RGBA" if "A" in image.getbands() else "RGB")
    scale = 1.0
    while True:
        img = (
            rgb
            if scale == 1.0
            else rgb.resize((max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale))))
        )
        for quality in (90, 80):
            webp = encode(img, "WEBP", quality=quality, method=6)
            if len(webp) <= PICTURE_BYTES or (quality == 80 and scale < 0.3):
                size = "" if scale == 1.0 else f", scaled to {img.width}x{img.height}"
                note = (
                    f"embedded as WebP (lossy, quality {quality}{size}) to keep the report "
                    "small; the command below writes the exact PNG"
                )
                return webp, "image/webp", note
        scale *= 0.75


def budget(pictures: int) -> int:
    """The size a report with this many pictures should stay under, in bytes."""
    return BUDGET + pictures * PICTURE_BUDGET


def over_budget(page: str, pictures: int, what: str, advice: str) -> str | None:
    """A note when the page is larger than its budget: `what` made it large, `advice` is what
    makes it smaller."""
    size = len(page.encode("utf-8"))
    limit = budget(pictures)
    if size <= limit:
        return None
    return (
        f"the HTML report is {size / MB:.2f} MB, over its {limit / MB:.2f} MB budget "
        f"({what}); browsers open it, but it is heavy to share: {advice}"
    )


# ---------------------------------------------------------------- the page


@cache
def _asset(name: str) -> str:
    return resources.files("hookcli.render").joinpath("assets", name).read_text("utf-8")


def escape_html(text: str) -> str:
    """User-controlled text for HTML: control characters shown as escapes, markup inert."""
    return html.escape(escape(text), quote=True)


_e = escape_html


def data_script(data: dict[str, Any]) -> str:
    """The JSON as a script element's text: compact, ASCII (a file name's undecodable bytes,
    lone surrogates, are \\udcXX escapes, not bytes UTF-8 cannot hold), and `<` written as
    \\u003c so no string in it can close the element (JSON.parse reads the same value back)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    text = text.replace("<", "\\u003c")
    return f'<script type="application/json" id="hookcli-data">{text}</script>'


def page(title: str, kind: str, body: Iterable[str], data: dict[str, Any]) -> str:
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<link rel="icon" href="data:,">',  # no favicon request
        f'<meta name="generator" content="hookcli {_e(__version__)}">',
        f"<title>{_e(title)}</title>",
        f"<style>{_asset('report.css')}</style>",
        f'</head><body class="kind-{kind}">',
        *body,
        data_script(data),
        f"<script>{_asset('report.js')}</script>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _link(name: str, call: int) -> str:
    from urllib.parse import quote

    return f"#layer={quote(name, safe='', errors='surrogatepass')}&amp;call={call}"


def _line(line: Line) -> str:
    cls = f' class="{line.style}"' if line.style != "plain" else ""
    mark = ""
    if line.mark is not None:
        mark = f'<b class="mark {"good" if line.style == "good" else "bad"}">{_e(line.mark)}</b> '
    tag = "li" if line.style == "item" else "p"
    return f"<{tag}{cls}>{mark}{_e(line.text)}</{tag}>"


def _table(t: Table) -> str:
    cols = t.shown
    head = "".join(
        f"<th{' class=num' if t.headers[i] in RIGHT else ''}>{_e(t.headers[i])}</th>" for i in cols
    )
    body = []
    for r in t.rows:
        cells = "".join(
            f"<td{' class=num' if t.headers[i] in RIGHT else ''}>{_e(r.cells[i])}</td>"
            for i in cols
        )
        body.append(f"<tr{' class=bad' if r.flagged else ''}>{cells}</tr>")
    caption = f"<caption>{_e(t.title)}</caption>" if t.title else ""
    return (
        f'<div class="scroll"><table class="plain">{caption}<thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def parts_html(parts: Iterable[Part]) -> list[str]:
    out: list[str] = []
    items: list[str] = []
    for part in parts:
        if isinstance(part, Line) and part.style == "item":
            items.append(_line(part))
            continue
        if items:
            out.append(f"<ul>{''.join(items)}</ul>")
            items = []
        out.append(_table(part) if isinstance(part, Table) else _line(part))
    if items:
        out.append(f"<ul>{''.join(items)}</ul>")
    return out


def section_html(s: Section) -> str:
    return (
        f'<section id="s-{_e(s.name)}"><h2>{_e(s.title)}</h2>{"".join(parts_html(s.parts))}'
        "</section>"
    )


def _header(title: str, lines: list[str]) -> str:
    rest = "".join(f"<p>{_e(x)}</p>" for x in lines)
    return f'<header id="run"><h1>{_e(title)}</h1><div class="dim">{rest}</div></header>'


def _banner(alerts: list[tuple[str, str, str | None]]) -> str:
    """What to look at first: (style, text, deep link or None) — the non-finite origin, the
    first divergence, failed checks. Empty when there is nothing wrong."""
    if not alerts:
        return ""
    items = []
    for style, text, href in alerts:
        body = _e(text)
        if href is not None:
            body = f'<a href="{href}">{body}</a>'
        items.append(f'<li class="{style}">{body}</li>')
    return f'<section id="banner" role="alert"><ul>{"".join(items)}</ul></section>'


def _pictures(pictures: Sequence[EmbeddedPicture]) -> str:
    if not pictures:
        return ""
    figs = []
    for p in pictures:
        src = f"data:{p.mime};base64," + base64.b64encode(p.data).decode("ascii")
        notes = "".join(f'<p class="note">note: {_e(n)}</p>' for n in p.notes)
        cmd = f'<p class="dim"><code>{_e(p.command)}</code></p>' if p.command else ""
        figs.append(
            f'<figure><img src="{src}" width="{p.width}" height="{p.height}" '
            f'alt="{_e(p.title)}"><figcaption>{_e(p.title)}{cmd}{notes}</figcaption></figure>'
        )
    return f'<section id="pictures"><h2>pictures</h2>{"".join(figs)}</section>'


# ---------------------------------------------------------------- the per-call table


@dataclass(frozen=True, slots=True)
class Column:
    """A column of the per-call table: its header, the key the script sorts by (resolved in
    the JSON: report.js `value`), and its cell text per tensor row of one call."""

    header: str
    key: str
    cells: Callable[[Any], list[str]]
    raw: bool = False  # the cells are HTML already (the histograms' SVG)


def _stack(values: list[str], raw: bool) -> str:
    texts = values if raw else [_e(v) for v in values]
    if len(texts) <= 1:
        return texts[0] if texts else ""
    return "".join(f"<div>{v}</div>" for v in texts)


def _row(index: int, rec: LayerCall | DiffCall, columns: list[Column], flags: list[str]) -> str:
    """One call's row: `data-i` indexes the JSON's calls (the script's sort keys and detail),
    `data-layer`/`data-call` are what a deep link names."""
    cells = []
    for col in columns:
        kind = " class=num" if col.header in RIGHT else " class=hist" if col.raw else ""
        cells.append(f"<td{kind}>{_stack(col.cells(rec), col.raw)}</td>")
    klass = f' class="{" ".join(flags)}"' if flags else ""
    return (
        f'<tr id="c{index}" data-i="{index}" data-layer="{_e(rec.name)}" data-call="{rec.call}" '
        f'data-type="{_e(rec.type)}"{klass}>{"".join(cells)}</tr>'
    )


def _calls_table(columns: list[Column], body: list[str], caption: str) -> str:
    head = "".join(
        f'<th scope="col" data-key="{c.key}"{" class=num" if c.header in RIGHT else ""}>'
        f"{_e(c.header)}</th>"
        for c in columns
    )
    return (
        f'<div class="scroll calls"><table id="calls"><caption>{_e(caption)}</caption>'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"
    )


def _outs(c: LayerCall, f: Callable[[TensorStats], str]) -> list[str]:
    return [f(t) for t in c.outputs] if c.outputs else [c.error or DASH]


def _grad(c: LayerCall, t: TensorStats) -> TensorStats | None:
    return next((g for g in c.grad_outputs or [] if g.path == t.path), None)


def _grad_num(attr: str) -> Callable[[LayerCall], list[str]]:
    def cells(c: LayerCall) -> list[str]:
        def one(t: TensorStats) -> str:
            g = _grad(c, t)
            return rows.grad_stat(getattr(g, attr) if g else None, g)

        return _outs(c, one)

    return cells


def _nonfinite(c: LayerCall) -> list[str]:
    tensors = [
        *(("out", t) for t in c.outputs),
        *(("grad_out", g) for g in c.grad_outputs or []),
        *(("grad_in", g) for g in (c.grad_inputs or [])[:1]),
    ]
    return [rows.nonfinite_cell(*tensors, call=c)]


_DECLARED = {s.name: s for s in TENSOR_STATS}


def app_element() -> str:
    """The element report.js builds a layers page's views in, carrying the declared statistics
    as it shows a tensor's details (`data-stats`: each statistic's JSON key, label and format,
    counts last)."""
    shown = sorted(TENSOR_STATS, key=lambda s: s.count)
    stats = json.dumps(
        [[s.name, s.label or s.name, s.format] for s in shown], separators=(",", ":")
    )
    return f'<div id="app" data-stats="{_e(stats)}"></div>'


def _stat(s: Stat) -> Column:
    """A declared statistic's column (rows.SHOWN_STATS): its header, sorted by its JSON key."""
    fmt = rows.FORMATS[s.format]
    header = s.header or s.name
    return Column(header, f"out.{s.name}", lambda c: _outs(c, lambda t: fmt(getattr(t, s.name))))


def _layer_columns(report: Report) -> list[Column]:
    head = [
        Column("layer", "name", lambda c: [c.name]),
        Column("type", "type", lambda c: [c.type]),
        Column("call", "call", lambda c: [str(c.call)]),
    ]
    output = Column("output", "out.numel", lambda c: _outs(c, lambda t: tensor_label(t, "out")))
    flags = Column("nan/inf", "nonfinite", _nonfinite)
    if report.backward is not None:
        grad_in = Column(
            "grad_in norm",
            "gin.norm",
            lambda c: [
                rows.grad_stat(c.grad_inputs[0].norm, c.grad_inputs[0]) if c.grad_inputs else DASH
            ],
        )
        cols = [
            *head,
            output,
            _stat(_DECLARED["mean"]),
            _stat(_DECLARED["std"]),
            Column("grad_out norm", "gout.norm", _grad_num("norm")),
            Column("grad_out mean", "gout.mean", _grad_num("mean")),
            Column("grad_out std", "gout.std", _grad_num("std")),
            grad_in,
            flags,
        ]
    else:
        cols = [
            *head,
            Column("input", "in.numel", lambda c: [rows.input_label(c)]),
            output,
            *[_stat(s) for s in rows.SHOWN_STATS],
            flags,
        ]
    if any(c.profile is not None for c in report.layers):
        cols.append(
            Column(
                "total ms",
                "prof.forward_ms",
                lambda c: [f"{c.profile.forward_ms:.3f}" if c.profile else DASH],
            )
        )
    if rows.has_hist(report):
        cols.append(
            Column("hist", "", lambda c: [_spark_svg(t.hist) for t in c.outputs] or [DASH], True)
        )
    return cols


def _layer_flags(report: Report) -> Callable[[LayerCall], list[str]]:
    origins = {(o.layer, o.call) for o in report.nonfinite_origins}

    def flags(c: LayerCall) -> list[str]:
        tensors = [*c.inputs, *c.outputs, *(c.grad_outputs or []), *(c.grad_inputs or [])]
        out = ["bad"] if any(t.nonfinite for t in tensors) or c.error else []
        if (c.name, c.call) in origins:
            out.append("origin")
        return out

    return flags


def _spark_svg(hist: dict[str, list[float]] | None) -> str:
    """A histogram as a tiny inline SVG (bar heights relative to the largest bin)."""
    if not hist or not hist.get("counts"):
        return DASH
    counts = hist["counts"]
    top = max(counts) or 1
    w = 4
    bars = "".join(
        f'<rect x="{i * w}" y="{16 - h:.1f}" width="{w - 0.3:.1f}" height="{h:.1f}"/>'
        for i, c in enumerate(counts)
        if (h := 16 * c / top) > 0
    )
    return (
        f'<svg class="spark" viewBox="0 0 {len(counts) * w} 16" width="{len(counts) * w}" '
        f'height="16" aria-hidden="true">{bars}</svg>'
    )


def report_html(report: Report, pictures: Sequence[EmbeddedPicture] = ()) -> str:
    """inspect, grads, check and folder runs (and a saved report): one page."""
    columns = _layer_columns(report)
    flags = _layer_flags(report)
    body = [_row(i, c, columns, flags(c)) for i, c in enumerate(report.layers)]
    sections = rows.report_sections(report)
    if report.command == "check":
        checks = [s for s in sections if s.name == "checks"]
        sections = checks + [s for s in sections if s.name != "checks"]
    m = report.model
    title = f"hookcli {report.command} {m.spec}"
    out = [
        _header(title, rows.header_lines(report)),
        _banner(report_alerts(report)),
        app_element(),
    ]
    for s in sections:
        if s.name == "header":
            continue
        if s.name == "calls":
            out.append(_calls_table(columns, body, rows.calls_title(report)))
            out += [_table(t) for t in s.tables()[1:]]  # parameter gradients
        else:
            out.append(section_html(s))
    out.append(_pictures(pictures))
    return page(title, "layers", out, report.to_dict())


def report_budget(report: Report, pictures: Sequence[EmbeddedPicture]) -> tuple[str, str]:
    """What makes a layers report's page large, and what makes it smaller."""
    what = f"{len(report.layers)} layer calls" + (f", {len(pictures)} pictures" if pictures else "")
    advice = "select fewer layers (-l, --depth)"
    if rows.has_hist(report):
        advice += ", drop --hist"
    if pictures:
        advice += ", embed fewer pictures"
    return what, advice


def report_alerts(report: Report) -> list[tuple[str, str, str | None]]:
    """The banner's lines; a link only to a call that is a row (an origin "after" the last
    call, in the model's output, has none)."""
    rows = {(c.name, c.call) for c in report.layers}

    def link(layer: str | None, call: int | None) -> str | None:
        if layer is None or call is None or (layer, call) not in rows:
            return None
        return _link(layer, call)

    alerts: list[tuple[str, str, str | None]] = [
        ("bad", f"NaN/Inf first appeared — {o.describe()}", link(o.layer, o.call))
        for o in report.nonfinite_origins
    ]
    for c in report.checks:
        if c.passed:
            continue
        href = link(c.first.layer, c.first.call) if c.first is not None else None
        alerts.append(("bad", f"check failed: {c.rule}: {c.message}", href))
    if report.interrupted:
        alerts.append(("note", "interrupted: the report covers the images seen so far", None))
    return alerts


# ---------------------------------------------------------------- diff


def _diff_cells(
    pick: Callable[[DiffCall], list[TensorDiff] | None], f: Callable[[TensorDiff], str]
) -> Callable[[DiffCall], list[str]]:
    def cells(c: DiffCall) -> list[str]:
        ds = pick(c)
        return [f(d) for d in ds] if ds else [DASH]

    return cells


def _b(c: DiffCall) -> list[TensorDiff]:
    return c.b


def _a(c: DiffCall) -> list[TensorDiff] | None:
    return c.a


def _diff_columns(report: DiffReport) -> list[Column]:
    head = [
        Column("layer", "name", lambda c: [c.name]),
        Column("type", "type", lambda c: [diffrows.type_label(c)]),
        Column("call", "call", lambda c: [str(c.call)]),
        Column(
            "output",
            "b.numel",
            _diff_cells(_b, lambda d: f"{d.path.removeprefix('out')} {shape(d.shape)}".strip()),
        ),
    ]
    if report.ref is not None:
        cols = [
            *head,
            Column("rel L2 A", "a.rel_l2", _diff_cells(_a, lambda d: num(d.rel_l2))),
            Column("rel L2 B", "b.rel_l2", _diff_cells(_b, lambda d: num(d.rel_l2))),
            Column("own A", "a.own_rel_l2", _diff_cells(_a, lambda d: num(d.own_rel_l2))),
            Column("own B", "b.own_rel_l2", _diff_cells(_b, lambda d: num(d.own_rel_l2))),
            Column(
                "SQNR A", "a.sqnr_db", _diff_cells(_a, lambda d: diffrows.db(d.sqnr_db, d.rel_l2))
            ),
            Column(
                "SQNR B", "b.sqnr_db", _diff_cells(_b, lambda d: diffrows.db(d.sqnr_db, d.rel_l2))
            ),
        ]
    else:
        cols = [
            *head,
            Column("max|Δ|", "b.max_abs", _diff_cells(_b, lambda d: num(d.max_abs))),
            Column("rel L2", "b.rel_l2", _diff_cells(_b, lambda d: num(d.rel_l2))),
            Column("own L2", "b.own_rel_l2", _diff_cells(_b, lambda d: num(d.own_rel_l2))),
            Column(
                "cosine",
                "b.cosine",
                _diff_cells(_b, lambda d: DASH if d.cosine is None else f"{d.cosine:.6f}"),
            ),
            Column(
                "SQNR dB", "b.sqnr_db", _diff_cells(_b, lambda d: diffrows.db(d.sqnr_db, d.rel_l2))
            ),
            Column("norm Δ", "b.norm_rel", _diff_cells(_b, lambda d: diffrows.signed(d.norm_rel))),
        ]
    cols.append(
        Column(
            "flag",
            "over",
            lambda c: [
                "; ".join(
                    diffrows.diff_flag(d) for d in [*(c.a or []), *c.b] if diffrows.diff_flag(d)
                )
                or DASH
            ],
        )
    )
    if report.isolate:  # each layer fed the reference's input: rel L2 is the own error
        cols = [c for c in cols if not c.header.startswith("own")]
    return cols


def _first_over(report: DiffReport) -> DiffCall | None:
    if report.first_over is None:
        return None
    for c in [*report.calls, *report.outputs]:
        if report.first_over.startswith(f"{c.name} ({c.type}) call {c.call},"):
            return c
    return None


def diff_alerts(report: DiffReport) -> list[tuple[str, str, str | None]]:
    """A diff's banner: the first call past tolerance, linked to its row; a broken rule on
    the next tokens."""
    tokens: list[tuple[str, str, str | None]] = [
        ("bad", f"failed: {why}", None) for why in report.token_failures
    ]
    if report.first_over is None:
        return tokens
    first = _first_over(report)
    href = _link(first.name, first.call) if first is not None else None
    return [("bad", f"first past tolerance: {report.first_over}", href), *tokens]


def diff_html(report: DiffReport) -> str:
    columns = _diff_columns(report)
    first = _first_over(report)
    body = []
    for i, c in enumerate([*report.calls, *report.outputs]):
        cls = []
        if any(d.over or d.nonfinite for d in [*(c.a or []), *c.b]):
            cls.append("bad")
        if c is first:
            cls.append("origin")
        body.append(_row(i, c, columns, cls))
    by_name = {s.name: s for s in diffrows.diff_sections(report)}
    table = by_name["calls"].tables()[0]
    m = report.model
    title = f"hookcli diff {m.spec}"
    out = [
        _header(title, diffrows.diff_header_lines(report)),
        _banner(diff_alerts(report)),
        '<div id="app"></div>',
        _calls_table(columns, body, table.title or ""),
        section_html(by_name["footer"]),
    ]
    return page(title, "diff", out, report.to_dict())


# ---------------------------------------------------------------- any other sections


def sections_html(title: str, sections: list[Section], data: dict[str, Any]) -> str:
    """A page of sections and their data (a run log's series, check over a run log): the
    tables static, the data embedded."""
    head = next((s for s in sections if s.name == "header"), None)
    lines = [x.text for x in head.lines()] if head is not None else []
    out = [_header(title, lines)]
    out += [section_html(s) for s in sections if s is not head]
    return page(title, "sections", out, data)
