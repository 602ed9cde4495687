"""One door for rendering: any report hookcli makes, in any format, by `written(obj, fmt)` (text,
or a binary format's bytes) or `render(obj, fmt)` (text only).

The CLI (`-f`/`-o FILE.suffix`) and the Python API (`hookcli.formatted`, `hookcli.html`) both come
through here, so a report looks the same whichever asked for it: an inspect/grads/check/folder
Report (or a saved one read back), a DiffReport, a LensReport, a CalibReport, a run log's
series and its checks (render.series). What each format takes, and the function writing each
kind, is the table in writers.py; each renderer is imported when it is asked for (Rich only
for the table). No torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from hookcli.errors import UsageError
from hookcli.records import CalibReport, DiffReport, LensReport, Report
from hookcli.render import Format
from hookcli.render.html import EmbeddedPicture
from hookcli.render.series import ChecksReport, SeriesReport
from hookcli.render.writers import Options, Writer, kind_of, writer

Renderable = Report | DiffReport | LensReport | CalibReport | SeriesReport | ChecksReport


def render(
    obj: Renderable,
    fmt: Format | str = Format.table,
    *,
    color: bool = False,
    width: int | None = None,
    pictures: Sequence[EmbeddedPicture] = (),
    checks_only: bool = False,
    quiet: bool = False,
) -> str:
    """`obj` as `fmt`, a text format (table, json, csv, markdown, html). `pictures` are
    embedded in a Report's HTML page; `checks_only` (check's table and Markdown) shows its
    checks alone, `quiet` only those that failed; `color` and `width` are the table's."""
    w = writer(fmt)
    _not_a_folder(w)
    if w.binary:
        raise UsageError(
            f"{w.name} is a binary file, not text.",
            f"write it with -o FILE{w.suffix}" + (f", or {w.api}." if w.api else "."),
        )
    options = Options(
        color=color, width=width, pictures=pictures, checks_only=checks_only, quiet=quiet
    )
    text = written(obj, w.format, options)
    assert isinstance(text, str), w.format
    return text


def written(obj: Renderable, fmt: Format | str, options: Options | None = None) -> str | bytes:
    """`obj` as `fmt`: the text of a text format, the bytes of a binary one (Parquet)."""
    w = writer(fmt)
    _not_a_folder(w)
    write = w.kinds.get(kind_of(obj))
    if write is None:
        raise UsageError(
            f"a {type(obj).__name__}'s output has no {w.name} form.", "write -f csv or -f json."
        )
    return write(obj, options or Options())


def noted(
    obj: Renderable, fmt: Format | str, out: str | bytes, options: Options | None = None
) -> str | None:
    """The writer's remark on what it wrote (an HTML page over its size budget), or None."""
    w = writer(fmt)
    return None if w.note is None else w.note(obj, out, options or Options())


def _not_a_folder(w: Writer) -> None:
    if w.folder:
        raise UsageError(
            f"{w.format.value} takes a training log's series, not a report.",
            f"hookcli report run.jsonl -f {w.format.value} -o runs/NAME",
        )
