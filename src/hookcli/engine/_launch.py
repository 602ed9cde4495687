"""Triton kernels launched without Triton's binding on every call (issue 52).

`kernel[grid](*args)` binds the arguments, works out what the kernel is specialised on (each
pointer's dtype and 16-byte alignment, each integer's width, whether it is 1, whether it is a
multiple of 16), makes a cache key of it and finds the compiled kernel: on a GPU about a fifth of
inspect's host time per hooked call, for a launch whose own cost is a few microseconds. `Fast`
keeps each compiled kernel under a key made of the same facts, read directly (`spec`), and
launches it as Triton's own `JITFunction.run` does once it has found it. A key that cannot be
made (an argument of another kind), Triton's interpreter (TRITON_INTERPRET=1: no compiled
kernel), ROCm (where Triton also specialises on a storage's size) and a Triton whose compiled
kernel lacks that interface take Triton's own way, every call. `spec` is checked against
Triton's specialisation in the tests, so a Triton that specialises on something new fails
there, not with a kernel launched on the wrong arguments. Triton's pre-run hooks, its check of
changed globals and a `debug` switched on after the first launch are not seen by `Fast`: these
kernels have none, read no global, and are not debugged in a run.
"""

from __future__ import annotations

from typing import Any

import torch
from triton import knobs
from triton.runtime import driver

_I32 = 1 << 31
_I64 = 1 << 63


def spec(arg: object) -> object:
    """What Triton specialises a kernel on for this argument (None: an argument `Fast` does
    not key, so the call takes Triton's own way)."""
    kind = type(arg)
    if kind is int:
        n: int = arg  # type: ignore[assignment]
        width = 0 if -_I32 <= n < _I32 else 1 if -_I64 <= n < _I64 else 2
        return (n == 1, n % 16 == 0, width)
    if kind is bool or kind is float:
        return kind
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    return None


class Fast:
    """A `@triton.jit` kernel launched by `run(grid, *args, **constexprs)`: the arguments in
    the kernel's order, its constexprs by name after them (in its order too)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        # Triton's interpreter (TRITON_INTERPRET=1) compiles nothing and has no driver; on
        # ROCm, Triton also specialises a pointer on its storage's size (32-bit buffer
        # offsets), which `spec` does not key on
        self._direct = not getattr(knobs.runtime, "interpret", False) and torch.version.hip is None
        self._compiled: dict[tuple[object, ...], Any] = {}

    def run(self, grid: tuple[int, ...], *args: object, **constexprs: object) -> None:
        if not self._direct:
            self.kernel[grid](*args, **constexprs)
            return
        device = driver.active.get_current_device()
        key = (device, *map(spec, args), *constexprs.values())
        compiled = self._compiled.get(key)
        if compiled is None:
            got = self.kernel[grid](*args, **constexprs)
            if None not in key[1 : 1 + len(args)] and self._launchable(got, args, constexprs):
                self._compiled[key] = got
            return
        every = (*args, *constexprs.values())
        stream = driver.active.get_current_stream(device)
        meta = compiled.launch_metadata(grid, stream, *every)
        compiled.run(
            grid[0],
            grid[1] if len(grid) > 1 else 1,
            grid[2] if len(grid) > 2 else 1,
            stream,
            compiled.function,
            compiled.packed_metadata,
            meta,
            knobs.runtime.launch_enter_hook,
            knobs.runtime.launch_exit_hook,
            *every,
        )

    def _launchable(
        self, got: object, args: tuple[object, ...], constexprs: dict[str, object]
    ) -> bool:
        """Whether `got`, what `kernel[grid](…)` returned, is a compiled kernel this Triton
        launches as `run` does (not the interpreter's None), called with the constexprs in the
        kernel's own order."""
        names = list(getattr(self.kernel, "arg_names", ()))
        return all(
            hasattr(got, a) for a in ("run", "function", "packed_metadata", "launch_metadata")
        ) and names[len(args) :] == list(constexprs)
