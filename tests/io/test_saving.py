"""--save: safetensors files load back with safetensors.torch.load_file and equal the tensors
captured in-process by independent hooks; hookcli show lists them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torchvision
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from tests.support.cli import assert_one_line_error
from tests.support.oracles import oracle_grads, retained_outputs

runner = CliRunner()


def test_saved_inputs_and_outputs_equal_the_captured_tensors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 64, 64)
    path = tmp_path / "run.safetensors"
    report = hookcli.inspect(model, x, device="cpu", layers=["layer1.0.*", "fc"], save=path)
    saved = load_file(str(path))
    store = retained_outputs(model, (x,))
    expected = 0
    for call in report.layers:
        for kind, tensors in (("input", call.inputs), ("output", call.outputs)):
            for t in tensors:
                key = f"{call.name}#{call.call}/{kind}/{t.path}"
                assert torch.equal(saved[key], store[(call.name, call.call)][t.path]), key
                expected += 1
    assert len(saved) == expected
    assert "layer1.0.relu#1/output/out" in saved  # the second call of the reused relu
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["model"] == "ResNet" and meta["command"] == "inspect"
    assert any("saved" in n for n in report.notes)
    assert [p.name for p in tmp_path.iterdir()] == ["run.safetensors"], "no temporary files left"


def test_saved_gradients_equal_autograd(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 64, 64)
    path = tmp_path / "g.safetensors"
    hookcli.grads(model, x, device="cpu", save=path, topk=0)
    saved = load_file(str(path))
    want = oracle_grads(model, x)
    grads = {k: v for k, v in saved.items() if "/grad_output/" in k}
    assert len(grads) == len(want)
    for (name, call, p), g in want.items():
        got = grads[f"{name}#{call}/grad_output/{p}"]
        torch.testing.assert_close(got, g, rtol=1e-5, atol=1e-7)


def test_show_lists_the_file(tmp_path: Path) -> None:
    path = tmp_path / "r.safetensors"
    r = runner.invoke(app, ["inspect", "resnet18", "-l", "fc", "--save", str(path)])
    assert r.exit_code == 0, r.stderr
    r = runner.invoke(app, ["show", str(path)])
    assert r.exit_code == 0, r.stderr
    assert "fc#0/output/out" in r.stdout and "1x1000" in r.stdout and "model: resnet18" in r.stdout
    r = runner.invoke(app, ["show", str(path), "-f", "json"])
    data = json.loads(r.stdout)
    assert {t["path"] for t in data["tensors"]} == {"fc#0/input/in[0]", "fc#0/output/out"}


def test_save_bad_input(tmp_path: Path) -> None:
    assert_one_line_error(
        runner.invoke(app, ["show", str(tmp_path / "none.safetensors")]), 2, "not found"
    )
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 40)
    assert_one_line_error(runner.invoke(app, ["show", str(junk)]), 2, "not a readable safetensors")
    r = runner.invoke(app, ["inspect", "resnet18", "--save", str(tmp_path / "x.pt")])
    assert_one_line_error(r, 2, "must end in .safetensors")
    kept = tmp_path / "kept.safetensors"
    kept.write_bytes(b"precious")
    r = runner.invoke(
        app,
        ["inspect", "tests/support/models.py:Fails", "--input", "randn:1x2", "--save", str(kept)],
    )
    assert r.exit_code == 3
    assert kept.read_bytes() == b"precious", "a failed run leaves the old file as it was"
    r = runner.invoke(app, ["inspect", "resnet18", "-l", "fc", "--save", str(kept)])
    assert r.exit_code == 0, r.stderr
    assert kept.read_bytes() != b"precious", "replaced, like every output"
    assert_one_line_error(
        runner.invoke(app, ["inspect", "resnet18", "--save", "-"]), 2, "needs a file name"
    )
    kept.unlink()
    out = tmp_path / "fail.safetensors"
    r = runner.invoke(
        app,
        ["inspect", "tests/support/models.py:Fails", "--input", "randn:1x2", "--save", str(out)],
    )
    assert r.exit_code == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.safetensors"], (
        "nothing half-written"
    )
