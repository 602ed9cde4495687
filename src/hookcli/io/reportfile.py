"""One loader for saved JSON reports (`check --baseline FILE`, `hookcli diff a.json b.json`,
`hookcli report FILE.json`): bounded, parsed safely and validated field by field before anything
reads it; `saved_report` reads one back as the Report it was written from.

A report is refused — exit 2, one line naming the file and what is wrong — when it is larger
than MAX_BYTES (checked before reading), does not start with `{`, is not UTF-8 JSON, nests
deeper than Python's parser can follow, holds NaN/Infinity, has another schema, or any
field that is read has the wrong type or is missing: `model` (spec, name, task, weights,
params), `input` (description, shapes), and every layer call (`name`, `type`, `call`,
`inputs`, `outputs`, the gradient lists, `params`) with every tensor entry (`path`, `shape`,
`numel`, the statistics as numbers or null, `nan`/`inf` as counts). A report with no tensor
statistics at all is refused too: comparing against it could never fail.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NoReturn

from hookcli.errors import UsageError
from hookcli.io.recordjson import RecordError, from_json, json_type
from hookcli.records import READABLE_SCHEMAS, SCHEMA_VERSION, TENSOR_STATS, Report
from hookcli.text import escape

MAX_BYTES = 256 * 2**20  # a resnet50 report is ~1 MB; a 10k-call one ~30 MB
_HEAD = 4096  # bytes read to find the first non-blank character
# a tensor's declared statistics (records.TensorStats): numbers or null, and counts
_STATS = tuple(s.name for s in TENSOR_STATS if not s.count)
_COUNTS = tuple(s.name for s in TENSOR_STATS if s.count)
_TENSOR_LISTS = ("inputs", "outputs", "grad_inputs", "grad_outputs")


class _Bad(Exception):
    """What is wrong with the report, as a phrase."""


def load_report(path: str | Path, role: str, record: str) -> dict[str, Any]:
    """The validated report at path. `role` names it in messages ("baseline", "report");
    `record` is the hint's command that writes a good one."""
    p = Path(path)
    record = escape(record)  # it may name the file too
    label = f"{role} {escape(str(p))}" if role else escape(str(p))

    def refuse(what: str) -> NoReturn:
        raise UsageError(f"{label} is not a hookcli JSON report: {what}.", record)

    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_BYTES:
                refuse(
                    f"it is {size / 2**20:.0f} MB, and reports are read only up to "
                    f"{MAX_BYTES // 2**20} MB"
                )
            head = f.read(_HEAD)
            first = head.lstrip(b" \t\r\n")[:1]
            if first != b"{":
                what = "it is empty" if not head.strip() else "it does not start with '{'"
                refuse(f"{what} (a JSON report is one object)")
            raw = head + f.read(MAX_BYTES + 1 - len(head))
    except FileNotFoundError:
        raise UsageError(f"{label} not found.", record) from None
    except IsADirectoryError:
        refuse("it is a folder")
    except OSError as exc:
        raise UsageError(f"cannot read {label}: {exc.strerror or exc}.", record) from None
    if len(raw) > MAX_BYTES:  # grew while being read
        refuse(f"it is over {MAX_BYTES // 2**20} MB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        refuse(f"not UTF-8 text (byte {exc.start})")
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        refuse("its JSON nests too deeply")
    except ValueError as exc:  # json.JSONDecodeError, and NaN/Infinity
        refuse(f"not readable JSON: {escape(str(exc))}")
    try:
        _validate(data)
    except _Bad as exc:
        refuse(str(exc))
    if data["schema"] not in READABLE_SCHEMAS:
        raise UsageError(
            f"{label} has schema {data['schema']}; this hookcli writes schema "
            f"{SCHEMA_VERSION} and reads {' and '.join(map(str, READABLE_SCHEMAS))}.",
            f"record it again with this version: {record}",
        )
    return data  # type: ignore[no-any-return]


def saved_report(path: str | Path) -> Report:
    """A JSON report (`inspect -f json -o FILE`) as the Report it was written from, for the
    renderers: io.reportfile validates what every reader needs, and each further field is
    checked against its record's type here (a field of the wrong type is an error, exit 2;
    one this version does not know is ignored)."""
    name = Path(path)
    suggested = name.with_suffix(".json") if name.name not in ("", ".", "..") else "report.json"
    record = f"write one: hookcli inspect MODEL … -o {suggested}"
    data = load_report(path, "report", record)
    try:
        report = from_json(Report, data)
    except RecordError as exc:
        raise UsageError(
            f"report {escape(str(path))} is not a hookcli JSON report: {exc}.", escape(record)
        ) from None
    assert isinstance(report, Report)
    return report


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a number in a report (hookcli writes null)")


# ---------------------------------------------------------------- the schema


def _get(obj: dict[str, Any], key: str, where: str, *, optional: bool = False) -> Any:
    if key not in obj:
        if optional:
            return None
        raise _Bad(f"{where} has no {key!r}")
    return obj[key]


def _str(obj: dict[str, Any], key: str, where: str, *, optional: bool = False) -> None:
    v = _get(obj, key, where, optional=optional)
    if not isinstance(v, str) and not (optional and v is None):
        raise _Bad(f"{where}.{key} is {json_type(v)}, not a string")


def _int(obj: dict[str, Any], key: str, where: str, *, optional: bool = False) -> None:
    v = _get(obj, key, where, optional=optional)
    if optional and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _Bad(f"{where}.{key} is {json_type(v) if not isinstance(v, int) else v}, not a count")


def _num(obj: dict[str, Any], key: str, where: str) -> None:
    v = obj.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _Bad(f"{where}.{key} is {json_type(v)}, not a number or null")
    try:
        float(v)
    except OverflowError:
        raise _Bad(f"{where}.{key} is beyond the range of a float") from None


def _list(obj: dict[str, Any], key: str, where: str, *, nullable: bool = False) -> list[Any]:
    v = _get(obj, key, where, optional=nullable)
    if v is None and nullable:
        return []
    if not isinstance(v, list):
        raise _Bad(f"{where}.{key} is {json_type(v)}, not a list")
    return v


def _dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Bad(f"{where} is {json_type(value)}, not an object")
    return value


def _shape(obj: dict[str, Any], where: str) -> None:
    v = _get(obj, "shape", where)
    if not isinstance(v, list) or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in v
    ):
        raise _Bad(f"{where}.shape is not a list of sizes")


def _tensor(value: Any, where: str) -> None:
    t = _dict(value, where)
    _str(t, "path", where)
    _shape(t, where)
    _int(t, "numel", where)
    _str(t, "dtype", where, optional=True)
    for key in _STATS:
        _num(t, key, where)
    for key in _COUNTS:
        _int(t, key, where, optional=True)


def _validate(data: Any) -> None:
    report = _dict(data, "the top level")
    if "calls" in report and "layers" not in report:
        raise _Bad("it is a diff report (compare inspect/grads/check reports)")
    schema = _get(report, "schema", "the report")
    if isinstance(schema, bool) or not isinstance(schema, int):
        raise _Bad(f"its schema is {json_type(schema)}, not a number")
    if schema not in READABLE_SCHEMAS:
        return  # the caller names the schema mismatch, whatever the rest looks like
    model = _dict(_get(report, "model", "the report"), "model")
    for key in ("spec", "name", "task", "weights"):
        _str(model, key, "model")
    _int(model, "params", "model")
    inp = _dict(_get(report, "input", "the report"), "input")
    _str(inp, "description", "input")
    shapes = _list(inp, "shapes", "input")
    for i, s in enumerate(shapes):
        _shape({"shape": s}, f"input.shapes[{i}]")
    _str(report, "device", "the report", optional=True)
    layers = _list(report, "layers", "the report")
    tensors = 0
    for i, raw in enumerate(layers):
        where = f"layers[{i}]"
        c = _dict(raw, where)
        _str(c, "name", where)
        _str(c, "type", where)
        _int(c, "call", where)
        for kind in _TENSOR_LISTS:
            entries = _list(c, kind, where, nullable=kind.startswith("grad_"))
            for j, t in enumerate(entries):
                _tensor(t, f"{where}.{kind}[{j}]")
            tensors += len(entries)
        for j, raw_p in enumerate(_list(c, "params", where, nullable=True)):
            pw = f"{where}.params[{j}]"
            param = _dict(raw_p, pw)
            _str(param, "name", pw)
            grad = param.get("grad")
            if grad is not None:
                _tensor(grad, f"{pw}.grad")
                tensors += 1
    if not layers:
        raise _Bad('"layers" is empty: there is nothing to compare against')
    if tensors == 0:
        raise _Bad("no layer call records a tensor: there is nothing to compare against")
