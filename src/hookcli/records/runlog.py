"""A `hookcli.watch` run log's lines (StepLine, NonfiniteLine) and how one is written."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hookcli.records.core import LOG_SCHEMA, CallMemory, Memory, Origin, TensorStats
from hookcli.records.meta import ABSENT, FINITE, LEAST, LENIENT, NULL_IS_ABSENT

# Read back by io/recordjson.py: a count or step is >= 0 (LEAST), a number finite (FINITE),
# what a line may leave out
# reads as null (ABSENT), a null list as none (NULL_IS_ABSENT: older lines), watch(memory=True)'s
# numbers as null when not well formed (LENIENT: no rule checks them).
_NONE_IF_NULL: dict[str, Any] = {NULL_IS_ABSENT: True}


@dataclass(slots=True)
class LoggedCall:
    """One layer call of a watched step, as its log line holds it (no element values or
    histograms). A gradient list is None when the call's tensors had no gradient."""

    name: str
    type: str
    call: int = field(metadata={LEAST: 0})
    inputs: list[TensorStats]
    outputs: list[TensorStats]
    grad_outputs: list[TensorStats] | None = None
    grad_inputs: list[TensorStats] | None = None
    error: str | None = None
    memory: CallMemory | None = field(default=None, metadata={LENIENT: True})  # watch(memory=True)


@dataclass(slots=True)
class LoggedParam:
    """One parameter of a watched step: its norm before the step, its gradient's statistics,
    and the update the optimizer made (its norm, and that ÷ the parameter's norm)."""

    name: str
    norm: float | None = field(metadata={ABSENT: None, FINITE: True})
    grad: TensorStats | None = field(metadata={ABSENT: None})
    update_norm: float | None = field(metadata={ABSENT: None, FINITE: True})
    update_ratio: float | None = field(metadata={ABSENT: None, FINITE: True})


@dataclass(slots=True)
class StepLine:
    """A watched optimizer step: one line of a hookcli.watch log, and one of `w.records`."""

    step: int = field(metadata={LEAST: 0})
    rank: int = field(metadata={LEAST: 0})
    world_size: int = field(metadata={LEAST: 1})
    loss: float | None = field(metadata={ABSENT: None, FINITE: True})
    layers: list[LoggedCall]
    params: list[LoggedParam]
    nonfinite_origins: list[Origin] = field(default_factory=list, metadata=_NONE_IF_NULL)
    loss_nonfinite: bool = False  # the loss was NaN/Inf (`loss` is null then)
    skipped: bool | None = None  # with a GradScaler: it skipped this step (inf gradients)
    scale: float | None = field(default=None, metadata={FINITE: True})  # a GradScaler's scale
    run: str | None = None  # the run's id, as the log writer marks each line
    schema: int = LOG_SCHEMA
    kind: str = "step"
    merged_ranks: int | None = None  # read back: the rank logs merged into it (runmerge)
    memory: Memory | None = field(default=None, metadata={LENIENT: True})  # watch(memory=True)
    # a rank that shares its data with others (tensor parallel): [its data-parallel index,
    # how many indices]; runmerge counts one rank per index. None: every rank its own data
    data_parallel: list[int] | None = field(default=None, metadata={LEAST: 0})


@dataclass(slots=True)
class NonfiniteLine:
    """The first NaN/Inf of a watched run (`w.nonfinite`): what held it, where the hooked
    re-run found it began, and the repro bundle written for `hookcli replay`."""

    step: int = field(metadata={LEAST: 0})
    rank: int = field(metadata={LEAST: 0})
    world_size: int = field(metadata={LEAST: 1})
    found: list[str]
    origins: list[Origin] = field(default_factory=list, metadata=_NONE_IF_NULL)
    nonfinite_params: list[str] = field(default_factory=list, metadata=_NONE_IF_NULL)
    nonfinite_grads: list[str] = field(default_factory=list)
    bundle: str | None = None
    notes: list[str] = field(default_factory=list)
    run: str | None = None
    schema: int = LOG_SCHEMA
    kind: str = "nonfinite"


# a tensor's statistics in a log line: the numbers, no element values or histograms
_LOGGED_STATS = tuple(
    f.name for f in dataclasses.fields(TensorStats) if f.name not in ("values", "hist", "channels")
)
_LINE_FIRST = ("schema", "kind", "step", "rank", "world_size")
# written only when they say something: a step's loss is finite, a run has no GradScaler, a
# step is one process's (not merged from rank logs)
_UNLESS = {
    "loss_nonfinite": False,
    "skipped": None,
    "scale": None,
    "run": None,
    "merged_ranks": None,
    "memory": None,
    "data_parallel": None,
}


def _logged_stats(t: TensorStats) -> dict[str, Any]:
    """Field by field (dataclasses.asdict's deep copy cost resnet18 30 ms a watched step)."""
    out = {name: getattr(t, name) for name in _LOGGED_STATS}
    out["shape"] = list(t.shape)
    if t.per_token is not None:
        out["per_token"] = [dataclasses.asdict(r) for r in t.per_token]
    return out


def _logged_call(c: LoggedCall) -> dict[str, Any]:
    def many(ts: list[TensorStats] | None) -> list[dict[str, Any]] | None:
        return None if ts is None else [_logged_stats(t) for t in ts]

    return {
        "name": c.name,
        "type": c.type,
        "call": c.call,
        "inputs": many(c.inputs),
        "outputs": many(c.outputs),
        "grad_outputs": many(c.grad_outputs),
        "grad_inputs": many(c.grad_inputs),
        "error": c.error,
    } | ({} if c.memory is None else {"memory": dataclasses.asdict(c.memory)})


def log_line(line: StepLine | NonfiniteLine) -> dict[str, Any]:
    """A log line as the JSON object written to disk: schema, kind, step, rank and world size
    first; optional fields only when they say something. `from_json` reads it back."""
    data: dict[str, Any] = {k: getattr(line, k) for k in _LINE_FIRST}
    for f in dataclasses.fields(line):
        if f.name in data:
            continue
        value = getattr(line, f.name)
        # a GradScaler's scale is written, null too, whenever a scaler was given
        scaled = f.name == "scale" and getattr(line, "skipped", None) is not None
        if f.name in _UNLESS and value == _UNLESS[f.name] and not scaled:
            continue
        if f.name == "layers":
            value = [_logged_call(c) for c in value]
        elif f.name == "params":
            value = [
                {
                    "name": p.name,
                    "norm": p.norm,
                    "grad": None if p.grad is None else _logged_stats(p.grad),
                    "update_norm": p.update_norm,
                    "update_ratio": p.update_ratio,
                }
                for p in value
            ]
        elif f.name in ("nonfinite_origins", "origins"):
            value = [dataclasses.asdict(o) for o in value]
        elif f.name == "memory":
            value = dataclasses.asdict(value)
        elif isinstance(value, list):
            value = list(value)
        data[f.name] = value
    return data


_OR_NULL = {NULL_IS_ABSENT: True}  # bundle.json: null, as absent, reads as the default


@dataclass(slots=True)
class BundleInfo:
    """A repro bundle's bundle.json: the step and rank that made NaN/Inf, what held it, the
    origins the recorder's re-run found, the model and device it ran on, the selection it
    watched, and whether the model was pickled and the batch saved. Read back by the one typed
    reader (io/recordjson.py); a field left out or null reads as its default."""

    schema: int
    step: int | None = field(default=None, metadata={LEAST: 0, **_OR_NULL})
    rank: int = field(default=0, metadata={LEAST: 0, **_OR_NULL})
    world_size: int = field(default=1, metadata={LEAST: 1, **_OR_NULL})
    found: list[str] = field(default_factory=list, metadata=_OR_NULL)
    nonfinite_params: list[str] = field(default_factory=list, metadata=_OR_NULL)
    origins: list[Origin] = field(default_factory=list, metadata=_OR_NULL)
    model: str | None = None  # the module's class, module.qualname
    device: str = field(default="cpu", metadata=_OR_NULL)
    layers: list[str] = field(default_factory=list, metadata=_OR_NULL)  # --layer patterns
    types: list[str] = field(default_factory=list, metadata=_OR_NULL)  # --type names
    forwards: int = field(default=0, metadata={LEAST: 0, **_OR_NULL})
    hookcli_version: str = field(default="", metadata=_OR_NULL)
    torch_version: str = field(default="", metadata=_OR_NULL)
    notes: list[str] = field(default_factory=list, metadata=_OR_NULL)
    pickled: bool = field(default=False, metadata=_OR_NULL)  # model.pt holds the module
    replayable: bool = field(default=True, metadata=_OR_NULL)  # batch.pt holds the step's batch
