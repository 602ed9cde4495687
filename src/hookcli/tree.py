"""The one walker over what models take and return: tensors inside tuples, namedtuples, lists,
Mappings (dicts, OrderedDicts, Hugging Face `ModelOutput`) and dataclasses, each tensor named by
its path — `out`, `out[0]`, `out["boxes"]`, `out.aux_logits`, `out.hidden` (docs/traps.md §5).

`iter_tensors` reads (hooks, diff, targets, pictures); `map_tensors` rebuilds the same structure
with some tensors replaced (an ablated output, `--input-grad`'s leaf copies). Both stop at the
same depth, so a pathological nesting cannot recurse without end.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

MAX_DEPTH = 8  # nested outputs deeper than this are not walked


def iter_tensors(obj: Any, path: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside obj, with its path: `out`, `out[0]`, `out["boxes"]`, `out.logits`."""
    kind = type(obj)
    if kind in _HOLD_NONE:  # (a forward's flags and sizes: no isinstance checks each)
        return
    if kind is torch.Tensor or isinstance(obj, torch.Tensor):
        yield path, obj
    elif depth >= MAX_DEPTH:
        return
    elif kind is dict:  # (keyword arguments: a plain dict, before Mapping's slower check)
        for key, item in obj.items():
            yield from iter_tensors(item, f"{path}[{_label(key)}]", depth + 1)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        for name in obj._fields:
            yield from iter_tensors(getattr(obj, name), f"{path}.{name}", depth + 1)
    elif isinstance(obj, list | tuple):
        for i, item in enumerate(obj):
            yield from iter_tensors(item, f"{path}[{i}]", depth + 1)
    elif isinstance(obj, Mapping):
        for key, item in obj.items():
            yield from iter_tensors(item, f"{path}[{_label(key)}]", depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # (its fields by name)
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None), f"{path}.{f.name}", depth + 1)


# what holds no tensor, by exact type (a subclass, even of int, may be anything)
_HOLD_NONE = frozenset({type(None), bool, int, float, str, bytes})


def map_tensors(
    obj: Any, fn: Callable[[str, torch.Tensor], torch.Tensor], path: str = "", depth: int = 0
) -> Any:
    """obj with every tensor t replaced by fn(path, t), the structure (and its types) kept;
    paths as iter_tensors names them. Objects it cannot rebuild are passed through."""
    if isinstance(obj, torch.Tensor):
        return fn(path, obj)
    if depth >= MAX_DEPTH:
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(
            *(map_tensors(getattr(obj, n), fn, f"{path}.{n}", depth + 1) for n in obj._fields)
        )
    if isinstance(obj, list | tuple):
        items = [map_tensors(v, fn, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
        return items if type(obj) is list else type(obj)(items)
    if isinstance(obj, MutableMapping):  # dict, OrderedDict, ModelOutput: a copy, set again
        new = copy.copy(obj)
        for key, item in obj.items():
            new[key] = map_tensors(item, fn, f"{path}[{_label(key)}]", depth + 1)
        return new
    # a dataclass rebuilt with its fields mapped (anything else passed through)
    return _map_dataclass(obj, fn, path, depth)


def _map_dataclass(
    obj: Any, fn: Callable[[str, torch.Tensor], torch.Tensor], path: str, depth: int
) -> Any:
    """A dataclass rebuilt with its fields mapped; obj itself where it is none, or cannot be
    rebuilt."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return obj
    changed = {
        f.name: map_tensors(getattr(obj, f.name, None), fn, f"{path}.{f.name}", depth + 1)
        for f in dataclasses.fields(obj)
        if f.init
    }
    try:
        return dataclasses.replace(obj, **changed)
    except Exception:  # (one it cannot rebuild: passed through, as any other)
        return obj


def _label(key: Any) -> str:
    return f'"{key}"' if isinstance(key, str) else repr(key)


_STEP = re.compile(r'\[(-?\d+)\]|\["([^"]*)"\]|\[\'([^\']*)\'\]|\.?([A-Za-z_][\w]*)|\.?(-?\d+)')


def steps(key: str) -> list[str | int]:
    """`logits` → ["logits"]; `0` → [0]; `out[0]["boxes"]`, `[0].boxes` → [0, "boxes"] (a
    leading `out` is the output itself, as paths name it). Raises ValueError when malformed."""
    text = key.strip()
    if text == "out":
        return []
    text = text.removeprefix("out") if text.startswith(("out[", "out.")) else text
    out: list[str | int] = []
    pos = 0
    while pos < len(text):
        m = _STEP.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"cannot read {key!r} at {text[pos:]!r}")
        index, dq, sq, name, bare = m.groups()
        if index is not None or bare is not None:
            out.append(int(index if index is not None else bare))
        else:
            out.append(dq if dq is not None else sq if sq is not None else name)
        pos = m.end()
    return out


def children(obj: Any) -> list[str]:
    """What one step into obj can name: its keys, fields or indices."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return list(obj._fields)
    if isinstance(obj, Mapping):
        return [str(k) for k in obj]
    if isinstance(obj, list | tuple):
        return [str(i) for i in range(len(obj))]
    return []


def pick(obj: Any, key: str) -> Any:
    """The element of a nested output named by key (see `steps`); a LookupError naming what
    there is when a step does not exist."""
    for step in steps(key):
        if isinstance(obj, Mapping) and step in obj:
            obj = obj[step]
        elif isinstance(obj, Mapping) and str(step) in obj:
            obj = obj[str(step)]
        elif isinstance(step, str) and isinstance(obj, tuple) and hasattr(obj, "_fields"):
            if step not in obj._fields:
                raise LookupError(f"no {step!r} (it has {', '.join(children(obj))})")
            obj = getattr(obj, step)
        elif isinstance(step, int) and isinstance(obj, list | tuple):
            if not -len(obj) <= step < len(obj):
                raise LookupError(f"no index {step} (it has {len(obj)} elements)")
            obj = obj[step]
        elif isinstance(step, int) and isinstance(obj, Mapping):  # ModelOutput: by position
            values = list(obj.values())
            if not -len(values) <= step < len(values):
                raise LookupError(f"no index {step} (it has {', '.join(children(obj))})")
            obj = values[step]
        else:
            have = children(obj)
            what = f"it has {', '.join(have)}" if have else f"it is a {type(obj).__name__}"
            raise LookupError(f"no {step!r} ({what})")
    return obj
