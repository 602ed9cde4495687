"""The repro bundle of a training step that made NaN/Inf, and the hooked re-run of that step.

What a step needs to run again exactly is captured by the recorder on every step at little
cost (references, not copies, except the buffers): each forward's arguments, the torch RNG
state, autocast and grad mode at its start, the gradient that reached each of its outputs in
backward (so the loss, which is user code, need not run again: backward restarts from those
gradients), and the buffers as they were when the step began (a forward in train mode rewrites
BatchNorm's running statistics). The parameters and the optimizer state are still the step's
own when the optimizer's pre-step hook sees non-finite values, before `step()` changes them.

`rerun` runs such a step again with hooks on, the forwards in order, each followed by its
backward, and names the first non-finite layer call and direction (engine.origins). The
recorder calls it in-process on detection; `hookcli replay BUNDLE` loads the bundle written to
disk and calls the same function, on the CPU or the original device.

On disk a bundle is a directory: bundle.json (what, when, where, the recorded origins),
model.pt (the module pickled, when it can be), state.pt (parameters, buffers, training flags
and the optimizer's state_dict), batch.pt (each forward's arguments, RNG and output gradients)
and records.jsonl (the last watched steps). state.pt and batch.pt are read with torch's
`weights_only` loader (tensors and plain values: nothing in them can run); model.pt is a pickle
of the module, which runs code when loaded: `hookcli replay` reads it only with --unpickle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookcli.commands.watch import BUNDLE_FILES, PICKLED_MODEL
from hookcli.engine.hookbits import measure
from hookcli.engine.hooks import HookSession, Target
from hookcli.engine.measure import finished_calls, statistics
from hookcli.engine.origins import any_nonfinite, find_origins
from hookcli.engine.tensorbits import version_of
from hookcli.errors import UsageError, one_line
from hookcli.io.recordjson import RecordError, from_json
from hookcli.records import BundleInfo, LayerCall, Origin, TensorStats
from hookcli.tree import iter_tensors, map_tensors

BUNDLE_SCHEMA = 1
FILES = BUNDLE_FILES


@dataclass(slots=True)
class ForwardCapture:
    """One forward of a step: its arguments (references; their version counters tell whether
    something wrote them in place later), the RNG and modes it ran under, and the gradient
    that reached each output tensor in backward (by path: out, out[0], out["logits"] …)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    grad_enabled: bool
    autocast: tuple[str, str] | None  # (device type, dtype) when the forward ran under autocast
    modes: list[bool] | None = None  # each module's training flag (model.modules() order)
    versions: list[int] = field(default_factory=list)
    output: Any = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)

    def written_since(self) -> bool:
        """Whether an argument tensor was changed in place after the forward began (the
        saved batch is then not the one the step saw)."""
        now = [version_of(t) for _, t in iter_tensors((self.args, self.kwargs), "in")]
        return now != self.versions

    def to_saved(self) -> dict[str, Any]:
        return {
            "args": self.args,
            "kwargs": self.kwargs,
            "rng": self.rng,
            "cuda_rng": self.cuda_rng,
            "grad_enabled": self.grad_enabled,
            "autocast": self.autocast,
            "modes": self.modes,
            "grads": self.grads,
        }

    @classmethod
    def from_saved(cls, d: Mapping[str, Any]) -> ForwardCapture:
        """One saved forward (TypeError naming the field that is not what the recorder wrote)."""
        if not isinstance(d, Mapping):
            raise TypeError("a saved forward is not a mapping")
        checks = {
            "args": isinstance(d.get("args"), list | tuple),
            "kwargs": isinstance(d.get("kwargs"), Mapping),
            "rng": isinstance(d.get("rng"), torch.Tensor),
            "grads": isinstance(d.get("grads") or {}, Mapping)
            and all(isinstance(g, torch.Tensor) for g in (d.get("grads") or {}).values()),
        }
        wrong = [k for k, ok in checks.items() if not ok]
        if wrong:
            raise TypeError(f"a saved forward's {', '.join(wrong)} is not what the recorder wrote")
        return cls(
            tuple(d["args"]),
            dict(d["kwargs"]),
            d["rng"],
            d.get("cuda_rng"),
            bool(d["grad_enabled"]),
            None if d.get("autocast") is None else tuple(d["autocast"]),
            None if d.get("modes") is None else [bool(x) for x in d["modes"]],
            grads=dict(d.get("grads") or {}),
        )


def capture_forward(
    args: tuple[Any, ...], kwargs: dict[str, Any], modules: Sequence[nn.Module]
) -> ForwardCapture:
    """What a forward about to run needs to run again: called from the model's root
    forward pre-hook (a few microseconds: no tensor is copied)."""
    cuda_rng = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        cuda_rng = torch.cuda.get_rng_state_all()
    autocast = None
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            autocast = (device_type, str(torch.get_autocast_dtype(device_type)).split(".")[-1])
            break
    capture = ForwardCapture(
        args,
        kwargs,
        torch.get_rng_state(),
        cuda_rng,
        torch.is_grad_enabled(),
        autocast,
        [m.training for m in modules],
    )
    capture.versions = [version_of(t) for _, t in iter_tensors((args, kwargs), "in")]
    return capture


def watch_output(capture: ForwardCapture, output: Any) -> None:
    """From the root forward hook: keep the output and, for each tensor of it that backward
    will reach, the gradient that arrives (a tensor hook keeps a reference; nothing is read)."""
    capture.output = output
    for path, t in iter_tensors(output, "out"):
        # not a leaf (a parameter the model returns): a hook on it would outlive the step
        if t.requires_grad and t.grad_fn is not None:

            def keep(grad: torch.Tensor, path: str = path) -> None:
                capture.grads[path] = grad

            t.register_hook(keep)  # type: ignore[no-untyped-call]


@dataclass(slots=True)
class Rerun:
    """What the hooked re-run of a step saw."""

    calls: list[LayerCall]
    origins: list[Origin]
    outputs: list[TensorStats]
    never_called: list[str]
    unhooked: list[tuple[str, str]]
    errors: list[str] = field(default_factory=list)  # forwards that raised on the re-run


def rerun(
    module: nn.Module,
    forwards: Sequence[ForwardCapture],
    targets: list[Target],
    types: Mapping[str, str],
    *,
    partial: bool,
) -> Rerun:
    """The step again with hooks on `targets`: each forward from its own RNG state, grad mode,
    autocast and train/eval flags, then its backward from the gradients its outputs received.
    The caller keeps the model's buffers and .grad as they were; the flags come back here.

    The arguments are detached copies (a tensor that required grad is a new leaf that does):
    backward stops at the module's inputs, never runs into graphs outside it nor adds to a
    `.grad` outside it. A forward (or its backward) that raises is noted and skipped; the
    others run. The origin is that of the first forward (micro-batch) in which NaN/Inf
    appears, with its own backward: each forward-backward pair is its own pass."""
    collector = statistics()
    session = HookSession(targets, collector, grads=True, readers=True)
    modules = list(module.modules())
    flags = [m.training for m in modules]
    groups: list[tuple[int, int, list[TensorStats]]] = []  # calls[start:end], the outputs
    errors: list[str] = []
    try:
        with session:
            for i, f in enumerate(forwards):
                start = len(session.calls)
                outputs: list[TensorStats] = []
                try:
                    _run_one(module, modules, f, session, outputs)
                except Exception as exc:  # reported; the other forwards go on
                    errors.append(f"forward {i} of the step raised: {one_line(exc)}")
                groups.append((start, len(session.calls), outputs))
    finally:
        session.remove_tensor_hooks()
        for m, flag in zip(modules, flags, strict=True):
            m.training = flag
    calls = finished_calls(session, backward=True)
    every_output = [t for _, _, outputs in groups for t in outputs]
    if any_nonfinite(session.calls, every_output):
        session.settle_readers()  # whose inputs others read too (a backward origin)
    origins: list[Origin] = []
    for start, end, outputs in groups:
        origins = find_origins(session.calls[start:end], types, partial=partial, outputs=outputs)
        if origins:
            break
    never = [t.name for t, n in zip(targets, session.counts, strict=True) if n == 0]
    return Rerun(calls, origins, every_output, never, list(session.unhooked), errors)


def _run_one(
    module: nn.Module,
    modules: Sequence[nn.Module],
    f: ForwardCapture,
    session: HookSession,
    outputs: list[TensorStats],
) -> None:
    """One captured forward and, when its outputs received gradients, its backward."""
    _set_rng(f)
    if f.modes is not None and len(f.modes) == len(modules):
        for m, flag in zip(modules, f.modes, strict=True):
            m.training = flag
    args, kwargs = map_tensors((f.args, f.kwargs), lambda _, t: _fresh(t))
    with torch.set_grad_enabled(f.grad_enabled), _autocast(f.autocast):
        out = module(*args, **kwargs)
    assert session.collector is not None
    measure(session.collector, out, "out", outputs)
    pairs = [
        (t, f.grads[path])
        for path, t in iter_tensors(out, "out")
        if path in f.grads and t.requires_grad
    ]
    if not pairs:
        return
    # d/dt Σ(t·g) = g exactly: backward restarts from the gradients the step's own loss gave,
    # without running the loss (user code) again
    scalar = torch.stack([(t * g.to(t.device, t.dtype)).sum().float() for t, g in pairs]).sum()
    session.count_readers(scalar)
    try:
        scalar.backward()  # type: ignore[no-untyped-call]
    except BaseException:
        session.settle_readers()  # (its graph, saved tensors and all, not kept past here)
        raise


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of an argument: a new leaf that requires grad when the original did."""
    d = t.detach()
    return d.requires_grad_(True) if t.requires_grad and (d.is_floating_point() or
                                                           d.is_complex()) else d  # fmt: skip


def _set_rng(f: ForwardCapture) -> None:
    torch.set_rng_state(f.rng)
    if f.cuda_rng is not None and torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):  # replayed on fewer devices than it ran on
            torch.cuda.set_rng_state_all(f.cuda_rng)


def _autocast(spec: tuple[str, str] | None) -> contextlib.AbstractContextManager[Any]:
    if spec is None:
        return contextlib.nullcontext()
    device_type, dtype = spec
    return torch.autocast(device_type, dtype=getattr(torch, dtype))


# ------------------------------------------------------------------ on disk


def write_bundle(
    dest: Path,
    *,
    info: BundleInfo,
    module: nn.Module,
    optimizer: Any,
    forwards: Sequence[ForwardCapture],
    records: Sequence[dict[str, Any]],
) -> list[str]:
    """The bundle directory, written whole or not at all (a temporary directory renamed into
    place; only an earlier bundle is ever replaced). Returns notes: a model that cannot be
    pickled (replay then needs --model), a batch that cannot (no replay). torch.save's own
    warnings (a tensor's hooks are not saved …) are not shown: the recorder's one line says
    what happened."""
    check_bundle_dest(dest)
    notes: list[str] = []
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            pickled = _saved(
                module, tmp / "model.pt", notes, "the model could not be pickled",
                "replay it with --model SPEC",
            )  # fmt: skip
            state = {
                "model": module.state_dict(),
                "training": {n: m.training for n, m in module.named_modules()},
                "optimizer": None if optimizer is None else optimizer.state_dict(),
            }
            torch.save(state, tmp / "state.pt")
            replayable = _saved(
                [f.to_saved() for f in forwards], tmp / "batch.pt", notes,
                "the batch could not be saved", "this bundle cannot be replayed",
            )  # fmt: skip
            if not replayable:
                torch.save([], tmp / "batch.pt")
            with (tmp / "records.jsonl").open("w", encoding="utf-8") as fh:
                for r in records:
                    fh.write(json.dumps(r, allow_nan=False) + "\n")
            meta = dataclasses.replace(
                info, pickled=pickled, replayable=replayable, notes=[*info.notes, *notes]
            )
            text = json.dumps(dataclasses.asdict(meta), indent=1, allow_nan=False)
            (tmp / "bundle.json").write_text(text + "\n")
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return notes


def _saved(obj: Any, path: Path, notes: list[str], what: str, then: str) -> bool:
    """torch.save, or a note saying why not (a lambda or a local class inside)."""
    try:
        torch.save(obj, path)
    except Exception as exc:
        path.unlink(missing_ok=True)
        notes.append(f"{what} ({type(exc).__name__}: {one_line(exc)}): {then}")
        return False
    return True


def check_bundle_dest(dest: Path) -> None:
    """A bundle may replace only an earlier bundle: a directory holding bundle.json and files
    a bundle has. Anything else there (a checkpoint folder, `.`) is a UsageError."""
    if not dest.exists():
        if dest.parent.exists() and not dest.parent.is_dir():
            raise UsageError(
                f"the bundle's folder {dest.parent} is a file.", "give bundle='DIR' elsewhere."
            )
        return
    known = {*FILES, PICKLED_MODEL}
    is_bundle = (
        dest.is_dir()
        and (dest / "bundle.json").is_file()
        and all(p.name in known for p in dest.iterdir())
    )
    if not is_bundle:
        raise UsageError(
            f"{dest} exists and is not a repro bundle: hookcli.watch replaces only a bundle.",
            "give bundle= a new directory name, e.g. bundle='run.bundle'.",
        )


@dataclass(slots=True)
class Bundle:
    path: Path
    info: BundleInfo
    state: dict[str, Any]
    forwards: list[ForwardCapture]
    records: list[dict[str, Any]]


def read_bundle(path: Path, *, unpickle: bool = False) -> Bundle:
    """A bundle written by `write_bundle`; anything else is a UsageError naming what is
    missing or wrong. state.pt and batch.pt are loaded with `weights_only=True` (tensors and
    plain values only) unless `unpickle`: a bundle is made to be shared, and one handed over
    must not run code by being read."""
    from hookcli.io.output import note_read

    if not path.is_dir():
        raise UsageError(
            f"{path} is not a repro bundle directory.",
            "give the directory hookcli.watch wrote on the first NaN/Inf (e.g. run.bundle).",
        )
    missing = [name for name in FILES if not (path / name).is_file()]
    if missing:
        raise UsageError(
            f"{path} is not a whole repro bundle: {', '.join(missing)} missing.",
            "give the directory hookcli.watch wrote on the first NaN/Inf.",
        )
    for name in (*FILES, PICKLED_MODEL):
        note_read(path / name)  # no output of this run may replace a part of the bundle
    damaged = f"it was written by another hookcli version or damaged (schema {BUNDLE_SCHEMA})."
    try:
        meta = json.loads((path / "bundle.json").read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or meta.get("schema") != BUNDLE_SCHEMA:
            raise ValueError(f"schema {meta.get('schema') if isinstance(meta, dict) else '?'}")
        try:
            info = from_json(BundleInfo, meta)
        except RecordError as exc:  # bundle.json's origins[0] has no 'direction', …
            raise ValueError(f"bundle.json's {exc}") from None
        records = [
            json.loads(line)
            for line in (path / "records.jsonl").read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
        if not all(isinstance(r, dict) for r in records):
            raise ValueError("records.jsonl holds a line that is not an object")
    except (OSError, ValueError, RecursionError) as exc:
        raise UsageError(
            f"cannot read the repro bundle {path}: {type(exc).__name__}: {one_line(exc)}.", damaged
        ) from exc
    state = _load(path / "state.pt", unpickle, damaged)
    saved = _load(path / "batch.pt", unpickle, damaged)
    try:
        if not isinstance(state, dict) or not isinstance(state.get("model"), Mapping):
            raise TypeError("state.pt holds no state dict under 'model'")
        if not all(isinstance(t, torch.Tensor) for t in state["model"].values()):
            raise TypeError("state.pt's state dict holds something other than tensors")
        if not isinstance(state.get("training") or {}, Mapping):
            raise TypeError("state.pt's training flags are not a mapping")
        if not isinstance(saved, list):
            raise TypeError("batch.pt holds no list of forwards")
        forwards = [ForwardCapture.from_saved(d) for d in saved]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(
            f"cannot read the repro bundle {path}: {type(exc).__name__}: {one_line(exc)}.", damaged
        ) from exc
    return Bundle(path, info, state, forwards, records)


def _load(path: Path, unpickle: bool, damaged: str) -> Any:
    """torch.load of a bundle's part: weights_only unless `unpickle` (the user's opt-in)."""
    import pickle

    try:
        with warnings.catch_warnings():  # torch's own (a pickle protocol it did not write …)
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=not unpickle)
    except pickle.UnpicklingError as exc:
        if unpickle or "weights only load failed" not in str(exc).lower():
            raise UsageError(f"cannot read {path}: {one_line(exc)}.", damaged) from exc
        raise UsageError(
            f"{path} holds Python objects beyond tensors and plain values; loading them would run "
            "code from the bundle.",
            "replay it with --unpickle only if you wrote this bundle yourself.",
        ) from exc
    except Exception as exc:  # truncated (EOFError), not a zip, a corrupt record …
        raise UsageError(
            f"cannot read {path}: {type(exc).__name__}: {one_line(exc)}.", damaged
        ) from exc


def to_device(forwards: Sequence[ForwardCapture], device: torch.device) -> list[ForwardCapture]:
    """The captured step moved to `device` (autocast follows the device type)."""
    moved = []
    for f in forwards:
        args, kwargs = map_tensors((f.args, f.kwargs), lambda _, t: t.to(device))
        grads = {k: g.to(device) for k, g in f.grads.items()}
        autocast = None if f.autocast is None else (device.type, f.autocast[1])
        moved.append(
            ForwardCapture(
                tuple(args), dict(kwargs), f.rng, f.cuda_rng, f.grad_enabled, autocast, f.modes,
                grads=grads,
            )
        )  # fmt: skip
    return moved
