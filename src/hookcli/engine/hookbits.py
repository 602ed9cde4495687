"""Small pieces of the hook session (engine/hooks.py): measuring a hook's tensors, which
gradient a hook saw, whether a model runs compiled, CUDA timing events."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hookcli.engine.stats import StatsCollector
from hookcli.engine.tensorbits import dtype_name
from hookcli.records import TensorStats
from hookcli.tree import iter_tensors

GradKey = tuple[int, tuple[int, ...]]  # a gradient tensor: data pointer and shape

# Nested outputs with more tensors than this are cut short (a note says so); deeper than
# tree.MAX_DEPTH, not walked.
_MAX_TENSORS = 512


def measure(collector: StatsCollector, obj: Any, root: str, stats: list[TensorStats]) -> None:
    """Measure every tensor in obj now; append its TensorStats (filled at finalize)."""
    if type(obj) is torch.Tensor:  # the common case: one plain tensor
        stats.append(collector.quick(obj, root))
        return
    if type(obj) is tuple and len(obj) == 1 and type(obj[0]) is torch.Tensor:
        stats.append(collector.quick(obj[0], f"{root}[0]"))
        return
    for n, (path, t) in enumerate(iter_tensors(obj, root)):
        if n >= _MAX_TENSORS:
            stats.append(TensorStats(f"{root}…", (), "", 0, note="more tensors not shown"))
            return
        stats.append(collector.quick(t, path))


def holds_compiled(modules: Iterable[nn.Module]) -> bool:
    """Whether any of the modules runs through torch.compile (`module.compile()`, or the
    OptimizedModule wrapper `torch.compile(module)` makes): dynamo guards on process-wide hooks
    and traces them, so a pass over such a model keeps hooks on each selected module."""
    return any(
        getattr(m, "_compiled_call_impl", None) is not None or "_orig_mod" in m._modules
        for m in modules
    )


def grad_key(grad: torch.Tensor) -> GradKey | None:
    """Which gradient tensor a hook saw (no synchronisation: the pointer, not the values);
    None for one without storage (sparse)."""
    try:
        return grad.data_ptr(), tuple(grad.shape)
    except Exception:
        return None


def shape_only(path: str, t: torch.Tensor) -> TensorStats:
    """A tensor's row of shape and dtype alone (no statistics)."""
    return TensorStats(path, tuple(t.shape), dtype_name(t.dtype), t.numel())


def on_cuda(obj: Any) -> bool:
    """Whether any tensor in obj is on a CUDA device; False when obj cannot be walked (the
    measuring part of the hook has noted that already)."""
    try:
        return any(t.is_cuda for _, t in iter_tensors(obj, ""))
    except Exception:
        return False


def cuda_event() -> Any:
    """A recorded CUDA timing event: the profile reads elapsed times once, after the pass."""
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record()
    return event
