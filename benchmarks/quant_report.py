"""The quantization report's cost (issue 53): `hookcli.diff` of a causal LM over a text file,
side B bfloat16 against A float32, its next-token statistics over every position, set against
the two sides' plain forwards over the same batches (each batch padded to the file's longest
text, as diff pads them), side by side in interleaved rounds:

    diff ÷ (forward A + forward B)

for the lean report (`own=False`, only `lm_head` hooked: the token statistics and the logits'
error), for every layer without the own error (`own=False`), and for diff's default (every
layer, and the own-error pass: one more forward of B, beside the accumulated one).
`--memory`: the peak resident memory of a child process running the lean report over the file
and over a file ten times as long (it should stay flat: one batch is held at a time).

A Llama of 4 blocks, hidden 256 and a 32,000-token vocabulary (random weights; a byte-level
tokenizer trained here), texts of about `--tokens` tokens.

Usage: python benchmarks/quant_report.py [--sequences 256] [--tokens 128] [--rounds 3]
       [--memory]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from _common import PRECISE_MALLOC, interleaved, run_child

import hookcli
from hookcli.records import DiffReport

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "in", "park", "once", "upon",
         "time", "there", "was", "model"]  # fmt: skip


def build(folder: Path, tokens: int) -> None:
    import transformers

    from examples.tiny_llm import LINES, train_tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * tokens + 8,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    train_tokenizer(LINES).save_pretrained(folder)


def corpus(path: Path, sequences: int, tokens: int) -> None:
    """Lines of about `tokens` tokens (the tokenizer knows few words: about one per word)."""
    g = torch.Generator().manual_seed(1)
    lines = []
    for _ in range(sequences):
        n = int(tokens * (0.5 + 0.5 * float(torch.rand((), generator=g))))
        picks = torch.randint(0, len(WORDS), (n,), generator=g).tolist()
        lines.append(" ".join(WORDS[k] for k in picks))
    path.write_text("\n".join(lines) + "\n")


def plain_forwards(folder: Path, text_file: Path, batch: int) -> Callable[[], object]:
    """Both sides' forwards over the file's batches, no hook: the floor."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.train(False)
    half = copy.deepcopy(model)
    torch.nn.Module.to(half, torch.bfloat16)  # (transformers' own `to` types poorly)
    texts = text_file.read_text().splitlines()
    longest = max(len(ids) for ids in tok(texts)["input_ids"])

    def run() -> None:
        with torch.no_grad():
            for i in range(0, len(texts), batch):
                enc = tok(
                    texts[i : i + batch], padding="max_length", max_length=longest,
                    return_tensors="pt",
                )  # fmt: skip
                model(**enc)
                half(**enc)

    return run


MEMORY = """
import json, resource, sys, warnings
import hookcli
warnings.simplefilter("ignore")
hookcli.diff(sys.argv[1], text_file=sys.argv[2], b="bfloat16", own=False, layers=["lm_head"])
print(json.dumps({"peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--memory", action="store_true")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        folder, text = Path(tmp) / "llama", Path(tmp) / "corpus.txt"
        build(folder, args.tokens)
        corpus(text, args.sequences, args.tokens)
        spec = f"hf:{folder}"
        if args.memory:
            long = Path(tmp) / "long.txt"
            corpus(long, 10 * args.sequences, args.tokens)
            os.environ.update(PRECISE_MALLOC)  # (the children's allocator returns what it frees)
            for name, path in (("file", text), ("ten times the file", long)):
                got = run_child(MEMORY, [spec, str(path)], name, timeout=3600)
                peak = got.get("peak_kb")
                shown = f"{int(str(peak)) / 1024:.0f} MiB" if peak is not None else got
                print(f"peak memory, {name}: {shown}")
            return

        def lean() -> DiffReport:
            return hookcli.diff(
                spec,
                text_file=str(text),
                b="bfloat16",
                own=False,
                layers=["lm_head"],
                batch_size=args.batch,
            )

        def layers() -> DiffReport:
            return hookcli.diff(
                spec, text_file=str(text), b="bfloat16", own=False, batch_size=args.batch
            )

        def default() -> DiffReport:
            return hookcli.diff(spec, text_file=str(text), b="bfloat16", batch_size=args.batch)

        variants: dict[str, Callable[[], object]] = {
            "plain": plain_forwards(folder, text, args.batch),
            "lean": lean,
            "layers": layers,
            "default": default,
        }
        report = lean()
        t = interleaved(variants, args.rounds)
        tokens = report.tokens
        assert tokens is not None
        print(
            f"{args.sequences} texts of up to {args.tokens} tokens, batches of {args.batch}, "
            f"{tokens.count} positions; medians of {args.rounds} rounds"
        )
        print(f"two plain forwards: {t['plain']:.2f} s")
        print(f"diff, lm_head and no own pass: {t['lean'] / t['plain']:.2f}x ({t['lean']:.2f} s)")
        print(
            f"diff, every layer, no own pass: {t['layers'] / t['plain']:.2f}x ({t['layers']:.2f} s)"
        )
        print(f"diff, default: {t['default'] / t['plain']:.2f}x ({t['default']:.2f} s)")
        print(json.dumps({"kld_mean": tokens.kld["mean"], "same_top1": tokens.same_top1}))


if __name__ == "__main__":
    main()
