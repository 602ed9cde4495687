"""--channels: each activation's statistics per channel, and the values that stand out.

Per channel — the channel dimension as the layout says it: the last of a (…, C) tensor (tokens,
features), dim 1 of NCHW, dim 3 of NHWC — the count of values, their mean and population std,
min, max, how many are zero and how many have |x| >= 6 (LLM.int8's outlier magnitude, Dettmers
et al. 2022). These merge exactly over batches, folders and ranks (Chan's update, as whole
tensors do: engine.aggregate), and memory is O(channels) however many tokens pass.

Per tensor: kurtosis (Pearson's, E[(x-mu)^4] / sigma^4: 3 for a normal distribution), the
median |x|, and the largest |x| with where they sit — the massive activations among them (Sun
et al., "Massive Activations in Large Language Models", 2024: |x| > 100 and > 1000 x the
tensor's median |x|).

Masked values never count as values: the scores an attention mask fills with the dtype's lowest
value or -inf are counted apart (`masked`), and a padded batch's padding is left out before any
of this (the collector's token mask). NaN and +inf are not values either: the tensor's own
statistics count them.

Everything is computed where the tensor lives, in float64, with no wait on a GPU; the numbers
travel to the host with the collector's other rows, at the end of the pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hookcli.engine.packing import (
    COUNT,
    LARGE_N,
    M2,
    MASKED,
    MAX,
    MEAN,
    MIN,
    PER_CHANNEL,
    ZEROS,
)
from hookcli.engine.tensorbits import FLAT, by_device, own_positions
from hookcli.records import ChannelStats, Massive

LARGE = 6.0  # LLM.int8: a feature dimension is an outlier where |x| reaches 6
MASSIVE_ABS = 100.0  # Sun et al.: a massive activation exceeds 100 …
MASSIVE_RATIO = 1000.0  # … and 1000 times the median |x| of its tensor
TOP = 16  # the largest |x| of each tensor kept as massive candidates


HIST_BINS = 2048  # calib's histogram of |x|: log-spaced bins over 12 decades, merged exactly
HIST_LOW, HIST_HIGH = -6, 6  # bin 0: |x| < 1e-6 (zeros too); the last: |x| >= 1e6


def hist_bounds() -> torch.Tensor:
    """The inner bounds of the |x| histogram (HIST_BINS - 1 of them, log-spaced, float64 on the
    CPU): bin k holds bounds[k-1] <= |x| < bounds[k]."""
    return torch.logspace(HIST_LOW, HIST_HIGH, HIST_BINS - 1, dtype=torch.float64)


_BOUNDS: dict[torch.device, torch.Tensor] = {}  # hist_bounds() on each device it was used on


def _bounds_on(device: torch.device) -> torch.Tensor:
    if device not in _BOUNDS:  # from pinned memory: the copy queued, the host not waiting
        _BOUNDS[device] = hist_bounds().pin_memory().to(device, non_blocking=True)
    return _BOUNDS[device]


def largest(
    absv: torch.Tensor, k: int, *, exact32: bool, host: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of `absv` (1-D, none negative or NaN) and their indices, the larger first
    and equal values in the order of their indices: the same values, indices and order on every
    device (topk leaves which of equal values it keeps, and their order, to its algorithm).
    `exact32`: every value is a float32 (the tensor's own dtype has at most 32 bits). `host`:
    whether the values may be read on the host (None: unless they are on a CUDA device, where
    nothing waits on it)."""
    if not k:
        return absv[:0], absv.new_zeros(0, dtype=torch.int64)
    if not absv.is_cuda if host is None else host:
        # the host may look: topk, then the ties at its k-th value put in order
        vals, idx = absv.topk(k)
        at = vals == vals[-1]
        kept = int(at.sum())
        equal = absv == vals[-1]
        if int(equal.sum()) > kept:  # more equal to the k-th than kept: the first of them
            idx = torch.cat([idx[~at], equal.nonzero().reshape(-1)[:kept]])
    else:  # a bounded piece at a time: each piece's k largest, then the k among them
        found = [
            start + _largest_in(absv[start : start + LARGEST_PIECE], k, exact32)
            for start in range(0, absv.numel(), LARGEST_PIECE)
        ]
        idx = found[0] if len(found) == 1 else torch.cat(found)
    # the index order, then the values' (stable: equal stay so); the k first (of the pieces')
    idx = idx.sort().values
    idx = idx.gather(0, absv.gather(0, idx).sort(descending=True, stable=True).indices[:k])
    return absv.gather(0, idx), idx


LARGEST_PIECE = 1 << 22  # values `largest` reads at a time on a device (its working copies')


def _largest_in(piece: torch.Tensor, k: int, exact32: bool) -> torch.Tensor:
    """The indices of a piece's k largest values (or all of them), equal ones by index, with
    no wait on the device: float32 values by one int64 key each — the value's bits (ordered as
    integers, none negative) above the complement of its index — others by a stable sort."""
    k = min(k, piece.numel())
    if not exact32:
        return torch.sort(piece, descending=True, stable=True).indices[:k]
    top = 2**32 - 1
    key = piece.float().view(torch.int32).to(torch.int64) << 32
    key |= torch.arange(top, top - piece.numel(), -1, device=piece.device)
    return top - (key.topk(k).values & top)


def _head(c: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """A packed vector's head for C channels (PER_CHANNEL * C + 2 float64 values, unfilled), and
    its per-channel block viewed as (PER_CHANNEL, C)."""
    vec = np.empty(PER_CHANNEL * c + 2)
    return vec, vec[: PER_CHANNEL * c].reshape(PER_CHANNEL, c)


def _packed(
    vec: np.ndarray[Any, Any], n: int, kurt: float, flat: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """The packed vector (`measure_channels`) of a tensor of n values per channel, none masked
    or non-finite. `vec`: PER_CHANNEL * C + 2 float64 values whose rows MEAN, M2, MIN, MAX,
    ZEROS and LARGE_N are filled; `flat()`: the tensor as (n, C), read for the median |x| and
    the largest values only where some |x| exceeds MASSIVE_ABS (else no activation can be
    massive, and the median is left out: null)."""
    c = (vec.size - 2) // PER_CHANNEL
    block = vec[: PER_CHANNEL * c].reshape(PER_CHANNEL, c)  # _head's view
    block[COUNT] = n
    block[MASKED] = 0
    vec[-2:] = kurt, math.nan
    if max(-block[MIN].min(), block[MAX].max()) > MASSIVE_ABS:
        values = flat()
        absx = values.abs().reshape(-1)
        vec[-1] = float(absx.median())
        exact32 = values.element_size() <= 4
        top_abs, top_idx = largest(absx, min(TOP, absx.numel()), exact32=exact32)
        signed = values.reshape(-1).gather(0, top_idx)
        top = torch.stack([signed.double(), top_idx.double(), top_abs.double()])
        vec = np.concatenate([vec, top.reshape(-1).numpy()])
    return torch.from_numpy(vec)


def _every_value_counts(flat: torch.Tensor, acc: torch.dtype) -> torch.Tensor | None:
    """`measure_channels` for a CPU tensor (values, C) none of whose values is masked or
    non-finite — the common case without the kernels, told from each channel's min and max in
    one pass: the same numbers in about half the passes of the general path, with one float64
    copy. None: some value is masked or not finite (the general path)."""
    lo, hi = torch.aminmax(flat, dim=0)
    lowest = torch.finfo(flat.dtype).min
    if not (bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all())):
        return None
    if bool((lo == lowest).any()):
        return None
    n, c = flat.shape
    vec, block = _head(c)
    v = flat.to(acc, copy=True)  # ours to change in place below (a float64 x is the caller's)
    var, mean = torch.var_mean(v, dim=0, correction=0)
    block[MEAN] = mean.numpy()
    block[M2] = (var * n).numpy()
    block[MIN] = lo.to(acc).numpy()
    block[MAX] = hi.to(acc).numpy()
    block[ZEROS] = (flat == 0).sum(0).numpy()
    block[LARGE_N] = (flat.abs() >= LARGE).sum(0).numpy()
    v -= mean.mean()  # the copy is ours: deviations from the tensor's mean, in place
    sq = v.square_()
    g_m2 = float(sq.sum())
    kurt = float(sq.square_().sum()) * (n * c) / (g_m2 * g_m2) if g_m2 > 0 else math.nan
    return _packed(vec, n, kurt, lambda: flat)


def _by_kernels(x: torch.Tensor, axis: int, chan: Any) -> torch.Tensor | None:
    """`measure_channels` of a CPU float tensor by the numba kernels (`chan`: the
    _chankernels module): two reads of x, in place where its channel dimension is the last in
    memory or x is contiguous, instead of a float64 copy and about ten passes. None: some
    value is masked or not finite (the general path)."""
    lowest = float(torch.finfo(x.dtype).min)
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()  # float16 and bfloat16 widen exactly
    c = x.shape[axis]
    moved = x.movedim(axis, -1)
    a: np.ndarray[Any, Any]
    if moved.is_contiguous() or not x.is_contiguous():
        a = moved.contiguous().numpy().reshape(-1, c)
    else:  # NCHW and the like: (outer, C, inner), read in place
        a = x.numpy().reshape(math.prod(x.shape[:axis]), c, -1)
    n = a.size // c
    vec, block = _head(c)
    large = a.dtype.type(LARGE)
    parts = chan.threads() if a.size >= chan.PARALLEL_MIN else 1
    if a.ndim == 3:
        chan.first_planes(a, large, block)
    elif parts > 1:
        chan.first_rows(a, large, parts, block)
    else:
        chan.first_rows_serial(a, large, block)
    # the first pass's fast-math figures hold only where every sum is finite (no NaN or Inf)
    if not np.isfinite(block[MEAN]).all() or (block[MIN] == lowest).any():
        return None
    block[MEAN] /= n
    g = float(block[MEAN].mean())
    moments = np.empty(2)
    if a.ndim == 3:
        chan.second_planes(a, block[MEAN], g, block, moments)
    elif parts > 1:
        chan.second_rows(a, block[MEAN], g, parts, block, moments)
    else:
        chan.second_rows_serial(a, block[MEAN], g, block, moments)
    g_m2, g_m4 = moments.tolist()
    kurt = g_m4 * (n * c) / (g_m2 * g_m2) if g_m2 > 0 else math.nan
    return _packed(vec, n, kurt, lambda: moved.reshape(-1, c))


def measure_channels(
    x: torch.Tensor, axis: int, *, hist: bool = False, kernels: Any = None
) -> torch.Tensor:
    """x (already without padding) per channel along `axis`, packed in one float64 vector
    (`unpack` reads it): per channel COUNT … MASKED; the tensor's kurtosis and median |x|; its
    TOP largest |x| as signed value, flat index into x moved to (…, C), and |x|; with `hist`,
    then the counts of |x| in HIST_BINS log-spaced bins. Computed where x lives; nothing is
    read on the host. `kernels`: the _chankernels module, for a CPU tensor (None: torch ops)."""
    d = x.detach()
    if kernels is not None and d.is_cpu and d.is_floating_point() and d.numel() and not hist:
        fast = _by_kernels(d, axis, kernels)
        if fast is not None:
            return fast
    moved = d.movedim(axis, -1) if axis != d.dim() - 1 else d
    c = moved.shape[-1]
    flat = moved.reshape(-1, c)
    acc = torch.float32 if flat.device.type == "mps" else torch.float64
    if flat.is_cuda and flat.is_floating_point() and flat.numel():
        from hookcli.engine import devicerow

        lowest = float(torch.finfo(flat.dtype).min)
        rows = devicerow.channel_rows(flat, lowest, LARGE)
        counts = None
        if rows is not None and hist:
            counts = devicerow.abs_hist(flat, _bounds_on(flat.device), lowest)
        if rows is not None and (counts is not None or not hist):
            packed = from_channel_rows(flat, rows, lowest)
            return packed if counts is None else torch.cat([packed, counts.to(torch.float64)])
    if flat.is_cpu and flat.is_floating_point() and flat.numel() and not hist:
        fast = _every_value_counts(flat, acc)
        if fast is not None:
            return fast
    v = flat.to(acc)
    masked = v == -math.inf
    if flat.is_floating_point():
        masked |= flat == torch.finfo(flat.dtype).min
    valid = torch.isfinite(v) & ~masked
    count = valid.sum(0, dtype=acc)
    z = torch.where(valid, v, 0.0)
    mean = z.sum(0) / count.clamp(min=1)
    dev = torch.where(valid, v - mean, 0.0)
    m2 = (dev * dev).sum(0)
    lo = torch.where(valid, v, math.inf).amin(0)
    hi = torch.where(valid, v, -math.inf).amax(0)
    zeros = (valid & (v == 0)).sum(0, dtype=acc)
    absv = z.abs()
    large = (absv >= LARGE).sum(0, dtype=acc)
    masked_n = masked.sum(0, dtype=acc)
    # the tensor: its mean from the channels', then the fourth moment about it
    total = count.sum()
    g_mean = (mean * count).sum() / total.clamp(min=1)
    sq = torch.where(valid, v - g_mean, 0.0).square()
    g_m2 = sq.sum()
    kurt = (sq * sq).sum() * total / (g_m2 * g_m2)
    kurt = torch.where((total > 0) & (g_m2 > 0), kurt, math.nan)
    absf = torch.where(valid, flat.abs().to(torch.float32), math.nan).reshape(-1)
    median = absf.nanmedian().to(acc) if absf.numel() else v.new_full((), math.nan)
    # reported where an activation could be massive only, as the CPU's fast path computes it
    median = torch.where(absv.amax() > MASSIVE_ABS, median, math.nan) if absv.numel() else median
    k = min(TOP, absv.numel())
    exact32 = flat.is_floating_point() and flat.element_size() <= 4
    top_abs, top_idx = largest(absv.reshape(-1), k, exact32=exact32)
    signed = z.reshape(-1).gather(0, top_idx)
    parts = [
        torch.stack([count, mean, m2, lo, hi, zeros, large, masked_n]).reshape(-1),
        torch.stack([kurt, median]),
        torch.stack([signed, top_idx.to(acc), top_abs]).reshape(-1),
    ]
    if hist:  # index_add_, not bincount: bincount reads its input's range back to the host
        bounds = hist_bounds().to(v.device, acc)
        idx = torch.bucketize(absv.reshape(-1), bounds, right=True)
        counts = torch.zeros(HIST_BINS, dtype=acc, device=v.device)
        parts.append(counts.index_add_(0, idx, valid.reshape(-1).to(acc)))
    return torch.cat(parts)


def from_channel_rows(flat: torch.Tensor, rows: torch.Tensor, lowest: float) -> torch.Tensor:
    """`measure_channels`' packed vector of `flat` (N, C) from the fused kernels' per-channel
    rows (engine/_triton.channel_rows); the median |x| and the largest values read from
    `flat` in its own dtype (no float64 copy of it), as the torch path reads them."""
    count, mean, m2, lo, hi, zeros, large, masked_n, q2, q4 = rows.unbind(0)
    total = count.sum()
    g_m2 = q2.sum()
    kurt = q4.sum() * total / (g_m2 * g_m2)
    kurt = torch.where((total > 0) & (g_m2 > 0), kurt, math.nan)
    valid = torch.isfinite(flat) & (flat != lowest)
    absx = flat.abs()
    absv = torch.where(valid, absx, 0)
    absf = torch.where(valid, absx.float(), math.nan).reshape(-1)
    median = absf.nanmedian().double()
    median = torch.where(absv.amax() > MASSIVE_ABS, median, math.nan)
    top_abs, top_idx = largest(
        absv.reshape(-1), min(TOP, absv.numel()), exact32=flat.element_size() <= 4
    )
    signed = torch.where(valid, flat, 0).reshape(-1).gather(0, top_idx)
    return torch.cat([
        torch.stack([count, mean, m2, lo, hi, zeros, large, masked_n]).reshape(-1),
        torch.stack([kurt, median]),
        torch.stack([signed.double(), top_idx.double(), top_abs.double()]).reshape(-1),
    ])  # fmt: skip


def unpack(
    packed: torch.Tensor, axis: int, c: int, *, hist: bool = False
) -> tuple[ChannelStats, list[tuple[float, int, float]]]:
    """The ChannelStats of `measure_channels`' vector (float64, on the CPU), and the tensor's
    largest |x| as (signed value, flat index into the tensor moved to (…, C), |x|). The
    arithmetic is done on the vector (numpy: these are small arrays, where torch's per-op
    cost dominates); each list is made once."""
    vec = packed.numpy()
    rows = vec[: PER_CHANNEL * c].reshape(PER_CHANNEL, c)
    kurt, median = vec[PER_CHANNEL * c : PER_CHANNEL * c + 2].tolist()
    end = vec.size - (HIST_BINS if hist else 0)
    rest = vec[PER_CHANNEL * c + 2 : end].reshape(3, -1).tolist()
    top = [(s, int(i), a) for s, i, a in zip(*rest, strict=True) if a > 0]
    count = rows[COUNT]
    has = count > 0
    lo, hi = rows[MIN], rows[MAX]
    with np.errstate(invalid="ignore"):  # NaN where a channel has no value: listed as None
        std = np.sqrt(np.maximum(rows[M2] / np.maximum(count, 1), 0))
        absmax = np.maximum(np.abs(lo), np.abs(hi))
    stats = ChannelStats(
        axis=axis,
        count=count.astype(np.int64).tolist(),
        mean=_listed(rows[MEAN], has),
        std=_listed(std, has),
        min=_listed(lo, has),
        max=_listed(hi, has),
        absmax=_listed(absmax, has & np.isfinite(lo) & np.isfinite(hi)),
        zeros=rows[ZEROS].astype(np.int64).tolist(),
        large=rows[LARGE_N].astype(np.int64).tolist(),
        masked=int(rows[MASKED].sum()),
        kurtosis=kurt if math.isfinite(kurt) else None,
        median_abs=median if math.isfinite(median) else None,
        abs_hist=vec[end:].astype(np.int64).tolist() if hist else None,
    )
    return stats, top


def _listed(values: np.ndarray[Any, Any], has: np.ndarray[Any, Any]) -> list[float | None]:
    """values as floats, None where `has` is False or the value is not finite."""
    ok = has & np.isfinite(values)
    out: list[float | None] = values.tolist()
    if not ok.all():
        out = [v if k else None for v, k in zip(out, ok.tolist(), strict=True)]
    return out


def find_massive(
    stats: ChannelStats,
    top: Sequence[tuple[float, int, float]],
    shape: Sequence[int],
    rows_at: RowMap,
) -> list[Massive]:
    """The massive activations among a tensor's largest |x| (`top`, from `unpack`): above
    MASSIVE_ABS and MASSIVE_RATIO x its median |x|. `rows_at` maps a row of the tensor moved
    to (…, C) back to its index in the tensor's own dimensions (padding taken out before: the
    real positions)."""
    median = stats.median_abs
    out: list[Massive] = []
    c = len(stats.count)
    for value, flat, a in top:
        if a <= MASSIVE_ABS or median is None or a <= MASSIVE_RATIO * median:
            continue
        row, channel = divmod(flat, c)
        index = rows_at(row, channel)
        out.append(
            Massive(
                channel=channel,
                index=index,
                value=value,
                ratio=a / median if median > 0 else None,
                position=index[1] if len(shape) == 3 else None,
                sequence=index[0] if len(shape) == 3 else None,
            )
        )
    return out


class RowMap:
    """Where a row of a tensor moved to (…, C) sits in the tensor: its index, channel placed
    back at `axis`; `real` the real positions of a padded batch (flattened batch x tokens);
    `flat`: the tensor's first dimension is those flattened positions (batch·tokens, C)."""

    def __init__(
        self, shape: Sequence[int], axis: int, real: Sequence[int] | None, *, flat: bool = False
    ) -> None:
        self.shape = tuple(shape)
        self.axis = axis
        self.real = real
        self.flat = flat
        self.others = [s for i, s in enumerate(shape) if i != axis]

    def __call__(self, row: int, channel: int) -> list[int]:
        others = self.others
        if self.real is not None and self.flat:  # (real rows, rest…): the row, then the rest
            rest = math.prod(others[1:])
            pos, within = divmod(row, rest) if rest else (row, 0)
            idx = [self.real[pos], *_unravel(within, others[1:])]
        elif self.real is not None:  # (real positions, rest…): the position, then the rest
            rest = math.prod(others[2:])
            pos, within = divmod(row, rest) if rest else (row, 0)
            b, t = divmod(self.real[pos], others[1])
            idx = [b, t, *_unravel(within, others[2:])]
        else:
            idx = _unravel(row, others)
        idx.insert(self.axis, channel)
        return idx


def _unravel(i: int, dims: Sequence[int]) -> list[int]:
    out = []
    for d in reversed(dims):
        i, r = divmod(i, d) if d else (i, 0)
        out.append(r)
    return out[::-1]


@dataclass(slots=True)
class ChannelRow:
    """--channels: one measured tensor's packed numbers (a tensor until `resolve` brings them
    over), its channel dimension, shape, channel count, and whether padding was taken out."""

    packed: torch.Tensor  # on its device until resolve brings it over (float64, CPU)
    axis: int
    shape: tuple[int, ...]
    channels: int
    padded: int  # 0, TOKENS or FLAT: how the padding was taken out


def resolve(
    chan: dict[int, ChannelRow],
    wants: Sequence[tuple[Any, int]],
    hist: bool,
    real_index: torch.Tensor | None,
    token_mask: torch.Tensor | None,
) -> None:
    """Every packed vector of `chan` to the host (one transfer per device), unpacked into the
    `.channels` of each TensorStats in `wants` (with its row's place), its massive activations
    located (in each text's own positions where padding was taken out)."""
    brought = (
        (idx, row.packed)
        for idx, row in chan.items()
        if not row.packed.is_cpu or row.packed.dtype != torch.float64
    )
    for idxs in by_device(brought).values():
        parts = [chan[i].packed for i in idxs]
        joined = torch.cat(parts).to("cpu", torch.float64)
        at = 0
        for i, part in zip(idxs, parts, strict=True):
            chan[i].packed = joined[at : at + part.numel()]
            at += part.numel()
    real = own = None
    if any(chan[i].padded for _, i in wants):
        assert real_index is not None
        assert token_mask is not None
        real = real_index.tolist()
        # each column's position in its own text (a left-padded sequence starts at 0)
        own = (token_mask.cpu().long().cumsum(1) - 1).tolist()
    for stats, idx in wants:
        row = chan[idx]
        found, top = unpack(row.packed, row.axis, row.channels, hist=hist)
        rows_at = RowMap(row.shape, row.axis, real if row.padded else None, flat=row.padded == FLAT)
        found.massive = find_massive(found, top, row.shape, rows_at)
        if own is not None and row.padded:
            own_positions(found.massive, own, row.padded == FLAT)
        stats.channels = found
