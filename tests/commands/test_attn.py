"""hookcli attn: attention probabilities against softmax(QK^T/sqrt(d)) computed by hand from
each block's input and its own projection weights (torch MultiheadAttention, timm, Hugging
Face), rollout against a hand-written one, the model's output and state untouched, and the
command line's files and one-line errors."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.engine.attention import capture_attention, find_attention
from hookcli.engine.prepare import prepare
from hookcli.errors import ModelError, UsageError
from hookcli.options import InputOptions, ModelOptions
from tests.support.attention import rollout_by_hand
from tests.support.cli import assert_one_line_error
from tests.support.oracles import hooks_left
from tests.support.paths import CAT

runner = CliRunner()
HF_ARGS = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}
HF_CLI = [a for k, v in HF_ARGS.items() for a in ("--model-arg", f"{k}={v}")]


def run(*args: str) -> Any:
    return runner.invoke(app, list(args))


# ---------------------------------------------------------------- by hand


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, L, C) → (B, heads, L, C / heads)."""
    b, n, c = t.shape
    return t.reshape(b, n, heads, c // heads).transpose(1, 2)


def _softmax(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1)


@torch.no_grad()
def mha_by_hand(mha: nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    """softmax(QK^T/sqrt(d)) from in_proj_weight/in_proj_bias; x batch first (B, L, E)."""
    x = x.double()
    w, b = mha.in_proj_weight.double(), mha.in_proj_bias.double()
    q, k, _ = F.linear(x, w, b).chunk(3, dim=-1)
    h = mha.num_heads
    return _softmax(_heads(q, h), _heads(k, h), 1 / math.sqrt(mha.head_dim))


@torch.no_grad()
def timm_by_hand(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """From timm's fused qkv Linear: (B, N, 3, heads, d) as timm lays it out."""
    bias = attn.qkv.bias.double() if attn.qkv.bias is not None else None
    qkv = F.linear(x.double(), attn.qkv.weight.double(), bias)
    b, n, _ = x.shape
    qkv = qkv.reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    return _softmax(qkv[0], qkv[1], attn.head_dim**-0.5)


@torch.no_grad()
def hf_by_hand(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """From the q_proj/k_proj Linears of transformers 5's ViTAttention."""
    x = x.double()
    q = F.linear(x, attn.q_proj.weight.double(), attn.q_proj.bias.double())
    k = F.linear(x, attn.k_proj.weight.double(), attn.k_proj.bias.double())
    h = attn.num_attention_heads
    return _softmax(_heads(q, h), _heads(k, h), attn.head_dim**-0.5)


def inputs_of(model: nn.Module, modules: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """Each module's first input in a plain forward (this test's own hooks, removed)."""
    seen: dict[int, torch.Tensor] = {}

    def keep(i: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(_m: nn.Module, args: tuple[Any, ...]) -> None:
            seen.setdefault(i, args[0].detach().clone())

        return hook

    handles = [m.register_forward_pre_hook(keep(i)) for i, m in enumerate(modules)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return [seen[i] for i in range(len(modules))]


# ---------------------------------------------------------------- the three kinds


@dataclass
class Case:
    model: nn.Module
    x: torch.Tensor
    blocks: list[str]
    attention: list[nn.Module]
    by_hand: Callable[[nn.Module, torch.Tensor], torch.Tensor]


def torchvision_vit() -> Case:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32
    ).eval()
    layers = list(model.encoder.layers)
    return Case(
        model,
        torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)),
        [f"encoder.layers.encoder_layer_{i}" for i in range(2)],
        [layer.self_attention for layer in layers],
        mha_by_hand,  # type: ignore[arg-type]
    )


def timm_vit(**kwargs: Any) -> Case:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("test_vit", pretrained=False, **kwargs).eval()
    return Case(
        model,
        torch.randn(1, 3, 160, 160, generator=torch.Generator().manual_seed(1)),
        [f"blocks.{i}" for i in range(len(model.blocks))],
        [b.attn for b in model.blocks],
        timm_by_hand,
    )


def hf_vit() -> Case:
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(**HF_ARGS, image_size=32, patch_size=8)
    model = transformers.ViTForImageClassification(config).eval()
    return Case(
        model,
        torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)),
        [f"vit.layers.{i}" for i in range(2)],
        [layer.attention for layer in model.vit.layers],
        hf_by_hand,
    )


CASES = {"torchvision": torchvision_vit, "timm": timm_vit, "hf": hf_vit}


def logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", list(CASES))
def test_probabilities_and_rollout_equal_a_hand_computation(kind: str) -> None:
    case = CASES[kind]()
    hand = [
        case.by_hand(a, x)
        for a, x in zip(case.attention, inputs_of(case.model, case.attention, case.x), strict=True)
    ]
    for block, want in [(case.blocks[0], hand[0]), (case.blocks[-1], hand[-1])]:
        drawing = hookcli.attn(case.model, case.x, layer=block, device="cpu")
        assert drawing.layer == block
        got = drawing.raw
        assert got is not None and got.dtype == np.float32
        assert got.shape == tuple(want.shape)  # (batch, heads, tokens, tokens)
        assert np.abs(got - want.numpy()).max() < 1e-5, block
    # the default block is the last one; the rollout runs through every block
    last = hookcli.attn(case.model, case.x, device="cpu")
    assert last.layer == case.blocks[-1]
    assert last.raw is not None and np.abs(last.raw - hand[-1].numpy()).max() < 1e-5
    rolled = rollout_by_hand(hand)
    assert last.rollout is not None and last.rollout.shape == tuple(rolled.shape)
    assert np.abs(last.rollout - rolled.numpy()).max() < 1e-5
    np.testing.assert_allclose(last.rollout.sum(-1), 1, atol=1e-5)
    # drawn: the class-token row of image 0 (its patches, prefix token dropped), min..max
    row = rolled[0, 0, 1:]
    side = math.isqrt(row.numel())
    want_heat = ((row - row.min()) / (row.max() - row.min())).reshape(side, side)
    assert last.heat is not None and np.abs(last.heat - want_heat.numpy()).max() < 1e-4
    heads = hand[-1][0, :, 0, 1:]
    scaled = (heads - heads.amin(1, keepdim=True)) / (
        heads.amax(1, keepdim=True) - heads.amin(1, keepdim=True)
    )
    tiles = last.picture.tiles
    assert tiles is not None
    want_tiles = (scaled.reshape(-1, side, side).numpy() * 255 + 0.5).astype(np.uint8)
    assert np.abs(tiles.astype(int) - want_tiles.astype(int)).max() <= 1
    assert any(f"1 prefix + {side}x{side} patches" in line for line in last.picture.legend)


def test_no_class_token_draws_the_mean_over_query_tokens() -> None:
    case = timm_vit(class_token=False, global_pool="avg")
    hand = [
        case.by_hand(a, x)
        for a, x in zip(case.attention, inputs_of(case.model, case.attention, case.x), strict=True)
    ]
    d = hookcli.attn(case.model, case.x, device="cpu")
    assert d.raw is not None and d.raw.shape == (1, 2, 100, 100)
    row = rollout_by_hand(hand)[0].mean(dim=0)  # no prefix token: every token is a patch
    want = ((row - row.min()) / (row.max() - row.min())).reshape(10, 10)
    assert d.heat is not None and np.abs(d.heat - want.numpy()).max() < 1e-4
    assert any("mean of 100" in line for line in d.picture.legend)


class _Block(nn.Module):
    """Uses the averaged weights its MultiheadAttention returns (sequence first, the flag
    positional): hookcli's per-head request must not reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, w = self.attn(x, x, x, None, True)  # w: (B, L, S), averaged over heads
        return out + w[..., :1].transpose(0, 1)


class WeightsUser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_block_that_uses_its_weights_gets_what_it_asked_for() -> None:
    torch.manual_seed(0)
    model = WeightsUser().eval()
    x = torch.randn(5, 2, 8)  # (L, B, E): batch_first=False
    with torch.no_grad():
        plain = model(x)
    prepared = prepare(ModelOptions(model, device="cpu"), inputs=InputOptions((x,)))
    sites = find_attention(model)
    assert [s.block for s in sites] == ["layers.0", "layers.1"]
    got = capture_attention(prepared, sites, keep={s.name for s in sites})
    assert torch.equal(got.output, plain)
    ins = inputs_of(model, [b.attn for b in model.layers], x)
    for call, attn, xin in zip(got.calls, [b.attn for b in model.layers], ins, strict=True):
        want = mha_by_hand(attn, xin.transpose(0, 1))
        assert call.probs is not None and call.probs.shape == (2, 2, 5, 5)
        assert (call.probs.double() - want).abs().max() < 1e-5
    assert hooks_left(model) == 0
    d = hookcli.attn(model, x, layer="layers.1.attn", device="cpu")  # the module names its block
    assert d.layer == "layers.1" and d.picture.image is None
    assert d.picture.layout == "tokens:5x5"


# ---------------------------------------------------------------- the model as found


def _exact_twin(kind: str, model: nn.Module) -> Callable[[], None]:
    """Put the model in the implementation the capture runs (MultiheadAttention: as it is;
    timm: fused_attn off; HF: eager); returns the undo."""
    if kind == "timm":
        flags = [(b.attn, b.attn.fused_attn) for b in model.blocks]
        for a, _ in flags:
            a.fused_attn = False

        def undo() -> None:
            for a, flag in flags:
                a.fused_attn = flag

        return undo
    if kind == "hf":
        was = model.config._attn_implementation
        model.set_attn_implementation("eager")
        return lambda: model.set_attn_implementation(was)
    return lambda: None


@pytest.mark.parametrize("kind", list(CASES))
def test_output_unchanged_and_model_left_as_found(kind: str) -> None:
    case = CASES[kind]()
    model, x = case.model, case.x
    if kind == "timm":
        model.blocks[0].attn.fused_attn = False  # a mixed state, each flag to come back
    with torch.no_grad():
        plain = logits(model(x))
    undo = _exact_twin(kind, model)
    with torch.no_grad():
        twin = logits(model(x))
    undo()
    fused = [getattr(a, "fused_attn", None) for a in case.attention]
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()  # the pass runs in eval mode; train mode comes back

    prepared = prepare(ModelOptions(model, device="cpu"), inputs=InputOptions((x,)))
    sites = find_attention(model)
    got = capture_attention(prepared, sites, keep=set())
    captured = logits(got.output)
    # the capture changes nothing the model computes: bit for bit what the same
    # implementation computes unhooked, and within rounding of the fused/SDPA kernels
    assert torch.equal(captured, twin)
    assert torch.allclose(captured, plain, rtol=1e-5, atol=1e-6)
    if kind == "torchvision":
        assert torch.equal(captured, plain)
    assert len(got.calls) == len(case.blocks)

    hookcli.attn(model, x, device="cpu")
    assert all(m.training for m in model.modules())
    model.eval()
    assert hooks_left(model) == 0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert [getattr(a, "fused_attn", None) for a in case.attention] == fused
    assert getattr(getattr(model, "config", None), "_attn_implementation", None) == impl
    assert not any("_output_capturing_hooks_installed" in vars(m) for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(logits(model(x)), plain)


@pytest.mark.parametrize("kind", ["timm", "hf"])
def test_switches_come_back_when_the_forward_raises(kind: str) -> None:
    case = CASES[kind]()
    model = case.model
    fused = [getattr(a, "fused_attn", None) for a in case.attention]
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    layer = model.blocks[-1] if kind == "timm" else model.vit.layers[-1]

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    layer.mlp.forward = broken
    with pytest.raises(ModelError, match="boom"):
        hookcli.attn(model, case.x, device="cpu")
    del layer.mlp.forward
    assert [getattr(a, "fused_attn", None) for a in case.attention] == fused
    assert getattr(getattr(model, "config", None), "_attn_implementation", None) == impl
    assert hooks_left(model) == 0


def test_a_model_without_attention_is_a_usage_error() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    with pytest.raises(UsageError, match="no attention module"):
        hookcli.attn(model, torch.randn(1, 3, 8, 8), device="cpu")


# ---------------------------------------------------------------- the command line


def test_cli_timm_png_and_raw_probabilities(tmp_path: Path) -> None:
    png, raw = tmp_path / "attn.png", tmp_path / "attn.npy"
    r = run("attn", "timm:test_vit", str(CAT), "-l", "blocks.3", "-o", str(png),
            "--save-raw", str(raw), "--device", "cpu")  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "" and f"wrote {png}" in r.stderr and f"wrote {raw}" in r.stderr
    probs = np.load(raw)
    assert probs.dtype == np.float32 and probs.shape == (1, 2, 101, 101)
    np.testing.assert_allclose(probs.sum(-1), 1, atol=1e-5)
    img = Image.open(png)
    assert img.format == "PNG"
    meta = json.loads(img.info["hookcli"])
    assert "blocks.3" in meta["title"] and meta["layout"] == "tokens:1+10x10"
    assert [t["label"] for t in meta["tiles"]] == ["head 0", "head 1"]
    x0, y0, x1, y1 = meta["rollout"]["box"]
    rollout = np.asarray(img.convert("RGB"))[y0 + 20 : y1, x0:x1]
    assert rollout.std() > 1, "the rollout panel is drawn"


def test_queries_on_an_image_grid_is_refused_not_ignored(tmp_path: Path) -> None:
    r = run("attn", "timm:test_vit", str(CAT), "-l", "blocks.3", "-o", str(tmp_path / "a.png"),
            "--queries", "5:1", "--device", "cpu")  # fmt: skip
    assert_one_line_error(r, 2, "--queries picks rows of a token x token map", "drop --queries")
    assert not (tmp_path / "a.png").exists()


def test_cli_hf_text_matrices_and_vision_by_glob(tmp_path: Path) -> None:
    raw = tmp_path / "bert.npy"
    r = run("attn", "hf:bert", *HF_CLI, "-o", str(tmp_path / "b.png"), "--save-raw", str(raw),
            "--device", "cpu")  # fmt: skip
    assert r.exit_code == 0, r.stderr
    probs = np.load(raw)
    assert probs.shape == (1, 2, 16, 16)  # token x token: the default 16 token ids
    np.testing.assert_allclose(probs.sum(-1), 1, atol=1e-5)
    meta = json.loads(Image.open(tmp_path / "b.png").info["hookcli"])
    assert "bert.encoder.layer.1" in meta["title"] and meta["layout"] == "tokens:16x16"
    r = run("attn", "hf:vit", *HF_CLI, "--model-arg", "image_size=32", "--model-arg",
            "patch_size=8", str(CAT), "-l", "*layers.0", "-o", str(tmp_path / "v.png"),
            "--device", "cpu")  # fmt: skip
    assert r.exit_code == 0, r.stderr
    meta = json.loads(Image.open(tmp_path / "v.png").info["hookcli"])
    assert "vit.layers.0 " in meta["title"] and meta["layout"] == "tokens:1+4x4"


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["timm:test_vit", str(CAT), "-l", "blocks.3.mlp"],
            ["not an attention block", "blocks.0, blocks.1 … blocks.5 (6 blocks)"],
        ),
        (["timm:test_vit", str(CAT), "-l", "blocks.*"], ["matches 6 attention blocks"]),
        (["timm:test_vit", str(CAT), "-l", "blocks.9"], ["no layer matches 'blocks.9'"]),
        (["timm:test_vit", str(CAT), "--image", "1"], ["--image 1 is out of range"]),
        (
            ["resnet18", "--input", "randn:1x3x32x32"],
            ["resnet18 has no attention module", "hookcli attn vit_b_16"],
        ),
    ],
)
def test_cli_bad_usage_is_one_line_and_writes_nothing(
    tmp_path: Path, args: list[str], needles: list[str]
) -> None:
    png, raw = tmp_path / "a.png", tmp_path / "a.npy"
    r = run("attn", *args, "-o", str(png), "--save-raw", str(raw), "--device", "cpu")
    assert_one_line_error(r, 2, *needles)
    assert not png.exists() and not raw.exists()


def test_cli_needs_an_output(tmp_path: Path) -> None:
    assert_one_line_error(run("attn", "timm:test_vit"), 2, "-o FILE.png is required")
    r = run("--help")
    assert r.exit_code == 0 and "attn" in r.stdout
    assert r.stdout.index(" cam ") < r.stdout.index(" attn ")
