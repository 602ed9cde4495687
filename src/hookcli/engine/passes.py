"""The engine under every command: prepare once, then hooked passes.

`prepare` loads the model, selects the modules to hook and builds the input — the same way for
inspect, grads, check, layers --shapes, maps, cam and folder runs. `hooked_pass` runs one
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
import dataclasses
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

from hookcli.engine.hooks import HookSession, Target
from hookcli.engine.selection import (
    ROOT_LABEL,
    ModuleEntry,
    module_entries,
    select,
    target_of,
    unhookable_note,
)
from hookcli.engine.targets import TargetSpec, parse_target
from hookcli.engine.targets import scalar as scalar_of
from hookcli.errors import HookcliError, ModelError, UsageError, one_line
from hookcli.inputs import ModelInput, default_input, from_images, from_specs
from hookcli.options import BackwardOptions, InputOptions, ModelOptions, Selection
from hookcli.runtime import beacon, gcpause, isa, ranks
from hookcli.sources import LoadedModel, load_model, resolve_device


@dataclass(slots=True)
class Prepared:
    """A loaded model on its device, the modules to hook, the input, and what backward
    starts from (None: forward only)."""

    loaded: LoadedModel
    device: torch.device
    seed: int
    entries: list[ModuleEntry]
    targets: list[Target]
    model_input: ModelInput | None
    backward: TargetSpec | None = None
    input_leaves: tuple[tuple[str, torch.Tensor], ...] = ()  # --input-grad: the input copies
    notes: list[str] = field(default_factory=list)  # for the report: modules hooks cannot see


@dataclass(slots=True)
class PassResult:
    output: Any
    scalar: torch.Tensor | None  # what backward started from
    forward_ms: float  # 0 unless the pass was timed
    backward_ms: float | None
    notes: list[str] = field(default_factory=list)  # how the pass had to run (for the report)


def prepare(
    model: ModelOptions,
    selection: Selection | None = None,
    inputs: InputOptions | None = None,
    *,
    backward: BackwardOptions | None = None,
    position: int | None = None,
) -> Prepared:
    """Model, modules and input for a run; every usage error is raised here, before any pass.
    No selection: nothing hooked (timing, pictures pick their own). No inputs: none built
    (folder runs bring their batches)."""
    isa.ensure()  # before oneDNN first runs: a CPU whose AMX kernels die gets a limit
    if model.offload and backward is not None:
        raise UsageError(
            "--offload keeps one block's weights in memory at a time; a backward needs them "
            "all again (autograd saves them).",
            "drop --offload for gradients, or check without --backward and gradient rules.",
        )
    device = torch.device("meta") if model.meta else resolve_device(model.device)
    # a module given through the API is named by its class: its repr can be huge, or endless
    label = model.model if isinstance(model.model, str) else type(model.model).__name__
    with beacon.phase(f"building {label}"):
        loaded = load_model(
            model.model,
            weights=model.weights,
            seed=model.seed,
            model_args=model.model_args,
            head=model.head,
            building=model.building,
        )
    if model.output_key:  # a copy: a LoadedModel passed in is left as it was
        loaded = dataclasses.replace(loaded, kind=loaded.kind.keyed(model.output_key))
    # the task may constrain the device (quantized: CPU only, no backward)
    device = loaded.kind.device(loaded.spec, model.device, device, backward is not None)
    if model.offload:
        from hookcli.sources.offload import place

        place(loaded.module, device)
    text = inputs is not None and inputs.has_text
    loaded = with_tokenizer(loaded, model.tokenizer, needed=text)
    if position is not None:  # --position: which real token a language model predicts after
        at = getattr(loaded.kind, "at_position", None)
        if at is None:
            raise UsageError(
                f"--position picks a language model's token; {loaded.spec} is {loaded.task}.",
                "drop --position.",
            )
        loaded = dataclasses.replace(loaded, kind=at(position))
    spec = None
    if backward is not None:
        default = loaded.kind.default_target
        if inputs is not None and inputs.target_text:  # a seq2seq target: its teacher-forced loss
            default = "next-token"
        target = backward.target or (None if backward.loss else default)
        spec = parse_target(target, backward.loss, loaded.categories)
        spec.item = loaded.kind.item
    entries = module_entries(loaded.module)
    targets: list[Target] = []
    if selection is not None and selection.every:
        targets = every_target(entries)
    elif selection is not None:
        targets = select(
            entries,
            layers=selection.layers,
            types=selection.types,
            depth=selection.depth,
            model_label=loaded.spec,
            always=selection.always,
        )
    model_input = None
    leaves: tuple[tuple[str, torch.Tensor], ...] = ()
    if inputs is not None:
        built = build_input(loaded, inputs, model.seed)  # (read before a move to meta)
        loaded = dataclasses.replace(loaded, kind=loaded.kind.for_input(built))
        mask = built.kwargs.get("attention_mask")
        if model.meta and isinstance(mask, torch.Tensor) and bool(mask.all()):
            # a mask of ones changes nothing, and transformers reads its values to skip it
            del built.kwargs["attention_mask"]
        model_input = built.to(device)
        if spec is not None and spec.kind == "lm":
            if model_input.labels is not None:  # --target-text: aligned with the logits
                spec.labels, spec.aligned = model_input.labels, True
            elif getattr(loaded.kind, "ids_key", "input_ids") == "decoder_input_ids":
                raise UsageError(
                    f"--target next-token of {loaded.spec} (a seq2seq model) needs its target "
                    "text: the decoder's tokens are not the input's.",
                    "give --target-text TEXT (one per --text), or --target top1.",
                )
            else:
                spec.labels = next_token_labels(model_input)
        if backward is not None and backward.input_grad:
            model_input, leaves = _with_input_grad(model_input)
    note = unhookable_note(entries)
    stray = ranks.stray_note()
    return Prepared(
        loaded,
        device,
        model.seed,
        entries,
        targets,
        model_input,
        spec,
        leaves,
        [*loaded.notes, *(n for n in (note, stray) if n)],
    )


def every_target(entries: Sequence[ModuleEntry]) -> list[Target]:
    """Every module Python hooks can see, the model itself included (as `(model)`)."""
    return [target_of(e) for e in entries if e.unhookable is None]


def with_tokenizer(loaded: LoadedModel, asked: Any, *, needed: bool) -> LoadedModel:
    """A language model with its tokenizer (--tokenizer, else the checkpoint's) and its tokens
    as labels. Needed (text given): a missing tokenizer is an error; else one beside the
    checkpoint only labels the predicted tokens, and none is no loss."""
    from hookcli.inputs.text import ensure_tokenizer, needs_text_model
    from hookcli.sources.lm import CausalLM, TokenLabels

    if needed:
        needs_text_model(loaded, "--text")
    elif asked is None and not (
        isinstance(loaded.kind, CausalLM) and loaded.tokenizer_from is not None
    ):
        return loaded
    if asked is not None and not needed:
        needs_text_model(loaded, "--tokenizer")
    loaded = dataclasses.replace(loaded)  # a LoadedModel passed in is left as it was
    try:
        ensure_tokenizer(loaded, asked)
    except UsageError:
        if needed or asked is not None:
            raise
        return loaded  # a checkpoint saved without its tokenizer: ids stay unlabelled
    vocab = getattr(loaded.kind, "vocab_size", None)
    if isinstance(loaded.kind, CausalLM) and loaded.categories is None and isinstance(vocab, int):
        loaded.categories = TokenLabels(loaded.tokenizer, vocab)
    return loaded


def next_token_labels(model_input: ModelInput) -> torch.Tensor:
    """The ids each position of a text predicts: input_ids, -100 where padding is."""
    from hookcli.engine.targets import IGNORE

    ids = model_input.kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise UsageError(
            "--target next-token needs the text's input_ids (batch x tokens).",
            "give --text, or --input input_ids=SPEC; or use --target top1.",
        )
    mask = model_input.kwargs.get("attention_mask")
    labels = ids.detach().clone()
    if isinstance(mask, torch.Tensor) and tuple(mask.shape) == tuple(ids.shape):
        labels[mask == 0] = IGNORE
        # a sequence's first real token has nothing before it to be predicted from (with
        # padding on the left, the position before it is padding)
        labels[:, 1:][mask[:, :-1] == 0] = IGNORE
    return labels


def build_input(loaded: LoadedModel, inputs: InputOptions, seed: int) -> ModelInput:
    """Images, tensors (Python API), tensor specs, text (a language model), or a random input
    of the right shape."""
    items = inputs.items
    if inputs.has_text:
        if items or inputs.specs:
            raise UsageError(
                "give text or images/--input tensors, not both.", "use one kind of input per run."
            )
        from hookcli.inputs.text import from_text

        return from_text(loaded, inputs)
    given = _given_tensors(loaded, inputs)
    if given is not None:
        return given
    if items and inputs.specs:
        raise UsageError(
            "give image files or --input tensor specs, not both.", "use one kind of input per run."
        )
    if items and not loaded.kind.takes_images:
        raise UsageError(
            f"{loaded.spec} takes token ids, not images.",
            "give --input randint:LOW:HIGH:1x16 (ids below its vocabulary size) or "
            "--input input_ids=SPEC.",
        )
    if items:
        return from_images([str(x) for x in items], loaded, strict=inputs.strict)
    if inputs.specs:
        return from_specs(inputs.specs, seed, loaded)
    return default_input(loaded, seed)


def _given_tensors(loaded: LoadedModel, inputs: InputOptions) -> ModelInput | None:
    """The Python API's tensors, or its mapping of keyword tensors; None for other inputs."""
    items = inputs.items
    if len(items) == 1 and isinstance(items[0], Mapping):
        if inputs.specs:
            raise UsageError("give keyword tensors or --input specs, not both.", "use one kind.")
        return _keyword_input(loaded, items[0])
    if not items or not all(isinstance(x, torch.Tensor) for x in items):
        return None
    if inputs.specs:
        raise UsageError("give tensors or --input specs, not both.", "use one kind of input.")
    if len(items) == 1:
        t = items[0]
        return ModelInput((t,), f"tensor {'x'.join(map(str, t.shape))}")
    return ModelInput(tuple(items), "tensors")


def _keyword_input(loaded: LoadedModel, given: Mapping[Any, Any]) -> ModelInput:
    """The Python API's mapping of keyword tensors (a tokenizer's output: input_ids,
    attention_mask, …) as the forward's keyword arguments; a padded batch's mask keeps its
    padding out of every statistic, as text given to hookcli does."""
    named: dict[str, torch.Tensor] = {}
    for key, value in given.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise TypeError(f"keyword inputs are named by argument names, not {key!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"keyword input {key!r} is a {type(value).__name__}, not a tensor (a "
                "tokenizer's output needs return_tensors='pt')"
            )
        named[key] = value
    if not named:
        raise TypeError("the mapping of keyword inputs is empty")
    args, kwargs, note = loaded.kind.spec_inputs([], named)
    shown = ", ".join(f"{k} {'x'.join(map(str, v.shape))}" for k, v in named.items())
    mask = named.get("attention_mask")
    ids = named.get("input_ids")
    padded = (
        isinstance(mask, torch.Tensor)
        and isinstance(ids, torch.Tensor)
        and mask.shape == ids.shape
        and mask.dim() == 2
        and bool((mask == 0).any())
    )
    return ModelInput(
        args,
        f"keyword tensors {shown}" + note,
        kwargs=kwargs,
        token_mask=mask.bool() if padded and mask is not None else None,
    )


def _with_input_grad(
    model_input: ModelInput,
) -> tuple[ModelInput, tuple[tuple[str, torch.Tensor], ...]]:
    """Copies of the floating-point inputs that require grad (the user's stay untouched)."""
    leaves: list[tuple[str, torch.Tensor]] = []

    def leaf(t: torch.Tensor, path: str) -> torch.Tensor:  # paths as hooks name inputs: in[0]
        if not t.is_floating_point():
            return t
        copy = t.detach().clone().requires_grad_(True)
        leaves.append((path, copy))
        return copy

    return model_input.map(lambda path, t: leaf(t, path)), tuple(leaves)


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
    params: list[torch.Tensor] = list(loaded.module.parameters())
    params += [t for _, t in prepared.input_leaves]  # a second pass starts from no gradient
    notes: list[str] = []
    with (
        gcpause.held(),
        model_left_as_found(loaded.module, prepared.device, train=train) as restore_buffers,
        grads_left_as_found(params),
    ):
        torch.manual_seed(prepared.seed)  # dropout and the like, in train mode
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
                    restore_buffers()
                    _restore_grads(params)
                    torch.manual_seed(prepared.seed)
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
                        value = _scalar(loaded, prepared.backward, output, prepared.seed)
                    if session.readers:
                        session.count_readers(value)  # whose input others read too (origins)
                    if session.memory is not None:
                        session.memory.arm()  # (disarmed in `finally`)
                    beacon.at("in backward, before any hooked layer's gradient arrived")
                    t1 = _clock(timed)
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


@contextlib.contextmanager
def model_left_as_found(
    model: nn.Module, device: torch.device, *, train: bool = False
) -> Iterator[Callable[[], None]]:
    """The run's mode (eval, or train on request) and device; everything restored after.

    Every module's own train/eval flag comes back, and the device. Buffers come back after
    every run, not only in train mode (where BatchNorm updates its running statistics even
    without gradients, docs/traps.md §9): a layer may count its calls or keep a running value
    in eval mode too. Yields a function that puts the buffers back now (before a rerun).
    """
    modes = [(m, m.training) for m in model.modules()]
    first = next(iter(model.parameters()), None)
    home = first.device if first is not None else None
    if home is not None and home.type == "meta":
        home = None  # --offload: weights come in on the pass's device as blocks run
    buffers = BufferSnapshot(m for m, _ in modes)
    caches = _tensor_caches(m for m, _ in modes)
    try:
        for m, name, _ in caches:
            setattr(m, name, {})
        for m, training in modes:
            if training != train:
                m.training = train
        if home is not None and home != device:
            model.to(device)
        yield buffers.restore
    finally:
        for m, training in modes:
            m.training = training
        if home is not None and home != device:
            model.to(home)
        buffers.restore()
        for m, name, value in caches:
            setattr(m, name, value)


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
        self.items: list[tuple[nn.Module, str, Any, int | None, torch.Tensor | None]] = []
        self.names: list[tuple[nn.Module, frozenset[str]]] = []
        self.scripted: list[tuple[torch.Tensor, torch.Tensor]] = []
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
                        self.items.append((m, name, b, None, None))
                    else:
                        self.items.append((m, name, b, _version(b), b.detach().clone()))

    def restore(self) -> None:
        with torch.no_grad():
            for m, name, orig, version, copy in self.items:
                now = m._buffers.get(name, _GONE)
                if now is not orig:
                    m._buffers[name] = orig
                if copy is None:
                    continue
                if (orig.shape, orig.dtype, orig.device) != (copy.shape, copy.dtype, copy.device):
                    orig.data = copy.clone()  # given another shape, dtype or device by `.data =`
                elif version is None or _version(orig) != version or not _same(orig, copy):
                    orig.copy_(copy)
            for b, copy in self.scripted:
                if not _same(b, copy):
                    b.copy_(copy)
            for m, names in self.names:
                if not m._buffers.keys() <= names:  # the forward added buffers
                    for extra in [n for n in m._buffers if n not in names]:
                        del m._buffers[extra]


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


def _version(t: torch.Tensor) -> int | None:
    """The in-place version counter; None for tensors without one (inference mode)."""
    try:
        return int(t._version)
    except RuntimeError:
        return None


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
    saved = [(p, p.grad) for p in params]
    try:
        for p in params:
            p.grad = None
        yield
    finally:
        for p, g in saved:
            p.grad = g


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
            if isinstance(exc, SystemExit):
                raise ModelError(
                    f"{loaded.name} called sys.exit({exc.code!r}){place} during forward.",
                    "a model's forward must return or raise; remove the sys.exit call.",
                ) from exc
            if isinstance(exc, NameError):  # a global the script sets by code not run
                said = _skipped_global(model, exc)
                if said is not None:
                    raise said from exc
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
            else:
                hint = _shape_hint(loaded, model_input, _module_named(model, where))
            if where is not None and len(where) > 80:  # a path 400 levels deep
                where = f"{where[:36]}…{where[-36:]} ({where.count('.') + 1} levels deep)"
                place = f" in layer {where}"
            raise ModelError(f"{loaded.name} failed{place}: {one_line(exc)}", hint) from exc


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


def _shape_hint(loaded: LoadedModel, model_input: ModelInput, failing: nn.Module | None) -> str:
    """What the model was given and, where the failing layer (or the model's first layer) can
    tell, the input shape it expects."""
    given = ", ".join("x".join(map(str, s)) for s in model_input.shapes()) or "no tensor"
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


def one_target(prepared: Prepared, pattern: str) -> Target:
    """Exactly one module for a picture's -l."""
    targets = select(prepared.entries, layers=[pattern], model_label=prepared.loaded.spec)
    if len(targets) > 1:
        shown = ", ".join(t.name for t in targets[:5])
        raise UsageError(
            f"-l {pattern!r} matches {len(targets)} layers ({shown}…); pictures are of one layer.",
            "name one layer exactly.",
        )
    return targets[0]
