"""Records (the dataclasses of hookcli.records) read back from parsed JSON, checked against their
type hints field by field: one reader for every file hookcli writes and reads. A field of the
wrong type is a RecordError naming it; a field this version does not know is ignored; a field
with a default may be absent (an older file). No torch.

Each record class's reader is compiled once, the first time it is read: a Python function
written out from the class's fields and resolved type hints (as dataclasses writes `__init__`),
checking and converting every field inline and building the record by position. Reading a
record this way costs about what a hand-written reader does; walking the hints for every value
cost a run log 30 times more. Where a value went wrong is found only when one did: the readers
pass no path down, a mismatch is raised with its own place and each enclosing reader adds its.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from hookcli.records import Failure
from hookcli.records.meta import ABSENT, FINITE, LEAST, LENIENT, NULL_IS_ABSENT, REQUIRED
from hookcli.records.statfields import STAT


class RecordError(Exception):
    """What is wrong with the data, and where (`layers[3].outputs[0].mean is a string, …`).
    The parts too, for a reader that words its own messages (logread): `path` (field names and
    list indices, outermost first), the `value` found, what was `expected` ("a number", "a
    whole number >= 0", …; "" when a field is `missing`, its name then) and whether null would
    have done (`nullable`)."""

    def __init__(self, message: str, bad: _Mismatch | None = None) -> None:
        super().__init__(message)
        self.path: tuple[str | int, ...] = () if bad is None else tuple(bad.path)
        self.value: Any = None if bad is None else bad.value
        self.expected = "" if bad is None else bad.expected
        self.missing = None if bad is None else bad.missing
        self.nullable = False if bad is None else bad.nullable


class _Mismatch(Exception):
    """A value that is not what its hint says, where it is (`path`: field names and list
    indices, innermost last, filled in on the way out) and how to say so."""

    def __init__(
        self, value: Any, expected: str, *, missing: str | None = None, nullable: bool = False
    ) -> None:
        self.value = value
        self.expected = expected  # "a number", "an object", … ("" with `missing`)
        self.missing = missing  # the name of a field that is absent
        self.nullable = nullable  # null would have done
        self.path: list[str | int] = []

    def message(self, where: str) -> str:
        here = place(where, self.path)
        if self.missing is not None:
            return f"{here or 'the report'} has no {self.missing!r}"
        if self.expected == "an object":
            here = here or "the top level"
        return f"{here} is {json_type(self.value)}, not {self.expected}"


def place(where: str, path: Sequence[str | int]) -> str:
    """A field's place as messages name it: `where` then the path (`layers[3].outputs[0]`)."""
    text = where
    for part in path:
        text = f"{text}[{part}]" if isinstance(part, int) else f"{text}.{part}"
    return text.lstrip(".")


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
    try:
        return reader(cls)(data)
    except _Mismatch as bad:
        raise RecordError(bad.message(where), bad) from None


# ---------------------------------------------------------------- compiled once per hint

_READERS: dict[Any, Callable[[Any], Any]] = {}
_NUMBER = (int, float)


def reader(hint: Any) -> Callable[[Any], Any]:
    """value -> value as the hint says (a record, a list, a tuple, a dict, an optional or
    plain value), raising _Mismatch; compiled the first time the hint is read."""
    found = _READERS.get(hint)
    if found is None:

        def pending(v: Any) -> Any:  # a record that holds itself reads through this
            return _READERS[hint](v)

        _READERS[hint] = pending
        found = _READERS[hint] = _compile(hint)
    return found


def _compile(hint: Any) -> Callable[[Any], Any]:
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _record(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return _union(args)
    if origin in (list, tuple):
        if args[0] in _TESTS:
            return _scalars(args[0], tuple if origin is tuple else list)
        return _sequence(reader(args[0]), tuple if origin is tuple else None)
    if origin is dict:
        return _mapping(reader(args[1]))
    return _scalar(hint)


_PLAIN = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def _names(hints: Sequence[Any]) -> str:
    return " or ".join(
        dict.fromkeys(
            _PLAIN.get(h, "an object" if dataclasses.is_dataclass(h) else "a list") for h in hints
        )
    )


# A scalar's test, as Python source over `v` (True when v is of the hint's type; JSON's own
# types first, then their subclasses): the same test inlined in a record's or a list's reader
# or run on its own.
_TESTS = {
    bool: "v.__class__ is bool or isinstance(v, bool)",
    int: "v.__class__ is int or (isinstance(v, int) and not isinstance(v, bool))",
    float: "v.__class__ is float or (isinstance(v, _NUMBER) and not isinstance(v, bool))",
    str: "v.__class__ is str or isinstance(v, str)",
}


def _scalar(hint: Any) -> Callable[[Any], Any]:
    if hint is Any:
        return _same
    if hint not in _TESTS:
        raise TypeError(f"no JSON reader for {hint!r}")
    return _function(
        f"def read(v):\n    if {_TESTS[hint]}:\n        return v\n"
        f"    raise _Mismatch(v, {_names([hint])!r})\n"
    )


def _scalars(hint: Any, kind: type[Any], least: int | None = None) -> Callable[[Any], Any]:
    """A list (a tuple, for `kind` tuple) of plain values, each tested inline (whole numbers
    held to `least` when given)."""
    test = _TESTS[hint].replace("v", "x")
    want = _names([hint])
    if least is not None:
        test, want = f"({test}) and x >= {least}", f"{want} >= {least}"
    return _function(
        "def read(v):\n"
        "    if not isinstance(v, list):\n"
        '        raise _Mismatch(v, "a list")\n'
        "    for x in v:\n"
        f"        if not ({test}):\n"
        f"            bad = _Mismatch(x, {want!r})\n"
        "            bad.path.append(next(i for i, y in enumerate(v) if y is x))\n"
        "            raise bad\n"
        f"    return {kind.__name__}(v)\n"
    )


def _held(hint: Any, least: int) -> Callable[[Any], Any]:
    """A list or tuple of whole numbers (or of lists of them: a list of shapes) each held to
    `least`."""
    kind = tuple if typing.get_origin(hint) is tuple else list
    item = typing.get_args(hint)[0]
    if item in _TESTS:
        return _scalars(item, kind, least)
    return _sequence(_held(item, least), kind if kind is tuple else None)


def _same(v: Any) -> Any:
    return v


def _union(args: tuple[Any, ...]) -> Callable[[Any], Any]:
    options = [a for a in args if a is not type(None)]
    nullable = len(options) < len(args)
    if len(options) == 1:  # an optional value: null, or the value (its own error if not)
        one = reader(options[0])
        if not nullable:
            return one
        return lambda v: None if v is None else one(v)
    readers = [reader(o) for o in options]
    expected = _names(options)

    def read(v: Any) -> Any:
        if v is None and nullable:
            return None
        for r in readers:
            try:
                return r(v)
            except _Mismatch:
                continue
        raise _Mismatch(v, expected)

    return read


def _sequence(item: Callable[[Any], Any], kind: type[Any] | None) -> Callable[[Any], Any]:
    def read(v: Any) -> Any:
        if not isinstance(v, list):
            raise _Mismatch(v, "a list")
        try:
            items = [item(x) for x in v]
        except _Mismatch as bad:
            at = next(i for i, x in enumerate(v) if _fails(item, x))  # the first, as read
            bad.path.insert(0, at)
            raise
        return kind(items) if kind is not None else items

    return read


def _fails(item: Callable[[Any], Any], x: Any) -> bool:
    try:
        item(x)
    except _Mismatch:
        return True
    return False


def _mapping(item: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def read(v: Any) -> Any:
        if not isinstance(v, dict):
            raise _Mismatch(v, "an object")
        out = {}
        for k, x in v.items():
            try:
                out[str(k)] = item(x)
            except _Mismatch as bad:
                bad.path.insert(0, str(k))
                raise
        return out

    return read


def _record(cls: type[Any]) -> Callable[[Any], Any]:
    """The reader of one record class, written out: each field read in turn (absent: its
    default, or what its metadata says an absent one reads as (ABSENT), or a _Mismatch; null
    as if absent where it says NULL_IS_ABSENT), the
    record built by position. A whole number (or a list of them) whose metadata gives its
    least value (LEAST; a count statistic: 0) is held to it, a number marked FINITE (any other
    statistic) to a finite one; a field marked LENIENT that is not
    of its type reads as its default."""
    hints = typing.get_type_hints(cls)
    scope: dict[str, Any] = {"_Mismatch": _Mismatch, "_NUMBER": _NUMBER, "_MISSING": _MISSING}
    scope["_FLOAT_MAX"] = sys.float_info.max
    scope["cls"] = cls
    lines = ["def read(data):"]
    if cls is Failure:  # schema 1: a failure was its line
        lines += ["    if isinstance(data, str):", "        return cls(data)"]
    lines += [
        "    if not isinstance(data, dict):",
        '        raise _Mismatch(data, "an object")',
        "    get = data.get",
    ]
    names: list[str] = []
    by_name: list[str] = []  # kw_only fields, passed by name after the others
    for i, f in enumerate(dataclasses.fields(cls)):
        if not f.init:
            continue
        name, local, meta = f.name, f"f{i}", f.metadata
        (by_name if f.kw_only else names).append(f"{name}={local}" if f.kw_only else local)
        lines.append(f"    v = get({name!r}, _MISSING)")
        null = " or v is None" if meta.get(NULL_IS_ABSENT) else ""
        lines.append(f"    if v is _MISSING{null}:")
        if meta.get(REQUIRED):
            absent = f'raise _Mismatch(None, "", missing={name!r})'
        elif f.default is not dataclasses.MISSING or ABSENT in meta:
            scope[f"d{i}"] = meta.get(ABSENT, f.default)
            absent = f"{local} = d{i}"
        elif f.default_factory is not dataclasses.MISSING:
            scope[f"d{i}"] = f.default_factory
            absent = f"{local} = d{i}()"
        else:
            absent = f'raise _Mismatch(None, "", missing={name!r})'
        lines += [f"        {absent}", "    else:"]
        stat = meta.get(STAT)
        least = meta.get(LEAST, 0 if stat is not None and stat.count else None)
        finite = meta.get(FINITE, stat is not None and not stat.count)
        finite = finite and float in (hints[name], *typing.get_args(hints[name]))
        present = _field(hints[name], name, local, scope, least)
        if finite:  # inf - inf is nan, true; a finite number less itself 0.0, false; a whole
            # number beyond a float's range (JSON's 1e400 written out) fails the second test
            present.append(
                f"if {local} is not None and ({local} - {local} or abs({local}) > _FLOAT_MAX):"
            )
            present.append('    _bad = _Mismatch(v, "a finite number", nullable=True)')
            present.append(f"    _bad.path.append({name!r})")
            present.append("    raise _bad")
        if meta.get(LENIENT):  # not of its type: as if absent
            present = ["try:", *[f"    {x}" for x in present], "except _Mismatch:", f"    {absent}"]
        lines += [f"        {line}" for line in present]
    lines.append(f"    return cls({', '.join(names + by_name)})")
    read = _function("\n".join(lines) + "\n", scope)
    read.__qualname__ = f"read_{cls.__name__}"
    return read


def _field(hint: Any, name: str, local: str, scope: dict[str, Any], least: int | None) -> list[str]:
    """The lines reading `v` (field `name`'s value, present) into `local`, the field's name
    added to a mismatch's place; the commonest hints inlined. `least`: a whole number's (or
    each in a list of them) least value."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    nullable = origin in (types.UnionType, typing.Union) and type(None) in args
    options = [a for a in args if a is not type(None)] if nullable else [hint]
    if len(options) == 1 and options[0] in _TESTS:  # a plain value, or an optional one
        test, want = _TESTS[options[0]], _names(options)
        if least is not None:
            test, want = f"({test}) and v >= {least}", f"{want} >= {least}"
        ok = f"v is None or ({test})" if nullable else test
        return [
            f"if not ({ok}):",
            f"    _bad = _Mismatch(v, {want!r}, nullable={nullable})",
            f"    _bad.path.append({name!r})",
            "    raise _bad",
            f"{local} = v",
        ]
    one = options[0] if nullable and len(options) == 1 else hint
    if least is not None and typing.get_origin(one) in (list, tuple):  # sizes, counts
        scope[f"r_{local}"] = _held(one, least)
    else:
        scope[f"r_{local}"] = reader(one)
    read = [
        "try:",
        f"    {local} = r_{local}(v)",
        "except _Mismatch as _bad:",
        f"    _bad.path.insert(0, {name!r})",
        "    raise",
    ]
    if nullable and len(options) == 1:  # an optional record or list: null, or read
        return ["if v is None:", f"    {local} = None", "else:", *[f"    {x}" for x in read]]
    return read


_MISSING = object()
_COUNTER = itertools.count()


def _function(source: str, scope: dict[str, Any] | None = None) -> Callable[[Any], Any]:
    """The function `read` defined by source, in scope (names: the record's own fields)."""
    scope = {"_Mismatch": _Mismatch, "_NUMBER": _NUMBER} if scope is None else scope
    exec(compile(source, f"<hookcli reader {next(_COUNTER)}>", "exec"), scope)
    read: Callable[[Any], Any] = scope["read"]
    return read
