"""A program's random generators, left as found by each call of the Python API.

A pass seeds torch's generators (`--seed`: dropout and the like draw the same numbers every
run) and so does building a model from a name (its random initialisation). Seeding torch's
global generators inside a program that calls `hookcli.check(model, x)` every few steps would
rewind that program's own random stream at each call: the same dropout masks and shuffles
again after every check. So each API call puts the generators back as it found them: the CPU's,
each CUDA device's when CUDA was in use before the call (else the seed CUDA will start from,
queued again as the program's: its CPU seed, as torch.manual_seed gives both) and MPS's. Two
calls at once in two threads, or draws by other threads during a call, are not kept apart."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def kept(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, with torch's generators put back after it as they were before it."""

    @functools.wraps(fn)
    def keeping(*args: P.args, **kwargs: P.kwargs) -> R:
        import torch

        cpu = torch.default_generator.get_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
        mps = torch.mps.get_rng_state() if torch.backends.mps.is_available() else None
        try:
            return fn(*args, **kwargs)
        finally:
            with contextlib.suppress(Exception):  # (never in place of the call's own error)
                _put_back(torch, cpu, cuda, mps)

    return keeping


def _put_back(torch: Any, cpu: Any, cuda: Any, mps: Any) -> None:
    torch.default_generator.set_state(cpu)  # (its initial seed too: the program's)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    elif torch.cuda.is_available():
        # CUDA not started before the call: torch.manual_seed queues CUDA's seed for when it
        # starts, the call's seed replaced the program's; queued again as the program's (its
        # CPU seed, which torch.manual_seed gives both, or both defaults when it gave none)
        torch.cuda.manual_seed_all(torch.initial_seed())
    if mps is not None:
        torch.mps.set_rng_state(mps)
