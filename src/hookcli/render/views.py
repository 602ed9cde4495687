"""What a report shows in a notebook or at a prompt: `Report.table()` (the CLI's table),
`_repr_html_()` (the HTML report's banner and tables as one fragment) and `to_pandas()`. The
package installs this module as records' views (hookcli/__init__.py): records imports no
renderer, since the renderers import records. No torch.

The fragment asks for nothing (no script, no image, no link that leaves it) and styles only
itself: one `<style>` whose every rule is under the `hookcli-nb` class of its own `<div>`, so a
notebook's page looks as it did around it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hookcli.records import DiffReport, Report
from hookcli.render import Format, diffrows, rows
from hookcli.render.html import diff_alerts, parts_html, report_alerts
from hookcli.render.html import escape_html as _e
from hookcli.render.lens import lens_html, lens_summary
from hookcli.render.parts import Section, Table

# Rows a table shows in the fragment; the rest are counted in a line under it.
MAX_ROWS = 200

_CSS = """
.hookcli-nb { font: 13px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; }
.hookcli-nb .hk-title { font-weight: 700; margin: 0 0 2px; }
.hookcli-nb p { margin: 1px 0; }
.hookcli-nb .dim, .hookcli-nb caption { color: #57606a; text-align: left; }
.hookcli-nb .note { color: #9a6700; }
.hookcli-nb .bad { color: #b42318; }
.hookcli-nb .good { color: #1a7f37; }
.hookcli-nb .hk-banner { margin: 6px 0; padding: 4px 10px; border: 1px solid #b42318;
  border-left-width: 4px; border-radius: 3px; list-style: none; font-weight: 600; }
.hookcli-nb h4 { margin: 10px 0 2px; font-size: 13px; }
.hookcli-nb .scroll { max-height: 480px; overflow: auto; }
.hookcli-nb table { border-collapse: collapse; margin: 4px 0; font-size: 12px; }
.hookcli-nb th, .hookcli-nb td { padding: 1px 8px; border-bottom: 1px solid #d0d7de;
  text-align: left; white-space: nowrap; font-variant-numeric: tabular-nums; }
.hookcli-nb th.num, .hookcli-nb td.num { text-align: right; }
.hookcli-nb tr.bad td { color: #b42318; }
"""


def table(obj: Report | DiffReport, *, color: bool, width: int | None) -> str:
    """The CLI's table of the report (render.formats: the one door)."""
    from hookcli.render.formats import render

    return render(obj, Format.table, color=color, width=width)


def lens_table(obj: Any, *, color: bool, width: int | None) -> str:
    """A lens report's table, as the CLI prints it."""
    from hookcli.render.formats import render

    return str(render(obj, "table", color=color, width=width))


def frame(obj: Report | DiffReport) -> Any:
    from hookcli.render.tabular import frame as tabular_frame

    return tabular_frame(obj)


def _capped(section: Section) -> list[Any]:
    """A section's parts, each table cut at MAX_ROWS rows and a line saying how many more."""
    from hookcli.render.parts import Line

    out: list[Any] = []
    for part in section.parts:
        if isinstance(part, Table) and len(part.rows) > MAX_ROWS:
            more = len(part.rows) - MAX_ROWS
            out.append(dataclasses.replace(part, rows=part.rows[:MAX_ROWS]))
            out.append(
                Line(f"… {more} more rows: report.table() or report.to_pandas() has them", "dim")
            )
        else:
            out.append(part)
    return out


def html(obj: Report | DiffReport) -> str:
    """The banner (NaN/Inf's origin, failed checks, the first call past tolerance) and the
    table's sections, as one self-contained fragment."""
    if isinstance(obj, DiffReport):
        sections, found = diffrows.diff_sections(obj), diff_alerts(obj)
    else:
        sections, found = rows.report_sections(obj), report_alerts(obj)
    alerts = [text for style, text, _ in found if style == "bad"]
    head = next((s for s in sections if s.name == "header"), None)
    out = [f'<div class="hookcli-nb"><style>{_CSS}</style>']
    out.append(f'<p class="hk-title">hookcli {_e(obj.command)} {_e(obj.model.spec)}</p>')
    if head is not None:
        out += [f'<p class="dim">{_e(line.text)}</p>' for line in head.lines()]
    if alerts:
        items = "".join(f'<li class="bad">{_e(a)}</li>' for a in alerts)
        out.append(f'<ul class="hk-banner" role="alert">{items}</ul>')
    for s in sections:
        if s is head or not s.parts:
            continue
        if s.title and s.name != "calls":
            out.append(f"<h4>{_e(s.title)}</h4>")
        out += parts_html(_capped(s))
    out.append("</div>")
    return "\n".join(out)


__all__ = ("frame", "html", "lens_html", "lens_summary", "lens_table", "table")
