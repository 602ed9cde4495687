"""engine/_launch.Fast: a compiled Triton kernel launched without Triton's binding on every
call. Its key must hold everything Triton specialises a kernel on (else a kernel compiled for
aligned pointers or a 32-bit length would be launched on others): checked here against
Triton's own specialisation, and the launch itself against a recording stand-in for Triton's
compiled kernel (the real one runs on a GPU: tests/engine/test_gpu.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from triton.backends.compiler import BaseBackend
from triton.runtime import jit

from hookcli.engine import _launch


def _triton_spec(arg: object) -> object:
    """Triton's specialisation of one argument, as JITFunction.run's binder makes it."""
    return jit.native_specialize_impl(BaseBackend, arg, False, True, True)


INTS = [1, 0, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1, -(2**31),
        -(2**31) - 16, 2**63 - 16, 2**63, -(2**63), 2**64 - 16]  # fmt: skip


def _tensors() -> list[torch.Tensor]:
    base = torch.zeros(64)
    return [
        base, base[1:], base[4:], base[2:], torch.zeros(8, dtype=torch.bfloat16),
        torch.zeros(8, dtype=torch.bfloat16)[1:], torch.zeros(8, dtype=torch.float64)[1:],
        torch.zeros(8, dtype=torch.float16)[8:],
    ]  # fmt: skip


def test_equal_keys_mean_equal_triton_specialisations() -> None:
    """Any two arguments `spec` keys alike, Triton specialises alike (so one compiled kernel
    serves both); integers at every boundary of Triton's classes, pointers aligned and not."""
    args: list[object] = [*INTS, True, False, 0.5, 2.0, *_tensors()]
    by_key: dict[object, object] = {}
    for a in args:
        key = _launch.spec(a)
        assert key is not None
        theirs = _triton_spec(a)
        assert by_key.setdefault(key, theirs) == theirs, (a, key, theirs)
    # and the facts it keys on are there: widths, 1, multiples of 16, alignment, dtype
    assert len({_launch.spec(a) for a in INTS}) == len({_triton_spec(a) for a in INTS})
    assert len({_launch.spec(t) for t in _tensors()}) == len({_triton_spec(t) for t in _tensors()})


def test_other_arguments_are_not_keyed() -> None:
    assert _launch.spec("text") is None
    assert _launch.spec(None) is None
    assert _launch.spec((1, 2)) is None


class _Compiled:
    """Triton's CompiledKernel as `Fast` uses it: what each launch was given."""

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log
        self.function = "fn"
        self.packed_metadata = "meta"

    def launch_metadata(self, grid: tuple[int, ...], stream: int, *args: object) -> object:
        return ("launch", grid, stream)

    def run(self, *args: object) -> None:
        self.log.append(("compiled", *args))


class _Kernel:
    """A @triton.jit kernel as `Fast` uses it: `kernel[grid](…)` compiles (a new stand-in
    each time) and launches, and returns the compiled kernel."""

    arg_names = ("x_ptr", "n", "FINAL", "BLOCK")

    def __init__(self, returns: bool = True) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.returns = returns

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: object, **kw: object) -> _Compiled | None:
            self.log.append(("jit", grid, args, kw))
            return _Compiled(self.log) if self.returns else None

        return launch


class _Driver:
    class active:
        @staticmethod
        def get_current_device() -> int:
            return 0

        @staticmethod
        def get_current_stream(device: int) -> int:
            return 7


def test_a_kernel_compiled_once_is_launched_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_launch, "driver", _Driver)
    kernel = _Kernel()
    fast = _launch.Fast(kernel)
    x = torch.zeros(64)
    fast.run((3,), x, 4096, FINAL=False, BLOCK=4096)
    assert kernel.log == [("jit", (3,), (x, 4096), {"FINAL": False, "BLOCK": 4096})]
    fast.run((5,), x, 4096 + 16, FINAL=False, BLOCK=4096)  # the same key: launched directly
    hooks = (_launch.knobs.runtime.launch_enter_hook, _launch.knobs.runtime.launch_exit_hook)
    assert kernel.log[1] == (
        "compiled", 5, 1, 1, 7, "fn", "meta", ("launch", (5,), 7), *hooks, x, 4096 + 16,
        False, 4096,
    )  # fmt: skip
    # what Triton specialises on, changed: compiled (by Triton's own way) again
    for args, kw in [
        ((x[1:], 4096), {"FINAL": False, "BLOCK": 4096}),  # a pointer not 16-byte aligned
        ((x, 4097), {"FINAL": False, "BLOCK": 4096}),  # a length not a multiple of 16
        ((x, 1), {"FINAL": False, "BLOCK": 4096}),  # a length of 1 (a constant to Triton)
        ((x, 2**31), {"FINAL": False, "BLOCK": 4096}),  # a 64-bit length
        ((x.double(), 4096), {"FINAL": False, "BLOCK": 4096}),  # another dtype
        ((x, 4096), {"FINAL": True, "BLOCK": 4096}),  # another constexpr
    ]:
        before = len(kernel.log)
        fast.run((1,), *args, **kw)
        assert kernel.log[before][0] == "jit", (args, kw)
        fast.run((1,), *args, **kw)
        assert kernel.log[before + 1][0] == "compiled", (args, kw)


def test_the_interpreter_and_unkeyed_calls_take_tritons_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_launch, "driver", _Driver)
    monkeypatch.setattr(_launch.knobs.runtime, "interpret", True)  # TRITON_INTERPRET=1
    interpreted = _Kernel()
    fast = _launch.Fast(interpreted)
    monkeypatch.setattr(_launch.knobs.runtime, "interpret", False)
    for _ in range(2):
        fast.run((1,), torch.zeros(4), 4, FINAL=True, BLOCK=16)
    assert [e[0] for e in interpreted.log] == ["jit", "jit"]
    returns_none = _Kernel(returns=False)  # a Triton whose launch returns nothing
    fast = _launch.Fast(returns_none)
    for _ in range(2):
        fast.run((1,), torch.zeros(4), 4, FINAL=True, BLOCK=16)
    assert [e[0] for e in returns_none.log] == ["jit", "jit"]
    kernel = _Kernel()
    fast = _launch.Fast(kernel)
    for _ in range(2):
        fast.run((1,), torch.zeros(4), "a string", FINAL=True, BLOCK=16)
    assert [e[0] for e in kernel.log] == ["jit", "jit"]
    # constexprs out of the kernel's order would be launched in the wrong places: not kept
    kernel = _Kernel()
    fast = _launch.Fast(kernel)
    for _ in range(2):
        fast.run((1,), torch.zeros(4), 4, BLOCK=16, FINAL=True)
    assert [e[0] for e in kernel.log] == ["jit", "jit"]
