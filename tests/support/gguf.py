"""GGUF files of a tiny Llama, written by the `gguf` package as llama.cpp's converter writes them:
llama's metadata, tensors under GGUF's names, q/k rows permuted as convert_hf_to_gguf does,
every matrix in the chosen quantization type (1-D tensors stay F32, as llama.cpp keeps them),
and optionally one tensor in another type (a planted fragile layer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def _permute(w: np.ndarray[Any, Any], heads: int, kv_heads: int | None) -> np.ndarray[Any, Any]:
    """convert_hf_to_gguf's q/k row permutation (transformers' GGUF loading reverses it)."""
    if kv_heads is not None and heads != kv_heads:
        heads = kv_heads
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_llama(model: Any, path: Path, qtype: str, *, other: dict[str, str] | None = None) -> Path:
    """`model` (a LlamaForCausalLM) as a GGUF file of `qtype` (Q8_0, Q4_0, F32 …); `other`:
    HF parameter name → the type that tensor takes instead."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for hf_name, p in model.state_dict().items():
        base, _, suffix = hf_name.rpartition(".")
        name = names.get_name(base)
        if name is None:
            continue
        w = p.detach().float().numpy()
        if name.endswith("attn_q"):
            w = _permute(w, cfg.num_attention_heads, cfg.num_attention_heads)
        elif name.endswith("attn_k"):
            w = _permute(w, cfg.num_attention_heads, cfg.num_key_value_heads)
        kind = (other or {}).get(hf_name, qtype if w.ndim == 2 else "F32")
        qt = gguf.GGMLQuantizationType[kind]
        if qt == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(f"{name}.{suffix}", np.ascontiguousarray(w))
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(w), qt)
            writer.add_tensor(f"{name}.{suffix}", data, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized(path: Path, model: Any) -> dict[str, torch.Tensor]:
    """The file's tensors as the gguf package dequantizes them, under the model's names (q/k
    rows unpermuted by hand): what the gguf side must put into the model."""
    import gguf

    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    back = {}
    for hf_name in model.state_dict():
        base, _, suffix = hf_name.rpartition(".")
        name = names.get_name(base)
        if name is not None:
            back[f"{name}.{suffix}"] = hf_name
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            [int(d) for d in reversed(t.shape)]
        )
        if ".attn_q." in t.name or ".attn_k." in t.name:
            heads = cfg.num_attention_heads if ".attn_q." in t.name else cfg.num_key_value_heads
            w = w.reshape(heads, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        out[back[t.name]] = torch.from_numpy(np.array(w, copy=True))
    return out
