"""hookcli on a GPU, measured in one process (issue 33): run by benchmarks/gpu_check.sh.

(a) host synchronisation: `torch.cuda.set_sync_debug_mode("error")` inside the forward of
    resnet50, vit_b_16 and a tiny Llama (random init), plain and hooked by inspect: any
    `.item()`, `.cpu()` or `if t.any()` per tensor in the pass raises (docs/traps.md §8); each
    model's line says "no sync" or what raised;
(b) time, by CUDA events (a start and an end recorded on the stream around each variant, the
    elapsed time read once the end has completed), float32 and bfloat16, interleaved rounds,
    ratios of medians:
    - `hookcli.inspect` with statistics on every leaf ÷ plain `model(x)` under no_grad (goal
      at most 1.05 times on resnet50 b32 bfloat16), and torchinfo's `summary` ÷ the same plain pass;
    - `hookcli.grads` ÷ a plain forward + backward of the same scalar (the sum of the top-1
      logits);
    - `hookcli.diff --b bfloat16` ÷ the two plain passes (float32 and bfloat16);
(c) where inspect's time goes: the same run with each tensor's statistics replaced by one fill
    kernel (the hooks and bookkeeping alone), at batch 32 and 128; and its time before, in and
    after the forward (`phases`);
(d) host time of one inspect and one diff call by cProfile, the profiles to --profile-out;
(e) with --llm, instead of (a)-(d) (issue 52 item 5): a Qwen2.5-0.5B-shaped causal LM (random
    init, bfloat16 on a GPU), every block hooked, batch 1:
    - `hookcli.inspect` of a 2,048-token prompt ÷ its plain forward under no_grad (goal at most
      1.10 times);
    - the prefill's time before, in and after its forward (`phases`);
    - a `--generate` step: (a run generating 1 + N tokens - a run generating 1) ÷ N, hooked
      (`hookcli.inspect(..., generate=)`) ÷ the same difference of plain `model.generate`
      (goal at most 1.5 times): the prompt's prefill cancels out of both.

Usage: python benchmarks/gpu_figures.py [--out FILE] [--rounds N] [--device cuda|cpu] [--quick]
    [--profile-out FILE] [--llm]
`--device cpu --quick` runs the same code on small models on the CPU (wall clock instead of
events, no sync check; a 2-block model and 64 tokens for --llm): a check of this script where
no GPU is.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

import hookcli


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Milliseconds of one call: CUDA events on a GPU, the wall clock on the CPU."""
    if device.type == "cuda":

        def by_events(fn: Callable[[], object]) -> float:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))

        return by_events

    def by_clock(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return by_clock


def interleaved(
    variants: dict[str, Callable[[], object]], rounds: int, device: torch.device
) -> dict[str, float]:
    """Median milliseconds of each variant, in turn round after round, after one warm-up."""
    timed = _timer(device)
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for key, fn in variants.items():
            times[key].append(timed(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def models(quick: bool) -> list[tuple[str, Callable[[], nn.Module], Callable[[int], torch.Tensor]]]:
    """(name, builder, input of a batch size)."""
    image = 64 if quick else 224

    def images(n: int) -> torch.Tensor:
        return torch.randn(n, 3, image, image, generator=torch.Generator().manual_seed(0))

    def vit_input(n: int) -> torch.Tensor:
        return torch.randn(n, 3, 224, 224, generator=torch.Generator().manual_seed(0))

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, 512, (n, 32), generator=torch.Generator().manual_seed(0))

    cnn = torchvision.models.resnet18 if quick else torchvision.models.resnet50
    return [
        ("resnet18" if quick else "resnet50", lambda: cnn().eval(), images),
        ("vit_b_16", lambda: torchvision.models.vit_b_16().eval(), vit_input),
        ("tiny llama", lambda: tiny_llama().eval(), tokens),
    ]


class NoSync(nn.Module):
    """`model` under `torch.cuda.set_sync_debug_mode("error")` for its forward alone: a hook
    that synchronises the host inside the pass raises, while what a run does once before or
    after its pass (moving the input, the one transfer of the statistics) does not."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return self.model(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _verdict(fn: Callable[[], object]) -> str:
    """ "no sync", or what raised: in the pass, or in a hook (which notes it on its call)."""
    try:
        got = fn()
    except Exception as exc:
        return f"SYNCHRONISED: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    failed = [c for c in getattr(got, "layers", []) if c.error]
    if failed:
        first = failed[0]
        return f"SYNCHRONISED in {len(failed)} hooked calls, first {first.name}: {first.error}"
    return "no sync"


def sync_check(device: torch.device, quick: bool) -> list[str]:
    """(a): each model's plain pass, then its hooked pass, under the sync debug mode 'error'
    (the plain pass first: a model that synchronises by itself is not hookcli's doing)."""
    if device.type != "cuda":
        return ["(a) host synchronisation: not checked (no CUDA device)"]
    lines = ["(a) host synchronisation inside the forward (set_sync_debug_mode('error'))"]
    for name, build, make in models(quick):
        lines.append(f"  {name}: {_sync_line(NoSync(build().to(device)), make(2).to(device))}")
    return lines


def _sync_line(model: NoSync, x: torch.Tensor) -> str:
    dev = str(x.device)
    with torch.no_grad():
        model.model(x)  # warm: kernels, caches
    hookcli.inspect(model, x, device=dev, topk=0)

    def plain() -> object:
        with torch.no_grad():
            return model(x)

    hooked = _verdict(lambda: hookcli.inspect(model, x, device=dev, topk=0))
    return f"plain pass {_verdict(plain)}; hooked inspect pass {hooked}"


def split(device: torch.device, quick: bool, rounds: int) -> list[str]:
    """(c): where inspect's time goes, bfloat16: the whole run; the same run with each
    tensor's statistics replaced by one fill kernel (the hooks and the run's bookkeeping
    alone); and a batch four times larger (a fixed cost per tensor weighs less there)."""
    from unittest import mock

    from hookcli.engine import stats

    name, build, make = models(quick)[0]
    model = build().to(device, torch.bfloat16)
    clock = "CUDA events" if device.type == "cuda" else "wall clock"
    lines = [f"(c) where inspect's time goes, {name} bfloat16 ({clock}, medians)"]
    for batch in (2, 8) if quick else (32, 128):
        x = make(batch).to(device, torch.bfloat16)

        def plain(x: torch.Tensor = x) -> object:
            with torch.no_grad():
                return model(x)

        def inspect(x: torch.Tensor = x) -> object:
            return hookcli.inspect(model, x, device=str(device), topk=0)

        def hooks_alone(x: torch.Tensor = x) -> object:
            def fill(t: torch.Tensor) -> torch.Tensor:
                return torch.zeros(9, dtype=torch.float64, device=t.device)

            # the fused Triton kernel (started in the pass's pool, or alone) and torch ops' row
            # all replaced by a fill
            with (
                mock.patch.object(stats, "torch_row", fill),
                mock.patch.object(stats, "started_row", return_value=None),
                mock.patch.object(stats, "fused_row", return_value=None),
            ):
                return inspect(x)

        def noop_hooks(x: torch.Tensor = x) -> object:
            # the floor of any Python hook: a pre- and a forward hook on every module that do
            # nothing, registered and removed around the pass as inspect's are
            handles = []
            for m in model.modules():
                handles.append(m.register_forward_pre_hook(_nothing, with_kwargs=True))
                handles.append(m.register_forward_hook(_nothing))
            try:
                with torch.no_grad():
                    return model(x)
            finally:
                for h in handles:
                    h.remove()

        got = interleaved(
            {"plain": plain, "inspect": inspect, "hooks": hooks_alone, "noop": noop_hooks},
            rounds,
            device,
        )
        lines.append(
            f"  b{batch}: plain {got['plain']:.2f} ms; inspect {got['inspect'] / got['plain']:.2f}x"
            f"; without the statistics' kernels {got['hooks'] / got['plain']:.2f}x; no-op hooks "
            f"on every module {got['noop'] / got['plain']:.2f}x"
        )
        before, during, after = phases(inspect, device, rounds)
        lines.append(
            f"    inspect's time: {before:.2f} ms before the forward, {during:.2f} ms the "
            f"forward, {after:.2f} ms after it"
        )
    return lines


def phases(fn: Callable[[], object], device: torch.device, rounds: int) -> tuple[float, ...]:
    """Where one hooked call's time goes, medians of `rounds` calls, ms: before the forward
    (preparation, hooks, the model's snapshot: the GPU idles unless work is queued), the
    forward itself, and after it (the device finishing the forward's queued work, then the
    one transfer, the statistics and the report). CUDA events on a GPU (an event completes
    when the host has queued it and the device has done what came before), the wall clock on
    the CPU."""
    from hookcli.engine import passes

    real = passes.run_forward
    marks: list[Any] = []

    def mark() -> Any:
        if device.type != "cuda":
            return time.perf_counter() * 1e3
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def marked(*args: Any, **kwargs: Any) -> Any:
        marks.append(mark())
        try:
            return real(*args, **kwargs)
        finally:
            marks.append(mark())

    def gap(a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) if device.type == "cuda" else float(b - a)

    got: list[tuple[float, ...]] = []
    passes.run_forward = marked
    try:
        for _ in range(rounds + 1):  # (the first, a warm-up)
            marks.clear()
            marks.append(mark())
            fn()
            marks.append(mark())
            if device.type == "cuda":
                torch.cuda.synchronize()
            start, entered, left, end = marks[0], marks[1], marks[-2], marks[-1]
            got.append((gap(start, entered), gap(entered, left), gap(left, end)))
    finally:
        passes.run_forward = real
    return tuple(statistics.median(g[k] for g in got[1:]) for k in range(3))


def _nothing(*_: object) -> None:
    return None


def host_profile(device: torch.device, quick: bool, out: Path | None) -> list[str]:
    """(d): where one call's host time goes (cProfile of inspect and diff, bfloat16, batch 32):
    the 25 functions of most own time, written beside the figures."""
    import cProfile
    import io
    import pstats

    name, build, make = models(quick)[0]
    model = build().to(device, torch.bfloat16)
    x = make(2 if quick else 32).to(device, torch.bfloat16)
    calls: dict[str, Callable[[], object]] = {
        "inspect": lambda: hookcli.inspect(model, x, device=str(device), topk=0),
        "diff": lambda: hookcli.diff(model.float(), x.float(), b="bfloat16", device=str(device)),
    }
    text = io.StringIO()
    lines = [f"(d) host time of one call, {name} bfloat16 (cProfile)"]
    for what, fn in calls.items():
        fn()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.runcall(fn)
        lines.append(f"  {what}: {(time.perf_counter() - t0) * 1e3:.1f} ms under the profiler")
        text.write(f"=== {what}\n")
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(25)
        if out is not None:  # the whole profile too, for pstats where it is read
            prof.dump_stats(out.with_name(f"{out.stem}_{what}.prof"))
        model.to(torch.bfloat16)
    if out is not None:
        out.write_text(text.getvalue())
        lines.append(f"  the profiles: {out}")
    return lines


def _profiled(fn: Callable[[], object], out: Path, what: str) -> None:
    """fn's host time under cProfile, its 30 functions of most own and most cumulative time
    written to `out`."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    text = io.StringIO()
    text.write(f"=== {what}\n")
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    out.write_text(text.getvalue())
    prof.dump_stats(out.with_suffix(".prof"))  # the whole profile, for pstats where it is read


def _top1_sum(out: Any) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    flat = logits.reshape(logits.shape[0], -1)
    top: torch.Tensor = flat.max(dim=1).values.sum()
    return top


def timings(device: torch.device, quick: bool, rounds: int) -> list[str]:
    """(b): ratios of medians by CUDA events (the wall clock on the CPU)."""
    summary: Callable[..., Any] | None
    try:
        from torchinfo import summary
    except ImportError:  # not among the carried wheels: the line says so
        summary = None
    batch = 2 if quick else 32
    lines = [f"(b) time ({'CUDA events' if device.type == 'cuda' else 'wall clock'}, median "
             f"of {rounds} interleaved rounds; batch {batch})"]  # fmt: skip
    name, build, make = models(quick)[0]
    for dtype in (torch.float32, torch.bfloat16):
        model = build().to(device, dtype)
        x = make(batch).to(device, dtype)
        lines.append(
            _one_dtype(model, x, f"{name} b{batch}", summary, rounds=rounds, device=device)
        )
    model32 = build().to(device)
    x32 = make(batch).to(device)
    model16 = build().to(device, torch.bfloat16)
    x16 = x32.to(torch.bfloat16)

    def two_plain() -> object:
        with torch.no_grad():
            model32(x32)
            return model16(x16)

    got = interleaved(
        {
            "two plain": two_plain,
            "diff": lambda: hookcli.diff(model32, x32, b="bfloat16", device=str(device)),
        },
        rounds,
        device,
    )
    lines.append(
        f"  {name} b{batch} diff --b bfloat16: {got['diff'] / got['two plain']:.3f}x the two "
        f"plain passes ({got['two plain']:.2f} ms)"
    )
    return lines


def _one_dtype(
    model: nn.Module,
    x: torch.Tensor,
    name: str,
    summary: Callable[..., Any] | None,
    *,
    rounds: int,
    device: torch.device,
) -> str:
    """inspect, torchinfo and grads against the plain passes, for one model and dtype."""
    dev = str(device)

    def plain() -> object:
        with torch.no_grad():
            return model(x)

    def plain_backward() -> object:
        model.zero_grad(set_to_none=True)
        _top1_sum(model(x)).backward()  # type: ignore[no-untyped-call]
        return None

    variants: dict[str, Callable[[], object]] = {
        "plain": plain,
        "inspect": lambda: hookcli.inspect(model, x, device=dev, topk=0),
        "plain+backward": plain_backward,
        "grads": lambda: hookcli.grads(model, x, device=dev, topk=0),
    }
    if summary is not None:
        variants["torchinfo"] = lambda: summary(model, input_data=x, verbose=0)
    got = interleaved(variants, rounds, device)
    label = str(x.dtype).removeprefix("torch.")
    torchinfo = f", torchinfo {got['torchinfo'] / got['plain']:.3f}x" if "torchinfo" in got else ""
    return (
        f"  {name} {label}: plain {got['plain']:.2f} ms; inspect "
        f"{got['inspect'] / got['plain']:.3f}x{torchinfo}; grads "
        f"{got['grads'] / got['plain+backward']:.3f}x of a plain forward+backward "
        f"({got['plain+backward']:.2f} ms)"
    )


# --llm: the prompt's tokens, and the steps a --generate step's cost is averaged over
PROMPT, STEPS = 2048, 16
QUICK_PROMPT, QUICK_STEPS = 64, 4


def qwen_shaped(device: torch.device, quick: bool) -> nn.Module:
    """A Qwen2.5-0.5B-shaped causal LM (24 blocks, hidden 896, 14 heads with 2 for keys and
    values, vocabulary 151,936, tied embeddings), random init, made on `device`; with `quick`
    a 2-block one of hidden 64. No end-of-sequence token: every generation makes all the
    tokens asked for, so hooked and plain runs take the same steps."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape: dict[str, Any] = (
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
        if quick
        else {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936}
    )  # fmt: skip
    config = Qwen2Config(
        **shape,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    with device:
        model: nn.Module = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = None  # type: ignore[union-attr]
    return model.eval()


def llm_figures(
    device: torch.device, quick: bool, rounds: int, profile_out: Path | None = None
) -> list[str]:
    """(e): prefill and a --generate step of a Qwen2.5-0.5B-shaped model, every block hooked,
    hooked ÷ plain, by CUDA events (the wall clock on the CPU)."""
    from hookcli.commands.lens import find_blocks

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = qwen_shaped(device, quick).to(dtype)
    blocks = [name for name, _ in find_blocks(model)]
    prompt, steps = (QUICK_PROMPT, QUICK_STEPS) if quick else (PROMPT, STEPS)
    vocab: int = model.config.vocab_size  # type: ignore[union-attr,assignment]
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    dev = str(device)

    def plain() -> object:
        with torch.no_grad():
            return model(input_ids=ids)

    def inspect(new: int = 0) -> object:
        return hookcli.inspect(model, ids, device=dev, layers=blocks, topk=0, generate=new)

    def plain_generate(new: int) -> object:
        # what --generate asks of model.generate (hookcli's sources.lm.generation_args), greedy
        with torch.no_grad():
            return model.generate(  # type: ignore[operator]
                ids, max_new_tokens=new, do_sample=False, num_beams=1, temperature=None,
                top_p=None, top_k=None, return_dict_in_generate=True,
            )  # fmt: skip

    made = plain_generate(1 + steps).sequences.shape[-1] - prompt  # type: ignore[attr-defined]
    if made != 1 + steps:
        return [f"(e) language model: model.generate made {made} tokens, not {1 + steps}"]
    got = interleaved(
        {
            "plain": plain,
            "inspect": inspect,
            "plain 1": lambda: plain_generate(1),
            f"plain {1 + steps}": lambda: plain_generate(1 + steps),
            "hooked 1": lambda: inspect(1),
            f"hooked {1 + steps}": lambda: inspect(1 + steps),
        },
        rounds,
        device,
    )
    before, during, after = phases(inspect, device, rounds)
    if profile_out is not None:  # where one prefill's host time goes
        _profiled(inspect, profile_out, "inspect, prefill")
    plain_step = (got[f"plain {1 + steps}"] - got["plain 1"]) / steps
    hooked_step = (got[f"hooked {1 + steps}"] - got["hooked 1"]) / steps
    clock = "CUDA events" if device.type == "cuda" else "wall clock"
    name = "2-block Qwen2-shaped model" if quick else "Qwen2.5-0.5B shape (24 blocks)"
    label = str(dtype).removeprefix("torch.")
    return [
        f"(e) language model, {name}, random init, {label}, every block hooked ({clock}, "
        f"median of {rounds} interleaved rounds; batch 1)",
        f"  prefill {prompt} tokens: plain {got['plain']:.2f} ms; inspect "
        f"{got['inspect'] / got['plain']:.3f}x",
        f"    inspect's time: {before:.2f} ms before the forward, {during:.2f} ms the forward, "
        f"{after:.2f} ms after it",
        f"  --generate step ({steps} steps after the first token): plain {plain_step:.2f} ms a "
        f"step; inspect {hooked_step / plain_step:.3f}x a step",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile-out", type=Path, default=None, help="(d)'s profiles here")
    parser.add_argument("--llm", action="store_true", help="(e) alone: a language model")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_figures: no CUDA device here; nothing measured (--device cpu checks the script)")
        return 0
    device = torch.device(args.device)
    card = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    head = [f"hookcli {hookcli.__version__}, torch {torch.__version__}, {card}"]
    sections: list[Callable[[], list[str]]] = (
        [lambda: llm_figures(device, args.quick, args.rounds, args.profile_out)]
        if args.llm
        else [
            lambda: sync_check(device, args.quick),
            lambda: timings(device, args.quick, args.rounds),
            lambda: split(device, args.quick, args.rounds),
            lambda: host_profile(device, args.quick, args.profile_out),
        ]
    )
    # each section is printed as it ends: a run stopped at its time limit keeps what it measured
    text = "\n".join(head) + "\n"
    print(text, end="", flush=True)
    for section in sections:
        part = "\n".join(section()) + "\n"
        print(part, end="", flush=True)
        text += part
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
