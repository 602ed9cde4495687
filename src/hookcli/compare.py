"""`hookcli diff`: where two runs of one model part ways, layer by layer.

A *side* is a variant of one model: a dtype (`float16`, `bfloat16`, `float64`), `autocast`
(`autocast:bfloat16`), `channels_last`, another `weights=…` or `seed=…`, another `device=…`,
combined with commas (`--b float16,channels_last`). Both sides run the same input through the
engine's hooked pass; every selected layer call's output is aligned by module name, call index
and tensor path, and measured against the reference: max|Δ|, relative L2, cosine, SQNR (dB),
accumulated in float64 over the elements finite on both sides.

The reference side runs first and its outputs spill to a temporary file the moment a hook sees
them; the compared side reads each one back when its own hook fires and keeps only the five
sums a difference needs. Peak memory is one activation, whatever the number of layers; the
sums add exactly across batches (folders). `--isolate` feeds each selected layer the reference
side's input, so a row shows that layer's own error rather than what it inherited; `--ref SIDE`
(e.g. float64) measures both sides against a third run, to say which one is wrong.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import math
import mmap
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from hookcli import beacon, bounds, isa
from hookcli._version import __version__
from hookcli.engine import Prepared, hooked_pass, model_input, prepare
from hookcli.errors import UsageError
from hookcli.hooks import HookSession, PendingCall, iter_tensors
from hookcli.inputs import ModelInput, expand_paths
from hookcli.options import InputOptions, ModelOptions, Selection
from hookcli.records import DiffCall, DiffReport, InputInfo, ModelInfo, TensorDiff
from hookcli.selection import count_params

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
SIDE_HELP = (
    "float32|float64|float16|bfloat16, autocast[:DTYPE], channels_last, quantized, compile, "
    "onnx, weights=W, seed=N, device=D; joined with commas"
)


@dataclass(frozen=True, slots=True)
class Side:
    """One variant of the model."""

    spec: str
    dtype: torch.dtype | None = None
    autocast: torch.dtype | None = None
    channels_last: bool = False
    weights: str | None = None
    seed: int | None = None
    device: str | None = None
    quantized: bool = False  # torchvision's int8 twin, calibrated on the run's input
    compile: bool = False  # each selected leaf module through torch.compile (inductor)
    onnx: bool = False  # exported with torch.onnx (dynamo), run by ONNX Runtime on the CPU

    def describe(self) -> str:
        return self.spec or "as loaded"


def parse_side(raw: str, option: str) -> Side:
    fields: dict[str, Any] = {}
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.lower()
        if key in _DTYPES and not sep:
            fields["dtype"] = _DTYPES[key]
        elif key.startswith("autocast") and not sep:
            name = key.partition(":")[2] or "bfloat16"
            if name not in ("bfloat16", "float16"):
                raise UsageError(
                    f"{option} {raw!r}: autocast has no dtype {name!r}; "
                    "its dtypes are bfloat16 and float16.",
                    f"e.g. {option} autocast:bfloat16 (or {option} quantized for int8).",
                )
            fields["autocast"] = _DTYPES[name]
        elif key in ("channels_last", "nhwc") and not sep:
            fields["channels_last"] = True
        elif key in ("quantized", "int8") and not sep:
            fields["quantized"] = True
        elif key == "compile" and not sep:
            fields["compile"] = True
        elif key in ("onnx", "onnxruntime", "ort") and not sep:
            fields["onnx"] = True
        elif key in ("weights", "device") and sep and value:
            fields[key] = value
        elif key == "seed" and sep and value.strip().lstrip("-").isdigit():
            fields["seed"] = bounds.integer(
                value.strip(), f"{option} seed", low=0, high=bounds.SEED_MAX, example="seed=1"
            )
        else:
            raise UsageError(
                f"{option} {raw!r}: {part!r} is not a side.", f"a side is made of: {SIDE_HELP}."
            )
    return Side(raw.strip(), **fields)


# ---------------------------------------------------------------- the spill file


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
        self._buf = bytearray()  # one reused read buffer for small tensors
        self.index: dict[tuple[str, int, str], tuple[int, np.dtype[Any], tuple[int, ...]]] = {}
        self._end = 0
        self.failed: OSError | None = None

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise ValueError("the spill file is closed")
        return self._fd

    def write(self, key: tuple[str, int, str], t: torch.Tensor) -> None:
        if self.failed is not None:
            return  # the run stops after this pass; nothing more to keep
        x = t.detach()
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        arr = x.contiguous().cpu().numpy()
        start = -(-self._end // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
        data = arr.reshape(-1).view(np.uint8).data  # the bytes, no copy
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(self.fd, data[done:], start + done)
        except OSError as exc:
            self.failed = exc
            return
        self.index[key] = (start, arr.dtype, tuple(arr.shape))
        self._end = start + arr.nbytes

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

    def read(self, key: tuple[str, int, str]) -> np.ndarray[Any, Any] | None:
        """The tensor written under key: a read-only view of its mapped pages, or (small
        tensors) a view of a buffer that the next read reuses."""
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
        if len(self._buf) < nbytes:
            self._buf = bytearray(nbytes)
        view = memoryview(self._buf)[:nbytes]
        got = 0
        while got < nbytes:
            n = os.preadv(self.fd, [view[got:]], offset + got)
            if n == 0:
                raise OSError(f"the spill file in {self.dir} was cut short")
            got += n
        return np.frombuffer(self._buf, dtype=dtype, count=count).reshape(shape)

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
class _Acc:
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

    def add(self, sums: np.ndarray[Any, Any], numel: int) -> None:
        self.sd += float(sums[0])
        self.sa += float(sums[1])
        self.sb += float(sums[2])
        self.sab += float(sums[3])
        self.max_abs = max(self.max_abs, float(sums[4]))
        self.nonfinite += int(sums[5])
        self.numel += numel

    def result(self, path: str, tol: float) -> TensorDiff:
        d = TensorDiff(path, self.shape, self.numel, nonfinite=self.nonfinite)
        d.note = "; ".join(sorted(self.notes)) or None
        if self.notes and self.numel == 0:
            d.over = True
            return d
        d.max_abs = self.max_abs
        if self.sa > 0:
            d.rel_l2 = math.sqrt(self.sd / self.sa)
            d.norm_rel = abs(math.sqrt(self.sb) - math.sqrt(self.sa)) / math.sqrt(self.sa)
            d.sqnr_db = 10 * math.log10(self.sa / self.sd) if self.sd > 0 else None
        elif self.sd == 0:
            d.rel_l2 = 0.0
        if self.sa > 0 and self.sb > 0:
            d.cosine = max(-1.0, min(1.0, self.sab / math.sqrt(self.sa * self.sb)))
        d.over = self.nonfinite > 0 or d.rel_l2 is None or d.rel_l2 > tol
        return d


def _sums(ref: np.ndarray[Any, Any], got: torch.Tensor) -> np.ndarray[Any, Any]:
    from hookcli.stats import kernels

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
        b4 = x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy()
        ks.diff_nhwc(ref, b4, out)
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
    if ks is not None and a.size:
        (ks.diff[1] if a.size >= 1 << 15 else ks.diff[0])(a, b, out)
        return out
    if b.dtype == np.uint16:  # bfloat16 bits → float32
        b = (b.astype(np.uint32) << 16).view(np.float32)
    fa, fb = a.astype(np.float64), b.astype(np.float64)  # no numba: the same sums, numpy
    finite = np.isfinite(fa) & np.isfinite(fb)
    fa, fb = np.where(finite, fa, 0.0), np.where(finite, fb, 0.0)
    d = fb - fa
    top = float(np.abs(d).max()) if d.size else 0.0
    return np.array([d @ d, fa @ fa, fb @ fb, fa @ fb, top, float((~finite).sum())])


# ---------------------------------------------------------------- sides


@dataclass(slots=True)
class _Run:
    side: Side
    prepared: Prepared


def _prepare_side(
    model: ModelOptions, selection: Selection, side: Side, *, with_input: InputOptions | None
) -> _Run:
    base = model.model
    if isinstance(base, nn.Module) and (side.dtype or side.channels_last or side.compile):
        base = copy.deepcopy(base)  # the Python API's own module: never changed in place
    options = dataclasses.replace(
        model,
        model=base,
        weights=side.weights if side.weights is not None else model.weights,
        seed=side.seed if side.seed is not None else model.seed,
        device=side.device if side.device is not None else model.device,
    )
    prepared = prepare(options, selection, with_input)
    module = prepared.loaded.module
    if side.dtype is not None:
        module.to(side.dtype)
    if side.channels_last:
        module.to(memory_format=torch.channels_last)
    if side.compile:
        _compile_leaves(prepared)
    return _Run(side, prepared)


def _compile_leaves(prepared: Prepared) -> None:
    """Each selected leaf module's forward through torch.compile (inductor), its hooks left
    outside the compiled code, so each row shows that layer's compiled numerics. (A whole-model
    torch.compile would break its graph at every hook anyway.) The first run compiles: seconds
    per distinct layer."""
    for t in prepared.targets:
        if next(t.module.children(), None) is None:
            t.module.forward = torch.compile(t.module.forward)


def _cast_tensor(t: torch.Tensor, side: Side, device: torch.device) -> torch.Tensor:
    if t.is_floating_point():
        t = t.to(device, side.dtype) if side.dtype is not None else t.to(device)
        if side.channels_last and t.dim() == 4:
            t = t.contiguous(memory_format=torch.channels_last)
        return t
    return t.to(device)


def _cast(minput: ModelInput, side: Side, device: torch.device) -> ModelInput:
    def cast(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return _cast_tensor(a, side, device)
        if isinstance(a, list):
            return [cast(x) for x in a]
        return a

    return minput.replace_args(tuple(cast(a) for a in minput.args))


@contextlib.contextmanager
def _autocast(side: Side, device: torch.device) -> Iterator[None]:
    if side.autocast is None:
        yield
        return
    with torch.autocast(device.type, dtype=side.autocast):
        yield


def _quantizable_twin(run: _Run, selection: Selection, calibration: ModelInput) -> None:
    """torchvision's quantizable version of the model, with this side's weights and conv+bn
    (+relu) fused, so that every side has the same modules under the same names; for a
    `quantized` side, then prepared, calibrated on the run's first input and converted to
    int8 (CPU)."""
    from torch.ao import quantization as tq

    from hookcli.loading import _quiet_warnings, registry_names
    from hookcli.selection import module_entries, select

    p = run.prepared
    name = f"quantized_{p.loaded.name}"
    if name not in registry_names():
        twins = [n.removeprefix("quantized_") for n in registry_names() if n.startswith("quant")]
        raise UsageError(
            f"{p.loaded.spec} has no quantized twin in torchvision.",
            f"the quantized side works with: {', '.join(twins)}.",
        )
    if p.device.type != "cpu":
        raise UsageError("the quantized side runs on the CPU only.", "add --device cpu.")
    import torchvision

    with _quiet_warnings():  # torch.ao.quantization's deprecation notices: not the user's
        twin = torchvision.models.get_model(name, weights=None, quantize=False)
        twin.load_state_dict(p.loaded.module.float().state_dict())
        twin.eval()
        twin.fuse_model()
        if run.side.quantized:
            twin.qconfig = tq.get_default_qconfig("x86")  # type: ignore[no-untyped-call]
            tq.prepare(twin, inplace=True)  # type: ignore[no-untyped-call]
            with torch.no_grad():
                twin(*_cast(calibration, Side(""), p.device).args)
            tq.convert(twin, inplace=True)  # type: ignore[no-untyped-call]
    if not run.side.quantized and run.side.dtype is not None:
        twin.to(run.side.dtype)
    p.loaded.module = twin
    p.entries = module_entries(twin)
    p.targets = select(
        p.entries,
        layers=selection.layers,
        types=selection.types,
        depth=selection.depth,
        model_label=p.loaded.spec,
    )


# ---------------------------------------------------------------- the passes


def _real(output: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The floating-point tensors of an output; int8 (quantized) ones as their real values."""
    for path, t in iter_tensors(output, "out"):
        if t.is_quantized:
            yield path, t.dequantize()
        elif t.is_floating_point():
            yield path, t


def _reference_pass(run: _Run, minput: ModelInput, spill: Spill, isolate: bool) -> None:
    def keep_output(pending: PendingCall, output: Any) -> None:
        c = pending.call
        for path, t in _real(output):
            spill.write((c.name, c.call, path), t)

    def keep_input(pending: PendingCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        c = pending.call
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                spill.write((c.name, c.call, f"in[{i}]"), a)

    p = run.prepared
    session = HookSession(
        p.targets, None, on_output=keep_output, on_input=keep_input if isolate else None
    )
    with (
        _autocast(run.side, p.device),
        torch.no_grad(),
        hooked_pass(p, session, minput=minput) as result,
    ):
        for path, t in _real(result.output):
            spill.write(("(model)", 0, path), t)


@dataclass(slots=True)
class _Compared:
    """What one compared side accumulates over every batch."""

    calls: dict[tuple[str, int], tuple[str, dict[str, _Acc]]] = field(default_factory=dict)
    order: dict[tuple[str, int], int] = field(default_factory=dict)  # return order
    outputs: dict[str, _Acc] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)

    def note_missing(self, spill: Spill, why: str) -> None:
        """Reference calls this side never produced an output for."""
        for name, call, path in spill.index:
            if name != "(model)" and not path.startswith("in[") and (name, call) not in self.calls:
                self.missing.add(f"{name} call {call}: {why}")


def _compared_pass(
    run: _Run, minput: ModelInput, spill: Spill, isolate: bool, into: _Compared
) -> None:
    p = run.prepared

    def compare(pending: PendingCall, output: Any) -> None:
        c = pending.call
        _, accs = into.calls.setdefault((c.name, c.call), (c.type, {}))
        into.order.setdefault((c.name, c.call), pending.finished or 0)
        for path, t in _real(output):
            _measure(accs, path, spill.read((c.name, c.call, path)), t)

    def feed(pending: PendingCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        c = pending.call
        new = list(args)
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor) or not (a.is_floating_point() or a.is_quantized):
                continue
            ref = spill.read((c.name, c.call, f"in[{i}]"))
            if ref is None or tuple(ref.shape) != tuple(a.shape):
                continue
            x = torch.from_numpy(ref.copy())  # a copy: the read buffer is reused
            if a.is_quantized:  # an int8 layer: the reference input on the layer's own grid
                x = torch.quantize_per_tensor(x, a.q_scale(), a.q_zero_point(), a.dtype)
            else:
                x = x.to(a.device, a.dtype)
            if a.dim() == 4 and a.is_contiguous(memory_format=torch.channels_last):
                x = x.contiguous(memory_format=torch.channels_last)
            new[i] = x
        return tuple(new), kwargs

    session = HookSession(p.targets, None, on_output=compare, on_input=feed if isolate else None)
    with (
        _autocast(run.side, p.device),
        torch.no_grad(),
        hooked_pass(p, session, minput=minput) as result,
    ):
        for path, t in _real(result.output):
            _measure(into.outputs, path, spill.read(("(model)", 0, path)), t)
    into.note_missing(spill, "only on the reference side")


def _measure(
    accs: dict[str, _Acc], path: str, ref: np.ndarray[Any, Any] | None, got: torch.Tensor
) -> None:
    acc = accs.setdefault(path, _Acc(tuple(got.shape)))
    if ref is None:
        acc.notes.add("only on this side")
        return
    if tuple(ref.shape) != tuple(got.shape):
        acc.notes.add(f"shapes differ: {_shape(ref.shape)} vs {_shape(tuple(got.shape))}")
        return
    acc.add(_sums(ref, got), got.numel())


def _shape(s: Sequence[int]) -> str:
    return "x".join(map(str, s)) or "scalar"


# ---------------------------------------------------------------- the report


def diff_report(
    model: ModelOptions,
    selection: Selection,
    inputs: InputOptions,
    a: Side,
    b: Side,
    *,
    ref: Side | None = None,
    isolate: bool = False,
    tol: float = 1e-3,
    batch_size: int | None = None,
) -> DiffReport:
    """Side B (and, with a --ref side, side A) against the reference, per layer call."""
    tol = bounds.tolerance(tol, "--tol", "--tol 1e-3")
    if batch_size is not None:
        batch_size = bounds.integer(
            batch_size, "--batch-size", low=1, high=bounds.BATCH_MAX, example="--batch-size 32"
        )
    reference = ref or a
    compared = [a, b] if ref is not None else [b]
    if reference.onnx:
        raise UsageError(
            "the onnx side cannot be the reference (its layers are not hooked).",
            "put it on --b, e.g. --a float32 --b onnx.",
        )
    if isolate and any(s.onnx for s in compared):
        raise UsageError(
            "--isolate cannot feed layers inside ONNX Runtime.",
            "drop --isolate for the onnx side (its rows are accumulated error).",
        )
    batches = _batches(inputs, batch_size)
    twin = any(s.quantized for s in (reference, *compared))
    runs = [  # the input is built once, by the reference side, and cast for each side
        _prepare_side(
            model,
            Selection() if twin else selection,  # the twin's own modules are selected later
            s,
            with_input=None if batches or i else inputs,
        )
        for i, s in enumerate([reference, *compared])
    ]
    results = [_Compared() for _ in compared]
    labels = ["ref", "A", "B"][-len(runs) :]  # what a crash message calls each side
    spill = Spill()
    seen = 0
    first_input: ModelInput | None = None
    try:
        todo: list[InputOptions | None] = [*batches] if batches else [None]
        for batch in todo:
            base = runs[0].prepared
            if batch is not None:
                minput = model_input(base.loaded, batch, model.seed)
            else:
                assert base.minput is not None
                minput = base.minput
            if twin and first_input is None:  # every side the fused twin; int8 calibrated here
                for run in runs:
                    _quantizable_twin(run, selection, minput)
            first_input = first_input or minput
            spill.reset()
            with beacon.phase(f"diff side {labels[0]} ({runs[0].side.describe()})"):
                _reference_pass(runs[0], _cast(minput, reference, base.device), spill, isolate)
            spill.raise_if_failed()  # a tensor not spilled is not "only on this side"
            for label, run, into in zip(labels[1:], runs[1:], results, strict=True):
                side_input = _cast(minput, run.side, run.prepared.device)
                with beacon.phase(f"diff side {label} ({run.side.describe()})"):
                    if run.side.onnx:
                        from hookcli.onnx_side import onnx_pass

                        onnx_pass(run.prepared, side_input, spill, into)
                    else:
                        _compared_pass(run, side_input, spill, isolate, into)
            seen += minput.shapes()[0][0] if minput.shapes() else 1
    finally:
        spill.close()
    assert first_input is not None
    where = ", ".join(map(str, inputs.items[:2])) if batches else None
    return _report(runs, results, first_input, seen, isolate=isolate, tol=tol, folder=where)


def _batches(inputs: InputOptions, batch_size: int | None) -> list[InputOptions]:
    """Image folders in batches (the sums add exactly); other inputs: one pass."""
    paths = [x for x in inputs.items if isinstance(x, str)]
    if not paths or len(paths) != len(inputs.items):
        return []
    files = expand_paths(paths)
    size = batch_size or 32
    if batch_size is None and len(files) <= size:
        return []
    chunks = [files[i : i + size] for i in range(0, len(files), size)]
    return [
        dataclasses.replace(inputs, items=tuple(str(f.path) for f in chunk)) for chunk in chunks
    ]


def _report(
    runs: list[_Run],
    results: list[_Compared],
    minput: ModelInput,
    seen: int,
    *,
    isolate: bool,
    tol: float,
    folder: str | None,
) -> DiffReport:
    with_ref = len(results) == 2
    last = results[-1]
    calls: list[DiffCall] = []
    first: tuple[int, str] | None = None
    for key, (type_, accs) in last.calls.items():
        call = DiffCall(key[0], type_, key[1], [acc.result(p, tol) for p, acc in accs.items()])
        if with_ref:
            _, a_accs = results[0].calls.get(key, (type_, {}))
            call.a = [acc.result(p, tol) for p, acc in a_accs.items()]
        calls.append(call)
        over = [d for d in [*call.b, *(call.a or [])] if d.over]
        if over:
            rank = last.order.get(key, 0)
            if first is None or rank < first[0]:
                first = (rank, _describe_over(call, over[0], tol))
    outputs = [
        DiffCall("(model)", "output", 0, [a.result(p, tol) for p, a in last.outputs.items()])
    ]
    if with_ref:
        outputs[0].a = [acc.result(p, tol) for p, acc in results[0].outputs.items()]
    loaded = runs[0].prepared.loaded
    params = count_params(loaded.module)  # lazy parameters as materialised by the passes
    info = ModelInfo(loaded.name, loaded.spec, loaded.task, loaded.weights_label, params)
    notes = isa.notes()
    notes += [
        "--isolate: each selected layer was fed the reference side's input, so each row is "
        "that layer's own error"
        if isolate
        else "errors accumulate: each row includes what the layers before it passed on "
        "(--isolate separates a layer's own error)"
    ]
    description = minput.description
    if folder is not None:
        description = f"{seen} images from {folder}"
        notes.append(f"differences are over all {seen} images, summed exactly across batches")
    return DiffReport(
        model=info,
        input=InputInfo(description, minput.shapes(), minput.sources, minput.preprocessing),
        device=str(runs[0].prepared.device),
        a=runs[1].side.describe() if with_ref else runs[0].side.describe(),
        b=runs[-1].side.describe(),
        ref=runs[0].side.describe() if with_ref else None,
        isolate=isolate,
        tol=tol,
        calls=calls,
        outputs=outputs,
        first_over=first[1] if first else None,
        missing=sorted(set().union(*(r.missing for r in results))),
        notes=notes,
        hookcli_version=__version__,
    )


def _describe_over(call: DiffCall, d: TensorDiff, tol: float) -> str:
    side = "A" if call.a and d in call.a else "B"
    what = (
        f"{d.nonfinite} values not finite"
        if d.nonfinite
        else d.note or f"relative L2 {d.rel_l2:.3g} > tol {tol:g}"
    )
    return f"{call.name} ({call.type}) call {call.call}, {d.path}, side {side}: {what}"


# ---------------------------------------------------------------- two saved reports


def diff_saved(path_a: str, path_b: str, tol: float = 1e-3) -> DiffReport:
    """Two JSON reports of one model (inspect/grads -f json): only their statistics are
    known, so each tensor is compared by the relative change of its norm (`norm_rel`); the
    mean and std changes are noted."""
    from hookcli.reportfile import load_report

    tol = bounds.tolerance(tol, "--tol", "--tol 1e-3")
    record = "give two reports written by hookcli inspect/grads/check -f json -o FILE."
    reports = [load_report(p, "", record) for p in (path_a, path_b)]
    a, b = reports
    if a["model"].get("spec") != b["model"].get("spec"):
        raise UsageError(
            f"the reports are of different models ({a['model'].get('spec')} vs "
            f"{b['model'].get('spec')}).",
            "compare two reports of one model.",
        )
    before = {(c["name"], c["call"]): c for c in a["layers"]}
    calls: list[DiffCall] = []
    first = None
    for c in b["layers"]:
        old = before.pop((c["name"], c["call"]), None)
        if old is None:
            continue
        by_path = {t["path"]: t for t in old["outputs"]}
        diffs = [_stat_diff(by_path.get(t["path"]), t, tol) for t in c["outputs"]]
        calls.append(DiffCall(c["name"], c["type"], c["call"], diffs))
        over = next((d for d in diffs if d.over), None)
        if over is not None and first is None:
            first = _describe_over(calls[-1], over, tol)
    matched = {(c.name, c.call) for c in calls}
    missing = [f"{n} call {k}: only in {path_a}" for n, k in before]
    missing += [
        f"{c['name']} call {c['call']}: only in {path_b}"
        for c in b["layers"]
        if (c["name"], c["call"]) not in matched
    ]
    m = b["model"]
    return DiffReport(
        model=ModelInfo(m["name"], m["spec"], m["task"], m["weights"], m["params"]),
        input=InputInfo(f"{a['input']['description']} | {b['input']['description']}", []),
        device=f"{a.get('device')} | {b.get('device')}",
        a=path_a,
        b=path_b,
        ref=None,
        isolate=False,
        tol=tol,
        calls=calls,
        first_over=first,
        missing=missing,
        notes=[
            "two saved reports: only statistics are known, so tensors are compared by the "
            "relative change of their norm (norm Δ); run `hookcli diff MODEL …` for max|Δ|, "
            "relative L2, cosine and SQNR"
        ],
        hookcli_version=__version__,
    )


def _stat_diff(old: dict[str, Any] | None, new: dict[str, Any], tol: float) -> TensorDiff:
    d = TensorDiff(new["path"], tuple(new["shape"]), new["numel"])
    if old is None:
        d.note, d.over = "only in the second report", True
        return d
    if old["shape"] != new["shape"]:
        d.note, d.over = f"shapes differ: {_shape(old['shape'])} vs {_shape(new['shape'])}", True
        return d
    d.nonfinite = int((new.get("nan") or 0) + (new.get("inf") or 0))
    na, nb = old.get("norm"), new.get("norm")
    if na is not None and nb is not None:
        d.norm_rel = abs(nb - na) / na if na else (0.0 if nb == 0 else None)
    changes = [
        f"{k} {old[k]:.4g} -> {new[k]:.4g}"
        for k in ("mean", "std")
        if old.get(k) is not None and new.get(k) is not None and old[k] != new[k]
    ]
    d.note = "; ".join(changes) or None
    d.over = d.nonfinite > 0 or d.norm_rel is None or d.norm_rel > tol
    return d
