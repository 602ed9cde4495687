"""What a diff measures, shared by every kind of compared side (the hooked passes in
passes.py, ONNX Runtime in onnx.py) and by the diff of two saved reports (saved.py): the
reference side's tensors spilled to disk, the five sums of one difference accumulated exactly
across batches, what one compared side collects, and how a call past tolerance is named.
"""

from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os
import tempfile
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard

import numpy as np
import torch

from hookcli.commands.diff import ondevice
from hookcli.commands.diff.tokens import TokenAccumulator
from hookcli.engine.measure import rows_only
from hookcli.engine.tensorbits import ATTENTION, FLAT, padding_of, unpadded
from hookcli.errors import UsageError
from hookcli.records import DiffCall, TensorDiff
from hookcli.sources.model import LoadedModel

Key = tuple[str, int, str]  # (layer name, call, tensor path: "out", "out[0]", "in[1]", "scores")
# a call's reference tensor by its path: a host array, or on CUDA the tensor itself (ondevice)
Lookup = Callable[[str], "np.ndarray[Any, Any] | torch.Tensor | None"]


def kept(t: torch.Tensor) -> np.ndarray[Any, Any] | torch.Tensor:
    """A reference tensor as a compared pass side by side reads it: where it is on CUDA (the
    reference pass waits while it is read: commands/diff/ondevice.py), else `as_array`."""
    t = dense(t)
    return t.detach() if ondevice.on_device(t) else as_array(t)


def dense(t: torch.Tensor) -> torch.Tensor:
    """A sparse tensor (COO, CSR, …) as its dense values, zeros included, as inspect measures
    it; any other as it is."""
    return t if t.layout is torch.strided else t.to_dense()


def as_array(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A reference tensor as the comparisons read it: on the CPU, contiguous, half precisions
    widened to float32 (a view of the tensor itself when it already is all that)."""
    x = dense(t.detach())
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    return x.contiguous().cpu().numpy()


class Sink(Protocol):
    """Where the reference side's pass puts each call's tensors: the spill, or (lockstep.py)
    a compared pass running beside it."""

    def put(self, name: str, call: int, kind: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """One call's inputs (kind "in") or outputs ("out"; the model's own under "(model)")."""


class Reference(Protocol):
    """Where a compared pass reads the reference side's tensors from."""

    @property
    def index(self) -> Collection[Key]:
        """Every tensor the reference side put, by key."""

    def get(self, name: str, call: int, kind: str) -> AbstractContextManager[Lookup]:
        """One call's tensors, readable by path inside the `with`."""

    def pace(self) -> None:
        """Before each call of the compared pass (side by side: the reference's turn)."""


class Spill:
    """The reference side's tensors, on disk: written as hooks see them, read back one at a
    time. Nothing of them stays in memory.

    The file is unlinked the moment it is created: only its descriptor reaches it, so it
    cannot outlive the process, however that ends (SIGTERM, SIGKILL, the OOM killer). Writes
    and reads go through the descriptor (pwrite/preadv: no buffering, no seek).

    A large tensor is read back by mapping its pages of the file (MAP_POPULATE: mapped in one
    go, no copy); the mapping goes when the last array viewing it does, so at most the tensor
    being compared is mapped. Each tensor starts on a page boundary for that.

    A failed write (a full TMPDIR) is kept in `failed`, not raised: hooks swallow errors to
    protect the user's forward, so the caller checks `raise_if_failed()` after the pass —
    else the missing tensor would show as a false "only on this side" divergence."""

    _MAP_FROM = 1 << 20  # below this, a plain read into a reused buffer is cheaper

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="hookcli-diff-", suffix=".spill")
        self.dir = os.path.dirname(self.path)
        try:
            os.unlink(self.path)  # the name goes now; the descriptor keeps the file
        except OSError:
            os.close(fd)
            raise
        self._fd: int | None = fd
        # one reused read buffer for small tensors, per thread: a forward that runs layers
        # in threads of its own reads (and writes) from several at once (issue 32)
        self._local = threading.local()
        self._lock = threading.Lock()  # the next free offset, taken by one write at a time
        self.index: dict[Key, tuple[int, np.dtype[Any], tuple[int, ...]]] = {}
        self._end = 0
        self.failed: OSError | None = None

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise ValueError("the spill file is closed")
        return self._fd

    def put(self, name: str, call: int, kind: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
        for path, t in tensors:
            self.write((name, call, path), t)

    @contextlib.contextmanager
    def get(self, name: str, call: int, kind: str) -> Iterator[Lookup]:
        yield lambda path: self.read((name, call, path))

    def pace(self) -> None:
        pass  # the reference pass is over

    def write(self, key: Key, t: torch.Tensor) -> None:
        if self.failed is not None:
            return  # the run stops after this pass; nothing more to keep
        arr = as_array(t)
        with self._lock:  # this tensor's region, reserved before it is written
            start = -(-self._end // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
            self._end = start + arr.nbytes
        data = arr.reshape(-1).view(np.uint8).data  # the bytes, no copy
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(self.fd, data[done:], start + done)
        except OSError as exc:
            self.failed = exc
            return
        self.index[key] = (start, arr.dtype, tuple(arr.shape))

    def raise_if_failed(self) -> None:
        """The write error, if any, as the one-line error it is for the user."""
        exc = self.failed
        if exc is None:
            return
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise UsageError(
                f"no space left in TMPDIR ({self.dir}) for diff's spill file "
                f"({self._end / 2**20:.0f} MB written of the reference side's outputs, "
                f"{os.strerror(exc.errno)}).",
                "set TMPDIR to a larger disk (TMPDIR=/path/with/space hookcli diff …), or "
                "select fewer layers with -l.",
            )
        raise UsageError(
            f"could not write diff's spill file in TMPDIR ({self.dir}): {exc.strerror or exc}.",
            "set TMPDIR to a writable local disk.",
        )

    def read(self, key: Key) -> np.ndarray[Any, Any] | None:
        """The tensor written under key: a read-only view of its mapped pages, or (small
        tensors) a view of a buffer that this thread's next read reuses."""
        found = self.index.get(key)
        if found is None:
            return None
        offset, dtype, shape = found
        count = int(np.prod(shape)) if shape else 1
        nbytes = count * dtype.itemsize
        if nbytes >= self._MAP_FROM:
            pages = mmap.mmap(
                self.fd,
                nbytes,
                flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                prot=mmap.PROT_READ,
                offset=offset,
            )
            return np.frombuffer(pages, dtype=dtype, count=count).reshape(shape)
        buf: bytearray = getattr(self._local, "buf", bytearray())
        if len(buf) < nbytes:
            buf = self._local.buf = bytearray(nbytes)
        view = memoryview(buf)[:nbytes]
        got = 0
        while got < nbytes:
            n = os.preadv(self.fd, [view[got:]], offset + got)
            if n == 0:
                raise OSError(f"the spill file in {self.dir} was cut short")
            got += n
        return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)

    def reset(self) -> None:
        """Empty for the next batch; the file keeps its pages, overwritten in place."""
        self.index.clear()
        self._end = 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ---------------------------------------------------------------- accumulated differences


@dataclass(slots=True)
class ErrorSums:
    """The sums of one (call, tensor) difference; they add exactly across batches."""

    shape: tuple[int, ...]
    numel: int = 0
    sd: float = 0.0  # Σ(b - a)²
    sa: float = 0.0  # Σa²
    sb: float = 0.0  # Σb²
    sab: float = 0.0  # Σab
    max_abs: float = 0.0
    nonfinite: int = 0
    notes: set[str] = field(default_factory=set)
    # a (batch, tokens, C) model output: Σ(b - a)² and Σa² of each position, (batch, tokens)
    rows: tuple[Any, Any] | None = None  # (on a device until `settle`)
    # sums measured on a device this pass, not yet brought over (`settle`): each tensor's
    # ondevice.sums, its element count and the compared tensor's dtype
    pending: list[tuple[torch.Tensor, int, torch.dtype]] = field(default_factory=list)

    def add(self, sums: np.ndarray[Any, Any], numel: int) -> None:
        self.sd += float(sums[0])
        self.sa += float(sums[1])
        self.sb += float(sums[2])
        self.sab += float(sums[3])
        self.max_abs = max(self.max_abs, float(sums[4]))
        self.nonfinite += int(sums[5])
        self.numel += numel

    def merge(self, other: ErrorSums) -> None:
        """Another process's sums of the same difference added in (torchrun)."""
        assert not self.pending, "device sums not settled"
        assert not other.pending, "device sums not settled"
        self.sd += other.sd
        self.sa += other.sa
        self.sb += other.sb
        self.sab += other.sab
        self.max_abs = max(self.max_abs, other.max_abs)
        self.nonfinite += other.nonfinite
        self.numel += other.numel
        self.notes |= other.notes
        self.rows = None  # positions of other batches: not one (batch, tokens) grid

    def result(self, path: str, tol: float) -> TensorDiff:
        d = TensorDiff(path, self.shape, self.numel, nonfinite=self.nonfinite)
        d.note = "; ".join(sorted(self.notes)) or None
        if self.notes and self.numel == 0:
            d.over = True
            return d
        if self.nonfinite:
            # values not finite on either side: no metric over what is left (a row of NaN on
            # both sides is not "identical"); the row is flagged with the count and the why
            d.over = True
            return d
        d.max_abs = self.max_abs
        if self.sa > 0:
            d.rel_l2 = math.sqrt(self.sd / self.sa)
            d.norm_rel = (math.sqrt(self.sb) - math.sqrt(self.sa)) / math.sqrt(self.sa)
            d.sqnr_db = 10 * math.log10(self.sa / self.sd) if self.sd > 0 else None
        elif self.sd == 0:
            d.rel_l2 = 0.0
        if self.sa > 0 and self.sb > 0:
            d.cosine = max(-1.0, min(1.0, self.sab / math.sqrt(self.sa * self.sb)))
        d.over = self.nonfinite > 0 or d.rel_l2 is None or d.rel_l2 > tol
        if self.rows is not None:
            sd, sa = self.rows
            d.per_position = [
                [math.sqrt(e / r) if r > 0 else None for e, r in zip(es, rs, strict=True)]
                for es, rs in zip(sd.tolist(), sa.tolist(), strict=True)
            ]
        return d


# numba's parallel kernels, one call at a time: compared passes may measure in threads of their
# own (lockstep.py without greenlet), and numba's fallback threading layer (workqueue) cannot
# take two at once
_PARALLEL = threading.Lock()


def sums(ref: np.ndarray[Any, Any], got: torch.Tensor) -> np.ndarray[Any, Any]:
    from hookcli.engine.stats import kernels

    ks = kernels()
    x = got.detach().cpu()
    out = np.zeros(6, dtype=np.float64)
    if (
        ks is not None
        and x.dim() == 4
        and not x.is_contiguous()
        and x.is_contiguous(memory_format=torch.channels_last)
        and x.dtype in (torch.float32, torch.bfloat16)
        and ref.dtype in (np.float32, np.float64)
    ):  # channels-last: read in its own order, no copy into the reference's layout
        nhwc = x.permute(0, 2, 3, 1)  # its own memory order: contiguous, no copy
        b4 = nhwc.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else nhwc.numpy()
        with _PARALLEL:
            ks.diff_nhwc(np.ascontiguousarray(ref), b4, out)
        return out
    x = x.contiguous()
    if x.dtype == torch.bfloat16:  # the kernel reads bfloat16 bits itself: no float copy
        b = x.view(torch.uint16).numpy().reshape(-1)
    else:
        b = (x.float() if x.dtype == torch.float16 else x).numpy().reshape(-1)
    a = ref.reshape(-1)
    if b.dtype not in (a.dtype, np.uint16):
        wide = np.promote_types(a.dtype, b.dtype)
        a, b = a.astype(wide, copy=False), b.astype(wide, copy=False)
    if ks is not None and a.size >= 1 << 15:
        with _PARALLEL:
            ks.diff[1](a, b, out)
        return out
    if ks is not None and a.size:
        ks.diff[0](a, b, out)
        return out
    if b.dtype == np.uint16:  # bfloat16 bits → float32
        b = (b.astype(np.uint32) << 16).view(np.float32)
    fa, fb = a.astype(np.float64), b.astype(np.float64)  # no numba: the same sums, numpy
    finite = np.isfinite(fa) & np.isfinite(fb)
    fa, fb = np.where(finite, fa, 0.0), np.where(finite, fb, 0.0)
    d = fb - fa
    top = float(np.abs(d).max()) if d.size else 0.0
    return np.array([d @ d, fa @ fa, fb @ fb, fa @ fb, top, float((~finite).sum())])


def _absorb(into: dict[str, ErrorSums], accs: Mapping[str, ErrorSums]) -> None:
    for path, acc in accs.items():
        mine = into.setdefault(path, ErrorSums(acc.shape))
        mine.merge(acc)


SCORES = ("(model)", 0, "scores")  # the reference side's class scores, in the spill
TOPK = 5  # the top-k of prediction agreement


def class_scores(loaded: LoadedModel, output: Any) -> torch.Tensor | None:
    """The (images, classes) scores of a classifier's output (torchvision, timm, an HF
    model's logits; int8 ones dequantized); None for other tasks and for a user's model, whose
    output is not known to be class scores."""
    from hookcli.sources.tasks import Classification, Custom

    kind = loaded.kind
    if not isinstance(kind, Classification) or isinstance(kind, Custom):
        return None
    out = kind.select(output)
    if isinstance(out, Mapping) and isinstance(out.get("logits"), torch.Tensor):
        out = out["logits"]  # a Hugging Face ModelOutput
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[1] < 2:
        return None
    if out.is_quantized:
        out = out.dequantize()
    return out.detach() if out.is_floating_point() else None


@dataclass(slots=True)
class Agreement:
    """One compared side's predictions against the reference's, over every image so far:
    top-1 the same or flipped (and where), and the overlap of the top-k classes."""

    k: int = TOPK
    images: int = 0
    same: int = 0
    overlap: float = 0.0  # Σ over images of |top-k ref ∩ top-k side| / k
    # (image index, its name or None, the reference's top-1, the side's; None: not finite)
    flips: list[tuple[int, str | None, int | None, int | None]] = field(default_factory=list)

    def add(
        self, ref: np.ndarray[Any, Any] | torch.Tensor, got: torch.Tensor, names: Sequence[str]
    ) -> None:
        if isinstance(ref, torch.Tensor):  # on the device: once a pass, the scores come over
            a = ref.detach().to("cpu", torch.float64)
        else:
            a = torch.from_numpy(np.array(ref, dtype=np.float64))  # a copy: the buffer is reused
        b = got.detach().cpu().double()
        if tuple(a.shape) != tuple(b.shape):
            return
        self.k = min(TOPK, a.shape[1])
        top_a, top_b = a.topk(self.k, dim=1).indices, b.topk(self.k, dim=1).indices
        fin_a, fin_b = torch.isfinite(a).all(dim=1), torch.isfinite(b).all(dim=1)
        for i in range(a.shape[0]):
            ra = int(top_a[i, 0]) if fin_a[i] else None
            rb = int(top_b[i, 0]) if fin_b[i] else None
            if ra is not None and ra == rb:
                self.same += 1
            else:
                name = names[i] if i < len(names) else None
                self.flips.append((self.images + i, name, ra, rb))
            if fin_a[i] and fin_b[i]:
                both = set(top_a[i].tolist()) & set(top_b[i].tolist())
                self.overlap += len(both) / self.k
        self.images += a.shape[0]

    def merge(self, other: Agreement) -> None:
        """Another process's images added in (their flips' indices already global)."""
        self.k = min(self.k, other.k)
        self.images += other.images
        self.same += other.same
        self.overlap += other.overlap
        self.flips = sorted([*self.flips, *other.flips], key=lambda f: f[0])

    def result(self, side: str, against: str, labels: Sequence[str] | None) -> dict[str, Any]:
        """As the report's JSON carries it."""

        def label(i: int | None) -> str | None:
            return labels[i] if labels is not None and i is not None and i < len(labels) else None

        return {
            "side": side,
            "against": against,
            "images": self.images,
            "top1_same": self.same,
            "top1_flips": len(self.flips),
            "flipped": [
                {
                    "index": i,
                    "image": name,
                    "ref": ra,
                    "side": rb,
                    "ref_label": label(ra),
                    "side_label": label(rb),
                }
                for i, name, ra, rb in self.flips
            ],
            "topk": self.k,
            "topk_overlap": self.overlap / self.images if self.images else None,
        }


@dataclass(slots=True)
class Compared:
    """What one compared side accumulates over every batch."""

    calls: dict[tuple[str, int], tuple[str, dict[str, ErrorSums]]] = field(default_factory=dict)
    order: dict[tuple[str, int], int] = field(default_factory=dict)  # return order
    outputs: dict[str, ErrorSums] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)
    agreement: Agreement | None = None  # None: no class scores on both sides
    # a causal LM's text: the next-token distributions against the reference's (issue 53)
    tokens: TokenAccumulator | None = None
    texts_before: int = 0  # a corpus in batches: the texts of the batches before this one
    tokens_skipped: str | None = None  # why the sides' logits could not be compared

    def add_calls(
        self,
        calls: Mapping[tuple[str, int], tuple[str, Mapping[str, ErrorSums]]],
        order: Mapping[tuple[str, int], int],
    ) -> None:
        """One pass's calls added in (a later batch's: the first batch's order stays)."""
        self._add_sums(calls)
        for key, rank in order.items():
            self.order.setdefault(key, rank)

    def _add_sums(
        self, calls: Mapping[tuple[str, int], tuple[str, Mapping[str, ErrorSums]]]
    ) -> None:
        for key, (type_, accs) in calls.items():
            _, mine = self.calls.setdefault(key, (type_, {}))
            _absorb(mine, accs)

    def absorb(self, other: Compared) -> None:
        """Another process's sums merged in (torchrun): its calls after this one's."""
        self._add_sums(other.calls)
        for key, rank in other.order.items():
            self.order[key] = min(self.order.get(key, rank), rank)
        _absorb(self.outputs, other.outputs)
        self.missing |= other.missing
        if other.agreement is not None:
            self.agreement = self.agreement or Agreement()
            self.agreement.merge(other.agreement)
        if other.tokens is not None:
            self.tokens = self.tokens or TokenAccumulator()
            self.tokens.absorb(other.tokens)

    def agree(
        self,
        ref: np.ndarray[Any, Any] | torch.Tensor | None,
        scores: torch.Tensor | None,
        names: Sequence[str],
    ) -> None:
        """This side's class scores against the reference's."""
        if scores is None or ref is None:
            return
        if self.agreement is None:
            self.agreement = Agreement()
        self.agreement.add(ref, scores, names)

    def note_missing(self, index: Iterable[Key], why: str) -> None:
        """Reference calls this side never produced an output for."""
        for name, call, path in index:
            if name != "(model)" and not path.startswith("in[") and (name, call) not in self.calls:
                self.missing.add(f"{name} call {call}: {why}")


class RealPositions:
    """A padded text batch's real positions, which alone enter a difference's sums: a tensor
    holding the batch's positions (engine/tensorbits.padding_of, the rule inspect's statistics
    follow) is compared at those only."""

    def __init__(self, mask: torch.Tensor, rows_only: frozenset[str]) -> None:
        self.shape = tuple(mask.shape)
        self.index = mask.reshape(-1).nonzero().squeeze(1)
        self.host = self.index.cpu().numpy()
        self.rows_only = rows_only

    @classmethod
    def of_pass(cls, mask: torch.Tensor | None, targets: Any, model: Any) -> RealPositions | None:
        """A pass's real positions: None where its input is no padded text batch."""
        return None if mask is None else cls(mask, rows_only(targets, model))

    def how(self, shape: Sequence[int], context: Key | None, path: str) -> int:
        return padding_of(shape, self.shape, context, path, self.rows_only)

    def of(self, x: Any, how: int) -> Any:
        """x's real positions (a host array's, or a tensor's), as `unpadded` lays them out."""
        if isinstance(x, torch.Tensor):
            return unpadded(x, self.index, how)
        if how == ATTENTION:
            x = np.swapaxes(x, 1, 2)
        if how != FLAT:
            x = x.reshape((-1, *x.shape[2:]))
        return x[self.host]


def measure(
    accs: dict[str, ErrorSums],
    path: str,
    ref: np.ndarray[Any, Any] | torch.Tensor | None,
    got: torch.Tensor,
    *,
    positions: bool = False,
    real: RealPositions | None = None,
    context: Key | None = None,
) -> None:
    """One tensor against the reference's, into its accumulator. `positions`: the model's
    output, whose (batch, tokens, C) tensors also get each position's error. `real`: a padded
    batch's real positions, only they compared (padding left out), in the call `context`."""
    got = dense(got)
    acc = accs.setdefault(path, ErrorSums(tuple(got.shape)))
    if ref is None:
        acc.notes.add("only on this side")
        return
    if tuple(ref.shape) != tuple(got.shape):
        acc.notes.add(f"shapes differ: {shape_label(ref.shape)} vs {shape_label(tuple(got.shape))}")
        return
    first = acc.numel + sum(n for _, n, _ in acc.pending) == 0  # got is all there is
    how = 0 if real is None else real.how(got.shape, context, path)
    rows = positions and first and got.dim() == 3 and got.is_floating_point()
    if isinstance(ref, torch.Tensor):  # on CUDA, side by side (ondevice.py)
        same = ref.device == got.device and ondevice.on_device(got)
        if same and _there(acc, ref, got, rows=rows, real=real if how else None, how=how):
            return
        # another device (the int8 twin's CPU), another stream: as a host array
        ref = as_array(ondevice.after_writes(ref))
    a, b = (real.of(ref, how), real.of(got, how)) if how and real else (ref, got)
    got_sums = sums(a, b)
    if got_sums[5] and not acc.nonfinite:  # the first time this tensor parts ways
        acc.notes.add(why_not_finite(a, b))
    acc.add(got_sums, b.numel())
    if rows:  # (one batch's positions, padding among them)
        acc.rows = position_sums(ref, got)
    elif not first:  # (a folder of batches keeps none)
        acc.rows = None


def _there(
    acc: ErrorSums,
    ref: torch.Tensor,
    got: torch.Tensor,
    *,
    rows: bool,
    real: RealPositions | None,
    how: int,
) -> bool:
    """`measure` on the device: the sums (and the output's per-position errors) kept there
    until `settle`; False when their float64 working copies do not fit (the host measures)."""
    a, b = (real.of(ref, how), real.of(got, how)) if real else (ref, got)
    try:
        measured = ondevice.sums(a, b)
        at = ondevice.position_sums(ref, got) if rows else None
    except torch.OutOfMemoryError:
        return False
    acc.pending.append((measured, b.numel(), got.dtype))
    acc.rows = at
    return True


POSITION_CHUNK = 1 << 22  # elements of the float64 working copies position_sums makes at once


def position_sums(
    ref: np.ndarray[Any, Any], got: torch.Tensor
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Σ(b - a)² and Σa² over the last dimension, per (sequence, position), in float64."""
    a = np.asarray(ref)
    if a.dtype == np.uint16:  # bfloat16 bits
        a = (a.astype(np.uint32) << 16).view(np.float32)
    ref_t = torch.from_numpy(np.ascontiguousarray(a))
    got_t = got.detach().cpu()
    batch, tokens, width = got_t.shape
    sd = np.zeros((batch, tokens))
    sa = np.zeros((batch, tokens))
    step = max(1, POSITION_CHUNK // max(width, 1))  # float64 copies of a few positions at a time
    for b in range(batch):
        for t in range(0, tokens, step):
            a64 = ref_t[b, t : t + step].double()
            d64 = got_t[b, t : t + step].double() - a64
            sd[b, t : t + step] = (d64 * d64).sum(-1).numpy()
            sa[b, t : t + step] = (a64 * a64).sum(-1).numpy()
    return sd, sa


def why_not_finite(ref: np.ndarray[Any, Any], got: torch.Tensor) -> str:
    """Why a compared tensor holds values that are not finite, when it can be told from the two
    sides: the reference's were not finite either, or they were and exceed what the compared
    side's dtype holds (an overflow: float16 ends at 65504), or the compared side made them from
    finite reference values. Runs only when NaN/Inf first appear in a tensor."""
    a = np.asarray(ref)
    if a.dtype == np.uint16:  # bfloat16 bits
        a = (a.astype(np.uint32) << 16).view(np.float32)
    b = got.detach().cpu()
    b = b.dequantize() if b.is_quantized else b
    bad_a = int(a.size - np.count_nonzero(np.isfinite(a)))  # in their own dtypes: no copies
    bad_b = int(b.numel() - torch.isfinite(b).sum())
    top = float(np.abs(a).max()) if a.size and not bad_a else 0.0
    return _why(bad_a, bad_b, top, b.dtype)


def _why(bad_a: int, bad_b: int, top: float, dtype: torch.dtype) -> str:
    """why_not_finite's words, from the counts of values not finite on each side, the
    reference's largest |x| and the compared side's dtype."""
    if bad_a and not bad_b:
        return f"the reference side holds {bad_a} values not finite, this side none"
    if bad_a:
        return f"not finite on both sides ({bad_a} on the reference, {bad_b} here)"
    if dtype.is_floating_point:
        limit = float(torch.finfo(dtype).max)
        name = str(dtype).removeprefix("torch.")
        if top > limit:
            return f"overflow: the reference's max |x| {top:.3g} exceeds {name}'s {limit:.6g}"
        return (
            f"{bad_b} values not finite made from finite reference values "
            f"(max |x| {top:.3g}, within {name}'s {limit:.6g})"
        )
    return f"{bad_b} values not finite made from finite reference values (max |x| {top:.3g})"


def settle(accs: Iterable[ErrorSums]) -> None:
    """Every device sum of these accumulators brought over in one transfer per device and
    added in the order measured, as the CPU's are when measured; a tensor's first NaN/Inf
    noted as on the CPU."""
    waiting = [acc for acc in accs if acc.pending or _on_device(acc.rows)]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for acc in waiting:
        for t, _, _ in acc.pending:
            by_device.setdefault(t.device, []).append(t)
        if _on_device(acc.rows):
            by_device.setdefault(acc.rows[0].device, []).extend(acc.rows)
    host: dict[int, Any] = {}
    for parts in by_device.values():
        flat = torch.cat([p.reshape(-1) for p in parts]).cpu().numpy()  # the one transfer
        at = 0
        for p in parts:
            host[id(p)] = flat[at : at + p.numel()].reshape(tuple(p.shape))
            at += p.numel()
    for acc in waiting:
        for t, numel, dtype in acc.pending:
            got = host[id(t)]
            if got[5] and not acc.nonfinite:  # the first time this tensor parts ways
                acc.notes.add(_why(int(got[6]), int(got[7]), float(got[8]), dtype))
            acc.add(got[:6], numel)
        acc.pending = []
        if _on_device(acc.rows):
            acc.rows = (host[id(acc.rows[0])], host[id(acc.rows[1])])


def _on_device(rows: Any) -> TypeGuard[tuple[torch.Tensor, torch.Tensor]]:
    return rows is not None and isinstance(rows[0], torch.Tensor)


def shape_label(s: Sequence[int]) -> str:
    return "x".join(map(str, s)) or "scalar"


def describe_over(call: DiffCall, d: TensorDiff, tol: float) -> str:
    """A call past tolerance, as the report's `first_over` names it."""
    side = "A" if call.a and d in call.a else "B"
    if d.nonfinite:
        what = f"{d.nonfinite} values not finite" + (f" ({d.note})" if d.note else "")
    else:
        what = d.note or f"relative L2 {d.rel_l2:.3g} > tol {tol:g}"
    return f"{call.name} ({call.type}) call {call.call}, {d.path}, side {side}: {what}"
