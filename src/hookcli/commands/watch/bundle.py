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
and records.jsonl (the last watched steps). model.pt and batch.pt are pickles: load only
bundles you wrote (`hookcli replay` says so).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookcli.engine.hooks import HookSession, Target, measure
from hookcli.engine.origins import find_origins, number_backward
from hookcli.engine.stats import StatsCollector
from hookcli.errors import UsageError
from hookcli.records import LayerCall, Origin, TensorStats
from hookcli.tree import iter_tensors

BUNDLE_SCHEMA = 1
FILES = ("bundle.json", "state.pt", "batch.pt", "records.jsonl")


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
    versions: list[int] = field(default_factory=list)
    output: Any = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)

    def written_since(self) -> bool:
        """Whether an argument tensor was changed in place after the forward began (the
        saved batch is then not the one the step saw)."""
        now = [_version(t) for _, t in iter_tensors((self.args, self.kwargs), "in")]
        return now != self.versions

    def to_saved(self) -> dict[str, Any]:
        return {
            "args": self.args,
            "kwargs": self.kwargs,
            "rng": self.rng,
            "cuda_rng": self.cuda_rng,
            "grad_enabled": self.grad_enabled,
            "autocast": self.autocast,
            "grads": self.grads,
        }

    @classmethod
    def from_saved(cls, d: Mapping[str, Any]) -> ForwardCapture:
        return cls(
            tuple(d["args"]),
            dict(d["kwargs"]),
            d["rng"],
            d.get("cuda_rng"),
            bool(d["grad_enabled"]),
            None if d.get("autocast") is None else tuple(d["autocast"]),
            grads=dict(d.get("grads") or {}),
        )


def capture_forward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> ForwardCapture:
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
        args, kwargs, torch.get_rng_state(), cuda_rng, torch.is_grad_enabled(), autocast
    )
    capture.versions = [_version(t) for _, t in iter_tensors((args, kwargs), "in")]
    return capture


def watch_output(capture: ForwardCapture, output: Any) -> None:
    """From the root forward hook: keep the output and, for each tensor of it that backward
    will reach, the gradient that arrives (a tensor hook keeps a reference; nothing is read)."""
    capture.output = output
    for path, t in iter_tensors(output, "out"):
        if t.requires_grad:

            def keep(grad: torch.Tensor, path: str = path) -> None:
                capture.grads[path] = grad

            t.register_hook(keep)  # type: ignore[no-untyped-call]


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors have none
        return -1


@dataclass(slots=True)
class Rerun:
    """What the hooked re-run of a step saw."""

    calls: list[LayerCall]
    origins: list[Origin]
    outputs: list[TensorStats]
    never_called: list[str]
    unhooked: list[tuple[str, str]]


def rerun(
    module: nn.Module,
    forwards: Sequence[ForwardCapture],
    targets: list[Target],
    types: Mapping[str, str],
    *,
    partial: bool,
) -> Rerun:
    """The step again with hooks on `targets`: each forward from its own RNG state, grad mode
    and autocast, then its backward from the gradients its outputs received. The caller keeps
    the model as it was (buffers, .grad). Forwards that raised or had no backward run as far as
    they can: the origin needs only the calls that ran."""
    collector = StatsCollector()
    session = HookSession(targets, collector, grads=True, readers=True)
    outputs: list[TensorStats] = []
    try:
        with session:
            for f in forwards:
                _set_rng(f)
                with torch.set_grad_enabled(f.grad_enabled), _autocast(f.autocast):
                    out = module(*f.args, **f.kwargs)
                measure(collector, out, "out", outputs)
                pairs = [
                    (t, f.grads[path])
                    for path, t in iter_tensors(out, "out")
                    if path in f.grads and t.requires_grad
                ]
                if not pairs:
                    continue
                # d/dt Σ(t·g) = g exactly: backward restarts from the gradients the step's own
                # loss gave, without running the loss (user code) again
                scalar = torch.stack(
                    [(t * g.to(t.device, t.dtype)).sum().float() for t, g in pairs]
                )
                scalar = scalar.sum()
                session.count_readers(scalar)
                scalar.backward()  # type: ignore[no-untyped-call]
    finally:
        session.remove_tensor_hooks()
    collector.finalize()
    calls = [p.complete(True) for p in session.calls]
    number_backward(session.calls)
    origins = find_origins(session.calls, types, partial=partial, outputs=outputs)
    never = [t.name for t, n in zip(targets, session.counts, strict=True) if n == 0]
    return Rerun(calls, origins, outputs, never, list(session.unhooked))


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
    info: dict[str, Any],
    module: nn.Module,
    optimizer: Any,
    forwards: Sequence[ForwardCapture],
    records: Sequence[dict[str, Any]],
) -> list[str]:
    """The bundle directory, written whole or not at all (a temporary directory renamed into
    place; an existing bundle of an earlier run is replaced). Returns notes (e.g. a model that
    cannot be pickled: replay then needs --model)."""
    notes: list[str] = []
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        try:
            torch.save(module, tmp / "model.pt")
            pickled = True
        except Exception as exc:  # a lambda, a local class, an open file in the module
            (tmp / "model.pt").unlink(missing_ok=True)
            pickled = False
            notes.append(
                f"the model could not be pickled ({type(exc).__name__}: {exc}); replay it "
                "with --model SPEC (a constructor hookcli can call)"
            )
        state = {
            "model": module.state_dict(),
            "training": {n: m.training for n, m in module.named_modules()},
            "optimizer": None if optimizer is None else optimizer.state_dict(),
        }
        torch.save(state, tmp / "state.pt")
        torch.save([f.to_saved() for f in forwards], tmp / "batch.pt")
        with (tmp / "records.jsonl").open("w", encoding="utf-8") as fh:
            for r in records:
                fh.write(json.dumps(r, allow_nan=False) + "\n")
        meta = dict(info, schema=BUNDLE_SCHEMA, pickled=pickled, notes=notes)
        (tmp / "bundle.json").write_text(json.dumps(meta, indent=1, allow_nan=False) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return notes


@dataclass(slots=True)
class Bundle:
    path: Path
    info: dict[str, Any]
    state: dict[str, Any]
    forwards: list[ForwardCapture]
    records: list[dict[str, Any]]


def read_bundle(path: Path) -> Bundle:
    """A bundle written by `write_bundle`; anything else is a UsageError naming what is
    missing."""
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
    try:
        info = json.loads((path / "bundle.json").read_text(encoding="utf-8"))
        if not isinstance(info, dict) or info.get("schema") != BUNDLE_SCHEMA:
            raise ValueError(f"schema {info.get('schema') if isinstance(info, dict) else '?'}")
        # pickles: the bundle is the user's own output (the command's help says so)
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
        saved = torch.load(path / "batch.pt", map_location="cpu", weights_only=False)
        forwards = [ForwardCapture.from_saved(d) for d in saved]
        records = [
            json.loads(line)
            for line in (path / "records.jsonl").read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise UsageError(
            f"cannot read the repro bundle {path}: {type(exc).__name__}: {exc}.",
            f"it was written by another hookcli version or damaged (schema {BUNDLE_SCHEMA}).",
        ) from exc
    return Bundle(path, info, state, forwards, records)


def to_device(forwards: Sequence[ForwardCapture], device: torch.device) -> list[ForwardCapture]:
    """The captured step moved to `device` (autocast follows the device type)."""
    from hookcli.tree import map_tensors

    moved = []
    for f in forwards:
        args, kwargs = map_tensors((f.args, f.kwargs), lambda _, t: t.to(device))
        grads = {k: g.to(device) for k, g in f.grads.items()}
        autocast = None if f.autocast is None else (device.type, f.autocast[1])
        moved.append(
            ForwardCapture(
                tuple(args), dict(kwargs), f.rng, f.cuda_rng, f.grad_enabled, autocast,
                grads=grads,
            )
        )  # fmt: skip
    return moved


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """The torch RNG states as they were (a re-run sets them to the step's)."""
    cpu = torch.get_rng_state()
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        cuda = torch.cuda.get_rng_state_all()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
