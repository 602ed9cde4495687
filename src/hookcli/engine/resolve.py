"""What StatsCollector.finalize brings over after the pass besides the rows: small tensors'
elements, histograms' counts, --per-token rows (one transfer per device each), each copied
into the TensorStats that wants it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from hookcli.engine.tensorbits import finite_or_none
from hookcli.records import TensorStats, TokenRow


def resolve_tokens(
    tokens: dict[int, list[TokenRow] | torch.Tensor], wants: list[tuple[TensorStats, int]]
) -> None:
    """--per-token rows; those on a device travel in one transfer per device."""
    pending: dict[torch.device, list[int]] = {}
    for idx, v in tokens.items():
        if isinstance(v, torch.Tensor):
            pending.setdefault(v.device, []).append(idx)
    for idxs in pending.values():
        parts = [tokens[i] for i in idxs]
        stacked = torch.stack(parts).to("cpu", torch.float64).tolist()  # type: ignore[arg-type]
        for i, grid in zip(idxs, stacked, strict=True):
            tokens[i] = [
                TokenRow(
                    sequence=b,
                    position=p,
                    norm=finite_or_none(cell[0]),
                    mean=finite_or_none(cell[1]),
                    std=finite_or_none(cell[2]),
                    max_abs=finite_or_none(cell[3]),
                    channel=int(cell[4]) if math.isfinite(cell[4]) else None,
                )
                for b, seq in enumerate(grid)
                for p, cell in enumerate(seq)
            ]
    for stats, idx in wants:
        rows = tokens[idx]
        assert not isinstance(rows, torch.Tensor)
        stats.per_token = [dataclasses.replace(r) for r in rows]


def resolve_hists(
    hists: dict[int, np.ndarray[Any, Any] | torch.Tensor],
    ranges: dict[int, Any],
    wants: list[tuple[TensorStats, int]],
) -> None:
    """--hist's counts (those on a device in one transfer per device) and their edges."""
    by_device: dict[torch.device, list[int]] = {}
    for i, h in hists.items():
        if isinstance(h, torch.Tensor):
            by_device.setdefault(h.device, []).append(i)
    for idxs in by_device.values():  # one transfer per device
        stacked = torch.stack([hists[i] for i in idxs]).cpu().numpy()  # type: ignore[misc]
        for i, counts in zip(idxs, stacked, strict=True):
            hists[i] = counts
    for stats, idx in wants:
        counts = hists[idx]
        lo, hi = (float(v) for v in ranges[idx])  # device edges: read at the end
        if not (math.isfinite(lo) and math.isfinite(hi)):
            continue
        edges = np.linspace(lo, hi if hi > lo else lo + 1.0, len(counts) + 1)
        stats.hist = {"counts": [int(c) for c in counts], "edges": edges.tolist()}


def resolve_values(
    values: dict[int, list[float | None] | torch.Tensor], wants: list[tuple[TensorStats, int]]
) -> None:
    """Small tensors' elements; those on a device travel in one transfer per device."""
    pending: dict[torch.device, list[int]] = {}
    for idx, v in values.items():
        if isinstance(v, torch.Tensor):
            pending.setdefault(v.device, []).append(idx)
    for idxs in pending.values():
        parts = [values[i] for i in idxs]
        flat = torch.cat(parts).cpu().tolist()  # type: ignore[arg-type]
        start = 0
        for i, part in zip(idxs, parts, strict=True):
            n = part.numel()  # type: ignore[union-attr]
            values[i] = [finite_or_none(v) for v in flat[start : start + n]]
            start += n
    for stats, idx in wants:
        got = values[idx]
        assert not isinstance(got, torch.Tensor)
        stats.values = got
