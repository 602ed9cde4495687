"""Reports where users already work (issue 38): a short repr, `report["layer"]`, the CLI's
table, an HTML fragment for notebooks, DataFrames, Parquet and CSV that carry every measured
tensor, and output suffixes hookcli does not write refused before any work.

Oracles: the report's own JSON (`to_dict`, what `-f json` writes), read back by pandas and
pyarrow's readers and Python's csv/html parsers; the CLI's table through CliRunner."""

from __future__ import annotations

import csv
import html.parser
import io
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.records import Report
from tests.support.paths import ROOT

pd = pytest.importorskip("pandas", reason="pip install 'hookcli[pandas]'")
pq = pytest.importorskip("pyarrow.parquet", reason="pip install 'hookcli[pandas]'")

runner = CliRunner()
STATS = ["mean", "std", "min", "max", "zeros", "nan", "inf", "norm"]


class Small(nn.Module):
    """Two calls of one ReLU, a frozen parameter, a parameter no gradient reaches, and a
    4-element output (its values are kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 5)
        self.fc2 = nn.Linear(5, 4)
        self.act = nn.ReLU()
        self.unused = nn.Linear(3, 3)
        self.fc1.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc2(self.act(self.fc1(x))))


@pytest.fixture(scope="module")
def grads_report() -> Report:
    torch.manual_seed(0)
    return hookcli.grads(Small(), torch.randn(1, 6))


@pytest.fixture(scope="module")
def big_report() -> Report:
    import torchvision

    torch.manual_seed(0)
    return hookcli.grads(torchvision.models.resnet18().eval(), torch.randn(1, 3, 64, 64))


# ---------------------------------------------------------------- repr, lookup, table


def test_repr_is_short_and_says_what_ran(big_report: Report) -> None:
    text = repr(big_report)
    assert len(text) <= 2000 and "\n" not in text
    assert text.startswith("<Report grads ResNet on cpu:")
    assert f"{len(big_report.layers)} layer calls" in text and "no NaN/Inf" in text
    assert len(repr(big_report.to_dict())) > 20 * len(text)  # what the old repr dumped


def test_str_is_the_clis_table(grads_report: Report, tmp_path: Path) -> None:
    saved = tmp_path / "r.json"
    saved.write_text(json.dumps(grads_report.to_dict()))
    shown = runner.invoke(app, ["report", str(saved)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    from hookcli.io.reportfile import saved_report

    again = saved_report(saved)  # the same report read back, as the CLI renders it
    assert again.table() == shown.stdout
    assert str(again) == again.table() and repr(again.table()) == str(again.table())
    assert str(grads_report) == grads_report.table()


def test_a_report_is_looked_up_by_layer_name(grads_report: Report) -> None:
    act = grads_report["act"]
    assert [c.call for c in act] == [0, 1] and all(c.name == "act" for c in act)
    assert grads_report["fc2"][0] is next(c for c in grads_report.layers if c.name == "fc2")
    with pytest.raises(KeyError, match=r"'fc3'.*nearest: fc1, fc2|'fc3'.*nearest: fc2, fc1"):
        grads_report["fc3"]
    with pytest.raises(TypeError):
        grads_report[0]  # type: ignore[index]
    assert "fc2" in grads_report and "fc3" not in grads_report and 0 not in grads_report
    with pytest.raises(TypeError, match="not iterable"):
        iter(grads_report)  # type: ignore[call-overload]


def test_diff_reports_too() -> None:
    torch.manual_seed(0)
    d = hookcli.diff(Small(), torch.randn(2, 6), b="float64")
    assert repr(d).startswith("<DiffReport Small on cpu: as loaded (float32) vs float64")
    assert [c.name for c in d["act"]] == ["act", "act"]
    assert "fc1" in d.table() and d.to_pandas().shape[0] == sum(
        len(c.b) + len(c.a or []) for c in [*d.calls, *d.outputs]
    )
    frame = d.to_pandas()
    rows = [(c, t) for c in [*d.calls, *d.outputs] for t in c.b]
    for (c, t), (_, r) in zip(rows, frame.iterrows(), strict=True):
        assert (r["layer"], r["call"], r["side"], r["path"]) == (c.name, c.call, "B", t.path)
        for key in ("max_abs", "rel_l2", "cosine"):
            assert r[key] == getattr(t, key)


# ---------------------------------------------------------------- DataFrame, Parquet, CSV


def _expected(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows a layers report's JSON says there are: every tensor of every call, each
    parameter's gradient, the model's output."""
    out = []
    for c in data["layers"]:
        for kind, key in (("input", "inputs"), ("output", "outputs")):
            out += [{"layer": c["name"], "call": c["call"], "kind": kind, **t} for t in c[key]]
        for kind, key in (("grad_input", "grad_inputs"), ("grad_output", "grad_outputs")):
            out += [
                {"layer": c["name"], "call": c["call"], "kind": kind, **t} for t in c[key] or []
            ]
        for p in c["params"] or []:
            g = p["grad"] or {"path": p["name"], "shape": p["shape"], "numel": p["numel"]}
            out.append(
                {"layer": c["name"], "call": c["call"], "kind": "param_grad", **g,
                 "path": p["name"], "weight_norm": p["norm"], "grad_weight": p["ratio"]}
            )  # fmt: skip
    out += [{"layer": "(model)", "call": 0, "kind": "model_output", **t} for t in data["outputs"]]
    return out


def _missing(x: Any) -> bool:
    return x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x))


def _same(a: Any, b: Any) -> bool:
    """Equal, or both missing (None in JSON; NaN or NA in a frame)."""
    if _missing(a) or _missing(b):
        return _missing(a) and _missing(b)
    return bool(a == b)


def test_to_pandas_is_the_json(grads_report: Report) -> None:
    frame = grads_report.to_pandas()
    expected = _expected(grads_report.to_dict())
    assert len(frame) == len(expected)
    assert {"param_grad", "grad_output", "model_output"} <= set(frame["kind"])
    for want, (_, got) in zip(expected, frame.iterrows(), strict=True):
        for key in ("layer", "call", "kind", "path", "numel", *STATS):
            assert _same(got[key], want.get(key)), key  # (a missing gradient: null counts)
        assert tuple(got["shape"]) == tuple(want["shape"])
        for key in ("weight_norm", "grad_weight"):
            assert _same(got[key], want.get(key))
        assert (got["values"] is None) == (want.get("values") is None)
        if want.get("values") is not None:
            assert list(got["values"]) == want["values"]
    frozen = frame[(frame.layer == "fc1") & (frame.path == "bias")].iloc[0]
    assert frozen["kind"] == "param_grad" and "frozen" in frozen["note"]
    assert frame["numel"].dtype == "Int64" and frame["mean"].dtype == "float64"


def test_parquet_and_csv_read_back_as_the_frame(grads_report: Report, tmp_path: Path) -> None:
    saved = tmp_path / "r.json"
    saved.write_text(json.dumps(grads_report.to_dict()))
    for out in ("r.parquet", "r.csv"):
        res = runner.invoke(app, ["report", str(saved), "-o", str(tmp_path / out)])
        assert res.exit_code == 0, res.output
    frame = grads_report.to_pandas()
    table = pq.read_table(tmp_path / "r.parquet")
    assert table.column_names == list(frame.columns)
    back = table.to_pandas()
    for col in frame.columns:
        for a, b in zip(back[col], frame[col], strict=True):
            if col in ("shape", "values"):
                assert (a is None and b is None) or list(a) == list(b)
            else:
                assert _same(a, b), col
    with open(tmp_path / "r.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(frame.columns) and len(rows) == len(frame)
    for row, (_, want) in zip(rows, frame.iterrows(), strict=True):
        assert row["shape"] == "x".join(map(str, want["shape"]))
        for key in STATS:
            assert (row[key] == "") == pd.isna(want[key])
            if row[key]:
                assert float(row[key]) == want[key]  # every digit (repr)
        values = json.loads(row["values"]) if row["values"] else None
        assert values == (list(want["values"]) if want["values"] is not None else None)


def test_parquet_files_of_different_runs_read_as_one(tmp_path: Path) -> None:
    """The schema is fixed: a column no row fills (`values` of large tensors, `note`) keeps
    its type, so a folder of runs reads back as one table."""
    torch.manual_seed(0)
    small = hookcli.inspect(nn.Linear(4, 4), torch.randn(1, 4))
    large = hookcli.inspect(nn.Linear(40, 40), torch.randn(1, 40))
    from hookcli.render.tabular import parquet

    for name, r in (("a", small), ("b", large)):
        (tmp_path / f"{name}.parquet").write_bytes(parquet(r))
    both = pd.read_parquet(tmp_path)
    assert len(both) == len(small.to_pandas()) + len(large.to_pandas())
    schema = pq.read_schema(tmp_path / "b.parquet")
    assert str(schema.field("values").type) == "list<element: double>"
    assert str(schema.field("note").type) == "string"
    assert str(schema.field("shape").type) == "list<element: int64>"


def test_inspect_writes_parquet_with_the_json_numbers(tmp_path: Path) -> None:
    args = ["inspect", "resnet18", "--input", "randn:1x3x32x32", "-l", "layer1.*"]
    res = runner.invoke(app, [*args, "-o", str(tmp_path / "r.parquet")])
    assert res.exit_code == 0, res.output
    data = json.loads(runner.invoke(app, [*args, "-f", "json"]).stdout)
    back = pq.read_table(tmp_path / "r.parquet").to_pandas()
    expected = _expected(data)
    assert len(back) == len(expected)
    for want, (_, got) in zip(expected, back.iterrows(), strict=True):
        for key in ("layer", "kind", "path"):
            assert got[key] == want[key]
        for key in STATS:
            assert _same(got[key], want[key])


# ---------------------------------------------------------------- suffixes, before any work


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "no-such-model", "-o", "r.xlsx"], "does not write .xlsx files"),
        (["inspect", "no-such-model", "-o", "r.parquet", "-f", "json"], "go together"),
        (["inspect", "no-such-model", "-o", "r.txt", "-f", "parquet"], "go together"),
        (["calib", "no-such-model", "-f", "parquet"], "no Parquet form"),
        (["diff", "no-such-model", "--b", "bfloat16", "-o", "d.pdf"], "does not write .pdf"),
        (["layers", "no-such-model", "-o", "l.parquet"], "not Parquet"),
        (["lens", "no-such-model", "-o", "l.parquet"], "no Parquet form"),
    ],
)
def test_an_output_hookcli_does_not_write_is_refused_first(
    args: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model does not exist: the output's error comes first, so it came before any
    work, and nothing was written."""
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert list(tmp_path.iterdir()) == []


def test_parquet_without_pandas_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hookcli.render import tabular

    monkeypatch.setattr(tabular, "available", lambda: False)
    res = runner.invoke(app, ["inspect", "resnet18", "-o", str(tmp_path / "r.parquet")])
    assert res.exit_code == 2 and "pip install 'hookcli[pandas]'" in res.output
    assert not (tmp_path / "r.parquet").exists()


def test_text_formats_keep_their_suffixes(tmp_path: Path) -> None:
    """.txt takes the table or any text format; a name without a suffix takes -f."""
    base = ["inspect", "resnet18", "--input", "randn:1x3x32x32", "-l", "fc"]
    assert runner.invoke(app, [*base, "-o", str(tmp_path / "t.txt")]).exit_code == 0
    assert runner.invoke(app, [*base, "-f", "json", "-o", str(tmp_path / "j.txt")]).exit_code == 0
    assert runner.invoke(app, [*base, "-f", "json", "-o", str(tmp_path / "plain")]).exit_code == 0
    assert json.loads((tmp_path / "plain").read_text())["command"] == "inspect"
    res = runner.invoke(app, ["layers", "resnet18", "-o", str(tmp_path / "l.json")])
    assert res.exit_code == 0 and json.loads((tmp_path / "l.json").read_text())["model"]
    # -f names the format whatever the name: a mktemp name, a table in a .json
    odd = tmp_path / "tmp.k3j9x2"
    assert runner.invoke(app, [*base, "-f", "json", "-o", str(odd)]).exit_code == 0
    assert json.loads(odd.read_text())["command"] == "inspect"
    res = runner.invoke(app, ["layers", "resnet18", "-f", "table", "-o", str(tmp_path / "t.json")])
    assert res.exit_code == 0 and (tmp_path / "t.json").read_text().startswith("resnet18 (")


def test_the_suffix_is_the_names_not_a_links_target(tmp_path: Path) -> None:
    target = tmp_path / "reports" / "r.2024-05-01"
    target.parent.mkdir()
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    res = runner.invoke(
        app, ["inspect", "resnet18", "--input", "randn:1x3x32x32", "-l", "fc", "-o", str(link)]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(target.read_text())["command"] == "inspect"


# ---------------------------------------------------------------- the HTML fragment


class _Parsed(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.style = ""
        self._in_style = False
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.style += data
        else:
            self.text.append(data)


def test_the_html_fragment_is_self_contained_and_scoped() -> None:
    from tests.support.models import NanForward

    torch.manual_seed(0)
    r = hookcli.inspect(NanForward(), torch.randn(2, 4))
    fragment = r._repr_html_()
    parsed = _Parsed()
    parsed.feed(fragment)
    tags = [t for t, _ in parsed.tags]
    assert tags[0] == "div" and parsed.tags[0][1]["class"] == "hookcli-nb"
    assert not {"script", "img", "link", "iframe", "html", "body", "head"} & set(tags)
    assert all(not (a.get("id")) for _, a in parsed.tags)  # ids clash between outputs
    assert all(not (a.get("src") or a.get("href")) for _, a in parsed.tags)
    rules = re.findall(r"([^{}]+)\{[^{}]*\}", parsed.style)
    assert rules and all(
        sel.strip().startswith(".hookcli-nb") for rule in rules for sel in rule.split(",")
    ), rules
    text = " ".join(parsed.text)
    assert "NaN/Inf first appeared" in text and r.nonfinite_origins[0].layer in text
    assert sum(1 for t in tags if t == "tr") >= len(r.layers)


def test_the_html_fragment_cuts_long_tables(big_report: Report) -> None:
    from hookcli.render import views

    fragment = big_report._repr_html_()
    calls = len(big_report.layers)
    assert calls > 50
    small = views.MAX_ROWS
    views.MAX_ROWS = 50
    try:
        cut = big_report._repr_html_()
    finally:
        views.MAX_ROWS = small
    assert f"… {calls - 50} more rows" in cut and len(cut) < len(fragment)


def test_the_docs_csv_claim_holds() -> None:
    """Small tensors' elements are in CSV (docs/usage.md says so)."""
    assert "carry their `values` in JSON and CSV" in (ROOT / "docs" / "usage.md").read_text()
    torch.manual_seed(0)
    r = hookcli.inspect(Small(), torch.randn(1, 6))
    rows = list(csv.DictReader(io.StringIO(hookcli.formatted(r, "csv"))))
    out = next(row for row in rows if row["kind"] == "model_output")
    assert json.loads(out["values"]) == pytest.approx(r.outputs[0].values)
