"""The parts every text format lays out: lines, tables and named sections of them (render.rows
builds a report's; table, markdown and HTML lay them out). No torch, no Rich."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Style = Literal["plain", "dim", "note", "heading", "item", "good", "bad"]
"""What a line is: plain text; context (dim); a note (a warning); a heading; an item of the
list above it (a check's failures); a verdict that is good or bad."""


@dataclass(frozen=True, slots=True)
class Line:
    """One line of text. `mark` ("PASS"/"FAIL") is a check's verdict shown before it."""

    text: str
    style: Style = "plain"
    mark: str | None = None


@dataclass(frozen=True, slots=True)
class Row:
    """One table row's cells; `flagged` when it shows something wrong (NaN/Inf, over tol)."""

    cells: list[str]
    flagged: bool = False


@dataclass(slots=True)
class Table:
    """A titled table. `drop`: the columns given up first, in order, when the table does not
    fit (a width-fitting format reads it; others ignore it). `hidden`: columns every format
    that lays out its columns like the table leaves out because they say nothing here
    (predictions of one image: the image column), kept for formats that show them anyway."""

    title: str | None
    headers: list[str]
    rows: list[Row] = field(default_factory=list)
    drop: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()

    @property
    def shown(self) -> list[int]:
        """The indices of the columns that are not hidden."""
        return [i for i, h in enumerate(self.headers) if h not in self.hidden]

    def shown_headers(self) -> list[str]:
        return [self.headers[i] for i in self.shown]

    def shown_cells(self, row: Row) -> list[str]:
        return [row.cells[i] for i in self.shown]


Part = Line | Table


@dataclass(slots=True)
class Section:
    """A named part of a report. `name` is stable (formats and tests key on it); `title` is
    what a format that heads its sections calls it."""

    name: str
    title: str
    parts: list[Part] = field(default_factory=list)

    def lines(self) -> list[Line]:
        return [p for p in self.parts if isinstance(p, Line)]

    def tables(self) -> list[Table]:
        return [p for p in self.parts if isinstance(p, Table)]
