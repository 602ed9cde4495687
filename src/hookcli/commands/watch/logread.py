"""Reading one hookcli.watch log file back, validated line by line.

A log is one JSON object a line (recorder.py writes them): `"kind": "step"` for each watched
optimizer step, `"kind": "nonfinite"` when a NaN/Inf is first seen. Every line is read by the
typed reader compiled for its record (io/recordjson.py: records.StepLine, NonfiniteLine), each
field checked against its type hint and its metadata (counts >= 0, what an absent field reads
as) as the record is built: what every reader of a run (runmerge, runseries, runrules) works
on. A file that is not a log, an empty one, a bad line, two runs appended to one file — each is
a one-line UsageError naming the file and the line, the reader's RecordError in the log's words.

No torch: a log is numbers, and reading one must work where torch is not installed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from hookcli.errors import UsageError
from hookcli.io.recordjson import RecordError, from_json, json_type
from hookcli.records import READABLE_LOG_SCHEMAS, NonfiniteLine, StepLine
from hookcli.text import escape

RUN_SCHEMA = 1  # the JSON `check`/`report` write about a run
KINDS = ("inputs", "outputs", "grad_inputs", "grad_outputs")
_WRITE_HINT = "hookcli.watch(model, optimizer=opt, log='run.jsonl') writes one"


class _Bad(Exception):
    """What is wrong with a line, as a phrase."""


@dataclass(slots=True)
class LogFile:
    """One log as read: its rank, its step records by step, its non-finite events."""

    path: str
    rank: int
    world_size: int
    steps: dict[int, StepLine]
    events: list[NonfiniteLine]
    notes: list[str] = field(default_factory=list)


def is_log_path(name: str) -> bool:
    """A run log is named *.jsonl (a saved report *.json): how check and report tell them."""
    return name.lower().endswith(".jsonl")


def expand_logs(names: Sequence[str]) -> list[str]:
    """The files named, a name that does not exist replaced by its rank logs when there are
    some: under torchrun `log="run.jsonl"` writes run.rank0.jsonl, run.rank1.jsonl, … (and
    `log="run-{rank}.jsonl"` run-0.jsonl, …), so `hookcli report run.jsonl` finds them."""
    out: list[str] = []
    for name in names:
        p = Path(name).expanduser()
        if p.exists() or not p.parent.is_dir():
            out.append(name)
            continue
        if "{rank}" in p.name:
            head, _, tail = p.name.partition("{rank}")
            pattern = re.compile(re.escape(head) + r"(\d+)" + re.escape(tail))
        else:
            pattern = re.compile(re.escape(p.stem) + r"\.rank(\d+)" + re.escape(p.suffix))
        found = sorted(
            (int(m.group(1)), c)
            for c in p.parent.iterdir()
            if (m := pattern.fullmatch(c.name)) is not None
        )
        world = _world_of(p.parent / found[0][1].name) if found else None
        if world is not None and world > len(found):  # a run's name: every rank's log, or none
            have = {rank for rank, _ in found}
            missing = ", ".join(str(r) for r in range(world) if r not in have)
            raise UsageError(
                f"{escape(name)} is a run of {world} processes, and the log of rank {missing} "
                "is not there.",
                "give every rank's log (a rank that crashed may not have written one), or "
                "name one rank's log to read that rank alone.",
            )
        out += [str(p.parent / c.name) for _, c in found] or [name]
    return out


def _world_of(path: Path) -> int | None:
    """The world size a log's first line gives (None: it cannot be read here; read_log
    then says why)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.readline(1 << 20).decode("utf-8"))
        world = data.get("world_size") if isinstance(data, dict) else None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return world if type(world) is int else None


def read_log(path: str | Path) -> LogFile:
    """One log, every line validated. A last line cut short (the run killed while writing it)
    is left out with a note; any other bad line is an error."""
    from hookcli.io.output import note_read

    p = Path(path)
    label = escape(str(p))
    note_read(p)

    def refuse(what: str, hint: str = f"{_WRITE_HINT} line per watched step.") -> NoReturn:
        raise UsageError(f"run log {label} {what}.", hint)

    steps: dict[int, StepLine] = {}
    events: list[NonfiniteLine] = []
    notes: list[str] = []
    first_line: dict[int, int] = {}  # step → the line it was on
    who: tuple[int, int] | None = None  # (rank, world size) of the first line
    first_run: tuple[str, int] | None = None  # (run id, line) of the first line with one
    lines = 0
    try:
        with open(p, "rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
                except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                    if not raw.endswith(b"\n") and lines:  # cut short: the writer died
                        notes.append(
                            f"{p.name} line {number} is incomplete (the run stopped while "
                            f"writing it): read up to line {number - 1}"
                        )
                        break
                    what = _why_not_json(exc)
                    if not lines:
                        refuse(f"is not a hookcli.watch log: line {number} is {what}")
                    refuse(f"line {number} is {what}")
                record: StepLine | NonfiniteLine | None = None
                try:
                    kind = _line_kind(data)
                    if kind == "step":
                        record = step_line(data)
                    elif kind == "nonfinite":
                        record = nonfinite_line(data)
                    if record is not None and record.rank >= record.world_size:
                        raise _Bad(f"is rank {record.rank} of a world of {record.world_size}")
                except (_Bad, RecordError) as exc:
                    what = _worded(exc) if isinstance(exc, RecordError) else str(exc)
                    if not lines:
                        refuse(f"is not a hookcli.watch log: line {number} {what}")
                    refuse(f"line {number} {what}")
                lines += 1
                if record is None:
                    continue  # a later recorder's line kind: nothing here reads it
                if record.schema not in READABLE_LOG_SCHEMAS:
                    refuse(
                        f"line {number} has schema {record.schema}; this hookcli reads "
                        f"{' and '.join(map(str, READABLE_LOG_SCHEMAS))}",
                        "read it with the hookcli version that wrote it.",
                    )
                here = (record.rank, record.world_size)
                if who is None:
                    who = here
                elif here != who:
                    refuse(
                        f"line {number} is rank {here[0]} of {here[1]}, line 1 rank {who[0]} "
                        f"of {who[1]}: one file holds one rank's log",
                        "give each rank's own log (run.rank0.jsonl run.rank1.jsonl …).",
                    )
                run_id = record.run
                if run_id is not None and first_run is None:
                    first_run = (str(run_id), number)
                elif run_id is not None and first_run is not None and str(run_id) != first_run[0]:
                    refuse(
                        f"line {number} is from another run than line {first_run[1]}: two runs "
                        "wrote one log",
                        "give each run its own log (hookcli.watch(log=...)), and delete this "
                        "one before a new run.",
                    )
                if isinstance(record, NonfiniteLine):
                    events.append(record)
                    continue
                step = record.step
                if step in steps:
                    refuse(
                        f"holds step {step} twice (lines {first_line[step]} and {number}): "
                        "two runs appended to one log",
                        "the log is opened for appending: delete it before a new run, or give "
                        "each run its own log.",
                    )
                steps[step] = record
                first_line[step] = number
    except FileNotFoundError:
        refuse(
            "not found",
            "give the log hookcli.watch(log=…) wrote; under torchrun each rank writes its "
            "own: run.rank0.jsonl, run.rank1.jsonl, …",
        )
    except IsADirectoryError:
        refuse("is a folder", "give the .jsonl file in it.")
    except OSError as exc:
        raise UsageError(
            f"cannot read run log {label}: {exc.strerror or exc}.", "check the path."
        ) from None
    if not lines:
        refuse("is empty: no watched step was logged")
    if not steps:
        refuse("holds no watched step (only non-finite events)")
    assert who is not None
    ordered = dict(sorted(steps.items()))
    return LogFile(str(p), who[0], who[1], ordered, events, notes)


def step_line(data: dict[str, Any]) -> StepLine:
    """A step line as its record (w.records holds the same), every field checked against its
    type hint and metadata by the reader compiled for StepLine (io/recordjson.py): a field of
    the wrong type, or a count below 0, is a RecordError naming it (read_log words it as the
    log's one-line message)."""
    line = from_json(StepLine, data)
    assert isinstance(line, StepLine)
    return line


def nonfinite_line(data: dict[str, Any]) -> NonfiniteLine:
    """A nonfinite line as its record (w.nonfinite is the same), checked as step_line is."""
    line = from_json(NonfiniteLine, data)
    assert isinstance(line, NonfiniteLine)
    return line


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a number in a log (hookcli writes null)")


def _why_not_json(exc: BaseException) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text (byte {exc.start})"
    if isinstance(exc, RecursionError):
        return "JSON nested too deeply"
    return f"not a JSON object on one line ({escape(str(exc))})"


# ---------------------------------------------------------------- a line's kind, and its messages


def _field(obj: dict[str, Any], key: str) -> Any:
    if key not in obj:
        raise _Bad(f"has no {key!r}")
    return obj[key]


def _line_kind(data: Any) -> str:
    """What a line is, from its schema and kind: every reader of it dispatches on them."""
    if not isinstance(data, dict):
        raise _Bad(f"is {json_type(data)}, not a JSON object")
    if "layers" in data and "model" in data:
        raise _Bad("is a JSON report (hookcli report FILE.json reads those), not a log line")
    schema = _field(data, "schema")
    if isinstance(schema, bool) or not isinstance(schema, int):
        raise _Bad(f"has schema {json_type(schema)}, not a number")
    kind = _field(data, "kind")
    if not isinstance(kind, str):
        raise _Bad(f"has kind {json_type(kind)}, not a string")
    return kind


# the lists of plain values a line holds, by what they hold (a message's words)
_ITEMS = {"shape": "sizes", "nonfinite_params": "names", "nonfinite_grads": "names"}


def _worded(bad: RecordError) -> str:
    """The typed reader's RecordError in the log's own words: `has KEY TYPE in PLACE, not …`
    (a whole number's value shown: `has numel = -1 in …`), `has no 'KEY' in PLACE`, `has TYPE
    in PLACE, not an object`, `has a shape that is not a list of sizes in PLACE`."""
    path, v = bad.path, bad.value
    if bad.missing is not None:
        return f"has no {bad.missing!r}{_place(path)}"
    if bad.expected == "an object":
        return f"has {json_type(v)}{_place(path)}, not an object"
    if len(path) >= 2 and isinstance(path[-1], int) and isinstance(path[-2], str):
        path = path[:-1]  # one of a list of plain values: the list is named
    elif not (path and path[-1] in _ITEMS and bad.expected == "a list"):
        key, where = path[-1], _place(path[:-1])
        if bad.expected.startswith("a whole number"):
            return f"has {key} = {json.dumps(v)[:40]}{where}, not {bad.expected}"
        null = " or null" if bad.nullable else ""
        return f"has {key} {json_type(v)}{where}, not {bad.expected}{null}"
    key = str(path[-1])
    name = key if key == "shape" else repr(key)
    return f"has a {name} that is not a list of {_ITEMS.get(key, 'strings')}{_place(path[:-1])}"


def _place(path: Sequence[str | int]) -> str:
    """` in layers[0].outputs[1]`, or nothing at the top level."""
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return f" in {text}" if text else ""
