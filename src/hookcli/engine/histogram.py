"""A tensor's histogram over its own range or edges shared by every batch of a run."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from hookcli.engine.statrow import MAX, MIN, Row
from hookcli.engine.tensorbits import accumulate_dtype, dense_flat, real_valued


def histogram(
    t: torch.Tensor,
    row: Row | torch.Tensor,
    bins: int,
    fixed: tuple[Any, Any] | None,
    *,
    widen: bool,
) -> tuple[np.ndarray[Any, Any] | torch.Tensor, tuple[Any, Any]]:
    """Counts of the finite elements in `bins` equal bins, and the (lo, hi) they span.

    Over the tensor's own [min, max]; or over `fixed` edges (folder runs, where every batch
    must share them to be merged), values outside counted in the end bins; `widen` makes own
    edges half a range wider each side, to serve later batches. Computed where the tensor
    lives: numpy on the CPU, scatter_add on a device (no synchronisation)."""
    x, _ = real_valued(t)
    if isinstance(row, tuple):
        lo, hi = fixed if fixed is not None else (row[MIN], row[MAX])
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return np.zeros(bins, dtype=np.int64), (lo, hi)
        if fixed is None and widen:
            pad = (hi - lo) / 2 or 0.5
            lo, hi = lo - pad, hi + pad
        hi = hi if hi > lo else lo + 1.0
        wide = x.dtype in (torch.float16, torch.bfloat16, torch.bool)  # (numpy: no bool bins)
        flat = dense_flat(x.float() if wide else x).numpy()
        if fixed is not None:  # end bins are open: values outside the edges land there
            flat = np.clip(flat[np.isfinite(flat)], lo, hi)
        counts, _ = np.histogram(flat, bins=bins, range=(lo, hi))
        return counts, (lo, hi)
    acc = accumulate_dtype(x.device)
    v = x.reshape(-1).to(acc)
    lo_t, hi_t = fixed if fixed is not None else (row[MIN].to(acc), row[MAX].to(acc))
    if fixed is None and widen:
        pad = torch.where(hi_t > lo_t, (hi_t - lo_t) / 2, torch.full_like(hi_t, 0.5))
        lo_t, hi_t = lo_t - pad, hi_t + pad
    span = torch.where(hi_t > lo_t, hi_t - lo_t, torch.ones_like(hi_t))
    idx = ((v - lo_t) / span * bins).floor().clamp(0, bins - 1).nan_to_num(0).long()
    finite = torch.isfinite(v).to(acc)
    on_device = torch.zeros(bins, dtype=acc, device=v.device).scatter_add_(0, idx, finite)
    return on_device, (lo_t, hi_t)
