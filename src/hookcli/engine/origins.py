"""Where NaN/Inf first appeared in a run, forward and backward, from the order hooks ran in —
no re-run, no trace.

Forward, the hooks' events in time order (a call entering with its inputs, a call returning
with its outputs): the first event that shows a NaN/Inf decides. A call returning non-finite
outputs from finite inputs is the origin itself. A call *entering* with a non-finite input
that no earlier call returned means the values were made by code outside the selected modules:
the origin is the gap between the last event before it and that call, and the forwards that
code can be in are named (the modules on the way between the two, by the module tree).

Backward, the gradient hooks' events in arrival order: the first non-finite gradient w.r.t. a
call's input, with finite gradients w.r.t. its outputs, is that call's own backward. A
non-finite gradient w.r.t. a call's *output* that is no other call's input gradient came
from code outside the selected modules (or from the loss): the gap again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hookcli.engine.hookbits import GradKey
from hookcli.engine.hooks import PendingCall
from hookcli.records import Origin, TensorStats

ROOT = "(model)"


def find_origins(
    calls: Sequence[PendingCall],
    types: Mapping[str, str] | None = None,
    *,
    partial: bool = False,
    outputs: Sequence[TensorStats] = (),
) -> list[Origin]:
    """The first forward and the first backward origin of NaN/Inf (none when all finite).

    `types`: module name → class name for every module of the model ("" the model itself),
    to name the forwards a gap's code can be in; `partial`: the selection leaves modules out,
    so a gap may also be an unselected module; `outputs`: the model's output, whose NaN/Inf
    no call returned were made by code after the last one."""
    if not any_nonfinite(calls, outputs):
        return []  # (the common case, without ordering every call's events)
    where = _Tree(types or {}, partial)
    origins = []
    forward = _forward(calls, where, outputs)
    if forward is not None:
        origins.append(forward)
    backward = _backward(calls, where)
    if backward is not None:
        origins.append(backward)
    return origins


def number_backward(calls: Sequence[PendingCall]) -> None:
    """Each call's `backward_order`: the rank of its first output gradient's arrival."""
    arrived = sorted(
        (p for p in calls if p.grad_output_seen is not None), key=lambda p: p.grad_output_seen or 0
    )
    for rank, p in enumerate(arrived):
        p.call.backward_order = rank


def any_nonfinite(calls: Sequence[PendingCall], outputs: Sequence[TensorStats]) -> bool:
    """Whether any call's tensor or gradient, or the model's output, holds NaN/Inf."""
    for p in calls:
        c = p.call
        for group in (c.inputs, c.outputs, c.grad_inputs, c.grad_outputs):
            for t in group or ():
                if t.nan or t.inf:
                    return True
    return any(t.nan or t.inf for t in outputs)


def _bad(tensors: Sequence[TensorStats] | None) -> TensorStats | None:
    return next((t for t in tensors or [] if t.nonfinite), None)


def _label(p: PendingCall) -> str:
    return f"{p.call.name} call {p.call.call}"


def _forward(
    calls: Sequence[PendingCall], where: _Tree, outputs: Sequence[TensorStats]
) -> Origin | None:
    events: list[tuple[int, bool, PendingCall]] = []  # (position, returned, call)
    for p in calls:
        events.append((p.entered, False, p))
        if p.returned is not None:
            events.append((p.returned, True, p))
    events.sort(key=lambda e: e[0])
    before: tuple[bool, PendingCall] | None = None
    for _, returned, p in events:
        c = p.call
        bad = _bad(c.outputs if returned else c.inputs)
        if bad is None:
            before = (returned, p)
            continue
        origin = Origin("forward", c.name, c.type, c.call, bad.path, bad.nan, bad.inf)
        if returned:
            return origin  # its inputs were finite when it entered: its own forward
        if before is None:
            origin.where = "before"
            origin.code = where.code(None, c.name, inside=False)
        else:
            prev_returned, prev = before
            origin.where = "between"
            origin.after = _label(prev)
            origin.after_finite = "output" if prev_returned else "input"
            origin.code = where.code(prev.call.name, c.name, inside=not prev_returned)
        return origin
    bad = _bad(outputs)
    if bad is None:
        return None
    # every call returned finite outputs, yet the model's output is not: code after them
    root = where.types.get("", "the model")
    origin = Origin("forward", ROOT, root, 0, bad.path, bad.nan, bad.inf, where="after")
    if before is not None:
        origin.after = _label(before[1])
        origin.after_finite = "output"
        origin.code = where.code(before[1].call.name, None, inside=False)
    else:
        origin.code = where.code(None, None, inside=False)
    return origin


def _backward(calls: Sequence[PendingCall], where: _Tree) -> Origin | None:
    events: list[tuple[int, bool, PendingCall, GradKey | None]] = []  # (position, input?, …)
    for p in calls:
        if p.grad_output_seen is not None:
            events.append((p.grad_output_seen, False, p, p.grad_output_key))
        if p.grad_input_seen is not None:
            events.append((p.grad_input_seen, True, p, p.grad_input_key))
    events.sort(key=lambda e: e[0])
    before: tuple[bool, PendingCall] | None = None
    for i, (_, arrived_input, arrived, key) in enumerate(events):
        c = arrived.call
        bad = _bad(c.grad_inputs if arrived_input else c.grad_outputs)
        if bad is None:
            before = (arrived_input, arrived)
            continue
        is_input, owner = arrived_input, arrived
        if not is_input:
            # one gradient, two hooks: X's output is P's input, and X's hook ran first. The
            # gradient is P's input gradient: P's own backward when its outputs' were finite.
            for _, later_input, q, later_key in events[i + 1 :]:
                if later_key is None or later_key != key:
                    break
                if later_input and _bad(q.call.grad_inputs) and not _bad(q.call.grad_outputs):
                    is_input, c, owner = True, q.call, q
                    bad = _bad(c.grad_inputs)
                    break
        assert bad is not None
        origin = Origin("backward", c.name, c.type, c.call, bad.path, bad.nan, bad.inf)
        if is_input and not _bad(c.grad_outputs):
            if not owner.input_shared:
                return origin  # its own backward
            # the input was read outside the call too: its gradient is every reader's sum
            others = [
                _label(q)
                for q in calls
                if q is not owner
                and q.grad_input_key is not None
                and q.grad_input_key == owner.grad_input_key
            ]
            origin.where = "shared"
            origin.code = others + [f"code in {f}" for f in where.code(c.name, None, inside=False)]
            return origin
        origin.where = "between" if before is not None else "before"
        if before is None:
            # the first gradient to arrive: from the loss, or code after this call
            origin.code = where.code(c.name, None, inside=False)
        else:
            prev_input, prev = before
            origin.after = _label(prev)
            origin.after_finite = "input" if prev_input else "output"
            # forward order: this call ran first, then the code, then `prev`; a gradient
            # w.r.t. prev's output arriving before means this call ran inside prev
            origin.code = where.code(c.name, prev.call.name, inside=not prev_input, reverse=True)
        return origin
    return None


class _Tree:
    """The module tree by dotted names: which forwards lie between two calls."""

    def __init__(self, types: Mapping[str, str], partial: bool) -> None:
        self.types = types
        self.partial = partial

    @staticmethod
    def _ancestors(name: str) -> list[str]:
        """The enclosing modules of `name`, innermost first, ending with the model ("")."""
        if name in ("", ROOT):
            return []
        parts = name.split(".")
        return [".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)] + [""]

    def _forward_of(self, name: str) -> str:
        kind = self.types.get(name)
        if name == "":
            return f"{kind or 'the model'}.forward"
        return f"{kind}.forward ({name})" if kind else f"{name}.forward"

    def code(
        self,
        first: str | None,
        then: str | None,
        *,
        inside: bool,
        reverse: bool = False,
    ) -> list[str]:
        """The forwards whose code runs after `first` returned and before `then` entered (in
        forward order; None: the start or the end of the model). `inside`: `first` had not
        returned — `then` ran inside it (forward), or in reverse, `first` inside `then`."""
        a = "" if first in (None, ROOT) else str(first)
        b = "" if then in (None, ROOT) else str(then)
        if inside:
            # nested: the code is in the outer module's forward or a module between the two
            inner, outer = (a, b) if reverse else (b, a)
            chain = self._ancestors(inner)
            names = chain[: chain.index(outer) + 1] if outer in chain else chain
        else:
            up = self._ancestors(a) if first not in (None, ROOT) else []
            down = self._ancestors(b) if then not in (None, ROOT) else []
            if first is None and then is None:
                names = [""]  # no call ran at all: the model's own forward
            elif first is None:
                names = down
            elif then is None:
                names = up
            else:
                common = next((n for n in up if n in down), "")
                names = up[: up.index(common) + 1] if common in up else up
                names += reversed(down[: down.index(common)] if common in down else down)
        seen: list[str] = []
        for n in names:
            if n not in seen:
                seen.append(n)
        out = [self._forward_of(n) for n in seen]
        if self.partial:
            out.append("a module not selected")
        return out
