"""One exception hierarchy. The core raises these; only cli.py turns them into exit codes."""

from __future__ import annotations

from typing import Any


class HookcliError(Exception):
    """A failure the user can act on: a one-line message and a next step."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if not self.hint:
            return self.message
        # the message is a sentence before the hint's: it ends with its own stop
        stop = "" if self.message.rstrip().endswith((".", "!", "?", ":", ";")) else "."
        return f"{self.message.rstrip()}{stop} Hint: {self.hint}"


class UsageError(HookcliError):
    """Bad usage or bad input: unknown model or layer, unreadable file, malformed spec (exit 2)."""

    exit_code = 2


class ModelError(HookcliError):
    """The model itself failed: exception in forward/backward, out of memory (exit 3)."""

    exit_code = 3


class CheckFailed(HookcliError):
    """The run completed and a check failed (exit 1)."""

    exit_code = 1


def one_line(exc: BaseException, *, with_type: bool = True, whole: bool = False) -> str:
    """An exception as one line of at most ~300 characters — `Type: first line`, whitespace
    folded — since a model's or torch's message may run to pages (a C++ stack after it).
    `whole`: every line folded into one, for messages whose reason follows a heading line
    (load_state_dict's, a validation error's)."""
    text = str(exc).strip()
    # torch's C++ errors carry their stack after this, sometimes inside a quoted message
    # whose newlines are escapes ("…long long\\nException raised from …")
    for stack in ("\\nException raised from ", "\nException raised from "):
        text = text.split(stack, 1)[0]
    first = " ".join((text if whole else text.split("\n", 1)[0]).split())
    first = first if len(first) <= 300 else first[:297] + "..."
    if not with_type:
        return first or type(exc).__name__
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def not_a_file(path: Any) -> str:
    """Why a path given as a file cannot be read as one: "not found", "is a folder", or "is
    not a regular file" (a pipe, a device, a socket: read only as files here)."""
    try:
        if path.is_dir():
            return "is a folder"
        if path.exists():
            return "is not a regular file (a pipe, a device or a socket)"
    except OSError:  # (a path too long, a loop of links: not found as a file either)
        pass
    return "not found"
