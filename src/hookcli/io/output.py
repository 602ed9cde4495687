"""Where results go: one policy for every file hookcli writes.

It holds for -o (reports, listings, PNGs), --save, --save-raw and --save-baseline alike:

- `-` is standard output (for -o only): text, or a PNG's bytes when stdout is not a terminal;
- `/dev/stdout`, `/dev/stderr`, `/dev/fd/N` and `/proc/self/fd/N` are the descriptors already
  open: written through them (a log opened for appending is appended to, a pipe is fed), never
  reopened with truncation, never renamed over;
- an existing regular file is replaced atomically — a temp file beside it, then a rename — so
  no reader ever sees a half-written file, a failed run leaves the old file as it was, and the
  new file keeps the old one's permission bits;
- a symbolic link is followed: the file it points to is replaced, the link stays a link;
- a device node or FIFO (`/dev/null`, a named pipe) is written through, never replaced by a
  regular file;
- a directory, a missing folder, an unwritable place, two outputs on one path, or a file the
  run reads is refused before any work: exit 2.

What the run reads is one registry (`note_read`): the CLI adds the files named on its command line
before any work, and every reader (images, tensor files, weights, model sources, the config)
adds the file it opens. A write checks the registry again just before its rename, so a file a
reader opened that the up-front check did not foresee is still never overwritten.

No torch here: the CLI claims its destinations before importing anything heavy.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from hookcli.errors import UsageError
from hookcli.runtime import beacon

STDOUT = "-"
# the descriptors a path can name; /proc/PID/fd/N only for this process's PID
_FD_PATH = re.compile(
    r"^/(?:dev/(stdout|stderr)|dev/fd/(\d+)|proc/(self|thread-self|\d+)/fd/(\d+))$"
)
_STD_FD = {"stdout": 1, "stderr": 2}


def user_path(raw: str | os.PathLike[str], what: str = "path") -> Path:
    """`~` and `~user` expanded; an unknown user is a usage error, not a RuntimeError."""
    try:
        return Path(raw).expanduser()
    except RuntimeError as exc:  # pathlib: "Could not determine home directory."
        text = os.fspath(raw)
        user = text[1:].split("/", 1)[0]
        raise UsageError(
            f"{what} {text}: there is no user {user!r} on this machine to expand ~{user}.",
            "write the path out in full.",
        ) from exc


# ---------------------------------------------------------------- what the run reads


class Reads:
    """The files (and image folders) this run reads; no output may replace one of them."""

    def __init__(self) -> None:
        self.files: dict[str, str] = {}  # real path → the path as named
        self.folders: dict[str, str] = {}
        # model folders (hf:PATH, a hub snapshot, a tokenizer folder): every file in them
        self.trees: dict[str, str] = {}
        self.outputs: dict[str, str] = {}  # real path → the option that claimed it
        self.piped: dict[str, bytes] = {}  # images read from pipes and devices, by name

    def add(self, path: str | os.PathLike[str]) -> None:
        """A file the run reads (regular files only: a pipe or device read cannot be
        destroyed by a write); a folder stands for the images in it."""
        text = os.fspath(path)
        if not text or text == STDOUT:
            return
        if text.startswith(MODEL_FOLDER):  # hf:PATH — a model folder: all of its files
            self.add_tree(text.removeprefix(MODEL_FOLDER))
            return
        try:
            real = os.path.realpath(os.path.expanduser(text))
            mode = os.stat(real).st_mode
        except (OSError, ValueError, RuntimeError):
            return  # not there (a spec such as randn:2, or a missing file the reader reports)
        if stat.S_ISREG(mode):
            self.files.setdefault(real, text)
        elif stat.S_ISDIR(mode):
            self.folders.setdefault(real, text)

    def add_tree(self, path: str | os.PathLike[str]) -> None:
        """A folder a model (or a tokenizer) is loaded from: weights, shards and their index,
        configs, tokenizer files, chat templates — no output may replace any file in it."""
        text = os.fspath(path)
        try:
            real = os.path.realpath(os.path.expanduser(text))
        except (OSError, ValueError, RuntimeError):
            return
        if os.path.isdir(real):
            self.trees.setdefault(real, text)

    def source_of(self, real: str | os.PathLike[str]) -> str | None:
        """The input a destination's real path is (as named), or None."""
        target = os.fspath(real)
        if target in self.files:
            return self.files[target]
        if self.trees and os.path.isfile(target):
            for folder, named in self.trees.items():
                if os.path.commonpath([folder, target]) == folder:
                    return f"a file of the model folder {named} it loads"
        if not self.folders or not os.path.isfile(target):
            return None
        for folder, named in self.folders.items():
            rel = os.path.relpath(target, folder)
            if rel.startswith(os.pardir) or any(p.startswith(".") for p in Path(rel).parts):
                continue
            if Path(target).suffix.lower() in _image_extensions():
                return f"{named} (an image in it)"
        return None

    def claim_output(self, real: str, option: str, path: Path) -> None:
        """Each output its own file: a second one on the same path would destroy the first."""
        other = self.outputs.get(real)
        if other is not None and other != option:
            raise UsageError(
                f"{option} {path} is also the {other} output; one would destroy the other.",
                "give each output its own path.",
            )
        self.outputs[real] = option


def _image_extensions() -> set[str]:
    from PIL import Image

    return {ext.lower() for ext in Image.registered_extensions()}


MODEL_FOLDER = "hf:"  # a read named so is a model folder: every file in it is protected
_registry = Reads()


def begin() -> None:
    """A new run: nothing read, nothing claimed yet (each CLI command and each Python API call
    starts with this)."""
    global _registry  # noqa: PLW0603 — one run per process at a time, like the beacon
    _registry = Reads()


def registry() -> Reads:
    return _registry


def note_read(path: str | os.PathLike[str]) -> None:
    """Every reader calls this with the file it opens: no output of this run may replace it."""
    _registry.add(path)


def _refuse_input(option: str, path: Path | str, real: str) -> None:
    source = _registry.source_of(real)
    if source is not None:
        raise UsageError(
            f"{option} {path} is also an input of this run ({source}); writing it would "
            "destroy it.",
            "choose another output path.",
        )


# ---------------------------------------------------------------- claiming


@dataclass(frozen=True, slots=True)
class Destination:
    """A claimed output: stdout (path None), a regular file to replace atomically, a special
    file (device, FIFO) to write through, or an open descriptor (fd) to write through."""

    option: str
    path: Path | None
    special: bool = False
    fd: int | None = None
    suffix: str = ""  # the name's suffix as typed (a link's own, not its target's), lower case

    @property
    def label(self) -> str:
        return "stdout" if self.path is None else str(self.path)

    @property
    def scratch_dir(self) -> str | None:
        """Where temp files go: beside a regular file (same file system: rename is atomic),
        else the system's temp folder."""
        return str(self.path.parent) if self.path is not None and not self.special else None


def _open_fd(text: str) -> int | None:
    """The descriptor a path names (/dev/stdout, /dev/fd/3, /proc/self/fd/1, or a symlink
    to one), or None."""
    path = os.path.abspath(text)
    for _ in range(40):
        m = _FD_PATH.match(os.path.normpath(path))
        if m:
            std, dev_fd, pid, proc_fd = m.groups()
            if std:
                return _STD_FD[std]
            if dev_fd is not None:
                return int(dev_fd)
            if pid.isdigit() and int(pid) != os.getpid():
                return None
            return int(proc_fd)
        if not os.path.islink(path):
            return None
        path = os.path.join(os.path.dirname(path), os.readlink(path))
    return None


def descriptor_of(text: str) -> int | None:
    """The open descriptor a path names (/dev/stdout, /dev/fd/3 …), or None: such a path is
    written through, never reopened with truncation (the watch log follows this too)."""
    return _open_fd(text)


def _claim_fd(option: str, text: str, fd: int) -> Destination:
    import fcntl  # POSIX only, as /dev/fd is

    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as exc:
        raise UsageError(
            f"{option} {text}: descriptor {fd} is not open (closed by the shell?).",
            "give a file name instead.",
        ) from exc
    if fd in (1, 2) and _stream(fd) is None:
        raise UsageError(f"{option} {text}: that stream is closed.", "give a file name instead.")
    if fd not in (1, 2) and flags & os.O_ACCMODE == os.O_RDONLY:  # Python's own: writable
        raise UsageError(
            f"{option} {text}: descriptor {fd} is open for reading only.",
            "open it for writing (e.g. 3>>log), or give a file name.",
        )
    return Destination(option, Path(text), special=True, fd=fd)


def claim(
    raw: Path | str | None,
    option: str,
    *,
    suffix: str | None = None,
    stdout_ok: bool = True,
    reads: Iterable[Path | str] = (),
) -> Destination | None:
    """Check an output before any work is done; None when no output was asked for. `reads`
    are files the run will read: they join the registry."""
    if raw is None:
        return None
    for source in reads:
        _registry.add(source)
    text = str(raw)
    if text == STDOUT:
        if not stdout_ok:
            raise UsageError(
                f"{option} needs a file name; '-' (standard output) is for -o.",
                f"e.g. {option} out{suffix or ''}",
            )
        return Destination(option, None)
    path = user_path(text, option)
    if suffix is not None and path.suffix.lower() != suffix:
        raise UsageError(
            f"{option} {path} must end in {suffix}.", f"e.g. {option} {path.stem}{suffix}"
        )
    fd = _open_fd(str(path))
    if fd is not None:
        return _claim_fd(option, text, fd)
    real = Path(os.path.realpath(path))  # a symlink's target (dangling: where it points)
    if real.is_symlink():  # realpath gave up on it: links that lead round to themselves
        raise UsageError(
            f"{option} {path} is a loop of symbolic links.",
            f"remove or repoint the link (ls -l {path}), or give another path.",
        )
    _refuse_input(option, path, str(real))
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
        return Destination(option, real, special=True, suffix=path.suffix.lower())
    parent = real.parent
    if not parent.is_dir():
        raise UsageError(
            f"{option} folder {parent} does not exist.", f"create it first: mkdir -p {parent}"
        )
    try:  # a real probe: permission bits say nothing for root or read-only file systems
        fd_probe, probe = tempfile.mkstemp(prefix=".hookcli-", suffix=".probe", dir=parent)
        os.close(fd_probe)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(
            f"{option} {path} is not writable ({exc.strerror}).", "choose another path."
        ) from exc
    if real.exists() and not os.access(real, os.W_OK):
        raise UsageError(f"{option} {path} is not writable.", "choose another path.")
    _registry.claim_output(str(real), option, path)
    return Destination(option, real, suffix=path.suffix.lower())


# ---------------------------------------------------------------- writing


def _stream(fd: int | None) -> BinaryIO | None:
    """Python's binary stream for stdout (fd None or 1) or stderr (2), flushed — a captured or
    wrapped stream stays in charge — or None (another descriptor, or a stream that is closed)."""
    text = sys.stderr if fd == 2 else sys.stdout if fd in (None, 1) else None
    stream: BinaryIO | None = getattr(text, "buffer", None)
    if text is not None and stream is not None:
        text.flush()
    return stream


def _write_fd(dest: Destination, data: bytes | BinaryIO) -> None:
    """Through an open descriptor (stdout, stderr, /dev/fd/N): appended where it points."""
    stream = _stream(dest.fd)
    if stream is None and dest.fd in (None, 1, 2):
        raise UsageError(
            f"{dest.label} is closed, so the results have nowhere to go.", "give -o FILE."
        )
    if stream is not None:
        if isinstance(data, bytes):
            stream.write(data)
        else:
            shutil.copyfileobj(data, stream, 1 << 20)
        stream.flush()
        return
    assert dest.fd is not None
    chunks = iter([data]) if isinstance(data, bytes) else iter(lambda: data.read(1 << 20), b"")
    for chunk in chunks:
        view = memoryview(chunk)
        while view:
            view = view[os.write(dest.fd, view) :]


def write_text(dest: Destination, text: str) -> None:
    if dest.path is None or dest.fd in (1, 2):  # Python's text stream: its encoding rules
        out = sys.stderr if dest.fd == 2 else sys.stdout
        out.write(text)
        out.flush()
        return
    write_bytes(dest, text.encode("utf-8"))


def write_bytes(dest: Destination, data: bytes) -> None:
    """A file's bytes (Parquet; text encoded) to the destination by the policy above."""
    if dest.path is None or dest.fd in (1, 2):
        out = sys.stderr if dest.fd == 2 else sys.stdout
        out.flush()
        out.buffer.write(data)
        out.buffer.flush()
        return
    if dest.fd is not None:
        try:
            _write_fd(dest, data)
        except OSError as exc:
            raise UsageError(
                f"cannot write {dest.label}: {exc.strerror}.", "free space or choose another path."
            ) from exc
        return

    def fill(tmp: str) -> None:
        Path(tmp).write_bytes(data)

    write_with(dest, fill)


def write_with(dest: Destination, fill: Callable[[str], None]) -> None:
    """fill(path) writes a temp file; it then becomes the destination by the policy above.
    Whatever fails, no temp file is left and a replaced file is either old or new."""
    try:  # (the folder may be gone since it was checked: removed while the model ran)
        fd, tmp = tempfile.mkstemp(prefix=".hookcli-", suffix=".tmp", dir=dest.scratch_dir)
    except OSError as exc:
        raise UsageError(
            f"cannot write {dest.label}: {exc.strerror}.",
            "check that its folder still exists and is writable, or choose another path.",
        ) from exc
    os.close(fd)
    beacon.track(tmp)  # a supervisor removes it if this process dies before it does
    try:
        fill(tmp)
        if dest.path is None or dest.fd is not None:
            if dest.fd in (None, 1) and sys.stdout.isatty() and not _is_text(tmp):
                raise UsageError(
                    "will not write binary data to a terminal.", "redirect stdout, or give -o FILE."
                )
            with open(tmp, "rb") as src:
                _write_fd(dest, src)
        elif dest.special:
            with open(tmp, "rb") as src, open(dest.path, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        else:
            # again just before the rename: a reader the up-front check missed
            _refuse_input(dest.option, dest.path, os.path.realpath(dest.path))
            _keep_mode(tmp, dest.path)
            os.replace(tmp, dest.path)
    except OSError as exc:
        raise UsageError(
            f"cannot write {dest.label}: {exc.strerror}.", "free space or choose another path."
        ) from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        beacon.untrack(tmp)


def _is_text(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\0" not in head


def _keep_mode(tmp: str, target: Path) -> None:
    """mkstemp makes files 0600: a replaced file keeps its permission bits (and, where we may,
    its owner and group); a new one gets the mode open() would give it."""
    try:
        old = os.stat(target)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        return
    os.chmod(tmp, stat.S_IMODE(old.st_mode))
    mine = os.stat(tmp)
    if (mine.st_uid, mine.st_gid) != (old.st_uid, old.st_gid):
        with contextlib.suppress(OSError):  # only root may give a file away
            os.chown(tmp, old.st_uid, old.st_gid)
            os.chmod(tmp, stat.S_IMODE(old.st_mode))  # chown clears setuid/setgid bits
