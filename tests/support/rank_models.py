"""Models and a launcher for torchrun's fault tests (tests/commands/test_torchrun_faults.py)."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch import nn


class Net(nn.Module):
    """A small conv net; the rank numbered `hang` sleeps in its forward as a hung rank would,
    the rank numbered `die` is killed there as by the out-of-memory killer."""

    def __init__(self, hang: int = -1, die: int = -1) -> None:
        super().__init__()
        self.hang = hang
        self.die = die
        self.conv = nn.Conv2d(3, 4, 3, stride=4)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = int(os.environ.get("RANK", "-1"))
        if rank == self.hang:
            time.sleep(120)
        if rank == self.die:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.fc(self.pool(torch.relu(self.conv(x))).flatten(1))  # type: ignore[no-any-return]


def main() -> None:
    """hookcli's console entry, with HOOKCLI_TEST_RANK<N>_ARGS added after the command on rank
    N (and HOOKCLI_TEST_RANK<N>_TAIL at the end): ranks started with different arguments, as two
    nodes' launch scripts can be."""
    from hookcli.cli import main as hookcli_main

    rank = os.environ.get("RANK", "0")
    extra = os.environ.get(f"HOOKCLI_TEST_RANK{rank}_ARGS", "").split()
    tail = os.environ.get(f"HOOKCLI_TEST_RANK{rank}_TAIL", "").split()  # positional ones
    sys.argv = ["hookcli", sys.argv[1], *extra, *sys.argv[2:], *tail]
    hookcli_main()


if __name__ == "__main__":
    main()
