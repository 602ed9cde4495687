"""hookcli's real console entry (`python -m hookcli`) in a child process, where CliRunner's
in-process runs cannot show signals, the supervisor and the interpreter's exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import ROOT


def child_env() -> dict[str, str]:
    """The test's environment (its TORCH_HOME included), with the tests importable."""
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def argv(*args: str) -> list[str]:
    """The console entry's command line: `python -m hookcli ARGS`."""
    return [sys.executable, "-m", "hookcli", *args]


def run_hookcli(
    *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """`python -m hookcli ARGS` run to its end: its exit code, stdout and stderr."""
    return subprocess.run(
        argv(*args),
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        env={**child_env(), "PYTHONFAULTHANDLER": "1", **(env or {})},
        timeout=300,
    )


def calling_main(code: str) -> subprocess.CompletedProcess[str]:
    """`code` run by a fresh Python as a program of its own that calls hookcli.cli.main()
    (unsupervised, in-process), from the project's root."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env={**child_env(), "HOOKCLI_NO_SUPERVISOR": "1"},
        timeout=300,
    )
