"""Python processes launched as torchrun would: a free port, the environment that finds
hookcli and the tests' own modules, and a run that fails the test with its stderr."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

TIMEOUT = 180  # seconds a launched process may take


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        # src for hookcli, the checkout for the tests' own models (tests.support.watch.Tiny)
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
    }


def run_python(args: list[str], tmp_path: Path) -> None:
    res = _launched(args, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]


def _launched(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [sys.executable, *args],
            cwd=tmp_path,
            env=launch_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{args[:3]} did not finish in {TIMEOUT} s: {exc.stderr!r}")


# gloo's C++ aborting a rank (a worker thread destroyed while joinable), seen now and then on
# a busy machine as a process group is taken down (sharded_run.py's _leave): run once more
GLOO_ABORT = "terminate called without an active exception"


def run_torchrun(script: Path, args: list[str], tmp_path: Path, procs: int = 2) -> None:
    """`script` with `args` in `procs` processes under torchrun (gloo, CPU); skipped where
    torch.distributed with gloo is not there."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available here")
    for attempt in range(2):
        torchrun = [
            "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(procs),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        ]  # fmt: skip
        res = _launched([*torchrun, str(script), *args], tmp_path)
        if res.returncode == 0 or GLOO_ABORT not in res.stderr or attempt:
            break
    assert res.returncode == 0, res.stderr[-3000:]
