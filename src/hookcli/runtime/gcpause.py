"""The CLI's start-up, and every pass, without Python's cyclic garbage collector.

Importing torch, torchvision, numba and the rest, then building a model, makes ~350,000
long-lived objects. While they are being made, the collector's full collections walk all of
them again and again: ~0.5 s of a 3.4 s `hookcli inspect resnet34 cat.jpeg`, for no garbage
worth it. So hookcli's own process (the console script or `python -m hookcli`, never a program
that calls main() or the Python API) turns the collector off before its imports (`pause`) and
back on once the model is built (`resume`: sources.load_model, replay's unpickled model),
freezing what start-up made (gc.freeze: kept out of every later collection, as it lives until
the process ends anyway).

The price: cyclic garbage that start-up itself left (~10,000 small objects on resnet34 —
import-time frames, functions, tuples; no tensors) is frozen with the rest and kept until the
process ends. Collecting it first would cost one full walk, ~0.26 s. A command that builds no
model (reading a log or a saved report) runs with the collector off, and `end` turns it back on
when the command returns.

Each pass, in any process (CLI or Python API), runs with the collector held off (`held`): a
pass makes thousands of short-lived objects (hook handles, records, weak references) that
reference counting frees, but the collections they trigger midway walk them, and promote those
still alive to the older generations, whose growth then sets off full collections of the
whole heap (torch, the model: ~190 ms every ~15 passes of resnet50 through the API). Held off,
a pass's garbage is never walked; the collector is back on when the pass ends, and collects
then whatever cyclic garbage the pass left (a forward rarely makes any). The collector is left
as found: off stays off.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_paused = [False]


def pause() -> None:
    """Collector off, if it is on (hookcli's own process, before anything heavy is imported)."""
    if gc.isenabled():
        gc.disable()
        _paused[0] = True


def resume() -> None:
    """Start-up's objects frozen and the collector back on; nothing unless pause() turned it
    off (the Python API, or a second call)."""
    if _paused[0]:
        gc.freeze()
        end()


def end() -> None:
    """The command has returned: the collector back on if it is still paused, nothing frozen."""
    if _paused[0]:
        _paused[0] = False
        gc.enable()


_lock = threading.Lock()
_holding = [0, False]  # passes running now (diff runs two at once), whether they turned it off


@contextlib.contextmanager
def held() -> Iterator[None]:
    """The collector off for one pass, and back on when the last pass running ends, if it was
    on when the first began."""
    with _lock:
        if _holding[0] == 0:
            _holding[1] = gc.isenabled()
            if _holding[1]:
                gc.disable()
        _holding[0] += 1
    try:
        yield
    finally:
        with _lock:
            _holding[0] -= 1
            if _holding[0] == 0 and _holding[1]:
                _holding[1] = False
                gc.enable()
