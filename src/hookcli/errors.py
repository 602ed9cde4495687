"""One exception hierarchy. The core raises these; only cli.py turns them into exit codes."""

from __future__ import annotations


class HookcliError(Exception):
    """A failure the user can act on: a one-line message and a next step."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} Hint: {self.hint}" if self.hint else self.message


class UsageError(HookcliError):
    """Bad usage or bad input: unknown model or layer, unreadable file, malformed spec (exit 2)."""

    exit_code = 2


class ModelError(HookcliError):
    """The model itself failed: exception in forward/backward, out of memory (exit 3)."""

    exit_code = 3


class CheckFailed(HookcliError):
    """The run completed and a check failed (exit 1)."""

    exit_code = 1
