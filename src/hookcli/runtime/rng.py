"""A program's random generators, left as found by each call of the Python API.

A pass seeds torch's generators (`--seed`: dropout and the like draw the same numbers every
run) and so does building a model from a name (its random initialisation). Seeding torch's
global generators inside a program that calls `hookcli.check(model, x)` every few steps would
rewind that program's own random stream at each call: the same dropout masks and shuffles
again after every check. So each API call puts the generators back as it found them: the CPU's,
and each CUDA device's when CUDA was in use before the call. (CUDA first started by the call
itself starts from the seed the call gave it.)"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def kept(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, with torch's generators put back after it as they were before it."""

    @functools.wraps(fn)
    def keeping(*args: P.args, **kwargs: P.kwargs) -> R:
        import torch

        cpu = torch.default_generator.get_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
        try:
            return fn(*args, **kwargs)
        finally:
            torch.default_generator.set_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)

    return keeping
