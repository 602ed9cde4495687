"""Small tensors' elements, kept during the pass (`small_values`, `small_values_together`), and
what StatsCollector.finalize brings over after it besides the rows: those elements,
histograms' counts, --per-token rows (one transfer per device each), each copied into the
TensorStats that wants it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from hookcli.engine.tensorbits import accumulate_dtype, by_device, finite_or_none, real_valued
from hookcli.records import TensorStats, TokenRow


def small_values(t: torch.Tensor) -> list[float | None] | torch.Tensor:
    """A small tensor's elements as floats (non-finite ones as None), flattened; on a GPU a
    float64 copy that finalize() brings over together with the others."""
    if t.dtype is torch.float32 and t.is_cpu and t.layout is torch.strided:  # (a bias)
        return [v if math.isfinite(v) else None for v in t.detach().reshape(-1).tolist()]
    x, _ = real_valued(t)
    flat = x.reshape(-1).to(accumulate_dtype(x.device), copy=True)
    if flat.is_cpu:
        return [finite_or_none(v) for v in flat.tolist()]
    return flat


def small_values_together(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """`small_values` of many small plain device tensors (a model's biases and their
    gradients), one copy for those of one device and dtype instead of one each: each a view of
    it."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(ts):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(ts)
    for (device, _), idxs in groups.items():
        flats = [ts[i].detach().reshape(-1) for i in idxs]
        whole = torch.cat(flats).to(accumulate_dtype(device))  # (cat: a copy already)
        for i, part in zip(idxs, torch.split(whole, [f.numel() for f in flats]), strict=True):
            out[i] = part
    return out


def resolve_tokens(
    tokens: dict[int, list[TokenRow] | torch.Tensor], wants: list[tuple[TensorStats, int]]
) -> None:
    """--per-token rows; those on a device travel in one transfer per device."""
    for idxs in by_device(tokens.items()).values():
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
    for idxs in by_device(hists.items()).values():  # one transfer per device
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
    for idxs in by_device(values.items()).values():
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
