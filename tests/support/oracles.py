"""Independent oracles: float64 statistics of a retained tensor, each layer's inputs and outputs
kept by hooks of the test's own, the hooks left on a model, the gradients torch.autograd
computes, and SmoothQuant's activation scales written out."""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from hookcli.tree import iter_tensors


def hooks_left(model: nn.Module) -> int:
    """How many hooks of any kind remain on any module of model, process-wide module hooks,
    and marks a module keeps for a hook it no longer holds (a process-wide pre-hook given
    keyword arguments)."""
    from torch.nn.modules import module as torch_module

    return (
        sum(
            len(m._forward_hooks)
            + len(m._forward_pre_hooks)
            + len(m._backward_hooks)
            + len(getattr(m, "_backward_pre_hooks", {}))
            + len(set(m._forward_pre_hooks_with_kwargs) - set(m._forward_pre_hooks))
            for m in model.modules()
        )
        + len(torch_module._global_forward_hooks)
        + len(torch_module._global_forward_pre_hooks)
    )


def oracle(t: torch.Tensor) -> dict[str, float | int | None]:
    """Independent float64 statistics of a retained tensor (finite elements for moments)."""
    if t.is_quantized:
        t = t.dequantize()
    if t.is_complex():
        t = t.abs()
    d = t.detach().to(torch.float64).reshape(-1)
    finite = d[torch.isfinite(d)]
    n = finite.numel()
    return {
        "numel": d.numel(),
        "mean": finite.mean().item() if n else None,
        "std": finite.std(correction=0).item() if n else None,
        "min": finite.min().item() if n else None,
        "max": finite.max().item() if n else None,
        "zeros": (d == 0).double().mean().item() if d.numel() else None,
        "nan": int(torch.isnan(d).sum()),
        "inf": int(torch.isinf(d).sum()),
        "norm": finite.norm().item() if n else None,
    }


def assert_stats_match(
    stats: object, t: torch.Tensor, rtol: float = 2e-5, *, same_tensor: bool = True
) -> None:
    """Every statistic of `stats` equals the oracle on t: moments within rtol of the data's
    scale (a mean near 0 is judged against the RMS); extremes and counts exactly when t is
    the very tensor that was measured, else (t recomputed by another path, e.g. with in-place
    ops disabled, which rounds differently) extremes within rtol of the scale too."""
    ref = oracle(t)
    assert stats.numel == ref["numel"]  # type: ignore[attr-defined]
    assert stats.nan == ref["nan"], (stats, ref)  # type: ignore[attr-defined]
    assert stats.inf == ref["inf"], (stats, ref)  # type: ignore[attr-defined]
    # no absolute floor: subnormal activations (~1e-42) must report their real spread
    scale = max(abs(ref["mean"] or 0.0), ref["std"] or 0.0)
    for key in ("min", "max", "zeros"):
        got, want = getattr(stats, key), ref[key]
        if same_tensor or want is None or key == "zeros":
            assert got == want, (key, stats, ref)
        else:
            assert got is not None and abs(got - want) <= rtol * max(scale, abs(want)), (
                key,
                got,
                want,
            )
    for key in ("mean", "std", "norm"):
        got, want = getattr(stats, key), ref[key]
        if want is None:
            assert got is None, (key, stats, ref)
            continue
        tol = rtol * (scale if key != "norm" else abs(want))
        assert got is not None and abs(got - want) <= tol, (key, got, want)


def captured_outputs(model: nn.Module, x: torch.Tensor, names: list[str]) -> dict[str, Any]:
    """Each named module's output (its first call's), cloned by an independent forward hook;
    an int8 (quantized) tensor as its real values."""
    got: dict[str, Any] = {}
    mods = dict(model.named_modules())

    def keeper(name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:  # returns None: output kept
            if name in got:
                return
            if isinstance(out, torch.Tensor):
                out = out.dequantize() if out.is_quantized else out.detach().clone()
            got[name] = out

        return hook

    handles = [mods[n].register_forward_hook(keeper(n)) for n in names]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return got


def retained_outputs(
    model: nn.Module, args: tuple[Any, ...]
) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
    """An independent oracle: clones of every leaf's inputs and outputs per (name, call)."""
    store: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    counts: dict[str, int] = defaultdict(int)
    handles = []
    for name, m in model.named_modules():
        if next(m.children(), None) is not None:
            continue

        def pre(mod: nn.Module, a: tuple[Any, ...], name: str = name) -> None:
            key = (name, counts[name])
            counts[name] += 1
            store[key] = {p: t.detach().clone() for p, t in iter_tensors(a, "in")}

        def post(mod: nn.Module, a: tuple[Any, ...], out: Any, name: str = name) -> None:
            key = (name, counts[name] - 1)
            store[key].update({p: t.detach().clone() for p, t in iter_tensors(out, "out")})

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for h in handles:
            h.remove()
    return store


def without_inplace(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if hasattr(m, "inplace"):
            m.inplace = False
    return twin


def oracle_grads(model: nn.Module, x: torch.Tensor) -> dict[tuple[str, int, str], torch.Tensor]:
    """∂(sum of top-1 logits)/∂(each leaf call's output), by torch.autograd.grad.

    In-place ops are disabled twice over: module `inplace` flags off, and each recorded
    output handed on as a clone, so functional in-place ops in forward code (DenseNet's
    `F.relu(features, inplace=True)`, ResNet's `out += identity`) modify the clone and the
    recorded tensor keeps the value the layer produced."""
    twin = without_inplace(model)
    outs: dict[tuple[str, int, str], torch.Tensor] = {}
    counts: dict[str, int] = defaultdict(int)
    handles = []
    for name, m in twin.named_modules():
        if next(m.children(), None) is not None:
            continue

        def hook(mod: nn.Module, a: Any, out: Any, name: str = name) -> Any:
            call = counts[name]
            counts[name] += 1
            for path, t in iter_tensors(out, "out"):
                if t.requires_grad:
                    outs[(name, call, path)] = t
            return out.clone() if isinstance(out, torch.Tensor) else None

        handles.append(m.register_forward_hook(hook))
    try:
        logits = twin(x)
    finally:
        for h in handles:
            h.remove()
    target = logits.max(dim=1).values.sum()
    keys = list(outs)
    grads = torch.autograd.grad(target, [outs[k] for k in keys], allow_unused=True)
    return {k: g for k, g in zip(keys, grads, strict=True) if g is not None}


def act_scales_by_hand(model: nn.Module, sequences: list[torch.Tensor]) -> dict[str, Any]:
    """SmoothQuant's get_act_scales, written out: a forward hook on every nn.Linear keeps
    max over sequences of x.abs().view(-1, C).max(dim=0); plus PerChannelMinMaxObserver."""
    from torch.ao.quantization.observer import PerChannelMinMaxObserver

    scales: dict[str, torch.Tensor] = {}
    observers: dict[str, Any] = {}

    def hook(name: str) -> Any:
        def keep(m: nn.Module, args: Any, out: Any) -> None:
            x = args[0].detach()
            c = x.shape[-1]
            now = x.abs().view(-1, c).float().max(dim=0)[0]
            scales[name] = torch.max(scales[name], now) if name in scales else now
            if name not in observers:
                observers[name] = PerChannelMinMaxObserver(ch_axis=-1, dtype=torch.qint8)
            observers[name](x.reshape(-1, c))

        return keep

    handles = [
        m.register_forward_hook(hook(n))
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]
    try:
        with torch.no_grad():
            for ids in sequences:
                model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return {"scales": scales, "observers": observers}
