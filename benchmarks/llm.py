"""The LLM row: hookcli reading every block of a language model, ÷ a plain forward, side by side
in one process with the same per-block read done by nnsight (`.save()` of every block's output)
and TransformerLens (`run_with_cache` of every block's residual stream), where they install.

Two random-init shapes, 512 tokens, CPU, eval, no_grad:

    gpt2-small     GPT2LMHeadModel, 12 blocks, hidden 768, vocab 50257 (124M parameters)
    qwen2.5-0.5b   Qwen2ForCausalLM, 24 blocks, hidden 896, 14 heads (2 KV), vocab 151936

hookcli: `hookcli.inspect(model, ids, layers=<every block>, topk=0)`: full statistics (mean,
std, min, max, zeros, NaN/Inf, norm) of every block's inputs and outputs, the whole API call
(selection, hooks, the pass, the report). Variants run interleaved, round after round; the
ratios are of medians.

Usage: python benchmarks/llm.py [--rounds N] [--tokens T] [--only NAME]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from _common import interleaved


def build(name: str) -> Any:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2-small":
        config: Any = tf.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)
        return tf.GPT2LMHeadModel(config).eval()  # type: ignore[no-untyped-call]
    config = tf.Qwen2Config(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=32768,
    )  # fmt: skip
    return tf.Qwen2ForCausalLM(config).eval()  # type: ignore[no-untyped-call]


def blocks_of(model: Any) -> list[str]:
    from hookcli.commands.lens import find_blocks

    return [n for n, _ in find_blocks(model)]


def variants(name: str, model: Any, ids: Any) -> dict[str, Callable[[], object]]:
    import torch

    import hookcli

    blocks = blocks_of(model)

    def plain() -> object:
        with torch.no_grad():
            return model(ids, use_cache=False)

    def hooked() -> object:
        return hookcli.inspect(model, ids, device="cpu", layers=blocks, topk=0)

    out: dict[str, Callable[[], object]] = {"plain": plain, "hookcli": hooked}
    peer = nnsight_variant(model, ids, blocks)
    if peer is not None:
        out["nnsight"] = peer
    lens = transformer_lens_variant(name, ids)
    if lens is not None:
        out["TransformerLens"] = lens
    return out


def nnsight_variant(model: Any, ids: Any, blocks: list[str]) -> Callable[[], object] | None:
    if importlib.util.find_spec("nnsight") is None:
        return None
    import torch

    wrapped = importlib.import_module("nnsight").NNsight(model)

    def run() -> object:
        saved: list[Any] = []
        with torch.no_grad(), wrapped.trace(ids, use_cache=False):
            for b in blocks:
                saved.append(_get(wrapped, b).output.save())
        assert len(saved) == len(blocks), "nnsight saved every block's output"
        return saved

    return run


def _get(root: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        root = root[int(part)] if part.isdigit() else getattr(root, part)
    return root


def transformer_lens_variant(name: str, ids: Any) -> Callable[[], object] | None:
    """TransformerLens re-implements the model: its own HookedTransformer of the same shape
    (random init), every block's residual stream cached."""
    if importlib.util.find_spec("transformer_lens") is None:
        return None
    import torch

    lens = importlib.import_module("transformer_lens")
    HookedTransformer = getattr(lens, "HookedTransformer", None)
    HookedTransformerConfig = getattr(lens, "HookedTransformerConfig", None)
    if HookedTransformer is None or HookedTransformerConfig is None:
        return None  # TransformerLens 4 removed HookedTransformer
    if name == "gpt2-small":
        cfg = HookedTransformerConfig(
            n_layers=12, d_model=768, n_heads=12, d_head=64, d_mlp=3072, d_vocab=50257,
            n_ctx=1024, act_fn="gelu_new", normalization_type="LN", device="cpu",
        )  # fmt: skip
    else:
        cfg = HookedTransformerConfig(
            n_layers=24, d_model=896, n_heads=14, n_key_value_heads=2, d_head=64, d_mlp=4864,
            d_vocab=151936, n_ctx=4096, act_fn="silu", normalization_type="RMS", gated_mlp=True,
            positional_embedding_type="rotary", rotary_dim=64, device="cpu",
        )  # fmt: skip
    model = HookedTransformer(cfg).eval()

    def run() -> object:
        with torch.no_grad():
            return model.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_resid_post"))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--only", choices=["gpt2-small", "qwen2.5-0.5b"])
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens} tokens")
    for name in ("gpt2-small", "qwen2.5-0.5b"):
        if args.only and name != args.only:
            continue
        model = build(name)
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        times = interleaved(variants(name, model, ids), args.rounds)
        base = times["plain"]
        shown = ", ".join(
            f"{k} {v * 1e3:.0f} ms ({v / base:.2f}x)" for k, v in times.items() if k != "plain"
        )
        print(f"{name}: plain {base * 1e3:.0f} ms; {shown}", flush=True)
        del model


if __name__ == "__main__":
    main()
