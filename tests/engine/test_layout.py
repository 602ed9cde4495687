"""Layouts of 3-D and 4-D activations (engine.layout): what torchvision's structure says, what
the input size implies, refusal when neither tells; and Grad-CAM on channels-last and token
layers against pytorch-grad-cam given the reshape_transform its docs ask users to write."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

import hookcli
from hookcli.engine.layout import (
    NCHW,
    NHWC,
    TOKENS,
    ModelHints,
    image_of,
    model_hints,
    resolve,
)
from hookcli.errors import UsageError
from tests.support.oracles import captured_outputs
from tests.support.paths import ROOT

NONE = ModelHints()


def test_torchvision_permute_modules_mark_the_channels_last_layers() -> None:
    swin = model_hints(torchvision.models.swin_t())
    for name in ("features.0", "features.0.2", "features.5", "features.7.1.norm1", "norm"):
        assert name in swin.channels_last, name
    for name in ("permute", "avgpool", "head"):
        assert name in swin.channels_first, name
    assert "features.0.0" in swin.convolutions  # the patch convolution: NCHW by its type
    convnext = model_hints(torchvision.models.convnext_tiny())
    for name in ("features.7.2.block.2", "features.7.2.block.3", "features.7.2.block.5"):
        assert name in convnext.channels_last, name
    for name in ("features.7.2.block", "features.7.2", "features"):
        assert name in convnext.channels_first, name
    assert "features.7.2.block.0" in convnext.convolutions
    vit = model_hints(torchvision.models.vit_b_16())
    assert vit.prefix_tokens == 1 and not vit.channels_last


class _Told(nn.Module):
    """Layout attributes the ways models hold them: on the instance, the class, a property."""

    output_fmt = "NHWC"  # the class's

    def __init__(self) -> None:
        super().__init__()
        self.num_prefix_tokens = 1  # the instance's
        self.lin = nn.Linear(2, 2)

    @property
    def dims(self) -> list[int]:
        return [0, 2, 3, 1]


class _Forwarding(nn.Module):
    """Forwards unknown attributes to a module it wraps (as torch.compile's wrapper does)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


class _ScriptableTold(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_prefix_tokens = 1
        self.output_fmt = "NHWC"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_layout_attributes_are_read_as_getattr_reads_them() -> None:
    """The walk reads `num_prefix_tokens`, `output_fmt` and `dims` without nn.Module's
    __getattr__ when it can, and gets what getattr gets: instance, class, property,
    TorchScript (attributes kept in C++) and a forwarding __getattr__."""
    from hookcli.engine.layout import _attr, _prefix_tokens

    told = _Told()
    scripted = torch.jit.script(_ScriptableTold())
    modules = [told, _Forwarding(told), scripted, told.lin, nn.Sequential(told)]
    for module in modules:
        for name in ("num_prefix_tokens", "output_fmt", "dims", "lin", "nothing"):
            assert _attr(module, name) == getattr(module, name, None), (type(module), name)
    wrapper = nn.Sequential(nn.Identity(), scripted)  # a scripted submodule says 1 prefix token
    assert _prefix_tokens(wrapper) == (1, "the model's num_prefix_tokens")


def test_a_permute_registered_twice_in_one_parent_counts_each_time() -> None:
    """Modules run in registration order: a Permute object reused later in the same Sequential
    opens the channels-last region again."""
    to_last, to_first = torchvision.ops.Permute([0, 2, 3, 1]), torchvision.ops.Permute([0, 3, 1, 2])
    seq = nn.Sequential(to_last, nn.Identity(), to_first, nn.ReLU(), to_last, nn.GELU(), to_first)
    hints = model_hints(seq)
    assert {"1", "5"} <= hints.channels_last and "5" not in hints.channels_first
    assert "3" in hints.channels_first


def test_the_permuted_layout_is_the_truth() -> None:
    """The oracle: swin's `features` output is what its own `permute` turns into NCHW."""
    model = torchvision.models.swin_t().eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        inner = model.features(x)
        truth = model.permute(model.norm(inner))
    layout = resolve("norm", tuple(inner.shape), (224, 224), model_hints(model))
    assert layout.kind == NHWC and layout.grid == (7, 7) and layout.channels == 768
    with torch.no_grad():
        assert torch.equal(layout.to_nchw(model.norm(inner)), truth)


def test_shapes_tell_the_layout_when_the_model_does_not() -> None:
    nchw = resolve("conv", (2, 64, 56, 56), (224, 224), NONE)
    assert (nchw.kind, nchw.grid, nchw.channels) == (NCHW, (56, 56), 64)
    nhwc = resolve("blk", (2, 14, 14, 384), (224, 224), NONE)
    assert (nhwc.kind, nhwc.grid, nhwc.channels) == (NHWC, (14, 14), 384)
    wide = resolve("conv", (1, 64, 60, 80), (480, 640), NONE)  # not square: strides agree
    assert (wide.kind, wide.grid) == (NCHW, (60, 80))
    tokens = resolve("ln", (1, 197, 768), (224, 224), NONE)
    assert (tokens.kind, tokens.prefix, tokens.grid) == (TOKENS, 1, (14, 14))
    t = torch.arange(197 * 4, dtype=torch.float32).reshape(1, 197, 4)
    grid = tokens.to_nchw(t)
    assert grid.shape == (1, 4, 14, 14)
    assert torch.equal(grid[0, :, 0, 1], t[0, 2])  # row 0, column 1 is patch 1, after the class
    assert "inferred from the input size" in tokens.describe()


def test_a_small_map_of_an_odd_input_is_read_by_its_one_stride() -> None:
    """resnet18 on a 97x131 input: every stage's map is ceil(input / stride) in both
    directions (layer4's 4x5 by 32, whose ratios differ by 8%), each read as NCHW, as the
    model's own outputs are; no stride fits 4x9 of that input."""
    model = torchvision.models.resnet18().eval()
    outs = captured_outputs(
        model, torch.randn(1, 3, 97, 131), ["layer1", "layer2", "layer3", "layer4"]
    )
    for name, out in outs.items():
        got = resolve(name, tuple(out.shape), (97, 131), NONE)
        assert (got.kind, got.grid) == (NCHW, tuple(out.shape[2:])), name
    with pytest.raises(UsageError):
        resolve("x", (1, 512, 4, 9), (97, 131), NONE)


class _PermutedBack(nn.Module):
    """timm MambaOut's stem: conv, permute to NHWC, norm, permute back to NCHW, act — in a
    model whose output_fmt is NHWC."""

    output_fmt = "NHWC"

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 24, 3, stride=2, padding=1)
        self.norm = nn.LayerNorm(24)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.act(h)


def test_an_nhwc_models_output_that_is_no_nhwc_map_is_refused_not_guessed() -> None:
    """The model says NHWC for every non-convolution module; `act`'s output (1, 24, 112, 112)
    is NCHW (its NHWC reading, a 24x112 grid, cannot come from a 224x224 input): refused, not
    read as 112 channels. `norm`'s, truly NHWC, is read so. The oracle: the tensors' own
    layouts, from the forward above."""
    model = _PermutedBack().eval()
    hints = model_hints(model)
    outs = captured_outputs(model, torch.randn(1, 3, 224, 224), ["norm", "act"])
    norm = resolve("norm", tuple(outs["norm"].shape), (224, 224), hints)
    assert (norm.kind, norm.grid, norm.channels) == (NHWC, (112, 112), 24)
    with pytest.raises(UsageError, match=r"act's output 1x24x112x112 is no NHWC map"):
        resolve("act", tuple(outs["act"].shape), (224, 224), hints)
    # swin's last stage: one 7x7 window per image, so the batch check passes its attention
    # probabilities (1, heads, 49, 49) in an output_fmt NHWC model
    with pytest.raises(UsageError, match="attention scores"):
        resolve(
            "attn.softmax", (1, 24, 49, 49), (224, 224), ModelHints(frozenset({"attn.softmax"}))
        )


def test_channels_read_an_input_by_its_own_layout_not_the_layers_output() -> None:
    """torchvision's Permute([0, 2, 3, 1]) (ConvNeXt's): its input is NCHW, its output NHWC.
    --channels read its input with its output's layout (axis 3, 56 "channels") when it was
    selected alone. The oracle: per-channel max|x| of the captured input over axis 1."""
    from torchvision.ops.misc import Permute

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 96, 4, stride=4), Permute([0, 2, 3, 1])).eval()
    x = torch.randn(1, 3, 224, 224)
    report = hookcli.inspect(model, x, layers=["1"], channels=True, device="cpu")
    (call,) = report.layers
    (given,) = call.inputs
    (made,) = call.outputs
    assert given.channels is not None and made.channels is not None
    assert (given.channels.axis, len(given.channels.absmax)) == (1, 96)
    assert (made.channels.axis, len(made.channels.absmax)) == (3, 96)
    with torch.no_grad():
        want = model[0](x).double().abs().amax(dim=(0, 2, 3)).tolist()
    assert given.channels.absmax == pytest.approx(want, rel=1e-6)
    assert made.channels.absmax == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize(
    ("shape", "size", "needle"),
    [
        ((1, 8, 8, 8), (224, 224), "both NCHW and NHWC fit"),
        ((1, 30, 20, 10), (224, 224), "neither NCHW nor NHWC fits"),
        ((1, 196, 196, 4), (224, 224), "neither NCHW nor NHWC fits"),  # CaiT's L x L x heads
        ((1, 4, 197, 197), (224, 224), "neither NCHW nor NHWC fits"),  # a ViT's attn_drop
        ((1, 170, 64), (224, 224), "no patch grid fits"),  # 169 = 13x13 does not tile 224
        ((1, 16, 64), (48, 48), "several prefix/grid splits fit"),  # 4x4, or 7 + 3x3
    ],
)
def test_an_unknowable_layout_is_refused_with_its_shape(
    shape: tuple[int, ...], size: tuple[int, int], needle: str
) -> None:
    with pytest.raises(UsageError) as err:
        resolve("x", shape, size, NONE)
    assert "x".join(map(str, shape)) in str(err.value) and needle in str(err.value)


class Ambiguous(nn.Module):
    """A 4-D output both layouts fit (8 channels of 8x8, or 8x8 cells of 8 channels) from a
    module whose type does not say: the convolution's output is NCHW by its type, the
    activation after it could be either."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, stride=4)
        self.act = nn.GELU()
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.conv(x)).flatten(1))


def test_a_picture_is_never_drawn_from_a_guessed_layout() -> None:
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(UsageError, match="1x8x8x8"):
        hookcli.maps(Ambiguous(), [x], layer="act")
    drawn = hookcli.maps(Ambiguous(), [x], layer="conv")
    assert "a convolution's output" in drawn.metadata["layout"]


# ---------------------------------------------------------------- Grad-CAM oracle


def _grad_cam_oracle(model: nn.Module, layer: nn.Module, x: torch.Tensor, reshape: object) -> Any:
    pytest.importorskip("pytorch_grad_cam")
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    with torch.no_grad():
        top = int(model(x).argmax())
    with GradCAM(model=model, target_layers=[layer], reshape_transform=reshape) as cam:
        return cam(input_tensor=x, targets=[ClassifierOutputTarget(top)])[0]


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    return t.permute(0, 3, 1, 2)


def _vit_tokens(t: torch.Tensor) -> torch.Tensor:  # pytorch-grad-cam's ViT recipe
    return t[:, 1:, :].reshape(t.size(0), 14, 14, t.size(2)).permute(0, 3, 1, 2)


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval()
    if name.startswith("vit"):  # torchvision zero-initialises ViT's head: no gradient at all
        nn.init.normal_(model.heads.head.weight, std=0.02)
    return model


@pytest.mark.parametrize(
    ("name", "layer", "reshape"),
    [
        ("swin_t", "features.7", _nhwc),
        ("convnext_tiny", "features.7.2.block.3", _nhwc),
        ("vit_b_16", "encoder.layers.encoder_layer_11.ln_1", _vit_tokens),
    ],
)
def test_cam_on_channels_last_and_token_layers_equals_pytorch_grad_cam(
    name: str, layer: str, reshape: object
) -> None:
    model = _model(name)
    torch.manual_seed(1)
    x = torch.randn(1, 3, 224, 224)
    expected = _grad_cam_oracle(model, model.get_submodule(layer), x, reshape)
    drawing = hookcli.cam(model, [x], layer=layer, device="cpu")
    assert drawing.raw is not None
    ours = drawing.raw.astype(np.float64).ravel()
    theirs = np.asarray(expected, dtype=np.float64).ravel()
    assert ours.std() > 0 and theirs.std() > 0
    assert np.corrcoef(ours, theirs)[0, 1] >= 0.999
    assert drawing.picture.layout.startswith(TOKENS if name.startswith("vit") else NHWC)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("vit_b_16", "encoder.layers.encoder_layer_11.ln_1"),  # the ViT recipe's layer
        ("swin_t", "norm"),
        ("convnext_tiny", "features"),
        ("maxvit_t", "blocks.3"),
    ],
)
def test_the_default_cam_layer_is_the_last_one_the_gradient_reaches(
    name: str, expected: str
) -> None:
    torch.manual_seed(1)
    drawing = hookcli.cam(_model(name), [torch.randn(1, 3, 224, 224)], device="cpu")
    assert drawing.layer == expected
    assert drawing.heat is not None and float(drawing.heat.max()) == 1.0


def test_maxvit_window_partitions_are_refused_and_its_stages_are_nchw() -> None:
    """MaxViT registers a PartitionAttentionLayer's departition before the layers it runs
    first, so registration order cannot tell; the Partition/Departition pair does. Without
    that hint the grid partition (1, 49, 64, 64) passes for a 64x64 NCHW map."""
    model = torchvision.models.maxvit_t().eval()
    hints = model_hints(model)
    layer = "blocks.0.layers.0.layers.grid_attention"
    for inner in ("partition_op", "partition_swap", "attn_layer.0", "departition_swap"):
        assert f"{layer}.{inner}" in hints.windows, inner
    assert f"{layer}.departition_op" not in hints.windows and layer not in hints.windows
    x = torch.randn(1, 3, 224, 224)
    names = [f"{layer}.partition_op", f"{layer}.departition_swap", layer, "blocks.3"]
    got = captured_outputs(model, x, names)
    with torch.no_grad():
        logits = model(x)
    part = tuple(got[f"{layer}.partition_op"].shape)
    assert part == (1, 49, 64, 64)
    assert resolve("p", part, (224, 224), NONE).kind == NCHW  # what a guess would draw
    for name in names[:2]:
        with pytest.raises(UsageError, match="holds windows") as refused:
            resolve(name, tuple(got[name].shape), (224, 224), hints)
        assert refused.value.hint == f"pick {layer}, which puts the windows back together."
    assert resolve(layer, tuple(got[layer].shape), (224, 224), hints).label == NCHW
    stage = resolve("blocks.3", tuple(got["blocks.3"].shape), (224, 224), hints)
    assert (stage.kind, stage.grid, stage.channels) == (NCHW, (7, 7), 512)
    with torch.no_grad():  # the oracle: the classifier pools over the dims read as the grid
        assert torch.equal(model.classifier(stage.to_nchw(got["blocks.3"])), logits)


def test_without_an_image_input_only_convolutions_have_a_layout() -> None:
    """A text model's (N, heads, L, L) attention scores are not maps: no image to check
    against, so refused (JSON: unknown) rather than assumed NCHW; a float 4-D input of any
    channel count is an image batch, token ids are not."""
    with pytest.raises(UsageError, match="not an image"):
        resolve("attn.dropout", (1, 2, 16, 16), None, NONE)
    conv = ModelHints(convolutions=frozenset({"conv"}))
    assert resolve("conv", (1, 8, 16, 16), None, conv).kind == NCHW
    assert image_of((torch.randn(2, 8, 32, 48),)) == ((32, 48), 2)
    assert image_of((torch.randint(0, 9, (1, 16)),)) == (None, None)
    assert image_of((torch.randint(0, 9, (2, 8, 4, 4)),)) == (None, None)
    assert image_of((torch.rand(1, 224, 224, 3),)) == (None, None)  # NHWC pixels: not read


def test_an_all_zero_map_names_its_cause() -> None:
    torch.manual_seed(0)
    vit = torchvision.models.vit_b_16().eval()  # as torchvision builds it: the head is zero
    drawing = hookcli.cam(
        vit, [torch.randn(1, 3, 224, 224)], layer="encoder.layers.encoder_layer_11.ln_1"
    )
    assert drawing.heat is not None and not drawing.heat.any()
    assert any("same for every class" in n and "zero-initialised head" in n for n in drawing.notes)


def test_ablate_mean_keeps_each_channel_where_the_layout_has_it() -> None:
    """--ablate LAYER=mean on a channels-last output averages over N, H and W per channel
    (dim 3), not over dim 1 as for NCHW."""
    from torchvision.ops.misc import Permute

    from hookcli.commands.ablation import ablated, parse
    from hookcli.engine.layout import model_hints, resolve
    from hookcli.engine.selection import module_entries

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 4, stride=4), Permute([0, 2, 3, 1]), nn.LayerNorm(4))
    x = torch.randn(2, 3, 32, 32)
    hints = model_hints(model)

    def layout(name: str, shape: tuple[int, ...]) -> Any:
        return resolve(name, shape, (32, 32), hints)

    with torch.no_grad():
        plain = model(x)
        with ablated(module_entries(model), [parse("2=mean")], 0, layout):
            changed = model(x)
    assert changed.shape == (2, 8, 8, 4)
    expected = plain.mean(dim=(0, 1, 2))
    assert torch.allclose(changed, expected.expand_as(changed))


class Stages(nn.Module):
    """A conv stage, a channels-last stage (torchvision's Permute), a token view, a head."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.ops.misc import Permute

        self.conv = nn.Conv2d(3, 6, 4, stride=4)  # 1x6x8x8: NCHW
        self.to_last = Permute([0, 2, 3, 1])
        self.norm = nn.LayerNorm(6)  # 1x8x8x6: NHWC, from the model's Permute
        self.tokens = nn.Flatten(1, 2)  # 1x64x6: 8x8 patch tokens, no prefix
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tokens(self.norm(self.to_last(self.conv(x)))).mean(1))


def test_json_states_each_3d_and_4d_output_layout() -> None:
    report = hookcli.inspect(Stages(), [torch.randn(1, 3, 32, 32)], device="cpu")
    layouts = {c.name: c.outputs[0].layout for c in report.layers}
    assert layouts == {
        "conv": "NCHW",
        "to_last": "NHWC",
        "norm": "NHWC",
        "tokens": "tokens:0+8x8",
        "head": None,
    }
    assert report.to_dict()["layers"][2]["outputs"][0]["layout"] == "NHWC"
    ambiguous = hookcli.inspect(Ambiguous(), [torch.randn(1, 3, 32, 32)], device="cpu")
    assert [c.outputs[0].layout for c in ambiguous.layers[:2]] == ["NCHW", "unknown"]
    folder = hookcli.inspect(Stages(), [str(ROOT / "sample_images")], batch_size=1, device="cpu")
    assert [c.outputs[0].layout for c in folder.layers][:2] == ["NCHW", "NHWC"]


def test_a_text_inputs_tokens_are_told_without_walking_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No image in the input: a 3-D output has no grid to be laid on, whatever the model says,
    so the model's tree is not walked for hints (a language model's every output is 3-D: the
    walk cost a 24-block model 1.6 ms a pass); a 4-D output, or an image input, still reads
    them."""
    from hookcli.engine import layout

    walked: list[nn.Module] = []

    def counted(model: nn.Module) -> ModelHints:
        walked.append(model)
        return model_hints(model)

    monkeypatch.setattr(layout, "model_hints", counted)
    model = torchvision.models.vit_b_16()
    text = layout.reader(model, None, None)
    with pytest.raises(UsageError, match="not an image"):
        text("encoder", (1, 16, 64))
    assert walked == []
    with pytest.raises(UsageError, match="no layout"):
        text("x", (1, 4, 8, 8))
    assert walked == [model]
    image = layout.reader(model, (224, 224), 1)
    assert image("encoder", (1, 197, 768)).prefix == 1
    assert walked == [model, model]
