"""Rich tables for people: the report's sections (render/rows.py) laid out for a terminal.

One row per (layer call, output tensor): structured outputs get one row per tensor, labelled
by path. NaN/Inf are flagged in red; under NO_COLOR or when not a terminal no escape codes
are written and boxes are plain ASCII. Tables fit the width (Grid). What the sections say is
built in render/rows.py, which Markdown reads too; this module decides only how they look.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Sequence

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from hookcli.records import DiffReport, LayersReport, ModelEntry, Prediction, Report, SavedFile
from hookcli.render import diffrows, listing, rows
from hookcli.render.markdown import diff_markdown, report_markdown
from hookcli.render.rows import (
    DROP,
    GRAD_HEADERS,
    HEADERS,
    PARAM_HEADERS,
    RIGHT,
    SAVED_HEADERS,
    Line,
    Section,
    grad_rows,
    header_lines,
    layer_rows,
    param_rows,
)
from hookcli.text import escape

__all__ = [
    "DROP",
    "GRAD_HEADERS",
    "HEADERS",
    "PARAM_HEADERS",
    "RIGHT",
    "SAVED_HEADERS",
    "Grid",
    "checks_table",
    "diff_markdown",
    "diff_table",
    "grad_rows",
    "header_lines",
    "layer_rows",
    "layers_table",
    "models_table",
    "param_rows",
    "predictions_table",
    "render_sections",
    "report_markdown",
    "report_table",
    "saved_table",
]


def _t(text: str, style: str = "") -> Text:
    """A line or cell for Rich: user text escaped (text.escape), never read as markup."""
    return Text(escape(text), style=style)


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


_NAME_MIN = 16  # the first column (a layer or file name) may fold down to this width, or
# to its longest piece between dots where that is wider, up to _PIECE_MAX: other columns give
# way before a piece is cut inside (a piece wider than that is: the last resort)
_PIECE_MAX = 32
_BREAKS = re.compile(r"[^.\s]*[.\s]+|[^.\s]+")  # a name's pieces, each up to a break after it


def fold_name(text: str, width: int) -> str:
    """A name cell in lines of at most `width` cells, each line broken right after a `.` (or
    at a space): `model.layers.0.self_attn.` then `q_proj`, never `model.layers.0.self_at`
    then `tn.q_proj`. Only a piece with no `.` in `width` cells is cut inside (the last
    resort). A line's leading spaces (`layers`' tree indent) start its continuation lines
    too, as far as they leave room for its longest piece (8 cells at least)."""
    width = max(width, 1)
    out: list[str] = []
    for line in text.split("\n"):
        if cell_len(line) <= width:
            out.append(line)
            continue
        body = line.lstrip(" ")
        keep = max(8, _longest_piece(body))  # the indent gives way before a piece is cut
        indent = " " * min(len(line) - len(body), max(width - keep, 0))
        room = width - len(indent)
        current = ""
        for found in _BREAKS.findall(body):
            piece = str(found)
            if current and cell_len((current + piece).rstrip()) > room:
                out.append(indent + current.rstrip())
                current = ""
            while cell_len(piece.rstrip()) > room:
                head = _cells(piece, room)
                out.append(indent + head)
                piece = piece[len(head) :]
            current += piece
        if current.strip():
            out.append(indent + current.rstrip())
    return "\n".join(out)


def _longest_piece(text: str) -> int:
    """The widest piece of a name that fold_name keeps on one line (its pieces between dots
    and spaces), leading spaces left out."""
    return max(
        (cell_len(str(p).rstrip()) for line in text.split("\n") for p in _BREAKS.findall(line)),
        default=0,
    )


def _cells(text: str, width: int) -> str:
    """The longest start of `text` of at most `width` cells (one character at least)."""
    n = 0
    for i, ch in enumerate(text):
        n += cell_len(ch)
        if n > width:
            return text[: max(i, 1)]
    return text


class Grid:
    """A table that fits the terminal without ever splitting a number across lines.

    Every column but the first (a name, which may fold) keeps its cells whole. When the
    table is wider than the console, columns are given up in the table's DROP order, and a
    line says which; when even that does not fit, each row becomes a block of `header value`
    pairs (a vertical layout)."""

    def __init__(
        self, title: str | None, headers: Sequence[str], color: bool, drop: Sequence[str] = ()
    ) -> None:
        # escaped (text.escape: control characters shown), never read as Rich markup: a lens
        # header holds a token's text (`'[/INST]'`)
        self.title = escape(title) if title else title
        self.headers = [escape(h) for h in headers]
        self.color = color
        self.drop = [h for h in drop if h in self.headers]
        self.rows: list[tuple[list[str], str | None]] = []
        self._floor = _NAME_MIN  # the width the names fold down to (set as it is drawn)

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
        need = sum(min(widths[i], self._floor) if i == 0 else widths[i] for i in keep)
        return need + 3 * (len(keep) - 1) <= width

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        pieces = (_longest_piece(cells[0]) for cells, _ in self.rows if cells)
        self._floor = max(_NAME_MIN, min(max(pieces, default=0), _PIECE_MAX))
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
        # names break after their dots, not where Rich's folding would cut them
        limit = max(self._floor, width - sum(widths[i] for i in keep[1:]) - 3 * (len(keep) - 1))
        rows = [([fold_name(cells[0], limit), *cells[1:]], style) for cells, style in self.rows]
        lines = self._laid_out(headers, keep, widths, width, wrap, rows)
        yield from (
            lines if lines is not None else [self._table(headers, keep, widths, width, wrap, rows)]
        )
        if hidden:
            note = f"(columns left out at {width} characters: {', '.join(hidden)}; widen the "
            note += "terminal, set COLUMNS, or use -f json)"
            yield _t(note, style="dim" if self.color else "")

    def _laid_out(  # noqa: PLR0917 (rows positional: tests stand in a `lambda *a`)
        self,
        headers: list[str],
        keep: list[int],
        widths: list[int],
        width: int,
        wrap: bool,
        rows: Sequence[tuple[list[str], str | None]] | None = None,
    ) -> list[Text] | None:
        """The table `_table` draws, line by line, where no cell needs folding: the same text
        (tests/render/test_render_width.py compares them), ten times faster than Rich's Table, which
        measures and wraps every cell (0.35 s for inspect's 158 rows on resnet50). `rows`:
        the rows with their names folded at their dots (fold_name; default: as added). None:
        a name still too wide, or the title, must fold; `_table` draws those."""
        rows = self.rows if rows is None else rows
        rest = sum(widths[i] for i in keep[1:]) + 3 * (len(keep) - 1)
        labels = [h.replace(" ", "\n") if wrap else h for h in headers]
        body = [[cells[i] for i in keep] for cells, _ in rows]
        name_width = max(
            cell_len(line) for c in (labels[0], *(r[0] for r in body)) for line in c.split("\n")
        )
        if name_width > max(self._floor, width - rest):
            return None  # a name folds: Rich's wrapping decides where
        cols = [name_width, *(widths[i] for i in keep[1:])]
        total = sum(cols) + 3 * (len(cols) - 1)
        if self.title and cell_len(self.title) > total:  # Rich wraps it (cells, headers and
            return None  # titles are escaped: no tab or newline is left in them)
        right = [h in RIGHT for h in headers]
        bar = "   " if self.color else " | "

        def lines_of(row: list[str], style: str, bottom: bool = False) -> list[Text]:
            split = [c.split("\n") for c in row]
            height = max(len(c) for c in split)
            if bottom:  # Rich sets a header's lines at the bottom of its row
                split = [[""] * (height - len(c)) + c for c in split]
            out = []
            for k in range(height):
                parts = []
                for n, c in enumerate(split):
                    piece = c[k] if k < len(c) else ""
                    piece = piece.rstrip() if right[n] else piece  # as Rich justifies right
                    pad = " " * (cols[n] - cell_len(piece))
                    parts.append(pad + piece if right[n] else piece + pad)
                out.append(Text(bar.join(parts), style=style))
            return out

        out = [Text(self.title)] if self.title else []
        out += lines_of(labels, "bold" if self.color else "", bottom=True)
        if self.color:
            out.append(Text("\u2500" * total))
        else:
            out.append(Text("-+-".join("-" * w for w in cols)))
        for (_, style), row in zip(rows, body, strict=True):
            out += lines_of(row, (style or "") if self.color else "")
        return out

    def _table(  # noqa: PLR0917
        self,
        headers: list[str],
        keep: list[int],
        widths: list[int],
        width: int,
        wrap: bool,
        rows: Sequence[tuple[list[str], str | None]] | None = None,
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
            right = h in RIGHT
            label = h.replace(" ", "\n") if wrap else h
            if n == 0:  # the name: folds when it must
                t.add_column(Text(label), overflow="fold", max_width=max(self._floor, width - rest))
            else:
                t.add_column(
                    Text(label),
                    justify="right" if right else "left",
                    no_wrap=True,
                    min_width=widths[i],
                )
        for cells, style in self.rows if rows is None else rows:
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
                name = fold_name(cells[0], width)
                yield Text(name, style=(style or "bold") if self.color else "")
            line = ""
            for pair in pairs:
                if line and cell_len(line) + 2 + cell_len(pair) > width:
                    yield _t(line, style=look)
                    line = ""
                line += "  " + pair
            if line:
                yield _t(line, style=look)


# A line's meaning (rows.Style) as a Rich style, in colour; a check's mark has its own.
_STYLES = {
    "plain": "",
    "dim": "dim",
    "note": "yellow",
    "heading": "bold",
    "item": "",
    "good": "bold green",
    "bad": "bold red",
}
_MARK_STYLES = {"good": "green", "bad": "bold red"}


def _line(line: Line, color: bool) -> Text:
    if line.mark is not None:
        text = _t(f"{line.mark} ", style=_MARK_STYLES.get(line.style, "") if color else "")
        text.append(escape(line.text))
        return text
    text_ = f"    {line.text}" if line.style == "item" else line.text
    return _t(text_, style=_STYLES[line.style] if color else "")


def grid(table: rows.Table, color: bool) -> Grid:
    """A section's table as a Grid: its shown columns, flagged rows red in colour."""
    g = Grid(table.title, table.shown_headers(), color, table.drop)
    for row in table.rows:
        g.add_row(*table.shown_cells(row), style="red" if (row.flagged and color) else None)
    return g


def render_sections(sections: Iterable[Section], *, color: bool, width: int | None) -> str:
    """Sections as the terminal shows them: lines styled, tables fitted to the width."""
    console, buf = _console(color, width)
    for section in sections:
        for part in section.parts:
            if isinstance(part, Line):
                console.print(_line(part, color))
            else:
                console.print(grid(part, color))
    return _text(buf)


def _text(buf: io.StringIO) -> str:
    """The rendered text without Rich's trailing padding."""
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


def report_table(report: Report, *, color: bool, width: int | None) -> str:
    return render_sections(rows.report_sections(report), color=color, width=width)


def checks_table(report: Report, *, color: bool, width: int | None, quiet: bool) -> str:
    """check: the pass/fail list (with --quiet, only failures: nothing when all pass)."""
    out = render_sections(rows.checks_sections(report, quiet=quiet), color=color, width=width)
    return "" if out.strip() == "" else out


def predictions_table(preds: list[Prediction], color: bool) -> Grid:
    return grid(rows.predictions_table(preds), color)


def layers_table(report: LayersReport, *, color: bool, width: int | None) -> str:
    return render_sections(listing.layers_sections(report), color=color, width=width)


def models_table(entries: list[ModelEntry], *, color: bool, width: int | None) -> str:
    return render_sections(listing.models_sections(entries), color=color, width=width)


def saved_table(saved: SavedFile, *, color: bool, width: int | None) -> str:
    return render_sections(listing.saved_sections(saved), color=color, width=width)


def diff_table(report: DiffReport, *, color: bool, width: int | None) -> str:
    return render_sections(diffrows.diff_sections(report), color=color, width=width)
