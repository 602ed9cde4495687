"""Per-head numbers of self-attention probabilities (batch, heads, L, L): the attention sink,
the mean entropy and the most-attended key.

Each sequence of a batch gets its own numbers, as if it ran alone. Its positions are counted
from its first real token (f: 0 unless a batch is padded on the left). The queries measured
are its real ones after f — the first real query can attend only itself under a causal mask,
and a class token's own row says nothing of the patches — each weighted equally:

- sink: the mean probability those queries put on key f (the first token: BOS, or a ViT's
  class token), "attention sinks" (Xiao et al. 2023); near 1 a dormant head that attends the
  sink and nothing else;
- entropy: the mean over those queries of -sum_k p log p, in nats (0: a query attends one key);
- top key: the key position (from f) with the largest mean probability over those queries,
  and that mean (`top_share`).

Computed where the probabilities live; one small tensor per call comes to the host. On CUDA the
sums over the queries come from one fused kernel (engine/_triton.head_sums) that reads the
probabilities once in their own dtype; elsewhere from torch ops in float64.
"""

from __future__ import annotations

import torch

from hookcli.engine import devicerow

HEAD_COLUMNS = 5  # sink, entropy, top key, top share, queries


def head_numbers(probs: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, HEAD_COLUMNS) float64 (float32 on MPS): each sequence's own numbers, for
    probabilities (B, H, L, L); `real` (B, L) marks the real tokens of a padded batch (None:
    every position is real). A sequence with no query counted has 0 queries (and zeros)."""
    acc = torch.float32 if probs.device.type == "mps" else torch.float64  # MPS has no float64
    p = probs.detach()
    b, h, length, _ = p.shape
    if real is None:
        mask = torch.ones(b, length, dtype=torch.bool, device=p.device)
    else:
        mask = real.to(device=p.device, dtype=torch.bool)
    pos = torch.arange(length, device=p.device)
    first = torch.where(mask, pos, length).amin(dim=1).clamp(max=length - 1)  # (B,)
    counted = mask & (pos > first[:, None])  # (B, L) the queries counted
    total = counted.sum(dim=1).to(acc)  # (B,)
    denom = total.clamp(min=1)[:, None]  # (B, 1)
    # keys counted from f: key j of sequence b is position f_b + j
    keys = (pos[None, :] + first[:, None]).clamp(max=length - 1)  # (B, L)
    valid_key = (pos[None, :] + first[:, None]) < length
    sums = devicerow.head_sums(p, counted)  # CUDA: one read of p, no float64 copy
    if sums is not None:
        col, plogp_sum = sums  # over the counted queries: each key's probability, Σ p log p
        sink = col.gather(2, first.view(b, 1, 1).expand(b, h, 1)).squeeze(2) / denom
        entropy = -plogp_sum / denom
        shifted_col = col.gather(2, keys.view(b, 1, length).expand(b, h, length))
        per_key = torch.where(valid_key.view(b, 1, length), shifted_col, 0.0) / denom[:, :, None]
    else:
        p = p.to(acc)
        rows = counted[:, None, :]  # a row not counted is left out, never multiplied (NaN x 0)
        # the sink: each query's probability on key f
        at_first = first.view(b, 1, 1, 1).expand(b, h, length, 1)
        sink_q = p.gather(3, at_first).squeeze(3)  # (B, H, L)
        sink = torch.where(rows, sink_q, 0.0).sum(2) / denom  # (B, H)
        plogp = torch.where(p > 0, p * p.log(), torch.zeros_like(p))
        entropy_q = -plogp.sum(3)  # (B, H, L)
        entropy = torch.where(rows, entropy_q, 0.0).sum(2) / denom
        shifted = p.gather(3, keys.view(b, 1, 1, length).expand(b, h, length, length))
        keep = valid_key.view(b, 1, 1, length) & counted.view(b, 1, length, 1)
        per_key = torch.where(keep, shifted, 0.0).sum(2) / denom[:, :, None]  # (B, H, L)
    share, top = per_key.max(dim=2)
    queries = total[:, None].expand(b, h)
    return torch.stack([sink, entropy, top.to(acc), share, queries], dim=2)
