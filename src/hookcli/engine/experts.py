"""Expert routing of mixture-of-experts models, read from each router's own output.

transformers fuses a MoE layer's experts into one module, so which expert a token went to is
not visible as a call of an expert module. The router says it: transformers' routers
(MixtralTopKRouter, Qwen2MoeTopKRouter, OlmoeTopKRouter, DeepseekV3TopkRouter, …) return
(router_logits, top-k weights, top-k expert indices). A module whose class name says router
and whose output holds an integer tensor of (tokens, k) expert indices is read: per call, the
indices of the real tokens (a padded batch's padding left out) are counted per expert where
they live (bincount, no wait on a GPU), one transfer at the end. A router whose output holds
no indices is named in a note and not read: its routing is never guessed from its logits.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_ROUTER = re.compile(r"router", re.IGNORECASE)


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


def find_routers(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """(name, module, experts) of every module whose class name says router and that holds a
    (experts, hidden) weight."""
    found = []
    for name, m in model.named_modules():
        if not _ROUTER.search(type(m).__name__):
            continue
        weight = getattr(m, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            found.append((name, m, int(weight.shape[0])))
    return found


def _indices(output: Any, experts: int) -> torch.Tensor | None:
    """The (tokens, k) integer expert indices of a router's output, the last such tensor."""
    items = output if isinstance(output, tuple | list) else (output,)
    for t in reversed(items):
        if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point():
            return t
    return None


@contextlib.contextmanager
def counting_routes(model: nn.Module, real: torch.Tensor | None) -> Iterator[Routing]:
    """Forward hooks on every router for the `with` block, removed after (even on error).
    `real` (batch, tokens) marks a padded batch's real tokens: a call over batch x tokens
    rows counts those only."""
    routing = Routing()
    handles = []
    flat = None if real is None else real.reshape(-1).nonzero().squeeze(1)
    rows = None if real is None else real.numel()
    for name, module, experts in find_routers(model):
        count = RouterCount(name, experts)
        routing.routers.append(count)

        def hook(m: nn.Module, args: Any, output: Any, count: RouterCount = count) -> None:
            idx = _indices(output, count.experts)
            if idx is None:
                if count.name not in routing.unread:
                    routing.unread.append(count.name)
                return
            idx = idx.detach()
            if flat is not None and idx.shape[0] == rows:
                idx = idx.index_select(0, flat.to(idx.device))
            bins = torch.bincount(idx.reshape(-1).long(), minlength=count.experts)
            count.counts = bins if count.counts is None else count.counts + bins
            count.top_k = int(idx.shape[1])
            count.calls += 1

        handles.append(module.register_forward_hook(hook))
    try:
        yield routing
    finally:
        for h in handles:
            h.remove()
