"""A program's random generators, left as found by each call of the Python API.

A pass seeds torch's generators (`--seed`: dropout and the like draw the same numbers every
run) and so does building a model from a name (its random initialisation). Seeding torch's
global generators inside a program that calls `hookcli.check(model, x)` every few steps would
rewind that program's own random stream at each call: the same dropout masks and shuffles
again after every check. So each API call puts the generators back as it found them: the CPU's,
each CUDA device's when CUDA was in use before the call (else the seeds queued for CUDA's
start, as the program left them) and MPS's. Two calls at once in two threads, or draws by other
threads during a call, are not kept apart."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def kept(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, with torch's generators put back after it as they were before it."""

    @functools.wraps(fn)
    def keeping(*args: P.args, **kwargs: P.kwargs) -> R:
        with left_as_found():
            return fn(*args, **kwargs)

    return keeping


@contextlib.contextmanager
def left_as_found() -> Iterator[None]:
    """torch's generators as they were when the block began, put back when it ends (an API
    call; watch's re-run of a step, which sets them to the step's)."""
    import torch

    cpu = torch.default_generator.get_state()
    started = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda = torch.cuda.get_rng_state_all() if started else None
    queue = None if started else _queued(torch)
    mps = torch.mps.get_rng_state() if torch.backends.mps.is_available() else None
    try:
        yield
    finally:
        # (each on its own, and never in place of the block's own error)
        with contextlib.suppress(Exception):
            torch.default_generator.set_state(cpu)  # (its initial seed too)
        with contextlib.suppress(Exception):
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
            elif queue is not None:
                _requeue(torch, *queue)
        if mps is not None:
            with contextlib.suppress(Exception):
                torch.mps.set_rng_state(mps)


def _queued(torch: Any) -> tuple[Any, Any, Any, list[Any]] | None:
    """Before CUDA starts, the seeds torch queues for its start (torch.manual_seed queues one:
    the latest of each kind is kept, and replayed at the start), as torch's own tracker of
    them holds them; None where this torch keeps no such tracker."""
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    fields = ("manual_seed_all_cb", "manual_seed_cb", "call_order")
    if tracker is None or not all(hasattr(tracker, f) for f in fields):
        return None
    return tracker, tracker.manual_seed_all_cb, tracker.manual_seed_cb, list(tracker.call_order)


def _requeue(torch: Any, tracker: Any, seed_all: Any, seed: Any, order: list[Any]) -> None:
    if not torch.cuda.is_initialized():  # the queue as it was: the block's own seed unqueued
        tracker.manual_seed_all_cb, tracker.manual_seed_cb = seed_all, seed
        tracker.call_order = order
        return
    # CUDA started during the block: from the seeds the program queued (torch.manual_seed,
    # torch.cuda.manual_seed(_all)) as its start would have, or torch's default seed when it
    # queued none. (A generator state it queued with torch.cuda.set_rng_state, or a random
    # seed with torch.cuda.seed, is not replayed.)
    torch.cuda.manual_seed_all(_DEFAULT_SEED)
    for queued in order:
        if queued is not None:
            queued[0]()


_DEFAULT_SEED = 67280421310721  # torch's generators' seed until one is given (CPU and CUDA)
