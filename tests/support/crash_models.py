"""Models that kill their own process, for the supervisor's tests (tests/runtime/test_supervise.py).

Each dies of a real signal sent to itself (os.kill), the way a segfaulting custom op, an
illegal instruction in a kernel or the OOM killer ends a process: no `except` can see it.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn


def _die(how: str) -> None:
    """As a native crash dies: the signal delivered to this thread, before anything else of it
    runs (os.kill's may land on another thread, and this one return from the forward)."""
    signal.pthread_kill(threading.get_ident(), getattr(signal, how))


class Dies(nn.Module):
    """Dies of signal `how` in its forward."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _die(self.how)
        return x


class _DiesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, how: str) -> torch.Tensor:
        ctx.how = how
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _die(ctx.how)
        return grad * 2, None


class DiesInBackward(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DiesInBackward.apply(x, self.how)  # type: ignore[no-untyped-call,no-any-return]


class Waits(nn.Module):
    """Writes a marker file, then sleeps: a run that is still going when a signal comes."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Path(self.marker).write_text(str(os.getpid()))  # the worker's pid
        time.sleep(60)
        return x


class Net(nn.Module):
    """fc1 → act → boom → fc2; boom dies of `how` in forward or backward (`when`), or never."""

    def __init__(self, how: str = "SIGSEGV", when: str = "forward", marker: str = "") -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.boom: nn.Module
        if marker:
            self.boom = Waits(marker)
        elif when == "backward":
            self.boom = DiesInBackward(how)
        elif when == "never":
            self.boom = nn.Identity()
        else:
            self.boom = Dies(how)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.boom(self.act(self.fc1(x))))  # type: ignore[no-any-return]


def dies_while_built() -> nn.Module:
    _die("SIGSEGV")
    return Net()


class SeesIsa(nn.Module):
    """Fails unless oneDNN's ISA limit reached the process that runs the model."""

    def __init__(self, expect: str) -> None:
        super().__init__()
        self.expect = expect
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        got = os.environ.get("ONEDNN_MAX_CPU_ISA")
        if got != self.expect:
            raise RuntimeError(f"ONEDNN_MAX_CPU_ISA is {got!r}")
        return self.fc(x)  # type: ignore[no-any-return]


class DiesInBfloat16(nn.Module):
    """fc → boom → fc2, where boom dies of SIGILL only when it sees bfloat16 (diff --b bfloat16)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.boom = _Bf16Boom()
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.boom(self.fc(x)))  # type: ignore[no-any-return]


class _Bf16Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            _die("SIGILL")
        return x


def dies_at_exit() -> nn.Module:
    """A model whose library dies as the interpreter exits (after the run is over)."""
    atexit.register(_die, "SIGSEGV")
    return Net(when="never")


class Ends(nn.Module):
    """Ends its process without dying (issue 32): replaces it with another program that exits
    0 (`exec`), leaves with os._exit(0) (`exit`), forks a child that comes back through the
    forward as the caller does (`fork`), or ignores SIGTERM after writing `marker` (`term`)."""

    def __init__(self, how: str, marker: str = "") -> None:
        super().__init__()
        self.how = how
        self.marker = marker
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "exec":
            os.execv(sys.executable, [sys.executable, "-c", "pass"])
        elif self.how == "exit":
            os._exit(0)
        elif self.how == "fork":
            child = os.fork()
            if child:
                os.waitpid(child, 0)  # the child has come back through the forward and gone
        elif self.how == "term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            Path(self.marker).write_text(str(os.getpid()))
            time.sleep(30)
        return self.fc(x)  # type: ignore[no-any-return]
