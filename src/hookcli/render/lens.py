"""The logit lens as sections (table, markdown, HTML), CSV, a notebook's HTML grid and a PNG:
blocks down, positions across, each cell the block's top-1 token at that position and its
probability (the cell's colour in the grid and the PNG). No torch here."""

from __future__ import annotations

import csv
import io
import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hookcli.render.fmt import DASH
from hookcli.render.rows import Line, Row, Section, Table, lines_section, token_lines

if TYPE_CHECKING:
    from PIL import Image

    from hookcli.records import LensCell, LensReport

POSITIONS_SHOWN = 16  # positions a table shows (the last ones); JSON, CSV and PNG have all
NOTEBOOK_POSITIONS = 64  # positions a notebook's grid shows (the last ones)
NOTEBOOK_SEQUENCES = 16  # sequences a notebook shows a grid of (the first ones)
PNG_SEQUENCES = 8  # sequences the PNG draws a panel of (the first ones)
COLOUR = "probability of the top-1 token"  # what a cell's colour is, in the grid and the PNG


def prob_text(p: float | None) -> str:
    """A probability readable at any size: 3 significant digits (0.512, 0.0213, 0.00347),
    scientific below 1e-3 (4.17e-05); 0 as 0. JSON and CSV keep the whole float."""
    if p is None or math.isnan(p):
        return "nan"
    if p == 0:
        return "0"
    if abs(p) < 1e-3:
        return f"{p:.2e}"
    return f"{p:#.3g}"


def lens_header(report: LensReport) -> list[str]:
    m = report.model
    lines = [
        f"lens: {m.spec} ({m.task}) on {report.device}",
        f"weights: {m.weights}",
        f"input: {report.input.description}",
    ]
    if report.input.preprocessing:
        lines.append(f"preprocessing: {report.input.preprocessing}")
    lines += token_lines(report.input.texts or [])
    blocks = report.blocks
    shown = ", ".join(blocks[:2]) + (f", …, {blocks[-1]}" if len(blocks) > 2 else "")
    lines.append(
        f"read: {len(blocks)} blocks ({shown}) through {report.norm or 'no norm'} and "
        f"{report.unembed}"
    )
    if report.applied:
        lines.append("as the model does: " + "; ".join(report.applied))
    if report.last_vs_logits is not None:
        same = "equal" if report.last_vs_logits == 0 else f"max |diff| {report.last_vs_logits:.3g}"
        lines.append(f"last block's lens vs the model's logits: {same}")
    return lines


def _short(layer: str, blocks: Sequence[str]) -> str:
    """model.layers.11 → layers.11 (the blocks' common prefix shortened)."""
    parts = layer.split(".")
    return ".".join(parts[-2:]) if len(parts) > 2 else layer


def _token(t: str | None) -> str:
    return repr(t) if t is not None else DASH


def _words(report: LensReport, sequence: int) -> list[str | None]:
    """The tokens at the positions the lens read of a sequence, in order."""
    tokens = report.tokens or []
    return list(tokens[sequence]) if sequence < len(tokens) else []


def _cell(top: Any) -> str:
    return f"{_word(top)} {prob_text(top.prob)}"


def lens_sections(report: LensReport) -> list[Section]:
    sections = [lines_section("header", "run", lens_header(report), "dim")]
    by_seq: dict[int, list[LensCell]] = {}
    for cell in report.lens:
        by_seq.setdefault(cell.sequence, []).append(cell)
    for seq, cells in by_seq.items():
        positions = sorted({c.position for c in cells})
        shown = positions[-POSITIONS_SHOWN:]
        words = _words(report, seq)
        real = positions  # the real positions, in order: the i-th holds the i-th token
        label = {p: (words[i] if i < len(words) else None) for i, p in enumerate(real)}
        headers = ["block"] + [
            f"{p} {_token(label[p])}" if label.get(p) is not None else str(p) for p in shown
        ]
        grid = {(c.layer, c.position): c for c in cells}
        rows = []
        for layer in report.blocks:
            row = [_short(layer, report.blocks)]
            for p in shown:
                c = grid.get((layer, p))
                row.append(_cell(c.top[0]) if c is not None and c.top else DASH)
            rows.append(Row(row))
        title = f"top-1 token per block and position, sequence {seq}"
        section = Section(f"lens_{seq}", f"lens, sequence {seq}", [Table(title, headers, rows)])
        if len(positions) > len(shown):
            section.parts.append(
                Line(
                    f"the last {len(shown)} of {len(positions)} positions shown; -f json, csv "
                    "or -o lens.png have all",
                    "dim",
                )
            )
        sections.append(section)
    sections.append(lines_section("notes", "notes", [f"note: {n}" for n in report.notes], "note"))
    return [s for s in sections if s.parts]


def lens_csv(report: LensReport) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["layer", "sequence", "position", "rank", "index", "token", "prob"])
    for c in report.lens:
        for rank, t in enumerate(c.top, 1):
            prob = "" if t.prob is None else repr(t.prob)
            w.writerow([c.layer, c.sequence, c.position, rank, t.index, t.token or "", prob])
    return buf.getvalue()


def lens_summary(report: LensReport) -> str:
    """One line: what ran, how much was read, and the last block's top-1 token at sequence 0's
    last position (the model's own next token)."""
    sequences = sorted({c.sequence for c in report.lens})
    positions = max((c.position + 1 for c in report.lens), default=0)
    parts = [
        f"{len(report.blocks)} blocks",
        f"{len(sequences)} sequence{'' if len(sequences) == 1 else 's'}",
        f"up to {positions} positions",
        f"top-{max((len(c.top) for c in report.lens), default=0)}",
    ]
    last = [c for c in report.lens if report.blocks and c.layer == report.blocks[-1] and c.top]
    if last:
        end = max((c for c in last if c.sequence == last[0].sequence), key=lambda c: c.position)
        parts.append(f"next token {_fit(_word(end.top[0]), 40)} {prob_text(end.top[0].prob)}")
    if report.notes:
        n = len(report.notes)
        parts.append(f"{n} note{'' if n == 1 else 's'}")
    spec = _fit(report.model.spec, 80)
    return f"<LensReport {spec} on {report.device}: {', '.join(parts)}>"


def _word(top: Any) -> str:
    return _token(top.token) if top.token is not None else str(top.index)


# ---------------------------------------------------------------- the notebook's grid

_NB_CSS = """
.hookcli-lens { font: 13px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; }
.hookcli-lens .hk-title { font-weight: 700; margin: 0 0 2px; }
.hookcli-lens p { margin: 1px 0; }
.hookcli-lens .dim, .hookcli-lens caption { color: #57606a; text-align: left; }
.hookcli-lens .note { color: #9a6700; }
.hookcli-lens h4 { margin: 10px 0 2px; font-size: 13px; }
.hookcli-lens .scroll { max-height: 480px; overflow: auto; }
.hookcli-lens table { border-collapse: collapse; margin: 4px 0; font-size: 12px; }
.hookcli-lens th, .hookcli-lens td { padding: 1px 6px; border: 1px solid #fff;
  text-align: left; white-space: nowrap; font-variant-numeric: tabular-nums; }
.hookcli-lens thead th { vertical-align: bottom; font-weight: 600; }
.hookcli-lens td span { display: block; font-size: 11px; }
.hookcli-lens .hk-bar { display: inline-block; width: 160px; height: 10px;
  vertical-align: middle; margin: 0 4px; background: linear-gradient(to right, STOPS); }
"""


def _css_rgb(rgb: tuple[int, int, int]) -> str:
    return f"rgb({rgb[0]},{rgb[1]},{rgb[2]})"


def _ink(rgb: tuple[int, int, int]) -> str:
    """Black on a light fill, white on a dark one."""
    r, g, b = rgb
    return "#000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#fff"


def lens_html(report: LensReport) -> str:
    """The lens as one self-contained HTML fragment for a notebook (`_repr_html_`): the header,
    then per sequence a grid of blocks (rows) by positions (columns, headed by the sequence's
    tokens), each cell the top-1 token and its probability, shaded by that probability. Every
    token is text, escaped; the fragment asks for nothing (no script, image or link) and its
    one style sheet is scoped to its own `<div>`."""
    from hookcli.render.html import escape_html as e

    stops = ", ".join(_css_rgb(_ramp(k / 4)) for k in range(5))
    out = [f'<div class="hookcli-lens"><style>{_NB_CSS.replace("STOPS", stops)}</style>']
    out.append(f'<p class="hk-title">hookcli lens {e(report.model.spec)}</p>')
    out += [f'<p class="dim">{e(line)}</p>' for line in lens_header(report)]
    out.append(f'<p class="dim">shade: {COLOUR}, 0<span class="hk-bar"></span>1</p>')
    by_seq: dict[int, list[LensCell]] = {}
    for cell in report.lens:
        by_seq.setdefault(cell.sequence, []).append(cell)
    for seq in sorted(by_seq)[:NOTEBOOK_SEQUENCES]:
        out += _grid_html(report, seq, by_seq[seq])
    if len(by_seq) > NOTEBOOK_SEQUENCES:
        out.append(
            f'<p class="dim">the first {NOTEBOOK_SEQUENCES} of {len(by_seq)} sequences shown; '
            "report.lens has all</p>"
        )
    out += [f'<p class="note">note: {e(n)}</p>' for n in report.notes]
    out.append("</div>")
    return "\n".join(out)


def _grid_html(report: LensReport, seq: int, cells: list[LensCell]) -> list[str]:
    from hookcli.render.html import escape_html as e

    positions = sorted({c.position for c in cells})
    shown = positions[-NOTEBOOK_POSITIONS:]
    words = _words(report, seq)
    label = {p: (words[i] if i < len(words) else None) for i, p in enumerate(positions)}
    grid = {(c.layer, c.position): c for c in cells}
    heads = "".join(
        f'<th title="position {p}: {e(_token(label.get(p)))}">{p}<br>'
        f"{e(_fit(_token(label.get(p)), 16))}</th>"
        for p in shown
    )
    out = [f"<h4>sequence {seq}</h4>", '<div class="scroll"><table>']
    out.append(
        f"<caption>top-1 token and its probability, per block and position, sequence {seq}"
        "</caption>"
    )
    out.append(f"<thead><tr><th>block</th>{heads}</tr></thead><tbody>")
    for layer in report.blocks:
        row = [f'<tr><th title="{e(layer)}">{e(_short(layer, report.blocks))}</th>']
        for p in shown:
            c = grid.get((layer, p))
            if c is None or not c.top:
                row.append(f"<td>{DASH}</td>")
                continue
            best = c.top[0]
            fill = _ramp(best.prob if best.prob is not None and best.prob == best.prob else 0.0)
            tip = ", ".join(f"{_word(t)} {prob_text(t.prob)}" for t in c.top)
            row.append(
                f'<td style="background:{_css_rgb(fill)};color:{_ink(fill)}" title="{e(tip)}">'
                f"{e(_fit(_word(best), 16))}<span>{prob_text(best.prob)}</span></td>"
            )
        out.append("".join(row) + "</tr>")
    out.append("</tbody></table></div>")
    if len(positions) > len(shown):
        out.append(
            f'<p class="dim">the last {len(shown)} of {len(positions)} positions shown; '
            "report.lens has all</p>"
        )
    return out


# ---------------------------------------------------------------- the PNG

CELL_W, CELL_H = 88, 32
LEFT, MARGIN, BAR_W = 110, 8, 256


def lens_png(
    report: LensReport, sequences: Sequence[int] | None = None
) -> tuple[Image.Image, dict[str, Any]]:
    """One panel per sequence (`sequences`, else the first PNG_SEQUENCES of them, a note saying
    how many more), stacked: blocks down, positions across, the sequence's tokens heading the
    columns; each cell the top-1 token and its probability, the probability its colour (a
    dark-blue → teal → yellow ramp), and the colour bar under the panels."""
    from PIL import Image, ImageDraw

    from hookcli.render.images import label_font

    by_seq: dict[int, list[LensCell]] = {}
    for c in report.lens:
        by_seq.setdefault(c.sequence, []).append(c)
    every = sorted(by_seq)
    drawn = list(sequences) if sequences is not None else every[:PNG_SEQUENCES]
    notes = []
    if sequences is None and len(every) > len(drawn):
        notes.append(
            f"the first {len(drawn)} of {len(every)} sequences drawn; -f json or csv has all"
        )
    font, small = label_font(12), label_font(10)
    title = f"logit lens: {_fit(report.model.spec, 80)}: top-1 token per block and position"
    bar_label = f"colour: {COLOUR}"
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    most = max((len({c.position for c in by_seq.get(s, [])}) for s in drawn), default=0)
    texts = [title, bar_label, *(f"note: {n}" for n in notes)]
    width = max(
        LEFT + CELL_W * max(1, most) + MARGIN,
        LEFT + BAR_W + 4 * MARGIN,
        *(int(probe.textlength(t, font=font)) + 2 * MARGIN for t in texts),
    )
    panel_h = 18 + 18 + CELL_H * len(report.blocks) + 14
    height = 30 + panel_h * len(drawn) + 4 + 16 + 14 + 16 + 16 * len(notes) + MARGIN
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    draw.text((MARGIN, MARGIN), title, fill="black", font=font)
    row_of = {layer: j for j, layer in enumerate(report.blocks)}
    panels, boxes = [], []
    y = 30
    for seq in drawn:
        cells = by_seq.get(seq, [])
        positions = sorted({c.position for c in cells})
        words = _words(report, seq)
        draw.text((MARGIN, y), f"sequence {seq}", fill="black", font=font)
        heads = y + 18
        for i, p in enumerate(positions):
            word = words[i] if i < len(words) and words[i] is not None else None
            text = _fit(repr(word)) if word is not None else str(p)
            draw.text((LEFT + i * CELL_W + 2, heads), text, fill="black", font=font)
        rows = heads + 18
        for j, layer in enumerate(report.blocks):
            draw.text(
                (4, rows + CELL_H * j + 9), _short(layer, report.blocks), fill="black", font=font
            )
        column = {p: i for i, p in enumerate(positions)}
        for c in cells:
            if c.layer not in row_of or not c.top:
                continue
            x = LEFT + column[c.position] * CELL_W
            top = rows + CELL_H * row_of[c.layer]
            best = c.top[0]
            prob = best.prob if best.prob is not None and best.prob == best.prob else 0.0
            fill = _ramp(prob)
            draw.rectangle([x, top, x + CELL_W - 2, top + CELL_H - 2], fill=fill)
            ink = _ink(fill)
            draw.text((x + 3, top + 2), _fit(_word(best)), fill=ink, font=font)
            draw.text((x + 3, top + 17), prob_text(best.prob), fill=ink, font=small)
            box = [x, top, x + CELL_W, top + CELL_H]
            boxes.append({"layer": c.layer, "sequence": seq, "position": c.position, "box": box})
        end = rows + CELL_H * len(report.blocks)
        panels.append({"sequence": seq, "box": [0, y, width, end]})
        y += panel_h
    y += 4
    draw.text((LEFT, y), bar_label, fill="black", font=font)
    y += 16
    for k in range(BAR_W):
        draw.line([(LEFT + k, y), (LEFT + k, y + 11)], fill=_ramp(k / (BAR_W - 1)))
    bar = [LEFT, y, LEFT + BAR_W, y + 12]
    y += 14
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        x = LEFT + round(tick * (BAR_W - 1))
        draw.line([(x, y - 2), (x, y + 1)], fill="black")
        text = f"{tick:g}"
        draw.text(
            (x - probe.textlength(text, font=small) / 2, y + 2), text, fill="black", font=small
        )
    y += 16
    for note in notes:
        draw.text((MARGIN, y), f"note: {note}", fill="black", font=font)
        y += 16
    meta = {
        "title": "logit lens",
        "sequences": drawn,
        "sequence_count": len(every),
        "panels": panels,
        "cells": boxes,
        "colorbar": {"box": bar, "label": COLOUR, "range": [0.0, 1.0]},
        "notes": notes,
    }
    return img, meta


def _fit(text: str, limit: int = 12) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _ramp(p: float) -> tuple[int, int, int]:
    """A dark-blue → teal → yellow ramp over [0, 1]."""
    p = min(1.0, max(0.0, p))
    stops = [(0.0, (48, 18, 59)), (0.5, (33, 145, 140)), (1.0, (253, 231, 37))]
    for (p0, c0), (p1, c1) in itertools.pairwise(stops):
        if p <= p1:
            f = (p - p0) / (p1 - p0)
            r, g, b = (round(a + (bb - a) * f) for a, bb in zip(c0, c1, strict=True))
            return r, g, b
    return stops[-1][1]
