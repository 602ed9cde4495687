"""The Python API does what the CLI does: hookcli.check/maps/cam/inspect give the same report,
the same exit decision, the same PNG pixels and raw CAM, the same histogram bins and the same
folder batching as the commands run with the same options (their JSON, PNG and .npy read
back)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.errors import UsageError
from hookcli.options import HIST_BINS
from hookcli.records import Report
from hookcli.render.json import report_json
from tests.support.paths import CAT, COFFEE

runner = CliRunner()
HEALTHY = "tests/support/models.py:Healthy"
NAN_FORWARD = "tests/support/models.py:NanForward"
TWO_BRANCHES = "tests/support/models.py:TwoBranches"


def cli(*args: str) -> tuple[int, str, str]:
    r = runner.invoke(app, [*args, "--no-config"])
    return r.exit_code, r.stdout, r.stderr


def cli_json(*args: str) -> tuple[int, dict[str, Any]]:
    code, out, err = cli(*args, "-f", "json")
    assert code in (0, 1), err
    return code, json.loads(out)


def as_json(report: Report) -> dict[str, Any]:
    """The API's report as the CLI writes it (NaN → null, tuples → lists)."""
    data: dict[str, Any] = json.loads(report_json(report))
    return data


def assert_same(api: Any, cli_: Any, where: str = "report", rel: float = 1e-9) -> None:
    """Equal structure and text; numbers within `rel` relative."""
    if isinstance(api, dict):
        assert isinstance(cli_, dict) and api.keys() == cli_.keys(), where
        for key in api:
            assert_same(api[key], cli_[key], f"{where}.{key}", rel)
    elif isinstance(api, list):
        assert isinstance(cli_, list) and len(api) == len(cli_), where
        for i, (a, b) in enumerate(zip(api, cli_, strict=True)):
            assert_same(a, b, f"{where}[{i}]", rel)
    elif isinstance(api, float) or isinstance(cli_, float):
        assert isinstance(api, int | float) and isinstance(cli_, int | float), where
        assert math.isclose(api, cli_, rel_tol=rel, abs_tol=0.0), f"{where}: {api} != {cli_}"
    else:
        assert api == cli_, f"{where}: {api!r} != {cli_!r}"


def test_assert_same_can_fail() -> None:
    assert_same({"a": [1.0, "x"]}, {"a": [1.0 + 1e-12, "x"]})
    for other in ({"a": [1.0 + 1e-6, "x"]}, {"a": [1.0, "y"]}, {"a": [1.0]}, {"b": [1.0, "x"]}):
        with pytest.raises(AssertionError):
            assert_same({"a": [1.0, "x"]}, other)


# ---------------------------------------------------------------- check


def test_check_passing_rules_equal_the_cli_report_and_exit_code() -> None:
    code, data = cli_json(
        "check",
        HEALTHY,
        "--input",
        "randn:4x4",
        "--fail-on",
        "dead",
        "--max-abs",
        "100",
        "--grad-norm",
        ":1e6",
        "--expect-shape",
        "fc1=4x8",
        "--device",
        "cpu",
    )
    report = hookcli.check(
        HEALTHY,
        input_specs=["randn:4x4"],
        fail_on="dead",
        max_abs=100,
        grad_norm=(None, 1e6),
        expect_shape={"fc1": (4, 8)},
        device="cpu",
    )
    assert code == 0
    assert hookcli.exit_code(report) == code and hookcli.passed(report)
    assert [c.rule for c in report.checks] == ["dead", "max-abs", "grad-norm", "expect-shape fc1"]
    assert report.backward is not None, "--grad-norm implies backward"
    assert report.predictions is None, "check makes no predictions"
    assert_same(as_json(report), data)


def test_check_failing_rule_equals_the_cli_exit_code_one() -> None:
    code, data = cli_json("check", NAN_FORWARD, "--input", "randn:16x4", "--device", "cpu")
    report = hookcli.check(NAN_FORWARD, input_specs=["randn:16x4"], device="cpu")
    assert code == 1
    assert hookcli.exit_code(report) == code and not hookcli.passed(report)
    (result,) = report.checks  # no rule given: nonfinite
    assert result.rule == "nonfinite" and not result.passed
    assert report.backward is None
    assert_same(as_json(report), data)


def test_check_backward_flag_runs_backward_like_the_cli() -> None:
    code, data = cli_json(
        "check", HEALTHY, "--input", "randn:4x4", "--backward", "--target", "sum", "--device", "cpu"
    )
    report = hookcli.check(
        HEALTHY, input_specs=["randn:4x4"], backward=True, target="sum", device="cpu"
    )
    assert code == 0 == hookcli.exit_code(report)
    assert report.backward is not None and report.backward.source.startswith("sum of every")
    assert any(c.grad_outputs for c in report.layers)
    assert_same(as_json(report), data)


@pytest.mark.parametrize(("seed", "want"), [("0", 0), ("1", 1)])
def test_check_baseline_drift_equals_the_cli(tmp_path: Path, seed: str, want: int) -> None:
    base = tmp_path / "base.json"
    code, _, err = cli("inspect", HEALTHY, "--input", "randn:4x4", "-o", str(base))
    assert code == 0, err
    args = ("--input", "randn:4x4", "--seed", seed, "--baseline", str(base), "--device", "cpu")
    code, data = cli_json("check", HEALTHY, *args)
    report = hookcli.check(
        HEALTHY, input_specs=["randn:4x4"], seed=int(seed), baseline=base, device="cpu"
    )
    assert code == want == hookcli.exit_code(report)
    assert [c.rule for c in report.checks] == ["baseline"]
    assert report.checks[0].passed == (want == 0)
    assert_same(as_json(report), data)


def test_inspect_fail_on_gives_the_cli_exit_code() -> None:
    code, data = cli_json(
        "inspect", NAN_FORWARD, "--input", "randn:16x4", "--fail-on", "nonfinite", "--device", "cpu"
    )
    report = hookcli.inspect(
        NAN_FORWARD, input_specs=["randn:16x4"], fail_on=["nonfinite"], device="cpu"
    )
    assert code == 1 == hookcli.exit_code(report)
    assert_same(as_json(report), data)
    plain = hookcli.inspect(NAN_FORWARD, input_specs=["randn:16x4"], device="cpu")
    assert plain.checks == [] and hookcli.exit_code(plain) == 0, "no rule, nothing to fail"


def test_api_options_are_checked_by_command() -> None:
    with pytest.raises(TypeError, match="max_abs"):
        hookcli.inspect(HEALTHY, input_specs=["randn:4x4"], max_abs=1.0)
    with pytest.raises(TypeError, match="topk"):
        hookcli.check(HEALTHY, input_specs=["randn:4x4"], topk=3)
    with pytest.raises(TypeError, match="per_image"):  # check makes no predictions
        hookcli.check(HEALTHY, input_specs=["randn:4x4"], per_image=True)
    with pytest.raises(UsageError, match="batch image files and folders"):  # check batches them
        hookcli.check(HEALTHY, input_specs=["randn:4x4"], batch_size=2)
    with pytest.raises(TypeError, match="layers"):
        hookcli.maps("resnet18", str(CAT), layer="conv1", layers=["fc"])
    with pytest.raises(UsageError, match="unknown --fail-on rule"):
        hookcli.check(HEALTHY, input_specs=["randn:4x4"], fail_on="nan")


# ---------------------------------------------------------------- histograms


def test_hist_true_gives_the_cli_bins() -> None:
    args = ("--input", "randn:4x4", "--hist", "--device", "cpu")
    code, data = cli_json("inspect", HEALTHY, *args)
    report = hookcli.inspect(HEALTHY, input_specs=["randn:4x4"], hist=True, device="cpu")
    assert code == 0
    hist = report.layers[0].outputs[0].hist
    assert hist is not None and len(hist["counts"]) == HIST_BINS == 12
    assert len(data["layers"][0]["outputs"][0]["hist"]["counts"]) == HIST_BINS
    assert_same(as_json(report), data)


# ---------------------------------------------------------------- folders


def make_images(root: Path, n: int, size: int = 48) -> Path:
    """n small crops of the sample photos in two class subfolders (an ImageFolder tree)."""
    cat, coffee = Image.open(CAT).convert("RGB"), Image.open(COFFEE).convert("RGB")
    for i in range(n):
        src = cat if i % 2 else coffee
        sub = root / ("cats" if i % 2 else "cups")
        sub.mkdir(parents=True, exist_ok=True)
        x, y = (i * 13) % 200, (i * 7) % 100
        src.crop((x, y, x + size, y + size)).save(sub / f"{i:03d}.png")
    return root


def test_folder_with_batch_size_equals_the_cli(tmp_path: Path) -> None:
    folder = make_images(tmp_path / "imgs", 40)
    code, data = cli_json(
        "inspect", TWO_BRANCHES, str(folder), "--batch-size", "8", "--hist", "--device", "cpu"
    )
    report = hookcli.inspect(TWO_BRANCHES, folder, batch_size=8, hist=True, device="cpu")
    assert code == 0
    assert "40 images" in report.input.description
    assert "in 5 batches of up to 8" in report.input.description
    assert report.input.shapes == [(40, 3, 224, 224)]
    assert {c.name for c in report.layers} == {"conv", "side", "head"}
    for call in report.layers:
        for t in call.outputs:
            assert t.shape[0] == 40 and t.hist is not None and len(t.hist["counts"]) == HIST_BINS
    assert_same(as_json(report), data)


def test_a_folder_of_more_than_one_batch_is_batched_like_the_cli(tmp_path: Path) -> None:
    """No batching option: 40 images are more than one batch (32), so both batch."""
    folder = make_images(tmp_path / "imgs", 40)
    code, data = cli_json("inspect", TWO_BRANCHES, str(folder), "--device", "cpu")
    report = hookcli.inspect(TWO_BRANCHES, [str(folder)], device="cpu")
    assert code == 0
    assert "in 2 batches of up to 32" in report.input.description
    assert any("statistics are over all images" in n for n in report.notes)
    assert_same(as_json(report), data)


def test_folder_refusals_are_the_cli_ones(tmp_path: Path) -> None:
    folder = make_images(tmp_path / "imgs", 3)
    code, _, err = cli("inspect", TWO_BRANCHES, str(folder), "--batch-size", "2", "--train")
    assert code == 2 and "--train works on one batch" in err
    with pytest.raises(UsageError, match="--train works on one batch"):
        hookcli.inspect(TWO_BRANCHES, folder, batch_size=2, train=True)
    with pytest.raises(UsageError, match="not tensors"):
        hookcli.inspect(TWO_BRANCHES, torch.zeros(1, 3, 8, 8), batch_size=2)


# ---------------------------------------------------------------- pictures


def png(path: Path) -> tuple[np.ndarray, dict[str, Any]]:
    img = Image.open(path)
    meta: dict[str, Any] = json.loads(img.info["hookcli"])
    return np.asarray(img.convert("RGB")), meta


def test_maps_equals_the_cli_png(tmp_path: Path) -> None:
    out = tmp_path / "maps.png"
    args = ("-l", "layer1.0.relu", "--call", "1", "--channels", "9", "--order", "index")
    code, _, err = cli("maps", "resnet18", str(CAT), *args, "--device", "cpu", "-o", str(out))
    assert code == 0, err
    drawing = hookcli.maps(
        "resnet18", CAT, layer="layer1.0.relu", call=1, channels=9, order="index", device="cpu"
    )
    pixels, meta = png(out)
    assert drawing.layer == "layer1.0.relu" and drawing.call == 1
    assert drawing.picture.labels == [str(i) for i in range(9)]
    assert np.array_equal(np.asarray(drawing.image.convert("RGB")), pixels)
    assert json.loads(json.dumps(drawing.metadata)) == meta
    saved = tmp_path / "api.png"
    drawing.save(saved)
    assert np.array_equal(png(saved)[0], pixels) and png(saved)[1] == meta


def test_cam_equals_the_cli_png_and_raw_map(tmp_path: Path) -> None:
    out, raw = tmp_path / "cam.png", tmp_path / "cam.npy"
    code, _, err = cli(
        "cam", "resnet18", str(CAT), "--device", "cpu", "-o", str(out), "--save-raw", str(raw)
    )
    assert code == 0, err
    assert "layer layer4: the last layer over the image" in err
    drawing = hookcli.cam("resnet18", CAT, device="cpu")
    assert drawing.layer == "layer4"
    pixels, meta = png(out)
    assert np.array_equal(np.asarray(drawing.image.convert("RGB")), pixels)
    assert json.loads(json.dumps(drawing.metadata)) == meta
    assert drawing.raw is not None and drawing.raw.shape == (224, 224)
    np.testing.assert_array_equal(drawing.raw, np.load(raw))
    assert drawing.raw.max() > 0


def test_cam_with_a_layer_and_gradcam_pp_equals_the_cli(tmp_path: Path) -> None:
    out, raw = tmp_path / "cam.png", tmp_path / "cam.npy"
    args = ("-l", "layer3", "--method", "gradcam++", "--target", "sum", "--device", "cpu")
    code, _, err = cli("cam", "resnet18", str(CAT), *args, "-o", str(out), "--save-raw", str(raw))
    assert code == 0, err
    drawing = hookcli.cam(
        "resnet18", CAT, layer="layer3", method="gradcam++", target="sum", device="cpu"
    )
    assert drawing.layer == "layer3"
    assert np.array_equal(np.asarray(drawing.image.convert("RGB")), png(out)[0])
    assert drawing.raw is not None
    np.testing.assert_array_equal(drawing.raw, np.load(raw))


def test_the_typed_keywords_are_exactly_what_each_command_takes() -> None:
    """hookcli.inspect/grads/check's **options are typed (apitypes: editors complete them, mypy
    catches a misspelt one); the TypedDicts hold exactly the keys api_report takes."""
    from hookcli.apitypes import CheckKeywords, GradsKeywords, InspectKeywords
    from hookcli.commands.api import BATCH_KEYS, INSPECT_RULE_KEYS, RULE_KEYS
    from hookcli.options import API_KEYS

    backward = {"target", "loss", "input_grad"}
    every = {*API_KEYS, *BATCH_KEYS}
    assert (
        set(InspectKeywords.__annotations__) | set(InspectKeywords.__optional_keys__)
        == (every | set(INSPECT_RULE_KEYS)) - backward
    )
    assert set(GradsKeywords.__optional_keys__) == every | set(INSPECT_RULE_KEYS)
    assert set(CheckKeywords.__optional_keys__) == (every | set(RULE_KEYS)) - {
        "topk",
        "per_image",
    }
    with pytest.raises(TypeError, match="unexpected option 'topk' for check"):
        hookcli.check(torch.nn.Linear(2, 2), torch.zeros(1, 2), topk=3)  # type: ignore[typeddict-unknown-key]


class _Dropping(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x))


@pytest.mark.parametrize(
    "call",
    [
        lambda m, x: hookcli.inspect(m, x, device="cpu", train=True),  # the pass draws masks
        lambda m, x: hookcli.grads(m, x, device="cpu", target="sum", train=True),
        lambda m, x: hookcli.check(m, x, device="cpu"),
        lambda m, x: hookcli.diff(m, x, b="bfloat16", device="cpu"),
        lambda m, x: hookcli.inspect(HEALTHY, device="cpu"),  # a model built from its name
    ],
    ids=["inspect", "grads", "check", "diff", "built"],
)
def test_a_call_leaves_the_programs_random_stream_as_it_found_it(call: Any) -> None:
    """Each call seeds torch's generator for its pass (and its model's random init): a
    program calling the API in its loop draws afterwards what it would have drawn without
    the call, not the call's seed's numbers again."""
    model, x = _Dropping(), torch.randn(3, 8)
    torch.manual_seed(1234)
    want = torch.rand(6)
    torch.manual_seed(1234)
    call(model, x)
    assert torch.equal(torch.rand(6), want)


def test_a_call_leaves_the_seed_queued_for_cudas_start_as_the_program_queued_it() -> None:
    """Before CUDA starts, torch.manual_seed queues CUDA's seed for its start; a model built
    from its name seeds torch too, which replaced the program's queued seed: the program's
    CUDA would have started from hookcli's seed. The queue comes back as the program left it."""
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    if tracker is None or torch.cuda.is_initialized():
        pytest.skip("CUDA started already, or this torch keeps no queue of seeds")
    torch.manual_seed(1234)
    queued = tracker.manual_seed_all_cb
    hookcli.inspect(HEALTHY, device="cpu")
    assert tracker.manual_seed_all_cb is queued
