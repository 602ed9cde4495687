"""Crash isolation: the CLI's work runs in a forked child that a small parent watches.

A model can kill the process in ways no `except` sees (HOOK_PITFALLS 16): a custom C++/CUDA op
segfaults, a kernel built for an ISA the CPU cannot run dies with SIGILL, a native library aborts,
the OOM killer sends SIGKILL. That is when a user most needs to know which layer was running.

So `hookcli` forks before anything heavy is imported (torch included): the child runs the command
as it always did — same stdin, stdout and stderr, same terminal, so tables, JSON and progress
bars are untouched — and writes where it is into a shared page (hookcli.beacon). The parent only
waits. If the child dies of a signal, the parent prints one line naming the signal, the layer
call that was running (forward or backward, and the phase: building the model, a diff side) and a
next step, removes the temp files the child had made, and exits 3. Outputs are written
atomically at the end of a run, so a dead run leaves none.

Ctrl-C reaches the child directly (the terminal signals the whole foreground process group; the
parent ignores it), so partial results and exit 130 work as before. SIGTERM and SIGHUP sent to
the parent are passed on to the child. No torch here; `--help` and other light calls are not
forked at all. Where there is no fork (Windows) or HOOKCLI_NO_SUPERVISOR is set, the command
runs in-process as before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from hookcli import beacon, isa

# commands that run no model: not worth a process of their own
_LIGHT = frozenset({"models", "show"})

_WHAT: dict[int, str] = {
    signal.SIGSEGV: "segmentation fault",
    signal.SIGILL: "illegal instruction",
    signal.SIGFPE: "arithmetic fault",
    signal.SIGABRT: "aborted",
    signal.SIGKILL: "killed",
}
if hasattr(signal, "SIGBUS"):
    _WHAT[signal.SIGBUS] = "bus error"

_NEXT: dict[int, str] = {
    signal.SIGSEGV: "a native op (a C++/CUDA extension or a library kernel) crashed there; "
    "run that layer alone to confirm, then report it to the op's authors.",
    signal.SIGILL: "the CPU refused an instruction of a compiled kernel built for an ISA it "
    "cannot run; try another dtype or device, or limit oneDNN: ONEDNN_MAX_CPU_ISA=AVX2.",
    signal.SIGFPE: "a native op divided an integer by zero; check that layer's input sizes.",
    signal.SIGABRT: "a native library aborted (its own message, if any, is above); "
    "run that layer alone to confirm.",
    signal.SIGKILL: "killed from outside, most often by the out-of-memory killer: use fewer or "
    "smaller inputs (--batch-size), or a machine with more memory.",
}
if hasattr(signal, "SIGBUS"):
    _NEXT[signal.SIGBUS] = _NEXT[signal.SIGSEGV]

# signals a user or a job scheduler sends to stop the run: passed on, not reported as a crash
_STOPS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, n))


def is_light(argv: Sequence[str]) -> bool:
    """Calls that need no isolation: help, version, shell completion, no command, listings."""
    if not argv or any(a in ("-h", "--help", "--version") for a in argv):
        return True
    if any(k.startswith("_") and k.endswith("_COMPLETE") for k in os.environ):
        return True
    return argv[0] in _LIGHT


def supervise(argv: Sequence[str]) -> int | None:
    """Fork the worker. In the parent: wait for it and return the exit code to use. In the child
    (or where no fork is made): return None, and the caller runs the command."""
    if not hasattr(os, "fork") or os.environ.get("HOOKCLI_NO_SUPERVISOR") or is_light(argv):
        return None
    isa.ensure()  # before the fork: the worker's oneDNN starts under the limit, if any
    light = beacon.start()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError:
        return None  # no process to spare: run in-process, unsupervised
    if pid == 0:
        _worker_setup()
        return None
    return _watch(pid, light)


def _worker_setup() -> None:
    """The child: no core file and no fatal-error dump on screen when it dies of a signal
    (the parent says what happened in one line) unless HOOKCLI_DEBUG asks for them."""
    if os.environ.get("HOOKCLI_DEBUG"):
        return
    import faulthandler

    faulthandler.disable()
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        _soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
        resource.setrlimit(resource.RLIMIT_CORE, (0, hard))


def _watch(pid: int, light: beacon.Beacon) -> int:
    """Wait for the worker; its exit code, or a one-line account of its death."""

    def pass_on(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the child gets the terminal's Ctrl-C itself
    for s in _STOPS:
        signal.signal(s, pass_on)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            return 3
        except InterruptedError:  # pragma: no cover — PEP 475 retries waitpid itself
            continue
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    signum = os.WTERMSIG(status)
    words = light.last_words()
    for path in words.temps:
        with contextlib.suppress(OSError):
            os.unlink(path)
    sys.stderr.write(death_message(signum, words) + "\n")
    sys.stderr.flush()
    if signum == signal.SIGINT:
        return 130
    if signum in _STOPS:
        return 128 + signum
    return 3


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def death_message(signum: int, words: beacon.LastWords) -> str:
    """One line: the signal, where the worker was, and a next step."""
    name = _name(signum)
    if signum == signal.SIGINT:
        return "interrupted"
    if signum in _STOPS:
        where = f" {words.where}" if words.where else ""
        return f"error: stopped by {name}{where}."
    what = f" ({_WHAT[signum]})" if signum in _WHAT else ""
    if words.where:
        where = f"{words.where}, {words.phase}" if words.phase else words.where
    else:
        where = f"while {words.phase}" if words.phase else "before any hooked layer ran"
    hint = _NEXT.get(signum, "a native part of the model or a library died there.")
    return f"error: the run died of {name}{what} {where}; no output was written. Hint: {hint}"
