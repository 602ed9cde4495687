"""The fused statistics kernel on CUDA (Triton): one read of a tensor, in its own dtype.

Every whole-tensor statistic of a row (engine/statrow.py) — count of finite elements, mean,
population variance, min, max, zeros, NaN, Inf, norm — from one read of the data, instead of
the dozen torch ops of cpurow.torch_row (each a launch, each a read of the tensor):

1. `_blocks`: each program reads BLOCK elements, widens them to float64 in registers and
   writes its block's nine numbers: finite count, sum, the sum of squares centred on the
   block's own mean (so no cancellation however large the mean), sum of squares, min, max,
   zeros, NaN, Inf. A tensor of at most BLOCK elements is finished by this one program.
2. `_merge`: one program walks the blocks in order, a chunk at a time, and combines them
   (Chan's pairwise update: M2 = Σ M2_b + Σ n_b (mean_b - mean)²) into the row.
   `_merge_many` does the same for many tensors in one launch, one program each: a `Pool`
   holds a pass's blocks and merges them after it (one launch per tensor during the pass).

`_diff_blocks` and `_diff_merge` (diff on CUDA): the sums of a compared tensor against the
reference's, each read once, likewise in blocks merged in order.

`_tokens` (--per-token): each program reads one position's C channels, twice (the second
time centred on the first's mean, from cache), and writes its five numbers — norm, mean,
population std, max |x| and the first channel holding it (NaN and its channel where the
position holds one, as torch's max does) — one launch for the whole tensor.

No atomics and a fixed order everywhere: the figures are bitwise the same run to run. Sums
accumulate in float64, as on every other path, so the row agrees with float64 torch to
rounding. Triton's interpreter (TRITON_INTERPRET=1, set before this module is imported) runs
the same kernels on CPU tensors: the tests check them on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hookcli.engine._launch import Fast

BLOCK = 4096  # elements a program of _blocks reads
CHUNK = 1024  # blocks _merge combines at a time
_PART = 9  # numbers a block writes (see _blocks)
_ROW = 9  # count, mean, var, min, max, zeros, nan, inf, norm


@triton.jit
def _blocks(  # noqa: PLR0917 (Triton: positional arguments)
    x_ptr, part_ptr, row_ptr, n, FINAL: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    v = tl.load(x_ptr + offs, mask=inside, other=0).to(tl.float64)
    count, s, m2, q, mn, mx, zeros, n_nan, n_inf = _block_sums(v, inside)
    if FINAL:  # the whole tensor was this block: its row
        _store_row(row_ptr, count, s / count, m2 / count, mn, mx, zeros, n_nan, n_inf, q)
    else:
        _store_nine(part_ptr + pid.to(tl.int64) * 9, count, s, m2, q, mn, mx, zeros, n_nan, n_inf)


@triton.jit
def _blocks_at(x_ptr, table_ptr, part_ptr, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    # program p: a block of one of many 16-byte-aligned tensors of x's dtype on x's device, the
    # elements table[2p] … table[2p] + table[2p + 1] - 1 counted from x_ptr; its nine numbers
    # as _blocks writes them for that block of that tensor, bitwise: the same lanes, and (the
    # offset said to be a multiple of ALIGN elements, 16 bytes) the same layout of them over
    # the threads as _blocks gets for an aligned tensor, so the same order of the sums
    pid = tl.program_id(0).to(tl.int64)
    start = tl.multiple_of(tl.load(table_ptr + 2 * pid), ALIGN)
    n = tl.load(table_ptr + 2 * pid + 1)
    offs = tl.arange(0, BLOCK)
    inside = offs < n
    v = tl.load(x_ptr + start + offs, mask=inside, other=0).to(tl.float64)
    count, s, m2, q, mn, mx, zeros, n_nan, n_inf = _block_sums(v, inside)
    _store_nine(part_ptr + pid * 9, count, s, m2, q, mn, mx, zeros, n_nan, n_inf)


@triton.jit
def _block_sums(v, inside):
    # a block's nine numbers: finite count, sum, M2 about the block's own mean, sum of
    # squares, min, max, zeros, NaN, Inf (v: its elements in float64, `inside` where real)
    nan = inside & (v != v)  # noqa: PLR0124 (NaN is the value unequal to itself)
    inf = inside & ((v == float("inf")) | (v == -float("inf")))
    finite = inside & ~nan & ~inf
    w = tl.where(finite, v, 0.0)
    count = tl.sum(finite.to(tl.float64), axis=0)
    s = tl.sum(w, axis=0)
    mean = s / tl.maximum(count, 1.0)
    d = tl.where(finite, v - mean, 0.0)
    m2 = tl.sum(d * d, axis=0)
    q = tl.sum(w * w, axis=0)
    mn = tl.min(tl.where(finite, v, float("inf")), axis=0)
    mx = tl.max(tl.where(finite, v, -float("inf")), axis=0)
    zeros = tl.sum((inside & (v == 0.0)).to(tl.float64), axis=0)
    n_nan = tl.sum(nan.to(tl.float64), axis=0)
    n_inf = tl.sum(inf.to(tl.float64), axis=0)
    return count, s, m2, q, mn, mx, zeros, n_nan, n_inf


@triton.jit
def _store_nine(base, v0, v1, v2, v3, v4, v5, v6, v7, v8):  # noqa: PLR0917 (Triton: positional)
    # nine numbers at base, in order (a block's numbers, diff's sums)
    tl.store(base + 0, v0)
    tl.store(base + 1, v1)
    tl.store(base + 2, v2)
    tl.store(base + 3, v3)
    tl.store(base + 4, v4)
    tl.store(base + 5, v5)
    tl.store(base + 6, v6)
    tl.store(base + 7, v7)
    tl.store(base + 8, v8)


@triton.jit
def _store_row(  # noqa: PLR0917 (Triton: positional arguments)
    row_ptr, count, mean, var, mn, mx, zeros, n_nan, n_inf, q
):
    # a constant, exactly: its value the mean, variance 0, norm |value|·√count (the sums
    # carry rounding); no finite element: the sums' 0/0 stays NaN (the row's count says so)
    constant = mn == mx
    tl.store(row_ptr + 0, count)
    tl.store(row_ptr + 1, tl.where(constant, mn, mean))
    tl.store(row_ptr + 2, tl.where(constant, 0.0, tl.maximum(var, 0.0)))
    tl.store(row_ptr + 3, mn)
    tl.store(row_ptr + 4, mx)
    tl.store(row_ptr + 5, zeros)
    tl.store(row_ptr + 6, n_nan)
    tl.store(row_ptr + 7, n_inf)
    tl.store(row_ptr + 8, tl.where(constant, tl.abs(mn) * tl.sqrt(count), tl.sqrt(q)))


@triton.jit
def _merged(part_ptr, row_ptr, blocks, CHUNK: tl.constexpr):
    count = tl.zeros((), tl.float64)
    s = tl.zeros((), tl.float64)
    q = tl.zeros((), tl.float64)
    zeros = tl.zeros((), tl.float64)
    n_nan = tl.zeros((), tl.float64)
    n_inf = tl.zeros((), tl.float64)
    mn = tl.full((), float("inf"), tl.float64)
    mx = tl.full((), -float("inf"), tl.float64)
    for start in range(0, blocks, CHUNK):  # in order: the same sums every run
        b = start + tl.arange(0, CHUNK)
        base = part_ptr + b.to(tl.int64) * 9
        there = b < blocks
        count += tl.sum(tl.load(base + 0, mask=there, other=0.0), axis=0)
        s += tl.sum(tl.load(base + 1, mask=there, other=0.0), axis=0)
        q += tl.sum(tl.load(base + 3, mask=there, other=0.0), axis=0)
        mn = tl.minimum(mn, tl.min(tl.load(base + 4, mask=there, other=float("inf")), axis=0))
        mx = tl.maximum(mx, tl.max(tl.load(base + 5, mask=there, other=-float("inf")), axis=0))
        zeros += tl.sum(tl.load(base + 6, mask=there, other=0.0), axis=0)
        n_nan += tl.sum(tl.load(base + 7, mask=there, other=0.0), axis=0)
        n_inf += tl.sum(tl.load(base + 8, mask=there, other=0.0), axis=0)
    mean = s / count
    m2 = tl.zeros((), tl.float64)
    for start in range(0, blocks, CHUNK):  # Chan: each block's M2 moved to the whole's mean
        b = start + tl.arange(0, CHUNK)
        base = part_ptr + b.to(tl.int64) * 9
        there = b < blocks
        n_b = tl.load(base + 0, mask=there, other=0.0)
        s_b = tl.load(base + 1, mask=there, other=0.0)
        m2_b = tl.load(base + 2, mask=there, other=0.0)
        gap = tl.where(n_b > 0, s_b / tl.maximum(n_b, 1.0) - mean, 0.0)
        # (a mean the sums overflowed: each block's own M2, inf as one block's would be)
        gap = tl.where(tl.abs(mean) < float("inf"), gap, 0.0)
        m2 += tl.sum(m2_b + n_b * gap * gap, axis=0)
    _store_row(row_ptr, count, mean, m2 / count, mn, mx, zeros, n_nan, n_inf, q)


@triton.jit
def _merge(part_ptr, row_ptr, blocks, CHUNK: tl.constexpr):
    _merged(part_ptr, row_ptr, blocks, CHUNK)


@triton.jit
def _merge_many(part_ptr, table_ptr, row_ptr, CHUNK: tl.constexpr):
    # program j: the j-th tensor's blocks, from table (start, blocks) pairs, into row j
    j = tl.program_id(0).to(tl.int64)
    start = tl.load(table_ptr + 2 * j)
    blocks = tl.load(table_ptr + 2 * j + 1)
    _merged(part_ptr + start * 9, row_ptr + j * 9, blocks, CHUNK)


def _cdiv(n: int, d: int) -> int:
    """⌈n / d⌉ on the host (triton.cdiv is a jit function: microseconds a call from Python)."""
    return -(-n // d)


# launched by Fast (engine/_launch.py): without Triton's binding on every call
_BLOCKS, _BLOCKS_AT, _MERGE = Fast(_blocks), Fast(_blocks_at), Fast(_merge)


def row(x: torch.Tensor, *, block: int = BLOCK, chunk: int = CHUNK) -> torch.Tensor:
    """The row of x (non-empty, floating point, contiguous) as 9 float64 numbers on x's
    device: one launch for a tensor of at most `block` elements, two for any other. (The
    sizes, powers of two, are for the tests: small ones walk many chunks of few elements.)"""
    flat = x.reshape(-1)
    n = flat.numel()
    out = torch.empty(_ROW, dtype=torch.float64, device=x.device)
    blocks = _cdiv(n, block)
    if blocks == 1:
        _BLOCKS.run((1,), flat, out, out, n, FINAL=True, BLOCK=block)
        return out
    parts = torch.empty(blocks * _PART, dtype=torch.float64, device=x.device)
    _BLOCKS.run((blocks,), flat, parts, out, n, FINAL=False, BLOCK=block)
    _MERGE.run((1,), parts, out, blocks, CHUNK=chunk)
    return out


POOL_BLOCKS = 1 << 15  # blocks a pool's buffer holds at least (2.25 MiB: 2^27 elements' numbers)
POOL_GROWTH = 4  # a pass that fills buffers gets ones twice as large, up to 2^4 times this


class Pool:
    """Rows started during a pass and finished after it, on one device: each tensor's blocks
    written by one launch of `_blocks` into the pool's buffer, after the last tensor's; a full
    buffer's tensors are merged (`_merge_many`, one launch for them all, each in its own
    order) and a buffer twice as large takes the next (up to POOL_GROWTH doublings: a pass
    over large activations merges a few times, not once per few megabytes), and `rows()`
    merges what is left. One launch per tensor in the pass instead of two, the same numbers
    bitwise (a tensor of one block merges to the row `_blocks` would write for it), and memory
    for one buffer (36 MiB at most) and the rows."""

    def __init__(self, *, chunk: int = CHUNK) -> None:
        self._chunk = chunk  # (blocks merged at a time: the sums' order, for the tests)
        self._buffer: torch.Tensor | None = None
        self._table: list[int] = []  # the buffer's tensors: (start, blocks), …
        self._free = 0  # blocks left in the buffer
        self._done: list[torch.Tensor] = []  # rows of the buffers merged so far
        self.size = 0  # tensors added

    def add(self, flat: torch.Tensor, *, block: int = BLOCK) -> int:
        """Start the row of `flat` (1-D, non-empty, floating point, contiguous): its place
        among the rows `rows()` returns."""
        n = flat.numel()
        blocks = _cdiv(n, block)
        self._room(blocks, flat.device)
        start, part = self._next_part()
        _BLOCKS.run((blocks,), flat, part, part, n, FINAL=False, BLOCK=block)
        self._table += (start, blocks)
        self._free -= blocks
        self.size += 1
        return self.size - 1

    def add_many(self, flats: Sequence[torch.Tensor], *, block: int = BLOCK) -> list[int]:
        """Start the rows of many tensors, each as `add` takes it, all of one dtype on the
        pool's device with 16-byte-aligned addresses: one launch (`_blocks_at`) for as many as
        the buffer holds, the same numbers bitwise as `add` one at a time; their places, in
        order."""
        places: list[int] = []
        blocks = [_cdiv(f.numel(), block) for f in flats]
        i = 0
        while i < len(flats):
            self._room(blocks[i], flats[i].device)
            j, free = i, self._free
            while j < len(flats) and blocks[j] <= free:
                free -= blocks[j]
                j += 1
            places += self._launch_at(flats[i:j], block)
            i = j
        return places

    def _room(self, blocks: int, device: torch.device) -> None:
        """A buffer with room for `blocks` more: this one, or (its tensors merged) a new one
        or this one again."""
        if self._buffer is None or self._free < blocks:
            self._merge_buffer()
            held = 0 if self._buffer is None else self._buffer.numel() // _PART
            want = min(2 * held, POOL_BLOCKS << POOL_GROWTH) if held else POOL_BLOCKS
            if held < max(want, blocks):  # (else used again: read before, in stream order)
                size = max(want, blocks)
                self._buffer = torch.empty(size * _PART, dtype=torch.float64, device=device)
            assert self._buffer is not None
            self._free = self._buffer.numel() // _PART

    def _next_part(self) -> tuple[int, torch.Tensor]:
        """The buffer's first free block and the buffer from it on (where a launch writes)."""
        assert self._buffer is not None
        start = self._buffer.numel() // _PART - self._free
        return start, self._buffer[start * _PART :]

    def _launch_at(self, flats: Sequence[torch.Tensor], block: int) -> list[int]:
        """flats' blocks (they fit in the buffer) by one launch: each program one block, found
        by its (offset from the first tensor's address in elements, elements) in a table."""
        assert self._buffer is not None
        base, size = flats[0], flats[0].element_size()
        assert all(t.data_ptr() % 16 == 0 for t in flats), "add_many takes 16-byte-aligned tensors"
        at = torch.tensor([(t.data_ptr() - base.data_ptr()) // size for t in flats])
        ns = torch.tensor([t.numel() for t in flats])
        blocks = (ns + block - 1) // block
        owner = torch.repeat_interleave(torch.arange(len(flats)), blocks)
        first = torch.cumsum(blocks, 0) - blocks  # each tensor's first block among them
        k = (torch.arange(owner.numel()) - first[owner]) * block  # a block's first element
        table = torch.stack((at[owner] + k, (ns[owner] - k).clamp(max=block)), 1).reshape(-1)
        start, part = self._next_part()
        _BLOCKS_AT.run(
            (owner.numel(),), base, _sent(table, base.device), part, ALIGN=16 // size, BLOCK=block
        )
        starts = (first + start).tolist()
        places = []
        for s0, b in zip(starts, blocks.tolist(), strict=True):
            self._table += (s0, b)
            places.append(self.size)
            self.size += 1
        self._free -= owner.numel()
        return places

    def _merge_buffer(self) -> None:
        """The buffer's tensors' rows, merged (one launch), kept; the buffer emptied."""
        if self._buffer is None or not self._table:
            return
        buffer, tensors = self._buffer, len(self._table) // 2
        starts = _sent(torch.tensor(self._table, dtype=torch.int64), buffer.device)
        rows = torch.empty((tensors, _ROW), dtype=torch.float64, device=buffer.device)
        _merge_many[(tensors,)](buffer, starts, rows, CHUNK=self._chunk)
        self._done.append(rows)
        self._table = []

    def rows(self) -> torch.Tensor:
        """(tensors added, 9) float64 rows on the pool's device, in the order added."""
        self._merge_buffer()
        done = self._done
        if not done:  # (no tensor was added)
            return torch.empty((0, _ROW), dtype=torch.float64)
        return done[0] if len(done) == 1 else torch.cat(done)


def _sent(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host table on `device`, queued from pinned memory: the host does not wait."""
    if device.type == "cuda":
        table = table.pin_memory()
    return table.to(device, non_blocking=True)


@triton.jit
def _diff_blocks(a_ptr, b_ptr, part_ptr, n, BLOCK: tl.constexpr):
    # one block of a reference a and a compared b, each read once in its own dtype: over the
    # elements finite on both sides Σ(b - a)², Σa², Σb², Σab, max |b - a|; the elements not
    # finite on either side, on a, on b; the largest finite |a|
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    a = tl.load(a_ptr + offs, mask=inside, other=0).to(tl.float64)
    b = tl.load(b_ptr + offs, mask=inside, other=0).to(tl.float64)
    fa = inside & (a == a) & (tl.abs(a) != float("inf"))  # noqa: PLR0124 (NaN: unequal)
    fb = inside & (b == b) & (tl.abs(b) != float("inf"))  # noqa: PLR0124
    both = fa & fb
    a0 = tl.where(both, a, 0.0)
    b0 = tl.where(both, b, 0.0)
    d = b0 - a0
    base = part_ptr + pid.to(tl.int64) * 9
    _store_nine(
        base,
        tl.sum(d * d, axis=0),
        tl.sum(a0 * a0, axis=0),
        tl.sum(b0 * b0, axis=0),
        tl.sum(a0 * b0, axis=0),
        tl.max(tl.abs(d), axis=0),
        tl.sum((inside & ~both).to(tl.float64), axis=0),
        tl.sum((inside & ~fa).to(tl.float64), axis=0),
        tl.sum((inside & ~fb).to(tl.float64), axis=0),
        tl.max(tl.where(fa, tl.abs(a), 0.0), axis=0),
    )


@triton.jit
def _diff_merge(part_ptr, out_ptr, blocks, CHUNK: tl.constexpr):
    # the blocks in order, a chunk at a time: sums add, maxima take the larger
    sd = tl.zeros((), tl.float64)
    sa = tl.zeros((), tl.float64)
    sb = tl.zeros((), tl.float64)
    sab = tl.zeros((), tl.float64)
    top_d = tl.zeros((), tl.float64)
    off = tl.zeros((), tl.float64)
    off_a = tl.zeros((), tl.float64)
    off_b = tl.zeros((), tl.float64)
    top_a = tl.zeros((), tl.float64)
    for start in range(0, blocks, CHUNK):
        b = start + tl.arange(0, CHUNK)
        base = part_ptr + b.to(tl.int64) * 9
        there = b < blocks
        sd += tl.sum(tl.load(base + 0, mask=there, other=0.0), axis=0)
        sa += tl.sum(tl.load(base + 1, mask=there, other=0.0), axis=0)
        sb += tl.sum(tl.load(base + 2, mask=there, other=0.0), axis=0)
        sab += tl.sum(tl.load(base + 3, mask=there, other=0.0), axis=0)
        top_d = tl.maximum(top_d, tl.max(tl.load(base + 4, mask=there, other=0.0), axis=0))
        off += tl.sum(tl.load(base + 5, mask=there, other=0.0), axis=0)
        off_a += tl.sum(tl.load(base + 6, mask=there, other=0.0), axis=0)
        off_b += tl.sum(tl.load(base + 7, mask=there, other=0.0), axis=0)
        top_a = tl.maximum(top_a, tl.max(tl.load(base + 8, mask=there, other=0.0), axis=0))
    _store_nine(out_ptr, sd, sa, sb, sab, top_d, off, off_a, off_b, top_a)


_DIFF_BLOCKS, _DIFF_MERGE = Fast(_diff_blocks), Fast(_diff_merge)


def diff_sums(
    a: torch.Tensor, b: torch.Tensor, *, block: int = BLOCK, chunk: int = CHUNK
) -> torch.Tensor:
    """diff's nine numbers of b against a (1-D, one length, non-empty, floating point,
    contiguous, one device), float64 on it, as commands/diff/ondevice.sums gives them: one read
    of each, two launches, the blocks merged in a fixed order (the same bits every run)."""
    n = a.numel()
    blocks = _cdiv(n, block)
    parts = torch.empty(blocks * 9, dtype=torch.float64, device=a.device)
    out = torch.empty(9, dtype=torch.float64, device=a.device)
    _DIFF_BLOCKS.run((blocks,), a, b, parts, n, BLOCK=block)
    _DIFF_MERGE.run((1,), parts, out, blocks, CHUNK=chunk)
    return out


TOKEN_BLOCK = 1024  # channels a program of _tokens reads at a time
_TOKEN = 5  # norm, mean, std, max |x|, its channel


@triton.jit
def _tokens(x_ptr, out_ptr, channels, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    base = x_ptr + r * channels
    far = channels + BLOCK  # past every channel: "none found"
    s = tl.zeros((), tl.float64)
    q = tl.zeros((), tl.float64)
    best = tl.full((), -1.0, tl.float64)
    best_at = tl.full((), far, tl.int64)
    nan_at = tl.full((), far, tl.int64)
    for start in range(0, channels, BLOCK):  # in order: the same sums every run
        offs = start + tl.arange(0, BLOCK)
        inside = offs < channels
        v = tl.load(base + offs, mask=inside, other=0).to(tl.float64)
        s += tl.sum(v, axis=0)
        q += tl.sum(v * v, axis=0)
        a = tl.abs(v)
        nan = inside & (a != a)  # noqa: PLR0124 (NaN is the value unequal to itself)
        nan_at = tl.minimum(nan_at, tl.min(tl.where(nan, offs.to(tl.int64), far), axis=0))
        top = tl.max(tl.where(inside & ~nan, a, -1.0), axis=0)
        at = tl.min(tl.where(inside & (a == top), offs.to(tl.int64), far), axis=0)
        later = top > best  # a tie keeps the earlier channel
        best_at = tl.where(later, at, best_at)
        best = tl.where(later, top, best)
    mean = s / channels
    m2 = tl.zeros((), tl.float64)
    for start in range(0, channels, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < channels
        v = tl.load(base + offs, mask=inside, other=0).to(tl.float64)
        d = tl.where(inside, v - mean, 0.0)
        m2 += tl.sum(d * d, axis=0)
    has_nan = nan_at < far
    out = out_ptr + r * 5
    tl.store(out + 0, tl.sqrt(q))
    tl.store(out + 1, mean)
    tl.store(out + 2, tl.sqrt(m2 / channels))
    tl.store(out + 3, tl.where(has_nan, float("nan"), best))
    tl.store(out + 4, tl.where(has_nan, nan_at, best_at).to(tl.float64))


_TOKENS = Fast(_tokens)


def token_rows(x: torch.Tensor, *, block: int = TOKEN_BLOCK) -> torch.Tensor:
    """(…, C) → (…, 5) float64 on x's device (x non-empty, floating point, contiguous): per
    position the norm, mean, std and max |x| over its C channels and the channel of that max,
    as engine/tensorbits.token_rows gives them — in one launch and one read of x."""
    channels = x.shape[-1]
    flat = x.reshape(-1, channels)
    out = torch.empty((flat.shape[0], _TOKEN), dtype=torch.float64, device=x.device)
    _TOKENS.run((flat.shape[0],), flat, out, channels, BLOCK=block)
    return out.reshape(*x.shape[:-1], _TOKEN)


CHANNEL_BLOCK = 64  # channels a program of _chan_first/_chan_second reads
ROW_BLOCK = 64  # rows (tokens) a program reads at a time
_CHANNEL = 10  # count, mean, M2, min, max, zeros, |x| >= 6, masked, Σ(x-g)², Σ(x-g)⁴


@triton.jit
def _chan_first(  # noqa: PLR0917 (Triton: positional arguments)
    x_ptr, out_ptr, low_ptr, rows, channels, large, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr
):
    c = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside_c = c < channels
    lowest = tl.load(low_ptr)  # (a float64 tensor: a Python float would come in as float32)
    count = tl.zeros((BLOCK_C,), tl.float64)
    s = tl.zeros((BLOCK_C,), tl.float64)
    mn = tl.full((BLOCK_C,), float("inf"), tl.float64)
    mx = tl.full((BLOCK_C,), -float("inf"), tl.float64)
    zeros = tl.zeros((BLOCK_C,), tl.float64)
    big = tl.zeros((BLOCK_C,), tl.float64)
    masked = tl.zeros((BLOCK_C,), tl.float64)
    for start in range(0, rows, BLOCK_N):  # in order: the same sums every run
        r = start + tl.arange(0, BLOCK_N).to(tl.int64)
        inside = (r < rows)[:, None] & inside_c[None, :]
        v = tl.load(x_ptr + r[:, None] * channels + c[None, :], mask=inside, other=0)
        v = v.to(tl.float64)
        hidden = inside & ((v == -float("inf")) | (v == lowest))  # a mask's fill value
        finite = inside & (v == v) & (tl.abs(v) != float("inf"))  # noqa: PLR0124 (NaN)
        valid = finite & ~hidden
        w = tl.where(valid, v, 0.0)
        count += tl.sum(valid.to(tl.float64), axis=0)
        s += tl.sum(w, axis=0)
        mn = tl.minimum(mn, tl.min(tl.where(valid, v, float("inf")), axis=0))
        mx = tl.maximum(mx, tl.max(tl.where(valid, v, -float("inf")), axis=0))
        zeros += tl.sum((valid & (v == 0.0)).to(tl.float64), axis=0)
        big += tl.sum((valid & (tl.abs(v) >= large)).to(tl.float64), axis=0)
        masked += tl.sum(hidden.to(tl.float64), axis=0)
    base = out_ptr + c
    tl.store(base + 0 * channels, count, mask=inside_c)
    tl.store(base + 1 * channels, s / tl.maximum(count, 1.0), mask=inside_c)
    tl.store(base + 3 * channels, mn, mask=inside_c)
    tl.store(base + 4 * channels, mx, mask=inside_c)
    tl.store(base + 5 * channels, zeros, mask=inside_c)
    tl.store(base + 6 * channels, big, mask=inside_c)
    tl.store(base + 7 * channels, masked, mask=inside_c)


@triton.jit
def _chan_second(  # noqa: PLR0917 (Triton: positional arguments)
    x_ptr, out_ptr, g_ptr, low_ptr, rows, channels, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr
):
    c = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside_c = c < channels
    lowest = tl.load(low_ptr)
    mean = tl.load(out_ptr + 1 * channels + c, mask=inside_c, other=0.0)
    g = tl.load(g_ptr)
    m2 = tl.zeros((BLOCK_C,), tl.float64)
    q2 = tl.zeros((BLOCK_C,), tl.float64)
    q4 = tl.zeros((BLOCK_C,), tl.float64)
    for start in range(0, rows, BLOCK_N):
        r = start + tl.arange(0, BLOCK_N).to(tl.int64)
        inside = (r < rows)[:, None] & inside_c[None, :]
        v = tl.load(x_ptr + r[:, None] * channels + c[None, :], mask=inside, other=0)
        v = v.to(tl.float64)
        hidden = (v == -float("inf")) | (v == lowest)
        valid = inside & (v == v) & (tl.abs(v) != float("inf")) & ~hidden  # noqa: PLR0124
        d = tl.where(valid, v - mean[None, :], 0.0)
        m2 += tl.sum(d * d, axis=0)
        e = tl.where(valid, v - g, 0.0)
        e2 = e * e
        q2 += tl.sum(e2, axis=0)
        q4 += tl.sum(e2 * e2, axis=0)
    base = out_ptr + c
    tl.store(base + 2 * channels, m2, mask=inside_c)
    tl.store(base + 8 * channels, q2, mask=inside_c)
    tl.store(base + 9 * channels, q4, mask=inside_c)


def channel_rows(
    x: torch.Tensor, lowest: float, large: float, *, block_c: int = CHANNEL_BLOCK,
    block_n: int = ROW_BLOCK,
) -> torch.Tensor:  # fmt: skip
    """(N, C) (contiguous, floating point, non-empty) → (10, C) float64 on x's device: per
    channel over its valid values (finite, and neither -inf nor `lowest`, an attention mask's
    fill) their count, mean, sum of squares about that mean, min and max, zeros, how many
    reach |x| >= `large`, the masked values; then Σ(x-g)² and Σ(x-g)⁴ about the whole
    tensor's mean g (for its kurtosis). Two launches, each a read of x in its own dtype; the
    whole's mean between them on the device (no synchronisation)."""
    rows, channels = x.shape
    out = torch.empty((_CHANNEL, channels), dtype=torch.float64, device=x.device)
    grid = (_cdiv(channels, block_c),)
    low = torch.full((1,), lowest, dtype=torch.float64, device=x.device)
    _chan_first[grid](x, out, low, rows, channels, large, BLOCK_N=block_n, BLOCK_C=block_c)
    count, mean = out[0], out[1]
    g = ((mean * count).sum() / count.sum().clamp(min=1)).reshape(1)
    _chan_second[grid](x, out, g, low, rows, channels, BLOCK_N=block_n, BLOCK_C=block_c)
    return out


HEAD_KEYS = 64  # keys a program of _head_cols reads
HEAD_QUERIES = 32  # queries it reads at a time


@triton.jit
def _head_cols(  # noqa: PLR0917 (Triton: positional arguments)
    p_ptr, counted_ptr, col_ptr, ent_ptr, heads, length, key_blocks,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1).to(tl.int64)
    b = bh // heads
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K).to(tl.int64)
    inside_k = k < length
    col = tl.zeros((BLOCK_K,), tl.float64)
    ent = tl.zeros((BLOCK_K,), tl.float64)
    base = p_ptr + bh * length * length
    for start in range(0, length, BLOCK_Q):  # in order: the same sums every run
        q = start + tl.arange(0, BLOCK_Q).to(tl.int64)
        inside_q = q < length
        counted = tl.load(counted_ptr + b * length + q, mask=inside_q, other=0) != 0
        inside = (inside_q & counted)[:, None] & inside_k[None, :]
        v = tl.load(base + q[:, None] * length + k[None, :], mask=inside, other=0)
        v = v.to(tl.float64)
        col += tl.sum(tl.where(inside, v, 0.0), axis=0)
        ent += tl.sum(tl.where(inside & (v > 0.0), v * tl.log(v), 0.0), axis=0)
    tl.store(col_ptr + bh * length + k, col, mask=inside_k)
    tl.store(ent_ptr + bh * key_blocks + kb, tl.sum(ent, axis=0))


def head_sums(
    p: torch.Tensor, counted: torch.Tensor, *, block_q: int = HEAD_QUERIES,
    block_k: int = HEAD_KEYS,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Attention probabilities (B, H, L, L) (contiguous, floating point) and the queries
    counted (B, L) → over each sequence's counted queries, per head: each key's summed
    probability (B, H, L) and Σ p log p (B, H), float64 on p's device (engine/heads.py makes
    the sink, entropy and top key of them). One launch, one read of p in its own dtype, then
    one small sum over the key blocks; a fixed order: bitwise the same run to run."""
    b, h, length, _ = p.shape
    key_blocks = _cdiv(length, block_k)
    col = torch.empty((b, h, length), dtype=torch.float64, device=p.device)
    ent = torch.empty((b, h, key_blocks), dtype=torch.float64, device=p.device)
    flags = counted.to(device=p.device, dtype=torch.int8).contiguous()
    grid = (b * h, key_blocks)
    _head_cols[grid](p, flags, col, ent, h, length, key_blocks, BLOCK_Q=block_q, BLOCK_K=block_k)
    return col, ent.sum(2)


HIST_BLOCK = 1024  # elements a program of _abs_hist reads


@triton.jit
def _abs_hist(  # noqa: PLR0917 (Triton: positional arguments)
    x_ptr, bounds_ptr, out_ptr, low_ptr, n, inner, STEPS: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    lowest = tl.load(low_ptr)
    v = tl.load(x_ptr + offs, mask=inside, other=0).to(tl.float64)
    a = tl.abs(v)
    valid = inside & (v == v) & (a != float("inf")) & (v != lowest)  # noqa: PLR0124 (NaN)
    # the bin: how many inner bounds are <= |x| (torch.bucketize(right=True)), by bisection
    lo = tl.zeros((BLOCK,), tl.int32)
    hi = tl.full((BLOCK,), inner, tl.int32)
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        b = tl.load(bounds_ptr + mid, mask=active, other=0.0)
        up = active & (b <= a)
        lo = tl.where(up, mid + 1, lo)
        hi = tl.where(active & ~up, mid, hi)
    tl.atomic_add(out_ptr + lo, tl.full((BLOCK,), 1, tl.int32), mask=valid)  # exact: integers


def abs_hist(x: torch.Tensor, bounds: torch.Tensor, lowest: float) -> torch.Tensor:
    """Counts of |x| over the valid values of x (flat, contiguous, floating point, fewer than
    2**31 of them: finite, not `lowest`, an attention mask's fill) in the bins the ascending
    float64 `bounds` (on x's device) make: bin k holds bounds[k-1] <= |x| < bounds[k], as
    torch.bucketize(right=True) places it. (len(bounds) + 1,) int32 on x's device; one launch,
    one read of x in its own dtype. Integer counts: the same whatever order they land in."""
    inner = bounds.numel()
    bounds = bounds.contiguous()
    out = torch.zeros(inner + 1, dtype=torch.int32, device=x.device)
    low = torch.full((1,), lowest, dtype=torch.float64, device=x.device)
    grid = (_cdiv(x.numel(), HIST_BLOCK),)
    steps = max(1, inner.bit_length())  # answers 0..inner: ceil(log2(inner + 1)) halvings
    _abs_hist[grid](x, bounds, out, low, x.numel(), inner, STEPS=steps, BLOCK=HIST_BLOCK)
    return out
