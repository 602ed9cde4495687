"""A watched run in TensorBoard (issue 38, item 3): `hookcli.watch(..., tensorboard=DIR)` while
training and `hookcli report run.jsonl -f tensorboard -o DIR` afterwards. Oracle: TensorBoard's
own event reader (EventAccumulator) on both folders, against the run's JSON series
(`hookcli report run.jsonl -f json`)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.errors import UsageError
from tests.support.cli import assert_one_line_error
from tests.support.watch import Tiny, tiny_batches

accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="pip install 'hookcli[tensorboard]'",
)
runner = CliRunner()
STEPS = 7


def _train(tmp: Path, every: int = 2, **watch: Any) -> Any:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with hookcli.watch(model, optimizer=opt, every=every, log=tmp / "run.jsonl", **watch) as w:
        for x, y in tiny_batches(STEPS):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            w.loss(loss)
            loss.backward()
            opt.step()
    return w


def _read(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a folder's event files, as TensorBoard reads them."""
    acc = accumulator.EventAccumulator(str(folder), size_guidance={accumulator.SCALARS: 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _expected(series: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """The scalars the run's JSON series say there are: null values left out."""
    steps = series["run"]["steps"]
    out: dict[str, list[tuple[int, float]]] = {}

    def add(tag: str, values: list[float | None]) -> None:
        pairs = [(s, v) for s, v in zip(steps, values, strict=True) if v is not None]
        if pairs:
            out[tag] = pairs

    add("loss", series["loss"]["series"]["loss"])
    for t in series["layers"]:
        for metric, values in t["series"].items():
            slug = metric.replace("/", "_").replace(" ", "_")
            add(f"layers/{t['name']}:{t['call']}/{slug}", values)
    for t in series["params"]:
        for metric, values in t["series"].items():
            add(f"params/{t['name']}/{metric.replace(' ', '_')}", values)
    return out


def _same(
    got: dict[str, list[tuple[int, float]]], want: dict[str, list[tuple[int, float]]]
) -> None:
    assert sorted(got) == sorted(want)
    for tag, pairs in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in pairs], tag
        for (_, a), (_, b) in zip(got[tag], pairs, strict=True):
            assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-30), (tag, a, b)  # float32


def test_live_sink_and_export_hold_the_runs_series(tmp_path: Path) -> None:
    w = _train(tmp_path, tensorboard=tmp_path / "live")
    assert len(w.records) == 4  # steps 0, 2, 4, 6
    res = runner.invoke(app, ["report", str(tmp_path / "run.jsonl"), "-f", "json"])
    assert res.exit_code == 0, res.output
    want = _expected(json.loads(res.stdout))
    assert "loss" in want and any(t.startswith("layers/conv:0/") for t in want)
    assert any(t.endswith("/update_ratio") for t in want)
    out = tmp_path / "export"
    res = runner.invoke(
        app, ["report", str(tmp_path / "run.jsonl"), "-f", "tensorboard", "-o", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "scalars over 4 steps" in res.stderr
    _same(_read(tmp_path / "live"), want)
    _same(_read(out), want)


def test_a_failing_sink_never_hurts_the_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The disk fills under TensorBoard's record writer: one line, the training and its log
    go on, and no traceback from a thread of TensorBoard's."""
    from tensorboard.summary.writer import record_writer

    real = record_writer.RecordWriter.write
    calls = [0]

    def filling(self: object, data: bytes) -> None:
        calls[0] += 1
        if calls[0] > 2:  # the header and the first step are written
            raise OSError(28, "No space left on device")
        real(self, data)  # type: ignore[arg-type]

    monkeypatch.setattr(record_writer.RecordWriter, "write", filling)
    w = _train(tmp_path, tensorboard=tmp_path / "live")
    assert len(w.records) == 4  # every watched step still recorded and logged
    assert len((tmp_path / "run.jsonl").read_text().splitlines()) == 4
    err = capsys.readouterr().err
    assert err.count("TensorBoard stopped") == 1 and "No space left" in err
    assert "Traceback" not in err
    assert len(_read(tmp_path / "live")["loss"]) == 1  # what was written before stays readable


def test_a_refused_watch_leaves_the_earlier_log_and_folder_alone(tmp_path: Path) -> None:
    _train(tmp_path)
    before = (tmp_path / "run.jsonl").read_text()
    (tmp_path / "taken").write_text("x")
    with pytest.raises(UsageError, match="is a file"):
        _train(tmp_path, tensorboard=tmp_path / "taken")
    with pytest.raises(UsageError, match="must be a folder"):
        _train(tmp_path, tensorboard=True)
    assert (tmp_path / "run.jsonl").read_text() == before
    _train(tmp_path, tensorboard=tmp_path / "tb")
    with pytest.raises(UsageError, match="already holds TensorBoard files"):
        _train(tmp_path, tensorboard=tmp_path / "tb")  # a second run: every point twice


@pytest.mark.parametrize("tracker", ["tensorboard", "mlflow", "wandb"])
@pytest.mark.parametrize(
    ("out", "needle"),
    [
        (None, "add -o"),
        ("{file}", "is a file"),
        ("-", "writes a folder, not -"),
        ("/proc/hookcli-no", "cannot write"),
    ],
)
def test_export_errors_are_one_line(
    tmp_path: Path, tracker: str, out: str | None, needle: str
) -> None:
    pytest.importorskip(tracker)
    _train(tmp_path)
    (tmp_path / "file").write_text("x")
    given = [] if out is None else ["-o", out.replace("{file}", str(tmp_path / "file"))]
    res = runner.invoke(app, ["report", str(tmp_path / "run.jsonl"), "-f", tracker, *given])
    assert_one_line_error(res, 2, needle)


def test_export_into_a_used_folder_is_refused(tmp_path: Path) -> None:
    _train(tmp_path)
    log = str(tmp_path / "run.jsonl")
    tb = tmp_path / "tb"
    assert runner.invoke(app, ["report", log, "-f", "tensorboard", "-o", str(tb)]).exit_code == 0
    res = runner.invoke(app, ["report", log, "-f", "tensorboard", "-o", str(tb)])
    assert_one_line_error(res, 2, "already holds TensorBoard files")
    if importlib.util.find_spec("mlflow") is not None:
        (tmp_path / "mixed" / "my.data").mkdir(parents=True)
        res = runner.invoke(app, ["report", log, "-f", "mlflow", "-o", str(tmp_path / "mixed")])
        assert_one_line_error(res, 2, "not an MLflow experiment")


def test_mlflow_keys_never_merge_two_layers() -> None:
    from hookcli.commands.watch.trackers import _mlflow_keys

    tags = ["layers/d.a+b:0/grad_norm", "layers/d.a_b:0/grad_norm", "layers/d.c:0/grad_norm"]
    keys = _mlflow_keys(tags)
    assert len(set(keys.values())) == 3
    assert keys["layers/d.c:0/grad_norm"] == "layers/d.c:0/grad_norm"  # untouched when unique
    assert all(keys[t].startswith("layers/d.a_b:0/grad_norm_") for t in tags[:2])


def test_tensorboard_is_for_run_logs_only(tmp_path: Path) -> None:
    res = runner.invoke(app, ["inspect", "resnet18", "-f", "tensorboard"])
    assert_one_line_error(res, 2, "training log")
    saved = tmp_path / "r.json"
    saved.write_text(json.dumps(hookcli.inspect(Tiny(), torch.randn(1, 3, 8, 8)).to_dict()))
    res = runner.invoke(app, ["report", str(saved), "-f", "tensorboard", "-o", str(tmp_path)])
    assert_one_line_error(res, 2, "run.jsonl")


def test_without_tensorboard_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hookcli.commands.watch import trackers

    _train(tmp_path)
    monkeypatch.setattr(trackers, "installed", lambda name: False)
    out = tmp_path / "tb"
    res = runner.invoke(
        app, ["report", str(tmp_path / "run.jsonl"), "-f", "tensorboard", "-o", str(out)]
    )
    assert_one_line_error(res, 2, "pip install 'hookcli[tensorboard]'")
    assert not out.exists()


# ---------------------------------------------------------------- MLflow and W&B


def _exported(tmp_path: Path, tracker: str, out: Path | str) -> dict[str, Any]:
    """The run's JSON series, once the log is exported to `tracker` at `out`."""
    _train(tmp_path)
    log = str(tmp_path / "run.jsonl")
    res = runner.invoke(app, ["report", log, "-f", tracker, "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "scalars over 4 steps" in res.stderr
    return json.loads(runner.invoke(app, ["report", log, "-f", "json"]).stdout)  # type: ignore[no-any-return]


def _exact(
    got: dict[str, list[tuple[int, float]]], want: dict[str, list[tuple[int, float]]]
) -> None:
    assert sorted(got) == sorted(want)
    for tag, pairs in want.items():
        assert sorted(got[tag]) == pairs, tag  # float64 both sides: every digit


def test_mlflow_file_store_holds_the_runs_series(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracking = pytest.importorskip("mlflow.tracking", reason="pip install 'hookcli[mlflow]'")
    store = tmp_path / "mlruns"
    data = _exported(tmp_path, "mlflow", store)
    want = _expected(data)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: the reader's side
    client = tracking.MlflowClient(tracking_uri=store.resolve().as_uri())
    experiment = client.get_experiment_by_name("hookcli")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    got = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in run.data.metrics
    }
    _exact(got, want)


def _wandb_records(path: Path) -> list[Any]:
    """The records of a W&B run file (LevelDB's log format: 32 KiB blocks of records, each a
    7-byte header and a payload, a payload split FIRST/MIDDLE/LAST over blocks), parsed with
    W&B's own protobuf schema. W&B 0.31 ships no Python reader of its own."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, parts, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # the rest of the block is padding
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


def test_wandb_offline_run_holds_the_runs_series(tmp_path: Path) -> None:
    pytest.importorskip("wandb", reason="pip install 'hookcli[wandb]'")
    data = _exported(tmp_path, "wandb", tmp_path / "wb")
    (run_file,) = (tmp_path / "wb").glob("wandb/offline-run-*/run-*.wandb")
    got: dict[str, list[tuple[int, float]]] = {}
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") != "history":
            continue
        step = record.history.step.num
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):  # W&B's own (_step, _runtime, _timestamp)
                got.setdefault(key, []).append((step, json.loads(item.value_json)))
    _exact(got, _expected(data))
