"""Statistics declared once (records/statfields.py, issue 50): each TensorStats statistic
carries how it merges, compares and shows, and everything that handles the statistics as a set
follows the declaration — the engine's fill, folder and rank merges, the layers table, HTML,
CSV/Parquet, the saved-report and run-log readers, --baseline and the log writer.

Each test iterates TENSOR_STATS and checks every statistic against an oracle outside the code
under test: torch in float64 on the same tensor, the parts' own figures combined as the
statistic's declared merge says, the report's JSON (dataclasses.asdict), measuring a scaled
tensor. A statistic added to TensorStats is checked here with no change but its oracle below.
"""

from __future__ import annotations

import csv
import html as htmllib
import io
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookcli
from hookcli.commands.baseline import STATS as COMPARED
from hookcli.commands.baseline import compare_baseline
from hookcli.commands.watch import logread, runmerge
from hookcli.engine import statrow
from hookcli.engine.aggregate import Accumulator
from hookcli.engine.stats import StatsCollector, tensor_stats
from hookcli.errors import UsageError
from hookcli.io.recordjson import RecordError, from_json
from hookcli.io.reportfile import load_report
from hookcli.records import (
    TENSOR_STATS,
    LoggedCall,
    Report,
    StepLine,
    TensorStats,
    log_line,
)
from hookcli.render import html, rows, tabular
from hookcli.render.csv import report_csv

NAMES = [s.name for s in TENSOR_STATS]
DECLARED = {s.name: s for s in TENSOR_STATS}


def _finite(x: torch.Tensor) -> torch.Tensor:
    d = x.detach().double().reshape(-1)
    return d[torch.isfinite(d)]


def _share(x: torch.Tensor, which: torch.Tensor) -> float:
    return float(which.sum()) / x.numel()


# Each declared statistic of a tensor, measured by torch in float64 — the oracle. A statistic
# that does not exist (no finite element) is None, as TensorStats has it.
ORACLES: dict[str, Callable[[torch.Tensor], float | int | None]] = {
    "mean": lambda x: float(_finite(x).mean()) if _finite(x).numel() else None,
    "std": lambda x: float(_finite(x).std(correction=0)) if _finite(x).numel() else None,
    "min": lambda x: float(_finite(x).min()) if _finite(x).numel() else None,
    "max": lambda x: float(_finite(x).max()) if _finite(x).numel() else None,
    "zeros": lambda x: _share(x, x.detach().double() == 0) if x.numel() else None,
    "nan": lambda x: int(torch.isnan(x).sum()),
    "inf": lambda x: int(torch.isinf(x).sum()),
    "norm": lambda x: float(_finite(x).norm()) if _finite(x).numel() else None,
}


def oracle(x: torch.Tensor) -> dict[str, float | int | None]:
    return {name: ORACLES[name](x) for name in NAMES}


def _close(got: Any, want: Any, rel: float = 1e-9) -> bool:
    if got is None or want is None:
        return got is want
    return bool(got == pytest.approx(want, rel=rel, abs=1e-12))


def _planted(seed: int, shape: tuple[int, ...] = (6, 5, 7)) -> torch.Tensor:
    """A tensor with zeros, NaN and Inf planted where a seed says."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3 + 0.5
    flat = x.view(-1)
    places = torch.randperm(flat.numel(), generator=g)
    flat[places[:9]] = 0.0
    flat[places[9:12]] = math.nan
    flat[places[12:14]] = math.inf
    flat[places[14]] = -math.inf
    return x


# ---------------------------------------------------------------- the declaration


def test_every_statistic_is_declared_measured_and_has_an_oracle() -> None:
    """The declared statistics are TensorStats' `stat(...)` fields; the engine's row measures
    exactly them (statrow would not import otherwise); each has its oracle here."""
    assert statrow.PASS_STATS + tuple(statrow.AFTER_PASS) == tuple(NAMES)
    assert set(ORACLES) == set(NAMES), "add the new statistic's float64 oracle to ORACLES"
    empty = TensorStats("t", (0,), "float32", 0)
    for s in TENSOR_STATS:
        assert getattr(empty, s.name) == (0 if s.count else None)
        assert s.compare in ("rms", "relative", "points", "count", None)
        assert (s.compare == "count") == s.count


@pytest.mark.parametrize("backend", ["torch", "kernel"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: _planted(1),
        lambda: torch.randn(3, 300, generator=torch.Generator().manual_seed(2)).relu(),
        lambda: torch.full((4, 4), 0.1),
        lambda: torch.full((5,), math.nan),
        lambda: torch.zeros(0, 3),
        lambda: _planted(3).half(),
        lambda: _planted(4, (64, 1100)),  # past the kernels' parallel threshold
    ],
    ids=["planted", "relu", "constant", "all-nan", "empty", "float16", "large"],
)
def test_each_statistic_equals_float64_torch(
    backend: str, make: Callable[[], torch.Tensor]
) -> None:
    x = make()
    c = StatsCollector(backend=backend)
    got = c.add(x, "t")
    c.finalize()
    want = oracle(x)
    for name in NAMES:
        assert _close(getattr(got, name), want[name]), (name, getattr(got, name), want[name])
        if DECLARED[name].count:
            assert type(getattr(got, name)) is int, name


def _combined(parts: list[TensorStats], name: str) -> float | int | None:
    """The parts' figures combined as the statistic declares it merges (the whole tensor's
    mean and std come from torch on it, below)."""
    s = DECLARED[name]
    numel = sum(p.numel for p in parts)
    values = [getattr(p, name) for p in parts]
    present = [v for v in values if v is not None]
    if s.count:
        return sum(values)
    if s.fraction:
        return sum((v or 0.0) * p.numel for v, p in zip(values, parts, strict=True)) / numel
    if not present:
        return None
    if s.merge == "min":
        return min(present)
    if s.merge == "max":
        return max(present)
    if s.merge == "norm":
        return math.sqrt(sum(v * v for v in present))
    raise AssertionError(f"{name}: merged from the moments, compared with the whole tensor")


def test_a_folder_runs_merge_is_each_statistics_declared_merge() -> None:
    """Parts merged (a folder run's batches, torchrun ranks) give each statistic as its
    declared merge combines the parts' figures, and the one-pass statistics equal the whole
    tensor's."""
    whole = _planted(5, (9, 4, 6))
    c = StatsCollector()
    parts = [c.add(whole[a:b].clone(), "out") for a, b in ((0, 2), (2, 7), (7, 9))]
    c.finalize()
    acc = Accumulator("out", "float32", (4, 6))
    for p in parts:
        acc.add(p)
    merged = acc.stats()
    assert merged.numel == whole.numel() and merged.shape == (9, 4, 6)
    want = oracle(whole)
    for name in NAMES:
        got = getattr(merged, name)
        if DECLARED[name].merge in ("mean", "std"):
            assert _close(got, want[name], 1e-12), name
        else:
            assert _close(got, _combined(parts, name), 1e-12), name
        if name in statrow.PASS_STATS:  # every one-pass statistic merges exactly
            assert _close(got, want[name], 1e-12), name


def test_a_gradients_scaled_statistics_are_those_of_the_scaled_tensor() -> None:
    """runmerge.scaled (a rank's gradient times 1/W) scales exactly the statistics that scale
    with their tensor: measuring the tensor times 1/4 (exact in binary) gives the same."""
    x = _planted(6)
    got = runmerge.scaled(tensor_stats(x), 0.25)
    want = tensor_stats(x * 0.25)
    for name in NAMES:
        assert _close(getattr(got, name), getattr(want, name), 1e-12), name


# ---------------------------------------------------------------- a report's every form


class Planted(nn.Module):
    """A layer whose output holds zeros, two NaN and an Inf: every statistic says something."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.lin(x)).clone()
        y[0, :2] = math.nan
        y[1, 0] = math.inf
        return y * 3 - 0.25


@pytest.fixture(scope="module")
def report() -> Report:
    torch.manual_seed(0)
    return hookcli.inspect(Planted(), torch.randn(4, 8), layers=["lin", "act"])


def _tensor_rows(report: Report) -> list[tuple[str, str, dict[str, Any]]]:
    """(layer, kind, the tensor's JSON) of every layer tensor, in row order."""
    data = report.to_dict()
    kinds = (("input", "inputs"), ("output", "outputs"))
    return [(c["name"], kind, t) for c in data["layers"] for kind, key in kinds for t in c[key]]


def test_the_csv_has_a_column_per_statistic_holding_the_jsons_value(report: Report) -> None:
    table = list(csv.DictReader(io.StringIO(report_csv(report))))
    header = next(csv.reader(io.StringIO(report_csv(report))))
    at = header.index("numel")
    assert header[at + 1 : at + 1 + len(NAMES)] == NAMES
    tensors = _tensor_rows(report)
    assert len(table) >= len(tensors)
    for line, (layer, kind, t) in zip(table, tensors, strict=False):
        assert (line["layer"], line["kind"]) == (layer, kind)
        for name in NAMES:
            cell, value = line[name], t[name]
            if value is None:
                assert cell == "", name
            elif DECLARED[name].count:
                assert int(cell) == value, name
            else:
                assert float(cell) == value, name


def test_parquet_types_each_statistic_by_its_kind(report: Report) -> None:
    pytest.importorskip("pandas")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pq.read_table(io.BytesIO(tabular.parquet(report)))
    tensors = _tensor_rows(report)
    for name in NAMES:
        column = table.column(name)
        assert str(column.type) == ("int64" if DECLARED[name].count else "double"), name
        got = [
            None if isinstance(v, float) and math.isnan(v) else v  # a missing float: NaN
            for v in column.to_pylist()[: len(tensors)]
        ]
        assert got == [t[name] for _, _, t in tensors], name


def test_the_layers_table_and_html_show_each_declared_column(report: Report) -> None:
    """Each statistic with a header is a column of the layers table (text, Markdown) and of
    the HTML page (sorted by its JSON key), holding the output's value as its format says;
    the page's script lists every statistic for a tensor's details."""
    table = rows.calls_table(report)
    shown = [s for s in TENSOR_STATS if s.header is not None]
    assert shown, "some statistic is shown"
    first = next(c for c in report.layers if c.outputs)
    cells = table.rows[[c.name for c in report.layers].index(first.name)].cells
    for s in shown:
        assert s.header in table.headers and s.header in rows.SAVED_HEADERS
        value = getattr(first.outputs[0], s.name)
        assert cells[table.headers.index(s.header)] == rows.FORMATS[s.format](value), s.name
    page = html.report_html(report)
    for s in shown:
        assert f'data-key="out.{s.name}"' in page, s.name
    found = re.search(r'<div id="app" data-stats="([^"]*)">', page)
    assert found is not None
    listed = json.loads(htmllib.unescape(found.group(1)))
    assert sorted(name for name, _, _ in listed) == sorted(NAMES)
    assert all(fmt in ("num", "pct", "int") for _, _, fmt in listed)


def test_a_saved_report_with_a_statistic_of_the_wrong_type_is_refused_naming_it(
    report: Report, tmp_path: Path
) -> None:
    path = tmp_path / "r.json"
    for name in NAMES:
        data = report.to_dict()
        data["layers"][0]["outputs"][0][name] = "x"
        path.write_text(json.dumps(data))
        with pytest.raises(UsageError) as bad:
            load_report(path, "baseline", "record one")
        assert f"layers[0].outputs[0].{name} is a string" in str(bad.value), name
    data = report.to_dict()
    path.write_text(json.dumps(data))
    again = load_report(path, "baseline", "record one")
    assert again.layers[0].outputs[0] == report.layers[0].outputs[0]


def test_the_baseline_compares_every_declared_statistic(report: Report) -> None:
    """A baseline that differs from the run in one statistic of one tensor fails naming it."""
    assert sorted(COMPARED) == sorted(s.name for s in TENSOR_STATS if s.compare is not None)
    same = compare_baseline(report, report, 1e-6, 0.0, "base.json")
    assert same.passed, same.message
    for name in COMPARED:
        base = report.to_dict()
        t = base["layers"][1]["outputs"][0]
        t[name] = (t[name] or 0) + (3 if DECLARED[name].count else 0.125)
        again = from_json(Report, json.loads(json.dumps(base)))
        result = compare_baseline(report, again, 1e-6, 0.0, "base.json")
        assert not result.passed, name
        assert result.first is not None and result.first.path == f"output out {name}", name


def _line(stats: list[TensorStats]) -> dict[str, Any]:
    call = LoggedCall("layer", "Linear", 0, [], stats, None, None)
    return log_line(StepLine(1, 0, 1, 0.5, [call], [], run="r"))


def test_the_log_writes_every_statistic_and_reads_it_back(tmp_path: Path) -> None:
    t = tensor_stats(_planted(7))
    line = _line([t])
    written = line["layers"][0]["outputs"][0]
    assert all(name in written for name in NAMES)
    log = tmp_path / "run.jsonl"
    log.write_text(json.dumps(line) + "\n")
    back = logread.read_log(log).steps[1].layers[0].outputs[0]
    for name in NAMES:
        assert getattr(back, name) == getattr(t, name), name
    assert back == logread.step_line(line).layers[0].outputs[0]


def test_a_log_line_with_a_statistic_of_the_wrong_type_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    log = tmp_path / "run.jsonl"
    for name in NAMES:
        line = _line([tensor_stats(_planted(8))])
        line["layers"][0]["outputs"][0][name] = "x"
        log.write_text(json.dumps(line) + "\n")
        with pytest.raises(UsageError) as bad:
            logread.read_log(log)
        said = str(bad.value)
        assert re.search(rf"line 1 has {name}\b.* in layers\[0\]\.outputs\[0\], not ", said), said


# ---------------------------------------------------------------- the typed reader, compiled


@pytest.fixture(scope="module")
def rich() -> Report:
    """A report with histograms and per-channel numbers too: every kind of field a report
    holds (records, optional records, lists, tuples, dicts, optional values)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return hookcli.inspect(model, torch.randn(3, 8), hist=8, channels=True)


def _leaves(data: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every (path, value) of a parsed JSON document's leaves, paths as the reader names them."""
    if isinstance(data, dict):
        return [x for k, v in data.items() for x in _leaves(v, f"{path}.{k}".lstrip("."))]
    if isinstance(data, list):
        return [x for i, v in enumerate(data) for x in _leaves(v, f"{path}[{i}]")]
    return [(path, data)]


def _set(data: Any, path: str, value: Any) -> None:
    parts = [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", path)]
    for p in parts[:-1]:
        data = data[p]
    data[parts[-1]] = value


def test_a_report_reads_back_as_the_record_it_was_written_from(rich: Report) -> None:
    data = json.loads(json.dumps(rich.to_dict()))
    again = from_json(Report, data)
    assert again == rich
    assert any(t.channels is not None for c in rich.layers for t in c.outputs)
    assert any(t.hist is not None for c in rich.layers for t in c.outputs)
    line = _line([tensor_stats(_planted(9))])
    assert from_json(StepLine, json.loads(json.dumps(line))) == logread.step_line(line)


def test_every_misplaced_value_is_named_where_it_is(rich: Report) -> None:
    """Each number of the report replaced by a string, and each string by a number: the
    reader names that very place (the path computed here, not by the reader)."""
    data = rich.to_dict()
    numbers = strings = 0
    for path, value in _leaves(data):
        if isinstance(value, bool) or value is None:
            continue
        wrong = "x" if isinstance(value, int | float) else 5
        bad = json.loads(json.dumps(data))
        _set(bad, path, wrong)
        with pytest.raises(RecordError) as e:
            from_json(Report, bad)
        kind = "a string" if wrong == "x" else "a number"
        assert str(e.value).startswith(f"{path} is {kind}, not "), (path, str(e.value))
        numbers += wrong == "x"
        strings += wrong == 5
    assert numbers > 100 and strings > 20


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda d: d["layers"][0].pop("name"), "layers[0] has no 'name'"),
        (lambda d: d.pop("model"), "the report has no 'model'"),
        (lambda d: _set(d, "layers[1].call", 1.5), "layers[1].call is a number, not a whole"),
        (lambda d: _set(d, "layers[0].outputs[0].channels.count", {}), "channels.count is an"),
        (lambda d: _set(d, "layers[0].outputs[0].shape[1]", None), "shape[1] is null, not a"),
        (lambda d: _set(d, "layers[0].outputs", None), "layers[0].outputs is null, not a list"),
        (lambda d: _set(d, "layers[0].outputs[0].hist", 3), "hist is a number, not an object"),
    ],
)
def test_a_bad_field_is_one_line_naming_its_place(
    rich: Report, change: Callable[[dict[str, Any]], Any], said: str
) -> None:
    bad = json.loads(json.dumps(rich.to_dict()))
    change(bad)
    with pytest.raises(RecordError, match=re.escape(said)):
        from_json(Report, bad)
    with pytest.raises(RecordError, match="the top level is a list, not an object"):
        from_json(Report, [])


def test_each_record_class_is_compiled_once() -> None:
    from hookcli.io import recordjson

    first = recordjson.reader(Report)
    assert recordjson.reader(Report) is first
    assert first.__qualname__ == "read_Report"
