"""Listings: the module tree (`hookcli layers`), the torchvision registry (`hookcli models`) and
what a saved safetensors file holds (`hookcli show`)."""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from hookcli.commands.inspect import input_info, model_info
from hookcli.commands.memory import tied_names
from hookcli.engine.hooks import HookSession
from hookcli.engine.measure import statistics
from hookcli.engine.passes import hooked_pass
from hookcli.engine.prepare import build_input, prepare
from hookcli.engine.selection import ROOT_LABEL, dtypes_held, has_lazy, recount
from hookcli.errors import ModelError, UsageError, not_a_file, one_line
from hookcli.options import InputOptions, ModelOptions, Selection
from hookcli.records import (
    KVCache,
    LayerCall,
    LayersReport,
    ModelEntry,
    ModuleRow,
    SavedFile,
    WeightBytes,
)
from hookcli.sources import TASKS
from hookcli.sources.torchvision import registry_names, task_of, weights_enum


def layers_report(
    model: ModelOptions,
    inputs: InputOptions = InputOptions(),
    *,
    shapes: bool = False,
    depth: int | None = None,
) -> LayersReport:
    """The module tree; with shapes, one forward fills output shapes and call counts. Built on
    the meta device (model.meta), the forward runs there too: shapes and each module's FLOPs
    with no weight read or allocated."""
    if depth is not None and depth < 1:
        raise UsageError(
            f"--depth must be 1 or more, got {depth}.", "use --depth 1 for top-level blocks."
        )
    shapes = shapes or model.meta
    if not shapes:  # no pass: no device, no input
        model = dataclasses.replace(model, device="cpu")
    prepared = prepare(model, Selection(every=True) if shapes else None, inputs if shapes else None)
    if not shapes and has_lazy(prepared.loaded.module):
        # lazy parameters get their sizes in a first forward: run one, unhooked
        x = build_input(prepared.loaded, inputs, model.seed).to(prepared.device)
        with hooked_pass(prepared, HookSession([], None), model_input=x):
            pass
        recount(prepared.entries)
    session = HookSession(prepared.targets, None)
    if shapes:
        assert prepared.model_input is not None
        try:
            with _meta_kernels(model.meta), hooked_pass(prepared, session):
                pass
        except ModelError as exc:
            if model.meta and _reads_values(exc.__cause__ or exc):
                raise ModelError(
                    f"{prepared.loaded.spec}'s forward reads a tensor's values, which the meta "
                    f"device does not have ({one_line(exc.__cause__ or exc)}).",
                    "drop --meta: --shapes runs the forward with real (random) weights.",
                ) from exc
            raise
        recount(prepared.entries)  # lazy parameters are materialised now
    rows = [
        ModuleRow(
            e.name or ROOT_LABEL,
            e.type,
            e.depth,
            e.params,
            e.own_params,
            e.leaf,
            e.names[1:],
            hookable=e.unhookable is None,
        )
        for e in prepared.entries
        if depth is None or e.depth <= depth
    ]
    tied: dict[str, list[str]] = {}
    for name, met in tied_names(prepared.loaded.module):
        owner, _, attr = name.rpartition(".")
        tied.setdefault(owner or ROOT_LABEL, []).append(f"{attr} = {met}")
    for row in rows:
        row.tied = tied.get(row.name, [])
    info = None
    flops = None
    if model.meta:
        from hookcli.engine.flops import count_flops

        with _meta_kernels(True):
            count = count_flops(prepared)
        if count.note:
            prepared.notes.append(count.note)
        flops = count.forward
        per: dict[str, int] = {}
        for (name, _), n in count.by_call.items():
            per[name] = per.get(name, 0) + n
        for row in rows:
            row.flops = per.get(row.name)
    if shapes:
        assert prepared.model_input is not None
        first: dict[str, LayerCall] = {}
        for p in session.calls:
            first.setdefault(p.call.name, p.call)
        counts = {t.name: n for t, n in zip(prepared.targets, session.counts, strict=True)}
        for row in rows:
            call = first.get(row.name)
            row.calls = counts.get(row.name, 0)
            if call is not None:
                row.output_shapes = [
                    ("" if o.path == "out" else o.path.removeprefix("out") + " ")
                    + "x".join(map(str, o.shape))
                    for o in call.outputs
                ]
        info = input_info(prepared.model_input)
    notes = list(dict.fromkeys(prepared.loaded.notes + prepared.notes))
    module = prepared.loaded.module
    return LayersReport(
        model_info(prepared.loaded),
        rows,
        info,
        flops,
        notes,
        weights=weight_bytes(module),
        kv_cache=kv_cache(module) if _is_causal_lm(module, prepared.loaded.task) else None,
    )


# what torch says when code reads a meta tensor's values (not any failure that names "meta":
# a model called meta-llama/…, a folder under /tmp/meta, a shape error on the meta device)
_VALUE_READS = (
    "cannot be called on meta tensors",
    "cannot copy out of meta tensor",
    "meta device type tensor",
    "correct data-independent implementation does not exist",
    "data-dependent",
    "on device meta is not on the expected device",
)


def _reads_values(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(phrase in text for phrase in _VALUE_READS)


def _meta_kernels(meta: bool) -> contextlib.AbstractContextManager[None]:
    """On the meta device, a mixture-of-experts model's fused experts run in every dtype
    (engine/flops.py's grouped_mm_on_meta); elsewhere nothing changes."""
    if not meta:
        return contextlib.nullcontext()
    from hookcli.engine.flops import grouped_mm_on_meta

    return grouped_mm_on_meta()


def _metric(meta: Mapping[str, Any]) -> str | None:
    metrics = meta.get("_metrics") or {}
    for dataset, values in metrics.items():
        for key, value in values.items():
            return f"{dataset} {key} {value}"
    return None


SOURCES = ("torchvision", "timm", "hf")


def list_models(
    pattern: str | None = None, task: str | None = None, source: str = "torchvision"
) -> list[ModelEntry]:
    """`hookcli models`: torchvision's registry, timm's (`--source timm`), or the Hugging Face
    model types with a classification head (`--source hf`); GLOB on the name after the prefix."""
    if source == "torchvision":
        return list_registry(pattern, task)
    if source not in SOURCES:
        raise UsageError(f"unknown source {source!r}.", f"use one of: {', '.join(SOURCES)}.")
    if task is not None and task != "classification":
        raise UsageError(
            f"--source {source} lists classification models only, not {task}.",
            "drop --task, or use --source torchvision.",
        )
    out = _timm_entries(pattern) if source == "timm" else _hf_entries(pattern)
    if not out:
        raise UsageError(
            f"no {source} model matching {pattern!r}.",
            f"run `hookcli models --source {source}` to list them all.",
        )
    return out


def _timm_entries(pattern: str | None) -> list[ModelEntry]:
    from hookcli.sources.timm import list_timm, pretrained_tags

    tags = pretrained_tags()
    out = []
    for name in list_timm(pattern):
        own = tags.get(name, ([], None))
        out.append(
            ModelEntry(
                name=f"timm:{name}",
                task="classification",
                weights=own[0],
                default=own[0][0] if own[0] else None,
                params=None,
                input_size=own[1],
                metric=None,
            )
        )
    return out


def _hf_entries(pattern: str | None) -> list[ModelEntry]:
    from hookcli.sources.hf import model_types

    kinds = [("image", "classification"), ("text", "text-classification")]
    return [
        ModelEntry(f"hf:{t}", task, [], None, None, None, None)
        for kind, task in kinds
        for t in model_types(kind)
        if not pattern or fnmatch.fnmatchcase(t, pattern)
    ]


def list_registry(pattern: str | None = None, task: str | None = None) -> list[ModelEntry]:
    if task is not None and task not in TASKS:
        raise UsageError(f"unknown task {task!r}.", f"use one of: {', '.join(TASKS)}.")
    out: list[ModelEntry] = []
    for name in registry_names():
        if pattern and not fnmatch.fnmatchcase(name, pattern):
            continue
        t = task_of(name)
        if task is not None and t != task:
            continue
        enum = weights_enum(name)
        members = [w.name for w in enum] if enum is not None else []
        default = enum.DEFAULT if enum is not None else None
        size = None
        if default is not None:
            crop = getattr(default.transforms(), "crop_size", None)
            size = f"{crop[0]}" if crop else None
        out.append(
            ModelEntry(
                name=name,
                task=t,
                weights=members,
                default=default.name if default is not None else None,
                params=default.meta.get("num_params") if default is not None else None,
                input_size=size,
                metric=_metric(default.meta) if default is not None else None,
            )
        )
    if not out:
        what = f" matching {pattern!r}" if pattern else ""
        raise UsageError(
            f"no registry model{what}{f' in task {task}' if task else ''}.",
            "run `hookcli models` to list them all.",
        )
    return out


def show_file(path: str | Path) -> SavedFile:
    """Every tensor in a .safetensors file, with its statistics; metadata as stored."""
    from safetensors import safe_open

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{p} {not_a_file(p)}.", "give a file written by --save.")
    try:
        with safe_open(str(p), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            collector = statistics()
            tensors = [collector.add(f.get_tensor(key), key) for key in f.keys()]  # noqa: SIM118
    except Exception as exc:
        raise UsageError(
            f"{p} is not a readable safetensors file: {exc}", "give a file written by --save."
        ) from exc
    collector.finalize()
    return SavedFile(str(p), metadata, tensors)


# ---------------------------------------------------------------- weight and KV-cache bytes

# a parameter's bytes in each dtype the weights are also given in (int4: two to a byte)
WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")
WEIGHTS_ASSUME = (
    "every parameter in that one dtype, each once (tied weights once); int8 1 byte and int4 "
    "half a byte a parameter, without the scales and zero points a quantized format adds"
)


def weight_bytes(module: nn.Module) -> WeightBytes:
    """The parameters' bytes as held (by dtype) and as they would be in each of
    WEIGHT_DTYPES: each parameter once (`parameters()` yields a shared, tied one once), as
    the parameter count is. On the meta device a tensor's shape and dtype are all this
    reads."""
    held: dict[str, int] = {}
    n = 0
    for p in [p for p in module.parameters() if not is_lazy(p)]:
        n += p.numel()
        name = str(p.dtype).removeprefix("torch.")
        held[name] = held.get(name, 0) + p.numel() * p.element_size()
    buffers = sum(b.numel() * b.element_size() for b in module.buffers() if not is_lazy(b))
    as_dtype = {"float32": 4 * n, "bfloat16": 2 * n, "float16": 2 * n, "int8": n}
    as_dtype["int4"] = (n + 1) // 2
    ordered = dict(sorted(held.items(), key=lambda kv: -kv[1]))
    return WeightBytes(n, sum(held.values()), ordered, as_dtype, buffers, WEIGHTS_ASSUME)


def _is_causal_lm(module: nn.Module, task: str) -> bool:
    """A decoder that generates with a KV cache: built as a causal LM, or a bare decoder
    whose config's type transformers builds as one (--head base)."""
    if task == "causal-lm":
        return True
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str) or getattr(config, "is_encoder_decoder", False):
        return False
    try:
        from hookcli.sources.hf import type_head

        return type_head(model_type) == "causal-lm"
    except Exception:  # no transformers: not one of its models
        return False


def _int(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# layer types (config.layer_types, as transformers names them) whose cache grows a token at a
# time, those that cache nothing, and those with a fixed-size state (not per token)
_FULL, _WINDOWED = ("full_attention",), ("sliding_attention", "chunked_attention")
_NO_CACHE = ("dummy", "moe", "mlp")
_FIXED_STATE = ("linear_attention", "mamba", "conv")
# config fields that would change a layer's cache in ways not read here: when present (and
# no num_key_value_heads says the answer), the cache is not guessed
_UNREAD = (
    "multi_query", "num_kv_heads", "n_head_kv", "multi_query_group_num", "kv_channels",
    "layers_block_type", "hybrid_override_pattern", "attn_layer_indices", "attn_layer_period",
    "block_types",
)  # fmt: skip


@dataclasses.dataclass(slots=True)
class _Layer:
    """One block's cache: values a token (None: no cache), and the tokens it keeps at most
    (None: every token)."""

    values: int | None
    window: int | None = None
    kind: str = "full_attention"
    heads: tuple[int | None, int | None] = (None, None)  # KV heads, head size (None: MLA)


def kv_cache(module: nn.Module) -> KVCache:
    """The KV cache a causal LM adds a token, from its config: 2 (key, value) x KV heads x
    head size a layer (grouped- and multi-query attention: num_key_value_heads; none given:
    every head its own), MLA's compressed latent (kv_lora_rank + qk_rope_head_dim) where the
    config has a kv_lora_rank; sliding-window and chunked layers keep their window at most,
    only where the config says so (layer_types, else sliding_window or attention_chunk_size,
    as transformers reads them). What cannot be told is said (note), not guessed."""
    dtype = dtypes_held(module)[0]
    size = torch.empty((), dtype=getattr(torch, dtype, torch.float32)).element_size()
    out = KVCache(dtype, None)
    config = getattr(module, "config", None)
    text = getattr(config, "get_text_config", None)
    if callable(text):
        try:
            config = text(decoder=True)
        except TypeError:  # transformers before decoder=
            config = text()
    if config is None:
        out.note = "unknown: the model has no config to read its attention from"
        return out
    out.context = _int(config, "max_position_embeddings")
    layers = _int(config, "num_hidden_layers")
    if layers is None:
        out.note = "unknown: its config names no num_hidden_layers"
        return out
    out.layers = layers
    blocks = _blocks(config, layers, out)
    if isinstance(blocks, str):
        out.note = f"unknown: {blocks}"
        return out
    cached = [b for b in blocks if b.values is not None]
    full = [b for b in cached if b.window is None]
    windowed = [b for b in cached if b.window is not None]
    out.bytes_per_token = sum(b.values or 0 for b in cached) * size
    out.full_bytes = sum(b.values or 0 for b in full) * size
    out.full_layers = len(full)
    out.sliding_layers = len(windowed)
    windows = {b.window for b in windowed}
    out.window = windows.pop() if len(windows) == 1 else None
    if out.context is not None:
        out.bytes_at_context = out.full_bytes * out.context + sum(
            (b.values or 0) * size * min(out.context, b.window or 0) for b in windowed
        )
    values = {(b.values, b.heads) for b in cached}
    one = values.pop() if len(values) == 1 else None
    what = f"{len(cached)} layers" if len(cached) != 1 else "1 layer"
    if one is None:
        total = sum(b.values or 0 for b in cached)
        out.formula = f"{total} values (keys and values, layers unlike) x {size} bytes"
        out.formula = out.formula if cached else ""
    elif one[1] == (None, None):  # MLA: one latent a token serves keys and values
        out.per_layer_values = one[0]
        rank, rope = _int(config, "kv_lora_rank"), _int(config, "qk_rope_head_dim")
        out.formula = (
            f"{what} x (kv_lora_rank {rank} + qk_rope_head_dim {rope}) x {size} bytes: "
            "MLA's compressed latent"
        )
    else:
        out.per_layer_values, (out.kv_heads, out.head_dim) = one
        out.formula = (
            f"2 (key, value) x {what} x {out.kv_heads} KV heads x {out.head_dim} head dim "
            f"x {size} bytes"
        )
    notes = [out.note] if out.note else []
    fixed = Counter(b.kind for b in blocks if b.kind in _FIXED_STATE)
    if fixed:
        kinds_ = ", ".join(f"{n} {k}" for k, n in fixed.items())
        notes.append(f"the {kinds_} layers keep a state of a fixed size, not counted")
    if len(cached) < layers and not fixed:
        notes.append(f"{layers - len(cached)} of the {layers} layers cache nothing")
    out.note = "; ".join(notes) or None
    return out


def _blocks(config: Any, layers: int, out: KVCache) -> list[_Layer] | str:
    """Each block's cache (per transformers' per-layer config where it has one), or why it
    cannot be told."""
    views = getattr(config, "per_layer_config", None)  # transformers' per-layer overrides
    try:
        per = list(views) if views is not None else []
    except Exception:
        per = []
    configs = per if len(per) == layers else [config] * layers
    kinds = _layer_kinds(config, layers)
    if isinstance(kinds, str):
        return kinds
    blocks: list[_Layer] = []
    for kind, c in zip(kinds, configs, strict=True):
        if kind in (*_NO_CACHE, *_FIXED_STATE):
            blocks.append(_Layer(None, kind=kind))
            continue
        read = _values(c, out)
        if isinstance(read, str):
            return read
        values, heads = read
        window = None
        if kind in _WINDOWED:
            field = "sliding_window" if kind == "sliding_attention" else "attention_chunk_size"
            window = _int(c, field)
            if window is None:
                return f"{kind} layers, but no {field} in its config"
        blocks.append(_Layer(values, window, kind, heads))
    return blocks


def _layer_kinds(config: Any, layers: int) -> list[str] | str:
    """Each block's kind as transformers' caches read it (config.layer_types; else every
    block sliding where the config names a sliding_window it uses, chunked where it names an
    attention_chunk_size), layers that reuse another's cache (kv_sharing_modes) caching
    nothing. A reason (a string) where that cannot be told."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        if not isinstance(types, list | tuple) or len(types) != layers:
            return f"its layer_types do not list its {layers} layers"
        kinds = [str(t) for t in types]
    elif getattr(config, "use_sliding_window", None) is False:
        kinds = ["full_attention"] * layers
    elif _int(config, "sliding_window") is not None:
        start = _int(config, "max_window_layers") if hasattr(config, "use_sliding_window") else 0
        kinds = [
            "sliding_attention" if i >= (start or 0) else "full_attention" for i in range(layers)
        ]
    elif _int(config, "attention_chunk_size") is not None:
        kinds = ["chunked_attention"] * layers
    else:
        kinds = ["full_attention"] * layers
    odd = sorted({k for k in kinds if k not in (*_FULL, *_WINDOWED, *_NO_CACHE, *_FIXED_STATE)})
    if odd:
        return f"layers of type {', '.join(odd)}, whose cache hookcli does not size"
    sharing = getattr(config, "kv_sharing_modes", None)
    if sharing is not None:
        if not isinstance(sharing, list | tuple) or len(sharing) != layers:
            return f"its kv_sharing_modes do not list its {layers} layers"
        kinds = ["dummy" if m == "reuse" else k for k, m in zip(kinds, sharing, strict=True)]
    elif (_int(config, "num_kv_shared_layers") or 0) > 0:
        return "num_kv_shared_layers: layers share caches in a way its config does not list"
    return kinds


def _values(config: Any, out: KVCache) -> tuple[int, tuple[int | None, int | None]] | str:
    """The values one token leaves in one attention layer's cache, with its KV heads and head
    size (a note on `out` where they are not read from the config); a reason where it cannot
    be told."""
    rank = _int(config, "kv_lora_rank")
    if rank is not None:  # MLA (DeepSeek-V2/V3): a latent for keys and values, and a rope key
        rope = _int(config, "qk_rope_head_dim")
        if rope is None:
            return "an MLA config (kv_lora_rank) with no qk_rope_head_dim"
        return rank + rope, (None, None)
    heads = _int(config, "num_attention_heads")
    if heads is None:
        return "its config names no num_attention_heads"
    kv = _int(config, "num_key_value_heads")
    if kv is None and getattr(config, "model_type", None) == "falcon":
        if getattr(config, "new_decoder_architecture", False):
            kv = _int(config, "num_kv_heads")
            out.note = (
                f"transformers' Falcon keeps keys and values expanded to all {heads} heads; "
                f"{kv} KV heads is what the architecture needs"
            )
        else:
            kv = 1 if getattr(config, "multi_query", False) else heads
    if kv is None:
        odd = [f for f in _UNREAD if getattr(config, f, None) not in (None, False)]
        if odd:
            return f"its config has {', '.join(odd)}, which hookcli does not read for the cache"
        kv = heads
        out.note = "no num_key_value_heads in its config: every head keeps its keys and values"
    head_dim = _int(config, "head_dim")
    hidden = _int(config, "hidden_size")
    if head_dim is None and hidden is not None and hidden % heads == 0:
        head_dim = hidden // heads
    if head_dim is None:
        return "its config names no head_dim, and hidden_size / num_attention_heads is not whole"
    return 2 * kv * head_dim, (kv, head_dim)
