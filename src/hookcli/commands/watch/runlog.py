"""Reading hookcli.watch logs back: validated, rank logs merged exactly, rules over a run
(`hookcli check run.jsonl`) and per-layer series (`hookcli report run.jsonl`).

A log is one JSON object a line (recorder.py writes them): `"kind": "step"` for each watched
optimizer step, `"kind": "nonfinite"` when a NaN/Inf is first seen. Every line is checked field
by field before anything reads it; a file that is not a log, an empty one, a bad line, two runs
appended to one file — each is a one-line UsageError naming the file and the line.

Rank logs (torchrun: run.rank0.jsonl, run.rank1.jsonl, …) merge into the log one process over
the whole batch would have written, when each rank's loss is a mean over an equal shard of it:

- activations (`inputs`, `outputs`): each rank's statistics are over its shard, so they combine
  exactly by Chan's parallel update (engine.aggregate.Accumulator);
- activation gradients (`grad_outputs`, `grad_inputs`) are first scaled by 1/W: DDP minimises
  the mean of the W ranks' losses, so d(mean loss)/d(activation) = (1/W) · the rank's local
  gradient (mean, std, min, max and norm scale; zeros and NaN/Inf counts do not), then merged;
- parameters are all-reduced by DDP, so every rank holds the same: rank 0's are taken, and a
  rank that disagrees beyond 1e-5 relative is a note (not one DDP model?), not an error;
- the loss is the mean of the ranks'.

A merged step has the same fields as a single process's (world_size 1) plus `merged_ranks`.

No torch: a log is numbers, and reading one must work where torch is not installed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from hookcli import bounds
from hookcli.commands.checks import RELU_FAMILY, parse_rules
from hookcli.engine.aggregate import Accumulator
from hookcli.errors import UsageError
from hookcli.options import RuleOptions
from hookcli.records import CheckResult, Failure, Origin, Report, TensorStats
from hookcli.text import escape

LOG_SCHEMAS = (1,)  # the log line versions this reads (recorder.LOG_SCHEMA)
RUN_SCHEMA = 1  # the JSON `check`/`report` write about a run
KINDS = ("inputs", "outputs", "grad_inputs", "grad_outputs")
GRAD_KINDS = ("grad_inputs", "grad_outputs")
PARAM_RTOL = 1e-5  # ranks of one DDP model agree on their parameters within this
_STATS = ("mean", "std", "min", "max", "zeros", "norm")
_SCALED = ("mean", "std", "min", "max", "norm")  # what scales with the gradient (not zeros)
_WRITE_HINT = "hookcli.watch(model, optimizer=opt, log='run.jsonl') writes one"


# ---------------------------------------------------------------- one log file


class _Bad(Exception):
    """What is wrong with a line, as a phrase."""


@dataclass(slots=True)
class LogFile:
    """One log as read: its rank, its step records by step, its non-finite events."""

    path: str
    rank: int
    world_size: int
    steps: dict[int, dict[str, Any]]
    events: list[dict[str, Any]]
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

    steps: dict[int, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
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
                if data["schema"] not in LOG_SCHEMAS:
                    refuse(
                        f"line {number} has schema {data['schema']}; this hookcli reads "
                        f"{' and '.join(map(str, LOG_SCHEMAS))}",
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
                    events.append(data)
                    continue
                step = data["step"]
                if step in steps:
                    refuse(
                        f"holds step {step} twice (lines {first_line[step]} and {number}): "
                        "two runs appended to one log",
                        "the log is opened for appending: delete it before a new run, or give "
                        "each run its own log.",
                    )
                steps[step] = data
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


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a number in a log (hookcli writes null)")


def _why_not_json(exc: BaseException) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text (byte {exc.start})"
    if isinstance(exc, RecursionError):
        return "JSON nested too deeply"
    return f"not a JSON object on one line ({escape(str(exc))})"


# ---------------------------------------------------------------- the line schema


def _type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int | float):
        return "a number"
    return "a list" if isinstance(value, list) else "an object"


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
        raise _Bad(f"has {key} {_type(v)}{where}, not a number or null")


def _string(obj: dict[str, Any], key: str, where: str, *, nullable: bool = False) -> None:
    v = _field(obj, key, where)
    if not isinstance(v, str) and not (nullable and v is None):
        raise _Bad(f"has {key} {_type(v)}{where}, not a string")


def _items(obj: dict[str, Any], key: str, where: str, *, nullable: bool = False) -> list[Any]:
    v = _field(obj, key, where)
    if v is None and nullable:
        return []
    if not isinstance(v, list):
        raise _Bad(f"has {key} {_type(v)}{where}, not a list")
    return v


def _optional_list(obj: dict[str, Any], key: str) -> list[Any]:
    """A list that may be absent or null (older lines): [] then; anything else is _Bad."""
    return _items(obj, key, "", nullable=True) if key in obj else []


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Bad(f"has {_type(value)}{where}, not an object")
    return value


def _line_kind(data: Any) -> str:
    if not isinstance(data, dict):
        raise _Bad(f"is {_type(data)}, not a JSON object")
    if "layers" in data and "model" in data:
        raise _Bad("is a JSON report (hookcli report FILE.json reads those), not a log line")
    schema = _field(data, "schema", "")
    if isinstance(schema, bool) or not isinstance(schema, int):
        raise _Bad(f"has schema {_type(schema)}, not a number")
    kind = _field(data, "kind", "")
    if not isinstance(kind, str):
        raise _Bad(f"has kind {_type(kind)}, not a string")
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
    for key in _STATS:
        _number(t, key, where)
    for key in ("nan", "inf"):
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


# ---------------------------------------------------------------- several logs: one run


@dataclass(slots=True)
class Run:
    """A run as one process over the whole batch would have logged it: `steps` are step
    records in step order (merged when several rank logs were given), `events` every rank's
    non-finite events; `ranks` the logs merged, `world_size` the processes of the run."""

    files: list[str]
    ranks: int
    world_size: int
    steps: list[dict[str, Any]]
    events: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)

    @property
    def step_numbers(self) -> list[int]:
        return [s["step"] for s in self.steps]


def load_run(paths: Sequence[str | Path]) -> Run:
    """One log, or every rank's log of one run merged (see the module docstring)."""
    if not paths:
        raise UsageError("no run log given.", "e.g. hookcli report run.jsonl")
    logs = [read_log(p) for p in paths]
    notes = [n for log in logs for n in log.notes]
    if len(logs) == 1:
        (log,) = logs
        if log.world_size > 1:
            notes.append(
                f"{Path(log.path).name} is rank {log.rank} of {log.world_size}: statistics over "
                "its shard of each batch only (give every rank's log to merge them)"
            )
        return Run([log.path], 1, log.world_size, list(log.steps.values()), log.events, notes)
    return merge_logs(logs, notes)


def merge_logs(logs: Sequence[LogFile], notes: list[str] | None = None) -> Run:
    """The rank logs of one run merged step by step."""
    notes = list(notes or [])
    names = [Path(log.path).name for log in logs]
    worlds = {log.world_size for log in logs}
    world = max(worlds)
    if len(worlds) > 1 or world < len(logs):
        sizes = ", ".join(
            f"{n} rank {log.rank} of {log.world_size}" for n, log in zip(names, logs, strict=True)
        )
        raise UsageError(
            f"{len(logs)} logs given for a run of {world} processes ({sizes}): not one run.",
            "give every rank's log of one run: run.rank0.jsonl run.rank1.jsonl …",
        )
    by_rank: dict[int, LogFile] = {}
    for log, name in zip(logs, names, strict=True):
        other = by_rank.get(log.rank)
        if other is not None:
            raise UsageError(
                f"{Path(other.path).name} and {name} are both rank {log.rank}'s log.",
                "give each rank's log once.",
            )
        by_rank[log.rank] = log
    if len(logs) < world:
        missing = ", ".join(str(r) for r in range(world) if r not in by_rank)
        raise UsageError(
            f"{len(logs)} logs given for a run of {world} processes (rank {missing} missing).",
            "give every rank's log of one run: run.rank0.jsonl run.rank1.jsonl …",
        )
    ordered = [by_rank[r] for r in range(world)]
    every = sorted({s for log in ordered for s in log.steps})
    for log in ordered:
        gone = [s for s in every if s not in log.steps]
        if gone:
            has = next(o for o in ordered if gone[0] in o.steps)
            raise UsageError(
                f"run log {escape(log.path)} (rank {log.rank}) has no step {gone[0]}, which "
                f"{escape(Path(has.path).name)} has"
                + (f" ({len(gone)} steps missing in all)" if len(gone) > 1 else "")
                + ".",
                "give the logs of one run, whole (a rank that stopped early ends its log "
                "early: read the ranks one at a time).",
            )
    steps = []
    for s in every:
        merged, disagree = merge_step([log.steps[s] for log in ordered])
        steps.append(merged)
        notes += disagree
    events = sorted((e for log in ordered for e in log.events), key=lambda e: e["step"])
    return Run([log.path for log in ordered], world, world, steps, events, notes)


def merge_step(records: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """One step's records from W ranks (rank order) merged into the record one process over
    the whole batch would have written, and notes on what did not agree."""
    w = len(records)
    first = records[0]
    step = first["step"]
    notes: list[str] = []
    merged: dict[str, Any] = {k: v for k, v in first.items() if k not in ("layers", "params")}
    merged.update(rank=0, world_size=1, merged_ranks=w)
    losses = [r.get("loss") for r in records]
    finite = [float(x) for x in losses if x is not None]
    merged["loss"] = math.fsum(finite) / w if len(finite) == w else None
    if any(r.get("loss_nonfinite") for r in records):
        merged["loss_nonfinite"] = True
    if any(r.get("skipped") for r in records):
        merged["skipped"] = True
    # layer calls, in the order rank 0 saw them (then any only other ranks ran)
    calls: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        for c in r["layers"]:
            calls.setdefault((c["name"], c["call"]), []).append(c)
    layers = []
    for (name, call), parts in calls.items():
        if len(parts) != w:
            notes.append(
                f"step {step}: {name} call {call} ran on {len(parts)} of {w} ranks; merged "
                "over those"
            )
        entry = {k: v for k, v in parts[0].items() if k not in KINDS}
        for kind in KINDS:
            lists = [c.get(kind) for c in parts]
            if all(x is None for x in lists):
                entry[kind] = None
                continue
            scale = 1.0 / w if kind in GRAD_KINDS else 1.0
            entry[kind] = merge_tensors([x or [] for x in lists], scale)
        entry["error"] = next((c.get("error") for c in parts if c.get("error")), None)
        layers.append(entry)
    merged["layers"] = layers
    merged["params"] = first["params"]
    notes += _params_agree(records)
    merged["nonfinite_origins"] = [
        {**o, "rank": r.get("rank", i)}
        for i, r in enumerate(records)
        for o in r.get("nonfinite_origins") or []
    ]
    return merged, notes


def merge_tensors(lists: Sequence[Sequence[dict[str, Any]]], scale: float = 1.0) -> list[Any]:
    """Each path's statistics over every rank's shard (Chan's update), each part's scaled
    statistics first multiplied by `scale` (a gradient's 1/W)."""
    acc: dict[str, Accumulator] = {}
    for tensors in lists:
        for d in tensors:
            t = tensor_stats(d, scale)
            a = acc.get(t.path)
            if a is None:
                a = acc[t.path] = Accumulator(t.path, t.dtype, t.shape[1:])
            a.add(t)
    return [_plain(a.stats()) for a in acc.values()]


def tensor_stats(d: dict[str, Any], scale: float = 1.0) -> TensorStats:
    """A log's tensor entry as TensorStats, its scaled statistics times `scale`."""
    values: dict[str, float | None] = {k: d.get(k) for k in _STATS}
    if scale != 1.0:
        for k in _SCALED:
            v = values[k]
            values[k] = None if v is None else v * scale
    return TensorStats(
        path=d["path"],
        shape=tuple(d["shape"]),
        dtype=d.get("dtype") or "",
        numel=d["numel"],
        nan=d.get("nan") or 0,
        inf=d.get("inf") or 0,
        note=d.get("note"),
        layout=d.get("layout"),
        mean=values["mean"],
        std=values["std"],
        min=values["min"],
        max=values["max"],
        zeros=values["zeros"],
        norm=values["norm"],
    )


def _plain(t: TensorStats) -> dict[str, Any]:
    """As a log line holds it (a JSON list for the shape; no values or histogram)."""
    out = dataclasses.asdict(t)
    out["shape"] = list(t.shape)
    out.pop("values", None)
    out.pop("hist", None)
    return out


def _params_agree(records: Sequence[dict[str, Any]]) -> list[str]:
    """DDP all-reduces gradients, so every rank steps the same weights: a parameter whose norm,
    gradient norm or update differs beyond PARAM_RTOL is worth a note (one per step)."""
    step = records[0]["step"]
    base = {p["name"]: p for p in records[0]["params"]}
    for i, r in enumerate(records[1:], 1):
        rank = r.get("rank", i)
        for p in r["params"]:
            q = base.get(p["name"])
            if q is None:
                return [f"step {step}: rank {rank} has parameter {p['name']}, rank 0 has not"]
            q_grad, p_grad = q.get("grad") or {}, p.get("grad") or {}
            for what, a, b in (
                ("norm", q.get("norm"), p.get("norm")),
                ("gradient norm", q_grad.get("norm"), p_grad.get("norm")),
                ("update norm", q.get("update_norm"), p.get("update_norm")),
            ):
                if not _close(a, b):
                    return [
                        f"step {step}: ranks disagree on {p['name']}'s {what} (rank 0 "
                        f"{_g(a)}, rank {rank} {_g(b)}): not one DistributedDataParallel "
                        "model? parameters are rank 0's"
                    ]
    return []


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= PARAM_RTOL * max(abs(a), abs(b)) + 1e-30


def _g(v: float | None) -> str:
    return "null" if v is None else f"{v:.6g}"


# ---------------------------------------------------------------- series over steps

LAYER_METRICS = ("out std", "out mean", "zeros", "nan/inf", "grad norm")
PARAM_METRICS = ("grad norm", "update ratio")
LOSS_METRICS = ("loss",)


@dataclass(slots=True)
class Series:
    """One metric over the watched steps: a value per step (None: absent, or not finite) and
    whether NaN/Inf was there at that step."""

    metric: str
    values: list[float | None]
    bad: list[bool]


@dataclass(slots=True)
class Track:
    """The series of one layer call, one parameter, or the loss."""

    kind: str  # "layer" | "param" | "loss"
    name: str
    type: str | None
    call: int | None
    series: list[Series]

    @property
    def bad_steps(self) -> list[int]:
        """Indices of the steps where any of its series held NaN/Inf."""
        n = len(self.series[0].bad) if self.series else 0
        return [i for i in range(n) if any(s.bad[i] for s in self.series)]


@dataclass(slots=True)
class RunSeries:
    """What `hookcli report run.jsonl` shows: every track over the watched steps."""

    files: list[str]
    ranks: int
    world_size: int
    steps: list[int]
    layers: list[Track]
    params: list[Track]
    loss: Track
    events: list[dict[str, Any]]
    notes: list[str]

    @property
    def tracks(self) -> list[Track]:
        return [*self.layers, *self.params, self.loss]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: each track's series as value lists (null: absent or not finite)
        and the steps where it held NaN/Inf."""

        def track(t: Track) -> dict[str, Any]:
            out: dict[str, Any] = {"name": t.name}
            if t.kind == "layer":
                out.update(type=t.type, call=t.call)
            out["series"] = {s.metric: s.values for s in t.series}
            out["nonfinite_steps"] = [self.steps[i] for i in t.bad_steps]
            return out

        return {
            "schema": RUN_SCHEMA,
            "command": "report",
            "run": run_header(self.files, self.ranks, self.world_size, self.steps, self.notes),
            "loss": track(self.loss),
            "layers": [track(t) for t in self.layers],
            "params": [track(t) for t in self.params],
            "nonfinite_events": self.events,
        }


def run_header(
    files: Sequence[str], ranks: int, world_size: int, steps: Sequence[int], notes: Sequence[str]
) -> dict[str, Any]:
    return {
        "files": list(files),
        "merged_ranks": ranks,
        "world_size": world_size,
        "steps": list(steps),
        "notes": list(notes),
    }


def _bad(t: dict[str, Any] | None) -> bool:
    return t is not None and bool(t.get("nan") or t.get("inf"))


def series(run: Run) -> RunSeries:
    """Per layer call: its first output's std, mean and zero fraction, NaN+Inf over its
    outputs, its first output gradient's norm; per parameter: gradient norm and update
    ratio; and the loss — one value per watched step."""
    n = len(run.steps)
    layer_at: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    types: dict[tuple[str, int], str] = {}
    param_at: dict[str, dict[int, dict[str, Any]]] = {}
    for i, s in enumerate(run.steps):
        for c in s["layers"]:
            key = (c["name"], c["call"])
            layer_at.setdefault(key, {})[i] = c
            types.setdefault(key, c["type"])
        for p in s["params"]:
            param_at.setdefault(p["name"], {})[i] = p
    layers = []
    for key, at in layer_at.items():
        cols: dict[str, Series] = {m: Series(m, [None] * n, [False] * n) for m in LAYER_METRICS}
        for i, c in at.items():
            out = (c.get("outputs") or [None])[0]
            grad = (c.get("grad_outputs") or [None])[0]
            outs_bad = any(_bad(t) for t in c.get("outputs") or [])
            grad_bad = any(_bad(t) for t in c.get("grad_outputs") or [])
            for metric, stat in (("out std", "std"), ("out mean", "mean"), ("zeros", "zeros")):
                cols[metric].values[i] = None if out is None else out.get(stat)
                cols[metric].bad[i] = outs_bad
            count = sum((t.get("nan") or 0) + (t.get("inf") or 0) for t in c.get("outputs") or [])
            cols["nan/inf"].values[i] = float(count)
            cols["nan/inf"].bad[i] = outs_bad
            cols["grad norm"].values[i] = None if grad is None else grad.get("norm")
            cols["grad norm"].bad[i] = grad_bad
        layers.append(Track("layer", key[0], types[key], key[1], list(cols.values())))
    params = []
    for name, at in param_at.items():
        grad_norm = Series("grad norm", [None] * n, [False] * n)
        ratio = Series("update ratio", [None] * n, [False] * n)
        for i, p in at.items():
            g = p.get("grad")
            grad_norm.values[i] = None if g is None else g.get("norm")
            grad_norm.bad[i] = _bad(g)
            ratio.values[i] = p.get("update_ratio")
        params.append(Track("param", name, None, None, [grad_norm, ratio]))
    loss = Series("loss", [s.get("loss") for s in run.steps], _loss_bad(run))
    return RunSeries(
        run.files,
        run.ranks,
        run.world_size,
        run.step_numbers,
        layers,
        params,
        Track("loss", "loss", None, None, [loss]),
        run.events,
        run.notes,
    )


def _loss_bad(run: Run) -> list[bool]:
    """The steps whose loss was not finite: the recorder marked it (`loss_nonfinite`), a
    non-finite event said so, or (logs without the mark) the loss is null
    where other steps logged one (the log writes NaN/Inf as null)."""
    said = {e["step"] for e in run.events if "loss" in (e.get("found") or [])}
    logged = any(s.get("loss") is not None for s in run.steps)
    return [
        bool(s.get("loss_nonfinite")) or s["step"] in said or (logged and s.get("loss") is None)
        for s in run.steps
    ]


# ---------------------------------------------------------------- rules over a run


@dataclass(slots=True)
class StepFailure(Failure):
    """A failure in a run: the Failure fields plus the watched step where it was (for rules
    over several steps, the first) and the rank whose log said so (None: the merged run)."""

    step: int | None = None
    rank: int | None = None
    steps: int | None = None  # how many watched steps broke the rule for this entry


@dataclass(slots=True)
class RunRules:
    """The rules over a run, validated (parse_run_rules)."""

    fail_on: list[str] = field(default_factory=list)
    dead_frac: float = RuleOptions().dead_frac
    dead_after: int = 0
    min_std: float | None = None
    grad_norm: tuple[float | None, float | None] | None = None
    update_ratio: tuple[float | None, float | None] | None = None

    @property
    def any(self) -> bool:
        return bool(
            self.fail_on
            or self.min_std is not None
            or self.grad_norm is not None
            or self.update_ratio is not None
        )


def parse_run_rules(
    options: RuleOptions = RuleOptions(),
    *,
    dead_after: int | None = None,
    min_grad_norm: float | None = None,
    max_grad_norm: float | None = None,
    min_update_ratio: float | None = None,
    max_update_ratio: float | None = None,
) -> RunRules:
    """check's rules for a run log: --fail-on, --dead-frac, --min-std and --grad-norm as for a
    model (checks.parse_rules validates them), and the run's own bounds. No rule at all:
    --fail-on nonfinite; --dead-after implies --fail-on dead."""
    base = parse_rules(options)
    rules = RunRules(fail_on=list(base.fail_on), dead_frac=base.dead_frac, min_std=base.min_std)
    if dead_after is not None:
        if isinstance(dead_after, bool) or not isinstance(dead_after, int) or dead_after < 0:
            raise UsageError(
                f"--dead-after must be a step number, 0 or more, got {dead_after!r}.",
                "e.g. --dead-after 100",
            )
        rules.dead_after = dead_after
        if "dead" not in rules.fail_on:
            rules.fail_on.append("dead")
    grads = _bounds(min_grad_norm, max_grad_norm, "grad-norm", "1e-8", "1e3")
    if grads is not None and base.grad_norm is not None:
        raise UsageError(
            "--grad-norm and --min-grad-norm/--max-grad-norm set the same bounds.",
            "give one: --grad-norm 1e-8:1e3, or --min-grad-norm 1e-8 --max-grad-norm 1e3.",
        )
    rules.grad_norm = grads if grads is not None else base.grad_norm
    rules.update_ratio = _bounds(min_update_ratio, max_update_ratio, "update-ratio", "1e-6", "1e-2")
    if not rules.any:
        rules.fail_on = ["nonfinite"]
    return rules


def _bounds(
    lo: float | None, hi: float | None, name: str, lo_eg: str, hi_eg: str
) -> tuple[float | None, float | None] | None:
    example = f"--min-{name} {lo_eg} --max-{name} {hi_eg}"
    if lo is not None:
        lo = bounds.number(lo, f"--min-{name}", low=0, example=example)
    if hi is not None:
        hi = bounds.number(hi, f"--max-{name}", low=0, infinite=True, example=example)
    if lo is None and hi is None:
        return None
    if lo is not None and hi is not None and lo > hi:
        raise UsageError(
            f"--min-{name} {lo:g} is above --max-{name} {hi:g}: an empty range.",
            f"e.g. {example}",
        )
    return lo, hi


def evaluate_run(run: Run, rules: RunRules) -> list[CheckResult]:
    """Each rule's verdict over every watched step. A log whose steps hold no layer and no
    parameter statistics is refused: every rule would pass on nothing (issue 32)."""
    if not any(s["layers"] or s["params"] for s in run.steps):
        files = ", ".join(run.files[:3]) + (" …" if len(run.files) > 3 else "")
        raise UsageError(
            f"{files}: {len(run.steps)} watched steps, but none holds a layer's or a "
            "parameter's statistics: there is nothing to check.",
            "watch layers that run (hookcli.watch(model, layers=...) or the default, every "
            "leaf) and parameters that get gradients, then check the new log.",
        )
    results = []
    if "nonfinite" in rules.fail_on:
        results.append(_nonfinite(run))
    if "dead" in rules.fail_on:
        results.append(_dead(run, rules.dead_frac, rules.dead_after))
    if rules.min_std is not None:
        results.append(_collapse(run, rules.min_std))
    if rules.grad_norm is not None:
        results.append(_grad_norm(run, *rules.grad_norm))
    if rules.update_ratio is not None:
        results.append(_update_ratio(run, *rules.update_ratio))
    return results


def _span(lo: float | None, hi: float | None) -> str:
    return f"[{'' if lo is None else f'{lo:g}'}, {'' if hi is None else f'{hi:g}'}]"


def _counts(t: dict[str, Any]) -> str:
    return ", ".join(f"{t.get(k)} {w}" for k, w in (("nan", "NaN"), ("inf", "Inf")) if t.get(k))


def _tensors(step: dict[str, Any]) -> Iterator[tuple[str | None, int | None, str, dict[str, Any]]]:
    """Every tensor entry of a step record: (layer, call, what, stats); parameters' gradients
    with layer None."""
    for c in step["layers"]:
        for kind, prefix in (
            ("inputs", ""),
            ("outputs", ""),
            ("grad_inputs", "grad_input "),
            ("grad_outputs", "grad_output "),
        ):
            for t in c.get(kind) or []:
                yield c["name"], c["call"], f"{prefix}{t['path']}", t
    for p in step["params"]:
        if p.get("grad") is not None:
            yield None, None, f"{p['name']}.grad", p["grad"]


def _origin_text(o: dict[str, Any]) -> str:
    names = {f.name for f in dataclasses.fields(Origin)}
    try:
        text = Origin(**{k: v for k, v in o.items() if k in names}).describe()
    except TypeError:  # a field missing: validated lines have the ones describe() needs
        text = f"{o.get('direction')}: {o.get('layer')} call {o.get('call')}"
    return f"rank {o['rank']}: {text}" if o.get("rank") is not None else text


def _nonfinite(run: Run) -> CheckResult:
    """NaN/Inf anywhere: a non-finite event, any statistic's NaN/Inf count, a non-finite loss.
    One failure per step (the step's first origin named), the earliest first. On a step
    GradScaler skipped, NaN/Inf in gradients is its overflow, handled: not a failure."""
    bad: list[StepFailure] = []
    checked = 0
    loss_bad = _loss_bad(run)
    events: dict[int, list[dict[str, Any]]] = {}
    for e in run.events:
        events.setdefault(e["step"], []).append(e)
    skipped_overflow = []
    seen_steps = set()
    for i, s in enumerate(run.steps):
        step = s["step"]
        seen_steps.add(step)
        skipped = bool(s.get("skipped"))
        tensors = list(_tensors(s))
        checked += len(tensors)
        hits = [x for x in tensors if _bad(x[3]) and not (skipped and _is_grad(x[2]))]
        excused = skipped and any(_bad(x[3]) for x in tensors if _is_grad(x[2]))
        if excused:
            skipped_overflow.append(step)
        step_events = [
            e for e in events.get(step, []) if not (skipped and set(e["found"]) <= {"grad"})
        ]
        if not hits and not loss_bad[i] and not step_events:
            continue
        step_origins = [*(s.get("nonfinite_origins") or [])]
        step_origins += [o for e in step_events for o in e.get("origins") or []]
        layer, call, path = None, None, None
        first = _origin_text(step_origins[0]) if step_origins else ""
        if step_origins:
            o = step_origins[0]
            layer, call, path = o["layer"], o["call"], o["path"]
        if hits:
            what = f"NaN/Inf in {len(hits)} of {len(tensors)} tensors"
            if not step_origins:
                layer, call, path, t = hits[0]
                place = path if layer is None else f"{layer} call {call} {path}"
                first = f"{place}: {_counts(t)}"
        else:
            what = "NaN/Inf"
        found_in = {f for e in step_events for f in e["found"]}
        found_in |= {_found(x[0], x[2]) for x in hits}
        if loss_bad[i]:
            found_in.add("loss")
        found = sorted(found_in)
        if found:
            what += f" (found in: {', '.join(found)})"
        message = f"step {step}: {what}" + (f"; first: {first}" if first else "")
        rank = next((e.get("rank") for e in step_events), None) if run.ranks > 1 else None
        value = sum((x[3].get("nan") or 0) + (x[3].get("inf") or 0) for x in hits)
        bad.append(StepFailure(message, layer, call, path, value, None, step=step, rank=rank))
    for step, step_events in sorted(events.items()):  # events of steps no line was logged for
        if step in seen_steps:
            continue
        e = step_events[0]
        origins = [_origin_text(o) for o in e.get("origins") or []]
        message = f"step {step} (not watched): NaN/Inf in {', '.join(e['found']) or 'the run'}"
        message += f"; first: {origins[0]}" if origins else ""
        o = (e.get("origins") or [{}])[0]
        bad.append(
            StepFailure(
                message, o.get("layer"), o.get("call"), o.get("path"),
                None, None, step=step, rank=e.get("rank") if run.ranks > 1 else None,
            )
        )  # fmt: skip
    bad.sort(key=lambda f: f.step if f.step is not None else -1)
    handled = (
        f"; GradScaler skipped step {', '.join(map(str, skipped_overflow))} for its gradient "
        "overflow (handled, not counted)"
        if skipped_overflow
        else ""
    )
    if not bad:
        message = f"no NaN/Inf in {checked} tensors over {len(run.steps)} watched steps{handled}"
        return CheckResult("nonfinite", True, message)
    steps = f"{len(bad)} step{'s' if len(bad) > 1 else ''}"
    message = f"NaN/Inf at {steps}, first {bad[0].message}{handled}"
    return CheckResult("nonfinite", False, message, list(bad), bad[0])


def _found(layer: str | None, what: str) -> str:
    """A tensor entry's kind as a non-finite event names it: output, grad or param."""
    if layer is None:
        return "param"
    return "grad" if _is_grad(what) else "output"


def _is_grad(what: str) -> bool:
    return what.startswith("grad_") or what.endswith(".grad")


def _entries(
    run: Run, kinds: Iterable[str]
) -> dict[tuple[str, int, str], list[tuple[int, dict[str, Any], str]]]:
    """Each (layer, call, path) of the given kinds: (step index, stats, type) per watched step."""
    out: dict[tuple[str, int, str], list[tuple[int, dict[str, Any], str]]] = {}
    for i, s in enumerate(run.steps):
        for c in s["layers"]:
            for kind in kinds:
                for t in c.get(kind) or []:
                    out.setdefault((c["name"], c["call"], t["path"]), []).append((i, t, c["type"]))
    return out


def _run_since(flags: Sequence[bool]) -> int | None:
    """The index from which every flag to the end is set (None: the last is not)."""
    start = None
    for i in range(len(flags) - 1, -1, -1):
        if not flags[i]:
            break
        start = i
    return start


def _dead(run: Run, frac: float, after: int) -> CheckResult:
    """A ReLU-family output whose zero fraction is at least `frac` at every watched step from
    step `after` on (and which ran at one of them at least)."""
    numbers = run.step_numbers
    if numbers[-1] < after:
        raise UsageError(
            f"--dead-after {after}: the log's last watched step is {numbers[-1]}.",
            f"give a step up to {numbers[-1]}.",
        )
    limit = "all zeros" if frac >= 1 else f"at least {frac:.0%} zeros"
    bad: list[StepFailure] = []
    checked = 0
    for (name, call, path), seen in _entries(run, ("outputs",)).items():
        if seen[0][2] not in RELU_FAMILY:
            continue
        late = [(i, t) for i, t, _ in seen if numbers[i] >= after and t.get("zeros") is not None]
        if not late:
            continue
        checked += 1
        if all(t["zeros"] >= frac for _, t in late):
            since = numbers[late[0][0]]
            zeros = min(t["zeros"] for _, t in late)
            text = (
                f"{name} call {call} {path}: {limit} at every watched step from step {since} "
                f"({len(late)} steps; fewest zeros {zeros:.1%})"
            )
            bad.append(
                StepFailure(text, name, call, path, zeros, frac, step=since, steps=len(late))
            )
    where = f"from step {after} on" if after else "at every watched step"
    if not bad:
        return CheckResult(
            "dead", True, f"no ReLU-family output {limit} {where} ({checked} checked)"
        )
    message = f"{len(bad)} of {checked} ReLU-family outputs {limit} {where}"
    if len(bad) > 1:
        message += f"; first in forward: {bad[0].message}"
    return CheckResult("dead", False, message, list(bad), bad[0])


def _collapse(run: Run, limit: float) -> CheckResult:
    """An output whose std (of two or more finite elements) stayed below `limit` from some
    watched step to the end of the run: it collapsed and did not recover."""
    numbers = run.step_numbers
    bad: list[StepFailure] = []
    checked = 0
    for (name, call, path), seen in _entries(run, ("outputs",)).items():
        usable = [(i, t) for i, t, _ in seen if t.get("std") is not None and _finite(t) >= 2]
        if not usable:
            continue
        checked += 1
        start = _run_since([t["std"] < limit for _, t in usable])
        if start is None:
            continue
        since = numbers[usable[start][0]]
        low = usable[start:]
        std = max(t["std"] for _, t in low)
        text = (
            f"{name} call {call} {path}: std below {limit:g} from step {since} to the end "
            f"({len(low)} steps; at most {std:.4g}: collapsed)"
        )
        bad.append(StepFailure(text, name, call, path, std, limit, step=since, steps=len(low)))
    if not bad:
        return CheckResult(
            "min-std", True, f"no output's std stayed below {limit:g} ({checked} checked)"
        )
    bad.sort(key=lambda f: f.step if f.step is not None else 0)  # stable: forward order
    message = f"{len(bad)} of {checked} outputs collapsed (std below {limit:g} to the end)"
    if len(bad) > 1:
        message += f"; first: {bad[0].message}"
    return CheckResult("min-std", False, message, list(bad), bad[0])


def _finite(t: dict[str, Any]) -> int:
    """A tensor entry's finite elements."""
    return int(t["numel"]) - int(t.get("nan") or 0) - int(t.get("inf") or 0)


def _outside(
    seen: Sequence[tuple[int, float | str]],
    lo: float | None,
    hi: float | None,
    *,
    words: tuple[str, str],
) -> list[tuple[int, float | str, str]]:
    """The (step index, value, side) of the values out of [lo, hi], the side named by `words`
    (below, above); Inf is above any bound, NaN is "not finite"."""
    out: list[tuple[int, float | str, str]] = []
    for i, v in seen:
        if v == "Inf":
            out.append((i, v, words[1]))
        elif v == "NaN":
            out.append((i, v, "not finite"))
        elif isinstance(v, float) and lo is not None and v < lo:
            out.append((i, v, words[0]))
        elif isinstance(v, float) and hi is not None and v > hi:
            out.append((i, v, words[1]))
    return out


def _norm_value(t: dict[str, Any]) -> float | str | None:
    """A gradient's norm for a bound: "Inf"/"NaN" when it holds them (its norm is over the
    finite elements only), else its norm (None: empty)."""
    if t.get("inf"):
        return "Inf"
    if t.get("nan"):
        return "NaN"
    norm = t.get("norm")
    return None if norm is None else float(norm)


def _bounded(
    rule: str,
    what: str,
    run: Run,
    *,
    entries: dict[tuple[str | None, int | None, str], list[tuple[int, float | str]]],
    lo: float | None,
    hi: float | None,
    low_word: str,
    high_word: str,
) -> CheckResult:
    """One failure per entry (layer call and tensor, or parameter) out of [lo, hi] at any
    watched step: the first such step, how many, and the worst value."""
    numbers = run.step_numbers
    span = _span(lo, hi)
    bad: list[StepFailure] = []
    for (layer, call, path), seen in entries.items():
        out = _outside(seen, lo, hi, words=(low_word, high_word))
        if not out:
            continue
        i, value, side = out[0]
        floats = [v for _, v, _ in out if isinstance(v, float)]
        worst: float | str = value
        if not isinstance(value, str) and floats:
            low_side = side == low_word
            worst = min(floats) if low_side else max(floats)
        place = path if layer is None else f"{layer} call {call} {path}"
        shown = worst if isinstance(worst, str) else f"{worst:.4g}"
        reach = "" if isinstance(worst, str) else "down to " if side == low_word else "up to "
        text = (
            f"{place}: {what} {reach}{shown} ({side}) at {len(out)} of {len(seen)} watched "
            f"steps, first step {numbers[i]}"
        )
        limit = hi if side == high_word else lo if side == low_word else None
        bad.append(
            StepFailure(text, layer, call, path, worst, limit, step=numbers[i], steps=len(out))
        )
    checked = len(entries)
    if not bad:
        return CheckResult(rule, True, f"every {what} within {span} ({checked} checked)")
    bad.sort(key=lambda f: f.step if f.step is not None else 0)
    message = f"{len(bad)} of {checked} {what}s outside {span}"
    if len(bad) > 1:
        message += f"; first: {bad[0].message}"
    return CheckResult(rule, False, message, list(bad), bad[0])


def _grad_norm(run: Run, lo: float | None, hi: float | None) -> CheckResult:
    """Each layer call's output-gradient norm and each parameter's gradient norm, over the
    steps GradScaler did not skip."""
    entries: dict[tuple[str | None, int | None, str], list[tuple[int, float | str]]] = {}
    for i, s in enumerate(run.steps):
        if s.get("skipped"):
            continue
        for c in s["layers"]:
            for g in c.get("grad_outputs") or []:
                v = _norm_value(g)
                if v is not None:
                    entries.setdefault((c["name"], c["call"], f"grad_output {g['path']}"), [])
                    entries[(c["name"], c["call"], f"grad_output {g['path']}")].append((i, v))
        for p in s["params"]:
            v = None if p.get("grad") is None else _norm_value(p["grad"])
            if v is not None:
                entries.setdefault((None, None, f"{p['name']}.grad"), []).append((i, v))
    return _bounded(
        "grad-norm", "gradient norm", run, entries=entries, lo=lo, hi=hi,
        low_word="vanishing", high_word="exploding",
    )  # fmt: skip


def _update_ratio(run: Run, lo: float | None, hi: float | None) -> CheckResult:
    """Each parameter's update/weight ratio ‖Δw‖/‖w‖, over the steps GradScaler did not skip
    and where it had a gradient (a parameter with none is not updated by design)."""
    entries: dict[tuple[str | None, int | None, str], list[tuple[int, float | str]]] = {}
    for i, s in enumerate(run.steps):
        if s.get("skipped"):
            continue
        for p in s["params"]:
            ratio = p.get("update_ratio")
            if ratio is None or p.get("grad") is None:
                continue
            entries.setdefault((None, None, p["name"]), []).append((i, float(ratio)))
    return _bounded(
        "update-ratio", "update ratio", run, entries=entries, lo=lo, hi=hi,
        low_word="too small", high_word="too large",
    )  # fmt: skip


def checks_json(run: Run, results: Sequence[CheckResult]) -> dict[str, Any]:
    """`hookcli check run.jsonl -f json`: the run, each rule's verdict and failures (each with
    its step), and the non-finite events."""
    return {
        "schema": RUN_SCHEMA,
        "command": "check",
        "run": run_header(run.files, run.ranks, run.world_size, run.step_numbers, run.notes),
        "checks": [dataclasses.asdict(c) for c in results],
        "nonfinite_events": run.events,
    }


def run_lines(run: Run | RunSeries) -> list[str]:
    """The header a run's table starts with: its files, steps and ranks."""
    numbers = run.step_numbers if isinstance(run, Run) else run.steps
    names = ", ".join(Path(f).name for f in run.files)
    shown = ", ".join(map(str, numbers[:8])) + (", …" if len(numbers) > 8 else "")
    lines = [f"{names}: {len(numbers)} watched steps ({shown})"]
    if run.ranks > 1:
        lines.append(
            f"{run.ranks} rank logs merged: one process over the whole batch (activation "
            f"gradients scaled by 1/{run.ranks}, parameters rank 0's, loss the ranks' mean)"
        )
    return lines


# ---------------------------------------------------------------- saved JSON reports


def saved_report(path: str | Path) -> Report:
    """A JSON report (`inspect -f json -o FILE`) as the Report it was written from, for the
    renderers: io.reportfile validates what every reader needs, and each further field is
    checked against its record's type here (a field of the wrong type is an error, exit 2;
    one this version does not know is ignored)."""
    from hookcli.io.reportfile import load_report

    record = f"write one: hookcli inspect MODEL … -f json -o {path}"
    data = load_report(path, "report", record)
    try:
        report = _record(Report, data, "")
    except _Bad as exc:
        raise UsageError(
            f"report {escape(str(path))} is not a hookcli JSON report: {exc}.", escape(record)
        ) from None
    assert isinstance(report, Report)
    return report


def _record(cls: type[Any], data: Any, where: str) -> Any:
    """data (parsed JSON) as an instance of the record dataclass cls, field by field."""
    if cls is Failure and isinstance(data, str):  # schema 1: a failure was its line
        return Failure(data)
    if not isinstance(data, dict):
        raise _Bad(f"{where or 'the top level'} is {_type(data)}, not an object")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            no_default = (
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            )
            if no_default:
                raise _Bad(f"{where or 'the report'} has no {f.name!r}")
            continue
        values[f.name] = _value(hints[f.name], data[f.name], f"{where}.{f.name}".lstrip("."))
    return cls(**values)


def _value(hint: Any, value: Any, where: str) -> Any:
    """value as the type hint says: records, lists, tuples, dicts, optional and plain values."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:
            try:
                return _value(option, value, where)
            except _Bad:
                continue
        raise _Bad(f"{where} is {_type(value)}, not {_names(options)}")
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _record(hint, value, where)
    if origin in (list, tuple, dict):
        return _container(origin, args, value, where)
    return _scalar(hint, value, where)


def _container(origin: Any, args: tuple[Any, ...], value: Any, where: str) -> Any:
    """A list, a tuple (a JSON list) or a dict of hinted values."""
    if origin is dict:
        if not isinstance(value, dict):
            raise _Bad(f"{where} is {_type(value)}, not an object")
        return {str(k): _value(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if not isinstance(value, list):
        raise _Bad(f"{where} is {_type(value)}, not a list")
    items = [_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _scalar(hint: Any, value: Any, where: str) -> Any:
    """A plain JSON value of the hinted type (bool, int, float, str, Any)."""
    if hint is Any:
        return value
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif hint is str:
        ok = isinstance(value, str)
    else:
        raise _Bad(f"{where} has a type this version cannot read")
    if not ok:
        raise _Bad(f"{where} is {_type(value)}, not {_names([hint])}")
    return value


def _names(hints: Sequence[Any]) -> str:
    plain = {bool: "true or false", int: "a number", float: "a number", str: "a string"}
    return " or ".join(
        dict.fromkeys(
            plain.get(h, "an object" if dataclasses.is_dataclass(h) else "a list") for h in hints
        )
    )
