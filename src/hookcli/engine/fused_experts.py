"""The routed experts of a fused MoE block, per expert (issue 48). transformers 5 keeps a
block's experts as one module holding 3-D parameters — `gate_up_proj` (or `up_proj`) of
(experts, out, in) and `down_proj` — and runs them by the implementation its config names
(`eager`: a Linear per expert; `grouped_mm`, `batched_mm`: one kernel over every expert). No
Linear module runs per expert, so a hook on Linears never sees them.

What each expert's projections read is found from the experts module's own call, whatever
implementation runs: its `forward(hidden_states, top_k_index, top_k_weights)` gives the rows
(tokens) routed to each expert — the up projection's input, a padded batch's padding rows left
out — and the down projection's input is computed from them as the eager implementation
computes it (the expert's own weights, `_apply_gate` or `act_fn`), under no_grad, beside the
model's run. Each projection's input is measured per input channel (engine.channels), on the
device, and read once at the end.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hookcli.engine.channels import measure_channels, unpack
from hookcli.records import ChannelStats

UP_NAMES = ("gate_up_proj", "up_proj")


def _param3(module: nn.Module, name: str) -> nn.Parameter | None:
    p = module._parameters.get(name)
    return p if isinstance(p, nn.Parameter) and p.dim() == 3 else None


def find_fused_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every fused experts module: one holding a 3-D `down_proj` and a 3-D `gate_up_proj` or
    `up_proj` (transformers' MixtralExperts, Qwen2MoeExperts, Qwen3MoeExperts, …)."""
    found = []
    for name, m in model.named_modules():
        if _param3(m, "down_proj") is not None and any(_param3(m, n) is not None for n in UP_NAMES):
            found.append((name, m))
    return found


def selected_experts(model: nn.Module, chosen: Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The fused experts modules a selection reaches: selected themselves, or a module of
    theirs selected (the default selection of leaves picks their activation)."""
    ids = {id(m) for m in chosen}
    return [
        (name, m)
        for name, m in find_fused_experts(model)
        if any(id(sub) in ids for sub in m.modules())
    ]


def pair_notes(model: nn.Module, selected: Iterable[str]) -> list[str]:
    """A padded batch: the selected modules inside a fused experts module (its activation)
    see (token, expert) pairs sorted by expert, the padding's pairs among them, which cannot
    be told apart by position: said, once per experts module."""
    names = list(selected)
    out = []
    for owner, _ in find_fused_experts(model):
        inside = [n for n in names if n.startswith(f"{owner}.")]
        if inside:
            out.append(
                f"{inside[0]}{' and others' if len(inside) > 1 else ''} inside {owner}: its "
                "rows are (token, expert) pairs sorted by expert, the padding's pairs among "
                "them (not read as positions); --channels reads each expert over its real "
                "tokens"
            )
    return out


def projections(module: nn.Module) -> list[str]:
    """The experts' projections in the order they run: up (gate_up_proj or up_proj), down."""
    up = next(n for n in UP_NAMES if _param3(module, n) is not None)
    return [up, "down_proj"]


def expert_layer(name: str, expert: int, projection: str) -> str:
    """How a calib report names one expert's projection: EXPERTS.E.PROJECTION, as the
    checkpoints of per-expert Linears name theirs (experts.3.down_proj)."""
    return f"{name}.{expert}.{projection}"


def expert_of(layer: str) -> tuple[str, int, str]:
    """expert_layer read back: (experts module, expert, projection)."""
    owner, e, projection = layer.rsplit(".", 2)
    return owner, int(e), projection


def weight_scales(module: nn.Module, projection: str, expert: int) -> torch.Tensor:
    """max|W| per input channel of one expert's projection: its (out, in) weight over rows,
    a transposed (in, out) one (`is_transposed`) over columns; float64 on the CPU."""
    weight: torch.Tensor = getattr(module, projection)[expert].detach().abs().double()
    return (weight.amax(1) if getattr(module, "is_transposed", False) else weight.amax(0)).cpu()


@dataclass
class ExpertTap:
    """During a pass, the per-channel input of every expert's projections (see the module
    docstring); `unreadable`: experts modules whose call could not be read, with why.

    Without a collector, each input is packed here (calib: `results`); with one (inspect
    --channels), each is measured by the collector as the input of a call of its own, named
    EXPERTS.E.PROJECTION: `measured` holds (owner, name, call, its TensorStats)."""

    modules: list[tuple[str, nn.Module]]
    real: torch.Tensor | None = None  # a padded batch's real tokens, (batch, tokens)
    hist: bool = True
    collector: Any = None  # engine.stats.StatsCollector
    packed: dict[str, list[tuple[torch.Tensor, int]]] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)
    measured: list[tuple[str, str, int, Any]] = field(default_factory=list)
    _calls: dict[str, int] = field(default_factory=dict)

    def hook(self, name: str) -> Any:
        def after(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            try:
                self._read(name, module, args, kwargs)
            except Exception as exc:
                self.unreadable.setdefault(name, f"its call could not be read ({exc})")

        return after

    def _read(self, name: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        down_proj = _param3(module, "down_proj")
        n = 0 if down_proj is None else down_proj.shape[0]
        if (
            not isinstance(hidden, torch.Tensor)
            or not isinstance(index, torch.Tensor)
            or hidden.dim() != 2
            or index.dim() != 2
            or index.shape[0] != hidden.shape[0]
            or index.is_floating_point()
            or n <= 0
        ):
            self.unreadable.setdefault(
                name,
                "its forward does not take (hidden_states (tokens, C), top_k_index (tokens, k))",
            )
            return
        up, down = projections(module)
        if up == "gate_up_proj" and not callable(getattr(module, "_apply_gate", None)):
            self.unreadable.setdefault(
                name,
                "it has no _apply_gate: how its gate and up halves combine is not known",
            )
            return
        if self.real is not None and self.real.numel() != hidden.shape[0]:
            self.unreadable.setdefault(
                name,
                f"its {hidden.shape[0]} rows are not the padded batch's "
                f"{self.real.shape[0]}x{self.real.shape[1]} positions: its padding could not "
                "be left out",
            )
            return
        with torch.no_grad():
            keep = None if self.real is None else self.real.reshape(-1).to(hidden.device)
            hits = torch.nn.functional.one_hot(index.clamp(0, n).long(), n + 1)[..., :n].sum(1)
            hits = hits > 0  # (tokens, experts): token t is routed to expert e
            if keep is not None:
                hits &= keep.unsqueeze(1)
            counts = hits.sum(0).tolist()  # one read per call
            for e, count in enumerate(counts):
                if not count:
                    continue
                rows = hits[:, e].nonzero().squeeze(1)
                x = hidden.detach().index_select(0, rows)
                self._add(name, expert_layer(name, e, up), x)
                with _hooks_silenced(module):  # our computation, not a call of the model's
                    inner = _down_input(module, up, e, x)
                self._add(name, expert_layer(name, e, down), inner)
        self.types.setdefault(name, type(module).__name__)

    def _add(self, owner: str, key: str, x: torch.Tensor) -> None:
        if self.collector is None:
            packed = measure_channels(x, 1, hist=self.hist)
            self.packed.setdefault(key, []).append((packed, x.shape[1]))
            return
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        before = self.collector.context
        self.collector.context = (key, call, "in")
        try:
            stats = self.collector.add(x, "in[0]", positions=False)  # real rows already
        finally:
            self.collector.context = before
        self.measured.append((owner, key, call, stats))

    def results(self) -> dict[str, list[ChannelStats]]:
        """Each expert projection's per-channel statistics, one per call, read to the host
        here (one transfer per call's vector)."""
        out: dict[str, list[ChannelStats]] = {}
        for key, parts in self.packed.items():
            for packed, c in parts:
                host = packed.to("cpu", torch.float64)
                out.setdefault(key, []).append(unpack(host, 1, c, hist=self.hist)[0])
        return out


def _down_input(module: nn.Module, up: str, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e's down projection input for rows x, as the eager implementation computes it."""
    weight = getattr(module, up)[e]
    transposed = bool(getattr(module, "is_transposed", False))
    h = x.to(weight.dtype)
    out = h @ weight if transposed else torch.nn.functional.linear(h, weight)
    bias = module._parameters.get(f"{up}_bias")
    if getattr(module, "has_bias", False) and isinstance(bias, torch.Tensor):
        out = out + bias[e]
    if up == "gate_up_proj":  # (_read checked it has _apply_gate)
        result: torch.Tensor = module._apply_gate(out)  # type: ignore[operator]
        return result
    return module.act_fn(out)  # type: ignore[operator,no-any-return]


@contextmanager
def _hooks_silenced(module: nn.Module) -> Iterator[None]:
    """The hooks of the experts module's own modules (its activation) held back while the
    tap computes an expert's down-projection input: that computation is hookcli's, and no
    hook — hookcli's or the user's — may count it as a call of the model."""
    held = []
    for m in module.modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks"):
            hooks = getattr(m, attr, None)
            if hooks:
                held.append((m, attr, hooks))
                setattr(m, attr, type(hooks)())
    try:
        yield
    finally:
        for m, attr, hooks in held:
            setattr(m, attr, hooks)


@contextmanager
def tapping(
    modules: list[tuple[str, nn.Module]],
    real: torch.Tensor | None,
    *,
    hist: bool = True,
    collector: Any = None,
) -> Iterator[ExpertTap]:
    """An ExpertTap on `modules` for the block's duration; its hooks removed after."""
    tap = ExpertTap(modules, real, hist, collector)
    handles = [m.register_forward_hook(tap.hook(name), with_kwargs=True) for name, m in modules]
    try:
        yield tap
    finally:
        for h in handles:
            h.remove()
