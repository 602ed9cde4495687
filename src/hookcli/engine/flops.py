"""--profile's FLOPs: each module call's floating-point operations, as torch counts them.

One pass of its own (never the timed one: the counting mode intercepts every operator, which
would distort the times) under `torch.utils.flop_counter.FlopCounterMode`, with hooks on every
module. FlopCounterMode adds its counts up per module name, so a module called twice would get
one sum; here each call reads the counter's running total when it is entered and when it
returns, and the difference is that call's FLOPs — the modules it calls included, as a
container's time is. No formula is written here: what counts is FlopCounterMode's registry
(matrix products, convolutions, attention; elementwise operations, normalisation and pooling
count 0), and a multiply-add is 2 FLOPs (MACs = FLOPs / 2, torchinfo's "mult-adds").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.utils.flop_counter import FlopCounterMode

from hookcli.engine.hooks import HookSession, PendingCall
from hookcli.engine.passes import Prepared, every_target, hooked_pass
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
    counter = FlopCounterMode(display=False)
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
