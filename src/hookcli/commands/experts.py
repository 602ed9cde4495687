"""A MoE model's expert routing in a report: each router's counts (engine.experts) made into
ExpertStats (engine.routing, which also merges them over batches and ranks). No torch at
import."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookcli.engine.routing import expert_stats, merge_experts
from hookcli.records import ExpertStats

__all__ = ["expert_stats", "merge_experts", "routing_report"]

if TYPE_CHECKING:
    from hookcli.engine.experts import Routing


def routing_report(routing: Routing) -> tuple[list[ExpertStats], list[str]]:
    """Every router that routed a token, in module order (one transfer for all), and notes."""
    import torch

    read = [r for r in routing.routers if r.counts is not None]
    notes = [
        f"router {name} gives no expert indices: its routing is not read" for name in routing.unread
    ]
    notes += [f"could not read {p}" for p in routing.problems[:3]]
    if not read:
        return [], notes
    flat = torch.cat([r.counts.to("cpu") for r in read if r.counts is not None]).tolist()
    out = []
    at = 0
    for r in read:
        counts = [int(c) for c in flat[at : at + r.experts]]
        at += r.experts
        out.append(expert_stats(r.name, r.experts, r.top_k, counts))
    return out, notes
