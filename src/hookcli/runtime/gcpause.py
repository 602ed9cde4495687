"""The CLI's start-up without Python's cyclic garbage collector.

Importing torch, torchvision, numba and the rest, then building a model, makes ~350,000
long-lived objects. While they are being made, the collector's full collections walk all of
them again and again: ~0.5 s of a 3.4 s `hookcli inspect resnet34 cat.jpeg`, for no garbage.
So the CLI's own process turns the collector off before its imports (`pause`) and back on once
the model is built (`resume`), freezing what start-up made first (gc.freeze: kept out of every
later collection, as it lives until the process ends anyway). Cyclic garbage made in between
is collected after; the passes themselves run with the collector on. The Python API never
pauses: a user's process keeps its own collector settings.
"""

from __future__ import annotations

import gc

_paused = [False]


def pause() -> None:
    """Collector off, if it is on (the CLI's process, before anything heavy is imported)."""
    if gc.isenabled():
        gc.disable()
        _paused[0] = True


def resume() -> None:
    """Start-up's objects frozen and the collector back on; nothing unless pause() turned it
    off (the Python API, or a second call)."""
    if _paused[0]:
        _paused[0] = False
        gc.freeze()
        gc.enable()
