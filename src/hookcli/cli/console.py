"""What the commands share at the edge: one-line errors and their exit codes, the spinner,
and where output goes (stdout or a claimed file). No torch."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from hookcli.errors import HookcliError, UsageError
from hookcli.render import Format
from hookcli.render.writers import Kind, Options, Writer, by_suffix, suffixes_named, writer
from hookcli.runtime import ranks
from hookcli.text import escape

if TYPE_CHECKING:
    from hookcli.io.output import Destination


class ListFormat(StrEnum):
    table = "table"
    json = "json"


def err(message: str) -> None:
    """One line on stderr; what users and models control in it (paths, layer names, messages)
    is escaped, so it can neither split the line nor reach the terminal as a control code."""
    sys.stderr.write(escape(message.rstrip("\n")) + "\n")
    sys.stderr.flush()


# the options this command took from the project config: (file, {--flag: value})
_from_config: list[tuple[str, dict[str, Any]]] = []


def config_values(path: str | None, values: dict[str, Any]) -> None:
    """The options the current command took from the config file at `path` (params.configured)."""
    _from_config.clear()
    if path and values:
        _from_config.append((path, values))


def from_config(flag: str) -> bool:
    """Whether the current command's `flag` (--format) took its value from the config."""
    return any(flag in values for _, values in _from_config)


def _config_note(message: str) -> str | None:
    """ "topk = -5 comes from hookcli.toml" when an error is about a value the config set: it
    names the option (--topk) or holds the value ('nosuch')."""
    for path, values in _from_config:
        # the option named, then a value quoted (the model's last: messages often name it)
        ranked = sorted(values.items(), key=lambda kv: kv[0] == "--model")
        for by_value in (False, True):
            for flag, value in ranked:
                items = value if isinstance(value, list | tuple) else [value]
                texts = [str(v) for v in items if v is not None and len(str(v)) >= 2]
                named = re.search(rf"{re.escape(flag)}\b", message) is not None
                quoted = any(
                    re.search(rf"(?<![\w.]){re.escape(t)}(?![\w])", message) for t in texts
                )
                if named if not by_value else quoted:
                    return f"{flag.removeprefix('--')} = {_toml(value)} comes from {path}"
    return None


def _toml(value: Any) -> str:
    """A config value as the file spells it (a string quoted, a list in brackets), not as
    Python's repr of the object it became (an enum member, a PosixPath)."""
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(getattr(value, "value", value))  # (an enum: its value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _quoted(text: str, message: str) -> bool:
    """`text` in the message as a whole (not 32 inside 32x512, nor fc inside fc1)."""
    return re.search(rf"(?<![\w.]){re.escape(text)}(?![\w])", message) is not None


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """Typed errors → one line on stderr and their exit code; Ctrl-C → 130. An error about a
    value the project config set says so (the file may be a parent folder's)."""
    try:
        yield
    except HookcliError as exc:
        note = _config_note(exc.message) if isinstance(exc, UsageError) else None
        if note is not None and "hookcli.toml:" not in exc.message:
            exc.message = f"{exc.message.rstrip().rstrip('.')} ({note})."
        err(f"error: {ranks.label()}{exc}")
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        err("interrupted")
        raise typer.Exit(130) from None
    except (typer.Exit, typer.Abort):
        raise
    except Exception as exc:
        if os.environ.get("HOOKCLI_DEBUG"):
            raise
        err(
            f"error: {ranks.label()}internal error: {type(exc).__name__}: {exc} "
            "Hint: this is a hookcli bug; rerun with HOOKCLI_DEBUG=1 for the traceback "
            "and report it."
        )
        raise typer.Exit(3) from None


@contextlib.contextmanager
def model_output_to_stderr() -> Iterator[None]:
    """While user code runs (model files, constructors, forward): its print() goes to stderr,
    so stdout carries only hookcli's data (a JSON report stays parseable)."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


@contextlib.contextmanager
def status(message: str) -> Iterator[None]:
    """While the model loads and runs: a spinner on stderr for a person at a terminal, and
    the model's own print() sent to stderr."""
    if not sys.stderr.isatty() or os.environ.get("NO_COLOR") or os.environ.get("CI"):
        with model_output_to_stderr():
            yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message), model_output_to_stderr():
        yield


def color() -> bool:
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def width() -> int | None:
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    env = os.environ.get("COLUMNS", "")
    return int(env) if env.isdigit() else 200


def claim(
    path: Path | None,
    option: str = "--output",
    *,
    suffix: str | None = None,
    stdout_ok: bool = True,
    reads: list[str] | None = None,
) -> Destination | None:
    """An output checked before any work is done (hookcli.io.output has the one policy)."""
    from hookcli.io.output import claim as claim_output

    return claim_output(path, option, suffix=suffix, stdout_ok=stdout_ok, reads=reads or [])


def to_file(dest: Destination | None) -> bool:
    """Output to a file (not stdout, not `-o -`)."""
    return dest is not None and dest.path is not None


def emit(text: str | bytes, dest: Destination | None, *, quiet: bool = False) -> None:
    """stdout, or the claimed destination (atomically replaced, or written through); `quiet`
    (check --quiet): no "wrote FILE" line. Bytes: a binary format's file (Parquet)."""
    from hookcli.io.output import write_bytes, write_text

    if dest is None:
        if isinstance(text, bytes):
            sys.stdout.flush()
            sys.stdout.buffer.write(text)
            sys.stdout.buffer.flush()
            return
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    if isinstance(text, bytes):
        write_bytes(dest, text)
    else:
        write_text(dest, text)
    if dest.path is not None and dest.fd is None and not quiet:  # `-o /dev/stdout`: the data
        err(f"wrote {dest.label}")


def emit_listing(data: object, fmt: ListFormat, output: Destination | None, table: str) -> None:
    """`models`, `layers` and `show`: JSON of the records, or the named table renderer."""
    if fmt == ListFormat.json:
        from hookcli.render.json import data_json

        text = data_json(data)
    else:
        from hookcli.render import table as tables

        text = getattr(tables, table)(data, color=color() and not to_file(output), width=width())
    emit(text, output)


def rendered(
    obj: Any,
    fmt: Format,
    dest: Destination | None,
    *,
    pictures: Sequence[Any] = (),
    checks_only: bool = False,
    quiet: bool = False,
) -> str | bytes:
    """A report in the format asked, through the one door (render.formats): colour and width
    from this terminal; a binary format's bytes; the writer's note (an HTML page over its size
    budget) on stderr."""
    from hookcli.render.formats import noted, written

    options = Options(
        color=color() and not to_file(dest),
        width=width(),
        pictures=pictures,
        checks_only=checks_only,
        quiet=quiet,
    )
    out = written(obj, fmt, options)
    note = noted(obj, fmt, out, options)
    if note is not None:
        err(f"note: {note}")
    return out


def _suffix(output: Destination | None) -> str:
    """The -o name's suffix as typed ('' for stdout, a descriptor, a name without one)."""
    return "" if output is None else output.suffix


def output_format(fmt: Format | None, output: Destination | None, *, kind: Kind) -> Format:
    """--format, else the -o name's suffix, else a table, for a command writing a `kind` of
    report; checked before any work, from the writers' table (render.writers). Without -f, a
    suffix hookcli does not write is refused (a table in a file named .parquet helps no one);
    -f writes any name, except that a binary format and its own suffix go only together. A
    format is refused where it does not take the kind (a tracker takes only a run log's
    series, and `hookcli report` sends it there first), where what it needs is missing, and
    for a terminal when it is binary."""
    suffix = _suffix(output)
    named = by_suffix(suffix)
    label = output.label if output is not None else ""
    typed = not from_config("--output")  # (-o on the command line: its suffix picks)
    if fmt is not None and named is not None and typed and from_config("--format"):
        fmt = None  # the config's format is a default, below what the command line says
    if fmt is None and suffix and named is None:
        raise UsageError(
            f"-o {label}: hookcli does not write {suffix} files.",
            f"name the file {suffixes_named()}, or give -f FORMAT.",
        )
    asked = None if fmt is None else writer(fmt)
    if asked is not None and named is not None and asked != named:
        binary = next((w for w in (asked, named) if w.binary), None)
        if binary is not None:
            raise UsageError(
                f"-f {asked.format.value} and -o {label}: {binary.name} and a {binary.suffix} "
                "name go together.",
                "drop -f (the suffix picks the format), or rename the file.",
            )
    chosen = asked or named or writer(Format.table)
    _possible(chosen, kind, output)
    return chosen.format


def _possible(w: Writer, kind: Kind, output: Destination | None) -> None:
    name = w.format.value
    if w.folder:
        raise UsageError(
            f"-f {name} writes a training log's series.",
            f"hookcli report run.jsonl -f {name} -o runs/NAME",
        )
    if kind not in w.kinds:
        raise UsageError(
            f"this command's output has no {w.name} form.", "write -f csv or -f json instead."
        )
    if w.needs is not None and not w.needs.here():
        raise UsageError(
            f"{w.name} needs {w.needs.packages}, which are not installed.",
            f"pip install 'hookcli[{w.needs.extra}]'.",
        )
    to_stdout = output is None or output.path is None or output.fd == 1
    if w.binary and to_stdout and sys.stdout.isatty():
        raise UsageError(f"{w.name} is binary; not for a terminal.", f"give -o FILE{w.suffix}.")


def listing_format(fmt: ListFormat | None, output: Destination | None) -> ListFormat:
    """models, layers and show: a table or JSON, -f's, else the -o name's (FILE.json: JSON);
    without -f, a suffix they do not write is refused before any work."""
    suffix = _suffix(output)
    named = by_suffix(suffix)
    if named is not None and named.binary:
        raise UsageError(
            f"-o {output.label if output else ''}: this command writes a table or JSON, not "
            f"{named.name}.",
            "name the file .txt or .json.",
        )
    if fmt is not None:
        return fmt
    if suffix == ".json":
        return ListFormat.json
    if suffix not in ("", ".txt"):
        raise UsageError(
            f"-o {output.label if output else ''}: this command writes a table (.txt) or JSON "
            f"(.json), not {suffix}.",
            "name the file .txt or .json, or give -f table|json.",
        )
    return ListFormat.table
