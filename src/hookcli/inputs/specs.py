"""`--input SPEC` → tensors: `randn:1x3x224x224`, `rand:…`, `ones:2`, `zeros:…`,
`randint:LOW:HIGH:SHAPE` (token ids), `file.pt`, `file.npy`; any of them with a `:DTYPE` suffix
(`randn:1x3x224x224:bfloat16`, `randint:0:1000:1x16:int32`); `NAME=SPEC` makes the tensor the
forward's keyword argument NAME (`input_ids=randint:0:1000:1x16`)."""

from __future__ import annotations

import math
import pickle
import re
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookcli.errors import ModelError, UsageError, not_a_file, one_line
from hookcli.io.output import note_read, user_path

MAX_NUMEL = (1 << 31) - 1  # a spec tensor has fewer than 2**31 elements (8 GiB of float32)
_SHAPE = r"[0-9]+(?:[x,][0-9]+)*"
_FILL = re.compile(rf"^(randn|rand|ones|zeros):({_SHAPE})$")
_RANDINT = re.compile(rf"^randint:(-?[0-9]+):(-?[0-9]+):({_SHAPE})$")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "double": torch.float64,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "long": torch.int64,
    "int32": torch.int32,
    "int": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
KINDS = "randn, rand, ones, zeros or randint:LOW:HIGH"


@dataclass(frozen=True, slots=True)
class Spec:
    """One --input value: its tensors, and the keyword it is passed as (None: positional)."""

    tensors: tuple[torch.Tensor, ...]
    name: str | None = None


def spec_shape(spec: str, dims: str) -> tuple[int, ...]:
    """The shape of KIND:SHAPE, its element count checked exactly (Python ints never wrap)."""
    kind = spec.partition(":")[0]
    try:
        shape = tuple(int(d) for d in re.split(r"[x,]", dims))
    except ValueError as exc:  # more digits than int() takes
        raise UsageError(
            f"{kind}:{dims[:30]}…: a dimension has thousands of digits.", "use a smaller shape."
        ) from exc
    numel = math.prod(shape)
    if numel > MAX_NUMEL:
        shown = dims if len(dims) <= 60 else dims[:40] + "…"
        gib = numel * 4 / (1 << 30)
        size = f"{gib:,.1f} GiB" if gib < 1e6 else "far beyond any memory"
        raise UsageError(
            f"{kind}:{shown} has {numel:,} elements ({size} as float32); the limit is "
            f"{MAX_NUMEL:,} (fewer than 2**31).",
            "use a smaller shape.",
        )
    return shape


def _load_tensors(raw: str, path: Path) -> Any:
    """torch.load with weights_only=True: tensors and plain containers, never pickled code."""
    if not path.is_file():
        raise UsageError(f"tensor file {raw} {not_a_file(path)}.", "check the path.")
    note_read(path)
    try:
        with warnings.catch_warnings():  # (torch's note on a plain pickle's protocol: noise)
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if zipfile.is_zipfile(path):  # torch.save's format, holding more than tensors
            raise UsageError(
                f"tensor file {raw} stores pickled Python objects, not only tensors; hookcli "
                "never unpickles code (it loads with weights_only=True).",
                "save plain tensors: torch.save(tensor, 'x.pt') or a tuple of tensors.",
            ) from exc
        raise UsageError(  # (torch's own text advises unpickling it: never done here)
            f"tensor file {raw} is not a torch.save file (a plain pickle, or other bytes; "
            "hookcli never unpickles).",
            "save it with torch.save(tensor, 'x.pt').",
        ) from exc
    except Exception as exc:
        raise UsageError(
            f"tensor file {raw} is not readable: {one_line(exc, with_type=False)}",
            "save it with torch.save(tensor, 'x.pt').",
        ) from exc


def _split_name(raw: str) -> tuple[str | None, str]:
    """`input_ids=randint:…` → ("input_ids", "randint:…"); a path holding `=` stays a path."""
    name, sep, rest = raw.partition("=")
    if sep and name.isidentifier() and not Path(raw).exists():
        return name, rest.strip()
    return None, raw


def _split_dtype(raw: str) -> tuple[str, torch.dtype | None]:
    """`randn:2x3:bfloat16` → ("randn:2x3", torch.bfloat16); no known suffix → (raw, None)."""
    body, sep, suffix = raw.rpartition(":")
    if sep and body and suffix.lower() in DTYPES:
        return body, DTYPES[suffix.lower()]
    return raw, None


def _randint(raw: str, m: re.Match[str], gen: torch.Generator) -> torch.Tensor:
    low, high = int(m.group(1)), int(m.group(2))
    if high <= low:
        raise UsageError(
            f"{raw}: HIGH ({high}) must be above LOW ({low}); values are drawn from [LOW, HIGH).",
            "for example --input randint:0:1000:1x16",
        )
    if low < -(2**63) or high >= 2**63:
        raise UsageError(
            f"{raw}: LOW and HIGH must be int64 numbers, within [-2^63, 2^63 - 1].",
            "for example --input randint:0:1000:1x16",
        )
    shape = spec_shape(raw, m.group(3))
    return torch.randint(low, high, shape, generator=gen)


def _file(spec: str, raw: str) -> list[torch.Tensor]:
    path = user_path(raw, "tensor file")
    if path.suffix.lower() in (".pt", ".pth"):
        data = _load_tensors(raw, path)
        items = list(data) if isinstance(data, list | tuple) else [data]
        if not items or not all(isinstance(t, torch.Tensor) for t in items):
            raise UsageError(
                f"tensor file {raw} holds a {type(data).__name__}, not tensors.",
                "save a tensor or a tuple of tensors with torch.save.",
            )
        for t in items:
            if t.is_meta or t.layout != torch.strided:
                what = (
                    "a meta tensor (a shape with no data)" if t.is_meta else f"a {t.layout} tensor"
                )
                raise UsageError(
                    f"tensor file {raw} holds {what}.",
                    "save a dense tensor with values: torch.save(torch.randn(2, 3), 'x.pt').",
                )
        return items
    if path.suffix.lower() == ".npy":
        if not path.is_file():
            raise UsageError(f"tensor file {raw} {not_a_file(path)}.", "check the path.")
        note_read(path)
        try:
            return [torch.from_numpy(np.load(path, allow_pickle=False))]
        except Exception as exc:
            raise UsageError(
                f"tensor file {raw} is not a readable .npy array: {one_line(exc, with_type=False)}",
                "save it with numpy.save.",
            ) from exc
    raise UsageError(
        f"malformed --input {spec!r}: expected KIND:SHAPE such as randn:1x3x224x224 "
        f"(KIND {KINDS}), or a .pt/.npy file; NAME=SPEC for a keyword argument.",
        "for example --input randn:1x3x224x224 or --input input_ids=randint:0:1000:1x16",
    )


def parse(spec: str, seed: int) -> Spec:
    """One --input value → its tensors (a .pt file may hold a tuple of them) and its keyword;
    one that does not fit in memory is out of memory (exit 3), said as the input's size."""
    try:
        return _parse(spec, seed)
    except (MemoryError, RuntimeError) as exc:
        if not isinstance(exc, MemoryError) and "allocate" not in str(exc):
            raise
        raise ModelError(
            f"out of memory making --input {spec!r}: {one_line(exc)}",
            "give a smaller shape (or a file of the tensor itself).",
        ) from exc


def _parse(spec: str, seed: int) -> Spec:
    name, raw = _split_name(spec.strip())
    body, dtype = _split_dtype(raw)
    gen = torch.Generator().manual_seed(seed)
    fill = _FILL.match(body)
    randint = _RANDINT.match(body)
    if fill:
        kind, dims = fill.groups()
        shape = spec_shape(body, dims)
        if kind == "randn":
            tensors = [torch.randn(shape, generator=gen)]
        elif kind == "rand":
            tensors = [torch.rand(shape, generator=gen)]
        else:
            tensors = [torch.ones(shape) if kind == "ones" else torch.zeros(shape)]
    elif randint:
        tensors = [_randint(body, randint, gen)]
    else:
        tensors = _file(spec, body if dtype is not None else raw)
    if dtype is not None:
        tensors = [_cast(t, dtype, spec) for t in tensors]
    if name is not None and len(tensors) != 1:
        raise UsageError(
            f"--input {spec!r} names one keyword argument but holds {len(tensors)} tensors.",
            "save one tensor per file for NAME=FILE.",
        )
    return Spec(tuple(tensors), name)


def _cast(t: torch.Tensor, dtype: torch.dtype, spec: str) -> torch.Tensor:
    whole = not t.is_floating_point() or bool(torch.equal(t, t.round()))
    if not whole and not dtype.is_floating_point and dtype != torch.bool:
        # randn values as token ids would be silently truncated toward zero
        raise UsageError(
            f"--input {spec!r} casts floating-point values to {dtype}: they would be truncated.",
            "use randint:LOW:HIGH:SHAPE for integer tensors.",
        )
    if t.numel() and dtype != torch.bool and (dtype.is_floating_point or not t.is_complex()):
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        finite = t[t.isfinite()] if t.is_floating_point() else t
        low, high = (finite.min().item(), finite.max().item()) if finite.numel() else (0, 0)
        if low < info.min or high > info.max:
            # int8 would wrap 200 to -56; float16 would make 70000 an Inf
            raise UsageError(
                f"--input {spec!r}: its values span [{low:g}, {high:g}], outside {dtype}'s "
                f"[{info.min:g}, {info.max:g}]; the cast would wrap or overflow them.",
                "draw within the type's range, or use a wider type.",
            )
    return t.to(dtype)


def parse_spec(spec: str, seed: int) -> list[torch.Tensor]:
    """One --input spec → its tensors (positional or named alike)."""
    return list(parse(spec, seed).tensors)
