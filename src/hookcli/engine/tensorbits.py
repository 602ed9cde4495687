"""Small tensor helpers the statistics and their callers share: the dtype sums are kept in, a
dtype's name, a finite float or None, a padded batch's real positions, per-position rows, any
tensor as real-valued strided data, and a tensor's elements as one flat run."""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Sequence
from typing import Any, TypeVar

import torch

# a plain tensor's or plain parameter's class: read as itself (not a DTensor, a lazy
# parameter or another subclass), a type(t) in PLAIN test on hot paths
PLAIN = (torch.Tensor, torch.nn.Parameter)

K = TypeVar("K")


def by_device(items: Iterable[tuple[K, object]]) -> dict[torch.device, list[K]]:
    """The keys of the items whose value is a tensor, grouped by its device, in order: what
    is brought to the host in one transfer per device."""
    out: dict[torch.device, list[K]] = {}
    for key, value in items:
        if isinstance(value, torch.Tensor):
            out.setdefault(value.device, []).append(key)
    return out


# how a tensor's (batch, tokens) positions are laid out (unpadded's `how`)
TOKENS, ATTENTION, FLAT = 1, 2, 3


def padding_of(
    shape: Sequence[int], mask: Sequence[int], context: Any, path: str, rows_only: Container[str]
) -> int:
    """How a tensor of `shape` holds the positions of a padded batch whose mask is of shape
    (batch, tokens), measured in `context` (a layer call's (name, call, kind), else None):
    0, none; TOKENS: (batch, tokens, …); ATTENTION: (batch, heads, tokens, tokens), its query
    rows; FLAT: (batch·tokens, C), the positions flattened into its rows in the mask's order.
    FLAT is read by size, so only where rows can be positions: a layer call's 2-D input or
    output (a 3-D tensor whose first dimension is batch x heads could match by its size),
    not a routed expert's (a loop-style MoE hands each expert Linear its tokens in routing
    order). A 2-D tensor of (batch, tokens) sizes is not TOKENS where its call has features
    as its columns (`rows_only`: a Linear's, a classifier's; a model's `pooler_output`)."""
    dims = len(shape)
    if dims < 2:
        return 0
    batch, tokens = mask
    name = context[0] if isinstance(context, tuple) and context else None
    if dims == 4 and shape[0] == batch and shape[2] == shape[3] == tokens:
        return ATTENTION
    if shape[0] == batch and shape[1] == tokens:
        features = name in rows_only or "pooler_output" in path
        return 0 if dims == 2 and features else TOKENS
    if dims != 2 or shape[0] != batch * tokens or not isinstance(name, str):
        return 0  # (not a layer call's tensor: its rows are not known to be positions)
    # a routed expert (experts.3, experts.3.w1) is not; a fused experts module (mlp.experts:
    # every position in the mask's order, with the routing beside it) is
    return 0 if ".experts." in f".{name}" else FLAT


def accumulate_dtype(device: torch.device) -> torch.dtype:
    """float64, or float32 on MPS (which lacks float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


def finite_or_none(v: float) -> float | None:
    """v as a Python float, or None when it is NaN/Inf (JSON has no NaN)."""
    return float(v) if math.isfinite(v) else None


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def version_of(t: torch.Tensor) -> int:
    """t's version counter; -1 for an inference tensor, which has none (made under
    `torch.inference_mode()`, it may change in place there unseen, so a collector measures
    it at each sight, never taking it as one seen before)."""
    try:
        return int(t._version)
    except RuntimeError:
        return -1


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def token_rows(t: torch.Tensor) -> torch.Tensor:
    """(batch, tokens, C) → (batch, tokens, 5): per position the norm, mean, std and max |x|
    over the C channels and the channel of that max (computed where t lives, no transfer)."""
    x = t.detach().to(accumulate_dtype(t.device))
    top = x.abs().max(dim=-1)
    return torch.stack(
        [
            x.norm(dim=-1),
            x.mean(dim=-1),
            x.std(dim=-1, correction=0),
            top.values,
            top.indices.to(x.dtype),
        ],
        dim=-1,
    )


def unpadded(t: torch.Tensor, real: torch.Tensor, how: int = 1) -> torch.Tensor:
    """t's real positions (`real`: their indices in the flattened (batch, tokens)), as
    (real, …): TOKENS, along its first two dimensions; ATTENTION, (batch, heads, tokens,
    tokens) by its query rows, as (real, heads, tokens); FLAT, the rows of a (batch·tokens, …)
    tensor. An index, not a boolean mask: no wait on a GPU."""
    x = t.detach().transpose(1, 2) if how == ATTENTION else t.detach()
    if how != FLAT:
        x = x.flatten(0, 1)
    return x.index_select(0, real.to(x.device))


def own_positions(massive: list[Any], own: list[list[int]], flat: bool) -> None:
    """A padded batch's massive activations named by the sequence and the position in its own
    text (`own`: each column's), their `index` left the tensor's own: a (batch, tokens, …)
    tensor's column, a (batch·tokens, C) one's row, read as (sequence, column)."""
    tokens = len(own[0]) if own else 0
    for m in massive:
        if flat and tokens:
            b, col = divmod(m.index[0], tokens)
            m.sequence, m.position = b, own[b][col]
        elif m.sequence is not None and m.position is not None:
            m.position = own[m.sequence][m.position]


def real_valued(t: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """Map any tensor to a real-valued strided tensor with the same statistics meaning."""
    note = None
    if t.is_quantized:
        t = t.dequantize()
        note = "quantized: statistics of the dequantized values"
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = t.abs()
        note = "complex: statistics of the magnitude"
    return t.detach(), note


def dense_flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor of exactly t's elements in memory order, copying only when t has gaps.

    Statistics ignore element order, so a channels_last or permuted tensor that covers its
    storage span densely is read in place.
    """
    if t.is_contiguous():
        return t.reshape(-1)
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return t.contiguous().reshape(-1)
        expected *= size
    return t.as_strided((t.numel(),), (1,))
