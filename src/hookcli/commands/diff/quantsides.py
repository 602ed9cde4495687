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

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from hookcli.commands.diff.sides import SideKind, register
from hookcli.engine.prepare import Prepared
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
class Gguf(SideKind):
    """The model with a GGUF file's (dequantized) tensors as its parameters."""

    path: str
    help: ClassVar[str] = "gguf:FILE.gguf"
    changes_module: ClassVar[bool] = True

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
                    self.path, return_tensors=True, model_to_load=module
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


_BAR = "tqdm"  # transformers' GGUF reader's progress bar, by name


def _no_bar(items: Any, *args: Any, **kwargs: Any) -> Any:
    """tqdm's stand-in while transformers reads a GGUF file: the items, no bar on stderr."""
    return items


def _same_architecture(side: str, found: dict[str, Any], config: Any) -> None:
    """One line naming the first config fields a GGUF file and the model disagree on."""
    want = str(config.model_type)
    got = str(found.get("model_type", "?"))
    if got != want and not (want.endswith("_text") and want.startswith(got)):
        raise UsageError(
            f"{side} is a {got} model; the model is a {want}.",
            "give a GGUF file of the model's architecture.",
        )
    diffs = [
        f"{f} {found[f]} in the file, {getattr(config, f)} in the model"
        for f in _SHAPE_FIELDS
        if f in found and getattr(config, f, None) is not None and found[f] != getattr(config, f)
    ]
    if diffs:
        raise UsageError(
            f"{side} does not match the model: {'; '.join(diffs)}.",
            "give a GGUF file converted from this model (same vocabulary and sizes).",
        )


# ---------------------------------------------------------------- torchao

_TORCHAO = ("int8wo", "int4wo", "int8dq")
INT4_GROUP = 128  # torchao's default group of input channels for int4 weights


def _linears(module: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            yield name, m


@register
@dataclass(frozen=True, slots=True)
class Torchao(SideKind):
    """Every Linear quantized by torchao's `quantize_`."""

    scheme: str
    group: int = INT4_GROUP
    help: ClassVar[str] = "torchao:int8wo|int4wo[:G]|int8dq"
    changes_module: ClassVar[bool] = True

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
        tq = _needs("torchao.quantization", side)

        from hookcli.sources import quiet_warnings

        module = prepared.loaded.module
        linears = dict(_linears(module))
        if not linears:
            raise UsageError(
                f"the {side} side quantizes Linear layers; {prepared.loaded.spec} has none.",
                "diff a model with Linear layers (a transformer, an MLP).",
            )
        config: Any
        skipped: list[str] = []
        if self.scheme == "int8wo":
            config = tq.Int8WeightOnlyConfig()
        elif self.scheme == "int8dq":
            config = tq.Int8DynamicActivationInt8WeightConfig()
        else:
            skipped = [n for n, m in linears.items() if m.in_features % self.group]
            config = self._int4(tq, prepared.device)
        keep = set(skipped)

        def chosen(m: nn.Module, name: str) -> bool:
            return isinstance(m, nn.Linear) and name not in keep

        try:
            with quiet_warnings():
                tq.quantize_(module, config, filter_fn=chosen)
        except (RuntimeError, ValueError, ImportError, NotImplementedError) as exc:
            raise UsageError(
                f"torchao could not quantize {prepared.loaded.spec} as {side} on "
                f"{prepared.device.type}: {type(exc).__name__}: {str(exc).splitlines()[0]}.",
                "try another scheme (torchao:int8wo), or another device.",
            ) from exc
        if isinstance(config, tq.IntxWeightOnlyConfig):
            prepared.notes.append(
                f"side {side}: int4 weights in groups of {self.group} by torchao's "
                "IntxWeightOnlyConfig (Int4WeightOnlyConfig's kernel does not run here)"
            )
        if skipped:
            prepared.notes.append(
                f"side {side}: {len(skipped)} Linear layers left unquantized, their input "
                f"width not a multiple of the group {self.group} (first {skipped[0]})"
            )

    def _int4(self, tq: Any, device: torch.device) -> Any:
        """int4 weights: torchao's Int4WeightOnlyConfig where its kernel runs (CUDA, with its
        kernels' package), else IntxWeightOnlyConfig's int4 in the same groups."""
        if device.type == "cuda":
            try:
                import mslk  # noqa: F401  (torchao's int4 kernels)

                return tq.Int4WeightOnlyConfig(group_size=self.group)
            except ImportError:
                pass
        from torchao.quantization.granularity import PerGroup

        return tq.IntxWeightOnlyConfig(
            weight_dtype=torch.int4,  # type: ignore[attr-defined]
            granularity=PerGroup(self.group),
        )


# ---------------------------------------------------------------- bitsandbytes

_BNB = ("nf4", "int8")


@register
@dataclass(frozen=True, slots=True)
class Bnb(SideKind):
    """Every Linear replaced by bitsandbytes' Linear4bit (NF4) or Linear8bitLt, under the
    same name, its weights quantized from the model's."""

    scheme: str
    help: ClassVar[str] = "bnb:nf4|int8"
    changes_module: ClassVar[bool] = True

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
        bnb = _needs("bitsandbytes", side)
        from hookcli.sources import quiet_warnings

        module = prepared.loaded.module
        head = getattr(module, "get_output_embeddings", lambda: None)()
        kept = [n for n, m in _linears(module) if m is head]
        linears = [(n, m) for n, m in _linears(module) if m is not head]
        if not linears:
            raise UsageError(
                f"the {side} side quantizes Linear layers; {prepared.loaded.spec} has none.",
                "diff a model with Linear layers (a transformer, an MLP).",
            )
        if kept:
            prepared.notes.append(
                f"side {side}: the output head {kept[0]} left unquantized, as transformers' "
                "bitsandbytes loading leaves it"
            )
        try:
            with quiet_warnings(), torch.no_grad():
                for name, lin in linears:
                    _replace(module, name, self._quantized(bnb, lin, prepared.device))
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            raise UsageError(
                f"bitsandbytes cannot run {side} on {prepared.device.type} here: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}.",
                "use torchao:int4wo or a gguf: side instead, or run where bitsandbytes has "
                "a backend (CUDA).",
            ) from exc
        _retarget(prepared, module)

    def _quantized(self, bnb: Any, lin: nn.Linear, device: torch.device) -> nn.Module:
        w = lin.weight.detach()
        dtype = w.dtype
        if self.scheme == "nf4":
            new = bnb.nn.Linear4bit(
                lin.in_features,
                lin.out_features,
                bias=lin.bias is not None,
                compute_dtype=dtype,
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
        bits = quant.get("bits") or quant.get("weight_bits")
        if quant.get("load_in_4bit") or quant.get("_load_in_4bit") or (bits and bits <= 4):
            return "int4"
        return "int8"
    dtype = config.get("torch_dtype") or config.get("dtype")
    return str(dtype) if dtype in ("float32", "float16", "bfloat16", "float64") else None


@register
@dataclass(frozen=True, slots=True)
class HfFolder(SideKind):
    """Another checkpoint of the same architecture, as transformers loads it: a quantized
    folder (bitsandbytes, torchao, compressed-tensors, GPTQ, AWQ — each where its package runs
    here), loaded into the model's own class, never with remote code."""

    path: str
    help: ClassVar[str] = "hf:FOLDER"
    changes_module: ClassVar[bool] = True

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

        tf = import_extra("transformers", "hf", f"{side} sides")
        with quiet_warnings():
            config = tf.AutoConfig.from_pretrained(self.path)  # config.json: no code run
        _same_architecture(side, config.to_dict(), module.config)
        quant = getattr(config, "quantization_config", None)
        method = (quant or {}).get("quant_method") if isinstance(quant, dict) else None
        try:
            with quiet_warnings():
                other = type(module).from_pretrained(
                    self.path, device_map={"": str(prepared.device)}, trust_remote_code=False
                )
        except (ImportError, RuntimeError, ValueError, OSError) as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UsageError(
                f"transformers cannot load {side} here"
                + (f" (quantized with {method})" if method else "")
                + f": {why}",
                "install what its quantization needs, or diff it where it runs (--device).",
            ) from exc
        other.train(module.training)
        _retarget(prepared, other)
        prepared.notes.append(
            f"side {side}: {type(other).__name__} as transformers loads the folder"
            + (f", quantized with {method}" if method else "")
        )


# ---------------------------------------------------------------- the weights, side by side


def dense_weight(module: nn.Module) -> torch.Tensor | None:
    """A layer's weight as a plain floating-point tensor (dequantized where a quantizer holds
    it: torchao's tensor subclasses, bitsandbytes' Params4bit and Int8Params, torch's
    quantized tensors); None for a module with no materialised weight of two or more
    dimensions (bitsandbytes' 4-bit weight is stored flat: its shape is its state's)."""
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
    return dense if dense.dim() >= 2 and dense.is_floating_point() else None


_CHUNK = 1 << 22  # elements summed at a time in float64 (a vocabulary's embedding is large)


def _sums(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Σa² and Σ(a-b)² in float64, a bounded piece at a time."""
    fa, fb = a.reshape(-1), b.reshape(-1).to(a.device)
    signal = noise = 0.0
    for start in range(0, fa.numel(), _CHUNK):
        x = fa[start : start + _CHUNK].double()
        y = fb[start : start + _CHUNK].double()
        signal += float(x.square().sum())
        noise += float((x - y).square().sum())
    return signal, noise


def weight_distances(a: nn.Module, b: nn.Module) -> list[WeightDistance]:
    """Each layer with a weight on both sides (same name, same shape once dense): the SQNR of
    side B's weight against side A's, in float64; layers whose weights are equal left out."""
    found: list[WeightDistance] = []
    b_modules = dict(b.named_modules())
    for name, ma in a.named_modules():
        mb = b_modules.get(name)
        wa = dense_weight(ma) if mb is not None else None
        wb = dense_weight(mb) if wa is not None and mb is not None else None
        if wa is None or wb is None or wb.shape != wa.shape:
            continue
        signal, noise = _sums(wa, wb)
        if noise == 0.0 or not math.isfinite(noise):
            continue
        sqnr = 10 * math.log10(signal / noise) if signal > 0 else None
        rel = math.sqrt(noise / signal) if signal > 0 else None
        found.append(WeightDistance(name, type(mb).__name__, sqnr, rel, wa.numel()))
    found.sort(key=lambda d: (d.sqnr_db is None, d.sqnr_db or 0.0))
    return found
