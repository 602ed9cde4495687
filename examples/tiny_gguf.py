"""Write a GGUF file of a Llama folder (`save_pretrained`'s) offline, with the `gguf` package, as
llama.cpp's convert_hf_to_gguf.py lays one out: llama's metadata, the tensors under GGUF's
names, q/k rows permuted as the converter permutes them, every matrix quantized to one type
(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, TQ2_0, F16, …; 1-D tensors stay F32, as llama.cpp keeps them),
and optionally some tensors in another type. The `gguf` package quantizes in numpy: for tiny
models and tests, not for a real checkpoint (use llama.cpp's own tools there).

    python examples/tiny_llm.py tiny-llama
    python examples/tiny_gguf.py tiny-llama tiny-Q4_0.gguf Q4_0
    hookcli diff hf:./tiny-llama --text-file corpus.txt --b gguf:tiny-Q4_0.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np


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


if __name__ == "__main__":
    import transformers

    folder, out, kind = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "Q8_0"
    model = transformers.LlamaForCausalLM.from_pretrained(folder)
    write_llama(model, Path(out), kind)
    print(f"wrote {out} ({kind})")
