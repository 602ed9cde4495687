"""Expert routing of mixture-of-experts models, read from each router's own output.

transformers fuses a MoE layer's experts into one module, so which expert a token went to is
not visible as a call of an expert module. The router says it: transformers' routers
(MixtralTopKRouter, Qwen2MoeTopKRouter, OlmoeTopKRouter, DeepseekV3TopkRouter, …) return
(router_logits, top-k weights, top-k expert indices). A module whose class name says router
and whose output holds an integer tensor of (tokens, k) expert indices is read: per call, the
indices of the real tokens (a padded batch's padding left out) are counted per expert where
they live (no wait on a GPU), one transfer at the end; an index outside the experts (a
dropped token's -1) is not counted. A router whose output holds no indices is named in a note
and not read: its routing is never guessed from its logits. The hooks never break the
model's forward: a failure is a note.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hookcli.engine.selection import all_modules

# a router's class: transformers' *TopKRouter, *Router; a MoE gate (DeepseekV2's MoEGate,
# HunYuanMoEV1Gate)
_ROUTER = re.compile(r"router|moe\w*gate", re.IGNORECASE)


@dataclass(slots=True)
class RouterCount:
    """One router's counts over a pass: tokens routed to each expert (k per token)."""

    name: str
    experts: int
    counts: torch.Tensor | None = None  # (experts,) int64, where the router runs
    top_k: int | None = None
    calls: int = 0


@dataclass(slots=True)
class Routing:
    """Every router found, and those whose output held no indices (names)."""

    routers: list[RouterCount] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # a router hook that failed, and why


@functools.cache
def _router_name(name: str) -> bool:
    return _ROUTER.search(name) is not None


def find_routers(
    model: nn.Module, types: Iterable[str] | None = None
) -> list[tuple[str, nn.Module, int]]:
    """(name, module, experts) of every module whose class name says router (or MoE gate)
    and that holds a (experts, hidden) weight: its own, or its one Linear's (Gemma 4's
    router.proj, HunYuan's gate.wg). `types`: the modules' class names, where the caller has
    them (the pass's module table): no walk at all for a model without a router."""
    found: list[tuple[str, nn.Module, int]] = []
    if types is None:
        types = (type(m).__name__ for m in all_modules(model))
    if not any(_router_name(t) for t in types):
        return found  # (most models: no second walk, for names)
    for name, m in model.named_modules():
        if not _router_name(type(m).__name__):
            continue
        weight = getattr(m, "weight", None)
        if not isinstance(weight, torch.Tensor):
            linears = [c for c in m.children() if isinstance(c, nn.Linear)]
            if len(linears) == 1:  # (its out_features: a quantized weight is packed)
                found.append((name, m, int(linears[0].out_features)))
            continue
        if weight.dim() == 2:
            found.append((name, m, int(weight.shape[0])))
    return found


def _indices(output: Any, experts: int) -> torch.Tensor | None:
    """The (tokens, k) integer expert indices of a router's output, the last such tensor."""
    items = output if isinstance(output, tuple | list) else (output,)
    for t in reversed(items):
        if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point():
            return t
    return None


def _count(
    count: RouterCount,
    idx: torch.Tensor | None,
    real: torch.Tensor | None,
    rows: int | None,
    routing: Routing,
) -> None:
    """One router call's indices added to its counts, where they live: an index outside
    0…experts-1 (a dropped token's -1) is not counted. No wait on a GPU (index_add_, not
    bincount, which reads its input's range back to the host)."""
    if idx is None:
        if count.name not in routing.unread:
            routing.unread.append(count.name)
        return
    idx = idx.detach()
    if real is not None and idx.shape[0] == rows:
        idx = idx.index_select(0, real.to(idx.device))
    flat = idx.reshape(-1).long()
    valid = (flat >= 0) & (flat < count.experts)
    if count.counts is None:
        count.counts = torch.zeros(count.experts, dtype=torch.int64, device=flat.device)
    count.counts.index_add_(0, flat.clamp(0, count.experts - 1), valid.long())
    count.top_k = int(idx.shape[1])
    count.calls += 1


@contextlib.contextmanager
def counting_routes(
    model: nn.Module, real: torch.Tensor | None, types: Iterable[str] | None = None
) -> Iterator[Routing]:
    """Forward hooks on every router for the `with` block, removed after (even on error).
    `real` (batch, tokens) marks a padded batch's real tokens: a call over batch x tokens
    rows counts those only. `types`: as `find_routers` takes them."""
    routing = Routing()
    handles = []
    flat = None if real is None else real.reshape(-1).nonzero().squeeze(1)
    rows = None if real is None else real.numel()
    for name, module, experts in find_routers(model, types):
        count = RouterCount(name, experts)
        routing.routers.append(count)

        def hook(m: nn.Module, args: Any, output: Any, count: RouterCount = count) -> None:
            try:  # never break the model's forward: a router not read is said
                _count(count, _indices(output, count.experts), flat, rows, routing)
            except Exception as exc:
                routing.problems.append(f"router {count.name}: {exc}")

        handles.append(module.register_forward_hook(hook))
    try:
        yield routing
    finally:
        for h in handles:
            h.remove()
