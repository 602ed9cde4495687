"""Where NaN/Inf first appeared in a run, forward and backward, from the order hooks ran in."""

from __future__ import annotations

from collections.abc import Sequence

from hookcli.engine.hooks import PendingCall
from hookcli.records import Origin


def find_origins(calls: Sequence[PendingCall]) -> list[Origin]:
    """Where NaN/Inf first appeared, from the order hooks ran in — no re-run, no trace.

    Forward: calls in the order they *returned* (a child before its container), the first
    with finite inputs and a non-finite output. Backward: calls in the order their input
    gradient arrived, the first whose output gradients are finite and an input gradient not.
    """
    origins = []
    for p in sorted((p for p in calls if p.finished is not None), key=lambda p: p.finished or 0):
        c = p.call
        bad = next((t for t in c.outputs if t.nonfinite), None)
        if bad is not None and not any(t.nonfinite for t in c.inputs):
            origins.append(Origin("forward", c.name, c.type, c.call, bad.path, bad.nan, bad.inf))
            break
    arrived = (p for p in calls if p.grad_input_seen is not None)
    for p in sorted(arrived, key=lambda p: p.grad_input_seen or 0):
        c = p.call
        bad = next((g for g in c.grad_inputs or [] if g.nonfinite), None)
        if bad is not None and not any(g.nonfinite for g in c.grad_outputs or []):
            origins.append(Origin("backward", c.name, c.type, c.call, bad.path, bad.nan, bad.inf))
            break
    return origins
