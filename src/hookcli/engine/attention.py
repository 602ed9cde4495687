"""Attention probabilities of a model's transformer blocks, read without editing the model.

Three kinds of attention module are read, each the way its library allows:

- torch `nn.MultiheadAttention` (torchvision's ViT): a forward pre-hook (`with_kwargs=True`)
  asks for the weights (`need_weights=True, average_attn_weights=False`) and a forward hook
  reads `output[1]`, (B, heads, L, S); the hook then hands the block what it asked for (None,
  or the average over heads), so the model computes what it computes without hookcli;
- timm attention modules (`timm.layers.Attention` and its kin: a boolean `fused_attn` and an
  `attn_drop` submodule): the fused kernel is switched off for the pass and restored after,
  even on error; the non-fused path computes `attn = attn.softmax(dim=-1)` then
  `attn = self.attn_drop(attn)`, so a forward hook on `attn_drop` reads the probabilities;
- Hugging Face transformers models: the pass runs with eager attention
  (`set_attn_implementation("eager")`; a model that cannot switch dynamically, such as
  Falcon, gets `config._attn_implementation = "eager"`, which its own code reads; every
  config's implementation put back after) and `output_attentions=True`; the probabilities
  are the output's `*attentions` fields (`attentions`; an encoder-decoder's
  `encoder_attentions`, `decoder_attentions` and `cross_attentions`), each matched by
  identity to the module call that returned it. The modules are those transformers records
  `attentions` / `cross_attentions` from (`_can_record_outputs`, each PreTrainedModel's
  table over its own submodules, as transformers applies them); a model without such a table
  (Falcon, Bloom, GPT-Neo … whose own code collects what `output_attentions=True` returns)
  has as attention modules the innermost modules whose forward takes `output_attentions`.
  A tensor in `cross_attentions` is cross-attention: queries of the decoder, keys of the
  encoder. A returned "attention" that is not 4-D (batch, heads, queries, keys) is kept as
  its shape only: which dimension is the head is never guessed. The output-capturing hooks
  transformers installs on a model's first `output_attentions=True` are removed after, with
  its flag.

An encoder-decoder (a transformers config's `is_encoder_decoder`, whose `get_encoder()` is
a submodule; or a module with `encoder` and `decoder` submodules) gives each site its side:
`encoder` or `decoder`.

A *block* is what `attn -l` names: the nearest ancestor of an attention module that is one
element of a ModuleList/Sequential stack (torchvision `encoder.layers.encoder_layer_3`, timm
`blocks.3`, Hugging Face `vit.layers.3`, `bert.encoder.layer.3`), else the module's parent.
Naming the attention module itself, or a module between it and its block, names the block.

The model is left as found: the pass runs through `engine.passes.hooked_pass` (mode, device,
buffers, gradients), and every hook, `fused_attn` flag and attention implementation changed
here is put back in a `finally`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hookcli.engine.hooks import HookSession
from hookcli.engine.passes import hooked_pass
from hookcli.engine.prepare import Prepared
from hookcli.engine.selection import select
from hookcli.errors import UsageError

MHA, TIMM, HF = "torch", "timm", "hf"
HOW = {
    MHA: "nn.MultiheadAttention asked for need_weights=True, average_attn_weights=False "
    "(the block gets what it asked for)",
    TIMM: "timm attention with fused_attn off for the pass (restored after), read after "
    "softmax at attn_drop",
    HF: "transformers eager attention with output_attentions=True (implementation restored after)",
}
# MultiheadAttention.forward(query, key, value, key_padding_mask, need_weights, attn_mask,
# average_attn_weights, is_causal): the positions of the two flags among its arguments
_NEED_WEIGHTS, _AVERAGE = 4, 6
_MISSING = object()
# a module's forward-hook tables: hooks transformers adds during the pass are removed from all
_HOOK_TABLES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
)
_HF_FLAG = "_output_capturing_hooks_installed"


@dataclass(frozen=True, slots=True)
class AttentionSite:
    """One attention module and the block it belongs to."""

    name: str  # the attention module's dotted name
    block: str  # the block -l names
    kind: str  # MHA, TIMM or HF
    type: str  # its class name
    module: nn.Module
    path: tuple[str, ...]  # the block, the modules between, the attention module: all name it
    cross: bool = False  # transformers records it as cross-attention (its cross_attentions)
    side: str = ""  # an encoder-decoder's ENCODER or DECODER side; "" in any other model


@dataclass(slots=True)
class AttentionCall:
    """One call of one attention module: its probabilities (when kept) and their mean over
    heads (always: the rollout's input), float32."""

    site: AttentionSite
    call: int
    shape: tuple[int, ...]  # (B, heads, queries, keys)
    mean: torch.Tensor | None  # (B, queries, keys); None when the shape is not 4-D
    probs: torch.Tensor | None = None  # (B, heads, queries, keys), for the sites asked for
    heads: torch.Tensor | None = None  # per head (engine.heads), when the pass asked for them
    cross: bool = False  # cross-attention: queries of one sequence (the decoder's), keys of another

    @property
    def square(self) -> bool:
        """Attention of (B, heads, L, L): as many queries as keys."""
        return len(self.shape) == 4 and self.shape[2] == self.shape[3]

    @property
    def self_attention(self) -> bool:
        """Self-attention over one token sequence: square and not cross-attention (a
        cross-attention whose two sequences have one length is square too)."""
        return self.square and not self.cross


@dataclass(slots=True)
class AttentionPass:
    """Every attention call of one forward, in the order they ran, and the model's output."""

    calls: list[AttentionCall]
    output: Any
    notes: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # how the probabilities were read
    hf_was: str | None = None  # Hugging Face: the attention implementation before eager


# ---------------------------------------------------------------- finding attention modules

ENCODER, DECODER = "encoder", "decoder"
_SELF_KEY, _CROSS_KEY = "attentions", "cross_attentions"
# a recorder spec: (its _can_record_outputs key, class, class-name suffix, layer name)
_Spec = tuple[str, type | None, str | None, str | None]


def _is_hf(model: nn.Module) -> bool:
    """A transformers PreTrainedModel (its forward takes output_attentions)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in type(model).__mro__
    )


def _hf_specs(model: nn.Module) -> list[_Spec]:
    """What this one PreTrainedModel records `attentions` and `cross_attentions` from (its
    class's `_can_record_outputs`: a class, a name, an OutputRecorder or a list of them)."""
    table = getattr(type(model), "_can_record_outputs", None)
    if not isinstance(table, Mapping):
        return []
    specs: list[_Spec] = []
    for key in (_SELF_KEY, _CROSS_KEY):
        entry = table.get(key)
        for spec in entry if isinstance(entry, list | tuple) else [entry]:
            if spec is None:
                continue
            if isinstance(spec, type):
                specs.append((key, spec, None, None))
            elif isinstance(spec, str):
                specs.append((key, None, spec, None))
            else:  # OutputRecorder
                specs.append(
                    (
                        key,
                        getattr(spec, "target_class", None),
                        getattr(spec, "class_name", None),
                        getattr(spec, "layer_name", None),
                    )
                )
    return specs


def _hf_recorded(name: str, module: nn.Module, specs: Sequence[_Spec]) -> str | None:
    """The key transformers records this module's output under (its own matching rule), or
    None."""
    for key, cls, suffix, layer in specs:
        by_class = cls is not None and isinstance(module, cls)
        by_name = suffix is not None and name.endswith(suffix)
        if (by_class or by_name) and (layer is None or f".{layer.strip('.')}." in f".{name}."):
            return key
    return None


_TAKES: dict[type, bool] = {}


def _takes_output_attentions(module: nn.Module) -> bool:
    """Whether the module's forward names an `output_attentions` parameter (not **kwargs)."""
    cls = type(module)
    if cls not in _TAKES:
        try:
            params = inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        _TAKES[cls] = "output_attentions" in params
    return _TAKES[cls]


def _hf_sites(model: nn.Module) -> dict[str, bool]:
    """Each attention module of a transformers model: its name → whether it is
    cross-attention. Each PreTrainedModel's table applies to its own submodules up to the next
    PreTrainedModel, as transformers installs its recorders. Under a PreTrainedModel that
    records no attention (Falcon, Bloom …: its own code collects what output_attentions
    returns), the innermost modules whose forward takes `output_attentions`."""
    recorded: dict[str, bool] = {}
    untabled: list[str] = []  # modules under a PreTrainedModel recording no attention

    def walk(module: nn.Module, name: str, specs: list[_Spec], pretrained: bool) -> None:
        key = _hf_recorded(name, module, specs) if specs else None
        if key is not None:
            recorded[name] = key == _CROSS_KEY
        elif not specs and name and not pretrained and _takes_output_attentions(module):
            untabled.append(name)
        for child, sub in module.named_children():
            full = f"{name}.{child}" if name else child
            own = _is_hf(sub)
            walk(sub, full, _hf_specs(sub) if own else specs, own)

    walk(model, "", _hf_specs(model), True)

    def holds(outer: str, names: Sequence[str]) -> bool:
        return any(n.startswith(outer + ".") for n in names)

    found = dict(recorded)
    for name in untabled:
        if not holds(name, untabled) and not holds(name, list(recorded)):
            found[name] = False
    return found


def _is_timm(module: nn.Module) -> bool:
    """timm's attention convention: a boolean `fused_attn` and an `attn_drop` submodule
    applied to the probabilities on the non-fused path."""
    return isinstance(getattr(module, "fused_attn", None), bool) and isinstance(
        getattr(module, "attn_drop", None), nn.Module
    )


def encoder_of(model: nn.Module) -> str | None:
    """The encoder's dotted name in an encoder-decoder: a transformers model whose config is
    `is_encoder_decoder` (its `get_encoder()`), or a module with `encoder` and `decoder`
    submodules (torch nn.Transformer); None in any other model."""
    found: Any = None
    if _is_hf(model) and getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        get = getattr(model, "get_encoder", None)
        try:
            found = get() if callable(get) else None
        except Exception:  # a model whose lookup needs what it lacks: no encoder known
            found = None
    elif isinstance(getattr(model, "encoder", None), nn.Module) and isinstance(
        getattr(model, "decoder", None), nn.Module
    ):
        found = model.encoder
    if not isinstance(found, nn.Module) or found is model:
        return None
    return next((n for n, m in model.named_modules() if m is found and n), None)


def find_attention(model: nn.Module) -> list[AttentionSite]:
    """The attention modules hookcli can read, in registration order, with their blocks.
    An attention module inside another one is the outer one's business, not a site."""
    modules = dict(model.named_modules())
    hf = _hf_sites(model) if _is_hf(model) else {}
    found: list[tuple[str, nn.Module, str]] = []
    for name, module in modules.items():
        if not name or any(name.startswith(f + ".") for f, _, _ in found):
            continue
        if isinstance(module, nn.MultiheadAttention):
            found.append((name, module, MHA))
        elif _is_timm(module):
            found.append((name, module, TIMM))
        elif name in hf:
            found.append((name, module, HF))
    names = [n for n, _, _ in found]
    encoder = encoder_of(model)
    sites = []
    for name, module, kind in found:
        block = _block_of(name, modules, names)
        path = [block]
        rest = name[len(block) :].lstrip(".").split(".") if name != block else []
        for part in rest:
            path.append(f"{path[-1]}.{part}")
        side = ""
        if encoder is not None:
            side = ENCODER if name.startswith(encoder + ".") else DECODER
        sites.append(
            AttentionSite(
                name,
                block,
                kind,
                type(module).__name__,
                module,
                tuple(path),
                cross=hf.get(name, False),
                side=side,
            )
        )
    return sites


def _block_of(name: str, modules: Mapping[str, nn.Module], sites: Sequence[str]) -> str:
    """The nearest ancestor that is one element of a ModuleList/Sequential stack and holds
    only this attention module; else the parent holding only it; else the module itself."""

    def alone(ancestor: str) -> bool:
        return sum(1 for s in sites if s == ancestor or s.startswith(ancestor + ".")) == 1

    parts = name.split(".")
    ancestors = [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
    for ancestor in ancestors:
        if not alone(ancestor):
            break
        container = modules.get(ancestor.rpartition(".")[0])
        if isinstance(container, nn.ModuleList | nn.Sequential):
            return ancestor
    if ancestors and alone(ancestors[0]):
        return ancestors[0]
    return name


def describe_blocks(sites: Sequence[AttentionSite]) -> str:
    """`blocks.0 … blocks.11 (12 blocks)`, or every block when there are few."""
    blocks = list(dict.fromkeys(s.block for s in sites))
    if len(blocks) <= 4:
        return ", ".join(blocks)
    return f"{blocks[0]}, {blocks[1]} … {blocks[-1]} ({len(blocks)} blocks)"


def no_attention(label: str) -> UsageError:
    return UsageError(
        f"{label} has no attention module hookcli can read (torch nn.MultiheadAttention, a "
        "timm attention module with fused_attn, or a Hugging Face model's attention layers).",
        "attn needs a transformer, e.g. `hookcli attn vit_b_16 IMAGE -o attn.png`; "
        f"`hookcli layers {label}` shows the modules.",
    )


def default_block(sites: Sequence[AttentionSite]) -> str:
    """The block attn draws without -l: the last self-attention block, of an encoder-decoder
    its encoder's (the self-attention over the given text; its decoder's runs over the
    decoder's own tokens, its cross-attention from those to the text)."""
    own = [s for s in sites if not s.cross]
    encoder = [s for s in own if s.side != DECODER]
    return (encoder or own or list(sites))[-1].block


def _cross_word(site: AttentionSite) -> str:
    return " (cross-attention)" if site.cross else ""


def pick_block(prepared: Prepared, sites: Sequence[AttentionSite], pattern: str | None) -> str:
    """The block -l names (a dotted name or a glob, as everywhere; the attention module or a
    module between it and its block name the block too); default: `default_block`."""
    label = prepared.loaded.spec
    if not sites:
        raise no_attention(label)
    if pattern is None:
        return default_block(sites)
    by_name = {name: site.block for site in sites for name in site.path}
    targets = select(prepared.entries, layers=[pattern], model_label=label)
    blocks = list(
        dict.fromkeys(by_name[n] for t in targets for n in (t.name, *t.aliases) if n in by_name)
    )
    if not blocks:
        shown = ", ".join(t.name for t in targets[:3]) + ("…" if len(targets) > 3 else "")
        what = f"{shown} ({targets[0].type})" if len(targets) == 1 else shown
        inside = [
            s for s in sites for t in targets for n in (t.name, *t.aliases)
            if s.name.startswith(n + ".")
        ]  # fmt: skip
        inside = list({s.name: s for s in inside}.values())
        if inside:
            listed = ", ".join(s.name + _cross_word(s) for s in inside[:4])
            raise UsageError(
                f"-l {pattern!r} matches {what}, which holds {len(inside)} attention "
                f"blocks ({listed}{'…' if len(inside) > 4 else ''}); attn draws one.",
                f"name one of them, e.g. -l {inside[0].block}.",
            )
        raise UsageError(
            f"-l {pattern!r} matches {what}, which is not an attention block; the blocks are "
            f"{describe_blocks(sites)}.",
            f"name one of them, e.g. -l {default_block(sites)}.",
        )
    if len(blocks) > 1:
        shown = ", ".join(blocks[:4]) + ("…" if len(blocks) > 4 else "")
        raise UsageError(
            f"-l {pattern!r} matches {len(blocks)} attention blocks ({shown}); attn draws one.",
            f"name one block exactly, e.g. -l {blocks[-1]}.",
        )
    return blocks[0]


# ---------------------------------------------------------------- reading them in one pass


# a self-attention call's per-head numbers, from its site and probabilities (B, H, L, L)
PerHead = Callable[[AttentionSite, torch.Tensor], Any]


class _Recorder:
    """Where the hooks put what they read: one AttentionCall per call, in order."""

    def __init__(self, keep: set[str], per_head: PerHead | None) -> None:
        self.keep = keep  # attention module names whose per-head probabilities are kept
        self.per_head = per_head  # each self-attention call's per-head numbers, as it comes
        self.calls: list[AttentionCall] = []
        self.counts: dict[str, int] = {}
        self.problems: list[str] = []
        self.hf_outputs: list[tuple[AttentionSite, int, list[torch.Tensor]]] = []
        self.hf_was: str | None = None  # the attention implementation before eager

    def reset(self) -> None:
        """A forward starts (again): forget what an earlier one recorded."""
        self.calls.clear()
        self.counts.clear()
        self.hf_outputs.clear()

    def next_call(self, site: AttentionSite) -> int:
        call = self.counts.get(site.name, 0)
        self.counts[site.name] = call + 1
        return call

    def add(
        self,
        site: AttentionSite,
        weights: torch.Tensor,
        call: int | None = None,
        cross: bool = False,
    ) -> None:
        w = weights.detach()
        if call is None:
            call = self.next_call(site)
        if w.dim() != 4:  # which dimension is the head cannot be told: only its shape is kept
            self.calls.append(AttentionCall(site, call, tuple(w.shape), None, cross=cross))
            return
        probs = w.float()
        mean = probs.mean(dim=1)
        kept = probs.clone() if site.name in self.keep else None
        heads = None
        if self.per_head is not None and w.shape[2] == w.shape[3] and not cross:
            heads = self.per_head(site, w)
        self.calls.append(AttentionCall(site, call, tuple(w.shape), mean, kept, heads, cross))


def _mha_hooks(site: AttentionSite, rec: _Recorder) -> list[RemovableHandle]:
    """Ask MultiheadAttention for per-head weights, read them, and return to the block what
    it asked for: None when it asked for none, the mean over heads when it asked for that."""
    asked: list[tuple[bool, bool]] = []

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        values, named = list(args), dict(kwargs)
        need = values[_NEED_WEIGHTS] if len(values) > _NEED_WEIGHTS else named.get("need_weights")
        average = values[_AVERAGE] if len(values) > _AVERAGE else named.get("average_attn_weights")
        asked.append(
            (True if need is None else bool(need), True if average is None else bool(average))
        )
        if len(values) > _NEED_WEIGHTS:
            values[_NEED_WEIGHTS] = True
        else:
            named["need_weights"] = True
        if len(values) > _AVERAGE:
            values[_AVERAGE] = False
        else:
            named["average_attn_weights"] = False
        return tuple(values), named

    def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        need, average = asked.pop() if asked else (True, False)
        if not isinstance(output, tuple) or len(output) != 2:
            return None
        out, weights = output
        replaced: Any = None
        if not need:
            replaced = (out, None)
        elif average and isinstance(weights, torch.Tensor):
            replaced = (out, weights.mean(dim=weights.dim() - 3))  # as MultiheadAttention does
        if isinstance(weights, torch.Tensor):
            try:
                rec.add(site, weights if weights.dim() == 4 else weights.unsqueeze(0))
            except Exception as exc:  # never break the forward
                rec.problems.append(f"{site.name}: {exc}")
        return replaced

    return [
        site.module.register_forward_pre_hook(pre, with_kwargs=True),
        site.module.register_forward_hook(post),
    ]


def _timm_hook(site: AttentionSite, rec: _Recorder) -> RemovableHandle:
    drop = site.module.attn_drop
    assert isinstance(drop, nn.Module)

    def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if isinstance(output, torch.Tensor):
            try:
                rec.add(site, output)
            except Exception as exc:
                rec.problems.append(f"{site.name}: {exc}")

    return drop.register_forward_hook(post)


def _hf_hook(site: AttentionSite, rec: _Recorder) -> RemovableHandle:
    """Each call's returned tensors that may be its attention, kept (alive, so that no later
    tensor takes an id) to match the output's attentions by identity: every 4-D one, and any
    after the first of a tuple (the first is the module's output; an "attention" that is not
    4-D — flash attention's output in its place — is matched, then refused by its shape)."""

    def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        items = output if isinstance(output, tuple | list) else (output,)
        held = [
            t
            for i, t in enumerate(items)
            if isinstance(t, torch.Tensor) and (t.dim() == 4 or i > 0)
        ]
        rec.hf_outputs.append((site, rec.next_call(site), held))

    return site.module.register_forward_hook(post)


def _hf_configs(model: nn.Module) -> list[Any]:
    """Every config the model's attention implementation lives in: each PreTrainedModel's,
    and their sub-configs, each once."""
    seen: dict[int, Any] = {}
    todo = [getattr(m, "config", None) for m in model.modules() if _is_hf(m)]
    while todo:
        config = todo.pop()
        if config is None or id(config) in seen:
            continue
        seen[id(config)] = config
        for key in getattr(config, "sub_configs", None) or {}:
            todo.append(getattr(config, key, None))
    return list(seen.values())


@contextlib.contextmanager
def _hf_eager(model: nn.Module) -> Iterator[str]:
    """Eager attention for the pass; every config's implementation, the output-capturing hooks
    transformers installs and its flag put back after. Yields the implementation it was."""
    configs = _hf_configs(model)
    saved = [(c, c.__dict__.get("_attn_implementation_internal", _MISSING)) for c in configs]
    modules = list(model.modules())
    flags = [(m, m.__dict__.get(_HF_FLAG, _MISSING)) for m in modules]
    tables = [(m, t, set(getattr(m, t, {}))) for m in modules for t in _HOOK_TABLES]
    before = str(getattr(getattr(model, "config", None), "_attn_implementation", None))
    try:
        config: Any = getattr(model, "config", None)
        setter = getattr(model, "set_attn_implementation", None)
        quiet = logging.getLogger("transformers")  # its warnings would break the one-line error
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            if callable(setter):
                setter("eager")
            if getattr(config, "_attn_implementation", None) != "eager":
                # a model that cannot switch dynamically (Falcon, Bloom …) reads its config's
                # implementation in its own forward: that is what is set (put back after)
                for each in configs:
                    each._attn_implementation = "eager"
        finally:
            quiet.setLevel(level)
        now = getattr(config, "_attn_implementation", None)
        if now != "eager":
            raise UsageError(
                f"{type(model).__name__} cannot switch to eager attention (it stays {now}), "
                "so transformers returns no attention probabilities.",
                "load the model with attn_implementation='eager'.",
            )
        yield before
    finally:
        for config, value in saved:
            if value is _MISSING:
                config.__dict__.pop("_attn_implementation_internal", None)
            else:
                config.__dict__["_attn_implementation_internal"] = value
        for m, value in flags:
            if value is _MISSING:
                m.__dict__.pop(_HF_FLAG, None)
            else:
                m.__dict__[_HF_FLAG] = value
        for m, t, keys in tables:
            table = getattr(m, t, None)
            if isinstance(table, dict):
                for key in [k for k in table if k not in keys]:
                    del table[key]


@contextlib.contextmanager
def _reading(
    model: nn.Module, sites: Sequence[AttentionSite], rec: _Recorder
) -> Iterator[list[str]]:
    """The hooks and switches of every kind of site, all undone on exit."""
    handles: list[RemovableHandle] = []
    fused: list[tuple[nn.Module, object]] = []  # timm modules and their own fused_attn
    kinds = list(dict.fromkeys(s.kind for s in sites))
    with contextlib.ExitStack() as stack:
        try:
            handles.append(model.register_forward_pre_hook(lambda m, a: rec.reset()))
            for site in sites:
                if site.kind == MHA:
                    handles += _mha_hooks(site, rec)
                elif site.kind == TIMM:
                    fused.append((site.module, vars(site.module).get("fused_attn", _MISSING)))
                    vars(site.module)["fused_attn"] = False
                    handles.append(_timm_hook(site, rec))
                else:
                    handles.append(_hf_hook(site, rec))
            if HF in kinds:
                rec.hf_was = stack.enter_context(_hf_eager(model))
            yield kinds
        finally:
            for handle in handles:
                handle.remove()
            for module, value in fused:  # the instance's own value, or none (its class's)
                if value is _MISSING:
                    vars(module).pop("fused_attn", None)
                else:
                    vars(module)["fused_attn"] = value


def _hf_attentions(output: Any) -> dict[int, tuple[torch.Tensor, bool]] | None:
    """The tensors of the output's `*attentions` fields (`attentions`, `encoder_attentions`,
    `decoder_attentions`, `cross_attentions` …) by identity, each with whether it is
    cross-attention; None when the output has no such field (a tuple)."""
    if not isinstance(output, Mapping):
        return None
    fields = [(str(k), v) for k, v in output.items() if str(k).endswith("attentions")]
    if not fields:
        return None
    found: dict[int, tuple[torch.Tensor, bool]] = {}
    for key, value in fields:
        for t in value if isinstance(value, tuple | list) else ():
            if isinstance(t, torch.Tensor):
                found.setdefault(id(t), (t, key.endswith(_CROSS_KEY)))
    return found


def capture_attention(
    prepared: Prepared,
    sites: Sequence[AttentionSite],
    keep: set[str],
    per_head: PerHead | None = None,
) -> AttentionPass:
    """One forward with every attention site read: each call's mean over heads, and the
    per-head probabilities of the sites named in `keep`; `per_head` is applied to each
    self-attention call's probabilities as they come (AttentionCall.heads). The model is
    left as found."""
    rec = _Recorder(keep, per_head)
    x = prepared.model_input
    assert x is not None
    model = prepared.loaded.module
    if any(s.kind == HF for s in sites):
        x = x.replace_args(x.args, {**x.kwargs, "output_attentions": True})
    notes: list[str] = []
    with _reading(model, sites, rec) as kinds:
        with hooked_pass(prepared, HookSession([], None), model_input=x) as result:
            output = result.output
            notes += result.notes
        if HF in kinds:
            _match_hf(rec, output, notes)
    if rec.problems:
        notes.append("could not read " + "; ".join(rec.problems[:3]))
    return AttentionPass(rec.calls, output, notes, kinds, rec.hf_was)


def _match_hf(rec: _Recorder, output: Any, notes: list[str]) -> None:
    """The output's attentions, each to the module call that returned it (by identity), in
    the order the calls ran; without them (a tuple output), what the modules returned (their
    first 4-D tensor)."""
    attentions = _hf_attentions(output)
    calls = list(rec.hf_outputs)
    if attentions is None:
        notes.append("the model returned no `attentions`: read from its attention modules")
        for site, call, held in calls:
            four = [t for t in held if t.dim() == 4]
            if four:
                rec.add(site, four[0], call, site.cross)
        return
    used: set[int] = set()
    for site, call, held in calls:
        hit = next((t for t in held if id(t) in attentions and id(t) not in used), None)
        if hit is None:
            continue
        used.add(id(hit))
        rec.add(site, hit, call, attentions[id(hit)][1] or site.cross)
    unmatched = len(attentions) - len(used)
    if unmatched:
        notes.append(
            f"{unmatched} of the model's attentions came from modules hookcli does not know: "
            "left out"
        )


def rollout(means: Sequence[torch.Tensor]) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020) of blocks' head-averaged probabilities, in the
    order they ran, each (B, L, L): add the identity for the residual connection, renormalise
    each row to sum to 1, multiply through the blocks (R = Â_n ··· Â_1). Float64, (B, L, L)."""
    first = means[0]
    b, n, _ = first.shape
    eye = torch.eye(n, dtype=torch.float64, device=first.device)
    result = eye.expand(b, n, n).clone()
    for mean in means:
        a = mean.double() + eye
        a = a / a.sum(dim=-1, keepdim=True)
        result = a @ result
    return result
