"""The fused one-pass statistics kernel (numba; compiled once, cached on disk).

One read of the data yields sum, sum of squares, zero count, min and max. Three details make
LLVM vectorise it (measured: 27 GB/s on one core, ~50 GB/s on two, like torch.sum alone):

* fast-math reassociation, so sums can be split across SIMD lanes. `nnan`/`ninf` let min/max
  vectorise; the caller trusts the results only when the sum is finite, i.e. when the data
  holds no NaN/Inf, which is exactly when those flags are true statements;
* `llvm.minnum`/`llvm.maxnum` intrinsics, which the loop vectoriser knows as reductions
  (numba's own min/max lower to compare-and-branch code that it does not);
* a 2-D (blocks x BLOCK) view iterated with `range(BLOCK)`, so indices are provably
  non-negative: numba's negative-index wrap-around otherwise turns every load into a gather.

Sums and sums of squares accumulate in float64 (each element widened as it is read; the zero
count stays in the input precision, exact while BLOCK < 2**24), so the kernel's figures agree
with the torch-ops paths in stats.py to rounding (~1e-15), not to float32's ~1e-7, whichever
path measured a tensor; and squares of tiny float32 values neither underflow nor go subnormal.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload
from numba.np.numpy_support import carray

BLOCK = 4096
FASTMATH = {"reassoc", "nnan", "ninf", "nsz", "contract"}


def _binary_intrinsic(name: str, flags: tuple[str, ...] = ()) -> Any:
    @intrinsic
    def call(typingctx: Any, a: Any, b: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ty = args[0].type
            fn = builder.module.declare_intrinsic(name, [ty], ir.FunctionType(ty, [ty, ty]))
            return builder.call(fn, args, fastmath=flags)

        return a(a, b), codegen

    return call


fmin = _binary_intrinsic("llvm.minnum")
fmax = _binary_intrinsic("llvm.maxnum")
# For arguments that are never NaN (the careful kernel replaces non-finite values first):
# the flags let min/max vectorise as reductions without assuming anything false.
_fmin_nonan = _binary_intrinsic("llvm.minnum", ("nnan", "nsz"))
_fmax_nonan = _binary_intrinsic("llvm.maxnum", ("nnan", "nsz"))


@njit(fastmath=FASTMATH, nogil=True, cache=True, inline="always")
def _block(r: Any) -> Any:
    s = 0.0
    q = 0.0
    z = np.float32(0)
    mn = r[0]
    mx = r[0]
    for j in range(r.shape[0]):
        v = r[j]
        w = np.float64(v)
        s += w
        q += w * w
        z += np.float32(1.0) if v == 0 else np.float32(0.0)
        mn = fmin(mn, v)
        mx = fmax(mx, v)
    return s, q, z, mn, mx


@njit(fastmath=FASTMATH, nogil=True, cache=True, inline="always")
def _fused(a: Any, out: Any) -> None:
    n = a.shape[0]
    nb = n // BLOCK
    blocks = a[: nb * BLOCK].reshape(nb, BLOCK)
    s = 0.0
    q = 0.0
    z = 0.0
    mn = np.inf
    mx = -np.inf
    for b in prange(nb):  # a plain range where the caller is not parallel
        bs, bq, bz, bmn, bmx = _block(blocks[b])
        s += np.float64(bs)
        q += np.float64(bq)
        z += np.float64(bz)
        mn = min(mn, np.float64(bmn))
        mx = max(mx, np.float64(bmx))
    if nb * BLOCK < n:
        bs, bq, bz, bmn, bmx = _block(a[nb * BLOCK :])
        s += np.float64(bs)
        q += np.float64(bq)
        z += np.float64(bz)
        mn = min(mn, np.float64(bmn))
        mx = max(mx, np.float64(bmx))
    out[0] = s
    out[1] = q
    out[2] = z
    out[3] = mn
    out[4] = mx


@njit(fastmath=FASTMATH, nogil=True, cache=True)
def fused_serial(a: Any, out: Any) -> None:
    """out[:] = sum, sum of squares, zero count, min, max of the 1-D array a (len(a) > 0)."""
    _fused(a, out)


@njit(fastmath=FASTMATH, nogil=True, cache=True, parallel=True)
def fused_parallel(a: Any, out: Any) -> None:
    """As fused_serial, with blocks spread over numba's threads."""
    _fused(a, out)


def _pointer_intrinsic(element: Any) -> Any:
    @intrinsic
    def at(typingctx: Any, address: Any) -> Any:
        sig = types.CPointer(element)(address)  # type: ignore[no-untyped-call]

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return at


_float32_at = _pointer_intrinsic(types.float32)  # the float32 pointer an integer address is


@njit(fastmath=FASTMATH, nogil=True, cache=True)
def fused_at(addresses: Any, sizes: Any, out: Any, small: int, values: Any) -> None:
    """out[k, :5] = fused_serial's five sums of the sizes[k] float32 values at addresses[k],
    for every k: many small tensors (a model's parameters, the copies held for after a pass)
    in one call, each read where it lies, with no joined copy of them all (issue 52). Each
    address must be a live, contiguous float32 CPU tensor's data of sizes[k] > 0 elements,
    held by the caller through the call. The elements of each tensor of at most `small` are
    written, widened, one tensor after another into `values`."""
    at = 0
    for k in range(addresses.shape[0]):
        a = carray(_float32_at(addresses[k]), (sizes[k],))
        _fused(a, out[k])
        if sizes[k] <= small:
            for j in range(sizes[k]):
                values[at + j] = a[j]
            at += sizes[k]


# The careful kernel: for data holding NaN/Inf, or whose variance needs a second, centred
# pass. No nnan/ninf flags here, so comparisons keep their IEEE meaning; non-finite values
# are replaced by neutral ones with selects, which still vectorise. Accumulates in float64.
_CAREFUL = {"reassoc", "nsz", "contract"}


@njit(fastmath=_CAREFUL, nogil=True, cache=True, inline="always")
def _careful_block(r: Any, shift: float) -> Any:
    s = 0.0
    q = 0.0
    z = 0.0
    nan = 0.0
    fin = 0.0
    mn = np.inf
    mx = -np.inf
    for j in range(r.shape[0]):
        v = np.float64(r[j])
        finite = (v - v) == 0.0  # False for NaN and ±Inf
        d = (v - shift) if finite else 0.0
        s += d
        q += d * d
        mn = _fmin_nonan(mn, v if finite else np.inf)
        mx = _fmax_nonan(mx, v if finite else -np.inf)
        # Counting finite values (not non-finite ones) is the form LLVM vectorises.
        fin += 1.0 if finite else 0.0
        z += 1.0 if v == 0.0 else 0.0
        nan += 1.0 if v != v else 0.0  # noqa: PLR0124 (the NaN test)
    return s, q, z, nan, fin, mn, mx


@njit(fastmath=_CAREFUL, nogil=True, cache=True, inline="always")
def _careful(a: Any, shift: float, out: Any) -> None:
    n = a.shape[0]
    nb = n // BLOCK
    blocks = a[: nb * BLOCK].reshape(nb, BLOCK)
    s = 0.0
    q = 0.0
    z = 0.0
    nan = 0.0
    fin = 0.0
    mn = np.inf
    mx = -np.inf
    for b in prange(nb):  # a plain range where the caller is not parallel
        bs, bq, bz, bnan, bfin, bmn, bmx = _careful_block(blocks[b], shift)
        s += bs
        q += bq
        z += bz
        nan += bnan
        fin += bfin
        mn = min(mn, bmn)
        mx = max(mx, bmx)
    if nb * BLOCK < n:
        bs, bq, bz, bnan, bfin, bmn, bmx = _careful_block(a[nb * BLOCK :], shift)
        s += bs
        q += bq
        z += bz
        nan += bnan
        fin += bfin
        mn = min(mn, bmn)
        mx = max(mx, bmx)
    out[0] = s
    out[1] = q
    out[2] = z
    out[3] = mn
    out[4] = mx
    out[5] = nan
    out[6] = n - fin - nan  # Inf count


@njit(fastmath=_CAREFUL, nogil=True, cache=True)
def careful_serial(a: Any, shift: float, out: Any) -> None:
    """out[:7] = Σ(v-shift), Σ(v-shift)², zeros, min, max (finite v only), NaN count, Inf count."""
    _careful(a, shift, out)


@njit(fastmath=_CAREFUL, nogil=True, cache=True, parallel=True)
def careful_parallel(a: Any, shift: float, out: Any) -> None:
    """As careful_serial, with blocks spread over numba's threads."""
    _careful(a, shift, out)


@intrinsic
def _bf16_to_f32(typingctx: Any, bits: Any) -> Any:
    """A bfloat16, given as its uint16 bits, as float32: the same bits, 16 zero bits after."""
    from numba.core import types

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())

    return types.float32(bits), codegen


def _as_float(x: Any) -> Any:
    """An element as a float: uint16 elements are bfloat16 bits (compiled by the overload)."""
    raise NotImplementedError  # only called from compiled code


@overload(_as_float, inline="always")
def _as_float_impl(x: Any) -> Any:
    from numba.core import types

    def from_bits(x: Any) -> Any:  # the same signature as _as_float, as numba requires
        return _bf16_to_f32(x)  # type: ignore[call-arg]  # numba supplies typingctx

    def same(x: Any) -> Any:
        return x

    return from_bits if x == types.uint16 else same


# The difference kernel (hookcli diff): one read of both sides yields Σd², Σa², Σb², Σab and
# max|d| over the elements finite on both sides, in float64, and the count of the others.
# b may be bfloat16 given as uint16 bits (numba has no bfloat16): read as float32 in the loop.
@njit(fastmath=_CAREFUL, nogil=True, cache=True, inline="always")
def _pair(xv: Any, yv: Any) -> Any:
    """One element pair's terms: (b-a)², a², b², ab, |b-a|, and 1 when either is not finite
    (its terms then 0)."""
    x = np.float64(xv)
    y = np.float64(_as_float(yv))
    finite = ((x - x) == 0.0) and ((y - y) == 0.0)  # False for NaN and ±Inf
    xf = x if finite else 0.0
    yf = y if finite else 0.0
    d = yf - xf
    return d * d, xf * xf, yf * yf, xf * yf, abs(d), 0.0 if finite else 1.0


@njit(fastmath=_CAREFUL, nogil=True, cache=True, inline="always")
def _diff_block(a: Any, b: Any) -> Any:
    sd = 0.0
    sa = 0.0
    sb = 0.0
    sab = 0.0
    mx = 0.0
    bad = 0.0
    for j in range(a.shape[0]):
        d2, a2, b2, ab, ad, nf = _pair(a[j], b[j])
        sd += d2
        sa += a2
        sb += b2
        sab += ab
        mx = _fmax_nonan(mx, ad)
        bad += nf
    return sd, sa, sb, sab, mx, bad


@njit(fastmath=_CAREFUL, nogil=True, cache=True, inline="always")
def _diff(a: Any, b: Any, out: Any) -> None:
    n = a.shape[0]
    nb = n // BLOCK
    ablocks = a[: nb * BLOCK].reshape(nb, BLOCK)
    bblocks = b[: nb * BLOCK].reshape(nb, BLOCK)
    sd = 0.0
    sa = 0.0
    sb = 0.0
    sab = 0.0
    mx = 0.0
    bad = 0.0
    for k in prange(nb):  # a plain range where the caller is not parallel
        d1, a1, b1, ab1, m1, x1 = _diff_block(ablocks[k], bblocks[k])
        sd += d1
        sa += a1
        sb += b1
        sab += ab1
        mx = max(mx, m1)
        bad += x1
    if nb * BLOCK < n:
        d1, a1, b1, ab1, m1, x1 = _diff_block(a[nb * BLOCK :], b[nb * BLOCK :])
        sd += d1
        sa += a1
        sb += b1
        sab += ab1
        mx = max(mx, m1)
        bad += x1
    out[0] = sd
    out[1] = sa
    out[2] = sb
    out[3] = sab
    out[4] = mx
    out[5] = bad


@njit(fastmath=_CAREFUL, nogil=True, cache=True)
def diff_serial(a: Any, b: Any, out: Any) -> None:
    """out[:6] = Σ(b-a)², Σa², Σb², Σab, max|b-a| (elements finite on both sides), and the
    number of elements not finite on one side or both. a and b: 1-D, the same length."""
    _diff(a, b, out)


@njit(fastmath=_CAREFUL, nogil=True, cache=True, parallel=True)
def diff_parallel(a: Any, b: Any, out: Any) -> None:
    """As diff_serial, with blocks spread over numba's threads."""
    _diff(a, b, out)


@njit(fastmath=_CAREFUL, nogil=True, cache=True, parallel=True)
def diff_nhwc(a: Any, b: Any, out: Any) -> None:
    """As diff_parallel, for a compared tensor laid out channels-last: a is the reference,
    (N, C, H, W) contiguous; b the same logical elements as (N, H, W, C), contiguous (the
    channels-last tensor in its own memory order), so neither is copied whole into the
    other's layout. Each (image, row) transposes a's (C, W) slab into a scratch (W, C) slab,
    which stays in cache, then pairs it with b's slab in one vectorised loop."""
    n, c, h, w = a.shape
    rows = n * h
    part = np.zeros((rows, 6))
    for r in prange(rows):
        i = r // h
        y0 = r % h
        slab = np.empty(w * c, dtype=a.dtype)
        for k in range(c):  # a's row k streams; the scratch slab's writes stay in cache
            for x0 in range(w):
                slab[x0 * c + k] = a[i, k, y0, x0]
        sd, sa, sb, sab, mx, bad = _diff_block(slab, b[i, y0].reshape(-1))
        part[r, 0] = sd
        part[r, 1] = sa
        part[r, 2] = sb
        part[r, 3] = sab
        part[r, 4] = mx
        part[r, 5] = bad
    for j in range(6):
        out[j] = part[:, j].max() if j == 4 else part[:, j].sum()
