"""Where results go: one policy for every file hookcli writes.

It holds for -o (reports, listings, PNGs), --save, --save-raw and --save-baseline alike:

- `-` is standard output (for -o only): text, or a PNG's bytes when stdout is not a terminal;
- an existing regular file is replaced atomically — a temp file beside it, then a rename — so
  no reader ever sees a half-written file, and a failed run leaves the old file as it was;
- a symbolic link is followed: the file it points to is replaced, the link stays a link;
- a device node or FIFO (`/dev/null`, `/dev/stdout`, a named pipe) is written through, never
  replaced by a regular file;
- a directory, a missing folder, an unwritable place, or a file the run reads (an input image,
  --input file, --weights, --baseline, the config) is refused before any work: exit 2.

No torch here: the CLI claims its destinations before importing anything heavy.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from hookcli.errors import UsageError

STDOUT = "-"


@dataclass(frozen=True, slots=True)
class Destination:
    """A claimed output: stdout (path None), a regular file to replace atomically, or a
    special file (device, FIFO) to write through."""

    option: str
    path: Path | None
    special: bool = False

    @property
    def label(self) -> str:
        return "stdout" if self.path is None else str(self.path)

    @property
    def scratch_dir(self) -> str | None:
        """Where temp files go: beside a regular file (same file system: rename is atomic),
        else the system's temp folder."""
        return str(self.path.parent) if self.path is not None and not self.special else None


def claim(
    raw: Path | str | None,
    option: str,
    *,
    suffix: str | None = None,
    stdout_ok: bool = True,
    reads: Iterable[Path | str] = (),
) -> Destination | None:
    """Check an output before any work is done; None when no output was asked for."""
    if raw is None:
        return None
    text = str(raw)
    if text == STDOUT:
        if not stdout_ok:
            raise UsageError(
                f"{option} needs a file name; '-' (standard output) is for -o.",
                f"e.g. {option} out{suffix or ''}",
            )
        return Destination(option, None)
    path = Path(text).expanduser()
    if suffix is not None and path.suffix.lower() != suffix:
        raise UsageError(
            f"{option} {path} must end in {suffix}.", f"e.g. {option} {path.stem}{suffix}"
        )
    real = Path(os.path.realpath(path))  # a symlink's target (dangling: where it points)
    for source in reads:
        if (
            str(source) != STDOUT
            and Path(source).exists()
            and real == Path(os.path.realpath(source))
        ):
            raise UsageError(
                f"{option} {path} is also an input of this run; writing it would destroy it.",
                "choose another output path.",
            )
    if real.is_dir():
        raise UsageError(
            f"{option} {path} is a directory.",
            f"give a file name, e.g. {option} out{suffix or '.json'}.",
        )
    if real.exists() and not real.is_file():  # a device node, FIFO or socket
        mode = real.stat().st_mode
        if stat.S_ISSOCK(mode):
            raise UsageError(f"{option} {path} is a socket.", "give a file, a FIFO or a device.")
        if not os.access(real, os.W_OK):
            raise UsageError(f"{option} {path} is not writable.", "choose another path.")
        return Destination(option, real, special=True)
    parent = real.parent
    if not parent.is_dir():
        raise UsageError(
            f"{option} folder {parent} does not exist.", f"create it first: mkdir -p {parent}"
        )
    try:  # a real probe: permission bits say nothing for root or read-only file systems
        fd, probe = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".probe", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(
            f"{option} {path} is not writable ({exc.strerror}).", "choose another path."
        ) from exc
    if real.exists() and not os.access(real, os.W_OK):
        raise UsageError(f"{option} {path} is not writable.", "choose another path.")
    return Destination(option, real)


def write_text(dest: Destination, text: str) -> None:
    if dest.path is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return

    def fill(tmp: str) -> None:
        Path(tmp).write_text(text, encoding="utf-8")

    write_with(dest, fill)


def write_with(dest: Destination, fill: Callable[[str], None]) -> None:
    """fill(path) writes a temp file; it then becomes the destination by the policy above.
    Whatever fails, no temp file is left and a replaced file is either old or new."""
    fd, tmp = tempfile.mkstemp(
        prefix=f".{dest.path.name if dest.path else 'stdout'}.",
        suffix=".tmp",
        dir=dest.scratch_dir,
    )
    os.close(fd)
    try:
        fill(tmp)
        if dest.path is None:
            if sys.stdout.isatty() and not _is_text(tmp):
                raise UsageError(
                    "will not write binary data to a terminal.", "redirect stdout, or give -o FILE."
                )
            sys.stdout.flush()
            with open(tmp, "rb") as src:
                shutil.copyfileobj(src, sys.stdout.buffer, 1 << 20)
            sys.stdout.buffer.flush()
        elif dest.special:
            with open(tmp, "rb") as src, open(dest.path, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        else:
            _plain_mode(tmp)
            os.replace(tmp, dest.path)
    except OSError as exc:
        raise UsageError(
            f"cannot write {dest.label}: {exc.strerror}.", "free space or choose another path."
        ) from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _is_text(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\0" not in head


def _plain_mode(path: str) -> None:
    """mkstemp makes files 0600; an output file gets the mode open() would give it."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
