"""GGUF files of a tiny Llama (examples/tiny_gguf.py writes them with the `gguf` package, as
llama.cpp's converter lays them out), and what the `gguf` package reads back from one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from examples.tiny_gguf import write_llama

__all__ = ["dequantized", "write_llama"]


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
