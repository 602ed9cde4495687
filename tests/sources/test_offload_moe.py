"""--offload of mixture-of-experts checkpoints (issue 49): transformers 5 fuses a layer's experts
into one module (`experts.gate_up_proj`, `experts.down_proj`) and save_pretrained writes them
back one matrix per expert; --offload converts them as from_pretrained does, block by block, so
the offloaded run's numbers equal the in-memory run's (and transformers' own logits)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("fused experts are transformers 5's", allow_module_level=True)

runner = CliRunner()
TEXT = ["The cat sat on the mat.", "A dog ran in the park today."]


def _common() -> dict[str, Any]:
    from tests.support.llm import VOCAB

    return {
        "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip


def _mixtral() -> Any:
    from tests.support.llm import CONFIGS

    return CONFIGS["mixtral"]()


def _qwen2_moe() -> Any:  # routed experts, a shared expert and its gate, q/k/v biases
    config = transformers.Qwen2MoeConfig(
        **_common(), intermediate_size=48, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, shared_expert_intermediate_size=40,
    )  # fmt: skip
    return transformers.Qwen2MoeForCausalLM(config)


def _qwen3_moe() -> Any:
    config = transformers.Qwen3MoeConfig(
        **_common(), intermediate_size=48, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, head_dim=8,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


def _olmoe() -> Any:
    config = transformers.OlmoeConfig(
        **_common(), intermediate_size=24, num_experts=4, num_experts_per_tok=2
    )
    return transformers.OlmoeForCausalLM(config)


def _deepseek_v3() -> Any:  # a dense first block, then shared + routed experts, a gate's bias
    config = transformers.DeepseekV3Config(
        **(_common() | {"num_key_value_heads": 4}), intermediate_size=48,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    )  # fmt: skip
    return transformers.DeepseekV3ForCausalLM(config)


FAMILIES = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
}


def _save(folder: Path, family: str, **kw: Any) -> Path:
    from tests.support.llm import make_tokenizer

    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    if family == "deepseek_v3":  # (zeros as built: a bias that is read shows in the numbers)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.1)
    model.save_pretrained(folder, **kw)
    make_tokenizer().save_pretrained(folder)
    return folder


def _names(folder: Path) -> list[str]:
    from safetensors import safe_open

    names = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            names += list(s.keys())
    return names


def _numbers(report: Any) -> dict[str, Any]:
    d = report.to_dict()
    return {k: d[k] for k in ("layers", "outputs", "predictions", "never_called")}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_moe_checkpoint_saved_per_expert_is_offloaded_as_from_pretrained_loads_it(
    family: str, tmp_path: Path
) -> None:
    folder = _save(tmp_path / family, family)
    names = _names(folder)
    # what save_pretrained writes: one matrix per expert, no fused tensor
    assert any(".experts.0." in n for n in names) and any(".experts.3." in n for n in names)
    assert not any("gate_up_proj" in n for n in names)
    spec = f"hf:{folder}"
    whole = hookcli.inspect(spec, text=TEXT, channels=True)
    off = hookcli.inspect(spec, text=TEXT, channels=True, offload=True)
    assert _numbers(off) == _numbers(whole)
    assert any("--offload" in n for n in off.notes)
    assert any(".experts." in c.name and "gate_up_proj" in c.name for c in whole.layers)
    # and the in-memory run is transformers' own: the logits' statistics are its logits'
    one = hookcli.inspect(spec, text=TEXT[:1], offload=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        logits = model(**tok(TEXT[:1], return_tensors="pt")).logits.double()
    out = next(t for t in one.outputs if "logits" in t.path)
    assert out.max == float(logits.max()) and out.min == float(logits.min())
    assert out.mean == pytest.approx(float(logits.mean()), rel=1e-6)
    assert whole.model.params == off.model.params == sum(p.numel() for p in model.parameters())


def _offloaded(folder: Path) -> tuple[Any, Any]:
    from hookcli.engine.prepare import prepare
    from hookcli.options import ModelOptions
    from hookcli.sources.offload import _ATTACHED

    model = prepare(ModelOptions(f"hf:{folder}", offload=True)).loaded.module
    return model, _ATTACHED[model]


def test_each_block_reads_its_own_experts_only(tmp_path: Path) -> None:
    """The experts of block 1 are read, stacked and concatenated when block 1 runs, from block
    1's tensors alone; block 0's are back on the meta device by then."""
    folder = _save(tmp_path / "m", "mixtral")
    model, off = _offloaded(folder)
    read: list[str] = []
    plain_read = off.checkpoint.read

    def counting(name: str) -> torch.Tensor:
        read.append(name)
        return plain_read(name)

    off.checkpoint.read = counting
    layers = model.model.layers
    seen: dict[str, Any] = {}

    def entering(index: int) -> Any:
        def hook(module: Any, args: Any) -> None:  # (after --offload's own pre-hook)
            seen[f"read by {index}"] = len(read)
            seen[f"others on {index}"] = layers[1 - index].mlp.experts.gate_up_proj.device.type
            seen[f"weight {index}"] = layers[index].mlp.experts.gate_up_proj.detach().clone()

        return hook

    for i in (0, 1):
        layers[i].register_forward_pre_hook(entering(i))
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8]]))
    block_1 = read[seen["read by 0"] : seen["read by 1"]]  # what entering block 1 read
    assert block_1 and all(n.startswith("model.layers.1.") for n in block_1)
    assert not any(n.startswith("model.layers.1.") for n in read[: seen["read by 0"]])
    assert sum(".experts." in n for n in block_1) == 4 * 3  # w1, w2, w3 of 4 experts, once
    assert len(block_1) == len(set(block_1))
    assert seen["others on 0"] == seen["others on 1"] == "meta"  # one block's weights at a time
    assert layers[1].mlp.experts.gate_up_proj.device.type == "meta"  # freed again
    # the fused weight is from_pretrained's
    truth = transformers.AutoModelForCausalLM.from_pretrained(folder)
    for i in (0, 1):
        assert torch.equal(seen[f"weight {i}"], truth.model.layers[i].mlp.experts.gate_up_proj)


def test_a_sharded_bf16_moe_checkpoint_and_a_fused_one_are_read_too(tmp_path: Path) -> None:
    # experts of one layer split over several shards, in bfloat16
    sharded = tmp_path / "sharded"
    torch.manual_seed(0)
    model = _qwen3_moe().to(torch.bfloat16).eval()
    model.save_pretrained(sharded, max_shard_size="8KB")
    from tests.support.llm import make_tokenizer

    make_tokenizer().save_pretrained(sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    experts_0 = {f for k, f in index.items() if ".layers.0.mlp.experts." in k}
    assert len(experts_0) > 1
    # a checkpoint written in the model's own fused layout (its state dict, as it is)
    from safetensors.torch import save_file

    fused = _save(tmp_path / "fused", "mixtral")
    torch.manual_seed(0)
    state = _mixtral().state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, fused / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    assert any(n.endswith("experts.gate_up_proj") for n in _names(fused))
    for folder in (sharded, fused):
        spec = f"hf:{folder}"
        whole = hookcli.inspect(spec, text=TEXT[:1], channels=True)
        off = hookcli.inspect(spec, text=TEXT[:1], channels=True, offload=True)
        assert _numbers(off) == _numbers(whole), folder.name


def _rewrite(folder: Path, change: Any) -> Path:
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    save_file(change(weights), folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _refused(folder: Path) -> str:
    r = runner.invoke(app, ["inspect", f"hf:{folder}", "--text", "hi", "--offload"])
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "save it again" not in lines[0] and "save the model again" not in lines[0]
    return str(lines[0])


def test_a_layout_nothing_maps_is_refused_saying_what_is_not_mapped(tmp_path: Path) -> None:
    # experts under names no conversion of Mixtral's knows
    renamed = _rewrite(
        _save(tmp_path / "renamed", "mixtral"),
        lambda w: {k.replace(".w1.", ".fc_in."): v for k, v in w.items()},
    )
    line = _refused(renamed)
    assert "model.layers.0.mlp.experts.gate_up_proj" in line
    assert "0 experts.*.w1.weight and 4 experts.*.w3.weight" in line  # what it was given
    assert "model.layers.*.block_sparse_moe.experts.*.fc_in.weight map to no weight" in line
    assert "conversions for mixtral" in line and "config.json" in line
    # one expert's matrix missing: the experts cannot be stacked; the conversion says why
    short = _rewrite(
        _save(tmp_path / "short", "mixtral"),
        lambda w: {k: v for k, v in w.items() if k != "model.layers.1.block_sparse_moe."
                   "experts.2.w3.weight"},
    )  # fmt: skip
    line = _refused(short)
    assert "model.layers.1.mlp.experts.gate_up_proj fails" in line
    assert "4 experts.*.w1.weight and 3 experts.*.w3.weight" in line and "every shard" in line
    # a quantized checkpoint: its float8 tensors are not the weights until a quantizer runs
    quantized = _save(tmp_path / "fp8", "mixtral")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    (quantized / "config.json").write_text(json.dumps(config))
    line = _refused(quantized)
    assert "quantized (fp8" in line and "without --offload" in line
