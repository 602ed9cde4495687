"""The statistics' numba kernels, loaded in a background thread before the first pass needs
them (issue 37).

Loading numba and the kernels' cached machine code costs about a second on this machine kind
(importing numba, its type registries — which import scipy.linalg to look for a BLAS — and
the cache), most of it while torch's own work would let the process run something else: the
model's construction, reading the input, the forward's ops. Started early, the load is done by
the time the statistics want it, and a one-shot run's statistics cost what a warm loop's do.

`start()` is called by `import hookcli` in a Python process, not in the `hookcli` command:
there the load's imports, which hold the GIL against the worker's own, slowed every run more
than they saved (docs/speed.md), and it loads the kernels inline past 256 MiB. The
thread imports numba and the kernels (engine.kernelwarm: engine._kernels, _chankernels and
packing, which import nothing else of hookcli's) and no other module of hookcli's: the caller
may be importing those itself, and two threads importing a package and one of its modules in
opposite order deadlock (Python raises _DeadlockError in one of them). The kernels' package,
hookcli.engine, is imported before the thread starts, so the thread never imports a package.
It never imports torch, leaves nothing running when it ends (serial kernels only: numba's
thread pool starts on the caller's first parallel call) and is a daemon, but a process that
ends while it loads waits for it first (bounded, before the exit handlers): the load runs
LLVM's C++ through ctypes without the GIL, and a process that exits under it runs LLVM's
static destructors while the thread is still inside LLVM — a segmentation fault on the way out of
`python -c "import hookcli"`, seen once in CI. Kept off (HOOKCLI_STATS=torch), a missing
numba, or a load that failed (`failed()`: never retried, numba may be half imported), leaves
the statistics on torch ops, as before. What it loaded is used through
engine.stats.kernels().
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from collections.abc import Callable

_thread: list[threading.Thread] = []
_done = threading.Event()


_off = [False]  # the statistics on torch ops in this process: no kernels loaded, ever


def keep_off() -> None:
    """No kernels in this process (HOOKCLI_STATS=torch, read by the package's edge: hookcli's
    __init__ through options.stats_backend_default): nothing loads them, here or later."""
    _off[0] = True


def kept_off() -> bool:
    return _off[0]


def start(load: Callable[[], None]) -> None:
    """Start the thread, once per process (a no-op after the first call, or when kept off):
    `load` (numba and the kernels: engine.kernelwarm.load)."""
    if _thread or _off[0]:
        return
    thread = threading.Thread(target=_run, args=(load,), name="hookcli-kernels", daemon=True)
    _thread.append(thread)
    thread.start()
    # before the interpreter's exit handlers: what the thread imports while the exit waits
    # for it (numba, llvmlite) registers exit handlers of its own, which must still run
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(_before_exit)
    else:
        register(_before_exit)


def _before_exit() -> None:
    """The interpreter is ending: the load finishes first (threading's exit hooks run before
    the exit handlers and the finalisation that would leave the thread inside LLVM as the
    process's destructors run). Bounded, for a thread stuck elsewhere; a forked child has no
    thread and does not wait."""
    if _thread and _thread[0].is_alive() and not _done.is_set():
        _done.wait(_EXIT_WAIT)


def _run(load: Callable[[], None]) -> None:
    try:
        load()
    except Exception as exc:  # numba absent or broken, or an import of it cut short
        _failed.append(exc)
        if os.environ.get("HOOKCLI_DEBUG"):
            traceback.print_exception(exc, file=sys.stderr)
    finally:
        _done.set()


def failed() -> bool:
    """Whether this process's load ended in an error. Then numba is not used here at all:
    an import the error cut short leaves numba's package half built in sys.modules, and an
    import of it afterwards returns a module without `numba.core` — the kernels then fail
    inside their first compile (`module 'numba' has no attribute 'core'`, seen once in CI),
    not at the import. The statistics stay on torch ops, exact."""
    return bool(_failed)


_failed: list[Exception] = []  # what ended the load, if it failed


def _before_fork() -> None:
    """A fork while the thread imports would leave the child modules half imported, their
    locks held by a thread it does not have: the fork waits for the load to end first (about a
    second at most; bounded, for a thread stuck elsewhere)."""
    if _thread and not _done.is_set():
        _done.wait(_FORK_WAIT)
    _unfinished[0] = bool(_thread) and not _done.is_set()


def _in_child() -> None:
    """The child has no thread: nothing to wait for; its first use loads the kernels itself
    — unless the fork came while the load was still importing (the wait ran out: a loaded
    machine compiling the kernels): then numba's modules are half imported in the child, their
    locks held for ever, so the child keeps off the kernels (torch ops, exact) rather than
    wait on them."""
    if _thread:
        _thread.clear()
        _done.set()
        if _unfinished[0]:
            _off[0] = True


_unfinished = [False]  # the fork under way came before the load ended


_FORK_WAIT = 30.0
_EXIT_WAIT = 60.0
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_in_child)


def started() -> bool:
    """Whether a load was started in this process."""
    return bool(_thread)


def finished() -> bool:
    """Whether a load was started and has ended (loaded, or failed)."""
    return _done.is_set()


def wait() -> None:
    """Until a load in flight has ended (at once where none was started)."""
    if _thread:
        _done.wait()
