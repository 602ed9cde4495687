"""Reading one hookcli.watch log file back, validated line by line.

A log is one JSON object a line (recorder.py writes them): `"kind": "step"` for each watched
optimizer step, `"kind": "nonfinite"` when a NaN/Inf is first seen. Every line is checked field
by field before anything reads it; a file that is not a log, an empty one, a bad line, two runs
appended to one file — each is a one-line UsageError naming the file and the line. A line that
passes is kept as its record (records.StepLine, NonfiniteLine), built straight from the checked
fields: what every reader of a run (runmerge, runseries, runrules) works on.

No torch: a log is numbers, and reading one must work where torch is not installed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NoReturn

from hookcli.errors import UsageError
from hookcli.io.recordjson import RecordError, from_json, json_type
from hookcli.records import (
    READABLE_LOG_SCHEMAS,
    TENSOR_STATS,
    CallMemory,
    LoggedCall,
    LoggedParam,
    Memory,
    NonfiniteLine,
    Origin,
    StepLine,
    TensorStats,
    TokenRow,
)
from hookcli.text import escape

RUN_SCHEMA = 1  # the JSON `check`/`report` write about a run
KINDS = ("inputs", "outputs", "grad_inputs", "grad_outputs")
GRAD_KINDS = ("grad_inputs", "grad_outputs")
# a tensor's declared statistics (records.TensorStats): numbers or null, and counts
STATS = tuple(s.name for s in TENSOR_STATS if not s.count)
COUNTS = tuple(s.name for s in TENSOR_STATS if s.count)
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
        out += [str(p.parent / c.name) for _, c in found] or [name]
    return out


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
                try:
                    kind = _line_kind(data)
                    if kind == "step":
                        _check_step(data)
                    elif kind == "nonfinite":
                        _check_event(data)
                except _Bad as exc:
                    if not lines:
                        refuse(f"is not a hookcli.watch log: line {number} {exc}")
                    refuse(f"line {number} {exc}")
                lines += 1
                if kind not in ("step", "nonfinite"):
                    continue  # a later recorder's line kind: nothing here reads it
                if data["schema"] not in READABLE_LOG_SCHEMAS:
                    refuse(
                        f"line {number} has schema {data['schema']}; this hookcli reads "
                        f"{' and '.join(map(str, READABLE_LOG_SCHEMAS))}",
                        "read it with the hookcli version that wrote it.",
                    )
                here = (data["rank"], data["world_size"])
                if who is None:
                    who = here
                elif here != who:
                    refuse(
                        f"line {number} is rank {here[0]} of {here[1]}, line 1 rank {who[0]} "
                        f"of {who[1]}: one file holds one rank's log",
                        "give each rank's own log (run.rank0.jsonl run.rank1.jsonl …).",
                    )
                run_id = data.get("run")
                if run_id is not None and first_run is None:
                    first_run = (str(run_id), number)
                elif run_id is not None and first_run is not None and str(run_id) != first_run[0]:
                    refuse(
                        f"line {number} is from another run than line {first_run[1]}: two runs "
                        "wrote one log",
                        "give each run its own log (hookcli.watch(log=...)), and delete this "
                        "one before a new run.",
                    )
                if kind == "nonfinite":
                    events.append(_event_record(data))
                    continue
                step = data["step"]
                if step in steps:
                    refuse(
                        f"holds step {step} twice (lines {first_line[step]} and {number}): "
                        "two runs appended to one log",
                        "the log is opened for appending: delete it before a new run, or give "
                        "each run its own log.",
                    )
                steps[step] = _step_record(data)
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
    type hint by the reader compiled for StepLine (io/recordjson.py): a field of the wrong type
    is a RecordError naming it. read_log checks a line by hand and builds the same record: its
    messages name a line's fields its own way, it also holds counts and sizes to >= 0, and it
    reads a line written with only the checked fields (the typed reader, as fast now, does
    neither yet)."""
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


# ---------------------------------------------------------------- checked lines as records
# Built field by field from a line the checks below passed. What the checks let be absent is
# None (a statistic, a loss, a norm), 0 (NaN/Inf counts), "" (a dtype) or the record's default;
# what they do not look at (a dtype, a note, an error, an origin's `where`) is taken as the
# line has it. step_line is the reader that checks every field's type.


def _step_record(data: dict[str, Any]) -> StepLine:
    """A checked step line as its record."""
    g = data.get
    return StepLine(
        step=data["step"],
        rank=data["rank"],
        world_size=data["world_size"],
        loss=g("loss"),
        layers=[_call_record(c) for c in data["layers"]],
        params=[_param_record(p) for p in data["params"]],
        nonfinite_origins=[_origin_record(o) for o in g("nonfinite_origins") or []],
        loss_nonfinite=g("loss_nonfinite", False),
        skipped=g("skipped"),
        scale=g("scale"),
        run=g("run"),
        schema=data["schema"],
        memory=_memory_record(Memory, g("memory")),
    )


def _memory_record(cls: type[Any], data: Any) -> Any:
    """watch(memory=True)'s numbers as their record; None when absent or not well formed
    (they are never checked as rules)."""
    if data is None:
        return None
    try:
        return from_json(cls, data)
    except RecordError:
        return None


def _event_record(data: dict[str, Any]) -> NonfiniteLine:
    """A checked nonfinite line as its record."""
    g = data.get
    return NonfiniteLine(
        step=data["step"],
        rank=data["rank"],
        world_size=data["world_size"],
        found=data["found"],
        origins=[_origin_record(o) for o in g("origins") or []],
        nonfinite_params=g("nonfinite_params") or [],
        nonfinite_grads=g("nonfinite_grads", []),
        bundle=g("bundle"),
        notes=g("notes", []),
        run=g("run"),
        schema=data["schema"],
    )


def _call_record(c: dict[str, Any]) -> LoggedCall:
    grad_outputs, grad_inputs = c["grad_outputs"], c["grad_inputs"]
    return LoggedCall(
        name=c["name"],
        type=c["type"],
        call=c["call"],
        inputs=[_stats_record(t) for t in c["inputs"]],
        outputs=[_stats_record(t) for t in c["outputs"]],
        grad_outputs=None if grad_outputs is None else [_stats_record(t) for t in grad_outputs],
        grad_inputs=None if grad_inputs is None else [_stats_record(t) for t in grad_inputs],
        error=c.get("error"),
        memory=_memory_record(CallMemory, c.get("memory")),
    )


def _param_record(p: dict[str, Any]) -> LoggedParam:
    g = p.get
    grad = g("grad")
    return LoggedParam(
        name=p["name"],
        norm=g("norm"),
        grad=None if grad is None else _stats_record(grad),
        update_norm=g("update_norm"),
        update_ratio=g("update_ratio"),
    )


def _compile_stats_record() -> Callable[[dict[str, Any]], TensorStats]:
    """`_stats_record`: a tensor's logged statistics (no element values, histograms or
    channels: never logged), its declared statistics (TENSOR_STATS) read as absent ones are
    (None, a count 0). Written out once from TensorStats' fields, every argument by position:
    a log holds tens of thousands, and keywords cost a quarter more (read_log's records equal
    step_line's: tests/commands/watch/test_watch_logs.py checks it)."""
    read = {"path": 't["path"]', "shape": 'tuple(t["shape"])', "dtype": 'g("dtype") or ""'}
    read |= {"numel": 't["numel"]', "note": 'g("note")', "layout": 'g("layout")'}
    read |= {s.name: f'g("{s.name}")' + (" or 0" if s.count else "") for s in TENSOR_STATS}
    names = [f.name for f in fields(TensorStats)]
    last = max(names.index(n) for n in read)
    args = ", ".join(read.get(n, "None") for n in names[: last + 1])
    code = (
        "def _stats_record(t):\n"
        "    g = t.get\n"
        f"    stats = TensorStats({args})\n"
        '    rows = g("per_token")\n'
        "    if rows is not None:\n"
        "        stats.per_token = _token_rows(rows)\n"
        "    return stats\n"
    )
    scope: dict[str, Any] = {"TensorStats": TensorStats, "_token_rows": _token_rows}
    exec(code, scope)  # names: TensorStats' own fields
    built: Callable[[dict[str, Any]], TensorStats] = scope["_stats_record"]
    return built


_TOKEN_FIELDS = tuple(TokenRow.__dataclass_fields__)


def _token_rows(rows: Any) -> list[TokenRow] | None:
    """--per-token rows as the recorder writes them (each TokenRow's fields); nothing reads
    them back, so rows of another shape are left out rather than refused."""
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return None
    return [TokenRow(**{k: r.get(k) for k in _TOKEN_FIELDS}) for r in rows]


_stats_record = _compile_stats_record()


def _origin_record(o: dict[str, Any]) -> Origin:
    """An origin of a checked line; the fields the checks leave alone (where, after,
    after_finite, code) taken only when of their type, else their default: a hand-edited
    line still reads and describes itself."""
    g = o.get
    where, after, code = g("where"), g("after"), g("code")
    finite = g("after_finite")
    return Origin(
        direction=o["direction"],
        layer=o["layer"],
        type=o["type"],
        call=o["call"],
        path=o["path"],
        nan=o["nan"],
        inf=o["inf"],
        where=where if isinstance(where, str) else "layer",
        after=after if isinstance(after, str) else None,
        after_finite=finite if isinstance(finite, str) else None,
        code=[c for c in code if isinstance(c, str)] if isinstance(code, list) else [],
    )


# ---------------------------------------------------------------- the line schema


def _field(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise _Bad(f"has no {key!r}{where}")
    return obj[key]


def _count(obj: dict[str, Any], key: str, where: str, *, low: int = 0) -> int:
    v = _field(obj, key, where)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise _Bad(f"has {key} = {json.dumps(v)[:40]}{where}, not a whole number >= {low}")
    return v


def _number(obj: dict[str, Any], key: str, where: str, *, optional: bool = True) -> None:
    v = obj.get(key) if optional else _field(obj, key, where)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(float(v)):
        raise _Bad(f"has {key} {json_type(v)}{where}, not a number or null")


def _string(obj: dict[str, Any], key: str, where: str, *, nullable: bool = False) -> None:
    v = _field(obj, key, where)
    if not isinstance(v, str) and not (nullable and v is None):
        raise _Bad(f"has {key} {json_type(v)}{where}, not a string")


def _items(obj: dict[str, Any], key: str, where: str, *, nullable: bool = False) -> list[Any]:
    v = _field(obj, key, where)
    if v is None and nullable:
        return []
    if not isinstance(v, list):
        raise _Bad(f"has {key} {json_type(v)}{where}, not a list")
    return v


def _optional_list(obj: dict[str, Any], key: str) -> list[Any]:
    """A list that may be absent or null (older lines): [] then; anything else is _Bad."""
    return _items(obj, key, "", nullable=True) if key in obj else []


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Bad(f"has {json_type(value)}{where}, not an object")
    return value


def _line_kind(data: Any) -> str:
    if not isinstance(data, dict):
        raise _Bad(f"is {json_type(data)}, not a JSON object")
    if "layers" in data and "model" in data:
        raise _Bad("is a JSON report (hookcli report FILE.json reads those), not a log line")
    schema = _field(data, "schema", "")
    if isinstance(schema, bool) or not isinstance(schema, int):
        raise _Bad(f"has schema {json_type(schema)}, not a number")
    kind = _field(data, "kind", "")
    if not isinstance(kind, str):
        raise _Bad(f"has kind {json_type(kind)}, not a string")
    if kind in ("step", "nonfinite"):
        _count(data, "step", "")
        _count(data, "rank", "")
        _count(data, "world_size", "", low=1)
        if data["rank"] >= data["world_size"]:
            raise _Bad(f"is rank {data['rank']} of a world of {data['world_size']}")
    return kind


def _tensor(value: Any, where: str) -> None:
    t = _object(value, where)
    _string(t, "path", where)
    shape = _field(t, "shape", where)
    if not isinstance(shape, list) or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape
    ):
        raise _Bad(f"has a shape that is not a list of sizes{where}")
    _count(t, "numel", where)
    for key in STATS:
        _number(t, key, where)
    for key in COUNTS:
        if key in t:
            _count(t, key, where)


def _origin(value: Any, where: str) -> None:
    o = _object(value, where)
    for key in ("direction", "layer", "type", "path"):
        _string(o, key, where)
    _count(o, "call", where)
    for key in ("nan", "inf"):
        _count(o, key, where)


def _check_step(data: dict[str, Any]) -> None:
    _number(data, "loss", "")
    for i, raw in enumerate(_items(data, "layers", "")):
        where = f" in layers[{i}]"
        c = _object(raw, where)
        _string(c, "name", where)
        _string(c, "type", where)
        _count(c, "call", where)
        for kind in KINDS:
            for j, t in enumerate(_items(c, kind, where, nullable=kind in GRAD_KINDS)):
                _tensor(t, f" in layers[{i}].{kind}[{j}]")
    for i, raw in enumerate(_items(data, "params", "")):
        where = f" in params[{i}]"
        p = _object(raw, where)
        _string(p, "name", where)
        for key in ("norm", "update_norm", "update_ratio"):
            _number(p, key, where)
        if p.get("grad") is not None:
            _tensor(p["grad"], f" in params[{i}].grad")
    for i, o in enumerate(_optional_list(data, "nonfinite_origins")):
        _origin(o, f" in nonfinite_origins[{i}]")
    _number(data, "scale", "")


def _check_event(data: dict[str, Any]) -> None:
    found = _items(data, "found", "")
    if any(not isinstance(f, str) for f in found):
        raise _Bad("has a 'found' that is not a list of strings")
    for i, o in enumerate(_optional_list(data, "origins")):
        _origin(o, f" in origins[{i}]")
    names = data.get("nonfinite_params") or []
    if not isinstance(names, list) or any(not isinstance(n, str) for n in names):
        raise _Bad("has a 'nonfinite_params' that is not a list of names")
