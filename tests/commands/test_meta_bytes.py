"""`hookcli layers --meta`: the weights' bytes (as held, and in float32, bfloat16, float16, int8
and int4) and a causal LM's KV cache a token (issue 49). Oracles: the bytes of the real
(not meta) model built from the same tiny config, each parameter once (`sum(numel x
element_size)` over the parameters deduplicated by identity); and the key/value tensors a
real tiny transformers model returns in `past_key_values` for N tokens. Where the config
cannot tell the cache, the report says so (no number)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.commands.listing import kv_cache, layers_report
from hookcli.options import ModelOptions
from hookcli.records import KVCache, LayersReport
from tests.support.llm import VOCAB, llama_config

transformers = pytest.importorskip("transformers")

runner = CliRunner()
SHAPE = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "max_position_embeddings": 64,
}  # fmt: skip
WINDOW = 6  # the sliding window of the windowed configs: 4 tokens fit in it, 11 do not


def _config(cls: str, **kw: Any) -> Callable[[], Any]:
    return lambda: getattr(transformers, cls)(**kw)


CONFIGS: dict[str, Callable[[], Any]] = {
    # grouped-query attention: 4 heads, 2 KV heads; its lm_head its own
    "llama": llama_config,
    "llama_tied": lambda: llama_config(tie_word_embeddings=True),
    # no num_key_value_heads (n_head only): every head its own; lm_head tied to wte
    "gpt2": _config("GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                    n_positions=64),
    # with a pad token: transformers' padding warning reads the ids' values (exit 3 on meta)
    "gpt2_pad": _config("GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                        n_positions=64, pad_token_id=0),
    # multi-query attention, two ways of saying it
    "falcon_mqa": _config("FalconConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, multi_query=True,
                          new_decoder_architecture=False),
    "bigcode_mqa": _config("GPTBigCodeConfig", vocab_size=VOCAB, n_embd=32, n_layer=2,
                           n_head=4, n_positions=64, multi_query=True),
    # every layer sliding (sliding_window, no layer_types)
    "mistral": _config("MistralConfig", **SHAPE, num_key_value_heads=2, sliding_window=WINDOW),
    # sliding and full layers in turn (layer_types), a head_dim not hidden / heads
    "gemma2": _config("Gemma2Config", **SHAPE, num_key_value_heads=1, head_dim=16,
                      sliding_window=WINDOW),
    # the layers from max_window_layers on sliding
    "qwen2": _config("Qwen2Config", **SHAPE, num_key_value_heads=2, use_sliding_window=True,
                     sliding_window=WINDOW, max_window_layers=2),
    # MLA: the compressed latent kv_lora_rank + qk_rope_head_dim a layer
    "deepseek_v3": _config("DeepseekV3Config", **SHAPE, num_key_value_heads=4, kv_lora_rank=16,
                           q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                           v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=16, first_k_dense_replace=1, n_group=1,
                           topk_group=1),
    # three linear-attention layers (a fixed-size state) and one full-attention layer
    "qwen3_next": _config("Qwen3NextConfig", **SHAPE, num_key_value_heads=2, head_dim=8,
                          linear_num_value_heads=2, linear_num_key_heads=2,
                          linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16),
}  # fmt: skip
WINDOWED = {"mistral", "gemma2", "qwen2"}


def _make(name: str, dtype: str = "float32") -> Any:
    try:
        config = CONFIGS[name]()
    except AttributeError:
        pytest.skip(f"this transformers has no {name}")
    config.dtype = dtype
    return config


def _meta(folder: Path, config: Any) -> LayersReport:
    """The config saved as a checkpoint's config.json, listed with --meta (no weight)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    return layers_report(ModelOptions(f"hf:{folder}", meta=True))


def _real(config: Any) -> Any:
    torch.manual_seed(0)
    dtype = config.dtype or "float32"
    dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _cache_bytes(model: Any, tokens: int) -> int:
    """The bytes of the key/value tensors a real model keeps after `tokens` tokens."""
    ids = torch.randint(3, VOCAB, (1, tokens))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    if hasattr(cache, "layers"):  # transformers' Cache
        pairs = [(getattr(x, "keys", None), getattr(x, "values", None)) for x in cache.layers]
    else:  # a tuple of (key, value) a layer
        pairs = [tuple(x[:2]) for x in cache]
    return sum(t.numel() * t.element_size() for p in pairs for t in p if torch.is_tensor(t))


# ---------------------------------------------------------------- the weights


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("llama", "float32"), ("llama_tied", "bfloat16"), ("gpt2", "float32"),
     ("gpt2_pad", "float32"), ("deepseek_v3", "bfloat16")],
)  # fmt: skip
def test_weight_bytes_are_the_real_models_parameters_each_once(
    tmp_path: Path, name: str, dtype: str
) -> None:
    config = _make(name, dtype)
    report = _meta(tmp_path, config)
    model = _real(config)
    every_one = [p for _, p in model.named_parameters(remove_duplicate=False)]
    params = list({id(p): p for p in every_one}.values())
    real = sum(p.numel() * p.element_size() for p in params)
    n = sum(p.numel() for p in params)
    w = report.weights
    assert w is not None
    assert w.bytes == real and w.params == n == report.model.params
    held: dict[str, int] = {}
    for p in params:  # a router's bias kept in float32 (DeepSeek-V3) is held so on meta too
        key = str(p.dtype).removeprefix("torch.")
        held[key] = held.get(key, 0) + p.numel() * p.element_size()
    assert w.held == held and max(held, key=held.__getitem__) == dtype
    assert w.as_dtype == {
        "float32": 4 * n, "bfloat16": 2 * n, "float16": 2 * n, "int8": n, "int4": math.ceil(n / 2)
    }  # fmt: skip
    if name in ("llama_tied", "gpt2", "gpt2_pad"):  # lm_head is the embedding: counted once
        every = sum(p.numel() for p in every_one)
        head = model.get_output_embeddings().weight
        assert every == n + head.numel()
        assert w.as_dtype["float32"] == 4 * (every - head.numel())


def test_a_vision_model_has_weight_bytes_and_no_kv_cache() -> None:
    import torchvision

    report = layers_report(ModelOptions("resnet18", meta=True))
    real = torchvision.models.resnet18()
    assert report.kv_cache is None and report.weights is not None
    assert report.weights.bytes == sum(p.numel() * p.element_size() for p in real.parameters())
    assert report.weights.buffer_bytes == sum(b.numel() * b.element_size() for b in real.buffers())
    from hookcli.render.table import layers_table

    text = layers_table(report, color=False, width=200)
    assert "weights float32 44.6 MiB (11.7M parameters, tied ones once)" in text
    assert "KV cache" not in text


# ---------------------------------------------------------------- the KV cache


@pytest.mark.parametrize(
    ("name", "dtype"), [*((n, "float32") for n in CONFIGS if n != "llama_tied"),
                        ("llama", "bfloat16")],
)  # fmt: skip
def test_kv_bytes_a_token_are_the_past_key_values_of_a_real_model(
    tmp_path: Path, name: str, dtype: str
) -> None:
    config = _make(name, dtype)
    kv = _meta(tmp_path, config).kv_cache
    assert kv is not None and kv.bytes_per_token is not None, kv
    assert kv.dtype == dtype
    model = _real(config)
    tokens = 4  # within every window: every layer keeps every token
    assert _cache_bytes(model, tokens) == kv.bytes_per_token * tokens
    if name in WINDOWED:
        assert kv.window == WINDOW and kv.sliding_layers > 0 and kv.full_bytes is not None
        sliding = kv.bytes_per_token - kv.full_bytes
        assert sliding > 0
        # past the window, a sliding layer keeps its last tokens (transformers holds
        # window - 1 of them between steps, the new one joining them as it runs)
        tokens = 11
        held = _cache_bytes(model, tokens)
        assert held == kv.full_bytes * tokens + sliding * (WINDOW - 1)
        assert kv.context == 64
        assert kv.bytes_at_context == kv.full_bytes * 64 + sliding * WINDOW
    else:
        assert kv.sliding_layers == 0 and kv.full_bytes == kv.bytes_per_token
        assert kv.bytes_at_context == kv.bytes_per_token * kv.context if kv.context else True


def test_the_formula_names_what_it_multiplies(tmp_path: Path) -> None:
    kv = _meta(tmp_path, _make("llama")).kv_cache
    assert kv is not None
    assert (kv.layers, kv.kv_heads, kv.head_dim, kv.bytes_per_token) == (2, 2, 8, 256)
    assert kv.formula == "2 (key, value) x 2 layers x 2 KV heads x 8 head dim x 4 bytes"
    assert kv.note is None
    mla = _meta(tmp_path / "mla", _make("deepseek_v3")).kv_cache
    assert mla is not None and mla.kv_heads is None and mla.per_layer_values == 16 + 8
    assert "kv_lora_rank 16 + qk_rope_head_dim 8" in mla.formula
    linear = _meta(tmp_path / "next", _make("qwen3_next")).kv_cache
    assert linear is not None and linear.full_layers == 1
    assert linear.note == "the 3 linear_attention layers keep a state of a fixed size, not counted"


def test_falcons_new_architecture_is_its_kv_heads_and_says_what_transformers_keeps(
    tmp_path: Path,
) -> None:
    config = transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_kv_heads=2, new_decoder_architecture=True,
    )  # fmt: skip
    kv = _meta(tmp_path, config).kv_cache
    assert kv is not None and kv.bytes_per_token == 2 * 2 * 2 * 8 * 4
    assert kv.note is not None and "expanded to all 4 heads" in kv.note
    # transformers' Falcon repeats the 2 KV heads to 4 before caching them
    assert _cache_bytes(_real(config), 3) == 3 * 2 * kv.bytes_per_token


class _Held(nn.Module):
    """A model of one config and one parameter of a dtype: what kv_cache reads."""

    def __init__(self, config: Any, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.config = config
        self.w = nn.Parameter(torch.zeros(1, dtype=dtype))


def test_published_figures_of_large_configs() -> None:
    """Llama-3-70B: 320 KiB a token in bfloat16, 40 GiB at 128K tokens; Mistral-7B-v0.1: 128
    KiB a token up to its 4096-token window, then nothing more; DeepSeek-V3's MLA latent:
    61 x (512 + 64) x 2 = 70,272 bytes a token."""
    from benchmarks.memory import LLAMA_70B

    llama = kv_cache(_Held(transformers.LlamaConfig(**LLAMA_70B)))
    assert llama.bytes_per_token == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert llama.bytes_at_context == 40 * 2**30
    mistral_7b = transformers.MistralConfig(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        sliding_window=4096, max_position_embeddings=32768,
    )  # fmt: skip
    mistral = kv_cache(_Held(mistral_7b))
    assert mistral.bytes_per_token == 128 * 1024 and mistral.full_bytes == 0
    assert mistral.bytes_at_context == 128 * 1024 * 4096 == 512 * 2**20
    deepseek = transformers.DeepseekV3Config(num_hidden_layers=61, kv_lora_rank=512)
    assert kv_cache(_Held(deepseek)).bytes_per_token == 61 * (512 + 64) * 2 == 70_272


UNKNOWN = {
    "no layer count": ({"num_attention_heads": 4, "hidden_size": 32}, "num_hidden_layers"),
    "ChatGLM-style groups": (
        {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32,
         "multi_query_group_num": 2}, "multi_query_group_num"),
    "no head size": (
        {"num_hidden_layers": 2, "num_attention_heads": 5, "hidden_size": 32}, "head_dim"),
    "a layer type not sized": (
        {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32,
         "num_key_value_heads": 2, "layer_types": ["full_attention", "mamba2"]}, "mamba2"),
    "sliding with no window": (
        {"num_hidden_layers": 1, "num_attention_heads": 4, "hidden_size": 32,
         "num_key_value_heads": 2, "layer_types": ["sliding_attention"]}, "sliding_window"),
    "MLA without its rope size": (
        {"num_hidden_layers": 2, "kv_lora_rank": 16}, "qk_rope_head_dim"),
    "layer_types of another length": (
        {"num_hidden_layers": 3, "num_attention_heads": 4, "hidden_size": 32,
         "layer_types": ["full_attention"]}, "layer_types"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(UNKNOWN))
def test_a_cache_the_config_cannot_tell_is_said_not_guessed(case: str) -> None:
    fields, needle = UNKNOWN[case]
    kv = kv_cache(_Held(SimpleNamespace(**fields), torch.float16))
    assert kv.bytes_per_token is None and kv.dtype == "float16"
    assert kv.note is not None and kv.note.startswith("unknown: ") and needle in kv.note
    from hookcli.render.listing import kv_lines

    assert [line.text for line in kv_lines(kv)] == [f"KV cache {kv.note}"]


# ---------------------------------------------------------------- the formats


def test_the_table_and_json_show_the_bytes(tmp_path: Path) -> None:
    _meta(tmp_path, _make("llama"))
    r = runner.invoke(app, ["layers", f"hf:{tmp_path}", "--meta"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.stderr
    assert "weights float32 153 KiB (39.1K parameters, tied ones once); buffers 32 B" in r.stdout
    each = "float32 153 KiB, bfloat16 76.3 KiB, float16 76.3 KiB, int8 38.2 KiB, int4 19.1 KiB"
    assert f"as {each} (every parameter in that one dtype" in r.stdout
    assert (
        "KV cache 256 B a token (float32: 2 (key, value) x 2 layers x 2 KV heads x 8 head dim x "
        "4 bytes); 16 KiB a sequence of its 64-token context"
    ) in r.stdout
    # the figures come after the module table, before the hint
    assert r.stdout.index("lm_head") < r.stdout.index("KV cache") < r.stdout.index("select with")
    r = runner.invoke(app, ["layers", f"hf:{tmp_path}", "--meta", "-f", "json"])
    data = json.loads(r.stdout)
    assert data["weights"]["bytes"] == 156_288 and data["weights"]["as_dtype"]["int4"] == 19_536
    assert data["weights"]["assumes"].startswith("every parameter in that one dtype")
    kv = data["kv_cache"]
    assert (kv["bytes_per_token"], kv["dtype"], kv["kv_heads"], kv["head_dim"]) == (
        256,
        "float32",
        2,
        8,
    )
    assert KVCache(**kv) == KVCache(**kv)  # the fields are the record's


def test_a_sliding_window_model_says_what_a_token_costs_past_the_window(tmp_path: Path) -> None:
    from hookcli.render.listing import kv_lines

    kv = _meta(tmp_path, _make("gemma2")).kv_cache
    assert kv is not None
    (line,) = [x.text for x in kv_lines(kv)]
    assert line == (
        "KV cache 512 B a token (float32: 2 (key, value) x 4 layers x 1 KV heads x 16 head dim "
        "x 4 bytes); past 6 tokens, 256 B a token: the 2 sliding-window layers keep the last 6 "
        "tokens; 17.5 KiB a sequence of its 64-token context"
    )
