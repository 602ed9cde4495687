"""The logit lens as sections (table, markdown, HTML), CSV and a PNG grid: blocks down,
positions across, each cell the block's top-1 token at that position, its probability as the
cell's colour. No torch here."""

from __future__ import annotations

import csv
import io
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hookcli.render.fmt import DASH
from hookcli.render.rows import Line, Row, Section, Table, lines_section, token_lines

if TYPE_CHECKING:
    from PIL import Image

    from hookcli.records import LensCell, LensReport

POSITIONS_SHOWN = 16  # positions a table shows (the last ones); JSON, CSV and PNG have all


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
    word = _token(top.token) if top.token is not None else str(top.index)
    return f"{word} {top.prob:.2f}" if top.prob is not None else f"{word} nan"


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


CELL_W, CELL_H = 88, 22


def lens_png(report: LensReport, sequence: int = 0) -> tuple[Image.Image, dict[str, Any]]:
    """Blocks down, positions across: each cell the top-1 token, its probability as colour
    (viridis-like ramp from dark to yellow); the input's tokens label the columns."""
    from PIL import Image, ImageDraw

    from hookcli.render.images import label_font

    cells = [c for c in report.lens if c.sequence == sequence]
    positions = sorted({c.position for c in cells})
    words = _words(report, sequence)
    font = label_font(12)
    left, top = 110, 40
    width = left + CELL_W * max(1, len(positions)) + 10
    height = top + CELL_H * (len(report.blocks) + 1) + 30
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    draw.text(
        (8, 8),
        f"logit lens: {report.model.spec}, sequence {sequence} (top-1 token, colour = prob)",
        fill="black",
        font=font,
    )
    column = {p: i for i, p in enumerate(positions)}
    for i, p in enumerate(positions):
        word = words[i] if i < len(words) and words[i] is not None else str(p)
        draw.text((left + i * CELL_W + 2, top), _fit(repr(word)), fill="black", font=font)
    row_of = {layer: j for j, layer in enumerate(report.blocks)}
    boxes = []
    for j, layer in enumerate(report.blocks):
        y = top + CELL_H * (j + 1)
        draw.text((4, y + 4), _short(layer, report.blocks), fill="black", font=font)
    for c in cells:
        if c.layer not in row_of or not c.top:
            continue
        x = left + column[c.position] * CELL_W
        y = top + CELL_H * (row_of[c.layer] + 1)
        best = c.top[0]
        prob = best.prob if best.prob is not None else 0.0
        fill = _ramp(prob)
        draw.rectangle([x, y, x + CELL_W - 2, y + CELL_H - 2], fill=fill)
        ink = "black" if prob > 0.6 else "white"
        text = _fit(repr(best.token) if best.token is not None else str(best.index))
        draw.text((x + 3, y + 4), text, fill=ink, font=font)
        box = [x, y, x + CELL_W, y + CELL_H]
        boxes.append({"layer": c.layer, "position": c.position, "box": box})
    meta = {"title": "logit lens", "sequence": sequence, "cells": boxes}
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
