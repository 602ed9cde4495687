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
then (at its next threshold) whatever cyclic garbage the pass left: a forward rarely makes any,
but what it makes, tensors included, waits until the pass ends. The collector is process-wide:
a program's other threads run without it while a pass runs, and it is left as found when the
pass began (off stays off). A one-pass inspect, grads or check holds it from before its model is
built to its checks (commands/run.py): the model's building, the report and the checks make
thousands of objects too, and a report still alive when the collector came back was walked
whole, then promoted towards the generation whose full collections walk the whole heap. Start-up
then ends inside that hold, which gives the collector back when it ends.
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
    """Start-up is over (or the command has returned): the collector back on if it is still
    paused, nothing frozen. Inside a hold (a one-pass run holds the collector off from before
    its model is built: commands/run.py), it stays off, and the last hold to end turns it on."""
    if _paused[0]:
        _paused[0] = False
        with holds.lock:
            if holds.count > 0:
                holds.turned_off = True
                return
        gc.enable()


class _Holds:
    """The passes running now (diff runs two at once), and whether the first of them turned
    the collector off."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.turned_off = False


holds = _Holds()


@contextlib.contextmanager
def held() -> Iterator[None]:
    """The collector off for one pass, and back on when the last pass running ends, if it was
    on when the first began. Taken and given back inside one try (a Ctrl-C between the two
    never leaves it off for good)."""
    taken = False
    try:
        with holds.lock:
            holds.count += 1  # counted first: an interrupt can leak a count (the collector
            taken = True  # is then never turned off again), never the collector's state
            if holds.count == 1:
                holds.turned_off = gc.isenabled()
                gc.disable()
        yield
    finally:
        with holds.lock:
            if taken:
                holds.count -= 1
                if holds.count == 0 and holds.turned_off:
                    holds.turned_off = False
                    gc.enable()
