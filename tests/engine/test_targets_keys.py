"""--output-key, and the detection and segmentation targets (issue 15): box:K equals
pytorch-grad-cam's FasterRCNNBoxScoreTarget, mask:CLASS its SemanticSegmentationTarget."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
import torchvision
from torch import nn
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.engine.targets import box_score, parse_target
from hookcli.errors import UsageError
from hookcli.tree import pick, steps

runner = CliRunner()
SEG = ["inspect", "deeplabv3_mobilenet_v3_large", "--input", "randn:1x3x64x64"]


class DictHead(nn.Module):
    """Returns features and logits in a dict, and a tuple from `pair`."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        feat = self.body(x)
        return {"features": feat, "logits": self.head(feat)}


def test_output_key_paths() -> None:
    out = {"a": (torch.zeros(1), [torch.ones(2)]), "b": torch.ones(3)}
    assert steps('out["a"][1][0]') == ["a", 1, 0] and steps("a.1") == ["a", 1]
    assert torch.equal(pick(out, 'out["a"][1][0]'), torch.ones(2))
    assert torch.equal(pick(out, "b"), torch.ones(3)) and pick(out, "out") is out
    assert torch.equal(pick(out, "1"), torch.ones(3))  # a mapping by position, as a ModelOutput
    with pytest.raises(LookupError, match="it has a, b"):
        pick(out, "c")


def test_output_key_drives_predictions_and_targets() -> None:
    torch.manual_seed(0)
    model = DictHead()
    x = torch.randn(2, 6)
    plain = hookcli.inspect(model, [x], device="cpu", topk=3)
    assert not plain.predictions  # a dict is not class scores
    keyed = hookcli.inspect(model, [x], device="cpu", topk=3, output_key="logits")
    with torch.no_grad():
        probs = torch.softmax(model(x)["logits"].double(), 1)
    got = {(p.image, p.index): p.prob for p in keyed.predictions}
    for (img, idx), prob in got.items():
        assert prob == pytest.approx(float(probs[img, idx]))
    assert len(got) == 6
    grads = hookcli.grads(
        model, [x], device="cpu", output_key="logits", target="2", layers=["head"]
    )
    g = grads.layers[0].grad_outputs[0]
    assert g is not None and g.norm == pytest.approx(2**0.5)  # one-hot on class 2, two rows
    with pytest.raises(UsageError, match=r"no 'nope'.*features, logits"):
        hookcli.grads(model, [x], device="cpu", output_key="nope")


def test_output_key_on_the_command_line() -> None:
    ok = runner.invoke(
        app,
        [*SEG, "--output-key", "out", "-l", "classifier.4", "-f", "json"],
    )
    assert ok.exit_code == 0, ok.stderr
    assert json.loads(ok.stdout)["predictions"]
    bad = runner.invoke(
        app,
        ["grads", *SEG[1:], "--output-key", "aux", "-l", "classifier.4"],
    )
    assert bad.exit_code == 2 and bad.stdout == ""
    line = bad.stderr.strip()
    assert "\n" not in line and "no 'aux' (it has out)" in line, line


# ---------------------------------------------------------------- detection


def _detector() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, box_score_thresh=0.0
    ).eval()


def test_box_target_equals_pytorch_grad_cams_and_its_map_too() -> None:
    pytest.importorskip("pytorch_grad_cam")
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import FasterRCNNBoxScoreTarget

    model = _detector()
    torch.manual_seed(1)
    x = torch.rand(1, 3, 160, 200)
    with torch.no_grad():
        det = model(x)[0]
    assert len(det["scores"]) > 0
    box, label = det["boxes"][0].numpy(), int(det["labels"][0])
    theirs = FasterRCNNBoxScoreTarget([label], [box])
    with torch.no_grad():
        out = model(x)
    assert float(box_score(out, 0)) == pytest.approx(float(theirs(out[0])[0]), rel=1e-6)
    layer = "backbone.fpn.layer_blocks.0.0"
    with GradCAM(model=model, target_layers=[model.get_submodule(layer)]) as cam:
        expected = cam(input_tensor=x, targets=[theirs])[0]
    drawing = hookcli.cam(model, [x], layer=layer, device="cpu")  # box:0 is the default
    assert drawing.raw is not None and "detection 0" in " ".join(drawing.picture.legend)
    ours = drawing.raw.astype(np.float64).ravel()
    ref = np.asarray(expected, dtype=np.float64).ravel()
    assert ours.std() > 0 and np.corrcoef(ours, ref)[0, 1] >= 0.999


def test_box_target_refuses_a_rank_with_no_detection() -> None:
    with pytest.raises(UsageError, match="no image has a detection 3"):
        box_score(
            [{"boxes": torch.zeros(1, 4), "scores": torch.ones(1), "labels": torch.ones(1)}], 3
        )
    with pytest.raises(UsageError, match="needs detections"):
        box_score(torch.zeros(2, 3), 0)
    with pytest.raises(UsageError, match="box:K takes a detection rank"):
        parse_target("box:first", None, None)


# ---------------------------------------------------------------- segmentation


class OutOnly(nn.Module):
    """pytorch-grad-cam's segmentation recipe: the model's `out` as its output."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> Any:
        return self.model(x)["out"]


def test_mask_target_equals_pytorch_grad_cams_segmentation_target() -> None:
    pytest.importorskip("pytorch_grad_cam")
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import SemanticSegmentationTarget

    torch.manual_seed(0)
    model = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None
    ).eval()
    x = torch.randn(1, 3, 96, 96)
    with torch.no_grad():
        pred = model(x)["out"][0].argmax(0)
    cls = int(pred.flatten().mode().values)
    mask = (pred == cls).float().numpy()
    layer = "backbone.16"
    wrapped = OutOnly(model)
    with GradCAM(model=wrapped, target_layers=[model.get_submodule(layer)]) as cam:
        expected = cam(input_tensor=x, targets=[SemanticSegmentationTarget(cls, mask)])[0]
    drawing = hookcli.cam(model, [x], layer=layer, target=f"mask:{cls}", device="cpu")
    assert drawing.raw is not None
    ours = drawing.raw.astype(np.float64).ravel()
    ref = np.asarray(expected, dtype=np.float64).ravel()
    assert ours.std() > 0 and np.corrcoef(ours, ref)[0, 1] >= 0.999
    absent = next(c for c in range(21) if not bool((pred == c).any()))
    empty = hookcli.cam(model, [x], layer=layer, target=f"mask:{absent}", device="cpu")
    assert any("mask is empty" in n for n in empty.picture.notes)
