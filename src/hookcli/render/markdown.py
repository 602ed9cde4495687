"""Markdown: the report's sections (render/rows.py) as GitHub-flavoured Markdown.

The same sections the terminal table prints, so every section reaches Markdown: the header,
the per-call table (and parameter gradients), the summary, NaN/Inf origins, input gradients,
predictions, notes, profile, ablation and checks. Text goes through text.markdown: control
characters escaped and `|` kept from ending a cell.
"""

from __future__ import annotations

from collections.abc import Iterable

from hookcli.records import DiffReport, Report
from hookcli.render import diffrows, rows
from hookcli.render.fmt import DASH
from hookcli.render.rows import RIGHT, Line, Part, Section, Table
from hookcli.text import markdown as md

# Sections printed as one block of lines under the per-call table.
_FOOTER = ("summary", "origins", "input_grads")


def md_table(headers: list[str], cells: Iterable[list[str]]) -> list[str]:
    """A Markdown table (after a blank line); numeric columns aligned right."""
    out = [
        "",
        "| " + " | ".join(md(h) for h in headers) + " |",  # `max|Δ|`: its bar escaped
        "|" + "|".join("---:" if h in RIGHT else "---" for h in headers) + "|",
    ]
    out += ["| " + " | ".join(md(c) for c in row) + " |" for row in cells]
    return out


def _table(t: Table, *, titled: bool = True) -> list[str]:
    out = ["", f"{md(t.title)}:"] if titled and t.title else []
    return out + md_table(t.shown_headers(), (t.shown_cells(r) for r in t.rows))


def _line(line: Line) -> str:
    if line.mark is not None:
        return f"**{line.mark}** {md(line.text)}  "
    if line.style == "item":
        return f"- {md(line.text)}"
    if line.style == "heading":
        return f"**{md(line.text)}**  "
    return f"{md(line.text)}  "


def parts_markdown(parts: Iterable[Part]) -> list[str]:
    """Lines as paragraphs (a blank line before each run; list items a list of their own),
    tables titled."""
    out: list[str] = []
    previous: str | None = None  # "line", "item" or None (start, or after a table)
    for part in parts:
        if isinstance(part, Table):
            out += _table(part)
            previous = None
            continue
        kind = "item" if part.style == "item" else "line"
        if kind != previous:
            out.append("")
        out.append(_line(part))
        previous = kind
    return out


def _predictions(section: Section) -> list[str]:
    """Predictions: one table with the image (and its class folder) on every row."""
    tables = section.tables()
    if not tables:  # none detected
        return parts_markdown(section.parts)
    t = tables[0]
    notes = [p.text for p in section.lines()]
    head = f"predictions ({md(notes[0])}):" if notes else "predictions:"
    out = ["", head, "", "| image | # | class | index | prob |", "|---|---:|---|---:|---:|"]
    for r in t.rows:
        image, folder, rank, label, index, p = r.cells
        image = md(image)
        if folder != DASH:
            image += f" ({md(folder)})"
        out.append(f"| {image} | {rank} | {md(label)} | {index} | {p} |")
    return out


def sections_markdown(sections: list[Section]) -> str:
    """Sections of an inspect/grads/check report as Markdown."""
    out: list[str] = []
    previous = ""
    for s in sections:
        if s.name == "header":
            out += [
                f"**{md(line.text)}**  " if i == 0 else f"{md(line.text)}  "
                for i, line in enumerate(s.lines())
            ]
        elif s.name == "calls":
            first, *more = s.tables()
            out += _table(first, titled=False)
            for t in more:
                out += _table(t)
        elif s.name in _FOOTER:
            out += ([] if previous in _FOOTER else [""]) + [f"{md(x.text)}  " for x in s.lines()]
        elif s.name == "predictions":
            out += _predictions(s)
        elif s.name == "notes":
            out += [f"\n{md(line.text)}" for line in s.lines()]
        else:
            out += parts_markdown(s.parts)
        previous = s.name
    return "\n".join(out) + "\n"


def report_markdown(report: Report) -> str:
    return sections_markdown(rows.report_sections(report))


def checks_markdown(report: Report, *, quiet: bool = False) -> str:
    return sections_markdown(rows.checks_sections(report, quiet=quiet))


def diff_markdown(report: DiffReport) -> str:
    m = report.model
    by_name = {s.name: s for s in diffrows.diff_sections(report)}
    table = by_name["calls"].tables()[0]
    out = [
        md(
            f"**diff** `{m.spec}` on {report.device}: A = {report.a}, B = {report.b}"
            + (f", reference = {report.ref}" if report.ref else " (A is the reference)")
        ),
        "",
        f"input: {md(report.input.description)}; tol {report.tol:g}",
        "",
        *_table(table, titled=False),
        "",
        *(f"{md(line.text)}  " for line in by_name["footer"].lines()),
    ]
    return "\n".join(out) + "\n"
