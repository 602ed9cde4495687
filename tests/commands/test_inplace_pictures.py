"""Pictures and saved tensors read a layer's output as the layer returned it, before a later
in-place op rewrites it (docs/traps.md §12): resnet18's `layer1.0.bn1` is followed by an
in-place ReLU, densenet121's `features` by `F.relu(..., inplace=True)` in forward.

Oracles: an independent forward hook that clones the output, and Grad-CAM by hand on a model
whose hook hands the next op a clone (so the op rewrites the clone, not the kept value), with
the gradient from torch.autograd.grad w.r.t. that kept value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file

import hookcli
from hookcli.commands.pictures import _capture, class_activation, feature_maps, tiles_uint8
from hookcli.engine.prepare import one_target, prepare
from hookcli.options import BackwardOptions, CamOptions, InputOptions, MapOptions, ModelOptions
from hookcli.sources import load_model
from tests.support.paths import CAT


def _cat() -> torch.Tensor:
    loaded = load_model("resnet18", seed=0)
    assert loaded.preprocess is not None
    return loaded.preprocess(Image.open(CAT).convert("RGB")).unsqueeze(0)  # type: ignore[no-any-return]


def _bn1_outputs() -> tuple[torch.Tensor, torch.Tensor]:
    """layer1.0.bn1's output as returned (cloned in the hook) and as read after the forward
    (the reference the in-place ReLU rewrote)."""
    model = load_model("resnet18", seed=0).module.eval()
    kept: dict[str, torch.Tensor] = {}

    def hook(m: torch.nn.Module, a: Any, out: torch.Tensor) -> None:
        kept["clone"], kept["ref"] = out.detach().clone(), out

    h = model.layer1[0].bn1.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(_cat())
    finally:
        h.remove()
    return kept["clone"], kept["ref"].detach()


def test_maps_of_resnet18_layer1_0_bn1_show_the_values_before_the_in_place_relu() -> None:
    returned, rewritten = _bn1_outputs()
    assert returned.min() < 0 and rewritten.min() == 0, "the oracle sees the in-place ReLU"

    model, inputs = ModelOptions("resnet18", device="cpu"), InputOptions(items=(str(CAT),))
    prepared = prepare(model, inputs=inputs)
    got = _capture(prepared, one_target(prepared, "layer1.0.bn1"), 0)
    assert got.out.min() < 0
    assert torch.equal(got.out, returned)

    picture = feature_maps(model, inputs, MapOptions("layer1.0.bn1", channels=64, order="index"))
    assert picture.tiles is not None
    assert np.array_equal(picture.tiles, tiles_uint8(returned[0].float()))
    assert not np.array_equal(picture.tiles, tiles_uint8(rewritten[0].float()))


def test_saved_output_of_resnet18_layer1_0_bn1_keeps_its_negative_values(tmp_path: Path) -> None:
    returned, _ = _bn1_outputs()
    dest = tmp_path / "bn1.safetensors"
    hookcli.inspect("resnet18", [str(CAT)], layers=["layer1.0.bn1"], save=str(dest), device="cpu")
    saved = load_file(str(dest))["layer1.0.bn1#0/output/out"]
    assert saved.min() < 0
    assert torch.equal(saved, returned)


def _hand_gradcam(x: torch.Tensor, *, clone: bool) -> torch.Tensor:
    """Grad-CAM of densenet121's `features` for the top-1 class, by hand. clone=True: the
    hook hands the in-place ReLU a clone, so the kept activation is the value `features`
    returned (the textbook map); clone=False: the kept tensor is rewritten by the ReLU (what
    a hook that keeps a reference reads)."""
    model = load_model("densenet121", seed=0).module.eval()
    kept: dict[str, torch.Tensor] = {}

    def hook(m: torch.nn.Module, a: Any, out: torch.Tensor) -> torch.Tensor | None:
        kept["act"] = out
        return out.clone() if clone else None

    h = model.features.register_forward_hook(hook)
    try:
        logits = model(x)
    finally:
        h.remove()
    score = logits[0, logits[0].argmax()]
    (grad,) = torch.autograd.grad(score, kept["act"])
    act, g = kept["act"].detach()[0].double(), grad[0].double()
    weights = g.mean(dim=(1, 2))
    cam = F.relu((weights[:, None, None] * act).sum(dim=0))
    return F.interpolate(cam[None, None], size=x.shape[2:], mode="bilinear", align_corners=False)[
        0, 0
    ]


def test_densenet121_grad_cam_equals_the_hand_computation_on_the_returned_activation() -> None:
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    textbook = _hand_gradcam(x, clone=True)
    rewritten = _hand_gradcam(x, clone=False)
    scale = float(textbook.max())
    assert scale > 0
    assert float((textbook - rewritten).abs().max()) > 1e-3 * scale, "the ReLU must matter"

    picture = class_activation(
        ModelOptions("densenet121", device="cpu"),
        InputOptions(items=(x,)),
        BackwardOptions(),
        CamOptions(),
    )
    assert "layer features" in " ".join(picture.notes)  # the default CAM layer
    assert picture.raw is not None and picture.heat is not None
    raw = torch.from_numpy(picture.raw).double()
    assert raw.shape == textbook.shape
    assert float((raw - textbook).abs().max()) <= 1e-5 * scale
    heat = torch.from_numpy(picture.heat).double()
    assert float((heat - textbook / scale).abs().max()) <= 1e-5
