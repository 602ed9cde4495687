"""--offload: a Hugging Face checkpoint larger than memory, run with one block's weights in
memory at a time.

The model is built with its parameters on the meta device (sources/skeleton.py; buffers real).
Its units are the blocks of its largest `nn.ModuleList` (a decoder's layers) and every other
module that owns parameters itself (embeddings, the final norm, the head). A forward pre-hook
reads a unit's weights from the checkpoint's safetensors files, as the in-memory load would
give them (the same dtype; names and layouts that transformers' loader converts converted the
same way, a mixture of experts' per-expert matrices stacked into its fused experts: see
offload_keys.py), and a forward hook puts the meta parameters back when the unit
returns: peak memory is about the largest unit plus the activations. Every computation is
the in-memory model's, so every number equals the in-memory run's. A parameter shared by two
modules (an LM's tied embedding and head) is read once for each.

The files are read with plain reads into tensors of their own (no memory map stays open, so
the pages read do not stay resident), after their headers are checked: a safetensors file is
data, its header a JSON object of names, dtypes, shapes and offsets inside the file.
"""

from __future__ import annotations

import itertools
import json
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from hookcli.errors import UsageError, one_line
from hookcli.io.saving import DTYPE_NAMES
from hookcli.sources.offload_keys import Fused, patterns, plan

DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()} | {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
HEADER_MAX = 100 * 2**20  # safetensors' own limit on a header
ALIGN = 64


@dataclass(frozen=True, slots=True)
class Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int


class Checkpoint:
    """A folder's safetensors weights (one file, or shards named by the index), by name."""

    def __init__(self, folder: Path, spec: str) -> None:
        self.spec = spec
        index = folder / "model.safetensors.index.json"
        self.metadata_dtype: str | None = None  # an index's metadata may name the dtype
        if index.is_file():
            files, self.metadata_dtype = _shards(index, folder, spec)
        elif (folder / "model.safetensors").is_file():
            files = [folder / "model.safetensors"]
        else:
            raise UsageError(
                f"{spec}: --offload reads model.safetensors (or its shards), and {folder} "
                "has neither.",
                "give a folder written by save_pretrained with safetensors weights.",
            )
        self.entries: dict[str, Entry] = {}
        for f in files:
            self.entries.update(_header(f, spec))
        self.first_file_keys = [k for k, e in self.entries.items() if e.file == files[0]]

    def read(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        size = e.end - e.start
        # placed as a memory map of the file would place it (its offset modulo 64): a matrix
        # product's kernel may take another path on other alignment, and the last bit differ
        block = torch.empty(size + ALIGN, dtype=torch.uint8)
        skip = (e.start - block.data_ptr()) % ALIGN
        if skip % block[:0].view(e.dtype).element_size():
            skip = 0  # (an offset the dtype cannot be viewed at)
        raw = block[skip : skip + size]
        with e.file.open("rb") as f:
            f.seek(e.start)
            got = f.readinto(cast(Any, raw.numpy()))
        if got != e.end - e.start:
            raise UsageError(
                f"{self.spec}: {e.file.name} ends inside tensor {name}.",
                "the checkpoint is truncated: save it again.",
            )
        return raw.view(e.dtype).reshape(e.shape)


def _shards(index: Path, folder: Path, spec: str) -> tuple[list[Path], str | None]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        names = sorted(set(data["weight_map"].values()))
        meta = data.get("metadata")
        dtype = meta.get("dtype") if isinstance(meta, dict) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise UsageError(
            f"{spec}: {index.name} is not a safetensors index ({one_line(exc)}).",
            "save the model again with save_pretrained.",
        ) from exc
    files = []
    for name in names:
        if (
            not isinstance(name, str)
            or Path(name).name != name
            or not name.endswith(".safetensors")
        ):
            raise UsageError(
                f"{spec}: {index.name} names {name!r}, not a .safetensors file in the folder.",
                "save the model again with save_pretrained.",
            )
        if not (folder / name).is_file():
            raise UsageError(
                f"{spec}: shard {name} named by {index.name} is missing.",
                "copy every shard into the folder.",
            )
        files.append(folder / name)
    return files, dtype if isinstance(dtype, str) else None


def _header(path: Path, spec: str) -> dict[str, Entry]:
    """The tensors a safetensors file holds, every offset checked against the file's size."""
    size = path.stat().st_size

    def bad(why: str) -> UsageError:
        return UsageError(
            f"{spec}: {path.name} is not a safetensors file ({why}).",
            "save the model again with save_pretrained.",
        )

    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad("shorter than its header")
        (n,) = struct.unpack("<Q", head)
        if n > min(HEADER_MAX, size - 8):
            raise bad("its header length runs past the file")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as exc:
            raise bad("its header is not JSON") from exc
    if not isinstance(header, dict):
        raise bad("its header is not an object")
    base = 8 + n
    out = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise bad(f"tensor {name!r} is not described by an object")
        kind = info.get("dtype")
        if not isinstance(kind, str) or kind not in DTYPES:  # (a list or object: unhashable)
            raise UsageError(
                f"{spec}: {path.name} holds tensor {name!r} of dtype {kind!r}, which --offload "
                "does not read.",
                "load the model without --offload.",
            )
        dtype = DTYPES[kind]
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (
            isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
        ):
            raise bad(f"tensor {name!r}: its shape or offsets are not whole numbers")
        start, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not 0 <= start <= end or base + end > size:
            raise bad(f"tensor {name!r} lies outside the file")
        if end - start != numel * itemsize:
            raise bad(f"tensor {name!r}'s bytes do not match its shape")
        spans.append((start, end, name))
        out[name] = Entry(path, dtype, tuple(shape), base + start, base + end)
    spans.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise bad(f"tensors {first!r} and {second!r} overlap")
    return out


class Offloaded:
    """The hooks that bring each unit's weights in from the checkpoint while it runs."""

    def __init__(self, model: nn.Module, checkpoint: Checkpoint) -> None:
        self.model = model
        self.checkpoint = checkpoint
        # a parameter (by id) -> (its name, where it comes from: a checkpoint name or a
        # conversion of several, as from_pretrained takes it: offload_keys.py)
        self.sources: dict[int, tuple[str, str | Fused]] = {}
        self.holders: dict[int, list[tuple[nn.Module, str]]] = {}
        self.loads = 0  # weights read, over the run
        self.device = torch.device("cpu")  # where they go (place())
        self._meta: dict[int, nn.Parameter] = {}  # a read parameter (by id) -> its meta one
        prefix = str(getattr(model, "base_model_prefix", "") or "")
        _refuse_quantized(model, checkpoint)
        self.plan = plan(model, checkpoint.entries, prefix)
        for name, p in model.named_parameters(remove_duplicate=False):
            owner, _, attr = name.rpartition(".")
            self.holders.setdefault(id(p), []).append((model.get_submodule(owner), attr))
            source = self.plan.sources.get(name)
            if source is not None:
                self.sources.setdefault(id(p), (name, source))
        missing, wrong = [], []
        for name, p in model.named_parameters():
            if id(p) not in self.sources:
                missing.append(name)
            elif (shape := self._shape(*self.sources[id(p)])) != tuple(p.shape):
                wrong.append(f"{name} {_shape(shape)}")
        if missing:
            raise self._refusal(missing)
        for name, b in model.named_buffers():
            source = self.plan.sources.get(name)
            if source is not None and (shape := self._shape(name, source)) != tuple(b.shape):
                wrong.append(f"{name} {_shape(shape)}")
        if wrong:
            more = f" (+{len(wrong) - 3} more)" if len(wrong) > 3 else ""
            raise UsageError(
                f"{checkpoint.spec}: the checkpoint's weights do not fit the model built from its "
                f"config: {', '.join(wrong[:3])}{more} in the checkpoint.",
                "check config.json and the --model-arg values against the checkpoint.",
            )
        self._persistent_buffers()
        self.units = _units(model)
        for unit, recurse in self.units:
            unit.register_forward_pre_hook(self._loader(unit, recurse), prepend=True)
            unit.register_forward_hook(self._freer(unit, recurse), always_call=True)

    def _shape(self, name: str, source: str | Fused) -> tuple[int, ...]:
        if isinstance(source, str):
            return self.checkpoint.entries[source].shape
        return source.shapes[name]

    def _refusal(self, missing: list[str]) -> UsageError:
        """Weights the checkpoint gives none for: why, and what helps."""
        spec = self.checkpoint.spec
        shown = ", ".join(missing[:4]) + (
            f" (+{len(missing) - 4} more)" if len(missing) > 4 else ""
        )
        head = f"{spec}: --offload found no weights for {shown} in the checkpoint"
        config = getattr(self.model, "config", None)
        kind = str(getattr(config, "model_type", "") or type(self.model).__name__)
        how = (
            f"by name or by transformers' conversions for {kind}"
            if self.plan.conversions
            else "by name, or with the base model's prefix"
        )
        unmatched = (
            f"; its {patterns(self.plan.unmatched)} map to no weight of "
            f"{type(self.model).__name__} {how}"
            if self.plan.unmatched
            else ""
        )
        failed = [(k, why) for k, why in self.plan.failed.items() if k in missing]
        if failed or self.plan.failed:
            first, (held, why) = (failed or list(self.plan.failed.items()))[0]
            return UsageError(
                f"{head}: transformers' conversion into {first} fails on the {held} the "
                f"checkpoint holds for it ({why}){unmatched}.",
                "check that every shard is there, and that config.json and the --model-arg "
                "values (the number of experts, the sizes) fit the checkpoint.",
            )
        if self.plan.unmatched:
            return UsageError(
                f"{head}{unmatched}.",
                "check that config.json names the architecture the weights were saved from "
                "(from_pretrained would leave these weights newly initialised too).",
            )
        return UsageError(
            f"{head}, and it holds no other tensor they could be made from.",
            "the checkpoint is incomplete: copy every shard, or save the model again.",
        )

    def _persistent_buffers(self) -> None:
        """Buffers the checkpoint holds (BatchNorm's statistics, say) are small: read now."""
        with torch.no_grad():
            for name, b in list(self.model.named_buffers()):
                source = self.plan.sources.get(name)
                if source is None or b is None:
                    continue
                if isinstance(source, str):
                    b.copy_(self.checkpoint.read(source))
                else:
                    b.copy_(source.convert(self.checkpoint.read, self.model)[name])

    def _params(self, unit: nn.Module, recurse: bool) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for p in unit.parameters(recurse=recurse):
            seen.setdefault(id(p), p)
        return list(seen.values())

    def _loader(self, unit: nn.Module, recurse: bool) -> Any:
        def load(module: nn.Module, args: Any) -> None:
            made: dict[int, dict[str, torch.Tensor]] = {}  # a conversion (by id) -> its output
            for p in self._params(unit, recurse):
                if p.device.type != "meta":
                    continue  # (read already: a tied parameter inside this unit twice)
                name, source = self.sources[id(p)]
                if isinstance(source, str):
                    read = self.checkpoint.read(source)
                else:  # several checkpoint tensors converted: once for all it makes
                    if id(source) not in made:
                        made[id(source)] = source.convert(
                            self.checkpoint.read, self.model, self.device
                        )
                    read = made[id(source)].pop(name)
                real = read.to(device=self.device, dtype=p.dtype)
                loaded = nn.Parameter(real, requires_grad=False)
                self.loads += 1
                for holder, attr in self.holders[id(p)]:
                    holder._parameters[attr] = loaded
                self._meta[id(loaded)] = p

        return load

    def _freer(self, unit: nn.Module, recurse: bool) -> Any:
        def free(module: nn.Module, args: Any, output: Any) -> None:
            for p in self._params(unit, recurse):
                meta = self._meta.pop(id(p), None)
                if meta is None:
                    continue
                for holder, attr in self.holders[id(meta)]:
                    holder._parameters[attr] = meta

        return free


def _refuse_quantized(model: nn.Module, checkpoint: Checkpoint) -> None:
    """A quantized checkpoint's tensors (float8 or packed integers, with their scales) are not
    the weights of the model built from its config until transformers' quantizer makes them so:
    read as they are, every number would be wrong."""
    quantized = getattr(getattr(model, "config", None), "quantization_config", None)
    if quantized is None:
        return
    method = (
        quantized.get("quant_method")
        if isinstance(quantized, dict)
        else getattr(quantized, "quant_method", None)
    )
    method = getattr(method, "value", method) or "a quantization_config"
    raise UsageError(
        f"{checkpoint.spec}: the checkpoint is quantized ({method}, in config.json), and "
        "--offload reads plain weights only: its tensors are not the model's weights until "
        "transformers' quantizer converts them.",
        "load it without --offload, or --offload a plain (dequantized) copy of it.",
    )


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _units(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """(module, whether its children's parameters are its own): each block of the largest
    ModuleList, then every other module that owns parameters itself."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    best = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)
    blocks = [b for b in (best or []) if any(True for _ in b.parameters())]
    inside = {id(m) for b in blocks for m in b.modules()}
    others = [
        m
        for m in model.modules()
        if id(m) not in inside and any(p is not None for p in m._parameters.values())
    ]
    return [(b, True) for b in blocks] + [(m, False) for m in others]


_ATTACHED: weakref.WeakKeyDictionary[nn.Module, Offloaded] = weakref.WeakKeyDictionary()


def attach(model: nn.Module, checkpoint: Checkpoint) -> Offloaded:
    """The model (built by skeleton.empty("offload")) made to read its weights from the
    checkpoint, block by block."""
    offloaded = _ATTACHED[model] = Offloaded(model, checkpoint)
    return offloaded


def place(model: nn.Module, device: torch.device) -> None:
    """An offloaded model's weights are read onto `device`, and its buffers moved there."""
    offloaded = _ATTACHED.get(model)
    if offloaded is not None:
        offloaded.device = device
        for m in model.modules():
            for name, b in m._buffers.items():
                if b is not None and b.device != device:
                    m._buffers[name] = b.to(device)
