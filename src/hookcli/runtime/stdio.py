"""Standard streams the CLI can rely on, whatever the shell handed it.

- A closed stdout (`>&-`) or stderr (`2>&-`): Python sets sys.stdout/sys.stderr to None and the
  first write is an AttributeError. stderr then goes nowhere (exit codes still tell); writing data
  to a closed stdout is a usage error naming it.
- A stdout that cannot take the data (`> /dev/full`: ENOSPC, a broken pipe, EIO): one line naming
  it and exit 2, instead of Python's "Exception ignored … BrokenPipeError" and exit 120 at shutdown.
- An encoding that cannot show "—" (PYTHONIOENCODING=ascii, LANG=C on old systems): the
  character is escaped instead of a UnicodeEncodeError.

No torch here.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Any, TextIO

from hookcli.errors import UsageError


class OutputFailed(UsageError):
    """stdout could not take the data (exit 2)."""


_failures: list[OutputFailed] = []  # said once: later flushes of the same data stay quiet


class _Closed(io.TextIOBase):
    """Stands for a stdout the shell closed: any write is the user's mistake, said in a line."""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if not s:
            return 0
        raise OutputFailed(
            "standard output is closed, so the results have nowhere to go.",
            "give -o FILE, or leave stdout open.",
        )

    def isatty(self) -> bool:
        return False


def _failed(exc: OSError) -> OutputFailed:
    reason = exc.strerror or type(exc).__name__
    failure = OutputFailed(
        f"cannot write to standard output: {reason}.",
        "write the results to a file with -o FILE, or free the device stdout points to.",
    )
    _failures.append(failure)
    return failure


class _Guarded(io.TextIOWrapper):
    """stdout whose write errors become one-line usage errors (exit 2)."""

    def write(self, s: str) -> int:
        try:
            return super().write(s)
        except OSError as exc:
            raise _failed(exc) from None

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as exc:
            raise _failed(exc) from None


def guard() -> None:
    """Make sys.stdout and sys.stderr safe to use (call once, before anything prints)."""
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 — lives as long as the process
    else:
        with contextlib.suppress(AttributeError, io.UnsupportedOperation):
            sys.stderr.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    out: TextIO | None = sys.stdout
    if out is None:
        sys.stdout = _Closed()
        return
    buffer = getattr(out, "buffer", None)
    if buffer is None:
        return  # replaced already (an embedding program): leave it alone
    sys.stdout = _Guarded(
        buffer,
        encoding=out.encoding,
        errors="backslashreplace",
        line_buffering=bool(out.line_buffering),
        write_through=getattr(out, "write_through", False),
    )


def finish(code: int) -> int:
    """Flush stdout at the end; a failure is reported (exit 2 if nothing failed before) and
    stdout pointed at /dev/null so the interpreter's own last flush cannot fail again."""
    said = len(_failures)
    try:
        sys.stdout.flush()
    except OutputFailed as exc:
        if not said:
            _say(f"error: {exc}")
        discard_stdout()
        return code or exc.exit_code
    if said:  # a write failed earlier (reported then); drop what is still buffered
        discard_stdout()
        return code or _failures[0].exit_code
    return code


def discard_stdout() -> None:
    """After a failed write: what is still buffered goes nowhere (no exit-120 at shutdown)."""
    with contextlib.suppress(OSError):
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.close(fd)
    out: Any = sys.stdout
    with contextlib.suppress(Exception):
        out.flush()


def _say(line: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
