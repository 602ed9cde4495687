"""Reading hookcli.watch logs back (issue 17, item 3): validation, the exact merge of rank
logs (against one process over the whole batch), the rules over a run (each with a case that
fails and one that passes), `hookcli check run.jsonl`, `hookcli report` and its PNG."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.commands.watch import logread, runmerge, runrules, runseries
from hookcli.errors import UsageError
from hookcli.io.recordjson import RecordError
from hookcli.records import StepLine, log_line
from tests.support.cli import assert_one_line_error
from tests.support.paths import ROOT
from tests.support.watch import Tiny, tiny_batches
from tests.support.watchlogs import (
    assert_same_run,
    call_dict,
    emulated_ddp,
    param_dict,
    read_lines,
    read_steps,
    step_dict,
    tensor_dict,
    train_watched,
    write_log,
)

runner = CliRunner()


def run(*args: str) -> Any:
    return runner.invoke(app, list(args))


# ---------------------------------------------------------------- building logs


ORIGIN = {
    "direction": "forward", "layer": "log", "type": "Log", "call": 0, "path": "out", "nan": 3,
    "inf": 0, "where": "layer", "after": None, "after_finite": None, "code": [],
}  # fmt: skip


def _checks(path: Path, **rules: Any) -> dict[str, Any]:
    """Each rule's verdict over the log at path, by rule name."""
    got = runrules.evaluate_run(runmerge.load_run([path]), runrules.parse_run_rules(**rules))
    return {c.rule: c for c in got}


# ---------------------------------------------------------------- reading


def test_a_real_log_reads_back_with_its_steps(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    train_watched(Tiny(), tiny_batches(5), log, every=2)
    r = runmerge.load_run([log])
    assert r.step_numbers == [0, 2, 4] and r.ranks == 1 and r.notes == []
    assert [c.name for c in r.steps[0].layers] == ["conv", "act", "fc"]
    # read_log builds each record from the checked line: the record step_line reads, whose
    # every field is checked against its type
    assert r.steps == read_steps(log)


def test_a_line_with_only_the_checked_fields_reads_as_a_record(tmp_path: Path) -> None:
    """What the checks leave optional reads as the readers always took it: no loss, no dtype,
    no statistics, no norms, no error, no origins."""
    sparse = step_dict(0, params=[{"name": "w", "grad": None}])
    del sparse["loss"], sparse["nonfinite_origins"]
    out = sparse["layers"][0]["outputs"][0]
    for key in ("dtype", "mean", "nan", "inf", "note", "layout"):
        del out[key]
    del sparse["layers"][0]["error"]
    event = {"schema": 1, "kind": "nonfinite", "step": 0, "rank": 0, "world_size": 1, "found": []}
    log = logread.read_log(write_log(tmp_path, [sparse, event]))
    step = log.steps[0]
    assert step.loss is None and step.nonfinite_origins == [] and step.layers[0].error is None
    t = step.layers[0].outputs[0]
    assert (t.dtype, t.mean, t.nan, t.inf, t.std) == ("", None, 0, 0, 1.0)
    p = step.params[0]
    assert (p.name, p.norm, p.grad, p.update_norm, p.update_ratio) == ("w", None, None, None, None)
    (e,) = log.events
    assert (e.found, e.origins, e.nonfinite_params, e.bundle, e.run) == ([], [], [], None, None)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("", "is empty"),
        ("\n\n", "is empty"),
        ("hello\n", "is not a hookcli.watch log: line 1 is not a JSON object"),
        ("[1, 2]\n", "is not a hookcli.watch log: line 1 is a list"),
        ('{"schema": 2, "layers": [], "model": {}}\n', "is a JSON report"),
        ('{"schema": 1, "kind": "step"}\n', "has no 'step'"),
        ('{"schema": 1, "kind": "step", "step": 0, "rank": 0, "world_size": 1, "loss": NaN}\n',
         "NaN is not a number"),
    ],
)  # fmt: skip
def test_a_file_that_is_not_a_log_is_a_one_line_error(
    tmp_path: Path, content: str, needle: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UsageError, match=r"run log .*bad\.jsonl") as e:
        runmerge.load_run([path])
    assert needle in str(e.value), str(e.value)
    assert e.value.hint
    r = run("check", str(path))
    assert_one_line_error(r, 2, "bad.jsonl")
    r = run("report", str(path))
    assert_one_line_error(r, 2, "bad.jsonl")


def test_a_bad_line_is_named_and_a_last_line_cut_short_is_a_note(tmp_path: Path) -> None:
    good = [json.dumps(step_dict(s)) for s in range(3)]
    path = tmp_path / "run.jsonl"
    path.write_text(good[0] + "\n" + good[1][:-5] + "\n" + good[2] + "\n")
    with pytest.raises(UsageError, match="line 2 is not a JSON object"):
        runmerge.load_run([path])
    bad = step_dict(1)
    bad["layers"][0]["outputs"][0]["numel"] = -1
    path.write_text(good[0] + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(UsageError, match=r"line 2 has numel = -1 in layers\[0\]\.outputs\[0\]"):
        runmerge.load_run([path])
    path.write_text(good[0] + "\n" + good[1] + "\n" + good[2][:40])  # the writer was killed
    r = runmerge.load_run([path])
    assert r.step_numbers == [0, 1]
    assert any("line 3 is incomplete" in n for n in r.notes)


def test_a_log_written_before_the_record_types_reads_back_as_records_unchanged() -> None:
    """tests/data/watch_log_v1.jsonl was written by hookcli.watch before log lines had record
    types (commit f3fefb7): three watched steps of Tiny, the third with a NaN in its input, so
    a nonfinite line too. Every line reads as its record (StepLine, NonfiniteLine), and the
    record writes back as the very same line, key for key and in order."""
    path = ROOT / "tests" / "data" / "watch_log_v1.jsonl"
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    assert [d["kind"] for d in raw] == ["step", "step", "nonfinite", "step"]
    run = runmerge.load_run([path])
    assert run.step_numbers == [0, 1, 2] and len(run.events) == 1
    assert run.steps == [logread.step_line(d) for d in raw if d["kind"] == "step"]
    assert run.events == [logread.nonfinite_line(raw[2])]
    # the JSON reports give the events as the log holds them
    for command in ("report", "check"):
        r = runner.invoke(app, [command, str(path), "-f", "json"])
        assert json.loads(r.stdout)["nonfinite_events"] == [raw[2]], command
    for data in raw:
        line = logread.step_line(data) if data["kind"] == "step" else logread.nonfinite_line(data)
        back = log_line(line)
        assert back == data and list(back) == list(data)
    first = logread.step_line(raw[0])
    assert [c.name for c in first.layers] == ["conv", "act", "fc"]
    out = first.layers[0].outputs[0]
    assert out.shape == tuple(raw[0]["layers"][0]["outputs"][0]["shape"]) and out.std is not None
    event = logread.nonfinite_line(raw[2])
    assert event.found and event.origins[0].direction == "forward"
    last = logread.step_line(raw[3])
    assert last.loss is None and last.loss_nonfinite


def test_a_field_of_the_wrong_type_in_a_line_read_as_a_record_is_named() -> None:
    bad = step_dict(0)
    bad["layers"][0]["error"] = 5
    with pytest.raises(RecordError, match=r"layers\[0\]\.error is a number"):
        logread.step_line(bad)


def test_a_disabled_grad_scaler_still_writes_its_null_scale() -> None:
    """As the recorder always wrote it: with a scaler, `skipped` and `scale` (null when the
    scaler is disabled); without one, neither."""
    line = StepLine(0, 0, 1, 1.0, [], [], skipped=False, scale=None)
    assert log_line(line)["skipped"] is False and log_line(line)["scale"] is None
    plain = log_line(StepLine(0, 0, 1, 1.0, [], []))
    assert "skipped" not in plain and "scale" not in plain and "loss_nonfinite" not in plain
    assert "merged_ranks" not in plain  # only a step merged from rank logs has it


def test_two_runs_appended_to_one_log_are_an_error(tmp_path: Path) -> None:
    path = write_log(tmp_path, [step_dict(0), step_dict(1), step_dict(0)])
    with pytest.raises(UsageError, match=r"holds step 0 twice \(lines 1 and 3\)"):
        runmerge.load_run([path])


def test_unknown_kinds_and_extra_keys_are_tolerated(tmp_path: Path) -> None:
    lines = [{"schema": 1, "kind": "start", "anything": 1}, step_dict(0, extra_key=[1, 2])]
    r = runmerge.load_run([write_log(tmp_path, lines)])
    assert r.step_numbers == [0]


def test_a_missing_log_is_a_one_line_error(tmp_path: Path) -> None:
    r = run("report", str(tmp_path / "none.jsonl"))
    assert_one_line_error(r, 2, "none.jsonl", "not found")
    r = run("check", str(tmp_path / "none.jsonl"))
    assert_one_line_error(r, 2, "none.jsonl", "not found")


# ---------------------------------------------------------------- merging


def test_merged_rank_logs_equal_one_process_over_the_whole_batch(tmp_path: Path) -> None:
    logs, single = emulated_ddp(tmp_path, steps=3, world=2)
    merged = runmerge.load_run(logs)
    assert merged.ranks == 2 and merged.notes == [], merged.notes
    assert all(s.merged_ranks == 2 and s.world_size == 1 for s in merged.steps)
    assert_same_run(merged.steps, read_steps(single))


def test_gradients_are_scaled_by_one_over_the_world_size(tmp_path: Path) -> None:
    """Without the 1/W scaling the merged gradient statistics would be W times too large:
    the comparison above can fail."""
    logs, single = emulated_ddp(tmp_path, steps=1, world=2)
    ranks = [read_steps(p)[0] for p in logs]
    merged, _ = runmerge.merge_step(ranks)
    want = read_steps(single)[0]
    fc = next(c for c in merged.layers if c.name == "fc")
    ref = next(c for c in want.layers if c.name == "fc")
    assert fc.grad_outputs is not None and ref.grad_outputs is not None
    assert fc.grad_outputs[0].norm == pytest.approx(ref.grad_outputs[0].norm, rel=1e-5)
    unscaled = runmerge.merge_tensors([[r.layers[2].grad_outputs[0]] for r in ranks])
    assert unscaled[0].norm == pytest.approx(2 * ref.grad_outputs[0].norm, rel=1e-5)
    wrong = dataclasses.replace(fc, grad_outputs=unscaled)
    with pytest.raises(AssertionError):
        assert_same_run([dataclasses.replace(merged, layers=[*merged.layers[:2], wrong])], [want])


def test_ranks_that_disagree_on_parameters_are_a_note(tmp_path: Path) -> None:
    logs, _ = emulated_ddp(tmp_path, steps=2, world=2, all_reduce=False)
    r = runmerge.load_run(logs)
    assert any("ranks disagree on" in n and "not one DistributedDataParallel" in n for n in r.notes)


def test_rank_logs_must_be_one_whole_run(tmp_path: Path) -> None:
    logs, _ = emulated_ddp(tmp_path, steps=2, world=2)
    with pytest.raises(UsageError, match=r"both rank 0's log"):
        runmerge.load_run([logs[0], logs[0]])
    alone = runmerge.load_run([logs[1]])  # one rank alone: read, with a note
    assert any("rank 1 of 2" in n for n in alone.notes)
    lines = logs[1].read_text().splitlines()
    logs[1].write_text(lines[0] + "\n")  # rank 1 stopped after step 0
    gone = r"run\.rank1\.jsonl \(rank 1\) has no step 1, which run\.rank0\.jsonl has"
    with pytest.raises(UsageError, match=gone):
        runmerge.load_run(logs)
    third = write_log(tmp_path, [step_dict(0)], "other.jsonl")
    with pytest.raises(
        UsageError, match=r"3 logs given for a run of 2 processes \(.*other.jsonl rank 0 of 1"
    ):
        runmerge.load_run([*logs, third])
    with pytest.raises(UsageError, match=r"1 logs given for a run of 2 processes \(rank 1 missing"):
        runmerge.merge_logs([logread.read_log(logs[0])])


def test_a_missing_log_name_finds_its_rank_logs(tmp_path: Path) -> None:
    logs, _ = emulated_ddp(tmp_path, steps=1, world=2)
    assert logread.expand_logs([str(tmp_path / "run.jsonl")]) == [str(p) for p in logs]
    r = run("check", str(tmp_path / "run.jsonl"))
    assert r.exit_code == 0, r.stderr
    assert "2 rank logs merged" in r.stdout
    # the crashed rank wrote no log: the run's name with rank 0's alone passed the check
    # (exit 0, a note); every rank's log or the one named, never a silent part
    logs[1].unlink()
    r = run("check", str(tmp_path / "run.jsonl"))
    assert_one_line_error(r, 2, "a run of 2 processes", "rank 1 is not there")
    r = run("check", str(logs[0]))  # one rank's log, named: read alone, said
    assert r.exit_code == 0 and "rank 0 of 2" in r.stdout


# ---------------------------------------------------------------- rules: nonfinite


def test_nonfinite_passes_on_a_finite_run_and_is_the_default(tmp_path: Path) -> None:
    checks = _checks(write_log(tmp_path, [step_dict(0), step_dict(1)]))
    assert list(checks) == ["nonfinite"] and checks["nonfinite"].passed


def test_nonfinite_fails_on_a_nan_statistic_naming_step_layer_and_origin(tmp_path: Path) -> None:
    bad = step_dict(2, [call_dict("log", "Log", out=tensor_dict(nan=3)), call_dict("act", "ReLU")])
    bad["nonfinite_origins"] = [ORIGIN]
    c = _checks(write_log(tmp_path, [step_dict(0), step_dict(1), bad]))["nonfinite"]
    assert not c.passed
    assert c.first is not None and (c.first.layer, c.first.call, c.first.step) == ("log", 0, 2)
    assert (
        "step 2" in c.message
        and "forward: first at log (Log) call 0, output out: 3 NaN" in c.message
    )


def test_nonfinite_fails_on_an_event_line_and_on_a_loss_gone_null(tmp_path: Path) -> None:
    event = {
        "schema": 1, "kind": "nonfinite", "step": 7, "rank": 0, "world_size": 1,
        "found": ["loss", "grad"], "origins": [{**ORIGIN, "direction": "backward"}],
        "nonfinite_params": ["fc.weight"], "bundle": "nan-step7.pt",
    }  # fmt: skip
    c = _checks(write_log(tmp_path, [step_dict(0), event]))["nonfinite"]
    assert not c.passed and c.first is not None and c.first.step == 7
    assert "step 7 (not watched)" in c.message and "backward: first at log (Log)" in c.message
    c = _checks(write_log(tmp_path, [step_dict(0), step_dict(1, loss=None)], "loss.jsonl"))[
        "nonfinite"
    ]
    assert not c.passed and "step 1" in c.message and "loss" in c.message
    # a run that never logged a loss is not non-finite for it
    assert _checks(write_log(tmp_path, [step_dict(0, loss=None)], "noloss.jsonl"))[
        "nonfinite"
    ].passed


def test_a_gradscaler_skipped_step_excuses_its_gradient_overflow_only(tmp_path: Path) -> None:
    overflow = step_dict(1, [call_dict("fc", grad=tensor_dict(inf=4))], skipped=True, scale=32768.0)
    c = _checks(write_log(tmp_path, [step_dict(0), overflow]))["nonfinite"]
    assert c.passed and "GradScaler skipped step 1" in c.message
    forward = step_dict(1, [call_dict("fc", out=tensor_dict(nan=1))], skipped=True)
    assert not _checks(write_log(tmp_path, [step_dict(0), forward], "f.jsonl"))["nonfinite"].passed


# ---------------------------------------------------------------- rules: dead, collapse


def _relu_run(tmp_path: Path, zeros: Sequence[float], name: str = "run.jsonl") -> Path:
    return write_log(
        tmp_path,
        [
            step_dict(s, [call_dict("act", "ReLU", out=tensor_dict(zeros=z))])
            for s, z in enumerate(zeros)
        ],
        name,
    )


def test_dead_after_k_fails_only_when_dead_at_every_step_from_k(tmp_path: Path) -> None:
    path = _relu_run(tmp_path, [0.5, 0.6, 1.0, 1.0])
    c = _checks(path, dead_after=2)["dead"]
    assert not c.passed and c.first is not None and (c.first.layer, c.first.step) == ("act", 2)
    assert "from step 2" in c.message
    assert _checks(path, dead_after=0)["dead"].passed  # alive at steps 0 and 1
    assert _checks(path, dead_after=1)["dead"].passed
    # --dead-frac lowers what counts as dead
    assert not _checks(path, dead_after=1, options=_rules(dead_frac=0.6))["dead"].passed
    # not a ReLU-family layer: never "dead"
    linear = write_log(
        tmp_path,
        [step_dict(s, [call_dict("fc", out=tensor_dict(zeros=1.0))]) for s in range(2)],
        "l.jsonl",
    )
    assert _checks(linear, dead_after=0)["dead"].passed
    with pytest.raises(UsageError, match="--dead-after 9: the log's last watched step is 3"):
        _checks(path, dead_after=9)


def _rules(**kw: Any) -> Any:
    from hookcli.options import RuleOptions

    return RuleOptions(**kw)


def test_collapse_fails_when_std_stays_below_min_std_to_the_end(tmp_path: Path) -> None:
    def steps(stds: Sequence[float]) -> list[dict[str, Any]]:
        return [step_dict(s, [call_dict("fc", out=tensor_dict(std=v))]) for s, v in enumerate(stds)]

    collapsed = write_log(tmp_path, steps([1.0, 0.5, 1e-9, 1e-10]))
    c = _checks(collapsed, options=_rules(min_std=1e-6))["min-std"]
    assert not c.passed and c.first is not None and c.first.step == 2
    recovered = write_log(tmp_path, steps([1.0, 1e-9, 1.0]), "r.jsonl")
    assert _checks(recovered, options=_rules(min_std=1e-6))["min-std"].passed


# ---------------------------------------------------------------- rules: gradients, updates


def test_grad_norm_bounds_fire_on_parameters_and_layer_gradients(tmp_path: Path) -> None:
    huge = step_dict(1, params=[param_dict(grad_norm=5e3)])
    tiny = step_dict(2, [call_dict("fc", grad=tensor_dict(norm=1e-12))])
    path = write_log(tmp_path, [step_dict(0), huge, tiny])
    c = _checks(path, max_grad_norm=1e3)["grad-norm"]
    assert not c.passed and c.first is not None
    assert (c.first.path, c.first.step, c.first.value) == ("fc.weight.grad", 1, 5e3)
    assert "exploding" in c.first.message
    c = _checks(path, min_grad_norm=1e-8)["grad-norm"]
    assert not c.passed and c.first is not None and (c.first.layer, c.first.step) == ("fc", 2)
    assert "vanishing" in c.first.message
    assert _checks(path, min_grad_norm=1e-13, max_grad_norm=1e4)["grad-norm"].passed
    assert not _checks(path, options=_rules(grad_norm="1e-8:"))["grad-norm"].passed
    inf = write_log(
        tmp_path,
        [step_dict(0, params=[param_dict(grad=tensor_dict("fc.weight.grad", inf=2))])],
        "i.jsonl",
    )
    c = _checks(inf, max_grad_norm=1e3)["grad-norm"]
    assert not c.passed and c.first is not None and c.first.value == "Inf"


def test_a_run_failures_step_and_value_are_one_steps(tmp_path: Path) -> None:
    """Past the bound at steps 1 (2e3) and 2 (5e3): the failure said step 1 with value 5e3
    (the worst, step 2's), a pair no step had; step and value are step 1's, the worst is in
    the message."""
    steps = [step_dict(s, params=[param_dict(grad_norm=g)]) for s, g in enumerate([1, 2e3, 5e3])]
    c = _checks(write_log(tmp_path, steps), max_grad_norm=1e3)["grad-norm"]
    assert c.first is not None and (c.first.step, c.first.value) == (1, 2e3)
    assert "up to 5000" in c.first.message and "first step 1" in c.first.message


def test_update_ratio_bounds(tmp_path: Path) -> None:
    path = write_log(
        tmp_path,
        [
            step_dict(0, params=[param_dict(ratio=1e-3)]),
            step_dict(1, params=[param_dict(ratio=0.5)]),
        ],
    )
    c = _checks(path, max_update_ratio=1e-2)["update-ratio"]
    assert not c.passed and c.first is not None and (c.first.step, c.first.value) == (1, 0.5)
    assert _checks(path, max_update_ratio=1.0)["update-ratio"].passed
    c = _checks(path, min_update_ratio=1e-2)["update-ratio"]
    assert not c.passed and c.first is not None and c.first.step == 0
    assert _checks(path, min_update_ratio=1e-6)["update-ratio"].passed
    frozen = write_log(
        tmp_path, [step_dict(0, params=[{**param_dict(ratio=0.0), "grad": None}])], "f.jsonl"
    )
    assert _checks(frozen, min_update_ratio=1e-6)["update-ratio"].passed  # no gradient: not updated


def test_bad_rule_values_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="--grad-norm and --min-grad-norm"):
        runrules.parse_run_rules(_rules(grad_norm="1:2"), max_grad_norm=3.0)
    with pytest.raises(UsageError, match=r"--min-update-ratio 1 is above --max-update-ratio 0\.1"):
        runrules.parse_run_rules(min_update_ratio=1.0, max_update_ratio=0.1)
    with pytest.raises(UsageError, match="--max-grad-norm"):
        runrules.parse_run_rules(max_grad_norm=float("nan"))
    with pytest.raises(UsageError, match="--dead-after"):
        runrules.parse_run_rules(dead_after=-1)


# ---------------------------------------------------------------- hookcli check run.jsonl


def test_check_cli_on_a_log_exit_codes_and_streams(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    train_watched(Tiny(), tiny_batches(4), log)
    r = run("check", str(log))
    assert r.exit_code == 0, r.stderr
    assert "PASS nonfinite" in r.stdout and "4 watched steps" in r.stdout and r.stderr == ""
    r = run("check", str(log), "--quiet")
    assert r.exit_code == 0 and r.stdout == ""
    r = run("check", str(log), "--max-update-ratio", "1e-9", "--max-grad-norm", "1e9")
    assert r.exit_code == 1, r.stderr
    assert "FAIL update-ratio" in r.stdout and "PASS grad-norm" in r.stdout
    assert r.stderr == ""  # the table on stdout says why
    r = run("check", str(log), "--max-update-ratio", "1e-9", "-f", "json")
    assert r.exit_code == 1
    data = json.loads(r.stdout)
    (check,) = data["checks"]
    assert check["rule"] == "update-ratio" and not check["passed"]
    assert check["failures"][0]["step"] == 0 and data["run"]["steps"] == [0, 1, 2, 3]
    assert r.stderr.startswith("check failed: update-ratio: ")
    r = run("check", str(log), "--dead-after", "0", "--dead-frac", "0.01", "-f", "csv")
    assert r.exit_code == 1
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert rows[0]["rule"] == "dead" and rows[0]["layer"] == "act" and rows[0]["step"] == "0"
    r = run("check", str(log), "-f", "markdown", "--min-std", "1e-6")
    assert r.exit_code == 0 and "**PASS** min-std" in r.stdout


def test_check_cli_refuses_model_flags_with_a_log_and_log_flags_with_a_model(
    tmp_path: Path,
) -> None:
    log = write_log(tmp_path, [step_dict(0)])
    for flags in (["--baseline", "base.json"], ["--input", "randn:1x3"], ["--backward"]):
        r = run("check", str(log), *flags)
        assert_one_line_error(r, 2, flags[0], "training log")
    r = run("check", str(log), "resnet18")
    assert_one_line_error(r, 2, "not both", "resnet18")
    r = run("check", "resnet18", "--dead-after", "3")
    assert_one_line_error(r, 2, "--dead-after", "hookcli check run.jsonl")
    r = run("check", str(log), "--grad-norm", "1:2", "--max-grad-norm", "3")
    assert_one_line_error(r, 2, "--grad-norm")


def test_check_cli_still_checks_a_model() -> None:
    r = run("check", "tests/support/models.py:NanForward", "--input", "randn:16x4")
    assert r.exit_code == 1, r.stderr
    assert "FAIL nonfinite" in r.stdout


# ---------------------------------------------------------------- hookcli report


def _nan_run(tmp_path: Path) -> Path:
    bad = step_dict(
        2, [call_dict("fc", out=tensor_dict(nan=5)), call_dict("act", "ReLU")], loss=None
    )
    return write_log(tmp_path, [step_dict(0), step_dict(1, loss=2.0), bad, step_dict(3, loss=0.5)])


def test_report_table_shows_series_with_sparklines_and_nonfinite_marks(tmp_path: Path) -> None:
    r = run("report", str(_nan_run(tmp_path)))
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    assert "4 watched steps" in out and "fc.weight" in out
    fc = next(line for line in out.splitlines() if line.startswith("fc "))
    assert "!" in fc, fc  # NaN at step 2 marked in its sparklines
    assert "loss: 1 → 0.5" in out
    assert runseries.series(runmerge.load_run([_nan_run(tmp_path)])).layers[0].bad_steps == [2]


def test_sparkline_scales_and_marks() -> None:
    from hookcli.render.series import sparkline

    assert sparkline([0.0, 1.0, 2.0], [False] * 3) == "▁▅█"
    assert sparkline([1.0, None, 3.0], [False, True, False]) == "▁!█"
    assert sparkline([1.0, None], [False, False]) == "▁ "
    assert len(sparkline([float(i) for i in range(100)], [False] * 100)) == 24


def test_report_json_csv_markdown(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    train_watched(Tiny(), tiny_batches(3), log)
    r = run("report", str(log), "-f", "json")
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["run"]["steps"] == [0, 1, 2]
    conv = data["layers"][0]
    assert conv["name"] == "conv" and len(conv["series"]["out std"]) == 3
    assert [p["name"] for p in data["params"]] == [
        "conv.weight",
        "conv.bias",
        "fc.weight",
        "fc.bias",
    ]
    assert data["loss"]["series"]["loss"][0] == pytest.approx(read_lines(log)[0]["loss"])
    r = run("report", str(log), "-f", "csv")
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert len(rows) == 3 * (3 * 5 + 4 * 2 + 1)
    row = next(x for x in rows if (x["step"], x["name"], x["metric"]) == ("1", "act", "zeros"))
    assert float(row["value"]) == pytest.approx(
        read_lines(log)[1]["layers"][1]["outputs"][0]["zeros"]
    )
    r = run("report", str(log), "-f", "markdown")
    assert r.exit_code == 0 and "| layer | type | call |" in r.stdout


def test_report_png_grid_marks_nonfinite_steps_in_red(tmp_path: Path) -> None:
    out = tmp_path / "series.png"
    r = run("report", str(_nan_run(tmp_path)), "-o", str(out))
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "" and f"wrote {out}" in r.stderr
    image = Image.open(out)
    meta = json.loads(image.text["hookcli"])  # type: ignore[attr-defined]
    rows, columns = meta["rows"], meta["columns"]
    assert rows == ["fc", "act", "fc.weight", "loss"] and "out std" in columns
    assert "update ratio" in columns and "loss" in columns
    from hookcli.render.series import CELL_H, CELL_W

    assert len(meta["cells"]) == 5 + 5 + 2 + 1  # two layer calls, a parameter, the loss
    assert all(
        (x1 - x0, y1 - y0) == (CELL_W, CELL_H)
        for x0, y0, x1, y1 in (c["box"] for c in meta["cells"])
    )
    x1 = max(c["box"][2] for c in meta["cells"])
    y1 = max(c["box"][3] for c in meta["cells"])
    assert image.width > x1 and image.height > y1 + 20  # and the step axis under the plots
    rgb = image.convert("RGB")

    def red(box: list[int]) -> int:
        x0, y0, x1, y1 = box
        return sum(
            1
            for x in range(x0, x1)
            for y in range(y0, y1)
            if (p := rgb.getpixel((x, y)))[0] > 200 and p[1] < 40 and p[2] < 40  # type: ignore[index]
        )

    for cell in meta["cells"]:
        bad = cell["row"] == "fc" and cell["column"] in ("out std", "out mean", "zeros", "nan/inf")
        bad |= cell["row"] == "loss"
        assert cell["nonfinite_steps"] == ([2] if bad else []), cell
        assert (red(cell["box"]) > 0) == bad, cell


def test_report_renders_a_saved_json_report(tmp_path: Path) -> None:
    saved = ROOT / "tests" / "golden" / "net.json"
    r = run("report", str(saved))
    assert r.exit_code == 0, r.stderr
    assert "l1" in r.stdout and "Linear" in r.stdout
    r = run("report", str(saved), "-f", "json")
    again, original = json.loads(r.stdout), json.loads(saved.read_text())
    assert again["layers"] == original["layers"] and again["model"] == original["model"]
    r = run("report", str(saved), "-f", "csv")
    assert r.stdout.splitlines()[0].startswith("layer,type,call,kind,path")
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**original, "predictions": "many"}))
    assert_one_line_error(run("report", str(broken)), 2, "broken.json", "predictions")


def test_report_bad_usage(tmp_path: Path) -> None:
    log = write_log(tmp_path, [step_dict(0)])
    saved = str(ROOT / "tests" / "golden" / "net.json")
    assert run("report", str(log), "-f", "yaml").exit_code == 2  # not a format
    assert_one_line_error(run("report", saved, saved), 2, "one saved report")
    assert_one_line_error(run("report", str(log), saved), 2, "not both")
    assert_one_line_error(run("report", saved, "-o", str(tmp_path / "x.png")), 2, "run log")
    png = str(tmp_path / "x.png")
    assert_one_line_error(run("report", str(log), "-f", "json", "-o", png), 2, ".png")
    assert_one_line_error(run("report", str(log), "-o", str(log)), 2, "input of this run")
    # a failed run leaves an existing output as it was
    out = tmp_path / "keep.png"
    out.write_bytes(b"old")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("nope\n")
    assert_one_line_error(run("report", str(bad), "-o", str(out)), 2, "bad.jsonl")
    assert out.read_bytes() == b"old"
    assert not list(tmp_path.glob(".hookcli-*"))


def test_help_lists_report_and_reading_logs_imports_no_torch(tmp_path: Path) -> None:
    r = run("--help")
    assert "report" in r.stdout
    h = run("report", "--help")
    assert h.exit_code == 0 and "Example: hookcli report" in h.stdout
    log = write_log(tmp_path, [step_dict(0)])
    code = (
        "import sys\n"
        "from hookcli.commands.watch import runmerge, runrules, runseries\n"
        "from hookcli.render import series\n"
        "import hookcli.cli.runlog\n"
        f"r = runmerge.load_run([{str(log)!r}])\n"
        "s = runseries.series(r)\n"
        "series.series_sections(s, ['x']); series.series_csv(s)\n"
        "runrules.evaluate_run(r, runrules.parse_run_rules())\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


def test_merged_loss_is_the_ranks_mean() -> None:
    a, b = step_dict(0, loss=1.0), step_dict(0, loss=3.0)
    b.update(rank=1)
    merged, _ = runmerge.merge_step([logread.step_line(a), logread.step_line(b)])
    assert merged.loss == 2.0 and merged.merged_ranks == 2 and merged.world_size == 1
    b["loss"] = None
    assert runmerge.merge_step([logread.step_line(a), logread.step_line(b)])[0].loss is None
    std = merged.layers[0].outputs[0].std
    assert std is not None and math.isclose(std, 1.0)


def test_a_merged_steps_origins_name_the_rank_that_found_them(tmp_path: Path) -> None:
    a = step_dict(0, world_size=2)
    b = step_dict(0, [call_dict("log", "Log", out=tensor_dict(nan=3))], rank=1, world_size=2)
    b["nonfinite_origins"] = [ORIGIN]
    logs = [write_log(tmp_path, [a], "r.rank0.jsonl"), write_log(tmp_path, [b], "r.rank1.jsonl")]
    run = runmerge.load_run(logs)
    (origin,) = run.steps[0].nonfinite_origins
    assert isinstance(origin, runmerge.RankOrigin) and origin.rank == 1
    (c,) = runrules.evaluate_run(run, runrules.parse_run_rules())
    assert not c.passed
    assert "first: rank 1: forward: first at log (Log) call 0, output out: 3 NaN" in c.message


def test_a_log_with_nothing_to_check_is_refused_not_passed(tmp_path: Path) -> None:
    """Steps with no layer and no parameter: every rule would pass on nothing (issue 32)."""
    empty = write_log(
        tmp_path, [step_dict(0, layers=[], params=[]), step_dict(1, layers=[], params=[])]
    )
    r = run("check", str(empty))
    assert r.exit_code == 2, r.stdout
    assert "2 watched steps, but none holds" in r.stderr and "nothing to check" in r.stderr
    assert r.stdout == ""
    # one step with one parameter is something to check
    some = write_log(tmp_path, [step_dict(0, layers=[], params=[param_dict()])], "some.jsonl")
    assert run("check", str(some)).exit_code == 0


@pytest.mark.parametrize("value", [-1, 1.5, True, "x", {"a": 1}])
def test_origins_of_the_wrong_type_are_one_line(tmp_path: Path, value: object) -> None:
    log = write_log(tmp_path, [step_dict(0, nonfinite_origins=value)])
    for command in ("check", "report"):
        r = run(command, str(log))
        assert r.exit_code == 2, (command, r.stderr)
        assert "nonfinite_origins" in r.stderr and "internal error" not in r.stderr
