"""The host's own cost per hooked layer call: a model of N tiny layers (Linear(8, 8), each a
leaf, every one hooked), whose forward costs next to nothing, so that what hookcli adds per
call is what is measured — as on a fast GPU, where the forward is cheap and the host's work
per hooked call is the whole overhead (issue 52).

For `inspect` (statistics of every call's input and output, the report built) and `grads`
(also every call's gradients and every parameter's gradient), side by side with the plain
forward (and forward + backward) in the same rounds, interleaved:

    (hooked - plain) ÷ layer calls, in µs

and the same for torchinfo's `summary` (shapes only), when it is installed.

Usage: python benchmarks/host_cost.py [--layers N] [--rounds R] [--device cpu|cuda]
       [--profile-out FILE]

`--device` (cpu, the default): where the model, its input and every run are (with cuda, each
timed call ends once the device is done: a plain pass synchronises at its end, as hookcli's
one transfer after the pass does).

`--profile-out`: one inspect and one grads call under cProfile, their 30 functions of most own
time and most cumulative time written to FILE (where a host's cost per call goes).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import interleaved
from torch import nn

import hookcli


def model(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)]).eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--profile-out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n: int = args.layers
    device: str = args.device
    m = model(n).to(device)
    x = torch.randn(4, 8, device=device)

    def done() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def plain() -> None:
        with torch.no_grad():
            m(x)
        done()

    def plain_backward() -> None:
        m(x).sum().backward()
        m.zero_grad(set_to_none=True)
        done()

    variants: dict[str, Callable[[], object]] = {
        "plain": plain,
        "inspect": lambda: hookcli.inspect(m, x, topk=0, device=device),
        "plain+backward": plain_backward,
        "grads": lambda: hookcli.grads(m, x, target="sum", topk=0, device=device),
    }
    try:
        from torchinfo import summary

        def info() -> None:
            summary(m, input_data=x, verbose=0, device=device)
            done()

        variants["torchinfo"] = info
    except ImportError:
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = interleaved(variants, args.rounds)

    def per(hooked: str, base: str) -> float:
        return float(t[hooked] - t[base]) / n * 1e6

    print(
        f"{n} layers of Linear(8, 8) on {device}, batch 4, 1 thread, medians of {args.rounds} "
        "rounds"
    )
    base, both = t["plain"] * 1e3, t["plain+backward"] * 1e3
    print(f"plain forward {base:.2f} ms; forward+backward {both:.2f} ms")
    print(f"inspect: {per('inspect', 'plain'):.0f} µs a layer call ({t['inspect'] * 1e3:.1f} ms)")
    print(
        f"grads: {per('grads', 'plain+backward'):.0f} µs a layer call ({t['grads'] * 1e3:.1f} ms)"
    )
    if "torchinfo" in t:
        print(f"torchinfo summary: {per('torchinfo', 'plain'):.0f} µs a layer call")
    if args.profile_out:
        _profiled({k: variants[k] for k in ("inspect", "grads")}, args.profile_out)


def _profiled(calls: dict[str, Callable[[], object]], out: str) -> None:
    import cProfile
    import io
    import pstats

    text = io.StringIO()
    for what, fn in calls.items():
        prof = cProfile.Profile()
        prof.runcall(fn)
        text.write(f"=== {what}\n")
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(30)
        prof.dump_stats(out.rsplit(".", 1)[0] + f"_{what}.prof")  # whole, for pstats
    with open(out, "w") as f:
        f.write(text.getvalue())


if __name__ == "__main__":
    main()
