"""Attention by hand: rollout (Abnar & Zuidema) and each head's sink, entropy and top key."""

from __future__ import annotations

import math
from typing import Any

import torch


def rollout_by_hand(probs: list[torch.Tensor]) -> torch.Tensor:
    """Abnar & Zuidema: mean over heads, + I, rows renormalised, multiplied through."""
    n = probs[0].shape[-1]
    eye = torch.eye(n, dtype=torch.float64)
    result = eye.expand(probs[0].shape[0], n, n)
    for p in probs:
        a = p.double().mean(dim=1) + eye
        a = a / a.sum(dim=-1, keepdim=True)
        result = a @ result
    return result


def numbers_by_hand(probs: list[Any]) -> list[tuple[float, float, int, float, int]]:
    """Per head: (sink, entropy, top key, its share, queries) over sequences given one by one
    as (heads, L, L) probabilities of their real tokens only: queries 1…L-1."""
    heads = probs[0].shape[0]
    out = []
    for h in range(heads):
        sink = entropy = 0.0
        n = 0
        keys: dict[int, float] = {}
        for p in probs:
            length = p.shape[1]
            for q in range(1, length):
                row = p[h, q].tolist()
                sink += row[0]
                entropy -= sum(v * math.log(v) for v in row if v > 0)
                for k, v in enumerate(row):
                    keys[k] = keys.get(k, 0.0) + v
                n += 1
        top = max(keys, key=lambda k: (keys[k], -k))
        out.append((sink / n, entropy / n, top, keys[top] / n, n))
    return out
