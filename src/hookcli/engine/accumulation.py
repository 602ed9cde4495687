"""Whether a distributed model is in the middle of the user's gradient accumulation, where a
backward of hookcli's own would mix with it (engine/passes.py refuses one then)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any


def accumulating(modules: Sequence[Any]) -> str | None:
    """Why a backward now would mix with the user's gradient accumulation: FSDP2 with its
    gradient sync off, or holding unreduced micro-batch gradients (a backward adds to them,
    and reduces nothing), DDP inside `no_sync()`; None otherwise."""
    if "torch.distributed" not in sys.modules:
        return None
    from torch.nn.parallel import DistributedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # (a torch without FSDP2)
        FSDPModule = ()  # type: ignore[assignment,misc]
    for m in modules:
        if isinstance(m, DistributedDataParallel) and not m.require_backward_grad_sync:
            return "DDP's gradient sync is off (inside no_sync())"
        if not isinstance(m, FSDPModule):
            continue
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
        if group is None:
            continue
        if not getattr(group, "reduce_grads", True):
            return "FSDP2's gradient sync is off (set_requires_gradient_sync(False))"
        for fp in getattr(group, "fsdp_params", ()):
            unsharded = getattr(fp, "_unsharded_param", None)
            if getattr(fp, "unsharded_accumulated_grad", None) is not None or (
                unsharded is not None and unsharded.grad is not None
            ):
                return "FSDP2 holds micro-batches' gradients not yet reduced"
    return None
