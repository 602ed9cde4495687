"""Side kinds in the formats quantized LLMs ship in (issue 53): a diff of the model as loaded
against the same architecture quantized as llama.cpp, torchao or bitsandbytes make it.

- `gguf:FILE.gguf`: the file's tensors, dequantized by the `gguf` package as transformers' GGUF
  loading reads them (names mapped, llama's q/k rows unpermuted), copied into the model's own
  parameters: the forward of a model holding exactly the file's quantized values. The file must
  be of the model's architecture: its config (type, vocabulary, sizes) and every parameter's
  shape are checked first, and a difference is one line naming it.
- `torchao:int8wo|int4wo[:G]|int8dq`: torchao's `quantize_` of every Linear: int8 weights,
  int4 weights in groups of G input channels (128 unless given), int8 dynamic activations with
  int8 weights. On a machine where torchao's int4 kernel (Int4WeightOnlyConfig) cannot run,
  as on a CPU, int4 weights are IntxWeightOnlyConfig's (the same grouped affine int4 values,
  computed unpacked), and the report says so.
- `hf:FOLDER`: a quantized checkpoint of the model's architecture, loaded by transformers into
  the model's class (its quantization_config decides how: bitsandbytes, torchao,
  compressed-tensors, GPTQ, AWQ — each where its package runs here).
- `bnb:nf4|int8`: bitsandbytes' Linear4bit (NF4) or Linear8bitLt in place of every Linear but
  the output head, which transformers' bitsandbytes loading (`load_in_4bit`) leaves as it is.

Each needs its package (`gguf`, `torchao`, `bitsandbytes`); one missing is one line saying which
to install. `weight_distances` gives each weight's SQNR between the two sides, whatever made
them differ (these kinds, a dtype, weights=).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from hookcli.commands.diff.sides import SideKind, register
from hookcli.engine import devicerow
from hookcli.engine.prepare import Prepared
from hookcli.engine.tensorbits import by_device
from hookcli.errors import UsageError
from hookcli.records import WeightDistance


def _needs(package: str, side: str) -> Any:
    """The package a side kind runs on, or one line naming the extra that installs it."""
    from hookcli.sources.base import import_extra

    return import_extra(package, "quant", f"{side} sides")


def _hf_model(prepared: Prepared, side: str) -> Any:
    """The loaded module as a transformers model (these formats name its parameters)."""
    module = prepared.loaded.module
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise UsageError(
            f"the {side} side quantizes a Hugging Face language model; "
            f"{prepared.loaded.spec} is not one.",
            f"diff an hf: model, e.g. hookcli diff hf:PATH --text-file corpus.txt --b {side}.",
        )
    return module


def _in_memory(prepared: Prepared, side: str) -> None:
    """The side's weights must be in memory to be replaced or quantized (not on meta)."""
    if any(p.is_meta for p in prepared.loaded.module.parameters()):
        raise UsageError(
            f"the {side} side needs the model's weights in memory; they are on the meta "
            "device here (--meta, an offloaded model).",
            "diff a model loaded with its weights.",
        )


class _QuantKind(SideKind):
    """What the kinds here share: one per side (a later one replaces an earlier), a model
    whose weights they change, none with torchvision's int8 twin."""

    changes_module: ClassVar[bool] = True
    changes_weights: ClassVar[bool] = True

    @property
    def slot(self) -> object:
        return _QuantKind

    def refuses(self, other: SideKind) -> str | None:
        from hookcli.commands.diff.sides import Quantized

        if isinstance(other, Quantized):
            return "the quantized side (torchvision's int8 twin) and an LLM quantization"
        return None


# ---------------------------------------------------------------- gguf

# a GGUF tensor type → the precision (tolerance.PRECISIONS) its values carry
_GGUF_FLOAT = {"F32": "float32", "F64": "float64", "F16": "float16", "BF16": "bfloat16"}
_GGUF_EIGHT = ("Q8_0", "Q8_1", "Q8_K", "I8", "Q6_K", "Q5_0", "Q5_1", "Q5_K")
# the config fields a GGUF file and the model must agree on (transformers' names)
_SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
)


@functools.cache
def gguf_types(path: str) -> tuple[str, ...]:
    """The tensor types of a GGUF file (Q4_0, Q8_0, F32 …), most elements first."""
    gguf = _needs("gguf", f"gguf:{path}")
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise UsageError(
            f"gguf:{path} cannot be read as a GGUF file ({type(exc).__name__}: {exc}).",
            "give a .gguf file written by llama.cpp or the gguf package.",
        ) from exc
    sizes: dict[str, int] = {}
    for t in reader.tensors:
        name = t.tensor_type.name
        sizes[name] = sizes.get(name, 0) + int(t.n_elements)
    return tuple(sorted(sizes, key=lambda n: -sizes[n]))


def _gguf_precision(types: tuple[str, ...]) -> str:
    """The coarsest precision among a file's tensor types."""
    order = ["float64", "float32", "float16", "bfloat16", "int8", "int4"]
    found = [
        _GGUF_FLOAT.get(t, "int8" if t in _GGUF_EIGHT else "int4")
        for t in types
        if t not in ("I16", "I32", "I64")
    ]
    return max(found, key=order.index) if found else "float32"


@register
@dataclass(frozen=True, slots=True)
class Gguf(_QuantKind):
    """The model with a GGUF file's (dequantized) tensors as its parameters."""

    path: str
    help: ClassVar[str] = "gguf:FILE.gguf"

    def refuses(self, other: SideKind) -> str | None:
        from hookcli.commands.diff.sides import Setting

        if isinstance(other, Setting) and other.name in ("weights", "seed"):
            return f"the GGUF file's tensors replace every weight, so {other.name}= would be lost"
        return _QuantKind.refuses(self, other)

    @classmethod
    def parse(cls, key: str, value: str | None, raw: str, option: str) -> SideKind | None:
        if not key.startswith("gguf:") or value is not None:
            return None
        from hookcli.io.output import user_path

        path = user_path(key.partition(":")[2].strip(), f"{option} gguf:")
        if not path.is_file():
            raise UsageError(
                f"{option} {raw!r}: GGUF file {path} not found.",
                f"give the file's path, e.g. {option} gguf:model-Q4_0.gguf.",
            )
        return cls(str(path))

    @property
    def precision(self) -> str | None:
        return _gguf_precision(gguf_types(self.path))

    def prepare(self, prepared: Prepared) -> None:
        side = f"gguf:{self.path}"
        module = _hf_model(prepared, side)
        _in_memory(prepared, side)
        _needs("gguf", side)
        from transformers import modeling_gguf_pytorch_utils as hf_gguf

        from hookcli.sources import quiet_warnings

        gguf_types(self.path)  # a file that is not GGUF: its one line, before transformers'
        bar = getattr(hf_gguf, _BAR)  # a bar per tensor: tqdm's own, not transformers' logging
        setattr(hf_gguf, _BAR, _no_bar)
        try:
            with quiet_warnings():  # the metadata first: a wrong file fails before the tensors
                meta = hf_gguf.load_gguf_checkpoint(self.path)  # type: ignore[no-untyped-call]
                _same_architecture(side, meta.get("config", {}), module.config)
                parsed = hf_gguf.load_gguf_checkpoint(  # type: ignore[no-untyped-call]
                    self.path,
                    return_tensors=True,
                    model_to_load=module,
                    torch_dtype=next(module.parameters()).dtype,  # not all of it in float32
                )
        except (ValueError, NotImplementedError, KeyError) as exc:
            raise UsageError(
                f"{side}: transformers cannot load it into {type(module).__name__} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}).",
                "give a GGUF file of the model's architecture.",
            ) from exc
        finally:
            setattr(hf_gguf, _BAR, bar)
        tensors: dict[str, torch.Tensor] = parsed["tensors"]
        params = dict(module.named_parameters())
        missing = [n for n in params if n not in tensors]
        if missing:
            raise UsageError(
                f"{side} has no tensor for {len(missing)} of the model's parameters "
                f"(first {missing[0]}).",
                "give a GGUF file converted from this model's architecture.",
            )
        for name, t in tensors.items():
            p = params.get(name)
            if p is not None and tuple(p.shape) != tuple(t.shape):
                raise UsageError(
                    f"{side}: {name} is {tuple(t.shape)} in the file, "
                    f"{tuple(p.shape)} in the model.",
                    "give a GGUF file of the same architecture and sizes.",
                )
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(tensors[name])
        prepared.notes.append(
            f"side {side}: its {', '.join(gguf_types(self.path))} tensors dequantized "
            "(gguf package) into the model's parameters"
        )
        unread = [n for n in tensors if n not in params]
        head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        if "lm_head.weight" in unread and isinstance(head, nn.Linear):
            # a model that ties its head to the embeddings, a file with an output.weight of its
            # own: llama.cpp reads that one, so side B's head is untied to hold it
            t = tensors["lm_head.weight"]
            head.weight = nn.Parameter(t.to(head.weight.device, head.weight.dtype))
            unread.remove("lm_head.weight")
            prepared.notes.append(
                f"side {side}: the file's output.weight is its own (the model ties its head to "
                "the embeddings): side B's head holds it, untied, as llama.cpp reads the file"
            )
        if unread:
            prepared.notes.append(
                f"side {side}: {len(unread)} of the file's tensors have no parameter of the model "
                f"to go into, left unread: {', '.join(unread[:4])}"
            )


_BAR = "tqdm"  # transformers' GGUF reader's progress bar, by name


def _no_bar(items: Any, *args: Any, **kwargs: Any) -> Any:
    """tqdm's stand-in while transformers reads a GGUF file: the items, no bar on stderr."""
    return items


def _same_architecture(
    side: str, found: dict[str, Any], config: Any, what: str = "file", kind: str = "a GGUF file"
) -> None:
    """One line naming the first config fields a side's `what` (a GGUF file, a checkpoint
    folder: `kind`) and the model disagree on."""
    want = str(config.model_type)
    got = str(found.get("model_type", "?"))
    if got != want and not (want.endswith("_text") and want.startswith(got)):
        raise UsageError(
            f"{side} is a {got} model; the model is a {want}.",
            f"give {kind} of the model's architecture.",
        )
    diffs = [
        f"{f} {found[f]} in the {what}, {getattr(config, f)} in the model"
        for f in _SHAPE_FIELDS
        if f in found and getattr(config, f, None) is not None and found[f] != getattr(config, f)
    ]
    if diffs:
        raise UsageError(
            f"{side} does not match the model: {'; '.join(diffs)}.",
            f"give {kind} of this model (same vocabulary and sizes).",
        )


# ---------------------------------------------------------------- torchao

_TORCHAO = ("int8wo", "int4wo", "int8dq")
INT4_GROUP = 128  # torchao's default group of input channels for int4 weights


def _some_linear(prepared: Prepared, side: str, found: bool) -> None:
    if not found:
        raise UsageError(
            f"the {side} side quantizes Linear layers; {prepared.loaded.spec} has none.",
            "diff a model with Linear layers (a transformer, an MLP).",
        )


def _linears(module: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            yield name, m


def _group_hint(widths: list[int]) -> str:
    """The largest of torchao's usual int4 group sizes that divides every width, if any."""
    group = next((g for g in (256, 128, 64, 32) if all(w % g == 0 for w in widths)), None)
    if group is None:
        return "no group of 32 or more divides them: torchao:int8wo quantizes any width."
    return f"give a group that divides them: torchao:int4wo:{group}."


@register
@dataclass(frozen=True, slots=True)
class Torchao(_QuantKind):
    """Every Linear quantized by torchao's `quantize_`."""

    scheme: str
    group: int = INT4_GROUP
    help: ClassVar[str] = "torchao:int8wo|int4wo[:G]|int8dq"

    @classmethod
    def parse(cls, key: str, value: str | None, raw: str, option: str) -> SideKind | None:
        if not key.startswith("torchao:") or value is not None:
            return None
        scheme, _, group = key.partition(":")[2].lower().partition(":")
        if scheme not in _TORCHAO or (group and scheme != "int4wo"):
            raise UsageError(
                f"{option} {raw!r}: torchao has no scheme {key.partition(':')[2]!r} here.",
                f"the schemes are {', '.join(_TORCHAO)} (int4wo:G groups G input channels).",
            )
        if not group:
            return cls(scheme)
        from hookcli import bounds

        size = bounds.integer(
            group, f"{option} torchao:int4wo:G", low=1, high=1 << 20, example="int4wo:32"
        )
        return cls(scheme, size)

    @property
    def precision(self) -> str | None:
        return "int4" if self.scheme == "int4wo" else "int8"

    def prepare(self, prepared: Prepared) -> None:
        side = f"torchao:{self.scheme}"
        _in_memory(prepared, side)
        tq = _needs("torchao.quantization", side)

        from hookcli.sources import quiet_warnings

        module = prepared.loaded.module
        linears = dict(_linears(module))
        _some_linear(prepared, side, bool(linears))
        config: Any
        skipped: list[str] = []
        if self.scheme == "int8wo":
            config = tq.Int8WeightOnlyConfig()
        elif self.scheme == "int8dq":
            config = tq.Int8DynamicActivationInt8WeightConfig()
        else:
            skipped = [n for n, m in linears.items() if m.in_features % self.group]
            if len(skipped) == len(linears):  # side B would be side A: no quantization report
                widths = sorted({m.in_features for m in linears.values()})
                raise UsageError(
                    f"{side} quantizes none of {prepared.loaded.spec}'s {len(linears)} Linear "
                    f"layers: no input width ({', '.join(map(str, widths[:6]))}) is a multiple "
                    f"of the group {self.group}.",
                    _group_hint(widths),
                )
            config = self._int4(tq, prepared.device, next(module.parameters()).dtype)
        keep = set(skipped)

        def chosen(m: nn.Module, name: str) -> bool:
            return isinstance(m, nn.Linear) and name not in keep

        try:
            with quiet_warnings():
                tq.quantize_(module, config, filter_fn=chosen)
        except (
            RuntimeError,
            ValueError,
            ImportError,
            NotImplementedError,
            AssertionError,
            TypeError,
            AttributeError,
        ) as exc:  # fmt: skip  (torchao checks with assert)
            raise UsageError(
                f"torchao could not quantize {prepared.loaded.spec} as {side} on "
                f"{prepared.device.type}: {type(exc).__name__}: {str(exc).splitlines()[0]}.",
                "try another scheme (torchao:int8wo), or another device.",
            ) from exc
        if isinstance(config, tq.IntxWeightOnlyConfig):
            prepared.notes.append(
                f"side {side}: int4 weights in groups of {self.group} by torchao's "
                "IntxWeightOnlyConfig, asymmetric (Int4WeightOnlyConfig's kernel needs CUDA, "
                "its kernels' package and a bfloat16 model; its zero points are floats, so "
                "its values differ slightly)"
            )
        if skipped:
            prepared.notes.append(
                f"side {side}: {len(skipped)} Linear layers left unquantized, their input "
                f"width not a multiple of the group {self.group} (first {skipped[0]})"
            )

    def _int4(self, tq: Any, device: torch.device, dtype: torch.dtype) -> Any:
        """int4 weights: torchao's Int4WeightOnlyConfig where its kernel runs (CUDA, with its
        kernels' package, a bfloat16 model: the only activations it takes), else
        IntxWeightOnlyConfig's int4 in the same groups, asymmetric as Int4WeightOnlyConfig's
        (its zero points integers, where tinygemm's are floats)."""
        if device.type == "cuda" and dtype == torch.bfloat16:
            try:
                import mslk  # noqa: F401  (torchao's int4 kernels)

                return tq.Int4WeightOnlyConfig(group_size=self.group)
            except ImportError:
                pass
        from torchao.quantization.granularity import PerGroup
        from torchao.quantization.quant_primitives import MappingType

        return tq.IntxWeightOnlyConfig(
            weight_dtype=torch.int4,  # type: ignore[attr-defined]
            granularity=PerGroup(self.group),
            mapping_type=MappingType.ASYMMETRIC,
        )


# ---------------------------------------------------------------- bitsandbytes

_BNB = ("nf4", "int8")


@register
@dataclass(frozen=True, slots=True)
class Bnb(_QuantKind):
    """Every Linear replaced by bitsandbytes' Linear4bit (NF4) or Linear8bitLt, under the
    same name, its weights quantized from the model's."""

    scheme: str
    help: ClassVar[str] = "bnb:nf4|int8"

    @classmethod
    def parse(cls, key: str, value: str | None, raw: str, option: str) -> SideKind | None:
        if not key.startswith("bnb:") or value is not None:
            return None
        scheme = key.partition(":")[2].lower()
        if scheme not in _BNB:
            raise UsageError(
                f"{option} {raw!r}: bitsandbytes has no scheme {scheme!r} here.",
                "the schemes are nf4 and int8.",
            )
        return cls(scheme)

    @property
    def precision(self) -> str | None:
        return "int4" if self.scheme == "nf4" else "int8"

    def prepare(self, prepared: Prepared) -> None:
        side = f"bnb:{self.scheme}"
        _in_memory(prepared, side)
        bnb = _needs("bitsandbytes", side)
        from hookcli.sources import quiet_warnings

        module = prepared.loaded.module
        head = getattr(module, "get_output_embeddings", lambda: None)()
        kept = [n for n, m in _linears(module) if m is head]
        linears = [(n, m) for n, m in _linears(module) if m is not head]
        _some_linear(prepared, side, bool(linears))
        if kept:
            prepared.notes.append(
                f"side {side}: the output head {kept[0]} left unquantized, as transformers' "
                "bitsandbytes loading leaves it"
            )
        try:
            with quiet_warnings(), torch.no_grad():
                for name, lin in linears:
                    _replace(module, name, self._quantized(bnb, lin, prepared.device))
        except (
            RuntimeError, ValueError, NotImplementedError, AssertionError, TypeError,
            AttributeError,
        ) as exc:  # fmt: skip
            raise UsageError(
                f"bitsandbytes cannot run {side} on {prepared.device.type} here: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}.",
                "use torchao:int4wo or a gguf: side instead, or run where bitsandbytes has "
                "a backend (CUDA).",
            ) from exc
        _retarget(prepared, module)

    def _quantized(self, bnb: Any, lin: nn.Linear, device: torch.device) -> nn.Module:
        w = lin.weight.detach()
        if self.scheme == "nf4":
            new = bnb.nn.Linear4bit(
                lin.in_features,
                lin.out_features,
                bias=lin.bias is not None,
                compute_dtype=torch.float32,  # BitsAndBytesConfig's bnb_4bit_compute_dtype
                quant_type="nf4",
                device="meta",
            )
            new.weight = bnb.nn.Params4bit(  # blocks of 64, their scales in float32 (no double
                w.float().cpu().clone(),  # quantization): transformers' BitsAndBytesConfig's
                requires_grad=False,
                quant_type="nf4",
                blocksize=64,
                compress_statistics=False,
            )
        else:
            new = bnb.nn.Linear8bitLt(
                lin.in_features,
                lin.out_features,
                bias=lin.bias is not None,
                has_fp16_weights=False,
                threshold=6.0,  # LLM.int8's outliers in float16: BitsAndBytesConfig's default
                device="meta",
            )
            new.weight = bnb.nn.Int8Params(
                w.half().cpu().clone(), requires_grad=False, has_fp16_weights=False
            )
        if lin.bias is not None:
            new.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        new.train(lin.training)
        moved: nn.Module = new.to(device)  # bitsandbytes quantizes the weight as it moves
        return moved


def _retarget(prepared: Prepared, module: nn.Module) -> None:
    """The side's module (changed in place, or another) as the one its pass hooks: its entries
    anew, each selected target the module now under its name."""
    from hookcli.engine.selection import module_entries

    prepared.loaded.module = module
    prepared.entries = module_entries(module)
    by_name = dict(module.named_modules())
    prepared.targets = [t for t in prepared.targets if t.name in by_name]
    for t in prepared.targets:
        t.module = by_name[t.name]


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)


# ---------------------------------------------------------------- a quantized checkpoint


def _folder_precision(path: str) -> str | None:
    """The precision a checkpoint folder's config.json names: its quantization_config's bits
    (4 or fewer: int4; else int8), else its dtype; None where it names neither."""
    import json

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") or {}
    if isinstance(quant, dict) and quant:
        bits = [quant.get("bits"), quant.get("weight_bits")]
        groups = quant.get("config_groups")  # compressed-tensors: each group's weights' bits
        if isinstance(groups, dict):
            bits += [(g.get("weights") or {}).get("num_bits") for g in groups.values()]
        four = quant.get("load_in_4bit") or quant.get("_load_in_4bit")
        four = four or quant.get("quant_method") == "mxfp4"
        if four or any(isinstance(b, int) and b <= 4 for b in bits):
            return "int4"
        return "int8"
    dtype = config.get("torch_dtype") or config.get("dtype")
    return str(dtype) if dtype in ("float32", "float16", "bfloat16", "float64") else None


@register
@dataclass(frozen=True, slots=True)
class HfFolder(_QuantKind):
    """Another checkpoint of the same architecture, as transformers loads it: a quantized
    folder (bitsandbytes, torchao, compressed-tensors, GPTQ, AWQ — each where its package runs
    here), loaded into the model's own class, never with remote code."""

    path: str
    help: ClassVar[str] = "hf:FOLDER"

    def refuses(self, other: SideKind) -> str | None:
        from hookcli.commands.diff.sides import Autocast, Setting

        if isinstance(other, Autocast) or (isinstance(other, Setting) and other.name == "device"):
            return None
        return f"the folder's model replaces the loaded one, so {other.help} would be lost"

    @classmethod
    def parse(cls, key: str, value: str | None, raw: str, option: str) -> SideKind | None:
        if not key.startswith("hf:") or value is not None:
            return None
        from hookcli.io.output import user_path

        path = user_path(key.partition(":")[2].strip(), f"{option} hf:")
        if not (path / "config.json").is_file():
            raise UsageError(
                f"{option} {raw!r}: {path} is not a checkpoint folder (no config.json there).",
                f"give a folder saved with save_pretrained, e.g. {option} hf:./model-int4.",
            )
        return cls(str(path))

    @property
    def precision(self) -> str | None:
        return _folder_precision(self.path)

    def prepare(self, prepared: Prepared) -> None:
        side = f"hf:{self.path}"
        module = _hf_model(prepared, side)
        from hookcli.sources import quiet_warnings
        from hookcli.sources.base import import_extra
        from hookcli.sources.hf import misfits, unreadable, unused_only

        tf = import_extra("transformers", "hf", f"{side} sides")
        try:
            with quiet_warnings():
                config = tf.AutoConfig.from_pretrained(self.path)  # config.json: no code run
        except (ValueError, OSError, KeyError) as exc:
            raise UsageError(
                f"{side}: transformers cannot read its config.json ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}).",
                "give a folder saved with save_pretrained of the model's architecture.",
            ) from exc
        _same_architecture(side, config.to_dict(), module.config, "folder", "a checkpoint folder")
        quant = getattr(config, "quantization_config", None)
        method = (quant or {}).get("quant_method") if isinstance(quant, dict) else None
        # the side's own load (or copy) of the model, of which only the class and config are
        # used: its weights go before the folder's come in (one model's worth held at a time)
        with contextlib.suppress(Exception):  # (a quantized model may refuse: then kept)
            module.to(torch.device("meta"))
        try:
            with quiet_warnings():
                other, info = type(module).from_pretrained(
                    self.path,
                    device_map={"": str(prepared.device)},
                    trust_remote_code=False,
                    output_loading_info=True,
                )
        except Exception as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if unreadable(exc):  # (safetensors' own error for a file cut short)
                raise UsageError(
                    f"{side}: its weights cannot be read: {why}",
                    "write the folder again with save_pretrained: its model*.safetensors "
                    "files and their index are the weights.",
                ) from exc
            if not isinstance(exc, ImportError | RuntimeError | ValueError):
                raise
            raise UsageError(
                f"transformers cannot load {side} here"
                + (f" (quantized with {method})" if method else "")
                + f": {why}",
                "install what its quantization needs, or diff it where it runs (--device).",
            ) from exc
        wrong = misfits(info)
        if wrong and not unused_only(info):
            raise UsageError(  # (a side part random is no side of this model)
                f"{side}'s weights do not fit {type(other).__name__}: {'; '.join(wrong)}.",
                "give a folder saved with save_pretrained from this model's architecture.",
            )
        if wrong:  # weights the class has no place for (a head, for a base model): said
            prepared.notes.append(f"side {side}: the folder's weights {wrong[0]}")
        other.train(module.training)
        _retarget(prepared, other)
        prepared.notes.append(
            f"side {side}: {type(other).__name__} as transformers loads the folder"
            + (f", quantized with {method}" if method else "")
        )


# ---------------------------------------------------------------- the weights, side by side


_DENSE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dense_weight(module: nn.Module) -> torch.Tensor | None:
    """A layer's weight as a plain floating-point tensor (dequantized where a quantizer holds
    it: torchao's tensor subclasses, bitsandbytes' Params4bit and Int8Params, torch's
    quantized tensors); None for a module with no materialised weight of two or more
    dimensions, or one held in a form not read here (float8 with a scale of its own, GPTQ's
    packed integers)."""
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.is_meta or isinstance(w, nn.UninitializedParameter):
        return None
    kind = type(w).__name__
    with torch.no_grad():
        if kind == "Params4bit":
            import bitsandbytes.functional as bf

            state = getattr(w, "quant_state", None)
            if state is None:
                return None
            dense = bf.dequantize_4bit(w.data, state)
        elif kind == "Int8Params":  # row scales: the weight's until a forward moves them
            scale = getattr(w, "SCB", None)
            if scale is None:
                scale = getattr(getattr(module, "state", None), "SCB", None)
            if scale is None:
                return None
            dense = w.data.float() * (scale.float().reshape(-1, 1) / 127.0)
        elif w.is_quantized or (type(w) is not nn.Parameter and hasattr(w, "dequantize")):
            dense = w.dequantize()
        else:
            dense = w
    dense = dense.detach()
    return dense if dense.dim() >= 2 and dense.dtype in _DENSE else None


_CHUNK = 1 << 22  # elements summed at a time in float64 on the CPU (an embedding is large)


def _sums(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float] | torch.Tensor:
    """Σa² and Σ(a-b)² in float64 (NaN where some element is not finite). On CUDA, diff's sums
    by the fused kernel, left on the device (`_settled` brings them over together); else on
    the CPU (any device: MPS has no float64), a bounded piece at a time."""
    if a.is_cuda and b.device == a.device:
        fused = devicerow.diff_sums(a, b)
        if fused is not None:
            return fused
    fa, fb = a.reshape(-1), b.reshape(-1)
    signal = noise = 0.0
    for start in range(0, fa.numel(), _CHUNK):
        x = fa[start : start + _CHUNK].to("cpu", torch.float64)
        y = fb[start : start + _CHUNK].to("cpu", torch.float64)
        signal += float(x.square().sum())
        noise += float((x - y).square().sum())
    return signal, noise


def _settled(
    measured: list[tuple[str, nn.Module, nn.Module, int, tuple[float, float] | torch.Tensor]],
) -> Iterator[tuple[str, nn.Module, nn.Module, int, tuple[float, float]]]:
    """Each weight's (Σa², Σ(a-b)²), those left on a device brought over in one transfer per
    device: the kernel's sums over the elements finite on both sides, NaN where one was not."""
    host: dict[int, tuple[float, float]] = {}
    for ks in by_device((k, got) for k, (*_, got) in enumerate(measured)).values():
        rows = torch.stack([measured[k][4] for k in ks]).cpu().tolist()  # type: ignore[misc]
        for k, row in zip(ks, rows, strict=True):
            host[k] = (math.nan, math.nan) if row[5] else (row[1], row[0])
    for k, (name, ma, mb, numel, got) in enumerate(measured):
        yield name, ma, mb, numel, host[k] if isinstance(got, torch.Tensor) else got


def weight_distances(a: nn.Module, b: nn.Module) -> tuple[list[WeightDistance], list[str]]:
    """Each layer with a weight on both sides (same name, same shape once dense): the SQNR of
    side B's weight against side A's, in float64, lowest first (a weight not finite on a side
    first of all, with no figure); layers whose weights are equal left out. And notes: the
    layers whose weight could not be read on a side, counted, never dropped in silence."""
    found: list[WeightDistance] = []
    unread: list[str] = []
    bad: list[str] = []  # NaN/Inf on a side
    if a is b:
        return found, []
    b_modules = dict(b.named_modules())
    measured: list[tuple[str, nn.Module, nn.Module, int, tuple[float, float] | torch.Tensor]] = []
    for name, ma in a.named_modules():
        mb = b_modules.get(name)
        if mb is None or not isinstance(getattr(ma, "weight", None), torch.Tensor):
            continue
        try:
            wa, wb = dense_weight(ma), dense_weight(mb)
            if wa is None:
                continue
            if wb is None or wb.shape != wa.shape:
                if getattr(mb, "weight", None) is not None or hasattr(mb, "qweight"):
                    unread.append(name)
                continue
            measured.append((name, ma, mb, wa.numel(), _sums(wa, wb)))
        except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError):
            unread.append(name)
    for name, ma, mb, numel, (signal, noise) in _settled(measured):
        type_b = type(mb).__name__ if type(mb) is not type(ma) else None
        if not (math.isfinite(signal) and math.isfinite(noise)):
            bad.append(name)
            found.append(WeightDistance(name, type(ma).__name__, None, None, numel, type_b))
            continue
        if noise == 0.0:
            continue
        sqnr = 10 * math.log10(signal / noise) if signal > 0 else None
        rel = math.sqrt(noise / signal) if signal > 0 else None
        found.append(WeightDistance(name, type(ma).__name__, sqnr, rel, numel, type_b))
    found.sort(key=lambda d: (d.sqnr_db is not None, d.sqnr_db or 0.0))
    notes = []
    if bad:
        notes.append(
            f"weights: {len(bad)} layers hold NaN/Inf on a side (first {bad[0]}), listed "
            "first with no SQNR"
        )
    if unread:
        notes.append(
            f"weights: {len(unread)} layers' weights could not be read dense on side B "
            f"(first {unread[0]}: a packed or scaled format not read here), not compared"
        )
    return found, notes
