"""timm and Hugging Face sources, token-id and keyword inputs (issue 15). Tiny models only:
timm's `test_*` models and HF configs shrunk with --model-arg; no weights are downloaded (the
HF cache is a temporary folder laid out as huggingface_hub expects)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.engine.layout import image_of, reader
from hookcli.engine.prepare import build_input
from hookcli.errors import UsageError
from hookcli.options import InputOptions
from hookcli.sources import load_model
from tests.support.oracles import captured_outputs
from tests.support.paths import CAT

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

runner = CliRunner()
SMALL = ["hidden_size=32", "num_hidden_layers=2", "num_attention_heads=2", "intermediate_size=64"]
SMALL_ARGS = [x for kv in SMALL for x in ("--model-arg", kv)]
SMALL_KW: dict[str, Any] = {k: int(v) for k, v in (kv.split("=") for kv in SMALL)}


def run(*args: str) -> Any:
    return runner.invoke(app, list(args))


def one_line_error(result: Any, code: int, *needles: str) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return str(lines[0])


# ---------------------------------------------------------------- timm


def test_timm_preprocessing_is_timms_own_transform_bitwise() -> None:
    from PIL import Image

    loaded = load_model("timm:test_vit")
    got = build_input(loaded, InputOptions(items=(str(CAT),)), 0).args[0]
    model = timm.create_model("test_vit", pretrained=False)
    cfg = timm.data.resolve_data_config(model=model)
    want = timm.data.create_transform(**cfg)(Image.open(CAT).convert("RGB")).unsqueeze(0)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert tuple(got.shape[-2:]) == tuple(cfg["input_size"][1:]) == (160, 160)
    assert "timm data config" in loaded.preprocess_label and "bicubic" in loaded.preprocess_label


def test_timm_built_for_another_size_gets_that_size() -> None:
    """`--model-arg img_size=N` builds a ViT for N, whose pretrained config still says its
    old size: the input is timm's own transform for N (resolve_data_config with that input
    size), said in the label, and the model runs on it (it raised on 224 px)."""
    from PIL import Image

    loaded = load_model("timm:test_vit", model_args={"img_size": 96})
    got = build_input(loaded, InputOptions(items=(str(CAT),)), 0).args[0]
    model = timm.create_model("test_vit", pretrained=False, img_size=96)
    cfg = timm.data.resolve_data_config(model=model, args={"input_size": (3, 96, 96)})
    want = timm.data.create_transform(**cfg)(Image.open(CAT).convert("RGB")).unsqueeze(0)
    assert torch.equal(got, want) and tuple(got.shape[-2:]) == (96, 96)
    assert "input size 96x96 (the model's patch_embed.img_size" in loaded.preprocess_label
    assert loaded.module(got).shape[0] == 1


def test_timm_inspect_states_the_preprocessing_and_predicts_imagenet_labels() -> None:
    r = run("inspect", "timm:test_vit", str(CAT), "-l", "head", "-f", "json")
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["input"]["preprocessing"].startswith("timm data config: resize 168 (bicubic)")
    assert report["input"]["shapes"] == [[1, 3, 160, 160]]
    top = report["predictions"][0]
    names = [d.split(",")[0] for d in timm.data.ImageNetInfo().label_descriptions()]
    assert top["label"] == names[top["index"]]


def _hub_cache(root: Path, repo: str, state: dict[str, torch.Tensor]) -> Path:
    """A hub cache holding repo's model.safetensors, laid out as huggingface_hub writes it."""
    from safetensors.torch import save_file

    base = root / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text("a" * 40)
    save_file({k: v.contiguous() for k, v in state.items()}, str(snap / "model.safetensors"))
    return snap / "model.safetensors"


def test_timm_default_weights_come_from_the_local_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    r = run("inspect", "timm:test_vit", "--weights", "DEFAULT", "-l", "head")
    expected = tmp_path / "models--timm--test_vit.r160_in1k" / "snapshots"
    one_line_error(r, 2, "not in the local Hugging Face cache", str(expected))
    torch.manual_seed(7)
    saved = timm.create_model("test_vit", pretrained=False).state_dict()
    _hub_cache(tmp_path, "timm/test_vit.r160_in1k", saved)
    loaded = load_model("timm:test_vit", weights="DEFAULT")
    for key, value in loaded.module.state_dict().items():
        assert torch.equal(value, saved[key]), key
    assert loaded.pretrained and "r160_in1k" in loaded.weights_label
    r = run("inspect", "timm:test_vit", "--weights", "nosuchtag", "-l", "head")
    one_line_error(r, 2, "unknown weights 'nosuchtag'", "r160_in1k")


def test_timm_unknown_name_suggests_the_nearest() -> None:
    r = run("inspect", "timm:test_vitt")
    one_line_error(r, 2, "timm has no model 'test_vitt'", "test_vit")


def test_models_lists_timm_and_hf() -> None:
    r = run("models", "--source", "timm", "test_vit*", "-f", "json")
    assert r.exit_code == 0, r.stderr
    names = [m["name"] for m in json.loads(r.stdout)]
    assert "timm:test_vit" in names and all(n.startswith("timm:test_vit") for n in names)
    r = run("models", "--source", "hf", "swin*", "-f", "json")
    assert r.exit_code == 0, r.stderr
    assert {m["name"] for m in json.loads(r.stdout)} >= {"hf:swin", "hf:swinv2"}
    one_line_error(run("models", "--source", "timm", "--task", "detection"), 2, "classification")


def test_a_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm now raises ImportError
    one_line_error(run("inspect", "timm:test_vit"), 2, "pip install 'hookcli[timm]'")
    monkeypatch.setitem(sys.modules, "transformers", None)
    one_line_error(run("inspect", "hf:vit"), 2, "pip install 'hookcli[hf]'")


# ---------------------------------------------------------------- Hugging Face


def _hf_vit() -> list[str]:
    return [*SMALL_ARGS, "--model-arg", "image_size=32", "--model-arg", "patch_size=8"]


def test_hf_model_output_logits_give_predictions_and_the_target() -> None:
    r = run("grads", "hf:vit", str(CAT), *_hf_vit(), "-l", "classifier", "-f", "json")
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["input"]["shapes"] == [[1, 3, 32, 32]]
    # the oracle: the same model and pixel_values, run by hand
    loaded = load_model("hf:vit", model_args={**SMALL_KW, "image_size": 32, "patch_size": 8})
    x = build_input(loaded, InputOptions(items=(str(CAT),)), 0).args[0]
    with torch.no_grad():
        logits = loaded.module(pixel_values=x).logits.double()
    probs = torch.softmax(logits, 1)[0]
    top = report["predictions"][0]
    assert top["index"] == int(probs.argmax()) and top["prob"] == pytest.approx(float(probs.max()))
    grad = report["layers"][0]["grad_outputs"][0]
    assert grad["shape"] == [1, 2] and grad["norm"] == pytest.approx(1.0)  # d top-1 / d logits


def test_hf_image_processor_is_the_types_own() -> None:
    loaded = load_model("hf:vit", model_args={**SMALL_KW, "image_size": 32, "patch_size": 8})
    from PIL import Image

    processor = transformers.ViTImageProcessorPil(size={"height": 32, "width": 32})
    want = processor(images=Image.open(CAT).convert("RGB"), return_tensors="pt")["pixel_values"]
    got = build_input(loaded, InputOptions(items=(str(CAT),)), 0).args[0]
    assert torch.equal(got, want)
    assert loaded.preprocess_label.startswith("ViTImageProcessor")


def test_hf_text_takes_token_ids_as_input_ids_with_an_attention_mask() -> None:
    r = run("inspect", "hf:bert", *SMALL_ARGS, "--input", "randint:0:100:2x8", "-f", "json")
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["input"]["shapes"] == [[2, 8], [2, 8]]
    assert "input_ids" in report["input"]["description"]
    root = next(c for c in report["layers"] if c["name"] == "bert.embeddings.word_embeddings")
    ids = root["inputs"][0]
    assert ids["dtype"] == "int64" and ids["min"] >= 0 and ids["max"] < 100
    assert len(report["predictions"]) == 2 * 2  # two sequences, two labels each
    # no input: random ids over the whole vocabulary, stated
    r = run("grads", "hf:bert", *SMALL_ARGS, "-l", "classifier", "-f", "json")
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert "input_ids randint:0:30522:1x16" in report["input"]["description"]
    assert report["backward"]["source"] == "top-1 score (logit) of each sequence, summed"


def test_hf_types_with_several_head_classes_build() -> None:
    """deit maps to two image-classification classes; from_config must pick the first."""
    args = {**SMALL_KW, "image_size": 32, "patch_size": 8}
    assert type(load_model("hf:deit", model_args=args).module).__name__ == (
        "DeiTForImageClassification"
    )


def test_keyword_inputs_reach_the_forward_by_name() -> None:
    seen: dict[str, Any] = {}

    class Keywords(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 4)

        def forward(self, input_ids: torch.Tensor, scale: torch.Tensor | None = None) -> Any:
            seen["ids"], seen["scale"] = input_ids, scale
            assert scale is not None
            return self.embed(input_ids) * scale

    report = hookcli.inspect(
        Keywords(),
        input_specs=["randint:3:7:2x5", "scale=ones:1:float64"],
        device="cpu",
    )
    assert seen["ids"].dtype == torch.int64 and seen["scale"].dtype == torch.float64
    assert int(seen["ids"].min()) >= 3 and int(seen["ids"].max()) < 7
    out = report.layers[0].outputs[0]
    assert out.dtype == "float32" and list(out.shape) == [2, 5, 4]
    # by name only: both as keywords
    hookcli.inspect(
        Keywords(), input_specs=["input_ids=randint:0:50:1x3", "scale=ones:1"], device="cpu"
    )
    assert seen["ids"].shape == (1, 3)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("randint:5:5:1x2", "HIGH (5) must be above LOW (5)"),
        ("randn:2x2:int64", "would be truncated"),
        ("randint:0:9", "expected KIND:SHAPE"),
        ("x=randn:1x2", ""),  # a keyword the model does not take: the model's own error
    ],
)
def test_bad_token_specs_are_one_line(spec: str, needle: str) -> None:
    r = run("inspect", "resnet18", "--input", spec)
    assert r.exit_code in (2, 3)
    one_line_error(r, r.exit_code, needle)
    if needle:
        assert r.exit_code == 2


def test_dtype_suffixes_apply_to_every_kind(tmp_path: Path) -> None:
    from hookcli.inputs import parse

    assert parse("randn:2x3:bfloat16", 0).tensors[0].dtype == torch.bfloat16
    assert parse("ones:2:int8", 0).tensors[0].dtype == torch.int8  # whole numbers cast exactly
    ids = parse("randint:-3:3:1000:int32", 1).tensors[0]
    assert ids.dtype == torch.int32 and int(ids.min()) == -3 and int(ids.max()) == 2
    np.save(tmp_path / "x.npy", np.arange(4, dtype=np.float32))
    spec = parse(f"weights={tmp_path / 'x.npy'}:float16", 0)
    assert spec.name == "weights" and spec.tensors[0].dtype == torch.float16
    with pytest.raises(UsageError, match="names the keyword 'a' twice"):
        hookcli.inspect(nn.Identity(), input_specs=["a=ones:1", "a=ones:1"], device="cpu")


# ---------------------------------------------------------------- layouts: the truth


def _outputs(model: nn.Module, names: list[str], x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each named module's output; of a tuple (HF layers), its first element."""
    got = captured_outputs(model, x, names)
    return {n: o[0] if isinstance(o, tuple) else o for n, o in got.items()}


@pytest.mark.parametrize(
    ("name", "kwargs", "layers", "label"),
    [
        ("test_vit", {}, ["blocks.0", "blocks.1"], "tokens:1+10x10"),
        (
            "deit_tiny_distilled_patch16_224",
            {"depth": 2, "embed_dim": 32, "num_heads": 2},
            ["blocks.0", "blocks.1"],
            "tokens:2+14x14",
        ),
        (
            "swin_tiny_patch4_window7_224",
            {"embed_dim": 16, "depths": (1, 1, 1, 1), "num_heads": (1, 1, 1, 1)},
            ["layers.0", "layers.1", "layers.2", "layers.3"],
            "NHWC",
        ),
        ("test_convnext", {}, ["stages.0", "stages.1", "stages.2", "stages.3"], "NCHW"),
    ],
)
def test_timm_layouts_equal_forward_intermediates(
    name: str, kwargs: dict[str, Any], layers: list[str], label: str
) -> None:
    """timm's own forward_intermediates(output_fmt='NCHW') is the oracle for the maps."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **kwargs).eval()
    size = timm.data.resolve_data_config(model=model)["input_size"][1:]
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        truth = model.forward_intermediates(
            x, indices=list(range(len(layers))), output_fmt="NCHW", intermediates_only=True
        )
    got = _outputs(model, layers, x)
    layout_of = reader(model, *image_of((x,)))
    for i, layer in enumerate(layers):
        layout = layout_of(layer, tuple(got[layer].shape))
        assert layout.label == label, (layer, layout.describe())
        assert torch.equal(layout.to_nchw(got[layer]), truth[i]), layer


def test_timm_windowed_attention_outputs_are_refused() -> None:
    model = timm.create_model(
        "swin_tiny_patch4_window7_224",
        embed_dim=16,
        depths=(1, 1, 1, 1),
        num_heads=(1, 1, 1, 1),
    ).eval()
    x = torch.randn(1, 3, 224, 224)
    got = _outputs(model, ["layers.0.blocks.0.attn"], x)["layers.0.blocks.0.attn"]
    assert got.shape[0] == 64  # 8x8 windows of 7x7 tokens: 49 tokens would tile a 7x7 grid
    with pytest.raises(UsageError, match="holds windows"):
        reader(model, *image_of((x,)))("layers.0.blocks.0.attn", tuple(got.shape))


def test_hf_swin_layouts_equal_its_reshaped_hidden_states() -> None:
    loaded = load_model(
        "hf:swin",
        model_args={"embed_dim": 16, "depths": [1, 1, 1, 1], "num_heads": [1, 1, 1, 1]},
    )
    model = loaded.module
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        truth = model(pixel_values=x, output_hidden_states=True).reshaped_hidden_states
    got = _outputs(model, ["swin.embeddings", "swin.layernorm"], x)
    layout_of = reader(model, *image_of((x,)))
    emb = layout_of("swin.embeddings", tuple(got["swin.embeddings"].shape))
    assert emb.label == "tokens:0+56x56"
    assert torch.equal(emb.to_nchw(got["swin.embeddings"]), truth[0])
    last = layout_of("swin.layernorm", tuple(got["swin.layernorm"].shape))
    assert last.label == "tokens:0+7x7"


def test_hf_vit_and_convnext_layouts() -> None:
    vit = load_model("hf:vit", model_args={**SMALL_KW, "image_size": 32, "patch_size": 8}).module
    x = torch.randn(1, 3, 32, 32)
    got = _outputs(vit, ["vit.layers.1"], x)["vit.layers.1"]
    layout = reader(vit, *image_of((x,)))("vit.layers.1", tuple(got.shape))
    assert layout.label == "tokens:1+4x4" and "class token" in layout.how
    # the oracle: HF's own hidden state after the block, CLS dropped, as (N, C, h, w)
    with torch.no_grad():
        hidden = vit(pixel_values=x, output_hidden_states=True).hidden_states[2]
    want = hidden[:, 1:].reshape(1, 4, 4, 32).permute(0, 3, 1, 2)
    assert torch.equal(layout.to_nchw(got), want)
    convnext = load_model(
        "hf:convnext",
        model_args={"depths": [1, 1, 1, 1], "hidden_sizes": [8, 16, 32, 64], "image_size": 64},
    ).module
    x = torch.randn(1, 3, 64, 64)
    block = "convnext.encoder.stages.1.layers.0"
    got2 = _outputs(convnext, [f"{block}.dwconv", f"{block}.layernorm", block], x)
    layout_of = reader(convnext, *image_of((x,)))
    norm = layout_of(f"{block}.layernorm", tuple(got2[f"{block}.layernorm"].shape))
    assert norm.label == "NHWC"
    assert layout_of(block, tuple(got2[block].shape)).label == "NCHW"
    # the oracle: the block's LayerNorm over channels of its depthwise conv's output
    dw = got2[f"{block}.dwconv"]
    ln = dict(convnext.named_modules())[f"{block}.layernorm"]
    with torch.no_grad():
        want2 = ln(dw.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    assert torch.equal(norm.to_nchw(got2[f"{block}.layernorm"]), want2)


@pytest.mark.parametrize(
    ("model", "model_args", "expected"),
    [
        ("timm:test_vit", {}, "blocks.{last}.norm1"),  # not the q/k/v Linear after it
        (
            "hf:vit",
            {**SMALL_KW, "image_size": 32, "patch_size": 8},
            "vit.layers.1.layernorm_before",
        ),
        (
            "hf:swin",  # not the backbone `swin`, whose ModelOutput holds the same states
            {"embed_dim": 16, "depths": [1, 1, 1, 1], "num_heads": [1, 1, 1, 1]},
            "swin.layernorm",
        ),
    ],
)
def test_default_cam_layers_of_timm_and_hf_follow_the_recipe(
    model: str, model_args: dict[str, Any], expected: str
) -> None:
    """A ViT's last-block pre-attention norm (the recipe's layer) for timm and Hugging Face
    as for torchvision; the attention's own projections, later in the block, are passed over."""
    drawing = hookcli.cam(model, CAT, device="cpu", model_args=model_args)
    if "{last}" in expected:
        depth = len(load_model(model).module.blocks)
        expected = expected.format(last=depth - 1)
    assert drawing.layer == expected
    assert drawing.heat is not None and drawing.picture.layout.startswith("tokens")


def test_timm_attention_bias_caches_start_empty_and_come_back() -> None:
    """LeViT keeps `attention_bias_cache` filled in eval mode: a second pass would backward
    through a tensor whose graph the first freed (cam runs two), or reuse the user's no-grad
    one. Each pass starts empty; the model's own dicts come back."""
    model = timm.create_model("levit_128s").eval()
    x = torch.randn(1, 3, 224, 224)

    def caches() -> dict[str, dict[str, torch.Tensor]]:
        return {
            n: m.attention_bias_cache
            for n, m in model.named_modules()
            if isinstance(getattr(m, "attention_bias_cache", None), dict)
        }

    before = caches()
    assert before and not any(before.values())
    drawing = hookcli.cam(model, [x], device="cpu")  # two forwards and backwards
    assert drawing.heat is not None
    assert all(c is before[n] and not c for n, c in caches().items())
    with torch.no_grad():
        model(x)  # the user's own pass fills them
    filled = {n: dict(c) for n, c in caches().items()}
    hookcli.grads(model, [x], device="cpu", layers=["stages.2"])
    assert all(c is before[n] and c == filled[n] for n, c in caches().items())


def test_cait_patch_tokens_before_the_class_token_joins() -> None:
    """CaiT's num_prefix_tokens is 1, yet its main blocks carry the 14x14 patches alone (the
    class token joins in blocks_token_only): read with no prefix, equal to timm's own
    forward_intermediates; the default CAM layer is the class-attention block's norm1 (its
    block class ends in ClassAttn, yet is a block, not an attention)."""
    torch.manual_seed(0)
    model = timm.create_model(
        "cait_xxs24_224", depth=2, depth_token_only=1, embed_dim=32, num_heads=2
    ).eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        truth = model.forward_intermediates(
            x, indices=[1], output_fmt="NCHW", intermediates_only=True
        )[0]
    got = _outputs(model, ["blocks.1"], x)["blocks.1"]
    layout = reader(model, *image_of((x,)))("blocks.1", tuple(got.shape))
    assert layout.label == "tokens:0+14x14" and "before" in layout.how
    assert torch.equal(layout.to_nchw(got), truth)
    assert hookcli.cam(model, [x], device="cpu").layer == "blocks_token_only.0.norm1"


def test_hf_types_whose_default_config_needs_more() -> None:
    """bart classifies at its last <eos> (the default ids end with one), t5's default config
    lacks decoder_start_token_id (its checkpoints use <pad>), timm_wrapper's image processor
    needs timm's pretrained config, imagegpt takes colour-cluster ids."""
    bart = hookcli.inspect(
        "hf:bart",
        head="seq-cls",  # hf:bart alone is its seq2seq LM
        device="cpu",
        layers=["classification_head"],
        model_args={
            "d_model": 16, "encoder_layers": 1, "decoder_layers": 1, "vocab_size": 100,
            "encoder_attention_heads": 2, "decoder_attention_heads": 2,
            "encoder_ffn_dim": 32, "decoder_ffn_dim": 32,
        },
    )  # fmt: skip
    assert "the last one <eos> (2)" in bart.input.description and bart.predictions
    t5 = {"d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2, "vocab_size": 100}
    assert hookcli.inspect("hf:t5", device="cpu", model_args=t5, layers=["*head*"]).predictions
    wrapped = hookcli.inspect(
        "hf:timm_wrapper", CAT, device="cpu", model_args={"architecture": "test_vit"}, depth=1
    )
    assert wrapped.input.shapes == [(1, 3, 160, 160)]  # test_vit's own data config
    assert str(wrapped.input.preprocessing).startswith("TimmWrapperImageProcessor")
    gpt = {"n_embd": 16, "n_layer": 1, "n_head": 2}
    report = hookcli.inspect("hf:imagegpt", device="cpu", model_args=gpt, depth=1)
    assert "input_ids randint:0:513" in report.input.description and report.predictions


def test_images_given_to_a_text_model_are_refused_in_one_line() -> None:
    result = run("cam", "hf:bert", str(CAT), *SMALL_ARGS, "-o", "-")
    one_line_error(result, 2, "takes token ids, not images")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["num_hidden_layers=abc"], "expected int, got str"),
        (["hidden_size=33", "num_hidden_layers=1"], "not a multiple of the number of attention"),
    ],
)
def test_a_value_an_hf_types_config_refuses_is_one_line_exit_2(
    args: list[str], needle: str
) -> None:
    """transformers' typed configs refuse a value with their own error class: the user's input
    (exit 2, its reason whole), not an internal error (exit 3), as a folder's config.json's."""
    from tests.support.cli import assert_one_line_error

    spec = [x for a in args for x in ("--model-arg", a)]
    res = CliRunner().invoke(app, ["layers", "hf:llama", *spec])
    assert_one_line_error(res, 2, "cannot make a llama config", needle, "--model-arg")
