"""A module's inputs as its caller passed them, for their gradients (grads' `grad_inputs`).

A module holding input hooks of its own (a tensor-parallel style's `_prepare_input_fn`,
FSDP2's pre-forward) is handed other tensors than its caller passed: a DTensor made from the
caller's tensor (`DTensor.from_local`), an autograd copy, a cast to the compute dtype. The
gradient of such a tensor is the module's own path's only; where the caller's tensor is read
elsewhere too (a SwiGLU's gate and up, attention's q, k and v, a residual), it is not
∂target/∂input, which `grad_inputs` is (docs/grads.md), as it is unsharded. So the caller's
tensor is watched instead, its gradient taken as the module's tensor's global one: a plain
tensor of the module's tensor's shape as it is, a DTensor's local part as that DTensor's.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from hookcli.engine.sharded import values_key
from hookcli.tree import iter_tensors

# a DTensor's (mesh, placements, shape, stride): its local part's gradient made it again
Spec = tuple[Any, tuple[Any, ...], Any, tuple[int, ...]]


def paired(
    obj: Any, callers: Any, root: str, *, casts: bool = False
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Spec]]:
    """obj's tensors (the module's inputs, paths as iter_tensors names them), each replaced by
    the caller's tensor it was made from where that one's gradient is the input's whole one;
    and, by path, the DTensor each such local part stands for. Nothing is replaced where the
    two do not line up (other structures), or a tensor is not made from the caller's: the
    same values where they lie, or (`casts`: FSDP2's mixed precision) the caller's cast to
    another floating dtype."""
    if obj is callers or (
        type(obj) is tuple
        and type(callers) is tuple
        and len(obj) == len(callers)
        and all(a is b for a, b in zip(obj, callers, strict=True))
    ):  # (nothing made anew: a hook of the module's own that left its inputs as they were)
        return list(iter_tensors(obj, root)), {}
    mine = list(iter_tensors(obj, root))
    theirs = list(iter_tensors(callers, root))
    if [p for p, _ in mine] != [p for p, _ in theirs]:
        return mine, {}
    items: list[tuple[str, torch.Tensor]] = []
    specs: dict[str, Spec] = {}
    for (path, got), (_, given) in zip(mine, theirs, strict=True):
        took = got
        if (
            got is not given
            and type(given) is torch.Tensor
            and given.requires_grad
            and got.requires_grad
        ):
            spec = _made_from(got, given, casts)
            if spec is not None:
                took = given
                if spec != ():
                    specs[path] = spec  # type: ignore[assignment]
        items.append((path, took))
    return items, specs


def _made_from(got: torch.Tensor, given: torch.Tensor, casts: bool) -> Spec | tuple[()] | None:
    """How `got` (the module's tensor) was made from `given` (the caller's): () an alias of its
    values (FSDP2's autograd copy) or, with `casts`, its cast to another floating dtype (FSDP2's
    mixed precision); a Spec for a DTensor whose local part is `given`'s values (a style's
    from_local); None for anything else (a hook's new values, a redistributed DTensor)."""
    if type(got) is torch.Tensor:
        if _aliases(got, given):
            return ()
        cast = (
            casts
            and got.shape == given.shape
            and got.dtype != given.dtype
            and got.is_floating_point()
            and given.is_floating_point()
        )
        return () if cast else None
    local = getattr(got, "_local_tensor", None)
    placements = tuple(getattr(got, "placements", ()))
    if (
        not isinstance(local, torch.Tensor)
        or not placements
        or any(p.is_partial() for p in placements)
        or not _aliases(local, given)
    ):
        return None
    return (got.device_mesh, placements, got.shape, got.stride())  # type: ignore[attr-defined]


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a's values are b's, where they lie (a view of the same elements). Two empty
    tensors of one shape and dtype count as one (no address tells them apart, and no value
    differs): a rank whose batch is empty then pairs the tensors as the other ranks do."""
    if a.numel() == 0 == b.numel():
        return a.shape == b.shape and a.dtype == b.dtype
    where = values_key(a)
    return where is not None and a.dtype == b.dtype and where == values_key(b)


def as_whole(grad: torch.Tensor, spec: Spec) -> torch.Tensor:
    """The caller's tensor's gradient (a local part) as the DTensor the module's input was."""
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = spec
    return DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride)


def fsdp_managed_any(model: Any) -> bool:
    """Whether FSDP2 runs any module of the model (a DDP-wrapped tensor-parallel model's
    DTensors are not FSDP's)."""
    return "torch.distributed.fsdp" in sys.modules and any(fsdp_managed(m) for m in model.modules())


def fsdp_managed(module: Any) -> bool:
    """Whether FSDP2 runs the module (its pre-forward may cast the inputs: mixed precision)."""
    if "torch.distributed.fsdp" not in sys.modules:
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)
