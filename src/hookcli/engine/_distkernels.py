"""The quantization report's per-position numbers from both sides' logits, one row at a time
(numba; compiled once, cached on disk).

For each position, from the reference's logits `a` and side B's `b` over the vocabulary, in
float64 as each value is read (float32 or float64 rows: bfloat16 and float16 widen exactly to
float32 first), three passes over the row with no tensor the size of the row but one scratch
row of exponentials per thread:

1. the max and its first index (argmax) of each side, and whether a NaN or +Inf is there;
2. e = exp(x - max) of each side, kept, and their sums s;
3. ln p = (x - max) - ln s (torch's log_softmax, term for term), p = e / s, and
   KL(A‖B) = Σ_{p_A>0} p_A (ln p_A - ln p_B), KL(B‖A) = Σ_{p_B>0} p_B (ln p_B - ln p_A).

Then, at the text's next token t: Δp = p_B(t) - p_A(t) and -ln p(t) of each side. A row with
a NaN or +Inf logit, or no finite one, on either side is flagged (its numbers NaN): log_softmax
gives NaN there. torch ops computed these in about twenty passes over float64 copies of the
chunk's rows, each with an exp or a log of every element; here each element's exponential is
taken once per side. Sums run in order, with no fast-math: a row's numbers are the same run to
run and agree with float64 torch to rounding (~1e-12 relative on KL values of 1e-6).
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from numba import njit, prange

FIELDS = 7  # KL(A‖B), KL(B‖A), Δp, same top-1, -ln p_A(t), -ln p_B(t), finite


@njit(nogil=True, cache=True, inline="always")
def _row(ra: Any, rb: Any, t: int, e: Any, out: Any) -> None:
    v = ra.shape[0]
    ma = -np.inf
    mb = -np.inf
    ia = 0
    ib = 0
    bad = False
    for j in range(v):
        x = np.float64(ra[j])
        y = np.float64(rb[j])
        if x != x or y != y or x == np.inf or y == np.inf:  # noqa: PLR0124, PLR1714 (NaN; numba)
            bad = True
        if x > ma:
            ma = x
            ia = j
        if y > mb:
            mb = y
            ib = j
    if bad or ma == -np.inf or mb == -np.inf:
        for k in range(FIELDS - 1):
            out[k] = np.nan
        out[FIELDS - 1] = 0.0
        return
    sa = 0.0
    sb = 0.0
    for j in range(v):
        ea = math.exp(np.float64(ra[j]) - ma)
        eb = math.exp(np.float64(rb[j]) - mb)
        e[0, j] = ea
        e[1, j] = eb
        sa += ea
        sb += eb
    lsa = math.log(sa)
    lsb = math.log(sb)
    kl = 0.0
    kl_reverse = 0.0
    for j in range(v):
        la = (np.float64(ra[j]) - ma) - lsa
        lb = (np.float64(rb[j]) - mb) - lsb
        pa = e[0, j] / sa
        pb = e[1, j] / sb
        if pa > 0:
            kl += pa * (la - lb)
        if pb > 0:
            kl_reverse += pb * (lb - la)
    lat = (np.float64(ra[t]) - ma) - lsa
    lbt = (np.float64(rb[t]) - mb) - lsb
    out[0] = kl
    out[1] = kl_reverse
    out[2] = math.exp(lbt) - math.exp(lat)
    out[3] = 1.0 if ia == ib else 0.0
    out[4] = -lat
    out[5] = -lbt
    out[6] = 1.0


@njit(nogil=True, cache=True, parallel=True)
def _distances(a: Any, b: Any, target: Any, out: Any, scratch: Any) -> None:
    for i in prange(a.shape[0]):
        _row(a[i], b[i], target[i], scratch[numba.get_thread_id()], out[i])  # type: ignore[attr-defined]


def distances(
    a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], target: np.ndarray[Any, Any]
) -> Any:
    """(n, V) logits of each side (C-contiguous, both float32 or both float64) and the n next
    tokens → (n, FIELDS) float64, a row per position (see the module's docstring)."""
    out = np.empty((a.shape[0], FIELDS))
    scratch = np.empty((numba.get_num_threads(), 2, a.shape[1]))
    _distances(a, b, target, out, scratch)
    return out
