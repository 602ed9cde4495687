"""hookcli.watch under a real torchrun: two processes (gloo, CPU) of DistributedDataParallel,
each on its half of every batch, each writing its own log; merged, the rank logs equal the log
of the same training in one process over the whole batches — layer statistics, gradients
(scaled by 1/W), parameters, loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.commands.watch import runmerge
from tests.support.launch import run_python, run_torchrun
from tests.support.paths import ROOT
from tests.support.watchlogs import assert_same_run, read_steps

SCRIPT = ROOT / "tests" / "support" / "ddp_train.py"


def _torchrun(tmp_path: Path, *extra: str) -> None:
    """tests/support/ddp_train.py in two processes (gloo, CPU), its logs in tmp_path."""
    pytest.importorskip("torch.distributed")
    run_torchrun(SCRIPT, [str(tmp_path), *extra], tmp_path)


def test_merged_ddp_rank_logs_equal_one_process(tmp_path: Path) -> None:
    _torchrun(tmp_path)
    run_python([str(SCRIPT), str(tmp_path), "--single"], tmp_path)
    logs = [tmp_path / "run.rank0.jsonl", tmp_path / "run.rank1.jsonl"]
    for r, log in enumerate(logs):
        first = json.loads(log.read_text().splitlines()[0])
        assert (first["rank"], first["world_size"]) == (r, 2)
        assert first["layers"][0]["outputs"][0]["shape"][0] == 4  # its half of the batch
    merged = runmerge.load_run(logs)
    assert merged.ranks == 2 and merged.notes == [], merged.notes  # parameters agree
    single = [json.loads(x) for x in (tmp_path / "single.jsonl").read_text().splitlines()]
    assert [s["step"] for s in single] == [0, 1, 2, 3]
    assert_same_run(merged.steps, read_steps(tmp_path / "single.jsonl"))
    # the CLI finds the rank logs from the name given to hookcli.watch, and merges them
    r = CliRunner().invoke(app, ["report", str(tmp_path / "run.jsonl"), "-f", "json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["run"]["merged_ranks"] == 2
    assert data["loss"]["series"]["loss"][0] == pytest.approx(single[0]["loss"], rel=1e-5)


def test_a_nan_on_one_rank_each_rank_says_so_and_rank_0_and_the_cause_bundle(
    tmp_path: Path,
) -> None:
    """A NaN in rank 1's data at step 2: both ranks log it (the all-reduce spreads it to rank
    0's gradients); rank 1's re-run names its origin, the model's input, and writes a bundle;
    rank 0 writes one too (the default bundle rank) with no layer call of its own to blame.
    `hookcli check` over the merged logs fails at step 2."""
    _torchrun(tmp_path, "--nan-step", "2")
    events = []
    for r in (0, 1):
        lines = [json.loads(x) for x in (tmp_path / f"run.rank{r}.jsonl").read_text().splitlines()]
        (event,) = [x for x in lines if x["kind"] == "nonfinite"]
        events.append(event)
        assert event["step"] == 2 and event["rank"] == r
        assert event["bundle"] == str(tmp_path / f"run.rank{r}.bundle")
    rank0, rank1 = events
    assert rank0["found"] == ["grad"] and rank0["origins"] == []
    assert "output" in rank1["found"]
    first = rank1["origins"][0]
    assert (first["direction"], first["where"], first["layer"]) == ("forward", "before", "conv")
    r = CliRunner().invoke(app, ["check", str(tmp_path / "run.jsonl")])
    assert r.exit_code == 1
    assert "step 2" in r.output + r.stderr
