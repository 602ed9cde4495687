"""A hook session: pre-hooks and forward hooks on the selected modules, always removed.

One record per *call* (docs/traps.md §3): ResNet's BasicBlock calls `self.relu` twice, so
`layer1.0.relu` yields calls 0 and 1. A module reachable under several names (aliases) is
hooked once, as one object. Pre- and post-hook of one call are paired by a per-module
stack, which keeps recursion and re-entrant modules right.

Statistics are taken inside the hook, immediately (docs/traps.md §4): after an in-place ReLU
`input[0] is output`, so inputs are measured in the pre-hook, before the module runs. Hooks
return None (they never replace an output) and never raise into the user's forward: a
failure to measure is recorded as a note on the call.

Gradients come from *tensor* hooks registered inside those hooks, not from module full
backward hooks, which wrap inputs/outputs in views that torchvision's in-place ReLU and
`out += identity` then modify and crash on (pytorch#61519, vision#4164). A tensor hook
registered before an in-place op receives the gradient of the value before the op — the
right one. A tensor that does not require grad gets no hook, and a hook that never fires
leaves its gradient absent: reported as null, never 0.
"""

from __future__ import annotations

import functools
import sys
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.nn.modules.module as _module_hooks
from torch import nn
from torch.utils.hooks import RemovableHandle

from hookcli.engine.callers import Spec, as_whole, fsdp_managed, paired
from hookcli.engine.copysafe import (
    CopySafeHook,
    InertHook,  # noqa: F401 (old pickles name it here)
    ScriptedCall,
)
from hookcli.engine.hookbits import (
    GradKey,
    cuda_event,
    grad_key,
    measure,
    on_cuda,
    shape_only,
)
from hookcli.engine.memory import CallBytes, MemoryMeter, storage_key
from hookcli.engine.sharded import is_sharded
from hookcli.engine.stats import StatsCollector
from hookcli.records import CallMemory, LayerCall, TensorStats
from hookcli.runtime import beacon
from hookcli.tree import iter_tensors

# autograd's node for a leaf (its `.variable`), by class, where torch names it
_ACCUMULATE: type | None = getattr(torch._C._functions, "AccumulateGrad", None)

# Called before a module runs; a (args, kwargs) it returns replaces the module's arguments.
InputHook = Callable[["PendingCall", tuple[Any, ...], dict[str, Any]], Any]

# autograd's per-thread sequence counter: the number the next node will take (a private
# binding, read where this torch has it; a probe node otherwise)
_PEEK_SEQ: Callable[[], int] | None = getattr(torch._C._autograd, "_get_sequence_nr", None)

# a gradient hook put straight into a plain tensor's hook dict, as Tensor.register_hook puts
# it (under an id from RemovableHandle's own counter, so none collides), without its checks,
# its import and the handle (issue 52: 1.5 µs a hook); False once this torch lacks a part.
# A plain tensor has no __torch_function__ of its own to dispatch register_hook to; a mode
# or a patch that intercepts register_hook does not see these (hookcli removes them itself)
_LEAN_HOOKS = [hasattr(RemovableHandle, "next_id")]


def _hook_into(t: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> tuple[Any, int] | None:
    """Hook a plain tensor that requires grad: (its hook dict, the hook's id), to remove it
    by; None where only `register_hook` can (another tensor type, or a torch without the
    parts), and the caller registers it."""
    if type(t) is not torch.Tensor or not _LEAN_HOOKS[0]:
        return None
    hooks = t._backward_hooks
    if hooks is None:
        node = t.grad_fn
        try:  # looked up first: a dict set on the tensor and never registered is a lost hook
            register = node._register_hook_dict if node is not None else None
        except AttributeError:
            _LEAN_HOOKS[0] = False
            return None
        hooks = t._backward_hooks = OrderedDict()
        if register is not None:
            register(t)
    key = RemovableHandle.next_id
    RemovableHandle.next_id = key + 1
    hooks[key] = hook
    return hooks, key


@dataclass(slots=True)
class Target:
    """One selected module object and every name it is reachable by."""

    module: nn.Module
    name: str
    aliases: list[str]
    type: str
    # a scripted module: the eager (parent, attribute) places a stand-in takes for the pass
    places: list[tuple[nn.Module, str]] = field(default_factory=list)


@dataclass(slots=True, eq=False)  # compared by identity
class PendingCall:
    """A LayerCall during the pass: its statistics are filled when the collector finalizes."""

    call: LayerCall
    # gradients by tensor path, filled during backward
    grad_inputs: dict[str, TensorStats] = field(default_factory=dict)
    grad_outputs: dict[str, TensorStats] = field(default_factory=dict)
    finished: int | None = None  # position among calls in the order they returned
    # --profile: perf_counter_ns marks (CPU) of the module's own forward and backward
    t_forward: list[int] = field(default_factory=list)
    hook_ns_at_start: int = 0  # the session's hook time when this call's forward began
    events: list[Any] = field(default_factory=list)  # --profile on CUDA: start/end events
    t_backward: list[int] = field(default_factory=list)
    output_bytes: int = 0
    # one clock for the forward: a position among the session's pre- and post-hook events
    entered: int = 0
    returned: int | None = None
    # positions among gradient hooks of the first input / output gradient, and which gradient
    # tensor each was (data pointer, shape: one gradient seen by two hooks has one key)
    grad_input_seen: int | None = None
    grad_output_seen: int | None = None
    grad_input_key: GradKey | None = None
    grad_output_key: GradKey | None = None
    # grads: what produced each input (its autograd node and output index, or the leaf), and
    # the autograd sequence numbers this call's forward created (start, end]; after
    # `settle_readers`, whether anything outside this call also read one of its inputs — then
    # an input gradient is the sum of several readers' and not this call's own
    input_producers: list[tuple[Any, int]] = field(default_factory=list)
    seq_span: tuple[int, int] | None = None
    input_shared: bool = False
    parent: PendingCall | None = None  # --profile: the hooked call this one ran inside
    bytes: CallBytes | None = None  # --memory: what it saved, its output, the allocator's peak

    def complete(self, backward: bool) -> LayerCall:
        """The LayerCall, once the collector has finalized: gradients in the order of the
        inputs and outputs; an absent gradient is left out, all absent is None (never 0)."""
        call = self.call
        call.forward_order = self.finished
        if backward:
            grads_in, grads_out = self.grad_inputs, self.grad_outputs
            call.grad_inputs = [grads_in[t.path] for t in call.inputs if t.path in grads_in] or None
            call.grad_outputs = [
                grads_out[t.path] for t in call.outputs if t.path in grads_out
            ] or None
        if self.bytes is not None:
            b = self.bytes
            call.memory = CallMemory(
                sum(b.saved.values()) if backward else None,
                len(b.saved) if backward else None,
                b.output_bytes,
                b.peak,
                b.freed if backward else None,
            )
        return call


class HookSession:
    """Context manager: hooks on enter, every handle removed on exit, whatever happened."""

    def __init__(
        self,
        targets: list[Target],
        collector: StatsCollector | None,
        *,
        on_output: Callable[[PendingCall, Any], None] | None = None,
        on_input: InputHook | None = None,
        grads: bool = False,
        saver: Any = None,
        profile: bool = False,
        readers: bool = False,
        memory: MemoryMeter | None = None,
        dense: bool = False,
        exclude: Callable[[], bool] | None = None,
    ) -> None:
        """`dense`: the targets are most of the model's modules, so that one process-wide
        pair of hooks costs less than a pair registered on each (see `_dispatch`).
        `exclude`: whether a call now is another pass's, on the same modules at the same
        time (diff's two passes of one side, as greenlets): this session leaves it alone."""
        self.targets = targets
        self.collector = collector
        self.on_output = on_output
        self.on_input = on_input  # may hand the module other arguments (diff --isolate)
        self.grads = grads
        self.saver = saver  # a saving.TensorSaver: tensors streamed to disk as seen
        self.profile = profile
        self.memory = memory  # --memory: engine/memory.py
        self.hook_ns = 0  # --profile: time spent inside these hooks, to subtract from containers
        self.tensor_handles: list[RemovableHandle] = []
        self._hooked: list[tuple[Any, int]] = []  # gradient hooks put in directly: dict, id
        # a hooked tensor, by id: (itself, weakly; its version then; the hook's handle id;
        # the calls' (pending, "in"/"out", path) it hands the gradient to)
        self._watched: dict[int, tuple[Any, int, int, list[tuple[PendingCall, str, str]]]] = {}
        # grads: the caller's inputs (args, kwargs, FSDP's casts) of each target whose own hooks
        # (a parallel style's, FSDP's) hand it other tensors, kept by a hook before those
        # (engine/callers.py); None: none
        self._callers: list[list[tuple[Any, Any, bool]]] | None = None
        self.resets = 0  # forwards forgotten by reset(), to run again
        self._finished = 0
        self._events = 0  # pre- and post-hook events: PendingCall.entered / returned
        self._grad_events = 0
        self.calls: list[PendingCall] = []
        self.counts = [0] * len(targets)
        self.unhooked: list[tuple[str, str]] = []  # targets that refused hooks, and why
        # grads: calls the model ran under no_grad (a reentrant checkpoint, its own no_grad)
        self.without_grad: dict[str, None] = {}
        self._stacks: list[list[PendingCall]] = [[] for _ in targets]
        self._open: list[PendingCall] = []  # --profile: calls running now, innermost last
        self._handles: list[RemovableHandle] = []
        self._restores: list[tuple[nn.Module, str, nn.Module, nn.Module]] = []
        self.dense = dense
        self.exclude = exclude
        self._dispatched: set[int] = set()  # targets hooked through the process-wide pair
        self._keyed: tuple[int, list[dict[int, bool]]] | None = None
        self._beacon = beacon.current()  # under the CLI's supervisor: where a crash happened
        self._started_by: GradKey | None = None  # the last output gradient
        # `readers` (inspect/grads: origins): before backward the pass calls count_readers;
        # a leaf whose views mark where autograd's node count stands, and each input's producer
        self.readers = readers and grads
        self._probe = torch.zeros((), requires_grad=True) if self.readers else None
        # count_readers' graph and the calls it holds inputs of, until settle_readers
        self._readers_waiting: tuple[Any, list[tuple[PendingCall, list[tuple[Any, int]]]]] | None
        self._readers_waiting = None

    def __enter__(self) -> HookSession:
        try:
            if self.dense:
                self._dispatch()
            for i, target in enumerate(self.targets):
                if i not in self._dispatched:
                    self._hook(i, target)
        except BaseException:
            self.remove()
            raise
        return self

    def _dispatch(self) -> None:
        """Hook most targets through one process-wide pre-hook and forward hook, instead of
        two hooks registered on each (issue 52: the registration and removal cost more than
        running them). A target that holds hooks of its own (a parallel style's, FSDP's, the
        user's) or is TorchScript keeps hooks on itself, so that its hooks and hookcli's run
        in the order they always did, and a scripted one is refused as before.

        The pair finds a call's target by the module's dict of keyword-taking pre-hooks: a
        shallow copy of the module (`copy.copy`, DataParallel's replicas) shares it, as it
        shares hooks registered on the module, and is measured as the module, as it was."""
        at: dict[int, int] = {}  # a target's place in self.targets, by its module's dict
        chosen = []
        for i, target in enumerate(self.targets):
            module = target.module
            marks = getattr(module, "_forward_pre_hooks_with_kwargs", None)
            if (
                target.places
                or marks is None
                or module._forward_pre_hooks
                or module._forward_hooks
                or isinstance(module, torch.jit.ScriptModule)
            ):
                continue
            at[id(marks)] = i
            chosen.append((i, marks))
        if not chosen:
            return
        on_pre, on_post = self._on_pre, self._on_post

        # (every module has the dict: _call_impl itself reads it while these hooks exist)
        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: Any = None) -> Any:
            i = at.get(id(module._forward_pre_hooks_with_kwargs))
            return None if i is None else on_pre(i, module, args, kwargs)

        def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            i = at.get(id(module._forward_pre_hooks_with_kwargs))
            if i is not None:
                on_post(i, module, args, output)

        handle = _module_hooks.register_module_forward_pre_hook(pre)
        self._handles.append(handle)  # (removed whatever happens next)
        # each chosen module is handed its keyword arguments too (a process-wide pre-hook
        # gets them where the module lists the hook's id as one that takes them)
        self._keyed = (handle.id, [marks for _, marks in chosen])
        for _, marks in chosen:
            marks[handle.id] = True
        self._handles.append(_module_hooks.register_module_forward_hook(post))
        self._dispatched = {i for i, _ in chosen}

    def _hook(self, i: int, target: Target) -> None:
        """Both hooks on one module; a module that refuses hooks (TorchScript, docs/traps.md
        §15) is listed in `unhooked` and the others are hooked all the same. A scripted module
        inside eager parents is hooked on a stand-in that takes its place in them."""
        module = target.module
        if target.places:
            module = ScriptedCall(target.module)
            for parent, attr in target.places:
                if parent._modules.get(attr) is target.module:
                    parent._modules[attr] = module
                    self._restores.append((parent, attr, target.module, module))
        own = bool(module._forward_pre_hooks)  # (a style's, FSDP's: before ours is added)
        try:
            pre = module.register_forward_pre_hook(
                CopySafeHook(self._pre_hook(i)), with_kwargs=True
            )
        except RuntimeError as exc:
            self.unhooked.append((target.name, str(exc)))
            return
        if self.grads and own and not target.places:
            self._handles.append(  # (the caller's inputs, before those hooks: engine/callers.py)
                module.register_forward_pre_hook(
                    CopySafeHook(functools.partial(self._keep_caller, i, fsdp_managed(module))),
                    with_kwargs=True,
                    prepend=True,
                )
            )
        try:
            # a tensor-parallel module (DTensor parameters): its output read before the style's
            # own hook hands it on as a local shard (use_local_output), as the DTensor it is
            parallel = "torch.distributed.tensor" in sys.modules and any(
                p is not None and is_sharded(p) for p in module._parameters.values()
            )
            post = module.register_forward_hook(CopySafeHook(self._post_hook(i)), prepend=parallel)
        except RuntimeError as exc:
            pre.remove()
            self.unhooked.append((target.name, str(exc)))
            return
        self._handles += (pre, post)

    def reset(self) -> None:
        """Forget the calls of a forward that failed, before the same forward runs again
        (engine: a model that needs autograd in its forward). The hooks stay."""
        self.resets += 1
        self.remove_tensor_hooks()
        if self._beacon is not None:
            for _ in self.open_calls():
                self._beacon.leave()
        self.calls.clear()
        self.without_grad.clear()
        self.counts = [0] * len(self.targets)
        for stack in self._stacks:
            stack.clear()
        self._callers = None
        self._open.clear()
        self._finished = 0
        self._events = 0
        self._grad_events = 0
        self.hook_ns = 0

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._keyed is not None:
            key, marked = self._keyed
            for marks in marked:
                marks.pop(key, None)
            self._keyed = None
        self._dispatched = set()
        while self._restores:  # the scripted modules back in their places
            parent, attr, scripted, standin = self._restores.pop()
            if parent._modules.get(attr) is standin:
                parent._modules[attr] = scripted

    def _mark_start(self, pending: PendingCall, args: Any, entered: int) -> None:
        """--profile: the module's own forward starts now, after this hook's work. On CUDA an
        event is recorded on the stream instead of waiting for it (no synchronisation)."""
        if on_cuda(args):
            pending.events.append(cuda_event())
        now = time.perf_counter_ns()
        self.hook_ns += now - entered
        pending.hook_ns_at_start = self.hook_ns
        pending.t_forward.append(now)

    def _seq_now(self) -> int:
        """Autograd's node counter now (per thread, increasing): the last number taken
        (autograd's own counter read where torch has it, else a node made by a dangling view of
        the probe, dropped at once): every node made later has a greater one; -1 when no node
        can be made (grad mode off)."""
        if _PEEK_SEQ is not None:  # the number the next node will take, less one
            return _PEEK_SEQ() - 1 if torch.is_grad_enabled() else -1
        assert self._probe is not None
        try:
            node = self._probe.view_as(self._probe).grad_fn
            return -1 if node is None else int(node._sequence_nr())
        except Exception:
            return -1

    def count_readers(self, scalar: torch.Tensor) -> None:
        """Before backward: the calls so far, and the graph behind `scalar`, kept for
        `settle_readers` — which walks the graph only when an origin of NaN/Inf is looked
        for (most passes have none; the graph's nodes and edges outlive backward, their saved
        tensors do not). A graph still waiting from an earlier backward is walked first."""
        self.settle_readers()
        waiting = [(p, p.input_producers) for p in self.calls if p.input_producers]
        for p, _ in waiting:
            p.input_producers = []
        self._readers_waiting = (scalar.grad_fn, waiting)

    def settle_readers(self) -> None:
        """For each call counted by `count_readers`, whether anything outside it — other
        modules, or code in a forward — also read one of its inputs (an autograd walk from the
        scalar, each edge into an input's producer placed by its reader's sequence number).
        Such an input's gradient is the sum of every reader's, so a non-finite one is not
        this call's own backward (engine.origins)."""
        if self._readers_waiting is None:
            return
        root, waiting = self._readers_waiting
        self._readers_waiting = None
        # only the edges into some call's input matter (a key each: the producer's node and
        # output, or a leaf itself)
        wanted = {(id(producer), nr) for _, producers in waiting for producer, nr in producers}
        readers: dict[tuple[int, int], list[int]] = {}
        if root is not None and wanted:
            # each node's wrapper kept while walking: a freed one's id could be a new one's
            seen: dict[int, Any] = {id(root): root}
            stack = [root]
            accumulate = _ACCUMULATE
            while stack:
                node = stack.pop()
                try:
                    seq, edges = int(node._sequence_nr()), node.next_functions
                except Exception:
                    continue
                for nxt, nr in edges:
                    if nxt is None:
                        continue
                    if type(nxt) is accumulate:  # the leaf itself; nothing behind it
                        key = (id(nxt.variable), -1)  # type: ignore[attr-defined]
                    else:
                        leaf = None if accumulate is not None else getattr(nxt, "variable", None)
                        key = (id(leaf), -1) if leaf is not None else (id(nxt), nr)
                        if id(nxt) not in seen:
                            seen[id(nxt)] = nxt
                            stack.append(nxt)
                    if key in wanted:
                        readers.setdefault(key, []).append(seq)
        for p, producers in waiting:
            span = p.seq_span
            if span is None or span[0] < 0 or span[1] < 0:
                continue
            lo, hi = span
            for producer, nr in producers:
                if any(not lo < seq <= hi for seq in readers.get((id(producer), nr), [])):
                    p.input_shared = True

    def remove_tensor_hooks(self) -> None:
        """Gradient hooks outlive the forward (backward comes after); removed here."""
        for handle in self.tensor_handles:
            handle.remove()
        self.tensor_handles.clear()
        for hooks, key in self._hooked:
            hooks.pop(key, None)
        self._hooked.clear()
        self._watched.clear()

    def _save(self, obj: Any, root: str, kind: str, call: LayerCall) -> None:
        for path, t in iter_tensors(obj, root):
            self.saver.add(f"{call.name}#{call.call}/{kind}/{path}", t)

    def _watch_grads(
        self,
        obj: Any,
        root: str,
        pending: PendingCall,
        callers: Any = None,
        casts: bool = False,
        *,
        args: Any = None,
    ) -> None:
        """A gradient hook on each tensor in obj that requires grad. A tensor hooked already
        (an output that is the next call's input), unchanged since and with no other hook
        after ours, gets no second hook: the one it has hands the gradient to both, in the
        order two hooks would have (issue 52: a hook costs more than the work it does)."""
        if root == "out" and not torch.is_grad_enabled():  # no gradient will reach them
            self.without_grad[pending.call.name] = None
            return
        specs: dict[str, Spec] | None = None
        if callers is not None:  # (the caller's own tensors where they are the inputs')
            items: Iterable[tuple[str, torch.Tensor]]
            items, specs = paired(obj, callers, root, casts=casts)
        elif type(obj) is torch.Tensor:
            items = ((root, obj),)
        elif type(obj) is tuple and len(obj) == 1 and type(obj[0]) is torch.Tensor:
            items = ((f"{root}[0]", obj[0]),)
        else:
            items = iter_tensors(obj, root)
        watched = self._watched
        for path, t in items:
            if not t.requires_grad:
                continue
            if root == "in" and self.readers:
                node = t.grad_fn
                pending.input_producers.append(
                    (node, t.output_nr) if node is not None else (t, -1)  # a leaf: itself
                )
            spec = specs.get(path) if specs else None
            if spec is not None:  # its own hook: the gradient taken as the module's DTensor
                hooked_as = t.register_hook(  # type: ignore[no-untyped-call]
                    functools.partial(self._on_grad_as, spec, [(pending, root, path)])
                )
                self.tensor_handles.append(hooked_as)
                continue
            key, version = id(t), t._version
            entry = watched.get(key)
            if entry is not None and entry[0]() is t and entry[1] == version:
                hooks = t._backward_hooks
                if hooks and next(reversed(hooks)) == entry[2]:  # ours is still the last
                    entry[3].append((pending, root, path))
                    continue
            watchers = [(pending, root, path)]
            if args is not None and t._is_view():
                self._watch_base(t, args, obj, watchers)
            hook = functools.partial(self._on_grad, watchers)
            hooked = _hook_into(t, hook)
            if hooked is not None:
                self._hooked.append(hooked)
                hook_id = hooked[1]
            else:
                handle = t.register_hook(hook)  # type: ignore[no-untyped-call]
                self.tensor_handles.append(handle)
                hook_id = handle.id
            try:  # noqa: SIM105 (a hot path)
                watched[key] = (weakref.ref(t), version, hook_id, watchers)
            except TypeError:  # no weak reference to it: each call hooks it again
                pass

    def _watch_base(
        self, t: torch.Tensor, args: Any, out: Any, watchers: list[tuple[PendingCall, str, str]]
    ) -> None:
        """An output that is a view of a tensor the layer made (a Linear's on 3-D input: its
        matmul's result reshaped): an in-place op after the layer (`h += x`, ReLU(inplace))
        rebases the view, and torch then never calls the hook on it. The base's hook, which
        keeps the value before the op, gives the view's gradient then — where the view is
        the whole base, reshaped, and neither the layer's inputs nor its other outputs are the
        base or views of it (nothing else of the model reads it)."""
        base = t._base
        if (
            base is None
            or base.grad_fn is None
            or base.numel() != t.numel()
            or not (t.is_contiguous() and base.is_contiguous())
            or any(x is base or x._base is base for _, x in iter_tensors(args, "in"))
            or any(
                x is not t and (x is base or x._base is base) for _, x in iter_tensors(out, "out")
            )
        ):
            return
        shape = t.shape
        handle = base.register_hook(  # type: ignore[no-untyped-call]
            functools.partial(self._on_base_grad, watchers, shape)
        )
        self.tensor_handles.append(handle)

    def _on_base_grad(
        self,
        watchers: list[tuple[PendingCall, str, str]],
        shape: torch.Size,
        grad: torch.Tensor | None,
    ) -> None:
        """The base's gradient: the view's, for each call watching the view whose gradient
        did not arrive by the view's own hook (it runs first where it runs at all)."""
        if grad is None:
            return
        view = grad.reshape(shape)
        key = grad_key(view)
        for pending, root, path in watchers:
            if path not in (pending.grad_inputs if root == "in" else pending.grad_outputs):
                self._grad_arrived(pending, root, path, view, key)

    def _keep_caller(
        self, i: int, casts: bool, _module: nn.Module, args: Any, kwargs: Any = None
    ) -> None:
        """Target i's inputs as its caller passed them (`casts`: FSDP2 may cast them)."""
        if self._callers is None:
            self._callers = [[] for _ in self.targets]
        self._callers[i].append((args, kwargs or {}, casts))

    def _on_grad_as(
        self, spec: Spec, watchers: list[tuple[PendingCall, str, str]], grad: torch.Tensor | None
    ) -> None:
        """A caller's tensor's gradient (a local part) taken as the DTensor the module got."""
        if grad is None:
            return
        try:
            whole = as_whole(grad, spec)
        except Exception as exc:  # never break the user's backward
            for pending, _, path in watchers:
                pending.call.error = f"could not measure the gradient of {path}: {exc}"
            return
        key = grad_key(grad)
        for pending, root, path in watchers:
            self._grad_arrived(pending, root, path, whole, key)

    def _on_grad(
        self, watchers: list[tuple[PendingCall, str, str]], grad: torch.Tensor | None
    ) -> None:
        """A watched tensor's gradient arrived: each call that watches it takes it."""
        if grad is None:  # no gradient reached this tensor: null, never an error
            return
        key = grad_key(grad)  # (one gradient, however many calls take it)
        for pending, root, path in watchers:
            self._grad_arrived(pending, root, path, grad, key)

    def _grad_arrived(
        self, pending: PendingCall, root: str, path: str, grad: torch.Tensor, key: GradKey | None
    ) -> None:
        # --profile: the first output gradient starts the module's backward, the first input
        # gradient ends it
        if self._beacon is not None:
            self._mark_backward(pending.call, root, key)
        if self.profile:
            marks = pending.t_backward
            if (root == "out" and not marks) or (root == "in" and len(marks) == 1):
                marks.append(time.perf_counter_ns())
        self._grad_events += 1
        if pending.bytes is not None and self.memory is not None:
            storage = storage_key(grad)  # --memory: the gradient's own storage
            if storage is not None:
                pending.bytes.grad_storages.setdefault(*storage)
            if root == "out":
                self.memory.output_grad(pending.bytes)
        if root == "in":
            if pending.grad_input_seen is None:
                pending.grad_input_seen = self._grad_events
                pending.grad_input_key = key
        elif pending.grad_output_seen is None:
            pending.grad_output_seen = self._grad_events
            pending.grad_output_key = key
        collector = self.collector
        if collector is None:
            return  # a timing-only session
        kind = "grad_input" if root == "in" else "grad_output"
        call = pending.call
        try:
            # whose gradient: folder runs key shared histogram edges by it
            collector.context = (call.name, call.call, kind)
            stats = collector.quick(grad, path)
            (pending.grad_inputs if root == "in" else pending.grad_outputs)[path] = stats
            if self.saver is not None:
                self.saver.add(f"{call.name}#{call.call}/{kind}/{path}", grad)
        except Exception as exc:  # never break the user's backward either
            call.error = f"could not measure the gradient of {path}: {exc}"

    def _mark_backward(self, call: LayerCall, root: str, key: GradKey | None) -> None:
        """Crash beacon: an output gradient starts that layer's backward; an input gradient
        ends it — unless the same gradient just started the backward of the layer that made
        that input (one tensor, two hooks: the more precise place stays)."""
        assert self._beacon is not None  # (key None, a sparse gradient: placed by the hook alone)
        if root == "out":
            self._started_by = key
            self._beacon.at(f"in the backward of layer {call.name} call {call.call}")
        elif key != self._started_by:
            self._beacon.at(f"in backward, after layer {call.name} call {call.call}'s backward")

    def open_calls(self) -> list[PendingCall]:
        """Calls whose module started and did not return (the forward raised inside them)."""
        return [c for stack in self._stacks for c in stack]

    def _pre_hook(self, i: int) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any]:
        return functools.partial(self._on_pre, i)

    def _on_pre(
        self, i: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Target i's call starts: its inputs measured (the forward pre-hook). `kwargs` is
        None only for a call of another pass that began before this session's hooks went
        (torch runs the hooks a call found, and asks for keywords by the hooks there now)."""
        callers = None
        if self._callers is not None and self._callers[i]:  # (what the caller passed)
            callers = self._callers[i].pop()
        if self.exclude is not None and self.exclude():
            return None
        kwargs = kwargs if kwargs is not None else {}
        target = self.targets[i]
        entered = time.perf_counter_ns() if self.profile else 0
        call = LayerCall(target.name, target.type, self.counts[i], target.aliases)
        self.counts[i] += 1
        if self._beacon is not None:
            self._beacon.enter(f"layer {call.name} call {call.call} (forward)")
        pending = PendingCall(call, entered=self._events)
        self._events += 1
        if self._probe is not None:
            pending.seq_span = (self._seq_now(), -1)
        self.calls.append(pending)
        self._stacks[i].append(pending)
        replaced = None
        if self.on_input is not None:
            try:
                replaced = self.on_input(pending, args, kwargs)
            except Exception as exc:  # the module gets its own arguments, unchanged
                call.error = f"could not replace the inputs: {exc}"
            if replaced is not None:
                args, kwargs = replaced
            if self._beacon is not None:  # on_input may have waited for another thread
                self._beacon.again()
        if self.profile:
            pending.parent = self._open[-1] if self._open else None
            self._open.append(pending)
        try:
            if self.collector is None:  # shapes only (layers --shapes, --profile timing)
                call.inputs = [shape_only(p, t) for p, t in iter_tensors(args, "in")]
                if self.grads:
                    self._watch_grads(args, "in", pending)
            else:
                self.collector.context = (call.name, call.call, "in")
                measure(self.collector, args, "in", call.inputs)
                if kwargs:
                    measure(self.collector, kwargs, "in", call.inputs)
                if self.grads:
                    given_args, given_kwargs, casts = callers or (None, None, False)
                    self._watch_grads(args, "in", pending, given_args, casts)
                    if kwargs:
                        self._watch_grads(kwargs, "in", pending, given_kwargs, casts)
                if self.saver is not None:
                    self._save(args, "in", "input", call)
                    self._save(kwargs, "in", "input", call)
        except Exception as exc:  # never break the user's forward (docs/traps.md §4)
            call.error = call.error or f"could not measure inputs: {exc}"
        if self.memory is not None:
            try:
                pending.bytes = self.memory.enter(args, kwargs, module)
            except Exception as exc:  # never break the user's forward (docs/traps.md §4)
                call.error = call.error or f"could not size the call: {exc}"
        if self.profile:
            self._mark_start(pending, args, entered)
        return replaced

    def _post_hook(self, i: int) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        return functools.partial(self._on_post, i)

    def _on_post(self, i: int, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Target i's call returned: its outputs measured (the forward hook)."""
        if self.exclude is not None and self.exclude():
            return
        stack = self._stacks[i]
        if not stack:
            return  # hooks registered mid-call: nothing to pair with
        pending = stack.pop()
        if self._beacon is not None:
            self._beacon.leave()
        if self.memory is not None and pending.bytes is not None:
            try:
                self.memory.leave(pending.bytes, output)
            except Exception as exc:
                pending.call.error = f"could not size the output: {exc}"
        entered = 0
        if self.profile:
            if pending in self._open:
                del self._open[self._open.index(pending) :]
            if pending.events:
                pending.events.append(cuda_event())
            entered = time.perf_counter_ns()  # first: our own work excluded
            # a container's span holds its children's hooks: take their time out
            nested = self.hook_ns - pending.hook_ns_at_start
            pending.t_forward.append(entered - nested)
        pending.finished = self._finished
        self._finished += 1
        pending.returned = self._events
        self._events += 1
        if self._probe is not None and pending.seq_span is not None:
            pending.seq_span = (pending.seq_span[0], self._seq_now())
        call = pending.call
        try:
            if self.profile:
                pending.output_bytes = sum(
                    t.numel() * t.element_size() for _, t in iter_tensors(output, "out")
                )
            if self.collector is None:
                call.outputs = [shape_only(p, t) for p, t in iter_tensors(output, "out")]
                if self.grads:
                    self._watch_grads(output, "out", pending)
            else:
                self.collector.context = (call.name, call.call, "out")
                measure(self.collector, output, "out", call.outputs)
                if self.grads:
                    self._watch_grads(output, "out", pending, args=args)
                if self.saver is not None:
                    self._save(output, "out", "output", call)
            if self.on_output is not None:
                self.on_output(pending, output)
        except Exception as exc:
            call.error = f"could not measure outputs: {exc}"
        if self.profile:
            self.hook_ns += time.perf_counter_ns() - entered
