"""The writers in one table (issue 50, item 3): a row per format, and every report kind (a
layers report, a diff, lens, calib, a run log's series and its checks) written through the one
door (render.formats), the CLI's choice of a format from -f and the -o name and each of its
refusals read from that table."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app, console
from hookcli.errors import UsageError
from hookcli.render import Format, formats, writers
from hookcli.render.series import ChecksReport, SeriesReport
from hookcli.render.writers import Kind, Options

runner = CliRunner()


def run(*args: object) -> Any:
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "160"})


def refused(result: Any, message: str) -> None:
    """Exit 2, nothing on stdout, and exactly this one line on stderr."""
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout == ""
    assert result.stderr == f"error: {message}\n"


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.act = nn.ReLU()
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x)))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A run log of three watched steps and a saved layers report."""
    folder = tmp_path_factory.mktemp("writers")
    torch.manual_seed(0)
    model = Small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = folder / "run.jsonl"
    with hookcli.watch(model, optimizer=opt, log=log) as w:
        for _ in range(3):
            x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            w.loss(loss)
            loss.backward()
            opt.step()
    saved = folder / "saved.json"
    saved.write_text(hookcli.formatted(hookcli.inspect(model, torch.randn(2, 6)), "json"))
    return {"log": log, "saved": saved}


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Replaces one row of the writers' table for a test: `table(row)`."""

    def put(row: writers.Writer) -> None:
        rows = tuple(row if w.format == row.format else w for w in writers.WRITERS)
        monkeypatch.setattr(writers, "WRITERS", rows)
        monkeypatch.setattr(writers, "BY_FORMAT", {w.format: w for w in rows})
        monkeypatch.setattr(writers, "BY_SUFFIX", {s: w for w in rows for s in w.suffixes})

    return put


# ---------------------------------------------------------------- the table


def test_every_format_has_one_writer_and_every_suffix_one_owner() -> None:
    assert [w.format for w in writers.WRITERS] != [], "the table was read"
    assert sorted(w.format for w in writers.WRITERS) == sorted(Format)
    owned = [s for w in writers.WRITERS for s in w.suffixes]
    assert len(owned) == len(set(owned)) and all(s == s.lower() for s in owned)
    assert all(s.startswith(".") and len(s) > 1 for s in owned)
    for w in writers.WRITERS:
        if w.binary:  # bytes go to a file: it has a name of its own
            assert w.suffix and not w.folder, w.format
        if w.folder:  # a tracker: written by commands.watch.trackers, not by the door
            assert not w.suffixes and not w.kinds, w.format
        if not w.binary and not w.folder:  # a text format writes every kind
            assert set(w.kinds) == set(Kind), w.format
    assert (Format.tensorboard, Format.mlflow, Format.wandb) == writers.TRACKERS
    assert writers.suffixes_named() == ".json, .csv, .md, .html, .txt or .parquet"


def test_the_cli_format_choices_are_the_formats() -> None:
    """-f's choices are render.Format's, so a new format is a row and its name, nowhere else."""
    for name in ("inspect", "grads", "check", "diff", "lens", "calib", "report", "replay"):
        res = run(name, "x", "-f", "nope")
        assert res.exit_code == 2, res.stderr
        listed = re.search(r"'nope' is not one of (.*?)\. Hint", res.stderr)
        assert listed is not None, res.stderr
        assert re.findall(r"'(\w+)'", listed.group(1)) == [f.value for f in Format], name


def test_reading_the_table_imports_no_renderer() -> None:
    code = (
        "import sys, hookcli.render.writers as w; w.writer('parquet'); w.by_suffix('.md'); "
        "heavy = [m for m in ('torch', 'rich', 'pandas', 'pyarrow', 'hookcli.render.html', "
        "'hookcli.render.table', 'hookcli.render.tabular') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------- refusals, as the CLI says them


def test_the_refusals_name_the_formats_the_table_holds(files: dict[str, Path]) -> None:
    log, saved = files["log"], files["saved"]
    out = log.parent / "out"
    refused(
        run("report", saved, "-o", f"{out}.xlsx"),
        f"-o {out}.xlsx: hookcli does not write .xlsx files. Hint: name the file .json, .csv, "
        ".md, .html, .txt or .parquet, or give -f FORMAT.",
    )
    together = (
        "Parquet and a .parquet name go together. Hint: drop -f (the suffix picks the format), "
        "or rename the file."
    )
    res = run("report", saved, "-f", "json", "-o", f"{out}.parquet")
    refused(res, f"-f json and -o {out}.parquet: {together}")
    res = run("report", saved, "-f", "parquet", "-o", f"{out}.txt")
    refused(res, f"-f parquet and -o {out}.txt: {together}")
    no_rows = "this command's output has no Parquet form. Hint: write -f csv or -f json instead."
    refused(run("report", log, "-f", "parquet", "-o", f"{out}.parquet"), no_rows)
    refused(run("report", log, "-o", f"{out}.parquet"), no_rows)
    refused(run("check", log, "-o", f"{out}.parquet"), no_rows)
    refused(
        run("check", log, "-f", "mlflow"),
        "-f mlflow writes a training log's series. Hint: hookcli report run.jsonl -f mlflow -o "
        "runs/NAME",
    )
    assert list(log.parent.glob("out*")) == []


def test_the_refusals_follow_the_row(files: dict[str, Path], table: Any) -> None:
    """Parquet's row renamed and its suffix changed: every message says the new ones, the
    old suffix is no longer written, and a kind given to the row is written by its function."""
    log, saved = files["log"], files["saved"]
    out = log.parent / "renamed"

    def series_bytes(obj: SeriesReport, o: Options) -> bytes:
        return f"{len(obj.run.steps)} steps".encode()

    row = writers.writer(Format.parquet)
    kinds = {**row.kinds, Kind.series: series_bytes}
    table(dataclasses.replace(row, name="Columnar", suffixes=(".col",), kinds=kinds, needs=None))
    res = run("report", saved, "-o", f"{out}.parquet")
    assert res.exit_code == 2 and res.stdout == ""
    listed = re.fullmatch(
        rf"error: -o {re.escape(str(out))}\.parquet: hookcli does not write \.parquet files\. "
        r"Hint: name the file (.*), or give -f FORMAT\.\n",
        res.stderr,
    )
    assert listed is not None, res.stderr
    suffixes = re.split(r", | or ", listed.group(1))
    assert ".col" in suffixes and ".parquet" not in suffixes and ".json" in suffixes
    refused(
        run("report", saved, "-f", "json", "-o", f"{out}.col"),
        f"-f json and -o {out}.col: Columnar and a .col name go together. Hint: drop -f (the "
        "suffix picks the format), or rename the file.",
    )
    refused(
        run("check", log, "-f", "parquet", "-o", f"{out}.col"),
        "this command's output has no Columnar form. Hint: write -f csv or -f json instead.",
    )
    refused(
        run("layers", "no-such-model", "-o", f"{out}.col"),
        f"-o {out}.col: this command writes a table or JSON, not Columnar. Hint: name the file "
        ".txt or .json.",
    )
    res = run("report", log, "-o", f"{out}.col")
    assert res.exit_code == 0, res.stderr
    assert Path(f"{out}.col").read_bytes() == b"3 steps"


def test_a_binary_format_is_refused_for_a_terminal_and_without_its_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    from hookcli.render import tabular

    monkeypatch.setattr(tabular, "available", lambda: True)  # pandas and pyarrow: asked later
    monkeypatch.setattr(sys, "stdout", Terminal())
    with pytest.raises(UsageError) as caught:
        console.output_format(Format.parquet, None, kind=Kind.report)
    assert str(caught.value) == "Parquet is binary; not for a terminal. Hint: give -o FILE.parquet."
    dash = console.claim(Path("-"))
    with pytest.raises(UsageError, match="not for a terminal"):
        console.output_format(Format.parquet, dash, kind=Kind.diff)  # -o -: stdout
    file = console.claim(tmp_path / "r.parquet")
    assert console.output_format(None, file, kind=Kind.report) == Format.parquet
    assert console.output_format(Format.json, None, kind=Kind.report) == Format.json
    monkeypatch.setattr(tabular, "available", lambda: False)
    with pytest.raises(UsageError) as caught:
        console.output_format(None, file, kind=Kind.report)
    assert str(caught.value) == (
        "Parquet needs pandas and pyarrow, which are not installed. Hint: pip install "
        "'hookcli[pandas]'."
    )
    with pytest.raises(UsageError, match="no Parquet form"):  # the kind is asked first
        console.output_format(None, file, kind=Kind.lens)


# ---------------------------------------------------------------- run logs through the door


def test_a_run_logs_series_and_checks_are_written_by_the_table(
    files: dict[str, Path], table: Any
) -> None:
    """The Markdown row's functions for the two run-log kinds replaced: `hookcli report
    run.jsonl` and `hookcli check run.jsonl` print what they return, with what they were
    given."""
    seen: list[tuple[Any, Options]] = []

    def spy(obj: Any, o: Options) -> str:
        seen.append((obj, o))
        return f"{type(obj).__name__}\n"

    row = writers.writer(Format.markdown)
    table(dataclasses.replace(row, kinds={**row.kinds, Kind.series: spy, Kind.checks: spy}))
    res = run("report", files["log"], "-f", "markdown")
    assert res.exit_code == 0 and res.stdout == "SeriesReport\n", res.stderr
    res = run("check", files["log"], "-f", "markdown", "--quiet", "--max-update-ratio", "1e-12")
    assert res.exit_code == 1 and res.stdout == "ChecksReport\n", res.stderr
    (series, o1), (checks, o2) = seen
    assert isinstance(series, SeriesReport) and list(series.run.steps) == [0, 1, 2]
    assert series.header[0].startswith("report run log ") and not o1.quiet
    assert isinstance(checks, ChecksReport) and o2.quiet
    assert checks.header[0].startswith("check run log ")
    assert [c.rule for c in checks.checks if not c.passed] == ["update-ratio"]
    assert checks.to_dict()["command"] == "check"


def test_the_door_writes_a_run_log_as_the_cli_does(files: dict[str, Path]) -> None:
    from hookcli.commands.watch.runmerge import load_run
    from hookcli.commands.watch.runseries import run_lines, series

    data = series(load_run([files["log"]]))
    lines = run_lines(data)
    report = SeriesReport(data, [f"report run log {lines[0]}", *lines[1:]])
    for fmt in ("json", "csv", "markdown", "table"):
        want = run("report", files["log"], "-f", fmt)
        assert want.exit_code == 0, want.stderr
        got = formats.written(report, fmt, Options(width=160))
        assert got == want.stdout, fmt
    # the JSON is the series' own; the CSV a row per step, track and metric
    assert json.loads(formats.render(report, "json")) == data.to_dict()
    rows = list(csv.DictReader(io.StringIO(formats.render(report, "csv"))))
    per_step = sum(len(t.series) for t in [*data.layers, *data.params, data.loss])
    assert len(rows) == 3 * per_step and {r["step"] for r in rows} == {"0", "1", "2"}


def test_a_series_html_page_over_its_budget_gets_the_rows_note(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hookcli.render import html

    res = run("report", files["log"], "-f", "html")
    assert res.exit_code == 0 and res.stderr == ""
    monkeypatch.setattr(html, "BUDGET", 100)
    res = run("report", files["log"], "-f", "html")
    assert res.exit_code == 0 and res.stdout.startswith("<!DOCTYPE html>")
    assert res.stderr.startswith("note: the HTML report is "), res.stderr
    assert "(a run log's series)" in res.stderr and "watch fewer layers (layers=)" in res.stderr
    res = run("check", files["log"], "-f", "html")  # a checks page has no budget
    assert res.exit_code == 0 and res.stderr == ""


# ---------------------------------------------------------------- the door in Python


def test_text_and_bytes_through_the_door(files: dict[str, Path]) -> None:
    pq = pytest.importorskip("pyarrow.parquet", reason="pip install 'hookcli[pandas]'")
    from hookcli.io.reportfile import saved_report

    report = saved_report(files["saved"])
    with pytest.raises(UsageError) as caught:
        formats.render(report, "parquet")
    assert str(caught.value) == (
        "Parquet is a binary file, not text. Hint: write it with -o FILE.parquet, or "
        "report.to_pandas().to_parquet(path)."
    )
    data = formats.written(report, "parquet")
    assert isinstance(data, bytes)
    back = pq.read_table(io.BytesIO(data)).to_pylist()
    rows = list(csv.DictReader(io.StringIO(formats.render(report, "csv"))))
    assert [(r["layer"], r["kind"]) for r in back] == [(r["layer"], r["kind"]) for r in rows]
    assert [r["std"] for r in back] == [float(r["std"]) if r["std"] else None for r in rows]
    with pytest.raises(UsageError) as caught:
        formats.render(report, "wandb")
    assert str(caught.value) == (
        "wandb takes a training log's series, not a report. Hint: hookcli report run.jsonl -f "
        "wandb -o runs/NAME"
    )
    series = SeriesReport(_series(files["log"]), ["report run log"])
    with pytest.raises(UsageError) as caught:
        formats.written(series, "parquet")
    assert str(caught.value) == (
        "a SeriesReport's output has no Parquet form. Hint: write -f csv or -f json."
    )
    with pytest.raises(TypeError, match="not a report hookcli writes"):
        formats.written(object(), "json")  # type: ignore[arg-type]


def _series(log: Path) -> Any:
    from hookcli.commands.watch.runmerge import load_run
    from hookcli.commands.watch.runseries import series

    return series(load_run([log]))


def test_markdown_shows_a_layer_named_like_markup_as_text() -> None:
    """A module named `</script><img src=x onerror=alert(1)>`, another `[x](javascript:…)`:
    rendered by markdown-it (CommonMark with HTML on, GFM tables) the Markdown report held a
    live <img> tag; every name is text there, whole."""
    import html

    import torch
    from markdown_it import MarkdownIt
    from torch import nn

    import hookcli
    from hookcli.render.markdown import report_markdown

    names = ["</script><img src=x onerror=alert(1)>", "[x](javascript:alert(1))", "> quote"]
    model = nn.Sequential()
    for name in names:
        model.add_module(name, nn.Identity())
    report = hookcli.inspect(model, torch.ones(1, 2), topk=0, device="cpu")
    page = MarkdownIt("commonmark", {"html": True}).enable("table").render(report_markdown(report))
    assert "<img" not in page and "<a " not in page and "<blockquote" not in page
    text = html.unescape(re.sub(r"<[^>]+>", "", page))
    for name in names:
        assert name in text, name


def test_a_parameter_with_no_gradient_has_null_counts_in_csv_as_in_json(tmp_path: Path) -> None:
    """A frozen layer's weight: JSON `grad: null`, its CSV/Parquet row `nan=0, inf=0` — a
    count of a gradient that does not exist. The same null in every family."""
    import torch
    from torch import nn

    import hookcli
    from hookcli.render.csv import report_csv

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model[0].weight.requires_grad_(False)
    report = hookcli.grads(model, torch.ones(1, 2), target="sum", topk=0, device="cpu")
    (frozen,) = [p for c in report.layers for p in c.params or [] if p.grad is None]
    assert frozen.name == "weight" and report.to_dict()["layers"][0]["params"][0]["grad"] is None
    rows = list(csv.DictReader(io.StringIO(report_csv(report))))
    grads = {r["layer"]: r for r in rows if r["path"] == "weight" and "grad" in r["kind"]}
    assert grads["0"]["nan"] == "" and grads["0"]["inf"] == ""  # (an empty cell: CSV's null)
    assert grads["1"]["nan"] == "0"  # a gradient that exists: its count
