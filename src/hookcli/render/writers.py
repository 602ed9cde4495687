"""What hookcli writes, in one table keyed by format: each writer's -o suffixes, whether it is
binary (bytes: a file, never a terminal) or fills a folder (an experiment tracker), what it
needs installed, and for each kind of report it takes, the function that writes it.

The render door (formats.py: `render`, `written`) and the CLI's choice of a format from -f and
the -o name, with its refusals (cli/console.py), read this table and nothing else: adding a
format is one writer function and one row here, and its name in render.Format (-f's choices).
Each function imports its renderer when it is called (Rich only for the table, pandas and
pyarrow only for Parquet), so reading the table costs nothing. No torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from hookcli.render import Format

if TYPE_CHECKING:
    from hookcli.records import CalibReport, DiffReport, LensReport, Report
    from hookcli.render.html import EmbeddedPicture
    from hookcli.render.parts import Section
    from hookcli.render.series import ChecksReport, SeriesReport


class Kind(StrEnum):
    """The reports hookcli writes."""

    report = "report"  # a layers report: inspect, grads, check, a folder run, replay, a saved one
    diff = "diff"
    lens = "lens"
    calib = "calib"
    series = "series"  # a run log's series: hookcli report run.jsonl
    checks = "checks"  # the rules over a run log: hookcli check run.jsonl


def kind_of(obj: object) -> Kind:
    """Which kind of report `obj` is (records' reports, render.series' two run-log reports)."""
    from hookcli.records import CalibReport, DiffReport, LensReport, Report
    from hookcli.render.series import ChecksReport, SeriesReport

    kinds: dict[type, Kind] = {
        Report: Kind.report,
        DiffReport: Kind.diff,
        LensReport: Kind.lens,
        CalibReport: Kind.calib,
        SeriesReport: Kind.series,
        ChecksReport: Kind.checks,
    }
    found = next((k for t, k in kinds.items() if isinstance(obj, t)), None)
    if found is None:
        raise TypeError(f"{type(obj).__name__} is not a report hookcli writes")
    return found


@dataclass(frozen=True, slots=True)
class Options:
    """How a report is laid out: `color` and `width` are the table's; `pictures` are embedded
    in a layers report's HTML page; `checks_only` (check's table and Markdown) shows its checks
    alone, `quiet` only those that failed (a run log's checks too)."""

    color: bool = False
    width: int | None = None
    pictures: Sequence[EmbeddedPicture] = ()
    checks_only: bool = False
    quiet: bool = False


Write = Callable[[Any, Options], str | bytes]
"""A writer's function for one kind: the report and the options → its text, or its bytes."""


@dataclass(frozen=True, slots=True)
class Needs:
    """Packages a writer needs that hookcli does not install: `here` says whether they are
    (asked before any work), `extra` is the pip extra that installs them."""

    packages: str  # as a message names them: "pandas and pyarrow"
    extra: str
    here: Callable[[], bool]


@dataclass(frozen=True, slots=True)
class Writer:
    """One format. `suffixes`: the -o names it owns (the first is the one messages give);
    `binary`: it writes bytes, so a file and never a terminal; `folder`: it fills the folder -o
    names (an experiment tracker: a run log's series, written by commands.watch.trackers, above
    the renderers); `kinds`: each report kind it takes and the function writing it; `note`: a
    remark on what was written (HTML: a page over its size budget); `api`: where Python gets
    a binary format's bytes, for the refusal of it as text."""

    format: Format
    name: str  # as messages name it: "Parquet"
    suffixes: tuple[str, ...] = ()
    binary: bool = False
    folder: bool = False
    kinds: Mapping[Kind, Write] = field(default_factory=dict)
    needs: Needs | None = None
    note: Callable[[Any, str | bytes, Options], str | None] | None = None
    api: str = ""

    @property
    def suffix(self) -> str:
        return self.suffixes[0] if self.suffixes else ""


# ---------------------------------------------------------------- the writers, by format


def _data(obj: Any) -> dict[str, Any]:
    """A report's JSON form: its `to_dict()`; a calib report's, its fields as they are."""
    import dataclasses

    if kind_of(obj) == Kind.calib:
        return dataclasses.asdict(obj)
    data: dict[str, Any] = obj.to_dict()
    return data


def _json(obj: Any, o: Options) -> str:
    from hookcli.render.json import data_json

    return data_json(_data(obj))


def _report_csv(obj: Report, o: Options) -> str:
    from hookcli.render.csv import report_csv

    return report_csv(obj)


def _diff_csv(obj: DiffReport, o: Options) -> str:
    from hookcli.render.csv import diff_csv

    return diff_csv(obj)


def _lens_csv(obj: LensReport, o: Options) -> str:
    from hookcli.render.lens import lens_csv

    return lens_csv(obj)


def _calib_csv(obj: CalibReport, o: Options) -> str:
    from hookcli.render.calib import calib_csv

    return calib_csv(obj)


def _series_csv(obj: SeriesReport, o: Options) -> str:
    from hookcli.render.series import series_csv

    return series_csv(obj.run)


def _checks_csv(obj: ChecksReport, o: Options) -> str:
    from hookcli.render.series import checks_csv

    return checks_csv(obj.checks)


def _report_table(obj: Report, o: Options) -> str:
    from hookcli.render.table import checks_table, report_table

    if o.checks_only:
        return checks_table(obj, color=o.color, width=o.width, quiet=o.quiet)
    return report_table(obj, color=o.color, width=o.width)


def _diff_table(obj: DiffReport, o: Options) -> str:
    from hookcli.render.table import diff_table

    return diff_table(obj, color=o.color, width=o.width)


def _report_markdown(obj: Report, o: Options) -> str:  # the same sections as the table
    from hookcli.render.markdown import checks_markdown, report_markdown

    return checks_markdown(obj, quiet=o.quiet) if o.checks_only else report_markdown(obj)


def _diff_markdown(obj: DiffReport, o: Options) -> str:
    from hookcli.render.markdown import diff_markdown

    return diff_markdown(obj)


def _report_html(obj: Report, o: Options) -> str:
    from hookcli.render.html import report_html

    return report_html(obj, o.pictures)


def _diff_html(obj: DiffReport, o: Options) -> str:
    from hookcli.render.html import diff_html

    return diff_html(obj)


def _parquet(obj: Report | DiffReport, o: Options) -> bytes:
    from hookcli.render.tabular import parquet

    return parquet(obj)


# ---------------------------------------------------------------- reports as pages of sections

# lens, calib and a run log's series and checks are format-neutral sections (parts.py) under a
# title: the table, Markdown and HTML lay out the same ones


def _lens_page(obj: LensReport, o: Options) -> tuple[str, list[Section]]:
    from hookcli.render.lens import lens_sections

    return f"hookcli lens {obj.model.spec}", lens_sections(obj)


def _calib_page(obj: CalibReport, o: Options) -> tuple[str, list[Section]]:
    from hookcli.render.calib import calib_sections

    return f"hookcli calib {obj.model.spec}", calib_sections(obj)


def _series_page(obj: SeriesReport, o: Options) -> tuple[str, list[Section]]:
    return "hookcli report: run log", obj.sections()


def _checks_page(obj: ChecksReport, o: Options) -> tuple[str, list[Section]]:
    return "hookcli check: run log", obj.sections(quiet=o.quiet)


PAGES: Mapping[Kind, Callable[[Any, Options], tuple[str, list[Section]]]] = {
    Kind.lens: _lens_page,
    Kind.calib: _calib_page,
    Kind.series: _series_page,
    Kind.checks: _checks_page,
}


def _sections(obj: Any, o: Options) -> tuple[str, list[Section]]:
    return PAGES[kind_of(obj)](obj, o)


def _blank(text: str) -> str:
    """A page with nothing on it is no text (check --quiet over a run log that passed)."""
    return text if text.strip() else ""


def _page_table(obj: Any, o: Options) -> str:
    from hookcli.render.table import render_sections

    return _blank(render_sections(_sections(obj, o)[1], color=o.color, width=o.width))


def _page_markdown(obj: Any, o: Options) -> str:
    from hookcli.render.markdown import sections_markdown

    return _blank(sections_markdown(_sections(obj, o)[1]))


def _page_html(obj: Any, o: Options) -> str:
    from hookcli.render.html import sections_html

    title, sections = _sections(obj, o)
    return sections_html(title, sections, _data(obj))


def _paged(write: Write) -> dict[Kind, Write]:
    return dict.fromkeys(PAGES, write)


# ---------------------------------------------------------------- notes and needs


def _html_budget(obj: Any, page: str | bytes, o: Options) -> str | None:
    """A note when an HTML page is larger than its budget: what made it large, what makes it
    smaller (a lens, calib or run-log checks page has no such budget)."""
    from hookcli.render.html import over_budget, report_budget

    kind = kind_of(obj)
    if kind == Kind.report:
        what, advice = report_budget(obj, o.pictures)
    elif kind == Kind.diff:
        what, advice = f"{len(obj.calls)} layer calls", "select fewer layers (-l)"
    elif kind == Kind.series:
        what, advice = "a run log's series", "watch fewer layers (layers=)"
    else:
        return None
    return over_budget(str(page), len(o.pictures), what, advice)


def _pandas_here() -> bool:
    from hookcli.render.tabular import available

    return available()


PANDAS = Needs("pandas and pyarrow", "pandas", _pandas_here)


# ---------------------------------------------------------------- the table

WRITERS: tuple[Writer, ...] = (
    Writer(Format.json, "JSON", (".json",), kinds=dict.fromkeys(Kind, _json)),
    Writer(
        Format.csv,
        "CSV",
        (".csv",),
        kinds={
            Kind.report: _report_csv,
            Kind.diff: _diff_csv,
            Kind.lens: _lens_csv,
            Kind.calib: _calib_csv,
            Kind.series: _series_csv,
            Kind.checks: _checks_csv,
        },
    ),
    Writer(
        Format.markdown,
        "Markdown",
        (".md", ".markdown"),
        kinds={Kind.report: _report_markdown, Kind.diff: _diff_markdown, **_paged(_page_markdown)},
    ),
    Writer(
        Format.html,
        "HTML",
        (".html", ".htm"),
        kinds={Kind.report: _report_html, Kind.diff: _diff_html, **_paged(_page_html)},
        note=_html_budget,
    ),
    Writer(
        Format.table,
        "table",
        (".txt",),
        kinds={Kind.report: _report_table, Kind.diff: _diff_table, **_paged(_page_table)},
    ),
    Writer(
        Format.parquet,
        "Parquet",
        (".parquet",),
        binary=True,
        kinds={Kind.report: _parquet, Kind.diff: _parquet},
        needs=PANDAS,
        api="report.to_pandas().to_parquet(path)",
    ),
    Writer(Format.tensorboard, "TensorBoard", folder=True),  # event files
    Writer(Format.mlflow, "MLflow", folder=True),  # a run in a file store or at a tracking URI
    Writer(Format.wandb, "W&B", folder=True),  # an offline W&B run
)

BY_FORMAT: Mapping[Format, Writer] = {w.format: w for w in WRITERS}
BY_SUFFIX: Mapping[str, Writer] = {s: w for w in WRITERS for s in w.suffixes}
TRACKERS = tuple(w.format for w in WRITERS if w.folder)


def writer(fmt: Format | str) -> Writer:
    """The writer of `fmt` (a Format or its name; another name: ValueError)."""
    return BY_FORMAT[Format(fmt)]


def by_suffix(suffix: str) -> Writer | None:
    """The writer that owns an -o name's suffix ('.md'), or None."""
    return BY_SUFFIX.get(suffix)


def suffixes_named() -> str:
    """Each writer's own suffix, as a refusal lists them: ".json, .csv, … or .parquet"."""
    own = [w.suffix for w in WRITERS if w.suffix]
    return ", ".join(own[:-1]) + f" or {own[-1]}"
