"""--offload: which checkpoint tensors make each of the model's weights, as from_pretrained
decides it.

transformers 5 converts a checkpoint's names and layouts while it loads: a mixture-of-experts
checkpoint holds one matrix per expert (`experts.0.w1.weight`, ... or `experts.0.gate_proj.weight`,
...) where the model holds them fused (`experts.gate_up_proj`, num_experts x 2*inter x hidden),
and `save_pretrained` writes the per-expert layout back. Its conversion mapping for the model
(`conversion_mapping.get_model_conversion_mapping`: renamings, and converters such as
`MergeModulelist` + `Concatenate`) is applied here the way its loader applies it
(`core_model_loading.convert_and_load_state_dict_in_model`): each checkpoint name is renamed,
at most one converter claims it, and the names a converter claims for one model weight are
gathered in the loader's order. Nothing is read to plan: each conversion runs once on meta
tensors of the checkpoint's shapes and dtypes (the model weights it makes, and their shapes);
the real one runs when the block that holds its weights runs (`Fused.convert`).

Without transformers' conversion machinery (transformers 4, or a model that is not a
PreTrainedModel) a weight's name is the checkpoint's, or differs by the base model's prefix.
"""

from __future__ import annotations

import copy
import importlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from hookcli.errors import one_line


class Described(Protocol):
    """A checkpoint tensor's description (offload.Entry): no data."""

    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(eq=False, slots=True)
class Fused:
    """Checkpoint tensors one of transformers' converters turns into model weights (one or
    more): the experts of one MoE layer stacked and concatenated, say."""

    converter: Any  # a transformers WeightConverter, copied for each conversion
    first: str  # the model weight the loader files the conversion under
    sources: dict[str, list[str]]  # source pattern -> checkpoint names, in the loader's order
    dtype: torch.dtype  # each read is cast to it first, as the loader casts it
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # model weight -> shape

    def convert(
        self, read: Any, model: nn.Module, device: torch.device | None = None
    ) -> dict[str, torch.Tensor]:
        """The model weights it makes: `read(name)` gives a checkpoint tensor (a meta one to
        plan)."""
        converter = copy.deepcopy(self.converter)
        for pattern, keys in self.sources.items():
            for key in keys:
                tensor = read(key).to(device=device, dtype=self.dtype)
                converter.add_tensor(self.first, key, pattern, tensor)
        out = converter.convert(self.first, model=model, config=getattr(model, "config", None))
        return {str(k): (v[0] if isinstance(v, list) else v) for k, v in dict(out).items()}


@dataclass(slots=True)
class Plan:
    """Where each of the model's tensors (parameters and persistent buffers, by name) comes
    from: a checkpoint name read as it is, or a conversion."""

    sources: dict[str, str | Fused] = field(default_factory=dict)
    unmatched: list[str] = field(default_factory=list)  # checkpoint names no weight takes
    # a conversion that fails on the checkpoint's shapes -> (the tensors it was given, why)
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)
    conversions: bool = False  # whether transformers' conversion mapping was applied


def key(name: str, prefix: str, entries: Mapping[str, object]) -> str | None:
    """The checkpoint's name for a model's tensor: the same, or with the base model's prefix
    added or left out (a head model's checkpoint loaded bare, or the other way)."""
    if name in entries:
        return name
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1 :] in entries:
        return name[len(prefix) + 1 :]
    if prefix and f"{prefix}.{name}" in entries:
        return f"{prefix}.{name}"
    return None


def plan(model: nn.Module, entries: Mapping[str, Described], prefix: str) -> Plan:
    """Each model tensor's source in the checkpoint, as from_pretrained would take it."""
    wanted = _wanted(model)
    machinery = _machinery(model)
    if machinery is None:
        return _plain(wanted, entries, prefix)
    get_mapping, rename, natural, converter_type = machinery
    try:
        mapping = list(get_mapping(model))
    except Exception:  # (an architecture transformers' mapping cannot walk: as named)
        return _plain(wanted, entries, prefix)
    converters = [t for t in mapping if isinstance(t, converter_type)]
    renamings = [t for t in mapping if not isinstance(t, converter_type)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    out = Plan(conversions=True)
    groups: dict[str, Fused] = {}
    for original in sorted(entries, key=natural):
        renamed, pattern = rename(original, renamings, converters, prefix or None, wanted)
        if renamed not in wanted and original in wanted:  # (the loader's own fallback)
            renamed, pattern = rename(original, [], [], prefix or None, wanted)
        if renamed not in wanted:
            out.unmatched.append(original)
        elif pattern is None:
            out.sources.setdefault(renamed, original)
        else:
            group = groups.get(renamed)
            if group is None:
                group = groups[renamed] = Fused(
                    by_pattern[pattern], renamed, {}, wanted[renamed].dtype
                )
            group.sources.setdefault(pattern, []).append(original)
    for first, group in groups.items():
        try:
            made = group.convert(lambda k: _meta(entries[k]), model)
        except Exception as exc:  # (an operation that needs the values, or shapes that clash)
            held = " and ".join(
                f"{len(group.sources.get(p, []))} {p.strip('.')}"
                for p in group.converter.source_patterns
            )
            out.failed[first] = (held, one_line(exc))
            continue
        for name, tensor in made.items():
            if name in wanted:
                group.shapes[name] = tuple(tensor.shape)
                out.sources.setdefault(name, group)
            else:
                out.unmatched.append(name)
    return out


def _wanted(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors by every name they have (tied ones twice), persistent buffers
    included: what from_pretrained fills (the model's state dict)."""
    names: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names[name] = p
    for module_name, module in model.named_modules(remove_duplicate=False):
        persistent = set(module._buffers) - set(module._non_persistent_buffers_set)
        for name in persistent:
            b = module._buffers[name]
            if b is not None:
                names[f"{module_name}.{name}" if module_name else name] = b
    return names


def _plain(wanted: Iterable[str], entries: Mapping[str, Described], prefix: str) -> Plan:
    out = Plan()
    for name in wanted:
        found = key(name, prefix, entries)
        if found is not None:
            out.sources[name] = found
    taken = set(out.sources.values())
    out.unmatched = [k for k in entries if k not in taken]
    return out


def _machinery(model: nn.Module) -> tuple[Any, Any, Any, Any] | None:
    """transformers' conversion mapping and its loader's renaming, where it has them (5)."""
    try:
        mapping = importlib.import_module("transformers.conversion_mapping")
        loading = importlib.import_module("transformers.core_model_loading")
        pretrained = importlib.import_module("transformers.modeling_utils").PreTrainedModel
        found = (
            mapping.get_model_conversion_mapping,
            loading.rename_source_key,
            loading.dot_natural_key,
            loading.WeightConverter,
        )
    except (ImportError, AttributeError):
        return None
    if not isinstance(model, pretrained):
        return None
    return found


def _meta(entry: Described) -> torch.Tensor:
    return torch.empty(entry.shape, dtype=entry.dtype, device="meta")


def patterns(names: Iterable[str], most: int = 3) -> str:
    """Names with their numbers (layers, experts) folded: `model.layers.*.mlp.experts.*.w1.weight`,
    at most `most` of them, and how many more."""
    folded: dict[str, int] = {}
    for name in names:
        f = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)
        folded[f] = folded.get(f, 0) + 1
    shown = list(folded)[:most]
    more = len(folded) - len(shown)
    return ", ".join(shown) + (f" (+{more} more)" if more else "")
