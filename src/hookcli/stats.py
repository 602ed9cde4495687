"""Statistics of one tensor, computed where the tensor lives, with no host sync per tensor.

Every tensor a hook sees becomes one *row* of nine numbers:

    count (finite elements), mean, var (population), min, max, zeros, nan, inf, norm

`StatsCollector.add` returns the row's index at once; `finalize` turns all rows into one
float64 array with a single device-to-host transfer per device (HOOK_PITFALLS 8).

Two ways to fill a row:

* CPU float32/float64 (the common case): one fused pass of a numba kernel (`_fused`) that
  yields sum, sum of squares, zero count, min and max together. torch's own reductions
  stream at 20-45 GB/s for sum/amax/amin but near 1 GB/s for var_mean, count_nonzero,
  `(t == 0).sum()` and isfinite; the fused kernel streams at the speed of `sum` while doing
  all five (see benchmarks/overhead.py). Its results are trusted only when they are provably
  exact enough: a non-finite sum means the tensor holds NaN/Inf (or overflowed), and a
  variance small against the mean square means cancellation; both fall back to the exact path.
* Everything else (GPU, MPS, integers, bool, the fallbacks above): `_torch_row`, torch ops
  that never synchronise, accumulating in float64 (float32 on MPS, which lacks float64).

Non-float kinds are mapped first: quantized tensors are dequantized, complex tensors
measured by magnitude, sparse tensors densified, float16/bfloat16 widened to float32.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hookcli.records import TensorStats

ROW = 9
COUNT, MEAN, VAR, MIN, MAX, ZEROS, NAN, INF, NORM = range(ROW)

# Below this many elements the parallel kernel's thread start-up costs more than it saves.
_PARALLEL_MIN = 1 << 15
# Cancellation guard: var = E[x^2] - mean^2 loses about log10(E[x^2]/var) digits. The
# kernel's float32 block sums carry ~1e-7 relative error, so past this ratio the exact
# two-pass float64 path is used instead.
_MAX_CANCELLATION = 100.0


def _load_kernels() -> tuple[Callable[..., None], Callable[..., None]] | None:
    """The numba kernels, or None when numba is missing or unusable here."""
    if os.environ.get("HOOKCLI_STATS", "auto") == "torch":
        return None
    try:
        from hookcli import _kernels
    except Exception:  # numba absent or broken: the torch path is exact, only slower
        return None
    return _kernels.fused_serial, _kernels.fused_parallel


_KERNELS: tuple[Callable[..., None], Callable[..., None]] | None | bool = False


def kernels() -> tuple[Callable[..., None], Callable[..., None]] | None:
    global _KERNELS
    if _KERNELS is False:
        _KERNELS = _load_kernels()
    assert _KERNELS is not False
    return _KERNELS


def backend_name() -> str:
    return "numba" if kernels() is not None else "torch"


def _accumulate_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _prepare(t: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """Map any tensor to a real-valued strided tensor with the same statistics meaning."""
    note = None
    if t.is_quantized:
        t = t.dequantize()
        note = "quantized: statistics of the dequantized values"
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = t.abs()
        note = "complex: statistics of the magnitude"
    return t.detach(), note


def _torch_row(x: torch.Tensor) -> torch.Tensor:
    """The exact row, on x's device, by torch ops that never synchronise."""
    acc = _accumulate_dtype(x.device)
    x = x.to(acc).reshape(-1)
    finite = torch.isfinite(x)
    count = finite.sum(dtype=acc)
    xf = torch.where(finite, x, torch.zeros((), dtype=acc, device=x.device))
    mean = xf.sum() / count
    centred = torch.where(finite, x - mean, torch.zeros((), dtype=acc, device=x.device))
    var = torch.dot(centred, centred) / count
    inf = torch.tensor(math.inf, dtype=acc, device=x.device)
    mn = torch.where(finite, x, inf).amin()
    mx = torch.where(finite, x, -inf).amax()
    zeros = (x == 0).sum(dtype=acc)
    nan = torch.isnan(x).sum(dtype=acc)
    n_inf = torch.isinf(x).sum(dtype=acc)
    norm = torch.linalg.vector_norm(xf)
    return torch.stack([count, mean, var, mn, mx, zeros, nan, n_inf, norm])


def _dense_flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of exactly t's elements in memory order, copying only when t has gaps.

    Statistics ignore element order, so a channels_last or permuted tensor that covers its
    storage span densely is read in place.
    """
    if t.is_contiguous():
        return t.view(-1)
    dims = sorted(
        ((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz != 1),
    )
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return t.contiguous().view(-1)
        expected *= size
    return t.as_strided((t.numel(),), (1,))


def _fused_row(t: torch.Tensor) -> np.ndarray[Any, np.dtype[np.float64]] | None:
    """The row from one numba pass, or None when its result cannot be trusted."""
    ks = kernels()
    if ks is None:
        return None
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    flat = _dense_flat(t).numpy()
    n = flat.shape[0]
    out = np.empty(5, dtype=np.float64)
    (ks[1] if n >= _PARALLEL_MIN else ks[0])(flat, out)
    s, q, zeros, mn, mx = out
    if not (math.isfinite(s) and math.isfinite(q)):
        return None  # NaN/Inf present, or float32 overflow: the exact path counts them
    mean = s / n
    var = max(q / n - mean * mean, 0.0)
    if q / n > _MAX_CANCELLATION * var and q > 0:
        return None  # ill-conditioned: mean large against spread
    return np.array([n, mean, var, mn, mx, zeros, 0.0, 0.0, math.sqrt(q)], dtype=np.float64)


_EMPTY_ROW = np.array([0, math.nan, math.nan, math.nan, math.nan, 0, 0, 0, math.nan])


class StatsCollector:
    """Collects one row per tensor during a pass; numbers reach the host once, at the end.

    Tensors seen twice unchanged (a module's output fed to the next module as input) are
    measured once: the cache is keyed by object identity and torch's version counter, so an
    in-place op in between (ReLU(inplace=True)) makes a fresh measurement. Only weak
    references are held, so no activation outlives the hook that saw it.
    """

    def __init__(self) -> None:
        self._rows: list[np.ndarray[Any, Any] | torch.Tensor] = []
        self._notes: list[str | None] = []
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, t: torch.Tensor, path: str) -> tuple[TensorStats, int]:
        """Measure t now; return its (incomplete) TensorStats and its row index."""
        key = id(t)
        hit = self._seen.get(key)
        version = t._version
        stats = TensorStats(path, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.numel())
        if hit is not None and hit[0]() is t and hit[1] == version:
            idx = hit[2]
            stats.note = self._notes[idx]
            return stats, idx
        with torch.no_grad():
            row, note = self._measure(t)
        idx = len(self._rows)
        self._rows.append(row)
        self._notes.append(note)
        stats.note = note
        try:
            self._seen[key] = (weakref.ref(t), version, idx)
        except TypeError:  # a tensor subclass without weakref support: just measure again
            pass
        return stats, idx

    def _measure(self, t: torch.Tensor) -> tuple[np.ndarray[Any, Any] | torch.Tensor, str | None]:
        if t.device.type == "meta":
            return _EMPTY_ROW, "meta tensor: shape only"
        x, note = _prepare(t)
        if x.numel() == 0:
            return _EMPTY_ROW, note
        if x.device.type == "cpu" and x.dtype in _FUSED_DTYPES:
            row = _fused_row(x)
            if row is not None:
                return row, note
        return _torch_row(x), note

    def finalize(self) -> np.ndarray[Any, np.dtype[np.float64]]:
        """All rows as one (n, 9) float64 array: one transfer per device."""
        out = np.empty((len(self._rows), ROW), dtype=np.float64)
        by_device: dict[torch.device, list[int]] = {}
        for i, row in enumerate(self._rows):
            if isinstance(row, torch.Tensor):
                by_device.setdefault(row.device, []).append(i)
            else:
                out[i] = row
        for idxs in by_device.values():
            stacked = torch.stack([self._rows[i] for i in idxs])  # type: ignore[misc]
            out[idxs] = stacked.to("cpu", torch.float64).numpy()
        self._seen.clear()
        return out


_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _num(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None


def fill(stats: TensorStats, row: np.ndarray[Any, np.dtype[np.float64]]) -> TensorStats:
    """Complete a TensorStats from its finalized row."""
    count = row[COUNT]
    stats.nan = int(row[NAN])
    stats.inf = int(row[INF])
    stats.zeros = float(row[ZEROS] / stats.numel) if stats.numel else None
    if count > 0:
        stats.mean = _num(row[MEAN])
        stats.std = _num(math.sqrt(max(row[VAR], 0.0)))
        stats.min = _num(row[MIN])
        stats.max = _num(row[MAX])
        stats.norm = _num(row[NORM])
    return stats


def tensor_stats(t: torch.Tensor, path: str = "tensor") -> TensorStats:
    """Statistics of one tensor, computed and returned at once (tests, small uses)."""
    collector = StatsCollector()
    stats, idx = collector.add(t, path)
    return fill(stats, collector.finalize()[idx])
