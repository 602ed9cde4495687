"""Crash isolation: the CLI's work runs in a forked child that a small parent watches.

A model can kill the process in ways no `except` sees (docs/traps.md §16): a custom C++/CUDA op
segfaults, a kernel built for an ISA the CPU cannot run dies with SIGILL, a native library aborts,
the OOM killer sends SIGKILL. That is when a user most needs to know which layer was running.
It can also end the process without dying (os._exit) or replace it with another program
(os.exec*): a run that ends before it finished is an error, never the exit 0 of a gate that
checked nothing.

So `hookcli` forks before anything heavy is imported (torch included): the child runs the
command as it always did — same stdin, stdout and stderr, same terminal, so tables, JSON and
progress bars are untouched — and writes where it is into a shared page
(hookcli.runtime.beacon). The parent only waits. If the child dies of a signal, the parent
prints one line naming the signal, the layer call that was running (forward or backward, and the
phase: building the model, a diff side) and a next step, removes the temp files the child had
made, and exits 3. Outputs are written atomically at the end of a run, so a dead run leaves
none.

Ctrl-C reaches the child directly (the terminal signals the whole foreground process group; the
parent ignores it), so partial results and exit 130 work as before. SIGTERM and SIGHUP sent to
the parent are passed on to the child. No torch here; `--help` and other light calls are not
forked at all. Where there is no fork (Windows) or HOOKCLI_NO_SUPERVISOR is set, the command
runs in-process as before.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType

from hookcli.runtime import beacon, isa, ranks
from hookcli.text import escape

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
    try:
        isa.ensure()  # before the fork: the worker's oneDNN starts under the limit, if any
    except KeyboardInterrupt:  # Ctrl-C during the first run's probe
        sys.stderr.write("interrupted\n")
        return 130
    light = beacon.start()
    parent = os.getpid()
    # a SIGCHLD ignored by whoever started us would have the kernel reap the worker before
    # waitpid sees it: a no-op handler makes it deliverable (the worker resets it)
    signal.signal(signal.SIGCHLD, _noop)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        return None  # no process to spare: run in-process, unsupervised
    if pid == 0:
        _worker_setup(parent)
        return None
    try:
        return _watch(pid, light)
    except KeyboardInterrupt:  # only in the instant before the signals are blocked
        return _watch(pid, light)


def _noop(signum: int, frame: FrameType | None) -> None:
    pass


def _worker_setup(parent: int) -> None:
    """The child: dies with its parent (a `kill -9` of hookcli leaves no orphan running), no core
    file and no fatal-error dump on screen when it dies of a signal (the parent says what
    happened in one line) unless HOOKCLI_DEBUG asks for them."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, _interrupt_once())
    _die_with(parent)
    import faulthandler

    if os.environ.get("HOOKCLI_DEBUG"):
        faulthandler.enable()
        return
    faulthandler.disable()
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        _soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
        resource.setrlimit(resource.RLIMIT_CORE, (0, hard))


def _interrupt_once() -> Callable[[int, FrameType | None], None]:
    """Ctrl-C as KeyboardInterrupt, as Python's own handler does — but one interrupt however
    often it is delivered: a SIGINT sent to the whole process group (`kill -INT -PGID`) reaches
    the worker directly and through the parent, and a second KeyboardInterrupt while the first
    is printing partial results would cut them short."""
    last = [-1.0]

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if last[0] >= 0 and now - last[0] < 1.0:
            return  # the same interrupt, delivered twice
        last[0] = now
        raise KeyboardInterrupt

    return on_sigint


def _die_with(parent: int) -> None:
    """Linux: SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG); elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)


def _watch(pid: int, light: beacon.Beacon) -> int:
    """Wait for the worker, passing on the signals meant for it; its exit code, or a one-line
    account of its death."""
    stopped: list[int] = []  # the stop signals passed on to the worker
    status = _wait(pid, stopped)
    if status is None:
        sys.stderr.write("error: lost track of the worker process. Hint: rerun the command.\n")
        return 3
    words = light.last_words()
    if not os.WIFEXITED(status):
        for path in words.temps:  # only our own temp files, by absolute path
            if os.path.isabs(path) and os.path.basename(path).startswith(".hookcli-"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
    if os.WIFEXITED(status) or (stopped and os.WTERMSIG(status) == signal.SIGKILL):
        # exited, or killed by us once the grace after a stop was over
        return _exited(os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1, stopped, words)
    signum = os.WTERMSIG(status)
    if words.finished is not None:  # a library died at interpreter exit, after the run
        sys.stderr.write(
            escape(f"warning: the worker died of {_name(signum)} while exiting, after the run "
                   "had finished; its results stand.") + "\n"
        )  # fmt: skip
        sys.stderr.flush()
        return words.finished
    sys.stderr.write(escape(death_message(signum, words)) + "\n")
    sys.stderr.flush()
    if signum == signal.SIGINT:
        return 130
    if signum in _STOPS:
        return 128 + signum
    return 3


def _exited(code: int, stopped: list[int], words: beacon.LastWords) -> int:
    """The exit code of a worker that exited (not killed): its own, unless it went on after a
    stop was passed on (a model ignoring SIGTERM: stopped all the same) or ended before the
    run finished (os._exit, os.exec*: an error, never a gate passed on nothing)."""
    if stopped:
        where = f" {words.where}" if words.where else ""
        text = f"error: {ranks.label()}stopped by {_name(stopped[0])}{where}."
        sys.stderr.write(escape(text) + "\n")
        return 128 + stopped[0]
    if words.finished is None:
        sys.stderr.write(escape(ended_message(code, words)) + "\n")
        sys.stderr.flush()
        return 3
    return code


_SI_USER = 0  # siginfo si_code of a signal sent by kill(), not by the terminal driver


def _grace() -> float:
    """How long a worker that ignores a passed-on stop has before SIGKILL (10 s;
    HOOKCLI_STOP_GRACE_S sets another)."""
    try:
        value = float(os.environ.get("HOOKCLI_STOP_GRACE_S", "10"))
    except ValueError:
        return 10.0
    return min(max(value, 0.0), 1e6) if not math.isnan(value) else 10.0  # at most ~11 days


def _wait(pid: int, stopped: list[int]) -> int | None:
    """The worker's wait status. Ctrl-C at the terminal reaches the worker directly (same
    process group), so the parent never repeats it; a SIGINT sent to the parent alone (`kill
    -INT`, a harness's send_signal) and SIGTERM/SIGHUP/SIGQUIT are passed on. The stops passed
    on are appended to `stopped`; a worker still running _grace() seconds after the first (a model
    that ignores SIGTERM) is killed: a stop sent to hookcli always stops it."""
    passed = {signal.SIGINT, *_STOPS}
    if not hasattr(signal, "sigwaitinfo"):  # macOS: no siginfo; SIGINT left to the terminal
        signal.signal(signal.SIGINT, signal.SIG_IGN)

        def stop(signum: int, frame: FrameType | None) -> None:
            stopped.append(signum)
            _pass_on(pid, signum)

        for s in _STOPS:
            signal.signal(s, stop)
        return _reap(pid, block=True)
    watched = {signal.SIGCHLD, *passed}
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    deadline: float | None = None
    while True:
        status = _reap(pid, block=False)
        if status != -1:
            return status
        if deadline is None:
            info = signal.sigwaitinfo(watched)
        else:
            left = deadline - time.monotonic()
            got = signal.sigtimedwait(watched, max(left, 0.0)) if left > 0 else None
            if got is None:  # the grace is over: the worker ignored the stop
                _pass_on(pid, signal.SIGKILL)
                deadline = None
                continue
            info = got
        if info.si_signo == signal.SIGCHLD:
            continue
        if info.si_signo == signal.SIGINT and info.si_code != _SI_USER:
            continue  # the terminal's Ctrl-C: the worker got it too
        if info.si_signo in _STOPS:
            stopped.append(info.si_signo)
            if deadline is None:
                deadline = time.monotonic() + _grace()
        _pass_on(pid, info.si_signo)


def _pass_on(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _reap(pid: int, *, block: bool) -> int | None:
    """The wait status; -1 while the worker runs (block=False); None if it is not our child."""
    try:
        done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
        return None
    return status if done else -1


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def ended_message(code: int, words: beacon.LastWords) -> str:
    """One line for a worker that exited before the run finished: the model's code ended the
    process (os._exit) or replaced it with another program (os.exec*), so nothing was
    checked, however the process exited."""
    if words.where:
        where = f" {words.where}, {words.phase}" if words.phase else f" {words.where}"
    else:
        where = f" while {words.phase}" if words.phase else ""
    return (
        f"error: {ranks.label()}the run ended{where} before it finished (the process exited "
        f"with status {code}): the model's code ended it or replaced it with another program "
        "(os._exit, os.exec*); nothing was checked and no output was written. Hint: remove "
        "that call from the model's code, or run the model with hookcli's Python API to see it."
    )


def death_message(signum: int, words: beacon.LastWords) -> str:
    """One line: the signal, where the worker was, and a next step."""
    name = _name(signum)
    if signum == signal.SIGINT:
        return "interrupted"
    if signum in _STOPS:
        where = f" {words.where}" if words.where else ""
        return f"error: {ranks.label()}stopped by {name}{where}."
    what = f" ({_WHAT[signum]})" if signum in _WHAT else ""
    if words.where:
        where = f"{words.where}, {words.phase}" if words.phase else words.where
    else:
        where = f"while {words.phase}" if words.phase else "before any hooked layer ran"
    hint = _NEXT.get(signum, "a native part of the model or a library died there.")
    return (
        f"error: {ranks.label()}the run died of {name}{what} {where}; no output was written. "
        f"Hint: {hint}"
    )
