"""The engine under every command: prepare once (engine/prepare.py), then hooked passes.

`hooked_pass` runs one
forward (and backward) with a HookSession attached, with everything a pass needs around it:
the model's mode and device set and restored, parameter gradients isolated, the seed set,
tensor hooks removed, and any failure of the model — anywhere, in any pass — turned into a
ModelError (exit 3) naming the layer that was running.

The model is left as found: hooks removed, every module's train/eval flag restored, its
buffers (a layer may rewrite its own, even in eval mode), the user's .grad, and (for a module
passed in through the Python API) its device, whatever happens in between.

A model that differentiates inside its forward (a MAML inner loop, a gradient penalty) cannot
run under no_grad: such a forward is run again with gradients enabled, and the report says so.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from hookcli.engine.accumulation import accumulating
from hookcli.engine.hooks import HookSession
from hookcli.engine.prepare import Prepared
from hookcli.engine.selection import ROOT_LABEL, all_modules, held
from hookcli.engine.targets import TargetSpec
from hookcli.engine.targets import scalar as scalar_of
from hookcli.engine.tensorbits import PLAIN, version_of
from hookcli.errors import HookcliError, ModelError, UsageError, one_line
from hookcli.inputs import ModelInput
from hookcli.runtime import beacon, gcpause
from hookcli.sources import LoadedModel
from hookcli.tree import iter_tensors


@dataclass(slots=True)
class PassResult:
    output: Any
    scalar: torch.Tensor | None  # what backward started from
    forward_ms: float  # 0 unless the pass was timed
    backward_ms: float | None
    notes: list[str] = field(default_factory=list)  # how the pass had to run (for the report)


@contextlib.contextmanager
def hooked_pass(
    prepared: Prepared,
    session: HookSession,
    *,
    model_input: ModelInput | None = None,
    train: bool = False,
    backward: bool = False,
    timed: bool = False,
) -> Iterator[PassResult]:
    """One forward (and, with backward, a backward from prepared.backward) with `session`'s
    hooks attached. Yields the result while parameter gradients are still readable; on exit
    the model is as it was (mode, device, buffers, the user's .grad) and no hook remains.
    `timed`: forward and backward wall times, the device synchronised around each."""
    loaded = prepared.loaded
    x = model_input if model_input is not None else prepared.model_input
    assert x is not None, "prepare() was given no inputs and the pass none either"
    # every parameter: a forward may call backward itself (MAML); the user's .grad comes back
    modules = all_modules(loaded.module)  # (one walk for both below)
    params = held(loaded.module, modules)[0]
    params += [t for _, t in prepared.input_leaves]  # a second pass starts from no gradient
    if backward and (why := accumulating(modules)) is not None:
        raise UsageError(
            f"{loaded.spec} is in the middle of gradient accumulation: {why}, so a backward "
            "now would add hookcli's gradients to the user's and read none reduced.",
            "call it between optimizer steps, or record the training's own backward with "
            "hookcli.watch.",
        )
    notes: list[str] = []
    shared = _SHARED.get(id(loaded.module)) if not train else None
    with (
        gcpause.held(),
        contextlib.nullcontext(shared)
        if shared is not None
        else model_left_as_found(
            loaded.module, prepared.device, train=train, modules=modules
        ) as buffers,
        contextlib.nullcontext() if shared is not None else grads_left_as_found(params),
    ):
        reseed(prepared.seed, prepared.device)  # dropout and the like, in train mode
        try:
            grad_on = backward or loaded.module in _NEEDS_AUTOGRAD
            if grad_on and not backward:
                notes.append(AUTOGRAD_NOTE)
            with torch.set_grad_enabled(grad_on):
                beacon.at("in forward, before any hooked layer ran")
                t0 = _clock(timed)
                try:
                    with _saving(session):
                        output = run_forward(loaded, x, session, prepared.device)
                except ModelError as exc:
                    if grad_on or not _needs_autograd(exc.__cause__):
                        raise
                    # the forward differentiates (torch.autograd.grad, backward) inside: run
                    # it again, from the same state, with gradients enabled
                    _NEEDS_AUTOGRAD.add(loaded.module)
                    notes.append(AUTOGRAD_NOTE)
                    session.reset()
                    buffers.restore()
                    _restore_grads(params)
                    reseed(prepared.seed, prepared.device)
                    if session.memory is not None:
                        session.memory.reset()
                    with torch.enable_grad(), _saving(session):
                        beacon.at("in forward (again, with gradients), before any hooked layer")
                        t0 = _clock(timed)
                        output = run_forward(loaded, x, session, prepared.device)
                forward_ms = _clock(timed) - t0
                value = None
                backward_ms = None
                if backward:
                    assert prepared.backward is not None, "prepare() was given no backward"
                    with _saving(session):  # the loss saves tensors too (cross-entropy its softmax)
                        book = None if session.collector is None else session.collector.book
                        read = output if book is None else book.as_whole(output)  # (TP: whole)
                        value = _scalar(loaded, prepared.backward, read, prepared.seed)
                    if session.readers:
                        session.count_readers(value)  # whose input others read too (origins)
                    if session.memory is not None:
                        session.memory.arm()  # (disarmed in `finally`)
                    beacon.at("in backward, before any hooked layer's gradient arrived")
                    t1 = _clock(timed)
                    with _strays_left_as_found(value, params):
                        run_backward(loaded, value)
                    backward_ms = _clock(timed) - t1 if timed else None
                if session.memory is not None:
                    session.memory.finish()
        finally:
            session.remove_tensor_hooks()
            if session.memory is not None:
                session.memory.disarm()
        yield PassResult(output, value, forward_ms, backward_ms, notes)


def _saving(session: HookSession) -> contextlib.AbstractContextManager[None]:
    """--memory: what autograd saves is counted (engine/memory.py); else nothing happens."""
    return session.memory.saving() if session.memory is not None else contextlib.nullcontext()


AUTOGRAD_NOTE = (
    "the model differentiates inside its forward (torch.autograd.grad or backward), which "
    "fails under no_grad: the forward ran with gradients enabled (same values)"
)
# models found to need autograd in their forward: later passes (folder batches) start so
_NEEDS_AUTOGRAD: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _needs_autograd(cause: BaseException | None) -> bool:
    """Whether a forward under no_grad failed because it differentiates inside."""
    if not isinstance(cause, RuntimeError):
        return False
    text = str(cause)
    return "does not require grad" in text or "does not have a grad_fn" in text


def _restore_grads(params: Sequence[torch.Tensor]) -> None:
    for p in params:
        p.grad = None


def unhooked_pass(
    prepared: Prepared,
    *,
    model_input: ModelInput | None = None,
    train: bool = False,
    backward: bool = False,
    timed: bool = False,
) -> PassResult:
    """The same pass with no hook at all (--profile's reference timing); `model_input`: a
    folder's batch instead of the prepared input."""
    session = HookSession([], None)
    with hooked_pass(
        prepared, session, model_input=model_input, train=train, backward=backward, timed=timed
    ) as result:
        return result


def _scalar(loaded: LoadedModel, spec: TargetSpec, output: Any, seed: int) -> torch.Tensor:
    try:
        return scalar_of(spec, loaded.kind.select(output), seed, loaded.kind.scores)
    except UsageError:
        raise
    except Exception as exc:  # the target does not fit what the model returned
        raise UsageError(
            f"cannot compute {spec.describe()} from {loaded.spec}'s output: {one_line(exc)}",
            "choose a --target or --loss that fits the output (`hookcli inspect` shows it).",
        ) from exc


def _clock(timed: bool) -> float:
    """Milliseconds on a monotonic clock after queued GPU work is done; 0 when not timing
    (an untimed pass never synchronises)."""
    if not timed:
        return 0.0
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
    return time.perf_counter() * 1e3


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one: "cuda" is the current CUDA device ("cuda:0", most often),
    and a device of another type without an index its first."""
    if a.type != b.type:
        return False
    ia: int | None = a.index  # (None where no index was given; torch's stubs say int)
    ib: int | None = b.index
    if ia == ib:
        return True
    if ia is not None and ib is not None:
        return False
    here = torch.cuda.current_device() if a.type == "cuda" else 0
    return (here if ia is None else ia) == (here if ib is None else ib)


@contextlib.contextmanager
def model_left_as_found(
    model: nn.Module,
    device: torch.device,
    *,
    train: bool = False,
    modules: Sequence[nn.Module] | None = None,
) -> Iterator[BufferSnapshot]:
    """The run's mode (eval, or train on request) and device; everything restored after.

    Every module's own train/eval flag comes back, and the device. Buffers come back after
    every run, not only in train mode (where BatchNorm updates its running statistics even
    without gradients, docs/traps.md §9): a layer may count its calls or keep a running value
    in eval mode too. Yields the buffers' snapshot (its `restore` puts them back now, before a
    rerun). `modules`: `all_modules(model)`, where the caller has just made it.
    """
    modules = all_modules(model) if modules is None else modules
    modes = [m.training for m in modules]
    first = next(iter(model.parameters()), None)
    home = first.device if first is not None else None
    if home is not None and home.type == "meta":
        home = None  # --offload: weights come in on the pass's device as blocks run
    buffers = BufferSnapshot(modules)
    caches = _tensor_caches(modules)
    moved = home is not None and not same_device(home, device)
    try:
        for m, name, _ in caches:
            setattr(m, name, {})
        for m, training in zip(modules, modes, strict=True):
            if training != train:
                m.training = train
        if moved:
            model.to(device)
        yield buffers
    finally:
        for m, training in zip(modules, modes, strict=True):
            if m.training is not training:  # (nn.Module's setattr costs microseconds each)
                m.training = training
        if moved:
            model.to(home)
        buffers.restore()
        for m, name, value in caches:
            setattr(m, name, value)


_SHARED: dict[int, BufferSnapshot] = {}  # models held for passes at once: their buffers


@contextlib.contextmanager
def shared_passes(prepared: Prepared) -> Iterator[Callable[[], bool]]:
    """Several passes of one model at the same time (diff's accumulated and own-error passes
    of one side, as greenlets taking turns): the model's mode, device, buffers and .grad set
    and restored once around them all, instead of by each pass around its own, which would
    put the model back as it was in the middle of another pass. Passes in train mode keep
    their own. Yields a check: whether the model's state moved meanwhile — a buffer written
    (in place, through .data too) or replaced, a parameter's .grad, a tensor, list or dict
    the module keeps, one of its Python numbers or strings — in which case the passes did not
    each see the model as one pass alone would, and their results are not to be used; the
    Python numbers and strings are then put back (buffers and .grad are, always)."""
    module = prepared.loaded.module
    params = held(module)[0] + [t for _, t in prepared.input_leaves]
    with (
        model_left_as_found(module, prepared.device) as buffers,
        grads_left_as_found(params),
    ):
        modules = all_modules(module)
        before = _state_print(modules, params)

        def moved() -> bool:
            if _state_print(modules, params) == before and not buffers.moved():
                return False
            for m, k, v in before:
                if isinstance(k, str) and type(v) in _SCALARS and vars(m).get(k, _GONE) != v:
                    setattr(m, k, v)
            return True

        _SHARED[id(module)] = buffers
        try:
            yield moved
        finally:
            _SHARED.pop(id(module), None)


_SCALARS = (int, float, bool, str)


def _state_print(modules: Sequence[nn.Module], params: Sequence[torch.Tensor]) -> list[Any]:
    """What a forward in eval mode may change in a model besides its buffers (BufferSnapshot
    compares those), cheaply compared: each parameter's .grad, each module's own tensors
    (object and version), lists and dicts (object and length), Python numbers and strings
    (value)."""
    seen: list[Any] = []
    for m in modules:
        for k, v in vars(m).items():
            if type(v) in _SCALARS:
                seen.append((m, k, v))
            elif isinstance(v, torch.Tensor):
                seen.append((m, k, (id(v), version_of(v))))
            elif isinstance(v, (list, dict)) and k not in _MODULE_ATTRIBUTES:
                seen.append((m, k, (id(v), len(v))))
    seen += [(p, id(p.grad), version_of(p.grad) if p.grad is not None else None) for p in params]
    return seen


def reseed(seed: int, device: torch.device) -> None:
    """torch.manual_seed(seed) for a pass on `device`: on the CPU or a CUDA device, the CPU's
    generator and (once CUDA is in use, or the pass is on it) every CUDA device's, alone
    (torch.manual_seed also queues a seed for each other backend, with a stack trace each:
    about a millisecond a pass on a GPU machine)."""
    if device.type in ("cpu", "cuda"):
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda" or torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.manual_seed_all(seed)
    else:
        torch.manual_seed(seed)


def _tensor_caches(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, str, dict[Any, Any]]]:
    """Dicts a module keeps tensors in between calls (timm's LeViT, EfficientFormer and
    EfficientViT `attention_bias_cache`, filled in eval mode): each pass starts from an empty
    one, so it neither reuses a tensor whose graph an earlier backward freed nor leaves its own
    behind; the model's dict object comes back after."""
    found = []
    for m in modules:
        own = vars(m)
        for name in own.keys() - _MODULE_ATTRIBUTES:  # the module's own attributes
            value = own[name]
            if name.endswith("_cache") and isinstance(value, dict):
                found.append((m, name, value))
    return found


# what every nn.Module instance holds, none of it a cache
_MODULE_ATTRIBUTES = frozenset(vars(nn.Module()))


_GONE = object()


class BufferSnapshot:
    """Every module's buffers as they were: the tensor objects and a copy of their values.
    `restore` puts back a buffer object the forward replaced (`self.x = self.x + 1`) or
    removed, copies the values back into one it wrote in place, and removes buffers the
    forward added. Written in place is judged by the values, not the version counter alone:
    batch_norm's kernel updates running statistics without moving it. Restoring writes only
    what changed (a buffer written back moves its version counter, nothing else does). Cost
    per pass: one clone and one comparison of all buffers (resnet50: 0.2 MB, well under a
    millisecond). Lazy buffers (not materialised yet) are left to materialise. A TorchScript
    module's buffers (a scripted BatchNorm in train mode updates them inside TorchScript) get
    their values copied back; their objects stay as TorchScript holds them. Off the CPU the
    values are copied back without comparing them first: a comparison would wait for the
    device, once per buffer (docs/traps.md §8); a copy is queued like any kernel."""

    def __init__(self, modules: Iterator[nn.Module] | Sequence[nn.Module]) -> None:
        self.items: list[tuple[nn.Module, str, Any, int, torch.Tensor | None]] = []
        self.names: list[tuple[nn.Module, frozenset[str]]] = []
        self.scripted: list[tuple[torch.Tensor, torch.Tensor]] = []
        on_device: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, its copy)
        with torch.no_grad():
            for m in modules:
                if isinstance(m, torch.jit.ScriptModule):
                    self.scripted += [
                        (b, b.detach().clone())
                        for _, b in m.named_buffers(recurse=False)
                        if not is_lazy(b)
                    ]
                    continue
                bufs = m._buffers
                self.names.append((m, frozenset(bufs)))
                for name, b in bufs.items():
                    if b is None or is_lazy(b):
                        self.items.append((m, name, b, -1, None))
                    elif b.is_cpu or b.device.type == "meta" or type(b) not in PLAIN:
                        self.items.append((m, name, b, version_of(b), b.detach().clone()))
                    else:  # copied below, with the others on its device
                        copy = torch.empty_like(b)
                        self.items.append((m, name, b, version_of(b), copy))
                        on_device.append((b, copy))
            _copy_all(on_device)

    def restore(self) -> None:
        back: list[tuple[torch.Tensor, torch.Tensor]] = []  # device buffers: (copy, buffer)
        with torch.no_grad():
            for m, name, orig, version, copy in self.items:
                now = m._buffers.get(name, _GONE)
                if now is not orig:
                    m._buffers[name] = orig
                if copy is None:
                    continue
                if (orig.shape, orig.dtype, orig.device) != (copy.shape, copy.dtype, copy.device):
                    orig.data = copy.clone()  # given another shape, dtype or device by `.data =`
                elif not orig.is_cpu and orig.device.type != "meta" and type(orig) in PLAIN:
                    back.append((copy, orig))  # (never compared there: copied back together)
                elif version < 0 or version_of(orig) != version or not _same(orig, copy):
                    orig.copy_(copy)
            _copy_all(back)
            for b, copy in self.scripted:
                if not _same(b, copy):
                    b.copy_(copy)
            for m, names in self.names:
                if not m._buffers.keys() <= names:  # the forward added buffers
                    for extra in [n for n in m._buffers if n not in names]:
                        del m._buffers[extra]

    def moved(self) -> bool:
        """Whether a buffer's values differ from the snapshot's, bit for bit, or one was
        replaced, removed or added. Off the CPU, one comparison of all of them on the device
        and a single wait for its answer."""
        waiting: list[torch.Tensor] = []
        for m, name, orig, _, copy in self.items:
            now: Any = m._buffers.get(name, _GONE)
            if now is not orig:
                return True
            if copy is None:
                continue
            if (orig.shape, orig.dtype, orig.device) != (copy.shape, copy.dtype, copy.device):
                return True
            if orig.device.type == "cpu":
                if not _same(orig, copy):
                    return True
            elif orig.numel():
                waiting.append(_differs(orig, copy))
        if any(not m._buffers.keys() <= names for m, names in self.names):
            return True
        return bool(torch.stack(waiting).any()) if waiting else False


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether two tensors of one shape and dtype differ bit for bit: on their device, no wait."""
    if a.is_floating_point() or a.is_complex():
        return ((a != b) & ~(a.isnan() & b.isnan())).any()
    return (a != b).any()


def _copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each (source, destination) pair's values copied, those of one device and dtype in one
    foreach copy (a few launches for all of them, not one each: a GPU model's buffers)."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]]
    groups = {}
    for src, dst in pairs:
        srcs, dsts = groups.setdefault((dst.device, dst.dtype), ([], []))
        srcs.append(src)
        dsts.append(dst)
    with torch.no_grad():
        for srcs, dsts in groups.values():
            if hasattr(torch, "_foreach_copy_"):
                torch._foreach_copy_(dsts, srcs)
            else:  # (torch before 2.3)
                for src, dst in zip(srcs, dsts, strict=True):
                    dst.copy_(src)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values, bit for bit (a NaN equals itself, unlike torch.equal); off the CPU,
    never known without waiting for the device, so taken as changed."""
    if a.device.type == "meta":
        return True  # no values
    if a.device.type != "cpu":
        return False
    bits = _BITS.get(a.element_size())
    if (a.is_floating_point() or a.is_complex()) and bits is not None:
        a, b = a.view(bits), b.view(bits)
    return bool(torch.equal(a, b))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@contextlib.contextmanager
def deterministic_algorithms(on: bool) -> Iterator[None]:
    """CI runs: torch's deterministic algorithms where it has them, the setting restored after."""
    if not on:
        yield
        return
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@contextlib.contextmanager
def grads_left_as_found(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Parameters' .grad set to None for the run (so only this backward is read) and the
    user's own .grad objects put back after."""
    saved = [(p, g) for p in params if (g := p.grad) is not None]  # (a write costs more)
    try:
        for p, _ in saved:
            p.grad = None
        yield
    finally:
        for p in params:
            if p.grad is not None:
                p.grad = None
        for p, g in saved:
            p.grad = g


@contextlib.contextmanager
def _strays_left_as_found(value: torch.Tensor, params: Sequence[torch.Tensor]) -> Iterator[None]:
    """The leaves the backward from `value` reaches besides `params` (a tensor attribute that
    requires grad and is no Parameter, a global one): each .grad set aside for the backward
    and put back after it, so the run neither writes nor adds to them."""
    known = {id(p) for p in params}
    strays: list[torch.Tensor] = []
    seen: set[Any] = set()
    stack = [value.grad_fn] if value.grad_fn is not None else []
    while stack:  # (the graph's nodes once each: ~1 µs a node)
        for node, _ in stack.pop().next_functions:
            if node is None or node in seen:
                continue
            seen.add(node)
            leaf = getattr(node, "variable", None)
            if leaf is None:
                stack.append(node)
            elif id(leaf) not in known:
                strays.append(leaf)
    saved = [(t, t.grad) for t in strays]
    try:
        for t in strays:
            t.grad = None
        yield
    finally:
        for t, g in saved:
            t.grad = g


def _failing_layer(tb: TracebackType | None, names: Mapping[int, str]) -> str | None:
    """The innermost module of the model whose code was running when the forward raised."""
    innermost = None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            innermost = names[id(owner)]
        tb = tb.tb_next
    return innermost


def generate(model: nn.Module, model_input: ModelInput) -> Any:
    """model.generate over the input (every step's forward goes through the hooks), with
    transformers' own log held back (its notes on generation settings)."""
    from hookcli.sources.hfbase import quiet_transformers, transformers_module

    assert model_input.generate is not None
    with quiet_transformers(transformers_module()):
        return model.generate(  # type: ignore[operator]
            *model_input.args, **model_input.kwargs, **model_input.generate
        )


def run_forward(
    loaded: LoadedModel, model_input: ModelInput, session: HookSession, device: torch.device
) -> Any:
    """The hooked forward (the caller sets grad mode and the model's state); model failures
    — an exception of any kind (a BaseException subclass, GeneratorExit), running out of
    memory, or the model calling sys.exit — become ModelError (exit 3) naming the layer that
    was running. Only Ctrl-C (KeyboardInterrupt) and hookcli's own errors (a hook refusing,
    e.g. --ablate LAYER=mean on an output whose channels cannot be told) go through as
    themselves."""
    model = loaded.module
    pid = os.getpid()
    with session:
        try:
            try:
                if model_input.generate is not None:
                    return generate(model, model_input)
                return model(*model_input.args, **model_input.kwargs)
            finally:
                if os.getpid() != pid:
                    # a process the model forked, come back through its forward: the report
                    # is the calling process's, and a second one would follow it
                    os._exit(0)
        except (KeyboardInterrupt, HookcliError):  # hookcli's own hooks refusing: as they say
            raise
        except torch.OutOfMemoryError as exc:
            raise ModelError(
                f"out of memory running {loaded.name} on {device}: {one_line(exc)}",
                "use fewer or smaller inputs, or --device cpu.",
            ) from exc
        except BaseException as exc:
            names = {id(m): (n or ROOT_LABEL) for n, m in model.named_modules()}
            where = _failing_layer(exc.__traceback__, names)
            if where is None:
                open_calls = session.open_calls()
                where = open_calls[-1].call.name if open_calls else None
            place = f" in layer {where}" if where else ""
            if where == ROOT_LABEL:  # the model's own forward, outside any layer of it
                place = " in its own forward (outside its layers)"
            if isinstance(exc, SystemExit):
                raise ModelError(
                    f"{loaded.name} called sys.exit({exc.code!r}){place} during forward.",
                    "a model's forward must return or raise; remove the sys.exit call.",
                ) from exc
            if isinstance(exc, NameError):  # a global the script sets by code not run
                said = _skipped_global(model, exc)
                if said is not None:
                    raise said from exc
            if isinstance(exc, TypeError) and _refused_by_forward(exc, model):
                raise UsageError(
                    f"the inputs do not fit {type(model).__name__}.forward"
                    f"{_signature(model)}: {one_line(exc, with_type=False)}",
                    "give one --input per positional argument, NAME=SPEC for a keyword one.",
                ) from exc
            if _needs_autograd(exc):
                hint = (
                    "the model differentiates inside its forward (torch.autograd.grad or "
                    "backward) a value that does not require grad: check which parameters "
                    "or inputs it differentiates, and that they require grad."
                )
            elif not isinstance(exc, Exception):
                hint = (
                    f"the model raised {type(exc).__name__}, a BaseException that is not an "
                    "Exception; a forward should raise an Exception subclass."
                )
            elif isinstance(exc, RecursionError):
                hint = (
                    f"the model nests calls deeper than Python's recursion limit "
                    f"({sys.getrecursionlimit()}), and its plain forward fails the same way: "
                    "nest less, or raise the limit in the model's file (sys.setrecursionlimit)."
                )
            elif where == ROOT_LABEL and not isinstance(exc, RuntimeError | IndexError):
                hint = (  # (a shape error would be a RuntimeError: this is the model's own code)
                    f"the model's own forward code raised it (given {_given(model_input)}): "
                    "HOOKCLI_DEBUG=1 shows the line."
                )
            elif _dtype_mismatch(exc):
                given = iter_tensors(model_input.forward_values(), "in")
                dtypes = sorted({str(t.dtype).removeprefix("torch.") for _, t in given})
                hint = (
                    f"the input's dtype ({', '.join(dtypes)}) is not the model's: cast it with "
                    "a :DTYPE suffix (--input x.npy:float32), or run the model in that dtype."
                )
            else:
                hint = _shape_hint(loaded, model_input, _module_named(model, where))
            if where is not None and len(where) > 80:  # a path 400 levels deep
                where = f"{where[:36]}…{where[-36:]} ({where.count('.') + 1} levels deep)"
                place = f" in layer {where}"
            raise ModelError(f"{loaded.name} failed{place}: {one_line(exc)}", hint) from exc


def _dtype_mismatch(exc: BaseException) -> bool:
    """A layer refusing its input's dtype (a float64 numpy array into float32 weights)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "expected scalar type" in text
        or "should be the same" in text  # (conv: "Input type … and weight type … should be")
        or ("expected" in text and "dtype" in text and "but" in text)
        or "mat1 and mat2 must have the same dtype" in text
    )


def _refused_by_forward(exc: TypeError, model: nn.Module) -> bool:
    """Whether the model's own forward refused its arguments (too many, a keyword it does
    not take): the exception raised where torch calls it, before its code ran."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    frame = tb.tb_frame
    return bool(
        frame.f_code.co_filename.endswith(os.path.join("nn", "modules", "module.py"))
        and frame.f_locals.get("self") is model
    )


def _signature(model: nn.Module) -> str:
    try:
        return str(inspect.signature(model.forward))
    except (TypeError, ValueError):
        return "(…)"


def _skipped_global(model: nn.Module, exc: NameError) -> UsageError | None:
    """For a model read from a script (sources.script): the one line naming the line that sets
    the name its forward needs, which hookcli did not run."""
    from hookcli.sources.custom import skipped_name

    for m in model.modules():
        owner = sys.modules.get(type(m).__module__)
        defs = getattr(owner, "__skipped__", None)
        if defs is not None:
            source = getattr(owner, "__file__", None) or type(m).__module__
            return skipped_name(defs, exc, source, f"{type(m).__name__}'s forward")
    return None


def _module_named(model: nn.Module, name: str | None) -> nn.Module | None:
    if not name or name == ROOT_LABEL:
        return model if name == ROOT_LABEL else None
    try:
        return model.get_submodule(name)
    except (AttributeError, RecursionError):
        return None


# what a layer expects, read from its own attributes (the layers a model's input meets first)
_TAKES: tuple[tuple[type[nn.Module], Callable[[Any], str]], ...] = (
    (nn.Linear, lambda m: f"(…, {m.in_features})"),
    (
        nn.modules.conv._ConvNd,
        lambda m: f"(N, {m.in_channels}, {', '.join(['…'] * len(m.kernel_size))})",
    ),
    (nn.modules.batchnorm._BatchNorm, lambda m: f"(N, {m.num_features}, …)"),
    (nn.LayerNorm, lambda m: f"(…, {', '.join(map(str, m.normalized_shape))})"),
    (nn.Embedding, lambda m: f"integer ids below {m.num_embeddings}"),
    (nn.MultiheadAttention, lambda m: f"(…, {m.embed_dim}) queries"),
)


def _takes(module: nn.Module) -> str | None:
    """The input a layer expects, as its own attributes say (Linear: (…, in_features))."""
    for kind, says in _TAKES:
        if isinstance(module, kind):
            return says(module)
    return None


def _given(model_input: ModelInput) -> str:
    """The input's tensor shapes, as a hint names them."""
    return ", ".join("x".join(map(str, s)) for s in model_input.shapes()) or "no tensor"


def _shape_hint(loaded: LoadedModel, model_input: ModelInput, failing: nn.Module | None) -> str:
    """What the model was given and, where the failing layer (or the model's first layer) can
    tell, the input shape it expects."""
    given = _given(model_input)
    expects = []
    if failing is not None and (takes := _takes(failing)) is not None:
        expects.append(f"{type(failing).__name__} takes {takes}")
    first = next(((m, t) for m in loaded.module.modules() if (t := _takes(m))), None)
    if first is not None and first[0] is not failing:
        expects.append(f"its first {type(first[0]).__name__} takes {first[1]}")
    said = f"; {'; '.join(expects)}" if expects else ""
    return (
        f"the model was given {given}{said}: check the input shape "
        f"(`hookcli layers {loaded.spec} --shapes` shows each layer's)."
    )


def run_backward(loaded: LoadedModel, value: torch.Tensor) -> None:
    if not value.requires_grad:
        raise UsageError(
            f"nothing in {loaded.spec} requires grad, so there is no gradient to show "
            "(no trainable parameter reaches the output).",
            "unfreeze parameters, or add --input-grad for the gradient w.r.t. the input.",
        )
    try:
        value.backward()  # type: ignore[no-untyped-call]
    except KeyboardInterrupt:
        raise
    except torch.OutOfMemoryError as exc:
        raise ModelError(
            f"out of memory in backward: {one_line(exc)}", "use fewer or smaller inputs."
        ) from exc
    except BaseException as exc:
        raise ModelError(
            f"{loaded.name} failed in backward: {one_line(exc)}",
            "the model's own backward raised; check custom autograd code.",
        ) from exc
