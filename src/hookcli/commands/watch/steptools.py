"""What the training recorder (hookcli.watch) reads around a step: a padded batch's mask, the
optimizer's parameters and their finiteness, the process's rank and its log's name, and a layer
call as a log line carries it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookcli.records import (
    LayerCall,
    LoggedCall,
    TensorStats,
)


def padding_mask(module: nn.Module, args: Any, kwargs: Any) -> torch.Tensor | None:
    """A language model's forward given a padded batch: its real tokens, (batch, tokens),
    from the `attention_mask` Hugging Face models take (by keyword, or by its place in the
    forward's signature) when it is a 2-D integer or boolean mask with padding in it; None
    otherwise (no mask, a 4-D or additive one, or nothing padded)."""
    mask = kwargs.get("attention_mask")
    if mask is None and args:
        import inspect

        try:
            names = list(inspect.signature(module.forward).parameters)
        except (TypeError, ValueError):
            names = []
        at = names.index("attention_mask") if "attention_mask" in names else -1
        mask = args[at] if 0 <= at < len(args) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.is_floating_point():
        return None
    if mask.is_complex() or mask.numel() == 0:
        return None
    real = mask != 0
    return None if bool(real.all()) else real


def params_of(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def norm_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the tensors' L2 norms (one foreach kernel per device and dtype), a float32
    0-d tensor on the first one's device: non-finite when any element is NaN or Inf."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    home = tensors[0].device
    return torch.stack(
        [torch.stack(torch._foreach_norm(g)).float().sum().to(home) for g in by_kind.values()]
    ).sum()


def all_finite(t: torch.Tensor) -> bool:
    return not t.is_floating_point() or bool(torch.isfinite(t).all())


def device_of(module: nn.Module) -> torch.device:
    first = next(iter(module.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def process_rank() -> tuple[int, int]:
    """This process's rank and the world size under torch.distributed (0, 1 without it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_log_path(path: Path, rank: int, world_size: int) -> Path:
    """Each rank its own log: `{rank}` in the name is replaced, else under a world of several
    processes `run.jsonl` becomes `run.rank0.jsonl`, `run.rank1.jsonl`, …"""
    if "{rank}" in path.name:
        return path.with_name(path.name.replace("{rank}", str(rank)))
    if world_size > 1:
        return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
    return path


def logged_call(c: LayerCall) -> LoggedCall:
    """A finished layer call as its log line holds it."""

    def many(ts: list[TensorStats] | None) -> list[TensorStats] | None:
        return None if ts is None else [numbers_only(t) for t in ts]

    return LoggedCall(
        c.name,
        c.type,
        c.call,
        [numbers_only(t) for t in c.inputs],
        [numbers_only(t) for t in c.outputs],
        many(c.grad_outputs),
        many(c.grad_inputs),
        c.error,
        c.memory,
    )


def numbers_only(t: TensorStats) -> TensorStats:
    """t as a log line holds it: its statistics, no element values or histogram (a record in
    w.records is its line)."""
    if t.values is None and t.hist is None:
        return t
    return dataclasses.replace(t, values=None, hist=None)
