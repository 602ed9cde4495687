"""Tiny language models saved as checkpoints: a byte-level BPE tokenizer trained on four lines
(nothing is downloaded), a Llama, GPT-2 and Mixtral config small enough for the CPU, and
`save`, which writes a model and its tokenizer into a folder as save_pretrained does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

LINES = [
    "The cat sat on the mat.",
    "A dog ran in the park.",
    "hello world, the cat and the dog",
    "Once upon a time there was a model.",
]
VOCAB = 320


def make_tokenizer(chat: bool = False) -> Any:
    """The tokenizer examples/tiny_llm.py trains, on LINES."""
    from examples.tiny_llm import train_tokenizer

    return train_tokenizer(LINES, VOCAB, chat=chat)


def llama_config(**extra: Any) -> Any:
    fields: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    return transformers.LlamaConfig(**{**fields, **extra})


MOE = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
    "num_experts_per_tok": 2, "max_position_embeddings": 64,
}  # fmt: skip

BART = {  # an encoder-decoder with learned positions
    "vocab_size": VOCAB, "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64, "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2, "decoder_start_token_id": 2,
}  # fmt: skip


CONFIGS = {
    "llama": lambda: transformers.LlamaForCausalLM(llama_config()),
    # every Linear at least 64 wide: bitsandbytes' NF4 on a CPU with AVX512-BF16 repacks a
    # layer's weight for its kernel in blocks of 64 input features, and fails on fewer
    "llama-wide": lambda: transformers.LlamaForCausalLM(llama_config(hidden_size=64)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    ),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(**MOE)),
    "bart": lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(**BART)),
}


def save(folder: Path, name: str, chat: bool = False) -> Path:
    torch.manual_seed(0)
    model = CONFIGS[name]().eval()
    model.save_pretrained(folder)
    make_tokenizer(chat).save_pretrained(folder)
    return folder
