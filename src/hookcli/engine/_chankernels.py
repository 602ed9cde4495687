"""--channels' numba kernels: a tensor's per-channel statistics in two reads (see channels.py).

The tensor is read as (outer, C, inner) — C its channels; inner 1 for (…, C) tensors (tokens,
features, channels-last images), H*W for NCHW. Two passes over the data in its own
precision (float32 or float64), each writing rows of channels.py's packed block:

1. `first_*`: per channel Σx (float64), min, max, the count of zeros and of |x| >= `large`
   (these in the input's precision — exact, and twice float64's SIMD lanes);
2. `second_*`: given each channel's mean and the tensor's mean g, per channel Σ(x-mean)² in
   float64 (the variance centred exactly, as var_mean does: no cancellation, whatever the
   mean), and for the tensor Σ(x-g)² and Σ(x-g)⁴ (its kurtosis).

The first pass carries the fast-math flags of _kernels._fused: its figures are trusted only
when every channel's sum is finite — the data then holds no NaN or Inf, which those flags
assume. The caller checks that (and masked values, the dtype's lowest, from the minima)
before the second pass, which runs only on clean data.

Where the channel is the last dimension, rows are split among numba's threads, each
accumulating its own per-channel partials (summed after in a fixed order, so the digits do
not depend on scheduling); where it is not, channels are.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import njit, prange

from hookcli.engine._kernels import FASTMATH, fmax, fmin
from hookcli.engine.packing import LARGE_N, M2, MAX, MEAN, MIN, ZEROS

PARALLEL_MIN = 1 << 15  # fewer elements: one thread (the threads' start costs more)


def threads() -> int:
    """numba's threads in this thread: how many row ranges a parallel pass splits rows into."""
    return int(numba.get_num_threads())


@njit(fastmath=FASTMATH, nogil=True, cache=True, inline="always")
def _first_rows(a: Any, large: Any, parts: int, out: Any) -> None:
    rows, c = a.shape
    s = np.zeros((parts, c))
    # min, max and the counts in the input's precision (exact; twice the lanes of float64)
    mn = np.full((parts, c), np.inf, dtype=a.dtype)
    mx = np.full((parts, c), -np.inf, dtype=a.dtype)
    z = np.zeros((parts, c), dtype=np.int64)
    big = np.zeros((parts, c), dtype=np.int64)
    for p in prange(parts):
        sp, mnp, mxp, zp, bigp = s[p], mn[p], mx[p], z[p], big[p]
        for r in range(rows * p // parts, rows * (p + 1) // parts):
            row = a[r]
            for j in range(c):
                v = row[j]
                sp[j] += np.float64(v)
                mnp[j] = fmin(mnp[j], v)
                mxp[j] = fmax(mxp[j], v)
                zp[j] += 1 if v == 0 else 0
                bigp[j] += 1 if abs(v) >= large else 0
    for j in range(c):  # the parts in a fixed order: the digits do not depend on scheduling
        out[MEAN, j] = s[0, j]
        out[MIN, j] = mn[0, j]
        out[MAX, j] = mx[0, j]
        out[ZEROS, j] = z[0, j]
        out[LARGE_N, j] = big[0, j]
    for p in range(1, parts):
        for j in range(c):
            out[MEAN, j] += s[p, j]
            out[MIN, j] = min(out[MIN, j], mn[p, j])
            out[MAX, j] = max(out[MAX, j], mx[p, j])
            out[ZEROS, j] += z[p, j]
            out[LARGE_N, j] += big[p, j]


@njit(fastmath=FASTMATH, nogil=True, cache=True, inline="always")
def _second_rows(  # noqa: PLR0917 (numba compiles no keyword-only arguments)
    a: Any, mean: Any, g: float, parts: int, out: Any, moments: Any
) -> None:
    rows, c = a.shape
    m2 = np.zeros((parts, c))
    g2 = np.zeros((parts, c))
    g4 = np.zeros((parts, c))
    for p in prange(parts):
        m2p, g2p, g4p = m2[p], g2[p], g4[p]
        for r in range(rows * p // parts, rows * (p + 1) // parts):
            row = a[r]
            for j in range(c):
                w = np.float64(row[j])
                d = w - mean[j]
                m2p[j] += d * d
                e = w - g
                e2 = e * e
                g2p[j] += e2
                g4p[j] += e2 * e2
    for j in range(c):
        out[M2, j] = m2[0, j]
    for p in range(1, parts):
        for j in range(c):
            out[M2, j] += m2[p, j]
    moments[0] = g2.sum()
    moments[1] = g4.sum()


@njit(fastmath=FASTMATH, nogil=True, cache=True, parallel=True)
def first_rows(a: Any, large: Any, parts: int, out: Any) -> None:
    """a: (rows, C), C-contiguous; large: a scalar of a's dtype. out: the (PER_CHANNEL, C)
    float64 block of channels.py's packed vector, whose rows MEAN (here: the sum), MIN, MAX,
    ZEROS and LARGE_N are filled. The rows are split in `parts` ranges over numba's threads."""
    _first_rows(a, large, parts, out)


@njit(fastmath=FASTMATH, nogil=True, cache=True)
def first_rows_serial(a: Any, large: Any, out: Any) -> None:
    """As first_rows, in this thread."""
    _first_rows(a, large, 1, out)


@njit(fastmath=FASTMATH, nogil=True, cache=True, parallel=True)
def second_rows(  # noqa: PLR0917 (numba compiles no keyword-only arguments)
    a: Any, mean: Any, g: float, parts: int, out: Any, moments: Any
) -> None:
    """a: (rows, C), free of NaN/Inf; mean: each channel's mean; g: the tensor's. Fills the
    block's row M2 (Σ(x - mean)² per channel), and moments[:2] = Σ(x-g)², Σ(x-g)⁴. Rows split
    as first_rows splits them."""
    _second_rows(a, mean, g, parts, out, moments)


@njit(fastmath=FASTMATH, nogil=True, cache=True)
def second_rows_serial(a: Any, mean: Any, g: float, out: Any, moments: Any) -> None:
    """As second_rows, in this thread."""
    _second_rows(a, mean, g, 1, out, moments)


@njit(fastmath=FASTMATH, nogil=True, cache=True, parallel=True)
def first_planes(a: Any, large: Any, out: Any) -> None:
    """a: (outer, C, inner), C-contiguous, inner > 1; otherwise as first_rows."""
    outer, c, inner = a.shape
    for j in prange(c):
        s = 0.0
        mn = a[0, j, 0]
        mx = mn
        z = 0
        big = 0
        for o in range(outer):
            plane = a[o, j]
            for i in range(inner):
                v = plane[i]
                s += np.float64(v)
                mn = fmin(mn, v)
                mx = fmax(mx, v)
                z += 1 if v == 0 else 0
                big += 1 if abs(v) >= large else 0
        out[MEAN, j] = s
        out[MIN, j] = mn
        out[MAX, j] = mx
        out[ZEROS, j] = z
        out[LARGE_N, j] = big


@njit(fastmath=FASTMATH, nogil=True, cache=True, parallel=True)
def second_planes(a: Any, mean: Any, g: float, out: Any, moments: Any) -> None:
    """a: (outer, C, inner), free of NaN/Inf, inner > 1; otherwise as second_rows."""
    outer, c, inner = a.shape
    g2 = np.zeros(c)
    g4 = np.zeros(c)
    for j in prange(c):
        m = mean[j]
        m2 = 0.0
        e2s = 0.0
        e4s = 0.0
        for o in range(outer):
            plane = a[o, j]
            for i in range(inner):
                w = np.float64(plane[i])
                d = w - m
                m2 += d * d
                e = w - g
                e2 = e * e
                e2s += e2
                e4s += e2 * e2
        out[M2, j] = m2
        g2[j] = e2s
        g4[j] = e4s
    moments[0] = g2.sum()
    moments[1] = g4.sum()
