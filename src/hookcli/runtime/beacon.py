"""Where the worker is, written where a parent process can read it after the worker dies.

A native crash (SIGSEGV in a custom op, SIGILL in a kernel built for an ISA the machine cannot
run, the OOM killer's SIGKILL) ends a process before any `except` or `finally` runs
(docs/traps.md §16). The CLI therefore runs the work in a forked child
(hookcli.runtime.supervise) and shares one anonymous memory page with it: the child writes into
it, as it goes, which layer call is running (forward or backward), the phase of the run
(building the model, a diff side) and the temp files it has made; the parent reads it when the
child died of a signal, names the layer and removes the temp files.

Writing costs one small memcpy per hooked call; with no supervisor (the Python API, tests) the
module-level beacon is None and every function returns at once. No torch here.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

# one page each: the running call, the phase, the exit code once the run is over, then the
# temp files (NUL-separated paths)
_WHERE, _PHASE, _FINISHED, _TEMPS = 0, 4096, 8192, 12288
_SIZE = 1 << 16
_LEN = struct.Struct("<I")


def _who() -> int:
    """Whose calls these are: the running thread, or, for diff's passes run as greenlets of one
    thread, the running greenlet (a thread's own main greenlet counts as the thread)."""
    greenlet = sys.modules.get("greenlet")
    if greenlet is not None:
        current = greenlet.getcurrent()
        if current.parent is not None:
            return id(current)
    return threading.get_ident()


@dataclass(frozen=True, slots=True)
class LastWords:
    """What a dead worker had written: the running call, the phase and its temp files."""

    where: str
    phase: str
    temps: tuple[str, ...]
    finished: int | None = None  # the run was over, with this exit code, when the worker died


class Beacon:
    """An anonymous shared mapping (MAP_SHARED: the parent sees the child's writes after fork)."""

    def __init__(self) -> None:
        self._map = mmap.mmap(-1, _SIZE)
        self._stacks: dict[int, list[str]] = {}  # per thread: its hooked calls running
        self._phases: dict[int, str] = {}  # a thread's own phase (diff's sides side by side)
        self._temps: list[str] = []
        self._last = ""

    @property
    def _stack(self) -> list[str]:
        return self._stacks.setdefault(_who(), [])

    def _own_phase(self) -> None:
        """A thread with a phase of its own writes it with its call: the last thread to write
        is the one running (diff's sides take turns), so the two fields agree."""
        mine = self._phases.get(_who())
        if mine is not None:
            self._put(_PHASE, mine, 4096)

    # ---------------------------------------------------------------- child side
    def _put(self, offset: int, text: str, limit: int) -> None:
        """Length 0, then the bytes, then their length: a death between two writes leaves an
        empty field, never new bytes read with an old length."""
        data = text.encode("utf-8", "replace")[: limit - _LEN.size]
        _LEN.pack_into(self._map, offset, 0)
        self._map[offset + _LEN.size : offset + _LEN.size + len(data)] = data
        _LEN.pack_into(self._map, offset, len(data))

    def enter(self, label: str) -> None:
        """A hooked call starts: it is what runs until it returns."""
        self._stack.append(label)
        self.again()

    def leave(self) -> None:
        """A hooked call returned: the enclosing call runs again, or nothing hooked does."""
        if not self._stack:
            return
        done = self._stack.pop()
        self._own_phase()
        if self._stack:
            self._put(_WHERE, f"in {self._stack[-1]}", 4096)
        else:
            self._last = done
            self._put(_WHERE, f"after {done} returned", 4096)

    def again(self) -> None:
        """This thread's running call, written: as it starts, and again after it waited while
        another thread's calls were written (diff's sides take turns)."""
        stack = self._stack
        if stack:
            self._own_phase()
            self._put(_WHERE, f"in {stack[-1]}", 4096)

    def at(self, text: str) -> None:
        """A place that is not a hooked forward call (a gradient arriving, a write)."""
        self._own_phase()
        self._put(_WHERE, text, 4096)

    def phase(self, text: str) -> None:
        """A new phase (building the model, a pass, a diff side): no call runs yet."""
        self._stacks.clear()  # every thread's: a thread that died in a call left its own
        self._put(_WHERE, "", 4096)
        self._put(_PHASE, text, 4096)

    def finish(self, code: int) -> None:
        """The run is over (its outputs written): a death from here on is not the run's."""
        self._put(_FINISHED, str(code), 64)

    def current_phase(self) -> str:
        return self._read(_PHASE)

    def track(self, path: str) -> None:
        self._temps.append(path)
        self._put(_TEMPS, "\0".join(self._temps), _SIZE - _TEMPS)

    def untrack(self, path: str) -> None:
        with contextlib.suppress(ValueError):
            self._temps.remove(path)
        self._put(_TEMPS, "\0".join(self._temps), _SIZE - _TEMPS)

    # ---------------------------------------------------------------- parent side
    def _read(self, offset: int) -> str:
        (n,) = _LEN.unpack_from(self._map, offset)
        raw = self._map[offset + _LEN.size : offset + _LEN.size + n]
        return raw.decode("utf-8", "replace")

    def last_words(self) -> LastWords:
        temps = self._read(_TEMPS)
        code = self._read(_FINISHED)
        return LastWords(
            self._read(_WHERE),
            self._read(_PHASE),
            tuple(t for t in temps.split("\0") if t),
            int(code) if code.lstrip("-").isdigit() else None,
        )


_beacon: Beacon | None = None


def start() -> Beacon:
    """The supervisor's beacon, made before the fork so both processes share it."""
    global _beacon  # noqa: PLW0603 — one per process, like the signal handlers it stands beside
    _beacon = Beacon()
    return _beacon


def current() -> Beacon | None:
    """The active beacon, or None (no supervisor: nothing is written)."""
    return _beacon


def finish(code: int) -> None:
    if _beacon is not None:
        _beacon.finish(code)


def at(text: str) -> None:
    if _beacon is not None:
        _beacon.at(text)


@contextlib.contextmanager
def phase(text: str) -> Iterator[None]:
    """Name a phase of the run for the crash message; the enclosing one comes back after."""
    if _beacon is None:
        yield
        return
    before = _beacon.current_phase()
    _beacon.phase(text)
    try:
        yield
    finally:
        _beacon.phase(before)


@contextlib.contextmanager
def thread_phase(text: str) -> Iterator[None]:
    """This thread's phase, while threads take turns (diff's sides side by side): written with
    each of its calls, so that a crash names the side whose call was running."""
    if _beacon is None:
        yield
        return
    ident = _who()
    _beacon._phases[ident] = text
    try:
        yield
    finally:
        del _beacon._phases[ident]
        _beacon._stacks.pop(ident, None)


def track(path: str | os.PathLike[str]) -> None:
    """A temp file the parent removes if this process dies before it does."""
    if _beacon is not None:
        _beacon.track(os.fspath(path))


def untrack(path: str | os.PathLike[str]) -> None:
    if _beacon is not None:
        _beacon.untrack(os.fspath(path))
