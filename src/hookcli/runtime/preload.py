"""The statistics' numba kernels, loaded in a background thread before the first pass needs
them (issue 37).

Loading numba and the kernels' cached machine code costs about a second on this machine kind
(importing numba, its type registries — which import scipy.linalg to look for a BLAS — and
the cache), most of it while torch's own work would let the process run something else: the
model's construction, reading the input, the forward's ops. Started early, the load is done by
the time the statistics want it, and a one-shot run's statistics cost what a warm loop's do.

`start()` is called where a run is certain: by `import hookcli` in a Python process (not in
the `hookcli` command, which forks first: there, when a model is about to be built). The thread
first imports the hookcli modules a first call would (`settle()`: the API's calls wait for that
before importing anything, so the two threads never import at once), then numba and the
kernels. It never imports torch, leaves nothing running when it ends (serial kernels only:
numba's thread pool starts on the caller's first parallel call) and is a daemon: a process may
end while it loads. HOOKCLI_STATS=torch, or a missing numba, leaves the statistics on torch
ops, as before. What it loaded is used through engine.stats.kernels().
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading

_thread: list[threading.Thread] = []
_imported = threading.Event()  # the modules a first call imports: done (or never started)
_done = threading.Event()
# What a first inspect/grads/check call imports, in the order it does (~0.1 s, most of it
# dataclasses): those without torch always, the rest where torch is imported already.
_WITHOUT_TORCH = ("hookcli.records", "hookcli.commands.api", "hookcli.commands.run")
_WITH_TORCH = ("hookcli.commands.inspect", "hookcli.commands.folder")


def start() -> None:
    """Start the load, once per process (a no-op after the first call, or with
    HOOKCLI_STATS=torch)."""
    if _thread:
        return
    if os.environ.get("HOOKCLI_STATS", "auto") == "torch":
        _imported.set()
        return
    thread = threading.Thread(target=_load, name="hookcli-kernels", daemon=True)
    _thread.append(thread)
    thread.start()


def _load() -> None:
    try:
        _import_modules()
    finally:
        _imported.set()
    try:
        import numpy as np

        from hookcli.engine import _chankernels, _kernels  # noqa: F401 (compiled on import)

        values, out = np.zeros(8, np.float32), np.zeros(7)
        _kernels.fused_serial(values, out)  # the first call loads numba's registries
        _kernels.careful_serial(values, 0.0, out)
    except Exception:  # numba absent or broken: engine.stats finds the same, and says so
        pass
    finally:
        _done.set()


def _import_modules() -> None:
    """hookcli's own modules that a first call would import, imported here while the caller
    does other work. torch is never imported here: where the caller has not imported it, the
    modules that need it are left to the first call."""
    torch = sys.modules.get("torch")
    ready = torch is not None and not getattr(
        getattr(torch, "__spec__", None), "_initializing", True
    )
    for name in _WITHOUT_TORCH + (_WITH_TORCH if ready else ()):
        with contextlib.suppress(Exception):  # the first call meets the same error, and says it
            importlib.import_module(name)


def settle() -> None:
    """Before a call imports hookcli's modules: until the thread is done importing them (the
    two never import the same modules at once, so no import waits on the other's)."""
    if _thread:
        _imported.wait()


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
