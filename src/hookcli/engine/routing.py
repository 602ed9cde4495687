"""A MoE router's counts as numbers (records.ExpertStats), and several runs' merged by adding
counts: exact over batches, folders and ranks. No torch."""

from __future__ import annotations

import math
from collections.abc import Sequence

from hookcli.records import ExpertStats


def expert_stats(layer: str, experts: int, top_k: int | None, counts: Sequence[int]) -> ExpertStats:
    """The numbers of one router's counts."""
    total = sum(counts)
    mean = total / experts if experts else 0.0
    shares = [c / total for c in counts if c] if total else []
    return ExpertStats(
        layer=layer,
        experts=experts,
        top_k=top_k,
        tokens=total // top_k if top_k else total,
        counts=list(counts),
        dead=[e for e, c in enumerate(counts) if c == 0],
        imbalance=max(counts) / mean if mean else None,
        entropy=-sum(f * math.log(f) for f in shares) if total else None,
        max_entropy=math.log(experts) if experts else 0.0,
    )


def merge_experts(parts: Sequence[Sequence[ExpertStats]]) -> list[ExpertStats]:
    """Several runs' (batches', ranks') routing as one: counts added router by router."""
    merged: dict[str, ExpertStats] = {}
    for part in parts:
        for e in part:
            have = merged.get(e.layer)
            counts = (
                e.counts
                if have is None
                else [a + b for a, b in zip(have.counts, e.counts, strict=True)]
            )
            merged[e.layer] = expert_stats(e.layer, e.experts, e.top_k, counts)
    return list(merged.values())
