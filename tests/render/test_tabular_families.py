"""DataFrames, Parquet and CSV carry every family a report measures (issue 49): --per-token's
positions, --channels' channels, massive activations and outlier features, --heads' heads and
a MoE model's experts, as rows of their own `kind`, with the same columns and dtypes whatever
the report measured.

Oracles: the report's own records, field by field; torch in float64 on the tensors a hook of
the test's own kept (each position's and each channel's numbers over the real tokens, the
tokenizer's attention mask telling which); values planted in the model (a massive activation,
an outlier feature, a dead channel); pyarrow's and Python's csv readers on the files."""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.records import Report

pd = pytest.importorskip("pandas", reason="pip install 'hookcli[pandas]'")
pa = pytest.importorskip("pyarrow", reason="pip install 'hookcli[pandas]'")
pq = pytest.importorskip("pyarrow.parquet", reason="pip install 'hookcli[pandas]'")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

runner = CliRunner()
TEXTS = ["The cat sat on the mat.", "hello world"]  # a padded batch: the second is shorter
MASSIVE = (0, 2, 11)  # where layer 0's MLP output holds a planted massive activation
FEATURE, DEAD = 5, 3  # channels every MLP output holds at 7.0 (|x| >= 6) and at 0
FAMILIES = ("token", "channel", "massive", "outlier_feature", "head", "expert")
# the families' columns and the Arrow type each has in every file, written out here
FAMILY_TYPES = {
    "sequence": "int64", "position": "int64", "token": "string", "token_id": "int64",
    "channel": "int64", "axis": "int64", "width": "int64", "head": "int64", "expert": "int64",
    "count": "int64", "total": "int64", "top_k": "int64", "max_abs": "double",
    "large": "int64", "masked": "int64", "kurtosis": "double", "value": "double",
    "index": "list<element: int64>", "ratio": "double", "share": "double", "sink": "double",
    "entropy": "double", "top_key": "int64",
}  # fmt: skip
HEAD_COLUMNS = ["head", "sink", "top_key"]
EXPERT_COLUMNS = ["expert", "top_k"]


class Llm:
    """A tiny Llama's report with --per-token, --channels and --heads, and what the test's own
    hooks kept of it."""

    def __init__(self, report: Report, kept: dict[str, torch.Tensor], mask: torch.Tensor):
        self.report = report
        self.kept = kept  # "block": model.layers.0's output, "down": its MLP's output
        self.mask = mask  # the tokenizer's attention mask of TEXTS (1: a real token)
        self.ids: torch.Tensor = torch.empty(0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.llm import save

    return save(tmp_path_factory.mktemp("families_llama"), "llama")


@pytest.fixture(scope="module")
def llm(folder: Path) -> Llm:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    layers = model.model.layers

    def plant(spike: bool) -> Any:
        def hook(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            out = out.clone()
            out[..., FEATURE] = 7.0
            out[..., DEAD] = 0.0
            if spike:
                out[MASSIVE] = 3000.0
            return out

        return hook

    kept: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Any:
        def hook(m: nn.Module, args: Any, out: Any) -> None:
            # the first pass, the one measured (--heads runs an eager-attention pass after it)
            if name not in kept:
                kept[name] = (out[0] if isinstance(out, tuple) else out).detach().clone()

        return hook

    for k in range(2):
        layers[k].mlp.down_proj.register_forward_hook(plant(spike=k == 0))
    layers[0].mlp.down_proj.register_forward_hook(keep("down"))  # after the planting
    layers[0].register_forward_hook(keep("block"))
    report = hookcli.inspect(
        model, text=TEXTS, tokenizer=str(folder), device="cpu", topk=0, per_token=True,
        channels=True, heads=True, layers=["model.layers.0", "model.layers.*.mlp.down_proj"],
    )  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    got = Llm(report, kept, enc.attention_mask.bool())
    got.ids = enc.input_ids
    return got


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Report:
    from tests.support.llm import save

    mixtral = save(tmp_path_factory.mktemp("families_mixtral"), "mixtral")
    return hookcli.inspect(f"hf:{mixtral}", text=TEXTS, device="cpu", topk=0)


@pytest.fixture(scope="module")
def plain() -> Report:
    torch.manual_seed(0)
    return hookcli.inspect(nn.Linear(4, 4), torch.randn(2, 4))


def _missing(x: Any) -> bool:
    return x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x))


def _cells(row: Any, want: dict[str, Any]) -> None:
    """Each named cell of a frame row is exactly the value given (None: missing)."""
    for key, value in want.items():
        got = row[key]
        if value is None:
            assert _missing(got), (key, got)
        elif isinstance(value, tuple):
            assert tuple(got) == value, key
        else:
            assert not _missing(got) and got == value, (key, got, value)


def _rows(frame: Any, kind: str) -> list[Any]:
    return [r for _, r in frame[frame["kind"] == kind].iterrows()]


# ---------------------------------------------------------------- each family's rows


def test_token_rows_are_each_positions_records_and_torchs_numbers(llm: Llm) -> None:
    report, frame = llm.report, llm.report.to_pandas()
    records = [
        (c, t, r)
        for c in report.layers
        for t in (*c.inputs, *c.outputs, *(c.grad_inputs or []), *(c.grad_outputs or []))
        for r in t.per_token or ()
    ] + [(None, t, r) for t in report.outputs for r in t.per_token or ()]
    rows = _rows(frame, "token")
    assert len(rows) == len(records) >= 3 * int(llm.mask.sum())  # block and both MLP outputs
    for (c, t, r), row in zip(records, rows, strict=True):
        _cells(row, {
            "layer": c.name if c else "(model)", "type": c.type if c else "output",
            "call": c.call if c else 0, "path": t.path, "sequence": r.sequence,
            "position": r.position, "token": r.token, "token_id": r.id, "norm": r.norm,
            "mean": r.mean, "std": r.std, "max_abs": r.max_abs, "channel": r.channel,
            "shape": None, "numel": None, "min": None, "head": None, "expert": None,
        })  # fmt: skip
    # the numbers themselves: torch in float64 on the tensors kept, real positions only
    checked = 0
    for layer, name in (("model.layers.0", "block"), ("model.layers.0.mlp.down_proj", "down")):
        kept = llm.kept[name].double()
        mine = [r for r in rows if r["layer"] == layer and r["path"] == "out"]
        assert len(mine) == int(llm.mask.sum())
        for row in mine:
            columns = llm.mask[row["sequence"]].nonzero().flatten().tolist()
            where = (int(row["sequence"]), columns[int(row["position"])])
            assert row["token_id"] == int(llm.ids[where])
            x = kept[where]
            assert row["norm"] == pytest.approx(float(x.norm()), rel=1e-5)
            assert row["mean"] == pytest.approx(float(x.mean()), rel=1e-4, abs=1e-6)
            assert row["std"] == pytest.approx(float(x.std(correction=0)), rel=1e-5)
            assert row["max_abs"] == pytest.approx(float(x.abs().max()), rel=1e-5)
            assert row["channel"] == int(x.abs().argmax())
            checked += 1
    assert checked == 2 * int(llm.mask.sum())
    spike = next(r for r in rows if r["layer"] == "model.layers.0.mlp.down_proj"
                 and (r["sequence"], r["position"]) == MASSIVE[:2])  # fmt: skip
    assert spike["channel"] == MASSIVE[2] and spike["max_abs"] == 3000.0
    assert spike["token"] == " sat"


def test_channel_rows_are_each_channels_records_and_torchs_numbers(llm: Llm) -> None:
    report, frame = llm.report, llm.report.to_pandas()
    rows = _rows(frame, "channel")
    measured = [(c, t) for c in report.layers for t in (*c.inputs, *c.outputs) if t.channels]
    assert len(rows) == sum(len(t.channels.count) for _, t in measured if t.channels) > 0
    it = iter(rows)
    for c, t in measured:
        ch = t.channels
        assert ch is not None
        median = statistics.median(a for a in ch.absmax if a is not None)
        for k in range(len(ch.count)):
            peak = ch.absmax[k]
            _cells(next(it), {
                "layer": c.name, "type": c.type, "call": c.call, "path": t.path, "channel": k,
                "axis": ch.axis, "count": ch.count[k], "mean": ch.mean[k], "std": ch.std[k],
                "min": ch.min[k], "max": ch.max[k], "max_abs": peak, "large": ch.large[k],
                "zeros": ch.zeros[k] / ch.count[k] if ch.count[k] else None,
                "ratio": peak / median if peak is not None and median else None,
                "sequence": None, "head": None,
            })  # fmt: skip
        # the tensor's own row gains its width, axis, masked values, kurtosis, outlier ratio
        (own,) = [
            r for _, r in frame[frame["kind"].isin(["input", "output"])].iterrows()
            if (r["layer"], r["call"], r["path"]) == (c.name, c.call, t.path)
        ]  # fmt: skip
        _cells(own, {"width": len(ch.count), "axis": ch.axis, "masked": ch.masked,
                     "kurtosis": ch.kurtosis, "ratio": ch.outlier_ratio,
                     "count": None})  # fmt: skip
    # the MLP's output over the real tokens, by hand
    x = llm.kept["down"].double()[llm.mask]  # (real tokens, channels)
    mine = [r for r in rows if r["layer"] == "model.layers.0.mlp.down_proj" and r["path"] == "out"]
    assert [r["channel"] for r in mine] == list(range(x.shape[1]))
    peaks = x.abs().amax(0)
    median = statistics.median(peaks.tolist())  # of an even count, the middle two's mean
    for row, col, peak in zip(mine, x.T, peaks, strict=True):
        assert row["count"] == len(col) and row["axis"] == 2
        assert row["mean"] == pytest.approx(float(col.mean()), rel=1e-5, abs=1e-7)
        assert row["std"] == pytest.approx(float(col.std(correction=0)), rel=1e-5, abs=1e-7)
        assert row["min"] == pytest.approx(float(col.min()), rel=1e-6)
        assert row["max"] == pytest.approx(float(col.max()), rel=1e-6)
        assert row["max_abs"] == pytest.approx(float(peak), rel=1e-6)
        assert row["zeros"] == float((col == 0).double().mean())
        assert row["large"] == int((col.abs() >= 6).sum())
        assert row["ratio"] == pytest.approx(float(peak) / median, rel=1e-6)
    assert mine[DEAD]["zeros"] == 1.0 and mine[FEATURE]["large"] == len(x)


def test_massive_activations_and_outlier_features_are_rows(llm: Llm) -> None:
    found = llm.report.outliers
    assert found is not None and found.massive and found.features
    frame = llm.report.to_pandas()
    types = {c.name: c.type for c in llm.report.layers}
    rows = _rows(frame, "massive")
    assert len(rows) == len(found.massive)
    for m, row in zip(found.massive, rows, strict=True):
        _cells(row, {
            "layer": m.layer, "type": types[m.layer], "call": m.call, "path": m.path,
            "channel": m.channel, "index": tuple(m.index), "sequence": m.sequence,
            "position": m.position, "value": m.value, "ratio": m.ratio, "max_abs": None,
        })  # fmt: skip
    planted = rows[0]  # largest first: the planted value itself
    _cells(planted, {"layer": "model.layers.0.mlp.down_proj", "type": "Linear", "path": "out",
                     "index": MASSIVE, "channel": MASSIVE[2], "value": 3000.0,
                     "sequence": MASSIVE[0], "position": MASSIVE[1]})  # fmt: skip
    features = _rows(frame, "outlier_feature")
    assert len(features) == len(found.features)
    for f, row in zip(found.features, features, strict=True):
        _cells(row, {"layer": None, "call": None, "channel": f.channel, "width": f.width,
                     "count": f.layers, "total": f.of, "share": f.share})  # fmt: skip
    # channel 5 is at 7.0 in every real token of all three outputs of width 32
    assert any(
        (r["channel"], r["width"], r["count"], r["total"], r["share"]) == (FEATURE, 32, 3, 3, 1.0)
        for r in features
    )


def test_head_rows_are_each_heads_records(llm: Llm) -> None:
    heads = llm.report.heads
    assert heads
    rows = _rows(llm.report.to_pandas(), "head")
    assert len(rows) == len(heads) == 2 * 4 * len(TEXTS)  # 2 attention calls, 4 heads
    for h, row in zip(heads, rows, strict=True):
        _cells(row, {
            "layer": h.layer, "call": h.call, "path": h.module, "sequence": h.sequence,
            "head": h.head, "sink": h.sink, "entropy": h.entropy, "top_key": h.top_key,
            "share": h.top_share, "count": h.queries, "type": None, "mean": None,
        })  # fmt: skip
    assert {(r["layer"], r["sequence"], r["head"]) for r in rows} == {
        (f"model.layers.{k}", s, h) for k in range(2) for s in range(len(TEXTS)) for h in range(4)
    }
    # each sequence's queries after its first
    assert {(r["sequence"], r["count"]) for r in rows} == {(0, 6), (1, 1)}


def test_expert_rows_are_each_routers_counts(moe: Report) -> None:
    assert moe.experts
    rows = _rows(moe.to_pandas(), "expert")
    assert len(rows) == sum(e.experts for e in moe.experts) == 2 * 4
    tokens = sum(len(t.ids) for t in moe.input.texts or [])
    it = iter(rows)
    for e in moe.experts:
        mine = [next(it) for _ in e.counts]
        for k, (n, row) in enumerate(zip(e.counts, mine, strict=True)):
            _cells(row, {"layer": e.layer, "expert": k, "count": n, "total": e.tokens,
                         "top_k": e.top_k, "entropy": e.entropy, "call": None,
                         "share": n / sum(e.counts)})  # fmt: skip
        assert e.top_k == 2 and sum(r["count"] for r in mine) == tokens * 2 == e.tokens * 2
        assert sum(r["share"] for r in mine) == pytest.approx(1.0)
        assert max(r["ratio"] for r in mine) == e.imbalance
        assert [r["ratio"] for r in mine] == pytest.approx(
            [n * 4 / sum(e.counts) for n in e.counts]
        )
        p = torch.tensor([r["share"] for r in mine], dtype=torch.float64)
        p = p[p > 0]
        assert e.entropy == pytest.approx(float(-(p * p.log()).sum()))


def test_families_follow_the_tensor_rows_which_are_unchanged(llm: Llm, moe: Report) -> None:
    for report in (llm.report, moe):
        kinds = list(report.to_pandas()["kind"])
        tensors = [k for k in kinds if k not in FAMILIES]
        assert kinds[: len(tensors)] == tensors  # every family row after every tensor row
        families = [k for k in kinds if k in FAMILIES]
        assert families == sorted(families, key=FAMILIES.index)
        calls = report.layers
        count = sum(len(c.inputs) + len(c.outputs) for c in calls) + len(report.outputs)
        assert len(tensors) == count
    assert set(llm.report.to_pandas()["kind"]) >= set(FAMILIES) - {"expert"}


# ---------------------------------------------------------------- one schema for every report


def test_every_report_has_the_same_columns_and_dtypes(llm: Llm, moe: Report, plain: Report) -> None:
    frames = [r.to_pandas() for r in (llm.report, moe, plain)]
    assert [list(f.columns) for f in frames[1:]] == [list(frames[0].columns)] * 2
    assert all(f.dtypes.equals(frames[0].dtypes) for f in frames[1:])
    assert set(FAMILY_TYPES) <= set(frames[0].columns)
    for name, arrow in FAMILY_TYPES.items():
        want = {"int64": "Int64", "double": "float64"}.get(arrow, "object")
        assert str(frames[0][name].dtype) == want, name
    llm_frame, moe_frame, plain_frame = frames
    assert not llm_frame[HEAD_COLUMNS].isna().all().any()  # measured: filled
    assert moe_frame[HEAD_COLUMNS].isna().all().all()  # no heads asked: null, not missing
    assert llm_frame[EXPERT_COLUMNS].isna().all().all()  # a dense model
    assert not moe_frame[EXPERT_COLUMNS].isna().all().any()
    assert plain_frame[list(FAMILY_TYPES)].isna().all().all()


def _same_frame(back: Any, frame: Any) -> None:
    assert list(back.columns) == list(frame.columns) and len(back) == len(frame)
    for col in frame.columns:
        for a, b in zip(back[col], frame[col], strict=True):
            if col in ("shape", "values", "index"):
                assert (a is None and b is None) or list(a) == list(b), col
            elif _missing(a) or _missing(b):
                assert _missing(a) and _missing(b), col
            else:
                assert a == b, col


def test_parquet_has_one_fixed_schema_and_the_frames_rows(
    llm: Llm, moe: Report, plain: Report, tmp_path: Path
) -> None:
    from hookcli.render.tabular import parquet

    saved = tmp_path / "llm.json"
    saved.write_text(json.dumps(llm.report.to_dict()))
    (tmp_path / "runs").mkdir()
    res = runner.invoke(app, ["report", str(saved), "-o", str(tmp_path / "runs" / "llm.parquet")])
    assert res.exit_code == 0, res.output
    (tmp_path / "runs" / "moe.parquet").write_bytes(parquet(moe))
    (tmp_path / "runs" / "plain.parquet").write_bytes(parquet(plain))
    schemas = [pq.read_schema(tmp_path / "runs" / f"{n}.parquet") for n in ("llm", "moe", "plain")]
    assert all(s.equals(schemas[0], check_metadata=False) for s in schemas[1:])
    for name, arrow in FAMILY_TYPES.items():
        assert str(schemas[0].field(name).type) == arrow, name
    for name, report in (("llm", llm.report), ("moe", moe), ("plain", plain)):
        back = pq.read_table(tmp_path / "runs" / f"{name}.parquet").to_pandas()
        _same_frame(back, report.to_pandas())
    both = pd.read_parquet(tmp_path / "runs")  # a folder of runs reads back as one table
    assert len(both) == sum(len(r.to_pandas()) for r in (llm.report, moe, plain))
    assert set(both["kind"]) >= set(FAMILIES)


def _csv_matches(text: str, frame: Any) -> None:
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0] == list(frame.columns) and len(rows) == len(frame) + 1
    for cells, (_, want) in zip(rows[1:], frame.iterrows(), strict=True):
        for name, cell in zip(rows[0], cells, strict=True):
            value = want[name]
            if name in ("values", "index"):
                assert (json.loads(cell) if cell else None) == (
                    None if value is None else list(value)
                ), name
            elif name == "shape":
                assert cell == ("" if value is None else "x".join(map(str, value)))
            elif _missing(value):
                assert cell == "", name
            elif isinstance(value, str):
                assert cell == value, name
            elif isinstance(value, float):
                assert float(cell) == value, name  # every digit
            else:
                assert cell == str(int(value)), name


def test_csv_has_the_frames_rows(llm: Llm, moe: Report, tmp_path: Path) -> None:
    saved = tmp_path / "llm.json"
    saved.write_text(json.dumps(llm.report.to_dict()))
    res = runner.invoke(app, ["report", str(saved), "-o", str(tmp_path / "llm.csv")])
    assert res.exit_code == 0, res.output
    frame = llm.report.to_pandas()
    _csv_matches((tmp_path / "llm.csv").read_text(), frame)
    _csv_matches(hookcli.formatted(moe, "csv"), moe.to_pandas())
    tokens = [r for r in csv.DictReader(io.StringIO(hookcli.formatted(llm.report, "csv")))
              if r["kind"] == "token"]  # fmt: skip
    assert {" cat", "hello", " world"} <= {r["token"] for r in tokens}  # spaces kept


def test_with_profile_the_family_rows_have_no_times(moe: Report) -> None:
    """--profile's columns are a call's, on its tensors' rows; the families' rows leave them
    empty (a router's counts are the run's, not one call's)."""
    import dataclasses

    from hookcli.records import CallProfile, Profile

    timed = dataclasses.replace(
        moe,
        layers=[dataclasses.replace(c, profile=CallProfile(1.5, None, 8, flops=7))
                for c in moe.layers],
        profile=Profile(unhooked_ms=1.0, layers_ms=1.0, runs=1),
    )  # fmt: skip
    frame = timed.to_pandas()
    assert list(frame.columns)[-4:] == ["forward_ms", "self_ms", "backward_ms", "flops"]
    experts = frame[frame["kind"] == "expert"]
    assert len(experts) == 8 and experts["forward_ms"].isna().all()
    assert experts["flops"].isna().all()
    calls = frame[frame["kind"].isin(["input", "output"])]
    assert len(calls) > 0 and (calls["forward_ms"] == 1.5).all() and (calls["flops"] == 7).all()
