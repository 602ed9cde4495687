"""Records (the dataclasses of hookcli.records) read back from parsed JSON, checked against their
type hints field by field: one reader for every file hookcli writes and reads. A field of the
wrong type is a RecordError naming it; a field this version does not know is ignored; a field
with a default may be absent (an older file). No torch.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any

from hookcli.records import Failure


class RecordError(Exception):
    """What is wrong with the data, and where (`layers[3].outputs[0].mean is a string, …`)."""


_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    """A record class's resolved type hints (resolving them costs more than reading a record)."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def json_type(value: Any) -> str:
    """A parsed JSON value's kind, for messages: "null", "a boolean", "a number", …"""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int | float):
        return "a number"
    return "a list" if isinstance(value, list) else "an object"


def from_json(cls: type[Any], data: Any, where: str = "") -> Any:
    """data (parsed JSON) as an instance of the record dataclass cls, field by field."""
    if cls is Failure and isinstance(data, str):  # schema 1: a failure was its line
        return Failure(data)
    if not isinstance(data, dict):
        raise RecordError(f"{where or 'the top level'} is {json_type(data)}, not an object")
    hints = _hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            no_default = (
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            )
            if no_default:
                raise RecordError(f"{where or 'the report'} has no {f.name!r}")
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
            except RecordError:
                continue
        raise RecordError(f"{where} is {json_type(value)}, not {_names(options)}")
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return from_json(hint, value, where)
    if origin in (list, tuple, dict):
        return _container(origin, args, value, where)
    return _scalar(hint, value, where)


def _container(origin: Any, args: tuple[Any, ...], value: Any, where: str) -> Any:
    """A list, a tuple (a JSON list) or a dict of hinted values."""
    if origin is dict:
        if not isinstance(value, dict):
            raise RecordError(f"{where} is {json_type(value)}, not an object")
        return {str(k): _value(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if not isinstance(value, list):
        raise RecordError(f"{where} is {json_type(value)}, not a list")
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
        raise RecordError(f"{where} has a type this version cannot read")
    if not ok:
        raise RecordError(f"{where} is {json_type(value)}, not {_names([hint])}")
    return value


def _names(hints: Sequence[Any]) -> str:
    plain = {bool: "true or false", int: "a number", float: "a number", str: "a string"}
    return " or ".join(
        dict.fromkeys(
            plain.get(h, "an object" if dataclasses.is_dataclass(h) else "a list") for h in hints
        )
    )
