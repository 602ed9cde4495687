"""The host's own cost on a language model (issue 52): a Qwen2-shaped causal LM of 24 blocks
(319 modules) made narrow (hidden 64, random init), so that its forward is cheap and what
hookcli adds per pass and per hooked call shows, as on a fast GPU where the forward costs little.

- a pass: `hookcli.inspect` of a 16-token prompt (a tokenizer's output) with every block hooked,
  and with `lm_head` alone, ÷ the plain forward;
- a `--generate` step: (a run generating 1 + N tokens - a run generating 1) ÷ N, every block
  hooked (`hookcli.inspect(..., generate=)`), ÷ the same difference of plain `model.generate`
  (the prompt's prefill cancels out of both).

CPU, one thread; variants interleaved, round after round; ratios of medians.

Usage: python benchmarks/llm_host.py [--rounds R] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import interleaved

import hookcli


def build() -> Any:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=24, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
        max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model = tf.Qwen2ForCausalLM(config).eval()  # type: ignore[no-untyped-call]
    model.generation_config.eos_token_id = None
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    from hookcli.commands.lens import find_blocks

    torch.set_num_threads(1)
    model = build()
    blocks = [name for name, _ in find_blocks(model)]
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    given = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    steps: int = args.steps

    def plain() -> object:
        with torch.no_grad():
            return model(**given)

    def generate(new: int) -> object:
        with torch.no_grad():
            return model.generate(
                **given, max_new_tokens=new, do_sample=False, num_beams=1, temperature=None,
                top_p=None, top_k=None, return_dict_in_generate=True,
            )  # fmt: skip

    def hooked(layers: list[str], new: int = 0) -> object:
        return hookcli.inspect(model, given, device="cpu", layers=layers, topk=0, generate=new)

    passes = {
        "plain": plain,
        "blocks": lambda: hooked(blocks),
        "lm_head": lambda: hooked(["lm_head"]),
    }
    generation = {
        "plain 1": lambda: generate(1),
        "plain N": lambda: generate(1 + steps),
        "hooked 1": lambda: hooked(blocks, 1),
        "hooked N": lambda: hooked(blocks, 1 + steps),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # (each set interleaved within itself: a generation's runs slow the passes around them)
        t = interleaved(passes, args.rounds) | interleaved(generation, args.rounds)
    base = t["plain"]
    print(f"Qwen2 shape, 24 blocks (319 modules), hidden 64, 16 tokens, 1 thread, "
          f"medians of {args.rounds} rounds")  # fmt: skip
    print(f"pass: plain forward {base * 1e3:.2f} ms; inspect every block "
          f"{t['blocks'] / base:.3f}x, lm_head alone {t['lm_head'] / base:.3f}x")  # fmt: skip
    plain_step = (t["plain N"] - t["plain 1"]) / steps
    hooked_step = (t["hooked N"] - t["hooked 1"]) / steps
    extra = (hooked_step - plain_step) * 1e6
    print(f"--generate step ({steps} steps): plain {plain_step * 1e3:.2f} ms; inspect every "
          f"block {hooked_step / plain_step:.3f}x (+{extra:.0f} µs)")  # fmt: skip


if __name__ == "__main__":
    main()
