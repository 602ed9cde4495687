"""One door for rendering: any report hookcli makes, in any format, by `render(obj, fmt)`.

The CLI (`-f`/`-o FILE.suffix`) and the Python API (`hookcli.formatted`, `hookcli.html`) both come
through here, so a report looks the same whichever asked for it: an inspect/grads/check/folder
Report (or a saved one read back), a DiffReport, a LensReport. Each format's renderer is
imported when it is asked for (Rich only for the table). No torch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from hookcli.records import CalibReport, DiffReport, LensReport, Report
from hookcli.render import TRACKERS, Format
from hookcli.render.html import EmbeddedPicture

Renderable = Report | DiffReport | LensReport | CalibReport


def render(  # noqa: PLR0911 (one return per kind and format)
    obj: Renderable,
    fmt: Format | str = Format.table,
    *,
    color: bool = False,
    width: int | None = None,
    pictures: Sequence[EmbeddedPicture] = (),
    checks_only: bool = False,
    quiet: bool = False,
) -> str:
    """`obj` as `fmt` (table, json, csv, markdown, html). `pictures` are embedded in a
    Report's HTML page; `checks_only` (check's table and Markdown) shows its checks alone,
    `quiet` only those that failed; `color` and `width` are the table's."""
    fmt = Format(fmt)
    if fmt in TRACKERS:
        from hookcli.errors import UsageError

        raise UsageError(
            f"{fmt.value} takes a training log's series, not a report.",
            f"hookcli report run.jsonl -f {fmt.value} -o runs/NAME",
        )
    if fmt == Format.parquet:
        from hookcli.errors import UsageError

        raise UsageError(
            "Parquet is a binary file, not text.",
            "write it with -o FILE.parquet, or report.to_pandas().to_parquet(path).",
        )
    if isinstance(obj, DiffReport):
        return _diff(obj, fmt, color=color, width=width)
    if isinstance(obj, LensReport):
        return _lens(obj, fmt, color=color, width=width)
    if isinstance(obj, CalibReport):
        return _calib(obj, fmt, color=color, width=width)
    if fmt == Format.html:
        from hookcli.render.html import report_html

        return report_html(obj, pictures)
    if fmt == Format.json:
        from hookcli.render.json import report_json

        return report_json(obj)
    if fmt == Format.csv:
        from hookcli.render.csv import report_csv

        return report_csv(obj)
    if fmt == Format.markdown:  # the same sections as the table
        from hookcli.render.markdown import checks_markdown, report_markdown

        return checks_markdown(obj, quiet=quiet) if checks_only else report_markdown(obj)
    from hookcli.render.table import checks_table, report_table

    if checks_only:
        return checks_table(obj, color=color, width=width, quiet=quiet)
    return report_table(obj, color=color, width=width)


def parquet(obj: Renderable) -> bytes:
    """A layers or diff report's rows (render.tabular) as a Parquet file's bytes."""
    if not isinstance(obj, Report | DiffReport):
        from hookcli.errors import UsageError

        raise UsageError(
            f"a {type(obj).__name__}'s output has no Parquet form.", "write -f csv or -f json."
        )
    from hookcli.render.tabular import parquet as tabular_parquet

    return tabular_parquet(obj)


def budget(obj: Renderable, pictures: Sequence[EmbeddedPicture] = ()) -> tuple[str, str] | None:
    """What makes `obj`'s HTML page large and what makes it smaller (for the note a page
    over its size budget gets); None: a page with no such budget."""
    if isinstance(obj, DiffReport):
        return f"{len(obj.calls)} layer calls", "select fewer layers (-l)"
    if isinstance(obj, LensReport | CalibReport):
        return None
    from hookcli.render.html import report_budget

    return report_budget(obj, pictures)


def _diff(report: DiffReport, fmt: Format, *, color: bool, width: int | None) -> str:
    if fmt == Format.html:
        from hookcli.render.html import diff_html

        return diff_html(report)
    if fmt == Format.json:
        return json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n"
    if fmt == Format.csv:
        from hookcli.render.csv import diff_csv

        return diff_csv(report)
    if fmt == Format.markdown:
        from hookcli.render.markdown import diff_markdown

        return diff_markdown(report)
    from hookcli.render.table import diff_table

    return diff_table(report, color=color, width=width)


def _lens(report: LensReport, fmt: Format, *, color: bool, width: int | None) -> str:
    from hookcli.render import lens

    if fmt == Format.json:
        return json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n"
    if fmt == Format.csv:
        return lens.lens_csv(report)
    sections = lens.lens_sections(report)
    if fmt == Format.html:
        from hookcli.render.html import sections_html

        return sections_html(f"hookcli lens {report.model.spec}", sections, report.to_dict())
    if fmt == Format.markdown:
        from hookcli.render.markdown import sections_markdown

        return sections_markdown(sections)
    from hookcli.render.table import render_sections

    return render_sections(sections, color=color, width=width)


def _calib(report: CalibReport, fmt: Format, *, color: bool, width: int | None) -> str:
    from hookcli.render import calib

    data = dataclasses.asdict(report)
    if fmt == Format.json:
        return json.dumps(data, indent=2, allow_nan=False) + "\n"
    if fmt == Format.csv:
        return calib.calib_csv(report)
    sections = calib.calib_sections(report)
    if fmt == Format.html:
        from hookcli.render.html import sections_html

        return sections_html(f"hookcli calib {report.model.spec}", sections, data)
    if fmt == Format.markdown:
        from hookcli.render.markdown import sections_markdown

        return sections_markdown(sections)
    from hookcli.render.table import render_sections

    return render_sections(sections, color=color, width=width)
