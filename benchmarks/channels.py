"""--channels on a GPT-2-small-shaped model (12 blocks, 768 wide, random init, CPU), measured
side by side in one process: hookcli.inspect with per-channel statistics of every Conv1D
(GPT-2's Linear) input and output ÷ a plain forward under no_grad, and ÷ the same inspect
without --channels. Rounds interleave the variants; ratios are of medians.

Usage: python benchmarks/channels.py [--rounds N] [--tokens T] [--layers L]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import hookcli


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args()
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=768, n_head=12, n_positions=1024)
    model = transformers.GPT2LMHeadModel(config)
    model.eval()  # type: ignore[no-untyped-call]
    ids = torch.randint(0, config.vocab_size, (1, args.tokens))

    def plain() -> None:
        with torch.no_grad():
            model(input_ids=ids)

    def run(channels: bool) -> Callable[[], None]:
        def go() -> None:
            hookcli.inspect(model, ids, device="cpu", types=["Conv1D"], channels=channels, topk=0)

        return go

    variants = {"plain": plain, "inspect": run(False), "inspect --channels": run(True)}
    for f in variants.values():
        f()  # warm
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, f in variants.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"GPT-2 shape: {args.layers} blocks x 768, {args.tokens} tokens, CPU "
          f"({torch.get_num_threads()} threads), {args.rounds} rounds")  # fmt: skip
    print(f"plain forward              {med['plain'] * 1e3:8.1f} ms")
    for name in ("inspect", "inspect --channels"):
        print(f"{name:<26} {med[name] * 1e3:8.1f} ms  {med[name] / med['plain']:.2f}x plain")
    ratio = med["inspect --channels"] / med["inspect"]
    print(f"--channels ÷ inspect: {ratio:.2f}x")


if __name__ == "__main__":
    main()
