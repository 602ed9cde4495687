"""Statistics of one tensor, computed where the tensor lives, with no host sync per tensor.

Every tensor a hook sees becomes one *row* (engine/statrow.py) of nine numbers

    count (finite elements), mean, var (population), min, max, zeros, nan, inf, norm

and then statrow.AFTER_PASS's, statistics TensorStats declares past those nine.

`StatsCollector.add` returns an empty TensorStats at once; `finalize` brings all rows to the
host with a single device-to-host transfer per device (docs/traps.md §8) and fills in every
TensorStats it handed out.

Three ways to fill a row:

* CPU floating point, until the numba kernels are loaded: `cpu_row`, a few fast torch
  reductions (float64 sum and sum of squares, aminmax, a nonzero count of a bool copy), about
  0.5 ms per MiB here. torch's var_mean, `x == 0`, count_nonzero of floats (on ReLU outputs),
  a sum of bools and isfinite stream near 1 GB/s, so they are not used: a finite sum and sum
  of squares prove the data holds no NaN/Inf.
* CPU floating point, once loaded: numba kernels (`kernel_row`), one fused pass for all five
  sums at the speed of `sum` alone (benchmarks/overhead.py). Loading numba costs ~1 s a
  process: runtime.preload starts it from `import hookcli` (not in the command); a collector
  takes the kernels once there, waiting for a load in flight past `_WAIT_AFTER` bytes
  measured with torch ops; with no load started, it loads them after `_KERNEL_AFTER` bytes.
  Both CPU paths accumulate in float64 and agree to rounding (~1e-15). Each result is trusted
  only when provably sound: a non-finite sum means NaN/Inf are present (the careful path then
  counts them and excludes them), and a variance small against the mean square means
  cancellation (a centred pass then fixes it). On the CPU, branching on a result costs nothing.
  A contiguous float32 tensor of at most `TOGETHER` elements is copied as the hook sees it and
  measured after the pass with the others in one kernel call (engine/cpurow.py `Later`).
* Everything else (GPU, MPS, integers, bool) and the careful case: `torch_row`, torch ops
  that never synchronise, accumulating in float64 (float32 on MPS, which lacks float64).

Non-float kinds are mapped first: quantized tensors are dequantized, complex tensors
measured by magnitude, sparse tensors densified, float16/bfloat16 widened to float32.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hookcli.engine.channels import ChannelRow, measure_channels, resolve
from hookcli.engine.cpurow import (
    TOGETHER,
    Kernels,
    Later,
    cpu_row,
    kernel_row,
    measurable_together,
    segment_rows,
    torch_row,
)
from hookcli.engine.devicerow import (
    finished_rows,
    fused_row,
    started_plain,
    started_row,
    started_rows,
    token_rows,
)
from hookcli.engine.histogram import histogram
from hookcli.engine.resolve import (
    resolve_hists,
    resolve_tokens,
    resolve_values,
    small_values,
    small_values_together,
)
from hookcli.engine.sharded import ShardBook, not_merged
from hookcli.engine.statrow import (
    AFTER_PASS,
    COUNT,
    EMPTY_ROW,
    NORM,
    Row,
    after_pass,
    fill,
)
from hookcli.engine.tensorbits import (
    ATTENTION,
    PLAIN,
    TOKENS,
    accumulate_dtype,
    by_device,
    dense_flat,
    dtype_name,
    padding_of,
    real_valued,
    unpadded,
    version_of,
)
from hookcli.options import STATS_BACKENDS
from hookcli.records import TensorStats, TokenRow
from hookcli.runtime import preload

# Tensors this small also report their elements (toy models, losses, gradients of scalars).
SMALL = 16
# StatsCollector._together: a tensor the CPU kernel measures with others where it lies
_ON_CPU = 1
# The process measures this many bytes with torch ops before it loads the numba kernels.
_KERNEL_AFTER = 256 << 20
# With the load in flight (runtime.preload), the process waits for it past this many bytes:
# torch ops cost about 0.5 ms per MiB here, the kernels a tenth of it.
_WAIT_AFTER = 64 << 20
# --channels by torch ops reads a tensor about this many times (a float64 copy, var_mean,
# aminmax, the counts, the kurtosis' moments): its bytes count so many times toward loading.
CHANNEL_PASSES = 10


def _norm_of(row: Row) -> float | None:
    """A row's norm over its finite elements; None where it has none."""
    return row[NORM] if row[COUNT] > 0 and math.isfinite(row[NORM]) else None


def _load_kernels() -> Kernels | None:
    """The numba kernels, or None when numba is missing or unusable here."""
    if preload.kept_off():  # HOOKCLI_STATS=torch, as the package's edge read it
        return None
    if preload.failed():  # the background load failed: numba may be half imported here
        return None
    try:
        import numba

        from hookcli.engine import _chankernels, _distkernels, _kernels
    except Exception:  # numba absent or broken: the torch path is exact, only slower
        return None
    # The kernels run between torch's own ops: use no more threads than torch does.
    most = int(getattr(numba.config, "NUMBA_NUM_THREADS", 1))
    theirs = torch.get_num_threads()
    numba.set_num_threads(max(1, min(theirs, most)))
    # numba's OpenMP pool starts there, and with it the OpenMP thread count torch reads
    # (torch.get_num_threads) becomes numba's, all CPUs: the user's torch.set_num_threads
    # would change under them. Put back (docs/traps.md §17).
    if torch.get_num_threads() != theirs:
        torch.set_num_threads(theirs)
    return Kernels(_kernels, _chankernels, _distkernels)


def kernel_threads() -> int | None:
    """The threads the kernels use in this thread (None: no kernels)."""
    if kernels() is None:
        return None
    import numba

    return int(numba.get_num_threads())


def use_kernel_threads(n: int | None) -> None:
    """In another thread (diff's sides side by side): numba's thread count is per thread, and
    a parallel sum's digits depend on it; the same count as the thread that loaded them."""
    if n is not None:
        import numba

        numba.set_num_threads(n)


@functools.cache
def kernels() -> Kernels | None:
    """Loaded on first use, once per process (numba costs about a second to import and load:
    runtime.preload starts that early, in the background; this waits for it to end)."""
    preload.wait()
    return _load_kernels()


_without_kernels = [0]  # bytes this process has measured on the CPU without the kernels


def _kernels_if_they_pay() -> Kernels | None:
    """The kernels once loading them pays: loaded already (here or by runtime.preload), or
    waited for when a load is in flight and this process has measured `_WAIT_AFTER` bytes
    with torch ops, or loaded here once it has measured `_KERNEL_AFTER` bytes without them.
    Whichever path measures a tensor, the figures agree to rounding."""
    done = _without_kernels[0]
    if kernels.cache_info().currsize or preload.finished() or done >= _KERNEL_AFTER:
        return kernels()
    if preload.started() and done >= _WAIT_AFTER:
        return kernels()
    return None


# how a tensor carries a padded batch's positions (StatsCollector._padded)


class Started:
    """A device tensor's row started in the pass's pool (devicerow.started_row), finished
    by finalize with every other: its device and its place there. (Not a tuple: a CPU row
    is one.)"""

    __slots__ = ("at", "device")

    def __init__(self, device: torch.device, at: int) -> None:
        self.device = device
        self.at = at


class StatsCollector:
    """Collects one row per tensor during a pass; numbers reach the host once, at the end.

    Tensors seen twice unchanged (a module's output fed to the next module as input) are
    measured once: the cache is keyed by object identity and torch's version counter, so an
    in-place op in between (ReLU(inplace=True)) makes a fresh measurement. Only weak
    references are held, so no activation outlives the hook that saw it.
    """

    def __init__(
        self,
        *,
        backend: str = "auto",
        hist_bins: int = 0,
        hist_edges: dict[Any, tuple[Any, Any]] | None = None,
    ) -> None:
        """backend: "auto" (the numba kernels once loaded — runtime.preload loads them in the
        background — torch reductions until then), "kernel" (numba from the first tensor,
        where numba works) or "torch" (never numba). They agree to rounding."""
        if backend not in STATS_BACKENDS:
            raise ValueError(f"backend must be one of {STATS_BACKENDS}, not {backend!r}")
        self._backend = backend
        self._kernels = kernels() if backend == "kernel" else None
        self._bins = hist_bins
        # folder runs: histogram edges shared by every batch, keyed by (context, path)
        self._edges = hist_edges
        self.context: Any = None  # set by the hook session: whose tensors come next
        # a padded text batch's real tokens, (batch, tokens): a tensor whose leading
        # dimensions are these is measured over its real positions only (set_token_mask)
        self.token_mask: torch.Tensor | None = None
        self._real_tokens = 0
        self._real_index: torch.Tensor | None = None
        # calls whose 2-D tensors are (rows, features), never (batch, tokens) (set by the pass)
        self.rows_only: frozenset[str] = frozenset()
        # --per-token: (batch, tokens) of the input; each output of shape (batch, tokens, C)
        # also gets per-position statistics over its C channels
        self.per_token: tuple[int, int] | None = None
        self._tokens: dict[int, list[TokenRow] | torch.Tensor] = {}
        self._wants_tokens: list[tuple[TensorStats, int]] = []
        # --channels: given the context and a tensor's shape, its channel dimension (None:
        # no per-channel statistics for it); each row's packed numbers (engine.channels)
        self.channels: Callable[[Any, tuple[int, ...]], int | None] | None = None
        self.channel_hist = False  # calib: each also gets its histogram of |x|
        self._chan: dict[int, ChannelRow] = {}
        self._wants_chan: list[tuple[TensorStats, int]] = []
        self._hist_range: dict[int, tuple[Any, Any]] = {}
        self._hists: dict[int, np.ndarray[Any, Any] | torch.Tensor] = {}  # row → bin counts
        self._wants_hist: list[tuple[TensorStats, int]] = []
        self._scratch = np.zeros(7, dtype=np.float64)
        self._later = Later()  # small CPU tensors' copies, measured together
        self._rows: list[Row | torch.Tensor | Started] = []
        self._pools: dict[torch.device, Any] = {}  # rows started on devices (devicerow)
        self._notes: list[str | None] = []
        self._values: dict[int, list[float | None] | torch.Tensor] = {}  # row → elements
        self._wants_values: list[tuple[TensorStats, int]] = []
        self._handed_out: list[tuple[TensorStats, int]] = []  # filled by finalize()
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}
        self._row_padded: dict[int, int] = {}  # a row read as a padded batch's: how (_padded)
        self.book = ShardBook()  # the pass's DTensors and their shards (engine/sharded.py)

    def __len__(self) -> int:
        return len(self._rows)

    def set_token_mask(self, mask: torch.Tensor | None) -> None:
        """Leave a padded batch's padding out of every tensor that has its (batch, tokens)
        leading dimensions, of a (batch·tokens, C) one the model flattened them into (OPT's
        fc1/fc2, a MoE block's shared expert), and of the query rows of (batch, heads,
        tokens, tokens) attention (None: measure whole tensors). The real positions are found
        once, here."""
        self.token_mask = mask
        self._real_tokens = 0 if mask is None else int(mask.sum())
        self._real_index = None if mask is None else mask.reshape(-1).nonzero().squeeze(1)

    def _token_rows_of(self, t: torch.Tensor, path: str) -> bool:
        """--per-token: whether t is an output of (batch, tokens, C)."""
        return (
            self.per_token is not None
            and path.startswith("out")
            and t.dim() == 3
            and tuple(t.shape[:2]) == self.per_token
            and t.is_floating_point()
            and t.device.type != "meta"
        )

    def _real_numel(self, shape: Sequence[int], padded: int) -> int:
        """The element count of a padded batch's tensor of `shape` at its real positions."""
        rest = shape[2:] if padded == TOKENS else shape[1:]
        return self._real_tokens * (shape[1] * shape[3] if padded == ATTENTION else math.prod(rest))

    def _padded(self, t: torch.Tensor, path: str) -> int:
        """How t holds the mask's positions (tensorbits.padding_of); never a parameter's or a
        gradient of one's (`add(…, positions=False)`)."""
        mask = self.token_mask
        if mask is None:
            return 0
        return padding_of(t.shape, mask.shape, self.context, path, self.rows_only)

    def add_whole(self, tensors: Sequence[tuple[torch.Tensor, str]]) -> list[TensorStats]:
        """`add(t, path, positions=False)` of each (parameters, their gradients: tensors
        measured whole, now), the small CPU float32 ones measured together, each where it
        lies, in one kernel call, and device ones started together, one launch a dtype,
        instead of one call each (issue 52)."""
        rows, seen = self._rows, self._seen
        out = []
        together: list[torch.Tensor] = []
        places: list[int] = []  # their rows' places
        kinds, started, small = self._together([t for t, _ in tensors])
        for i, ((t, path), kind, at) in enumerate(zip(tensors, kinds, started, strict=True)):
            if kind == _ON_CPU and id(t) not in seen:
                n = t.numel()
                stats = TensorStats(path, tuple(t.shape), "float32", n)
                places.append(len(rows))
                together.append(t)
                # (its row, and a small one's elements, filled in below)
                self._record(stats, EMPTY_ROW, t, version_of(t), [] if n <= SMALL else None)
                out.append(stats)
            elif at is not None:
                out.append(self._started(t, path, at, small.get(i), version_of(t)))
            else:
                out.append(self.add(t, path, positions=False))
        if together:
            assert self._kernels is not None  # (nothing is together without them)
            elements: list[list[float | None] | None] = []
            found = segment_rows(together, self._kernels, elements, SMALL)
            for at, row, got in zip(places, found, elements, strict=True):
                rows[at] = row
                if got is not None:
                    self._values[at] = got
        return out

    def params_now(
        self, weights: Sequence[torch.Tensor], grads: Sequence[tuple[torch.Tensor, str]]
    ) -> tuple[list[float | None], list[TensorStats]] | None:
        """`norms(weights)`, `add_whole(grads)` by two kernel calls, filled now (issue 52), where
        all are measured together on the CPU and no gradient was seen in the pass; else None."""
        ks, seen = self._kernels, self._seen  # (a freed tensor's id may be a gradient's now)
        every = [*weights, *(g for g, _ in grads)]  # (asked first: _together starts device rows)
        if ks is None or self._more_wanted() or not all(measurable_together(every)):
            return None
        if any((hit := seen.get(id(g))) and hit[0]() is g for g, _ in grads):
            return None
        norms = [_norm_of(row) for row in segment_rows(weights, ks)]
        elements: list[list[float | None] | None] = []
        rows = segment_rows([g for g, _ in grads], ks, elements, SMALL)
        return norms, [
            fill(TensorStats(path, tuple(g.shape), "float32", g.numel(), values=got), row)
            for (g, path), row, got in zip(grads, rows, elements, strict=True)
        ]

    def norms(
        self, tensors: Sequence[tuple[torch.Tensor, str]]
    ) -> list[float | TensorStats | None]:
        """Each tensor's norm over its finite elements, None where it has none (a model's
        weights, whose other statistics no report shows): a small plain CPU one's now, from
        one kernel call for them all, with no TensorStats made, kept or filled (issue 52); any
        other's as `add(t, path, positions=False)` measures it (device ones started together,
        one launch a dtype), a TensorStats whose norm finalize() fills in."""
        out: list[float | TensorStats | None] = []
        together: list[torch.Tensor] = []
        places: list[int] = []
        kinds, started, small = self._together([t for t, _ in tensors])
        for i, ((t, path), kind, at) in enumerate(zip(tensors, kinds, started, strict=True)):
            if kind == _ON_CPU:
                places.append(len(out))
                together.append(t)
                out.append(None)  # (below)
            elif at is not None:
                out.append(self._started(t, path, at, small.get(i), version_of(t)))
            else:
                out.append(self.add(t, path, positions=False))
        if together:
            assert self._kernels is not None  # (nothing is together without them)
            found = segment_rows(together, self._kernels)
            for at, row in zip(places, found, strict=True):
                out[at] = _norm_of(row)
        return out

    def _more_wanted(self) -> bool:
        """Whether tensors measured whole want more than their row (channels, tokens,
        histograms, shards, more statistics): then none is measured together."""
        book = self.book
        return bool(AFTER_PASS or self._bins or self.channels is not None or self.per_token
                    or book.local_shards or book.layouts)  # fmt: skip

    def _together(
        self, tensors: list[torch.Tensor]
    ) -> tuple[list[int], list[int | None], dict[int, torch.Tensor]]:
        """Which tensors (measured whole, now) the CPU kernel measures together where they
        lie (`measurable_together`: _ON_CPU), when nothing else about them is wanted
        (channels, tokens, histograms, shards, more statistics); and the places of those whose
        rows were started together on their devices (`started_rows`), None for the others,
        and the elements of the small ones among these (copied together)."""
        alone: list[int | None] = [None] * len(tensors)
        if self._more_wanted():
            return [0] * len(tensors), alone, {}
        cpu = measurable_together(tensors) if self._kernels is not None else [False] * len(alone)
        kinds = [_ON_CPU if c else 0 for c in cpu]
        if self._backend == "torch":
            return kinds, alone, {}
        seen = self._seen
        fresh = [i for i, t in enumerate(tensors) if not kinds[i] and id(t) not in seen]
        if fresh:  # (a CPU tensor: not started, at once)
            got = started_rows([tensors[i] for i in fresh], self._pools)
            for i, at in zip(fresh, got, strict=True):
                alone[i] = at
        small = [i for i, at in enumerate(alone) if at is not None and tensors[i].numel() <= SMALL]
        copies = small_values_together([tensors[i] for i in small])
        return kinds, alone, dict(zip(small, copies, strict=True))

    def _started(
        self,
        t: torch.Tensor,
        path: str,
        at: int,
        values: list[float | None] | torch.Tensor | None,
        version: int,
    ) -> TensorStats:
        """A device tensor whose row was started (place `at` in its device's pool; `values`,
        a small one's elements; `version`, t's at the start): recorded as `add` records it."""
        stats = TensorStats(path, tuple(t.shape), dtype_name(t.dtype), t.numel())
        self._record(stats, Started(t.device, at), t, version, values)
        return stats

    def _record(
        self,
        stats: TensorStats,
        row: Row | Started,
        t: torch.Tensor,
        version: int,
        values: list[float | None] | torch.Tensor | None,
    ) -> None:
        """A new tensor's row (no note), its elements when it is small, and its identity for
        a second sight: `add`'s bookkeeping where nothing else applies."""
        idx = len(self._rows)
        self._rows.append(row)
        self._notes.append(None)
        self._handed_out.append((stats, idx))
        if values is not None:
            self._values[idx] = values
            self._wants_values.append((stats, idx))
        if version >= 0:  # (an inference tensor has no version: never taken as seen)
            self._seen[id(t)] = (weakref.ref(t), version, idx)

    def quick(self, t: torch.Tensor, path: str) -> TensorStats:
        """`add(t, path)` for a layer call's tensor, by the short way where it applies (issue
        52: this runs once per hooked tensor): a plain small contiguous CPU float32 tensor, no
        token mask, channels, histograms or shards; the same numbers either way."""
        book = self.book
        ks = self._kernels
        if (
            type(t) is not torch.Tensor
            or t._is_zerotensor()
            or book.local_shards
            or book.layouts
            or book.fed
            or book.batch_groups
            or self.token_mask is not None
            or self.per_token
            or self.channels is not None
            or self._bins
            or AFTER_PASS
        ):
            return self.add(t, path)
        key = id(t)
        hit = self._seen.get(key)
        try:  # (tensorbits.version_of, inlined: this runs once per hooked tensor)
            version = t._version
        except RuntimeError:  # an inference tensor: no version counter, never seen before
            version = -1
        if hit is not None and hit[0]() is t and hit[1] == version:
            idx = hit[2]
            stats = TensorStats(path, tuple(t.shape), dtype_name(t.dtype), t.numel())
            stats.note = self._notes[idx]
            self._handed_out.append((stats, idx))
            if idx in self._values:
                self._wants_values.append((stats, idx))
            return stats
        n = t.numel()
        if t.is_cuda:  # started in the pass's pool as it lies, one launch
            at = started_plain(t, self._pools) if self._backend != "torch" else None
            if at is None:
                return self.add(t, path)
            return self._started(t, path, at, small_values(t) if n <= SMALL else None, version)
        if ks is None or not (
            t.dtype is torch.float32
            and t.is_cpu
            and t.layout is torch.strided
            and 0 < n <= TOGETHER
            and t.is_contiguous()
        ):
            return self.add(t, path)
        stats = TensorStats(path, tuple(t.shape), "float32", n)
        later = self._later
        if later.full(n):
            self._settle_later(ks)
        values = small_values(t) if n <= SMALL else None  # (first: it may raise)
        # (measured after the pass into the place its row takes next)
        later.add(len(self._rows), t)
        self._record(stats, EMPTY_ROW, t, version, values)
        return stats

    def add(self, t: torch.Tensor, path: str, *, positions: bool = True) -> TensorStats:
        """Measure t now; return its TensorStats, whose numbers finalize() fills in.
        `positions`: t may hold a padded batch's token positions (False: a parameter or its
        gradient, measured whole whatever its shape)."""
        book = self.book
        # a plain tensor may be a shard: a sharded DTensor was met (its local tensors may
        # follow), or a tensor-parallel plan's styles declare some
        if type(t) not in PLAIN or book.local_shards or book.layouts:
            part = book.part(t, self.context, path)
            if part is not None:
                t, groups, shape = part
                if groups:
                    return self._add_sharded(t, groups, shape, path, positions)
        if t._is_zerotensor():  # (autograd's zeros with no memory: no kernel reads them)
            t = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
        key = id(t)
        hit = self._seen.get(key)
        version = version_of(t)
        stats = TensorStats(path, tuple(t.shape), dtype_name(t.dtype), t.numel())
        padded = self._padded(t, path) if self.token_mask is not None and positions else 0
        if padded:
            stats.numel = self._real_numel(t.shape, padded)
        if (
            hit is not None
            and hit[0]() is t
            and hit[1] == version
            and self._row_padded.get(hit[2], 0) == padded  # (its rows read as here)
        ):
            idx = hit[2]
            stats.note = self._notes[idx]
            self._handed_out.append((stats, idx))
            if idx in self._values:
                self._wants_values.append((stats, idx))
            if idx in self._hists:
                self._wants_hist.append((stats, idx))
            if self.per_token and idx not in self._tokens and self._token_rows_of(t, path):
                # first seen as an input, now an output
                self._tokens[idx] = token_rows(t, fused=self._backend != "torch")
            if idx in self._tokens:
                self._wants_tokens.append((stats, idx))
            if idx not in self._chan and self.channels is not None:
                self._channel_row(t, idx, padded)  # first seen where none were wanted
            if idx in self._chan:
                self._wants_chan.append((stats, idx))
            return stats
        seen = t
        if padded:
            assert self._real_index is not None
            t = unpadded(t, self._real_index, padded)
        said = None
        if positions and (book.fed or book.batch_groups):
            said = book.plain(seen, stats, len(self._rows), self.context)
        # reads detached data only: no autograd graph is made; the row is appended next
        # (a tensor held for later is measured into that place)
        row, note = self._measure(t)
        if said:
            note = f"{note}; {said}" if note else said
        if padded:
            note = f"{note}; padding left out" if note else "over real tokens (padding left out)"
        idx = len(self._rows)
        self._rows.append(row)
        self._notes.append(note)
        self._handed_out.append((stats, idx))
        stats.note = note
        if padded:
            self._row_padded[idx] = padded
        if 0 < stats.numel <= SMALL and t.device.type != "meta":
            self._values[idx] = small_values(t)
            self._wants_values.append((stats, idx))
        if self._bins and stats.numel > 0 and t.device.type != "meta":
            edge_key = (self.context, path)
            fixed = self._edges.get(edge_key) if self._edges is not None else None
            assert not isinstance(row, Started)  # (with histograms, rows are not started)
            counts, span = histogram(t, row, self._bins, fixed, widen=self._edges is not None)
            if self._edges is not None and fixed is None:
                self._edges[edge_key] = span
            self._hists[idx] = counts
            self._hist_range[idx] = span
            self._wants_hist.append((stats, idx))
        if self.per_token and self._token_rows_of(seen, path):
            self._tokens[idx] = token_rows(seen, fused=self._backend != "torch")
            self._wants_tokens.append((stats, idx))
        if self.channels is not None and self._channel_row(
            seen, idx, padded, t if padded else None
        ):
            self._wants_chan.append((stats, idx))
        if version >= 0:  # (an inference tensor has no version: never taken as seen)
            try:  # noqa: SIM105 (a hot path: suppress() costs an object per call)
                self._seen[key] = (weakref.ref(seen), version, idx)
            except TypeError:  # no weakref support: measured again next time
                pass
        return stats

    def _add_sharded(
        self, local: torch.Tensor, groups: tuple[Any, ...], shape: Any, path: str, batch: bool
    ) -> TensorStats:
        """A DTensor (or its local tensor) measured as the global tensor it stands for
        (engine/sharded.py): its shard's row now, the other ranks' merged in at finalize."""
        stats = TensorStats(path, tuple(shape), dtype_name(local.dtype), math.prod(shape))
        mask = self.token_mask if batch else None
        padded = self._padded(local, path) if mask is not None else 0
        if padded:  # this rank's part of the positions' values: its padding left out
            assert self._real_index is not None
            stats.numel = self._real_numel(shape, padded)
            local = unpadded(local, self._real_index, padded)
        row, note = self._measure(local)
        if padded:
            note = f"{note}; padding left out" if note else "over real tokens (padding left out)"
        elif (
            mask is not None
            and tuple(shape[:2]) == tuple(mask.shape)
            and self._real_tokens < mask.numel()
        ):  # padding there, in positions split over the ranks
            said = "padding counted too (the ranks split the positions)"
            note = f"{note}; {said}" if note else said
        note = not_merged(note, channels=self.channels is not None, hist=bool(self._bins))
        idx = len(self._rows)
        self._rows.append(row)
        self._notes.append(note)
        self._handed_out.append((stats, idx))
        stats.note = note
        self.book.sharded(idx, groups, stats if batch else None, self.context)
        return stats

    def _channel_row(
        self, seen: torch.Tensor, idx: int, padded: int, x: torch.Tensor | None = None
    ) -> bool:
        """--channels: measure `seen` per channel when the command's chooser names its
        channel dimension; whether it did. A padded batch's tensor is measured at its real
        positions (`x`: it without padding, else taken here); its channel dimension must lie
        past (batch, tokens), which become one, or past a flattened (batch·tokens)."""
        assert self.channels is not None
        if padded == ATTENTION or not seen.is_floating_point() or seen.device.type == "meta":
            return False
        shape = tuple(seen.shape)
        axis = self.channels(self.context, shape)
        first = 2 if padded == TOKENS else 1  # the first dimension past the positions
        if axis is None or seen.numel() == 0 or (padded and axis < first):
            return False
        if padded and x is None:
            assert self._real_index is not None
            x = unpadded(seen, self._real_index, padded)
        x = seen if x is None else x
        inner = axis - 1 if padded == TOKENS else axis  # (batch, tokens) became one dimension
        if x.numel() == 0:
            return False
        packed = measure_channels(x, inner, hist=self.channel_hist, kernels=self._chan_kernels(x))
        self._chan[idx] = ChannelRow(packed, axis, shape, shape[axis], padded)
        return True

    def _chan_kernels(self, x: torch.Tensor) -> Any:
        """The per-channel kernels for x, once they pay (as `_cpu` decides): a tensor measured
        per channel by torch ops costs about CHANNEL_PASSES reads of it, against the kernels'
        two."""
        if not x.is_cpu:
            return None
        ks = self._kernels_or_count(CHANNEL_PASSES * x.numel() * x.element_size())
        return ks.channels if ks is not None else None

    def _kernels_or_count(self, nbytes: int) -> Kernels | None:
        """The kernels once they pay for their loading; else None, with "auto" counting the
        `nbytes` measured without them toward that."""
        ks = self._kernels
        if ks is None and self._backend == "auto":
            ks = self._kernels = _kernels_if_they_pay()
            if ks is None:
                _without_kernels[0] += nbytes
        return ks

    def _measure(self, t: torch.Tensor) -> tuple[Row | torch.Tensor | Started, str | None]:
        if (
            t.dtype is torch.float32
            and t.is_cpu
            and type(t) in PLAIN
            and t.layout is torch.strided
            and t.numel() > 0
        ):  # the common case, without real_valued's checks
            x = t.detach() if t.requires_grad else t
            if AFTER_PASS:
                return after_pass(self._cpu(x), x), None
            ks, n = self._kernels, x.numel()
            if ks is not None and n <= TOGETHER and not self._bins and x.is_contiguous():
                later = self._later  # measured after the pass, with others (cpurow.Later)
                if later.full(n):
                    self._settle_later(ks)
                later.add(len(self._rows), x)  # (its row's place: the caller appends it next)
                return EMPTY_ROW, None
            return self._cpu(x), None
        if t.device.type == "meta":
            return EMPTY_ROW, "meta tensor: shape only"
        x, note = real_valued(t)
        if x.numel() == 0:
            return EMPTY_ROW, note
        if not x.is_floating_point():  # integers, bools: as floats, as torch_row reads them
            x = x.to(accumulate_dtype(x.device))  # (then the kernels, not twenty torch ops)
        row = self._cpu(x) if x.is_cpu and x.dtype in _CPU_DTYPES else self._device_row(x)
        if AFTER_PASS:
            assert not isinstance(row, Started)  # (with AFTER_PASS, rows are not started)
            row = after_pass(row, x)
        return row, note

    def _cpu(self, t: torch.Tensor) -> Row | torch.Tensor:
        """A CPU float tensor's row: by the kernels once they pay for their loading."""
        ks = self._kernels or self._kernels_or_count(t.numel() * t.element_size())
        if ks is not None:
            return kernel_row(t, ks, self._scratch)
        return cpu_row(dense_flat(t))

    def _device_row(self, x: torch.Tensor) -> torch.Tensor | Started:
        """A device tensor's row, on its device: on CUDA, a floating-point one's by the fused
        Triton kernel (one read, engine/_triton.py), started now and finished with the pass's
        others by finalize where nothing reads it before (histograms, AFTER_PASS); else, and
        with backend "torch", by torch ops."""
        if self._backend == "torch":
            return torch_row(x)
        if not self._bins and not AFTER_PASS:  # (both read the row during the pass)
            at = started_row(x, self._pools)
            if at is not None:
                return Started(x.device, at)
        row = fused_row(x)
        return torch_row(x) if row is None else row

    def _settle_later(self, ks: Kernels) -> None:
        """The rows of the small tensors held for later, in their places."""
        rows = self._rows
        for idx, row in self._later.rows(ks):
            rows[idx] = row

    def finalize(self) -> None:
        """Fill every TensorStats handed out since the last finalize: one transfer per device."""
        if self._later.copies:
            assert self._kernels is not None  # (tensors are held only once the kernels are)
            self._settle_later(self._kernels)
        # CPU rows are tuples of floats already; device rows come over in one transfer each
        out: list[Sequence[float]] = []
        started: list[tuple[int, Started]] = []
        for i, row in enumerate(self._rows):
            if isinstance(row, torch.Tensor):
                out.append(EMPTY_ROW)  # replaced below
            elif type(row) is Started:
                started.append((i, row))
                out.append(EMPTY_ROW)
            else:
                out.append(row)  # type: ignore[arg-type]
        for idxs in by_device(enumerate(self._rows)).values():
            stacked = torch.stack([self._rows[i] for i in idxs])  # type: ignore[misc]
            for i, values in zip(idxs, stacked.to("cpu", torch.float64).tolist(), strict=True):
                out[i] = values
        lost: dict[int, str] = {}  # rows the device could not finish: why
        if self._pools:
            finished = finished_rows(self._pools)
            self._pools.clear()
            for i, s in started:
                got = finished[s.device]
                if isinstance(got, str):
                    lost[i] = f"not measured: the device's statistics failed ({got})"
                else:
                    out[i] = got[s.at]
        merged = self.book.merge(out, self._handed_out)  # each DTensor's: the whole's row
        resolve_values(self._values, self._wants_values)
        resolve_hists(self._hists, self._hist_range, self._wants_hist)
        resolve_tokens(self._tokens, self._wants_tokens)
        self._resolve_channels()
        for stats, idx in self._handed_out:
            fill(stats, out[idx])
            if idx in lost:
                stats.note = f"{stats.note}; {lost[idx]}" if stats.note else lost[idx]
        self.book.scale_gradients(self._handed_out)  # (a data-parallel batch's: ÷ W)
        ShardBook.tidy(self._handed_out, merged, SMALL)  # no rank's own extras on a merged row
        for kept in (
            self._handed_out, self._wants_values, self._wants_hist, self._rows, self._wants_tokens,
            self._wants_chan,
        ):  # fmt: skip
            kept.clear()
        for table in (
            self._notes, self._values, self._hists, self._hist_range, self._seen, self._tokens,
            self._chan, self._row_padded,
        ):  # fmt: skip
            table.clear()

    def _resolve_channels(self) -> None:
        """--channels: every packed vector to the host, unpacked into each TensorStats that
        wants it (channels.resolve)."""
        if self._wants_chan:
            resolve(self._chan, self._wants_chan, self.channel_hist, self._real_index,
                    self.token_mask)  # fmt: skip


_CPU_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def tensor_stats(t: torch.Tensor, path: str = "tensor") -> TensorStats:
    """Statistics of one tensor, computed and returned at once (tests, small uses)."""
    collector = StatsCollector()
    stats = collector.add(t, path)
    collector.finalize()
    return stats
