"""Interventions: `--ablate LAYER=zero|mean|scale:K|noise:S|clamp:LO:HI` for one run.

Each is a forward hook on the layer that returns a changed output — the one place hookcli
replaces what a module returns, on purpose, and only during the ablated run. Hooks are
removed afterwards; the model is left unchanged.

    zero        the output becomes zeros
    mean        each channel becomes its mean over every other dim (a scalar for 1-D); the
                channel dim follows the output's layout (NHWC, tokens: engine.layout); a
                padded text batch's (batch, tokens, C) mean is over its real positions
    scale:K     multiplied by K
    noise:S     plus Gaussian noise of std S (seeded)
    clamp:LO:HI clamped into [LO, HI]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookcli import bounds
from hookcli.engine.layout import NHWC, TOKENS, LayoutOf
from hookcli.engine.selection import ModuleEntry
from hookcli.errors import UsageError
from hookcli.records import Ablation, LayerChange, Report, TensorStats
from hookcli.tree import map_tensors

OPS = ("zero", "mean", "scale:K", "noise:S", "clamp:LO:HI")


@dataclass(slots=True)
class AblationSpec:
    layer: str
    op: str
    args: tuple[float, ...] = ()

    def describe(self) -> str:
        return f"{self.layer}={':'.join([self.op, *(f'{a:g}' for a in self.args)])}"


def parse(raw: str) -> AblationSpec:
    layer, sep, op = raw.partition("=")
    parts = op.strip().split(":")
    kind = parts[0].lower()
    want = {"zero": 0, "mean": 0, "scale": 1, "noise": 1, "clamp": 2}
    if not sep or not layer.strip() or kind not in want or len(parts) - 1 != want[kind]:
        raise UsageError(
            f"malformed --ablate {raw!r}: expected LAYER=OP with OP one of {', '.join(OPS)}.",
            "for example --ablate layer4=zero or --ablate layer3.1.relu=scale:0.5",
        )
    option = f"--ablate {raw!r}: {kind}"
    if kind == "scale":
        args: tuple[float, ...] = (bounds.number(parts[1], option, example="scale:0.5"),)
    elif kind == "noise":
        args = (bounds.number(parts[1], f"{option} std", low=0, example="noise:0.1"),)
    elif kind == "clamp":  # an infinite bound is a one-sided clamp
        lo, hi = (bounds.number(p, option, infinite=True, example="clamp:0:6") for p in parts[1:])
        if lo > hi:
            raise UsageError(f"--ablate {raw!r}: clamp needs LO <= HI.", "e.g. clamp:0:6")
        args = (lo, hi)
    else:
        args = ()
    return AblationSpec(layer.strip(), kind, args)


def _channel_mean(t: torch.Tensor, channel: int, real: torch.Tensor | None) -> torch.Tensor:
    """Each channel's mean over every other dim, in t's shape; where `real` (a padded batch's
    (batch, tokens) mask) matches a (batch, tokens, C) t, over its real positions alone (the
    padding's values are what the model makes of a pad token, no data)."""
    if real is not None and t.dim() == 3 and channel == 2 and real.shape == t.shape[:2]:
        weight = real.to(device=t.device, dtype=torch.float32).unsqueeze(-1)
        total = (t.float() * weight).sum(dim=(0, 1), keepdim=True)
        return (total / weight.sum()).to(t.dtype).expand_as(t).clone()
    dims = [d for d in range(t.dim()) if d != channel]
    return t.mean(dim=dims, keepdim=True).expand_as(t).clone()


def _change(
    spec: AblationSpec,
    seed: int,
    channel_dim: Callable[[torch.Tensor], int],
    real: torch.Tensor | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    gen: list[torch.Generator] = []

    def change(t: torch.Tensor) -> torch.Tensor:
        if spec.op == "zero":
            return torch.zeros_like(t)
        if spec.op == "scale":
            return t * spec.args[0]
        if spec.op == "clamp":
            return t.clamp(spec.args[0], spec.args[1])
        if spec.op == "mean":
            if t.dim() < 2:
                return torch.full_like(t, float(t.float().mean()))
            return _channel_mean(t, channel_dim(t), real)
        if not gen:
            gen.append(torch.Generator(device=t.device).manual_seed(seed))
        noise = torch.randn(t.shape, generator=gen[0], device=t.device, dtype=t.dtype)
        return t + spec.args[0] * noise

    return change


@contextmanager
def ablated(
    entries: Sequence[ModuleEntry],
    specs: Sequence[AblationSpec],
    seed: int,
    layout: LayoutOf | None = None,
    *,
    tokens: tuple[int, ...] | None = None,
    real: torch.Tensor | None = None,
) -> Iterator[list[int]]:
    """Hooks that change the named layers' outputs; yields their call counts, removed after.
    `layout` tells `mean` where a 3-D/4-D output keeps its channels (engine.layout: dim 3 of
    NHWC, dim 2 of tokens); without it, or for other ranks, dim 1. `tokens`: a text model's
    (batch, tokens), whose (batch, tokens, C) outputs keep their channels last; `real`: its
    padded batch's mask, whose real positions alone make a mean."""
    handles = []
    calls = [0] * len(specs)
    try:
        for i, spec in enumerate(specs):
            entry = next((e for e in entries if spec.layer in e.names), None)
            if entry is None:
                raise UsageError(
                    f"--ablate: no layer named {spec.layer!r}.",
                    "ablation takes an exact layer name; see `hookcli layers MODEL`.",
                )

            def channel_dim(t: torch.Tensor, name: str = spec.layer) -> int:
                if tokens is not None and t.dim() == 3 and tuple(t.shape[:2]) == tokens:
                    return 2  # (a text model's hidden states: channels last, as --channels)
                if layout is None or t.dim() not in (3, 4):
                    return 1
                try:
                    kind = layout(name, tuple(t.shape)).kind
                except UsageError as exc:
                    raise UsageError(
                        f"--ablate {name}=mean: which dimension of its output holds the "
                        f"channels cannot be told. {exc.message}",
                        "ablate this layer with zero, scale, clamp or noise, or give an "
                        "image input.",
                    ) from exc
                return 3 if kind == NHWC else 2 if kind == TOKENS else 1

            change = _change(spec, (seed + i) % 2**64, channel_dim, real)  # seeds wrap at 2**64

            def hook(
                module: nn.Module,
                args: Any,
                out: Any,
                i: int = i,
                change: Callable[[torch.Tensor], torch.Tensor] = change,
            ) -> Any:
                calls[i] += 1
                # every floating-point tensor of the output changed, its structure kept
                return map_tensors(out, lambda _, t: change(t) if t.is_floating_point() else t)

            handles.append(entry.module.register_forward_hook(hook))
        yield calls
    finally:
        for h in handles:
            h.remove()


def _moved(clean: TensorStats, ablated: TensorStats) -> float:
    """How far the ablated output's statistics moved from the clean one's: the largest change
    of its mean, std, min, max and norm over the clean output's rms (a sign flip or a
    permutation keeps the norm; the mean, min and max move); inf where one is not finite on
    one side only."""
    rms = clean.norm / math.sqrt(clean.numel) if clean.norm and clean.numel else 0.0
    worst = 0.0
    for field in ("mean", "std", "min", "max", "norm"):
        a, b = getattr(clean, field), getattr(ablated, field)
        if a is None or b is None:
            worst = worst if (a is None) == (b is None) else math.inf
        elif a != b:
            worst = max(worst, abs(b - a) / rms if rms > 0 else math.inf)
    return worst


def compare(clean: Report, changed: Report, specs: Sequence[AblationSpec]) -> Ablation:
    """How the ablation moved the predictions and every layer call's output."""
    before = {(c.name, c.call, t.path): t for c in clean.layers for t in c.outputs}
    changes = []
    for c in changed.layers:
        for t in c.outputs:
            b = before.get((c.name, c.call, t.path))
            if b is None or b.norm is None or t.norm is None:
                continue
            rel = abs(t.norm - b.norm) / max(b.norm, 1e-12)
            moved = _moved(b, t)
            if moved > 1e-6:
                changes.append(
                    LayerChange(c.name, c.call, t.path, b.norm, t.norm, rel, b.mean, t.mean, moved)
                )
    changes.sort(key=lambda ch: -(ch.moved or 0.0))
    return Ablation(
        specs=[s.describe() for s in specs],
        predictions_before=clean.predictions,
        predictions_after=changed.predictions,
        outputs_before=clean.outputs,
        outputs_after=changed.outputs,
        changed_layers=changes,
    )
