"""The watch log as the recorder writes it: it must never hurt the training it records (issue 32).

- A regular file is opened without truncation, locked (flock) for this run, then emptied: a
  second run watching into the same file while the first still runs is refused when its
  `with` starts, instead of the two runs interleaving into one log. Every line carries this
  run's id (`run`), so a reader still tells two runs apart where locks do not hold (NFS).
- `/dev/stdout`, `/dev/stderr`, `/dev/fd/N` are the descriptors already open: written through,
  never reopened with truncation (`log='/dev/stdout'` used to empty a redirected job's output);
  a FIFO or device is appended to.
- A write that fails (a full disk, a closed pipe, a file system gone read-only) ends the
  logging, not the training: one line on stderr says so, and the loop goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import uuid
from pathlib import Path
from typing import Any, TextIO

from hookcli.errors import UsageError, one_line


class LogWriter:
    def __init__(self, path: Path) -> None:
        from hookcli.io.output import descriptor_of

        self.path = path
        self.run = uuid.uuid4().hex[:12]
        self.failed: str | None = None  # why logging stopped, once it has
        self._own = True  # the file is ours to close
        fd = descriptor_of(str(path))
        try:
            if fd in (1, 2):
                self._file: TextIO | None = sys.stdout if fd == 1 else sys.stderr
                self._own = False
            elif fd is not None:
                self._file = os.fdopen(os.dup(fd), "a", encoding="utf-8")
            elif path.exists() and not path.is_file():  # a FIFO, a device
                if stat.S_ISDIR(path.stat().st_mode):
                    raise IsADirectoryError(21, "Is a directory")
                self._file = path.open("a", encoding="utf-8")
            else:
                self._file = _locked(path)
        except OSError as exc:
            raise UsageError(
                f"cannot write the watch log {path}: {exc.strerror or one_line(exc)}.",
                "give a writable path, e.g. log='run.jsonl'.",
            ) from exc

    def write(self, line: dict[str, Any]) -> None:
        """One JSON line, flushed; a failure ends the logging with one line on stderr. The line
        gains this run's id in place, so the record kept in memory (w.records) is the line."""
        if self._file is None:
            return
        line["run"] = self.run
        try:
            self._file.write(json.dumps(line, allow_nan=False) + "\n")
            self._file.flush()
        except (OSError, ValueError) as exc:  # ValueError: written to a closed stream
            self.failed = f"{type(exc).__name__}: {one_line(exc)}"
            self.close()
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(
                    f"hookcli.watch: the log {self.path} could not be written ({self.failed}); "
                    "logging stopped, training goes on.\n"
                )
                sys.stderr.flush()

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None and self._own:
            with contextlib.suppress(OSError, ValueError):
                f.close()  # its lock goes with it


def _locked(path: Path) -> TextIO:
    """The log file for this run alone: opened without truncating, locked, then emptied (a new
    run starts a new log); another live run's lock is a UsageError."""
    f = path.open("a", encoding="utf-8")
    try:
        import fcntl

        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # no flock (Windows): the run ids still tell runs apart
        pass
    except BlockingIOError as exc:
        f.close()
        raise UsageError(
            f"another run is watching into {path} right now: two runs in one log cannot be "
            "told apart.",
            "give this run its own log, e.g. log='run2.jsonl'.",
        ) from exc
    except OSError:  # a file system without locks
        pass
    f.truncate(0)
    return f
