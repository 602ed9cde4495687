"""One loader for saved JSON reports (`check --baseline FILE`, `hookcli diff a.json b.json`,
`hookcli report FILE.json`): bounded, parsed safely, then read as the Report it was written from
by the one typed reader (io/recordjson.py), every field checked against its record's type.

A report is refused — exit 2, one line naming the file and what is wrong — when it is larger
than MAX_BYTES (checked before reading), does not start with `{`, is not UTF-8 JSON, nests
deeper than Python's parser can follow, holds NaN/Infinity (or a number beyond a float's
range), has another schema, or any field is of the wrong type or missing where the record
requires it: `model` (spec, name, task, weights, params), `input` (description, shapes), and
every layer call (`name`, `type`, `call`, `inputs`, `outputs`, the gradient lists, `params`)
with every tensor entry (`path`, `shape`, `numel`, the statistics as finite numbers or null,
`nan`/`inf` as counts). A field this version does not know is ignored. A report with no tensor
statistics at all is refused too: comparing against it could never fail.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NoReturn

from hookcli.errors import UsageError
from hookcli.io.recordjson import RecordError, from_json, json_type, place
from hookcli.records import READABLE_SCHEMAS, SCHEMA_VERSION, Report
from hookcli.text import escape

MAX_BYTES = 256 * 2**20  # a resnet50 report is ~1 MB; a 10k-call one ~30 MB
_HEAD = 4096  # bytes read to find the first non-blank character


class _Bad(Exception):
    """What is wrong with the report, as a phrase."""


def load_report(path: str | Path, role: str, record: str, *, compared: bool = True) -> Report:
    """The report at path, read and checked. `role` names it in messages ("baseline",
    "report"); `record` is the hint's command that writes a good one; `compared`: it will be
    compared against (then one with no tensor statistics is refused: it could never fail)."""
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
        schema = _schema(data)
    except _Bad as exc:
        refuse(str(exc))
    if schema not in READABLE_SCHEMAS:
        raise UsageError(
            f"{label} has schema {schema}; this hookcli writes schema "
            f"{SCHEMA_VERSION} and reads {' and '.join(map(str, READABLE_SCHEMAS))}.",
            f"record it again with this version: {record}",
        )
    try:
        report = from_json(Report, data)
    except RecordError as exc:
        refuse(escape(_phrase(exc)))  # a mapping's keys are the file's own text
    assert isinstance(report, Report)
    try:
        if compared:
            _something_to_compare(report)
    except _Bad as exc:
        refuse(str(exc))
    return report


def saved_report(path: str | Path) -> Report:
    """A JSON report (`inspect -f json -o FILE`) as the Report it was written from, for the
    renderers (exit 2 naming what is wrong with it)."""
    return load_report(
        path, "report", "write one: hookcli inspect MODEL … -o REPORT.json", compared=False
    )


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a number in a report (hookcli writes null)")


# ---------------------------------------------------------------- what the record cannot say


def _schema(data: Any) -> int:
    """The report's schema, once it is seen to be a report (an object, not a diff's)."""
    if not isinstance(data, dict):
        raise _Bad(f"the top level is {json_type(data)}, not an object")
    if "calls" in data and "layers" not in data:
        raise _Bad("it is a diff report (compare inspect/grads/check reports)")
    if "schema" not in data:  # (lens, layers and attn write JSON of their own)
        raise _Bad("it has no 'schema' (the JSON of inspect, grads and check has one)")
    schema = data["schema"]
    if isinstance(schema, bool) or not isinstance(schema, int):
        raise _Bad(f"its schema is {json_type(schema)}, not a number")
    return schema


def _something_to_compare(report: Report) -> None:
    if not report.layers:
        raise _Bad('"layers" is empty: there is nothing to compare against')
    for c in report.layers:
        if c.inputs or c.outputs or c.grad_inputs or c.grad_outputs:
            return
        if any(p.grad is not None for p in c.params or ()):
            return
    raise _Bad("no layer call records a tensor: there is nothing to compare against")


def _phrase(exc: RecordError) -> str:
    """The reader's mismatch in a report's words: a size or count that is not one, a number
    beyond a float's range, null named where it would have done."""
    path = exc.path
    if exc.missing is not None or not exc.expected:
        return str(exc)
    v = exc.value
    if exc.expected.endswith(">= 0"):  # LEAST: a count, or a size in a shape
        sizes = [i for i, part in enumerate(path) if part in ("shape", "shapes")]
        if sizes:
            end = sizes[-1] + (2 if path[sizes[-1]] == "shapes" else 1)
            return f"{_place(path[:end])} is not a list of sizes"
        found = v if isinstance(v, int) and not isinstance(v, bool) else json_type(v)
        return f"{_place(path)} is {found}, not a count"
    if exc.expected == "a finite number":  # FINITE
        if isinstance(v, int):
            return f"{_place(path)} is beyond the range of a float"
        return f"{_place(path)} is infinite, not a finite number or null"
    return f"{exc}{' or null' if exc.nullable else ''}"


def _place(path: tuple[str | int, ...]) -> str:
    return place("", path) or "the report"
