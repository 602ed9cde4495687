"""The one walker over what models take and return: tensors inside tuples, namedtuples, lists
and Mappings (dicts, OrderedDicts, Hugging Face `ModelOutput`), each tensor named by its path —
`out`, `out[0]`, `out["boxes"]`, `out.aux_logits` (HOOK_PITFALLS 5).

`iter_tensors` reads (hooks, diff, targets, pictures); `map_tensors` rebuilds the same structure
with some tensors replaced (an ablated output, `--input-grad`'s leaf copies). Both stop at the
same depth, so a pathological nesting cannot recurse without end.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

MAX_DEPTH = 8  # nested outputs deeper than this are not walked


def iter_tensors(obj: Any, path: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside obj, with its path: `out`, `out[0]`, `out["boxes"]`, `out.logits`."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif depth >= MAX_DEPTH:
        return
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        for name in obj._fields:
            yield from iter_tensors(getattr(obj, name), f"{path}.{name}", depth + 1)
    elif isinstance(obj, list | tuple):
        for i, item in enumerate(obj):
            yield from iter_tensors(item, f"{path}[{i}]", depth + 1)
    elif isinstance(obj, Mapping):
        for key, item in obj.items():
            yield from iter_tensors(item, f"{path}[{_label(key)}]", depth + 1)


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
    return obj


def _label(key: Any) -> str:
    return f'"{key}"' if isinstance(key, str) else repr(key)
