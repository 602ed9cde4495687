"""A tensor's row (engine/statrow.py): on any device by torch ops (`torch_row`); a CPU float
tensor's from the numba kernels or from fast torch reductions; and many small tensors' rows
from one kernel call (`Later`: copies taken while the pass runs, measured together after it;
issue 52).

Both paths accumulate in float64 and agree to rounding (~1e-15). Each result is trusted only
when provably sound: a non-finite sum means NaN/Inf are present (the careful pass then counts
them and excludes them), and a variance small against the mean square means cancellation (a
centred pass then fixes it).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hookcli.engine.statrow import INF, NAN, Row
from hookcli.engine.tensorbits import PLAIN, accumulate_dtype, dense_flat

# Below this many elements the parallel kernel's thread start-up costs more than it saves.
PARALLEL_MIN = 1 << 15
# Cancellation guard: var = E[x^2] - mean^2 loses about log10(E[x^2]/var) digits of float64's
# ~16; past this ratio a second pass centred on the mean measures the variance instead.
MAX_CANCELLATION = 100.0
# `cpu_row` widens at most this many elements to float64 at a time (a scratch copy that stays
# in the cache, and bounded).
CHUNK = 1 << 18
# Tensors of at most this many elements are measured together (StatsCollector.add_whole, Later)
TOGETHER = 1 << 14
# Later holds copies of at most this many elements before it measures them
LATER_HELD = 1 << 20


class Kernels:
    """The numba kernels (see _kernels.py): fast for clean data, careful for the rest."""

    def __init__(self, module: Any, chan: Any, dist: Any) -> None:
        self.fused = (module.fused_serial, module.fused_parallel)
        self.at = module.fused_at  # many small tensors in one call, each where it lies
        self.careful = (module.careful_serial, module.careful_parallel)
        self.diff = (module.diff_serial, module.diff_parallel)
        self.diff_nhwc = module.diff_nhwc
        self.channels = chan  # --channels' per-channel passes (_chankernels)
        self.distances = dist.distances  # diff's next-token numbers per position (_distkernels)


def torch_row(x: torch.Tensor) -> torch.Tensor:
    """The exact row, on x's device, by torch ops that never synchronise."""
    acc = accumulate_dtype(x.device)
    x = x.to(acc).reshape(-1)
    finite = torch.isfinite(x)
    count = finite.sum(dtype=acc)
    xf = torch.where(finite, x, torch.zeros((), dtype=acc, device=x.device))
    mean = xf.sum() / count
    centred = torch.where(finite, x - mean, torch.zeros((), dtype=acc, device=x.device))
    var = torch.dot(centred, centred) / count
    inf = torch.full((), math.inf, dtype=acc, device=x.device)  # a fill, not a host copy
    mn = torch.where(finite, x, inf).amin()
    mx = torch.where(finite, x, -inf).amax()
    zeros = (x == 0).sum(dtype=acc)
    nan = torch.isnan(x).sum(dtype=acc)
    n_inf = torch.isinf(x).sum(dtype=acc)
    norm = torch.linalg.vector_norm(xf)
    # a constant, exactly: mean the value, variance 0 (the sums carry rounding), no sync
    constant = mn == mx
    mean = torch.where(constant, mn, mean)
    var = torch.where(constant, torch.zeros_like(var), var)
    norm = torch.where(constant, mn.abs() * count.sqrt(), norm)
    return torch.stack([count, mean, var, mn, mx, zeros, nan, n_inf, norm])


def sums(flat: torch.Tensor, shift: float = 0.0) -> tuple[float, float]:
    """Σ(v-shift) and Σ(v-shift)² of a 1-D CPU tensor in float64, a bounded chunk at a time."""
    s = q = 0.0
    for start in range(0, flat.shape[0], CHUNK):
        d = flat[start : start + CHUNK].double()
        if shift:
            d = d - shift
        s += float(d.sum())
        q += float(torch.dot(d, d))
    return s, q


def cpu_row(flat: torch.Tensor) -> Row | torch.Tensor:
    """The row of a 1-D CPU float tensor from fast torch reductions (float64 sums), or the
    careful `torch_row` when the sums show NaN/Inf."""
    s, q = sums(flat)
    if not (math.isfinite(s) and math.isfinite(q)):
        return torch_row(flat)
    n = flat.shape[0]
    mn, mx = (float(v) for v in torch.aminmax(flat))
    # counted on the bool copy: torch's count_nonzero branches on floats (slow on ReLU outputs)
    # and its sum of bools widens each to int64 (1 ms/MiB); together 7x faster than either
    zeros = float(n - int(torch.count_nonzero(flat.bool())))
    return finish(float(n), s, q, zeros=zeros, mn=mn, mx=mx, centred=lambda mean: sums(flat, mean))


def kernel_row(t: torch.Tensor, ks: Kernels, out: np.ndarray[Any, Any]) -> Row:
    """The row of a CPU float tensor from numba passes: usually one, at most three.

    1. the fast pass, trusted when its sums are finite (so the data holds no NaN/Inf, which
       its fast-math flags assume);
    2. else the careful pass, which counts NaN/Inf and keeps them out of the statistics;
    3. and, when E[x^2] dwarfs the variance, a careful pass centred on the mean (`finish`).

    `out` is a scratch buffer of 7 float64 values.
    """
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    if t.is_neg():  # a lazily negated view: numpy cannot read it where it lies
        t = t.resolve_neg()
    # numpy's reshape of a contiguous array is a view, and cheaper than torch's
    flat = t.numpy().reshape(-1) if t.is_contiguous() else dense_flat(t).numpy()
    par = flat.shape[0] >= PARALLEL_MIN
    ks.fused[par](flat, out)
    return row_of_sums(flat, out, ks, par)


def row_of_sums(flat: np.ndarray[Any, Any], out: Any, ks: Kernels, par: bool = False) -> Row:
    """The row of `flat` from the fast pass's five sums in out[:5] (out holds 7 float64
    values: the careful passes, where needed, fill all of them)."""
    n = flat.shape[0]
    s, q, zeros, mn, mx = out[:5].tolist()
    nan = inf = 0.0
    count = float(n)
    if not (math.isfinite(s) and math.isfinite(q)):  # NaN/Inf present
        ks.careful[par](flat, 0.0, out)
        s, q, zeros, mn, mx, nan, inf = out.tolist()
        count = n - nan - inf

    def centred(mean: float) -> tuple[float, float]:
        ks.careful[par](flat, mean, out)
        return float(out[0]), float(out[1])

    return finish(count, s, q, zeros=zeros, mn=mn, mx=mx, centred=centred, nan=nan, inf=inf)


def measurable_together(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Which tensors `segment_rows` can read where they lie: plain (or Parameter) contiguous
    CPU float32 ones of 1 to TOGETHER elements, none a lazily negated view nor nested."""
    return [
        type(t) in PLAIN
        and t.dtype is torch.float32
        and t.is_cpu
        and t.layout is torch.strided
        and 0 < t.numel() <= TOGETHER
        and t.is_contiguous()
        and not t.is_neg()  # (read where it lies: no lazy negation)
        and not t.is_nested
        for t in tensors
    ]


def segment_rows(
    tensors: Sequence[torch.Tensor],
    ks: Kernels,
    elements: list[list[float | None] | None] | None = None,
    small: int = 0,
) -> list[Row]:
    """The rows of contiguous CPU float32 tensors (none empty), from one call of the kernel
    that reads each where it lies, each as `row_of_sums` gives it, bit for bit: the common
    cases (finite, and a constant or without cancellation) worked out for all at once, the
    others (NaN/Inf present, cancellation) one by one. `elements`, when given, gets each
    tensor's elements if it has at most `small` (non-finite ones None), else None."""
    sizes = np.fromiter((t.numel() for t in tensors), np.int64, len(tensors))
    addresses = np.fromiter((t.data_ptr() for t in tensors), np.uint64, len(tensors))
    odd = addresses % 4 != 0
    if odd.any() or not addresses.all():
        # a float32 array off a 4-byte boundary (numpy's may be, and a tensor made from one):
        # read from an aligned copy; one without storage (resized to nothing): refused
        tensors = list(tensors)
        for j in np.flatnonzero(odd | (addresses == 0)).tolist():
            if addresses[j] == 0:
                raise ValueError(f"a tensor of {sizes[j]} elements has no storage to read")
            tensors[j] = tensors[j].clone()
            addresses[j] = tensors[j].data_ptr()
    # the tensors are held (by `tensors`) through the call: the addresses stay theirs
    return rows_at(
        addresses,
        sizes,
        ks,
        lambda j: tensors[j].detach().numpy().reshape(-1),
        elements=elements,
        small=small,
    )


def rows_at(
    addresses: np.ndarray[Any, Any],
    sizes: np.ndarray[Any, Any],
    ks: Kernels,
    flat: Callable[[int], np.ndarray[Any, Any]],
    *,
    elements: list[list[float | None] | None] | None = None,
    small: int = 0,
) -> list[Row]:
    """`segment_rows` of float32 runs at aligned `addresses` (uint64) of `sizes` (int64)
    elements, which the caller keeps alive; `flat(j)`: run j as a numpy array, for the ones
    measured one by one."""
    sums = np.empty((len(sizes), 7), dtype=np.float64)
    values = np.empty(int(sizes[sizes <= small].sum()) if elements is not None else 0)
    ks.at(addresses, sizes, sums, small if elements is not None else 0, values)
    n = sizes.astype(np.float64)
    s, q, zeros, mn, mx = sums[:, 0], sums[:, 1], sums[:, 2], sums[:, 3], sums[:, 4]
    with np.errstate(all="ignore"):  # NaN/Inf rows go the careful way below
        finite = np.isfinite(s) & np.isfinite(q)
        # a constant, as `finish` gives it: exactly (an all-zero gradient, a fresh bias)
        constant = finite & (mn == mx)
        mean = np.where(constant, mn, s / n)
        var = np.where(constant, 0.0, np.maximum(q / n - mean * mean, 0.0))
        norm = np.where(constant, np.abs(mn) * np.sqrt(n), np.sqrt(q))
        # what `finish` does otherwise: NaN/Inf present, cancellation
        careful = ~finite | (~constant & (q / n > MAX_CANCELLATION * var) & (q > 0))
    none = [0.0] * len(sizes)
    rows: list[Row] = list(
        zip(
            n.tolist(), mean.tolist(), var.tolist(), mn.tolist(), mx.tolist(), zeros.tolist(),
            none, none, norm.tolist(), strict=True,
        )
    )  # fmt: skip
    for j in np.flatnonzero(careful).tolist():
        rows[j] = row_of_sums(flat(j), sums[j], ks)
    if elements is not None:
        at = 0
        for size, row in zip(sizes.tolist(), rows, strict=True):
            if size > small:
                elements.append(None)
                continue
            got: list[Any] = values[at : at + size].tolist()
            if row[NAN] or row[INF]:
                got = [v if math.isfinite(v) else None for v in got]
            elements.append(got)
            at += size
    return rows


def finish(
    count: float,
    s: float,
    q: float,
    *,
    zeros: float,
    mn: float,
    mx: float,
    centred: Callable[[float], tuple[float, float]],
    nan: float = 0.0,
    inf: float = 0.0,
) -> Row:
    """The row from the sums over the finite elements; `centred(mean)` gives Σ(v-mean) and
    Σ(v-mean)² over them, for the variance when E[x^2] dwarfs it."""
    if count == 0:
        return (0.0, math.nan, math.nan, math.nan, math.nan, zeros, nan, inf, math.nan)
    if mn == mx:  # a constant: exactly (the sums carry rounding; 0.1 gives std 1e-16)
        return (count, mn, 0.0, mn, mx, zeros, nan, inf, abs(mn) * math.sqrt(count))
    mean = s / count
    norm = math.sqrt(q)
    var = max(q / count - mean * mean, 0.0)
    if q / count > MAX_CANCELLATION * var and q > 0:
        ds, dq = centred(mean)
        ds /= count
        var = max(dq / count - ds * ds, 0.0)
        mean += ds
    return (count, mean, var, mn, mx, zeros, nan, inf, norm)


def _memmove() -> Callable[[int, int, int], Any]:
    """memmove(dst, src, n), called holding the GIL where ctypes tells its address
    (ctypes.memmove lets the GIL go and takes it back, which costs more than 128 bytes' copy)."""
    address = ctypes.cast(ctypes.memmove, ctypes.c_void_p).value
    if not address:
        return ctypes.memmove
    kind = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return kind(address)


_COPY = _memmove()


class Later:
    """Small contiguous CPU float32 tensors (at most TOGETHER elements each), measured after
    the pass, together: each is copied as the hook sees it (an in-place op after the hook
    must not change what is measured) into one buffer, and every `LATER_HELD` elements, or
    at the end, one call of the segmented kernel measures them all where they lie in it
    (issue 52: one kernel call per tensor cost more than the copy, and a copy as a new
    tensor, `clone`, cost twice a `memmove` into the buffer). Rows come out as `row_of_sums`
    gives them, bit for bit.

    The buffer is numpy's (float32 on the CPU whatever torch's default dtype and device, and
    never an inference tensor), of at least TOGETHER elements, so that any tensor fits once
    what is held has been measured. A copy that would pass its end is refused, never
    written; each copy is recorded in one step, and every run is checked against the
    buffer's end before it is read. Hooks firing on several threads at once into one
    collector are not supported (their numbers may mix, as the collector's rows' places
    may), but no copy, nor any read, goes outside the buffer."""

    def __init__(self) -> None:
        self.bound = LATER_HELD  # elements held at most before they are measured
        # the buffer (made at the first add) with its address, set together
        self.store: tuple[np.ndarray[Any, Any], int] | None = None
        self.copies: list[tuple[int, int, int]] = []  # (first element, size, row's place)
        self.held = 0

    def full(self, n: int) -> bool:
        """Whether `n` more elements would pass what is held at most."""
        return self.held + n > self.bound

    def add(self, at: int, x: torch.Tensor) -> None:
        """Copy x (contiguous, CPU, float32, at most TOGETHER elements) now, in its place
        `at` among the collector's rows; a caller measures what is held first when `full`.
        A tensor with no storage to read (freed, or functionalized) is refused."""
        store = self.store
        if store is None:
            made = np.empty(max(self.bound, TOGETHER), np.float32)
            store = self.store = (made, made.ctypes.data)
        buffer, base = store
        start, n = self.held, x.numel()
        if start + n > buffer.shape[0]:
            raise ValueError(f"{n} elements do not fit in what is held for later")
        address = x.data_ptr()
        if address:  # its bytes, copied as they lie
            _COPY(base + 4 * start, address, 4 * n)
            if x.is_neg():  # a lazily negated view: its bytes are its values' negatives
                run = buffer[start : start + n]
                np.negative(run, out=run)
        elif getattr(x, "_is_zerotensor", lambda: False)():  # zeros, with no bytes at all
            buffer[start : start + n] = 0.0
        else:
            raise ValueError(f"a tensor of {n} elements has no storage to read")
        self.copies.append((start, n, at))
        self.held = start + n

    def rows(self, ks: Kernels) -> list[tuple[int, Row]]:
        """Every held tensor's row, with its place; nothing is held after."""
        store = self.store
        copies, self.copies = self.copies, []
        self.held = 0
        if not copies or store is None:
            return []
        values, base = store  # (held through the call: the addresses stay its own)
        table = np.array(copies, np.int64).reshape(-1, 3)
        # (a run that is not inside the buffer, which only hooks racing on several threads
        # could record, is not read: its statistics stay empty)
        table = table[
            (table[:, 1] > 0) & (table[:, 0] >= 0) & (table[:, 0] + table[:, 1] <= len(values))
        ]
        starts = table[:, 0]
        sizes = np.ascontiguousarray(table[:, 1])
        rows = rows_at(
            starts.astype(np.uint64) * np.uint64(4) + np.uint64(base),
            sizes,
            ks,
            lambda j: values[int(starts[j]) : int(starts[j]) + int(sizes[j])],
        )
        return list(zip(table[:, 2].tolist(), rows, strict=True))
