"""The model source seam: a source registered by prefix serves every command with its own
preprocessing, labels and score reading; the built-in sources claim their spec kinds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.errors import UsageError
from hookcli.records import Prediction
from hookcli.sources import LoadedModel, Source, Task, load_model, register, resolve, unregister
from hookcli.sources.custom import FileSource, ModuleSource
from hookcli.sources.tasks import Row
from hookcli.sources.torchvision import TorchvisionSource
from tests.support.paths import CAT

FRUIT = ["apple", "banana", "cherry", "date"]


class ToyNet(nn.Module):
    """Returns a dict no built-in reader knows: {"fruit": (N, 4) scores}."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"fruit": self.pool(self.conv(x)).flatten(1) * 10}


class ToyTask(Task):
    name = "toy"

    def scores(self, output: Any) -> torch.Tensor:
        return output["fruit"]  # type: ignore[no-any-return]

    def predict(self, output: Any, topk: int, row: Row) -> tuple[list[Prediction], str] | None:
        scores = output["fruit"].detach()
        values, idxs = scores.topk(min(topk, scores.shape[1]), dim=1)
        preds = [
            row(rank, int(i), float(v), img)
            for img in range(scores.shape[0])
            for rank, (v, i) in enumerate(zip(values[img], idxs[img], strict=True), 1)
        ]
        return preds, f"top-{topk} fruit by raw score"


def toy_preprocess(image: Any) -> torch.Tensor:
    from torchvision.transforms import v2

    to = v2.Compose([v2.Resize((40, 40)), v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])
    return to(image)  # type: ignore[no-any-return]


class ToySource(Source):
    name = "toy"
    prefix = "toy"

    def load(
        self, spec: str, *, weights: str, seed: int, model_args: dict[str, Any]
    ) -> LoadedModel:
        torch.manual_seed(seed)
        return LoadedModel(
            module=ToyNet().eval(),
            name=spec.removeprefix("toy:"),
            spec=spec,
            kind=ToyTask(),
            weights_label=f"toy (seed {seed})",
            pretrained=True,
            categories=list(FRUIT),
            preprocess=toy_preprocess,
            preprocess_label="toy: resize 40x40, [0, 1]",
            input_size=(40, 40),
        )


@pytest.fixture
def toy() -> Iterator[ToySource]:
    source = register(ToySource())
    try:
        yield source  # type: ignore[misc]
    finally:
        unregister("toy")


def test_a_registered_source_serves_the_python_api(toy: ToySource) -> None:
    assert resolve("toy:x") is toy
    report = hookcli.inspect("toy:x", [str(CAT)], topk=2)
    assert report.model.task == "toy" and report.model.spec == "toy:x"
    assert report.input.preprocessing == "toy: resize 40x40, [0, 1]"
    assert report.input.shapes == [(1, 3, 40, 40)]
    assert report.prediction_note == "top-2 fruit by raw score"
    assert report.predictions is not None and len(report.predictions) == 2
    assert all(p.label in FRUIT for p in report.predictions)
    # no input: the default input is the source's size
    assert hookcli.inspect("toy:x").input.shapes == [(1, 3, 40, 40)]


def test_a_registered_source_reads_its_own_backward_target(toy: ToySource) -> None:
    report = hookcli.grads("toy:x", [str(CAT)], target="cherry")
    assert report.backward is not None
    assert "class 2 ('cherry')" in report.backward.source
    conv = next(c for c in report.layers if c.name == "conv")
    assert conv.grad_outputs and conv.grad_outputs[0].norm


def test_a_registered_source_serves_the_cli(toy: ToySource) -> None:
    result = CliRunner().invoke(app, ["inspect", "toy:x", str(CAT), "--topk", "3", "-f", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["model"]["task"] == "toy"
    assert data["input"]["preprocessing"] == "toy: resize 40x40, [0, 1]"
    assert [p["label"] in FRUIT for p in data["predictions"]] == [True] * 3
    result = CliRunner().invoke(app, ["grads", "toy:x", "--target", "banana", "-f", "json"])
    assert result.exit_code == 0, result.output


def test_without_the_plugin_the_prefix_is_a_module_spec() -> None:
    assert isinstance(resolve("toy:x"), ModuleSource)
    with pytest.raises(UsageError, match="cannot import module 'toy'"):
        load_model("toy:x")


def test_each_built_in_source_resolves_its_spec_kinds() -> None:
    assert isinstance(resolve("resnet18"), TorchvisionSource)
    assert isinstance(resolve("examples/tiny/net.py:Net"), FileSource)
    assert isinstance(resolve("tests.support.models:Kinds"), ModuleSource)
    loaded = load_model("resnet18")
    assert loaded.task == "classification" and loaded.kind.default_topk == 5
    assert load_model("examples/tiny/net.py:Net").kind.name == "custom"
    with pytest.raises(UsageError, match="Did you mean resnet18") as err:
        resolve("resnet181")
    assert "hookcli models" in (err.value.hint or "")


def test_built_in_task_kinds_follow_the_torchvision_package() -> None:
    from hookcli.sources.torchvision import kind_of

    assert kind_of("fasterrcnn_resnet50_fpn").name == "detection"
    assert kind_of("fasterrcnn_resnet50_fpn").fallback_size == (320, 320)
    assert kind_of("deeplabv3_resnet50").name == "segmentation"
    assert kind_of("r3d_18").name == "video"
    assert kind_of("raft_small").name == "optical_flow"
    assert kind_of("quantized_resnet18").name == "quantized"
    assert kind_of("resnet18").name == "classification"


def _project(root: Any) -> None:
    """A project folder: a package whose model module imports a sibling relatively (what
    path/to/file.py:Name cannot load) and a factory."""
    pkg = root / "proj"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "layers.py").write_text(
        "from torch import nn\n\ndef block():\n    return nn.Conv2d(3, 4, 3)\n"
    )
    (pkg / "nets.py").write_text(
        "from torch import nn\nfrom .layers import block\n\n"
        "def make_net():\n    return nn.Sequential(block(), nn.ReLU())\n"
    )
    (pkg / "broken.py").write_text("import no_such_dependency_xyz\n")


def test_pkg_mod_factory_works_from_the_console_script_in_a_project(tmp_path: Any) -> None:
    """The console script's sys.path starts at its bin folder, not the current directory:
    hookcli adds the directory, as `python -m` has it. A missing module or a missing
    dependency each get the hint that fits, not one that sends users to file.py:Name (which
    cannot load a module with relative imports)."""
    import subprocess
    import sys
    from pathlib import Path

    _project(tmp_path)
    script = Path(sys.executable).parent / "hookcli"
    run = [str(script), "inspect", "proj.nets:make_net", "--input", "randn:1x3x8x8", "-f", "json"]
    res = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert [c["name"] for c in json.loads(res.stdout)["layers"]] == ["0", "1"]
    res = subprocess.run(
        [str(script), "inspect", "proj.broken:Net"],
        cwd=tmp_path, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        "error: module proj.broken imports no_such_dependency_xyz, which is not installed. "
        "Hint: install it (pip install no_such_dependency_xyz) in this environment."
    ]
    res = subprocess.run(
        [str(script), "inspect", "nosuchpkg.nets:Net"],
        cwd=tmp_path, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert (
        res.returncode == 2 and "run hookcli from the folder that holds the package" in res.stderr
    )
    assert "file.py:Name" not in res.stderr


def test_a_module_with_a_syntax_error_is_bad_input_in_either_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FILE.py:Name and module:Name alike: a syntax error is the input's (exit 2), one line."""
    from tests.support.cli import assert_one_line_error

    (tmp_path / "synbad.py").write_text("import torch\ndef broken(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in (f"{tmp_path / 'synbad.py'}:Net", "synbad:Net"):
        res = CliRunner().invoke(app, ["layers", spec])
        assert_one_line_error(res, 2, "line 2")
