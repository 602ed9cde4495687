"""The sides of a diff side by side: the reference side's pass hands each call's tensors
straight to the compared passes running beside it, instead of spilling them to disk and
reading them back (the spill in measure.py).

Each call is a rendezvous. The reference side puts a call's outputs (or, for a pass fed the
reference's inputs, its inputs) in a one-slot exchange and waits there until every pass that
needs them has measured (or copied) them, so a tensor is never read after the reference side
has moved on and changed it in place (an in-place ReLU after a BatchNorm). At most one call's
tensors are held: memory stays flat in the number of layers, as with the spill.

The passes must meet the same calls in the same order. When they do not (a side that skips or
repeats a call, a forward run again with gradients), the exchange breaks: every pass stops at
its next call and the caller runs the batch again through the spill, which pairs calls by key.
So does a run whose forward drew random numbers (the passes share torch's generator, and would
draw each other's numbers). Sides that cannot run at the same time never try: the same module
object on two sides (their hooks would fire for both), torch.compile, ONNX Runtime.

The passes are greenlets of the calling thread, switched at the rendezvous: one thread, so one
pool of torch's worker threads, warm for every pass (as threads, each pass had a pool of its
own, asleep when its turn came and still spinning when it ended: two resnet50 passes handing
the turn over at every leaf call took 1.18x the two plain passes as threads, 0.98x as
greenlets). Grad mode, autocast and, once CUDA is in use, the current CUDA device and stream,
which torch keeps per thread, are each pass's own: saved when it waits, put back when it
resumes. What cannot be put back (inference mode, a torch function or dispatch mode) a pass may
not hold while it waits: the exchange breaks and the spill runs the batch. Without the greenlet
package the passes are threads.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from hookcli.commands.diff.measure import Compared, Key, Lookup, kept
from hookcli.commands.diff.passes import compared_pass, reference_pass
from hookcli.commands.diff.sides import Compile, SideRun
from hookcli.engine.passes import shared_passes
from hookcli.engine.stats import kernel_threads, use_kernel_threads
from hookcli.errors import ModelError
from hookcli.inputs import ModelInput
from hookcli.runtime import beacon

ENABLED = True  # False: every batch through the spill (tests compare the two)
GREENLETS = True  # False: the passes run as threads (tests compare the two)
SHARED = True  # False: a side's two passes in rounds of their own (tests compare the two)
MOVED = "the model's state moved"  # _round: a model's state moved under passes at once
_MOVING: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models whose forward moves state


class _Abandoned(BaseException):
    """Raised inside a pass whose exchange broke, to stop it at its next call. A BaseException:
    the hooks let it through, as the user's forward would not catch it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Consumer:
    """A compared pass: its side (as a crash message names it), its input, whether it is fed
    the reference's inputs, and what it accumulates."""

    described: str
    run: SideRun
    model_input: ModelInput
    isolate: bool
    compared: Compared


REFERENCE = -1  # the reference pass, among the compared passes' indices


class Exchange:
    """The one-slot rendezvous between the reference pass (`put`) and the compared passes
    (`reader(i).get`), and the turn: one pass at a time runs model code, the others are parked
    at a hook. So code between hooks never runs in two passes at once either (a draw from
    torch's generator, a lazy module's first call), and `unchanged()` — the generator as
    seeded — is checked at each handover."""

    def __init__(
        self,
        isolate: Sequence[bool],
        unchanged: Callable[[], bool],
        cv: threading.Condition | _Cooperative | None = None,
        strand: Callable[[], Any] = threading.get_ident,
    ) -> None:
        """`strand`: what tells the passes' code apart (the current greenlet, or thread)."""
        self._cv = cv if cv is not None else threading.Condition()
        self.moves = 0  # a pass took the turn, or the state changed: progress (greenlets)
        self._isolate = list(isolate)
        self._unchanged = unchanged
        self._slot: tuple[Key, dict[str, np.ndarray[Any, Any] | torch.Tensor]] | None = None
        self._waiting: set[int] = set()  # the passes yet to read the slot
        self._ended: set[int] = set()  # compared passes that are over
        self._over = False  # the reference pass is over
        self._runner: int | None = None  # whose turn it is: REFERENCE, a compared pass, nobody
        self._posted: set[tuple[str, int, str]] = set()
        self.index: set[Key] = set()
        self.broken: str | None = None
        self._homes: dict[int, int] = {}  # each pass's thread (greenlets: all the same one)
        # each pass's strand of execution: its greenlet, or its thread
        self._strand = strand
        self._strands: dict[Any, int] = {}

    @property
    def inputs(self) -> bool:
        """Whether some compared pass is fed the reference's inputs."""
        return any(self._isolate)

    # ---------------------------------------------------------------- under the lock
    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
        self._notify()

    def _notify(self) -> None:
        self.moves += 1
        self._cv.notify_all()

    def _wait(self, me: int, ready: Callable[[], bool]) -> None:
        """Go on once ready() holds and it is this pass's turn: keep the turn when ready
        already, else give it up and wait for it (or for the exchange to break)."""
        if self._runner == me:
            if ready():
                return
            self._runner = None
            self._notify()
        while self.broken is None and not (ready() and self._runner is None):
            self._cv.wait()
        if self.broken is None:
            self._runner = me
            self.moves += 1

    def _mine(self, i: int) -> bool:
        return self._slot is not None and i in self._waiting

    def _turn(self, i: int) -> None:
        """A compared pass's turn: the reference pass stopped at an event for it, or over."""
        self._wait(i, lambda: self._mine(i) or self._over)

    def _leave(self, me: int) -> None:
        if self._runner == me:
            self._runner = None
        self._notify()

    def abort(self, why: str) -> None:
        with self._cv:
            self._break(why)

    def _foreign(self, me: int) -> bool:
        """A hook of pass `me` called from a thread of the model's own (a forward that runs
        layers in threads): it cannot wait for its turn there (a greenlet belongs to its
        thread), so the exchange breaks, the call returns quietly — nothing raised into the
        model's thread — and the spill runs the batch (issue 32)."""
        home = self._homes.get(me)
        if home is None or home == threading.get_ident():
            return False
        with self._cv:
            self._break("a forward called a layer from a thread of its own")
        return True

    # ---------------------------------------------------------------- the reference pass
    def begin(self) -> None:
        """The reference pass starts, with the turn."""
        self._homes[REFERENCE] = threading.get_ident()
        self._strands[self._strand()] = REFERENCE
        with self._cv:
            self._wait(REFERENCE, lambda: True)

    def put(self, name: str, call: int, kind: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self._foreign(REFERENCE):
            return
        arrays = {path: kept(t) for path, t in tensors}
        with self._cv:
            key = (name, call, kind)
            if key in self._posted:
                self._break(f"the reference side ran {name} call {call} twice")
            need = {i for i, iso in enumerate(self._isolate) if kind == "out" or iso}
            if need & self._ended:
                self._break(f"a compared side ended before {name} call {call}")
            if not self._unchanged():
                self._break("a forward drew from torch's generator")
            if self.broken is not None:
                raise _Abandoned
            self._posted.add(key)
            self.index.update((name, call, path) for path in arrays)
            self._slot, self._waiting = (key, arrays), need
            self._wait(REFERENCE, lambda: not self._waiting)
            self._slot = None
            if self.broken is not None:
                raise _Abandoned

    def end(self) -> None:
        """The reference pass is over (or failed)."""
        with self._cv:
            self._over = True
            self._leave(REFERENCE)

    # ---------------------------------------------------------------- a compared pass
    def reader(self, i: int) -> Reader:
        return Reader(self, i)

    @contextlib.contextmanager
    def _get(self, i: int, name: str, call: int, kind: str) -> Iterator[Lookup]:
        if self._foreign(i):
            yield lambda path: None  # measured against nothing: the spill runs the batch
            return
        with self._cv:
            self._turn(i)
            if self.broken is None and not self._mine(i):
                self._break(f"the reference side has no {name} call {call}")
            if self.broken is not None or self._slot is None:
                raise _Abandoned
            key, arrays = self._slot
            if key != (name, call, kind):
                self._break(f"the sides' calls differ: {key[0]} call {key[1]} against {name}")
                raise _Abandoned
        try:
            yield arrays.get
        finally:
            with self._cv:
                self._waiting.discard(i)
                if not self._waiting:
                    self._notify()

    def _pace(self, i: int) -> None:
        """Before a compared pass starts, and before each of its calls runs: its turn comes
        once the reference pass has stopped at an event this pass has yet to read (so the
        passes compute one after the other: two thread pools on the same cores slow each
        other down more than they gain). A container's call and its first child's both go on
        the same stop."""
        self._homes.setdefault(i, threading.get_ident())
        self._strands.setdefault(self._strand(), i)
        if self._foreign(i):
            return
        with self._cv:
            self._turn(i)

    def _elsewhere(self, i: int) -> bool:
        """Whether the code running now is another pass's (for two passes on one model, whose
        hooks fire for both): a thread of the model's own is nobody's, so pass i's hooks
        still see it, and break the exchange (`_foreign`)."""
        return self._strands.get(self._strand(), i) != i

    def _ended_pass(self, i: int) -> None:
        with self._cv:
            self._ended.add(i)
            if i in self._waiting:
                self._break("a compared side ended before the reference side")
            self._leave(i)


@dataclasses.dataclass(frozen=True, slots=True)
class Reader:
    """What one compared pass reads the exchange through (measure.Reference)."""

    exchange: Exchange
    i: int

    @property
    def index(self) -> set[Key]:
        return self.exchange.index

    def get(self, name: str, call: int, kind: str) -> contextlib.AbstractContextManager[Lookup]:
        return self.exchange._get(self.i, name, call, kind)

    def pace(self) -> None:
        self.exchange._pace(self.i)

    def elsewhere(self) -> bool:
        return self.exchange._elsewhere(self.i)


def fits(runs: Sequence[SideRun]) -> bool:
    """Whether these sides can run side by side: hooked passes (no ONNX Runtime), no
    torch.compile (dynamo compiles in one thread at a time), no lazy module yet to draw its
    weights, no module, parameter or buffer shared by two sides, one seed (the generator
    check), on the CPU or CUDA."""
    if not ENABLED or len(runs) < 2:
        return False
    owners: set[int] = set()
    for run in runs:
        if run.side.pass_runner() is not None or run.side.has(Compile):
            return False
        if run.prepared.device.type not in ("cpu", "cuda"):
            return False
        module = run.prepared.loaded.module
        if any(
            isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()
            for m in module.modules()
        ):
            return False  # its first call draws its weights: a pass that falls back keeps them
        mine = {id(x) for x in (*module.modules(), *module.parameters(), *module.buffers())}
        if mine & owners:
            return False
        owners |= mine
    return len({run.prepared.seed for run in runs}) == 1


def run(
    reference: SideRun, described: str, model_input: ModelInput, consumers: Sequence[Consumer]
) -> set[Key] | None:
    """One batch of the reference pass and every compared pass, side by side: the keys of
    the reference's tensors; None (and every Compared as it was) when the passes did not meet
    the same calls, for the spill to run the batch again.

    Two passes of one side (its accumulated and its own error) run on the same module. They
    run at the same time all the same, beside one reference pass: each pass's hooks leave the
    other's calls alone, and the model's state is set and restored once around both
    (engine.passes.shared_passes). Unless the model's forward moves its state (writes a
    buffer, counts its calls): each pass would then see the other's moves, so the batch runs
    again in rounds, one pass of each side in each, every round with a reference pass of its
    own (which costs less than spilling the reference's inputs and outputs and reading them
    back), and so do the model's later batches. A failure of a pass is raised, the reference
    side's first, as the spill's passes, one after another, would raise it."""
    kept = [copy.deepcopy(c.compared) for c in consumers]
    shared = _shared(consumers)
    if shared:  # each pass on a copy of its input (a forward may change it in place)
        first = [dataclasses.replace(c, model_input=c.model_input.copy()) for c in consumers]
        at_once = _round(reference, described, model_input.copy(), first, shared)
        if not isinstance(at_once, str):
            if at_once is None:
                _restore_all(consumers, kept)
            return at_once
        _restore_all(consumers, kept)  # the model's state moved: in rounds
    rounds: list[list[Consumer]] = []
    taken: dict[int, int] = {}  # id(run) → its passes placed so far
    for c in consumers:
        n = taken[id(c.run)] = taken.get(id(c.run), -1) + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(c)
    index: set[Key] | None = set()
    for group in rounds:  # each round's reference pass on its own copy of the input
        got = _round(reference, described, model_input.copy(), group)
        index = None if isinstance(got, str) else got
        if index is None:
            _restore_all(consumers, kept)  # for the spill to run again
            break
    return index


def _shared(consumers: Sequence[Consumer]) -> list[SideRun]:
    """The sides with two passes here, when those may run at the same time (else none): not
    a model whose forward moved its state before, nor one holding TorchScript modules (each
    pass's hooks put a stand-in of its own in their place)."""
    if not SHARED:
        return []
    runs = {id(c.run): c.run for c in consumers}
    doubled = [r for r in runs.values() if sum(c.run is r for c in consumers) > 1]
    for r in doubled:
        if r.prepared.loaded.module in _MOVING or any(t.places for t in r.prepared.targets):
            return []
    return doubled


def _restore_all(consumers: Sequence[Consumer], kept: Sequence[Compared]) -> None:
    for c, saved in zip(consumers, kept, strict=True):
        _restore(c.compared, saved)


def _round(
    reference: SideRun,
    described: str,
    model_input: ModelInput,
    consumers: Sequence[Consumer],
    shared: Sequence[SideRun] = (),
) -> set[Key] | str | None:
    """The reference pass and the compared passes as greenlets of this thread (or, without
    the greenlet package, the reference pass and all compared passes but the last in threads
    of their own, the last in this one, where Ctrl-C arrives). Each writes its calls to the
    crash beacon under its side's name: the passes take turns, so the last to write is
    running. `shared`: sides whose passes run here on one model at the same time; MOVED when
    such a model's state moved."""
    cuda, seeded = _seeded_state(reference.prepared.seed)
    switched = _greenlet() if GREENLETS else None
    cv = _Cooperative(switched.getcurrent()) if switched is not None else None
    strand = switched.getcurrent if switched is not None else threading.get_ident
    exchange = Exchange([c.isolate for c in consumers], lambda: _state(cuda) == seeded, cv, strand)
    doubled = {id(r) for r in shared}
    errors: dict[int, BaseException] = {}  # REFERENCE, or a compared pass's index
    threads_of_kernels = kernel_threads()  # loads the kernels here, not in two passes at once

    def produce() -> None:
        try:
            exchange.begin()
            use_kernel_threads(threads_of_kernels)
            with beacon.thread_phase(f"diff side {described}"):
                reference_pass(reference, model_input, exchange, exchange.inputs)
        except BaseException as exc:
            errors[REFERENCE] = exc
            exchange.abort("the reference side failed")
        finally:
            exchange.end()

    def consume(i: int) -> None:
        c = consumers[i]
        reader = exchange.reader(i)
        try:
            reader.pace()  # the reference pass first, to its first event
            use_kernel_threads(threads_of_kernels)
            exclude = reader.elsewhere if id(c.run) in doubled else None
            with beacon.thread_phase(f"diff side {c.described}"):
                compared_pass(c.run, c.model_input, reader, c.isolate, c.compared, exclude=exclude)
        except BaseException as exc:
            errors[i] = exc
            exchange.abort("a compared side failed")
        finally:
            exchange._ended_pass(i)

    passes: list[Callable[[], None]] = [produce]
    passes += [functools.partial(consume, i) for i in range(len(consumers))]
    with contextlib.ExitStack() as held:
        moved = [held.enter_context(shared_passes(r.prepared)) for r in shared]
        if cv is not None:
            _as_greenlets(switched, passes, cv, exchange)
        else:
            _as_threads(passes, exchange)
        moving = [r.prepared.loaded.module for r, m in zip(shared, moved, strict=True) if m()]
    failed = {i: e for i, e in errors.items() if not _abandoned(e)}
    if REFERENCE in failed:  # as the spill would: the reference pass runs first
        raise failed[REFERENCE]
    for exc in failed.values():
        if not isinstance(exc, Exception):  # Ctrl-C and the like: at once
            raise exc
    if failed:  # a compared side's error: the spill runs the batch again, and raises it
        return None  # after a reference pass that ran to its end (which may fail later)
    if moving:
        _MOVING.update(moving)
        return MOVED
    return exchange.index if exchange.broken is None and _state(cuda) == seeded else None


def _as_threads(passes: Sequence[Callable[[], None]], exchange: Exchange) -> None:
    """Every pass but the last in a thread of its own, the last in this one (Ctrl-C arrives
    here)."""
    names = ["hookcli-diff-reference"] + [f"hookcli-diff-{i}" for i in range(len(passes) - 2)]
    threads = [
        threading.Thread(target=p, name=n, daemon=True)
        for p, n in zip(passes[:-1], names, strict=True)
    ]
    started: list[threading.Thread] = []
    try:
        for t in threads:
            t.start()
            started.append(t)
        passes[-1]()
        for t in started:
            t.join()
    except BaseException:  # Ctrl-C while waiting for the others: stop them too
        exchange.abort("interrupted")
        for t in started:
            t.join()
        raise


def _as_greenlets(
    switched: Any, passes: Sequence[Callable[[], None]], cv: _Cooperative, exchange: Exchange
) -> None:
    """Each pass a greenlet of this thread, resumed in turn until all have ended: one that
    waits comes back here at once, one whose turn it is runs to its next wait. A round in
    which none moved (none took the turn, none ended) can only repeat: the exchange breaks
    (every pass then stops at its next call, and the spill runs the batch again). Ctrl-C
    raised here, between passes, breaks it too, and is raised once every pass has stopped; a
    pass still not over then (a second Ctrl-C) is stopped here and now, not whenever the
    garbage collector would get to it."""
    home = _torch_state()
    lets = [switched.greenlet(p) for p in passes]
    try:
        try:
            _resume(lets, exchange, cv, home)
        except BaseException:
            exchange.abort("interrupted")
            _resume(lets, exchange, cv, home)
            raise
    finally:
        for g in lets:
            for _ in range(100):  # each throw unwinds the pass to its end, or to a wait
                if g.dead:
                    break
                _set_torch_state(home)
                g.throw(_Abandoned)
        _set_torch_state(home)


def _resume(lets: Sequence[Any], exchange: Exchange, cv: _Cooperative, home: _TorchState) -> None:
    while True:
        live = [g for g in lets if not g.dead]
        if not live:
            return
        before = exchange.moves
        for g in live:
            _set_torch_state(home)  # a pass that starts begins from this thread's state
            g.switch()  # one that resumes puts its own back (_Cooperative.wait)
            if cv.held is not None:  # it waits holding what cannot be put back
                exchange.abort(f"a pass waited {cv.held}")
                cv.held = None
        if exchange.moves == before and all(not g.dead for g in live):
            exchange.abort("the passes could not take turns")


_TorchState = tuple[bool, tuple[tuple[bool, torch.dtype], ...], bool, tuple[Any, ...]]
_AUTOCAST_DEVICES = ("cpu", "cuda")


def _torch_state() -> _TorchState:
    """What torch keeps per thread that a pass sets and that can be put back: grad mode,
    autocast, and (once CUDA is in use) the current CUDA device and stream (the stream as
    torch's (id, device index, device type): no Stream object made at every turn)."""
    cuda: tuple[Any, ...] = ()
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        device = torch.cuda.current_device()
        cuda = (device, _stream_of(device))
    return (
        torch.is_grad_enabled(),
        tuple(
            (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
        ),
        torch.is_autocast_cache_enabled(),
        cuda,
    )


def _stream_of(device: int) -> Any:
    """The current stream of a CUDA device, as `_set_stream` takes it back."""
    raw = getattr(torch._C, "_cuda_getCurrentStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device)


def _set_stream(stream: Any) -> None:
    if isinstance(stream, torch.cuda.Stream):
        torch.cuda.set_stream(stream)
    else:  # (stream id, device index, device type), as torch.cuda.set_stream passes them
        sid, index, kind = stream
        torch._C._cuda_setStream(stream_id=sid, device_index=index, device_type=kind)


def _set_torch_state(state: _TorchState) -> None:
    """`state` put back, each part only where it differs (a set is then a no-op: this runs at
    every turn of every pass)."""
    grad, autocast, cache, cuda = state
    if torch.is_grad_enabled() != grad:
        torch.set_grad_enabled(grad)
    for device, (on, dtype) in zip(_AUTOCAST_DEVICES, autocast, strict=True):
        if torch.is_autocast_enabled(device) != on:
            torch.set_autocast_enabled(device, on)
        if torch.get_autocast_dtype(device) != dtype:
            torch.set_autocast_dtype(device, dtype)
    if torch.is_autocast_cache_enabled() != cache:
        torch.set_autocast_cache_enabled(cache)
    if cuda:
        device, stream = cuda
        if torch.cuda.current_device() != device:
            torch.cuda.set_device(device)
        if _stream_of(device) != stream:
            _set_stream(stream)


def _unswappable() -> tuple[bool, int, int]:
    """What torch keeps per thread that cannot be put back: inference mode, and the torch
    function and dispatch modes (a `with torch.device(...)` block is one)."""
    return (
        torch.is_inference_mode_enabled(),
        int(torch._C._len_torch_function_stack()),
        int(torch._C._len_torch_dispatch_stack()),
    )


class _Cooperative:
    """threading.Condition's part the exchange uses, for passes that are greenlets of one
    thread: no lock (one runs at a time), and waiting is going back to the greenlet that
    resumes them (`hub`), this pass's torch state saved and put back. A pass that waits in
    inference mode or a torch mode (which cannot be put back) says so in `held`."""

    def __init__(self, hub: Any) -> None:
        self.hub = hub
        self.unswappable = _unswappable()  # the hub's, made in its thread just before
        self.held: str | None = None

    def __enter__(self) -> _Cooperative:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def notify_all(self) -> None:
        """Nothing: every waiting pass looks again when it is resumed."""

    def wait(self) -> None:
        state = _torch_state()
        if _unswappable() != self.unswappable:
            self.held = "in inference mode or a torch function or dispatch mode"
        self.hub.switch()
        _set_torch_state(state)


def _greenlet() -> Any:
    """The greenlet module, or None where it is not installed."""
    try:
        return importlib.import_module("greenlet")
    except ImportError:
        return None


def _abandoned(exc: BaseException) -> bool:
    return isinstance(exc, _Abandoned) or (
        isinstance(exc, ModelError) and isinstance(exc.__cause__, _Abandoned)
    )


def _restore(into: Compared, saved: Compared) -> None:
    for f in dataclasses.fields(Compared):
        setattr(into, f.name, getattr(saved, f.name))


def _state(cuda: bool) -> list[bytes]:
    """torch's generators (CPU, and with `cuda` every CUDA device's), as bytes."""
    states = [torch.get_rng_state()]
    if cuda:
        states += torch.cuda.get_rng_state_all()
    return [bytes(s.numpy().tobytes()) for s in states]


def _seeded_state(seed: int) -> tuple[bool, list[bytes]]:
    """The generators as every pass leaves them when its forward draws nothing: seeded (CUDA's
    when CUDA is in use already: the sides' models are on their devices by now)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    torch.manual_seed(seed)
    return cuda, _state(cuda)
