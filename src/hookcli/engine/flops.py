"""--profile's FLOPs: each module call's floating-point operations, as torch counts them.

One pass of its own (never the timed one: the counting mode intercepts every operator, which
would distort the times) under `torch.utils.flop_counter.FlopCounterMode`, with hooks on every
module. FlopCounterMode adds its counts up per module name, so a module called twice would get
one sum; here each call reads the counter's running total when it is entered and when it
returns, and the difference is that call's FLOPs — the modules it calls included, as a
container's time is. What counts is FlopCounterMode's registry (matrix products,
convolutions, attention; elementwise operations, normalisation and pooling count 0), and a
multiply-add is 2 FLOPs (MACs = FLOPs / 2, torchinfo's "mult-adds").

Two formulas are added to that registry. Attention on the CPU
(`aten._scaled_dot_product_flash_attention_for_cpu` and its backward) gets the registry's own
SDPA formulas, which it lacks (a CPU run counted attention 0). And `aten._grouped_mm`, which
has none there and is how transformers 5 runs a mixture-of-experts layer's fused experts
(MixtralExperts and the like hold every expert in 3-D parameters; their default "grouped_mm"
implementation sorts the routed (token, expert) pairs by expert and multiplies each expert's
rows by its matrices in one call). Without it the experts counted 0. The formula counts the
rows actually multiplied: up to the offsets' last value, the pairs routed (read back from the
device, once per call: the counting pass is not timed); on the meta device, where offsets have
no values, every row, for a top-k router tokens x k. `grouped_mm_on_meta` makes that product's
output on the meta device in every dtype and size (torch's meta kernel holds the CUDA kernel's
limits: bfloat16 only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from hookcli.engine.hooks import HookSession, PendingCall
from hookcli.engine.passes import hooked_pass
from hookcli.engine.prepare import Prepared, every_target
from hookcli.errors import one_line
from hookcli.inputs import ModelInput

CallKey = tuple[str, int]  # layer name, call index


@dataclass(slots=True)
class FlopCount:
    """Forward FLOPs of every call of every hookable module, the whole forward's (operations
    outside modules included) and, when the pass had one, the whole backward's. `note`: why
    nothing could be counted (the counts are then empty and None)."""

    by_call: dict[CallKey, int] = field(default_factory=dict)
    forward: int | None = None
    backward: int | None = None
    note: str | None = None


def count_flops(
    prepared: Prepared,
    *,
    model_input: ModelInput | None = None,
    train: bool = False,
    backward: bool = False,
) -> FlopCount:
    """One pass under FlopCounterMode (with its backward when `backward`). A model that runs
    but cannot run under the counting mode gets a note instead of counts: its timings and
    statistics stand without FLOPs."""
    counter = FlopCounterMode(display=False, custom_mapping=_FORMULAS)
    marks: dict[PendingCall, list[int]] = {}

    def entered(pending: PendingCall, args: Any, kwargs: Any) -> None:
        marks[pending] = [counter.get_total_flops()]

    def returned(pending: PendingCall, output: Any) -> None:
        marks.setdefault(pending, []).append(counter.get_total_flops())

    session = HookSession(
        every_target(prepared.entries), None, on_input=entered, on_output=returned
    )
    try:
        with (
            counter,
            hooked_pass(prepared, session, model_input=model_input, train=train, backward=backward),
        ):
            at_end = counter.get_total_flops()
    except Exception as exc:  # the model ran before (timed); only the counting failed
        return FlopCount(note=f"FLOPs not counted: {one_line(exc)}")
    count = FlopCount()
    for p in session.calls:  # not `marks`: a forward run again (autograd inside) left some
        m = marks.get(p, [])
        if len(m) == 2:
            count.by_call[(p.call.name, p.call.call)] = m[1] - m[0]
    model = prepared.loaded.module
    root = next((t.name for t in session.targets if t.module is model), None)
    if root is not None and (root, 0) in count.by_call:
        count.forward = count.by_call[(root, 0)]
    elif not backward:
        count.forward = at_end  # the model itself refused hooks: the pass is the forward
    if backward and count.forward is not None:
        count.backward = at_end - count.forward
    if count.forward == 0:  # a quantized model, custom kernels: not 0 work, only not counted
        count.note = (
            "FlopCounterMode counted no FLOPs: none of the model's operators has a formula "
            "there (matrix products, convolutions, attention do; quantized and custom kernels "
            "do not)"
        )
    return count


def grouped_mm_flops(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    *args: Any,
    out_val: Any = None,
    **kwargs: Any,
) -> int:
    """FLOPs of `aten._grouped_mm` (2 per multiply-add), in its four layouts: (rows, K) by
    (groups, K, N), each group of rows by its own matrix (the experts' forward; the backward's
    gradient of the input); (groups, M, K) by (K, columns), each group of columns; (M, K) by
    (K, N) grouped along K into (groups, M, N) (the gradient of the experts' weights); and
    (groups, M, K) by (groups, K, N), a batched product. The grouped extent counts up to the
    offsets' last value (the kernel leaves what lies beyond it alone), or in full where the
    offsets have no values (meta)."""
    a, b = mat_a.shape, mat_b.shape
    end = _last_offset(offs)
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    if len(a) == 2 and len(b) == 3:
        return 2 * _upto(a[0], end) * a[1] * b[2]
    if len(a) == 3 and len(b) == 2:
        return 2 * a[1] * a[2] * _upto(b[1], end)
    return 2 * a[0] * _upto(a[1], end) * b[1]


def _last_offset(offs: torch.Tensor | None) -> int | None:
    """The offsets' last value (the grouped rows' end), None where it cannot be read."""
    if not isinstance(offs, torch.Tensor) or offs.numel() == 0 or offs.device.type == "meta":
        return None
    return int(offs[-1].item())


def _upto(size: int, end: int | None) -> int:
    return size if end is None else max(0, min(size, end))


class _Raw:
    """A formula that takes the operator's tensors themselves (FlopCounterMode passes other
    formulas their shapes): the offsets' values are what it counts."""

    _get_raw = True

    def __init__(self, formula: Any) -> None:
        self.formula = formula

    def __call__(self, *args: Any, **kwargs: Any) -> int:
        return int(self.formula(*args, **kwargs))


def _cpu_attention_formulas() -> dict[Any, Any]:
    """Attention as the CPU runs it: F.scaled_dot_product_attention dispatches there to
    `aten._scaled_dot_product_flash_attention_for_cpu` (and its backward), which torch's
    registry has no formula for, so a CPU --profile counted attention 0 while the meta device
    and the GPU count it. The registry's own SDPA formulas apply: their arguments begin with
    query, key and value (grad_out first in the backward), as these operators' do. They are
    already shape-wrapped (register_flop_formula): passed the tensors, they take the shapes."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    found: dict[Any, Any] = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        found[aten._scaled_dot_product_flash_attention_for_cpu] = _Raw(flop_counter.sdpa_flop)
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        found[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _Raw(
            flop_counter.sdpa_backward_flop
        )
    return found


# `aten._grouped_mm` came with torch 2.8; before it no model can call it
_GROUPED_MM: Any = getattr(torch.ops.aten, "_grouped_mm", None)
_FORMULAS: dict[Any, Any] = {
    **({_GROUPED_MM: _Raw(grouped_mm_flops)} if _GROUPED_MM is not None else {}),
    **_cpu_attention_formulas(),
}


class _GroupedMMOnMeta(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """`aten._grouped_mm` on meta tensors: the output's shape and dtype, made here. torch's meta
    kernel holds the CUDA kernel's limits (bfloat16 only; every row 16-byte aligned), which a
    CPU run of the same model does not have: a float32 Mixtral, or one whose expert width is
    not a multiple of 8, runs on the CPU and stopped on meta. Nothing is computed on meta."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if _GROUPED_MM is not None and func is _GROUPED_MM.default and _on_meta(args):
            rest = dict(zip(("offs", "bias", "out_dtype"), args[2:], strict=False)) | kwargs
            return _grouped_mm_output(args[0], args[1], rest.get("offs"), rest.get("out_dtype"))
        return func(*args, **kwargs)


def _on_meta(args: tuple[Any, ...]) -> bool:
    return (
        len(args) >= 2
        and all(isinstance(t, torch.Tensor) for t in args[:2])
        and args[0].device.type == "meta"
    )


def _grouped_mm_output(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """The empty (meta) output of `_grouped_mm` in each layout, the shapes checked as the
    kernel checks them: the inner sizes agree, and the groups are the offsets' (or, 3-D by
    3-D, the batch's)."""
    a, b = tuple(mat_a.shape), tuple(mat_b.shape)
    groups = None if offs is None else offs.shape[0]
    shape: tuple[int, ...]
    if len(a) not in (2, 3) or len(b) not in (2, 3) or a[-1] != b[-2]:
        raise RuntimeError(f"grouped_mm: mat_a of {a} and mat_b of {b} do not multiply")
    if len(a) == 3 and len(b) == 3:
        ok, shape = a[0] == b[0] and offs is None, (a[0], a[1], b[2])
    elif len(a) == 2 and len(b) == 3:
        ok, shape = groups == b[0], (a[0], b[2])
    elif len(a) == 3:
        ok, shape = groups == a[0], (a[1], b[1])
    else:
        ok, shape = groups is not None, (groups or 0, a[0], b[1])
    if not ok:
        raise RuntimeError(
            f"grouped_mm: mat_a of {a}, mat_b of {b} and offsets of {groups} groups do not match"
        )
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


@contextlib.contextmanager
def grouped_mm_on_meta() -> Iterator[None]:
    """For the `with` block, `aten._grouped_mm` runs on the meta device in every dtype and size
    (a mixture-of-experts model built there in float32 or float16 stopped at its experts)."""
    with _GroupedMMOnMeta():  # type: ignore[no-untyped-call]
        yield
