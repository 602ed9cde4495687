"""hookcli.watch: what watching costs a training loop, measured side by side in one process.

For a tiny CNN and resnet18 at 64 px, batch 16, with SGD and with AdamW on the CPU, each a
run of `steps` optimizer steps (forward, cross-entropy, backward, step), medians of
interleaved rounds, as ratios to the same loop without hookcli:

  every=1   every step watched: all leaf calls' statistics and output gradients, every
            parameter's gradient and update ratio (issue 17's target: <= 1.30x)
  every=10  one step in ten watched (target: <= 1.03x)
  unwatched inside a watch none of whose steps is watched: what the recorder costs when it
            is not recording — the root hooks that keep each step's batch references and
            buffers, the optimizer's step hooks, and the NaN/Inf check of the loss, the outputs
            and every parameter gradient (target: <= 1.01x)
  --tensorboard  also every=1 with `tensorboard=DIR` (a new folder each run): the live sink's
            scalars written every step, as a ratio to every=1 without it

Usage: python benchmarks/watch.py [--rounds N] [--steps N] [--quick] [--tensorboard]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from _common import interleaved
from torch import nn
from torch.nn import functional as F


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )  # fmt: skip
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(self.features(x).flatten(1))
        return out


def _model(name: str) -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return TinyCNN() if name == "tiny" else torchvision.models.resnet18(num_classes=10)


def _loop(
    model: nn.Module, opt: torch.optim.Optimizer, data: list[tuple[torch.Tensor, torch.Tensor]],
    every: int | None, *, plain: bool = False, board: bool = False,
) -> Callable[[], None]:  # fmt: skip
    import tempfile

    import hookcli

    def run() -> None:
        if plain:
            for x, y in data:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                opt.step()
            return
        folder = tempfile.mkdtemp(prefix="hookcli-tb-") if board else None
        w = hookcli.watch(model, optimizer=opt, every=every or 10**9, tensorboard=folder)
        if every is None:
            w.step_index = 1  # unwatched: the watched step 0 is behind it
        with w:
            for x, y in data:
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                w.loss(loss)
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()

    return run


def main() -> None:

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 10 steps")
    parser.add_argument("--tensorboard", action="store_true", help="also every=1 + tensorboard")
    args = parser.parse_args()
    rounds, steps = (3, 10) if args.quick else (args.rounds, args.steps)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU; {rounds} rounds")
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 3, 64, 64, generator=g), torch.randint(0, 10, (16,), generator=g))]
    data = data * steps
    for name in ("tiny", "resnet18"):
        for opt_name in ("SGD", "AdamW"):
            model = _model(name).train()

            def make(opt_name: str = opt_name, model: nn.Module = model) -> torch.optim.Optimizer:
                if opt_name == "SGD":
                    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
                return torch.optim.AdamW(model.parameters(), lr=1e-4)

            opt = make()
            variants: dict[str, Callable[[], object]] = {
                "plain": _loop(model, opt, data, None, plain=True),
                "every1": _loop(model, opt, data, 1),
                "every10": _loop(model, opt, data, 10),
                "unwatched": _loop(model, opt, data, None),
            }
            if args.tensorboard:
                variants["board"] = _loop(model, opt, data, 1, board=True)
            t = interleaved(variants, rounds)
            plain = t["plain"]
            board = f", every=1 + tensorboard ÷ every=1 {t['board'] / t['every1']:.3f}x"
            print(
                f"  {name} {opt_name} ({steps} steps, plain {plain * 1e3 / steps:.1f} ms/step): "
                f"every=1 {t['every1'] / plain:.3f}x, every=10 {t['every10'] / plain:.3f}x, "
                f"unwatched {t['unwatched'] / plain:.3f}x" + (board if args.tensorboard else "")
            )


if __name__ == "__main__":
    main()
