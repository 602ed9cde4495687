"""The sides of a diff side by side: the reference side's pass in a thread of its own hands
each call's tensors straight to the compared passes running beside it, instead of spilling
them to disk and reading them back (the spill in measure.py).

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
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hookcli.commands.diff.measure import Compared, Key, Lookup, as_array
from hookcli.commands.diff.passes import compared_pass, reference_pass
from hookcli.commands.diff.sides import Compile, SideRun
from hookcli.errors import ModelError
from hookcli.inputs import ModelInput
from hookcli.runtime import beacon

ENABLED = True  # False: every batch through the spill (tests compare the two)


class _Abandoned(BaseException):
    """Raised inside a pass whose exchange broke, to stop it at its next call. A BaseException:
    the hooks let it through, as the user's forward would not catch it."""


@dataclass(frozen=True, slots=True)
class Consumer:
    """A compared pass: its side (as a crash message names it), its input, whether it is fed
    the reference's inputs, and what it accumulates."""

    described: str
    run: SideRun
    model_input: ModelInput
    isolate: bool
    compared: Compared


class Exchange:
    """The one-slot rendezvous between the reference pass (`put`) and the compared passes
    (`reader(i).get`)."""

    def __init__(self, isolate: Sequence[bool]) -> None:
        self._cv = threading.Condition()
        self._isolate = list(isolate)
        self._slot: tuple[tuple[str, int, str], dict[str, np.ndarray[Any, Any]]] | None = None
        self._waiting: set[int] = set()  # the passes yet to read the slot
        self._ended: set[int] = set()  # compared passes that are over
        self._over = False  # the reference pass is over
        self._posted: set[tuple[str, int, str]] = set()
        self._puts = 0  # events put so far
        self._seen = [0] * len(isolate)  # per compared pass: the events it has paced past
        self.index: set[Key] = set()
        self.broken: str | None = None

    @property
    def inputs(self) -> bool:
        """Whether some compared pass is fed the reference's inputs."""
        return any(self._isolate)

    def _break(self, why: str) -> None:  # under the lock
        if self.broken is None:
            self.broken = why
        self._cv.notify_all()

    def abort(self, why: str) -> None:
        with self._cv:
            self._break(why)

    def put(self, name: str, call: int, kind: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
        arrays = {path: as_array(t) for path, t in tensors}
        with self._cv:
            key = (name, call, kind)
            if key in self._posted:
                self._break(f"the reference side ran {name} call {call} twice")
            need = {i for i, iso in enumerate(self._isolate) if kind == "out" or iso}
            if need & self._ended:
                self._break(f"a compared side ended before {name} call {call}")
            if self.broken is not None:
                raise _Abandoned
            self._posted.add(key)
            self.index.update((name, call, path) for path in arrays)
            self._slot, self._waiting = (key, arrays), need
            self._puts += 1
            self._cv.notify_all()
            while self._waiting and self.broken is None:
                self._cv.wait()
            self._slot = None
            if self.broken is not None:
                raise _Abandoned

    def end(self) -> None:
        """The reference pass is over (or failed)."""
        with self._cv:
            self._over = True
            self._cv.notify_all()

    def reader(self, i: int) -> Reader:
        return Reader(self, i)

    @contextlib.contextmanager
    def _get(self, i: int, name: str, call: int, kind: str) -> Iterator[Lookup]:
        with self._cv:
            while self.broken is None and not (self._slot is not None and i in self._waiting):
                if self._over:
                    self._break(f"the reference side has no {name} call {call}")
                else:
                    self._cv.wait()
            if self.broken is not None or self._slot is None:
                raise _Abandoned
            key, arrays = self._slot
            self._seen[i] = self._puts  # paced past it
            if key != (name, call, kind):
                self._break(f"the sides' calls differ: {key[0]} call {key[1]} against {name}")
                raise _Abandoned
        try:
            yield arrays.get
        finally:
            with self._cv:
                self._waiting.discard(i)
                if not self._waiting:
                    self._cv.notify_all()

    def _pace(self, i: int) -> None:
        """Before a compared pass's call runs: wait until the reference pass has stopped at
        its next event, so that the two compute one after the other, not at once (two
        passes' thread pools on the same cores slow each other down more than they gain)."""
        with self._cv:
            while self.broken is None and not self._over and self._puts == self._seen[i]:
                self._cv.wait()
            self._seen[i] = self._puts

    def _ended_pass(self, i: int) -> None:
        with self._cv:
            self._ended.add(i)
            if i in self._waiting:
                self._break("a compared side ended before the reference side")
            self._cv.notify_all()


@dataclass(frozen=True, slots=True)
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


def fits(runs: Sequence[SideRun]) -> bool:
    """Whether these sides can run side by side: hooked passes (no ONNX Runtime), no
    torch.compile (dynamo compiles in one thread at a time), no module, parameter or buffer
    shared by two sides, one seed (the generator check below), on the CPU or CUDA."""
    if not ENABLED or len(runs) < 2:
        return False
    owners: set[int] = set()
    for run in runs:
        if run.side.pass_runner() is not None or run.side.has(Compile):
            return False
        if run.prepared.device.type not in ("cpu", "cuda"):
            return False
        module = run.prepared.loaded.module
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

    Two passes of one side (its accumulated and its own error) run on the same module, so
    never at the same time: they go in rounds, each round with a reference pass of its own
    (which costs less than spilling the reference's inputs and outputs and reading them back).
    A failure of a pass is raised, the reference side's first, as the spill's passes, one
    after another, would raise it."""
    from hookcli.engine.stats import kernels

    kernels()  # loaded here, once, not by two passes at a time
    kept = [copy.deepcopy(c.compared) for c in consumers]
    rounds: list[list[Consumer]] = []
    taken: dict[int, int] = {}  # id(run) → its passes placed so far
    for c in consumers:
        n = taken[id(c.run)] = taken.get(id(c.run), -1) + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(c)
    index: set[Key] | None = set()
    for group in rounds:
        index = _round(reference, described, model_input, group)
        if index is None:
            for c, saved in zip(consumers, kept, strict=True):  # for the spill to run again
                _restore(c.compared, saved)
            break
    return index


def _round(
    reference: SideRun, described: str, model_input: ModelInput, consumers: Sequence[Consumer]
) -> set[Key] | None:
    """The reference pass in a thread of its own, the last compared pass in this one (Ctrl-C
    arrives here), the others in threads of their own. Each writes its calls to the crash
    beacon under its side's name: the passes take turns, so the last to write is running."""
    exchange = Exchange([c.isolate for c in consumers])
    seeded = _seeded_state(reference.prepared.seed)
    errors: dict[int, BaseException] = {}  # -1: the reference pass

    def produce() -> None:
        try:
            with beacon.thread_phase(f"diff side {described}"):
                reference_pass(reference, model_input, exchange, exchange.inputs)
        except BaseException as exc:
            errors[-1] = exc
            exchange.abort("the reference side failed")
        finally:
            exchange.end()

    def consume(i: int) -> None:
        c = consumers[i]
        try:
            with beacon.thread_phase(f"diff side {c.described}"):
                compared_pass(c.run, c.model_input, exchange.reader(i), c.isolate, c.compared)
        except BaseException as exc:
            errors[i] = exc
            exchange.abort("a compared side failed")
        finally:
            exchange._ended_pass(i)

    last = len(consumers) - 1
    threads = [threading.Thread(target=produce, name="hookcli-diff-reference", daemon=True)]
    threads += [
        threading.Thread(target=consume, args=(i,), name=f"hookcli-diff-{i}", daemon=True)
        for i in range(last)
    ]
    for t in threads:
        t.start()
    try:
        consume(last)
        for t in threads:
            t.join()
    except BaseException:  # Ctrl-C while waiting for the others: stop them too
        exchange.abort("interrupted")
        for t in threads:
            t.join()
        raise
    for i in (-1, *range(len(consumers))):
        exc = errors.get(i)
        if exc is not None and not _abandoned(exc):
            raise exc
    return exchange.index if exchange.broken is None and _state() == seeded else None


def _abandoned(exc: BaseException) -> bool:
    return isinstance(exc, _Abandoned) or (
        isinstance(exc, ModelError) and isinstance(exc.__cause__, _Abandoned)
    )


def _restore(into: Compared, saved: Compared) -> None:
    into.calls, into.order, into.outputs = saved.calls, saved.order, saved.outputs
    into.missing, into.agreement = saved.missing, saved.agreement


def _state() -> list[bytes]:
    """torch's generators (CPU, and CUDA when it is in use), as bytes."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states += torch.cuda.get_rng_state_all()
    return [bytes(s.numpy().tobytes()) for s in states]


def _seeded_state(seed: int) -> list[bytes]:
    """The generators as every pass leaves them when its forward draws nothing: seeded."""
    torch.manual_seed(seed)
    return _state()
