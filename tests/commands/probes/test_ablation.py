"""--ablate: interventions through hooks, against independent forwards with the layer changed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.errors import UsageError
from hookcli.sources import load_model
from tests.support.cli import assert_one_line_error
from tests.support.oracles import assert_stats_match, hooks_left
from tests.support.paths import CAT

runner = CliRunner()


def _forward_with(model: nn.Module, x: torch.Tensor, layer: str, change: Any) -> torch.Tensor:
    twin = copy.deepcopy(model)
    module = dict(twin.named_modules())[layer]
    module.register_forward_hook(lambda m, a, out: change(out))
    with torch.no_grad():
        return twin(x)


@pytest.mark.parametrize(
    ("op", "change"),
    [
        ("zero", torch.zeros_like),
        ("scale:0.5", lambda t: t * 0.5),
        ("clamp:0:0.1", lambda t: t.clamp(0, 0.1)),
        ("mean", lambda t: t.mean(dim=(0, 2, 3), keepdim=True).expand_as(t).clone()),
    ],
)
def test_ablating_layer4_equals_an_independent_forward(op: str, change: Any) -> None:
    model = load_model("resnet18", seed=0).module  # the weights the run below builds
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    report = hookcli.inspect("resnet18", x, device="cpu", ablate=[f"layer4={op}"], layers=["fc"])
    a = report.ablation
    assert a is not None and a.specs == [f"layer4={op}"]
    want = _forward_with(model, x, "layer4", change)
    assert_stats_match(a.outputs_after[0], want)
    with torch.no_grad():
        assert_stats_match(a.outputs_before[0], model(x))
    probs = torch.softmax(want.double(), dim=1)
    top = probs[0].topk(5)
    assert [p.index for p in a.predictions_after if p.image == 0] == top.indices.tolist()
    assert [p.prob for p in a.predictions_after if p.image == 0] == pytest.approx(
        top.values.tolist()
    )


def test_an_output_whose_norm_stays_is_still_changed() -> None:
    """Negating layer4 keeps avgpool's norm but flips its mean: avgpool is a changed layer,
    its move against the two runs' own outputs (mean by hand over the clean rms), and the
    prediction table pairs the images' rows by image and rank."""
    model = load_model("resnet18", seed=0).module.eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    report = hookcli.inspect(
        "resnet18", x, device="cpu", ablate=["layer4=scale:-1"], layers=["avgpool"], topk=2
    )
    a = report.ablation
    assert a is not None
    (change,) = [ch for ch in a.changed_layers if ch.layer == "avgpool"]
    with torch.no_grad():
        clean = model.avgpool(model.layer4(model.layer3(model.layer2(model.layer1(
            model.maxpool(model.relu(model.bn1(model.conv1(x))))))))).double()  # fmt: skip
    assert change.relative < 1e-6  # (the norm: the same)
    rms = clean.norm() / clean.numel() ** 0.5
    # negated: mean -> -mean, min -> -max, max -> -min; std and norm stay
    lo, hi, mean = clean.min(), clean.max(), clean.mean()
    want = max(float(2 * mean.abs()), float(hi + lo)) / float(rms)
    assert change.moved == pytest.approx(want, rel=1e-5)
    r = runner.invoke(
        app, ["inspect", "resnet18", "--input", "randn:2x3x64x64", "-l", "avgpool",
              "--ablate", "layer4=scale:-1", "--topk", "2"],
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    rows = r.stdout.split("clean -> ablated")[1].splitlines()
    assert rows[1].split("|")[0].strip() == "image"
    assert [row.split("|")[0].strip() for row in rows[3:7]] == ["0", "0", "1", "1"]
    assert "avgpool" in r.stdout.split("layer outputs that changed")[1]


def test_the_model_is_left_unchanged() -> None:
    torch.manual_seed(0)
    model = load_model("resnet18", seed=0).module
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(1, 3, 64, 64)
    hookcli.inspect(model, x, device="cpu", ablate=["layer3=noise:0.5", "fc=zero"], topk=2)
    assert hooks_left(model) == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert model(x).abs().sum() > 0, "fc is not zeroed any more"


def test_cli_table_and_bad_input() -> None:
    r = runner.invoke(
        app, ["inspect", "resnet18", str(CAT), "-l", "fc", "--ablate", "layer4.1.conv2=zero"]
    )
    assert r.exit_code == 0, r.stderr
    assert "ablation: layer4.1.conv2=zero" in r.stdout and "clean -> ablated" in r.stdout
    assert_one_line_error(
        runner.invoke(app, ["inspect", "resnet18", "--ablate", "layer4"]), 2, "malformed --ablate"
    )
    assert_one_line_error(
        runner.invoke(app, ["inspect", "resnet18", "--ablate", "layer4=scale"]),
        2,
        "malformed --ablate",
    )
    assert_one_line_error(
        runner.invoke(app, ["inspect", "resnet18", "--ablate", "layer9=zero"]),
        2,
        "no layer named 'layer9'",
    )
    r = runner.invoke(
        app,
        [
            "inspect",
            "vit_b_16",
            "--input",
            "randn:1x3x224x224",
            "-l",
            "heads",
            "--ablate",
            "encoder.layers.encoder_layer_0.self_attention.out_proj=zero",
        ],
    )
    assert_one_line_error(r, 2, "never ran")


def test_mean_refuses_a_4d_output_whose_channels_cannot_be_told() -> None:
    """No image input: an upsampled latent's 4-D output could hold its channels on dim 1 or
    dim 3. mean is refused with exit 2 in one line (not a model failure), and the other
    ablations, which need no channel, still run; a convolution's output is NCHW by type."""
    model = nn.Sequential(
        nn.Linear(8, 4 * 6 * 6), nn.Unflatten(1, (4, 6, 6)), nn.Upsample(scale_factor=2),
        nn.Conv2d(4, 2, 3),
    )  # fmt: skip
    with pytest.raises(UsageError, match=r"--ablate 2=mean: which dimension") as e:
        hookcli.inspect(model, input_specs=["randn:2x8"], ablate=["2=mean"], device="cpu")
    assert e.value.exit_code == 2 and "zero, scale, clamp or noise" in str(e.value.hint)
    hookcli.inspect(model, input_specs=["randn:2x8"], ablate=["2=zero"], device="cpu")
    hookcli.inspect(model, input_specs=["randn:2x8"], ablate=["3=mean"], device="cpu")
