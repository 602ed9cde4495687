"""Folder runs: statistics aggregated over batches equal those of one concatenated batch
(float64 oracle), flat memory, skipped/strict images, Ctrl-C, merging reports across shards."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.commands import folder
from hookcli.commands.folder import image_files
from hookcli.engine.aggregate import merge_reports
from hookcli.errors import UsageError
from hookcli.inputs import read_image
from hookcli.sources import load_model
from tests.support.cli import assert_one_line_error
from tests.support.images import make_folder
from tests.support.oracles import assert_stats_match, retained_outputs
from tests.support.paths import CAT, COFFEE

pytestmark = pytest.mark.kernels  # the second CI pass reruns these on generic x86-64

runner = CliRunner()


def test_aggregated_statistics_equal_one_concatenated_batch(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "data", 10)
    layers = ["conv1", "layer1.0.*", "fc"]
    report = hookcli.inspect("resnet18", [str(folder)], batch_size=3, layers=layers, device="cpu")
    loaded = load_model("resnet18", seed=0)
    files = image_files([str(folder)])
    x = torch.stack([loaded.preprocess(read_image(f.path)) for f in files])  # type: ignore[misc]
    store = retained_outputs(loaded.module.eval(), (x,))
    assert report.input.shapes == [(10, 3, 224, 224)]
    checked = 0
    for call in report.layers:
        for t in call.inputs + call.outputs:
            assert t.shape[0] == 10
            # recomputed in batches of another size: BLAS may round differently, so no
            # bitwise-equal extremes here, only agreement within rtol
            assert_stats_match(
                t, store[(call.name, call.call)][t.path], rtol=1e-5, same_tensor=False
            )
            checked += 1
    assert checked == 2 * 6 + 2 * 2  # layer1.0.*: 6 calls (relu twice); conv1 and fc
    with torch.no_grad():
        assert_stats_match(report.outputs[0], loaded.module(x), rtol=1e-5, same_tensor=False)


def test_reports_of_two_shards_merge_into_the_whole(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "data", 8)
    files = [str(f.path) for f in image_files([str(folder)])]
    half = [
        hookcli.inspect("resnet18", part, batch_size=2, layers=["layer1.0.relu"], device="cpu")
        for part in (files[:4], files[4:])
    ]
    whole = hookcli.inspect("resnet18", files, batch_size=8, layers=["layer1.0.relu"], device="cpu")
    merged = merge_reports([h.to_dict() for h in half])
    for m, w in zip(merged["layers"], whole.to_dict()["layers"], strict=True):
        for key in ("mean", "std", "min", "max", "zeros", "norm"):
            assert m["outputs"][0][key] == pytest.approx(w["outputs"][0][key], rel=1e-9)


def test_memory_stays_flat_as_images_grow(tmp_path: Path) -> None:
    small, large = make_folder(tmp_path / "s", 30, 64), make_folder(tmp_path / "l", 300, 64)

    def peak(folder: Path) -> int:
        tracemalloc.start()
        hookcli.inspect(
            "tests/support/models.py:TwoBranches", [str(folder)], batch_size=16, device="cpu"
        )
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    peak(small)  # warm-up: imports, kernels
    a, b = peak(small), peak(large)
    assert b < a * 1.5 + 2_000_000, (a, b)


def test_cli_folder_run_skips_or_refuses_unreadable_images(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "data", 5)
    (folder / "cups" / "zz_broken.jpg").write_bytes(b"nope")
    r = runner.invoke(app, ["inspect", "resnet18", str(folder), "--batch-size", "2", "-l", "fc"])
    assert r.exit_code == 0, r.stderr
    assert "5 images from" in r.stdout
    assert "skipped 1 image(s) that cannot be used: cups/zz_broken.jpg (not an image" in r.stdout
    r = runner.invoke(app, ["inspect", "resnet18", str(folder), "--batch-size", "2", "--strict"])
    assert_one_line_error(r, 2, "zz_broken.jpg", "--strict")
    r = runner.invoke(
        app,
        [
            "inspect",
            "resnet18",
            str(folder),
            "--batch-size",
            "2",
            "-f",
            "json",
            "-l",
            "fc",
            "--limit",
            "3",
        ],
    )
    assert json.loads(r.stdout)["input"]["shapes"] == [[3, 3, 224, 224]]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--batch-size", "0"], ["--batch-size must be 1 or more"]),
        (["--limit", "0"], ["--limit must be 1 or more"]),
        (["--batch-size", "2", "--ablate", "fc=zero"], ["--ablate works on one batch"]),
    ],
)
def test_folder_bad_options(tmp_path: Path, args: list[str], needles: list[str]) -> None:
    folder = make_folder(tmp_path / "data", 3)
    assert_one_line_error(
        runner.invoke(app, ["inspect", "resnet18", str(folder), *args]), 2, *needles
    )


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--loss", "ce:3"], ["--loss is a mean over one batch", "use --target"]),
        (["--input-grad"], ["--input-grad works on one batch"]),
    ],
)
def test_grads_folder_bad_options(tmp_path: Path, args: list[str], needles: list[str]) -> None:
    folder = make_folder(tmp_path / "data", 3)
    cmd = ["grads", "resnet18", str(folder), "--batch-size", "2", *args]
    assert_one_line_error(runner.invoke(app, cmd), 2, *needles)


def test_grads_over_a_folder_equal_autograd_over_one_concatenated_batch(tmp_path: Path) -> None:
    """grads in batches: every call's gradients and every parameter's gradient (summed over
    the batches) against torch.autograd.grad of the whole folder's target in one batch (the
    sum of each image's top-1 logit), computed independently here."""
    folder = make_folder(tmp_path / "data", 7)
    layers = ["layer4.1.conv2", "layer4.1.bn2", "fc"]
    report = hookcli.grads("resnet18", [str(folder)], batch_size=3, layers=layers, device="cpu")
    loaded = load_model("resnet18", seed=0)
    model = loaded.module.eval()
    files = image_files([str(folder)])
    x = torch.stack([loaded.preprocess(read_image(f.path)) for f in files])  # type: ignore[misc]
    seen: dict[str, torch.Tensor] = {}
    conv = model.layer4[1].conv2
    conv.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out))
    logits = model(x)
    target = logits.gather(1, logits.argmax(1, keepdim=True)).sum()
    params = [conv.weight, model.fc.weight, model.fc.bias]
    g_out, *g_params = torch.autograd.grad(target, [seen["out"], *params])
    assert report.input.shapes == [(7, 3, 224, 224)]
    assert report.backward is not None and report.backward.value is not None
    assert report.backward.value == pytest.approx(float(target.detach()), rel=1e-5)
    by_name = {c.name: c for c in report.layers}
    call = by_name["layer4.1.conv2"]
    assert call.grad_outputs is not None and call.params is not None
    assert_stats_match(call.grad_outputs[0], g_out, rtol=1e-5, same_tensor=False)
    assert call.grad_outputs[0].shape == (7, 512, 7, 7)
    fc = by_name["fc"].params
    assert fc is not None
    for ps, want in zip([call.params[0], *fc], g_params, strict=True):
        assert ps.grad is not None and ps.grad.dtype == "float32"
        assert_stats_match(ps.grad, want, rtol=1e-5, same_tensor=False)
        assert ps.grad_norm == pytest.approx(float(want.double().norm()), rel=1e-5)
    assert [c.backward_order for c in report.layers] == [2, 1, 0]
    assert any("gradients of the whole folder" in n for n in report.notes)


class _NanHead(torch.nn.Module):
    """A small CNN whose scores are NaN: backward starts from a NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, stride=4)
        self.fc = torch.nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean((2, 3))) * float("nan")


def test_grads_folder_edge_cases(tmp_path: Path) -> None:
    """--hist: a gradient's histogram spans that gradient (its own shared edges, not an
    activation's); a NaN backward scalar is null, and the JSON stays valid; batching options
    with no image to batch are refused."""
    folder = make_folder(tmp_path / "data", 5)
    report = hookcli.grads(
        "resnet18", [str(folder)], batch_size=2, layers=["layer4.1.conv2", "fc"], hist=True
    )
    for call in report.layers:
        for t in [*(call.grad_outputs or []), *(call.grad_inputs or [])]:
            assert t.hist is not None and t.min is not None and t.max is not None
            lo, hi = t.hist["edges"][0], t.hist["edges"][-1]
            assert lo <= t.min and t.max <= hi, (call.name, t.path)
            assert hi - lo <= 2 * (t.max - t.min) * (1 + 1e-9), (call.name, t.path)
            assert sum(t.hist["counts"]) == t.numel
        for ps in call.params or []:
            assert ps.grad is not None and ps.grad.hist is not None
    nan = hookcli.grads(_NanHead(), [str(folder)], batch_size=2, device="cpu")
    assert nan.backward is not None and nan.backward.value is None
    json.dumps(nan.to_dict(), allow_nan=False)
    r = runner.invoke(app, ["grads", "resnet18", "-i", "randn:1x3x32x32", "--batch-size", "2"])
    assert_one_line_error(r, 2, "batch image files and folders")
    with pytest.raises(UsageError, match="stats_backend"):
        hookcli.inspect("resnet18", input_specs=["randn:1x3x32x32"], stats_backend="numba")


def test_mixed_sizes_are_reported(tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    folder.mkdir()
    Image.open(CAT).convert("RGB").save(folder / "a.png")
    Image.open(COFFEE).convert("RGB").resize((300, 600)).save(folder / "b.png")
    r = runner.invoke(
        app,
        [
            "inspect",
            "deeplabv3_mobilenet_v3_large",
            str(folder),
            "--batch-size",
            "2",
            "-l",
            "classifier",
        ],
    )
    assert_one_line_error(r, 2, "different sizes", "--batch-size 1")


def test_ctrl_c_reports_partial_results_and_exits_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    images = make_folder(tmp_path / "data", 6)
    real = folder._FolderRun.batch
    seen = []

    def interrupt_on_second(self: folder._FolderRun, *a: Any, **k: Any) -> Any:
        if seen:
            raise KeyboardInterrupt
        seen.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(folder._FolderRun, "batch", interrupt_on_second)
    r = runner.invoke(app, ["inspect", "resnet18", str(images), "--batch-size", "2", "-l", "fc"])
    assert r.exit_code == 130
    assert "interrupted after 2 of 6 images" in r.stdout and "fc" in r.stdout
    assert "interrupted" in r.stderr


def test_per_image_predictions_in_a_folder_run(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "data", 5)
    report = hookcli.inspect(
        "resnet18", [str(folder)], batch_size=2, layers=["fc"], device="cpu", per_image=2
    )
    loaded = load_model("resnet18", seed=0)
    files = image_files([str(folder)])
    x = torch.stack([loaded.preprocess(read_image(f.path)) for f in files])  # type: ignore[misc]
    with torch.no_grad():
        top = torch.softmax(loaded.module.eval()(x).double(), dim=1).topk(2, dim=1)
    assert report.predictions is not None and len(report.predictions) == 10
    for p in report.predictions:
        assert p.index == top.indices[p.image, p.rank - 1].item()
        assert p.source == files[p.image].name  # relative to the folder named
    r = runner.invoke(
        app,
        ["inspect", "resnet18", str(folder), "--batch-size", "2", "-l", "fc", "--per-image", "1"],
    )
    assert r.exit_code == 0 and "predictions" in r.stdout and "0000.png" in r.stdout


def test_folder_histograms_merge_exactly_over_shared_edges(tmp_path: Path) -> None:
    import numpy as np

    folder = make_folder(tmp_path / "data", 7)
    report = hookcli.inspect(
        "resnet18", [str(folder)], batch_size=3, layers=["layer1.0.conv1"], device="cpu", hist=12
    )
    loaded = load_model("resnet18", seed=0)
    files = image_files([str(folder)])
    x = torch.stack([loaded.preprocess(read_image(f.path)) for f in files])  # type: ignore[misc]
    out = retained_outputs(loaded.module.eval(), (x,))[("layer1.0.conv1", 0)]["out"]
    hist = report.layers[0].outputs[0].hist
    assert hist is not None and len(hist["counts"]) == 12
    lo, hi = hist["edges"][0], hist["edges"][-1]
    data = np.clip(out.double().numpy().ravel(), lo, hi)
    want, _ = np.histogram(data, bins=12, range=(lo, hi))
    assert sum(hist["counts"]) == out.numel()
    assert np.abs(np.asarray(hist["counts"]) - want).sum() <= 4  # ulp-close values at edges


def test_a_small_imagefolder_tree_is_read_and_rows_name_path_and_class(tmp_path: Path) -> None:
    """20 images in class subfolders: one batch (no folder run), every image read, each
    prediction row naming the image's path in the tree and its class folder (issue 9)."""
    folder = make_folder(tmp_path / "data", 20, size=64)
    args = ["inspect", "resnet18", str(folder), "-l", "fc", "--topk", "1"]
    r = runner.invoke(app, [*args, "-f", "json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["input"]["shapes"] == [[20, 3, 224, 224]]
    rows = {p["source"]: p["folder_class"] for p in data["predictions"]}
    assert len(rows) == 20
    assert rows["cats/0001.png"] == "cats" and rows["cups/0000.png"] == "cups"
    table = runner.invoke(app, args, env={"COLUMNS": "120"})
    assert table.exit_code == 0, table.stderr
    assert "cats/0001.png" in table.stdout and "folder" in table.stdout


@pytest.mark.parametrize("batched", [False, True], ids=["one batch", "folder run"])
def test_unreadable_images_behave_the_same_in_small_and_batched_folders(
    tmp_path: Path, batched: bool
) -> None:
    folder = make_folder(tmp_path / "data", 4, size=64)
    broken = folder / "cups" / "zz_broken.jpg"
    broken.write_bytes(b"nope")
    mode = ["--batch-size", "2"] if batched else []
    r = runner.invoke(app, ["inspect", "resnet18", str(folder), "-l", "fc", *mode, "-f", "json"])
    assert r.exit_code == 0, r.stderr
    notes = " ".join(json.loads(r.stdout)["notes"])
    assert "skipped 1 image(s) that cannot be used: cups/zz_broken.jpg (not an image" in notes
    r = runner.invoke(app, ["inspect", "resnet18", str(folder), "-l", "fc", *mode, "--strict"])
    assert_one_line_error(r, 2, "zz_broken.jpg", "drop --strict")
    named = [str(folder / "cats" / "0001.png"), str(broken)]
    r = runner.invoke(app, ["inspect", "resnet18", *named, "-l", "fc", *mode])
    assert_one_line_error(r, 2, "zz_broken.jpg", "give a readable image file")


def test_check_over_a_folder_runs_in_batches(tmp_path: Path) -> None:
    """check takes folders as inspect does: in batches (--batch-size; more images than one
    batch holds, by default), its rules over the merged statistics, which equal one batch's."""
    folder = make_folder(tmp_path / "data", 6, size=64)
    rules = {"max_abs": 1e9, "min_std": 1e-12, "fail_on": ["nonfinite", "dead"]}
    whole = hookcli.check("resnet18", str(folder), layers=["layer4.1.*", "fc"], **rules)
    parts = hookcli.check(
        "resnet18", str(folder), layers=["layer4.1.*", "fc"], batch_size=4, **rules
    )
    assert "6 images" in parts.input.description  # a folder run: 2 batches
    assert [(c.rule, c.passed) for c in parts.checks] == [(c.rule, c.passed) for c in whole.checks]
    for w, p in zip(whole.layers, parts.layers, strict=True):
        assert (w.name, w.call) == (p.name, p.call)
        a, b = p.outputs[0], w.outputs[0]
        assert (a.numel, a.zeros, a.min, a.max) == (b.numel, b.zeros, b.min, b.max)
        for key in ("mean", "std", "norm"):
            assert getattr(a, key) == pytest.approx(getattr(b, key), rel=1e-9), key
    r = runner.invoke(
        app, ["check", "resnet18", str(folder), "-l", "fc", "--batch-size", "4", "-f", "json"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["input"]["description"] == parts.input.description
