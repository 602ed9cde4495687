"""--profile: each selected call's forward (and backward) time, FLOPs and output size, against
the same pass unhooked and timed in the same process.

The times come from a pass whose hooks only read the clock, on every module, so each call's
place in the call tree is known whether selected or not: the selected calls are added up once
each (a call inside another selected call is part of it), and the rest of the model's forward
is split into the forward's own code outside any module (the containers' self times) and the
modules not selected. FLOPs come from a pass of their own, after the timed ones
(engine/flops.py). A folder run profiles each batch and adds the batches up (ProfileSum).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from hookcli.engine.hooks import HookSession, PendingCall
from hookcli.engine.passes import hooked_pass, unhooked_pass
from hookcli.engine.prepare import Prepared, every_target
from hookcli.inputs import ModelInput
from hookcli.records import CallProfile, Profile

if TYPE_CHECKING:  # engine.flops imports torch's FLOP counter (~0.1 s): only --profile needs it
    from hookcli.engine.flops import CallKey

_N = TypeVar("_N", int, float)


def profile_calls(
    prepared: Prepared,
    *,
    train: bool = False,
    runs: int = 3,
    model_input: ModelInput | None = None,
    warm_up: bool = True,
) -> tuple[Profile, dict[CallKey, CallProfile]]:
    """Per call times from a pass whose hooks only read the clock (no statistics between
    layers to disturb the caches), against the same pass unhooked (median of `runs`, after a
    warm-up unless `warm_up` is False: a folder's later batches follow a warm model). Every
    module is timed, so a container's self time is its total less its children's; the
    selected calls are reported. Then FLOPs, in a pass of their own."""
    backward = prepared.backward is not None
    reference = [
        unhooked_pass(prepared, model_input=model_input, train=train, backward=backward, timed=True)
        for _ in range(runs + int(warm_up))
    ][int(warm_up) :]
    unhooked_ms = statistics.median(r.forward_ms for r in reference)
    unhooked_bwd = statistics.median(r.backward_ms or 0.0 for r in reference) if backward else None
    session = HookSession(every_target(prepared.entries), None, grads=backward, profile=True)
    with hooked_pass(prepared, session, model_input=model_input, train=train, backward=backward):
        pass
    if any(p.events for p in session.calls):
        torch.cuda.synchronize()  # once: every recorded event has completed
    from hookcli.engine.flops import count_flops

    flops = count_flops(prepared, model_input=model_input, train=train, backward=backward)
    tree = CallTree(session.calls, {t.name for t in prepared.targets})
    by_call: dict[CallKey, CallProfile] = {}
    for p in tree.selected:
        key = (p.call.name, p.call.call)
        f = tree.total[p]
        by_call[key] = CallProfile(
            f,
            _backward_ms(p),
            p.output_bytes,
            f / unhooked_ms if unhooked_ms else None,
            max(tree.own[p], 0.0),
            flops.by_call.get(key),
        )
    outer = [(p.call.name, p.call.call) for p in tree.outermost]
    layers_flops = [flops.by_call.get(key) for key in outer]
    profile = Profile(
        unhooked_ms,
        tree.layers_ms,
        runs,
        unhooked_bwd,
        sum(_backward_ms(p) or 0.0 for p in tree.outermost) if backward else None,
        model_ms=tree.model_ms,
        outside_ms=tree.outside_ms,
        unselected_ms=tree.unselected_ms,
        containers=sum(1 for p in tree.selected if tree.children[p]),
        nested=len(tree.selected) - len(tree.outermost),
        flops=flops.forward,
        layers_flops=None if None in layers_flops else sum(f or 0 for f in layers_flops),
        backward_flops=flops.backward,
        flops_note=flops.note,
    )
    return profile, by_call


class CallTree:
    """The timed calls of every module as a tree (each call's parent: the call it ran in),
    and the forward split three ways without counting any time twice: the selected calls
    that are not inside another selected one (`layers_ms`), the self time of the unselected
    calls that ran other modules (the forward's own code outside modules: `outside_ms`), and
    the unselected calls that ran none (`unselected_ms`). The three add up to `model_ms`, the
    top-level calls' totals (the model's own call, when its root module is hookable)."""

    def __init__(self, calls: Sequence[PendingCall], wanted: set[str]) -> None:
        self.total = {p: _forward_ms(p) for p in calls}
        self.children: dict[PendingCall, list[PendingCall]] = {p: [] for p in calls}
        for p in calls:
            if p.parent is not None and p.parent in self.children:
                self.children[p.parent].append(p)
        # calls come in the order they were entered: a parent before its children
        covered: dict[PendingCall, bool] = {}  # selected, or inside a selected call
        inside: dict[PendingCall, bool] = {}  # inside a selected call
        for p in calls:
            inside[p] = p.parent is not None and covered.get(p.parent, False)
            covered[p] = inside[p] or p.call.name in wanted
        self.own = {p: self.total[p] - sum(self.total[c] for c in self.children[p]) for p in calls}
        self.selected = [p for p in calls if p.call.name in wanted]
        self.outermost = [p for p in self.selected if not inside[p]]
        free = [p for p in calls if not covered[p]]
        self.layers_ms = sum((self.total[p] for p in self.outermost), 0.0)
        self.outside_ms = sum((max(self.own[p], 0.0) for p in free if self.children[p]), 0.0)
        self.unselected_ms = sum((self.total[p] for p in free if not self.children[p]), 0.0)
        self.model_ms = sum((self.total[p] for p in calls if p.parent is None), 0.0)


@dataclass(slots=True)
class ProfileSum:
    """A folder run's profile: each batch's, added up per layer call and in total; a call's
    share is its summed time over the summed unhooked passes."""

    profile: Profile | None = None
    by_call: dict[CallKey, CallProfile] = dataclasses.field(default_factory=dict)

    def add(self, profile: Profile, by_call: dict[CallKey, CallProfile]) -> None:
        if self.profile is None:
            self.profile, self.by_call = profile, dict(by_call)
            return
        total = self.profile
        self.profile = dataclasses.replace(
            total,
            unhooked_ms=total.unhooked_ms + profile.unhooked_ms,
            layers_ms=total.layers_ms + profile.layers_ms,
            unhooked_backward_ms=_sum(total.unhooked_backward_ms, profile.unhooked_backward_ms),
            layers_backward_ms=_sum(total.layers_backward_ms, profile.layers_backward_ms),
            batches=total.batches + profile.batches,
            model_ms=_sum(total.model_ms, profile.model_ms),
            outside_ms=_sum(total.outside_ms, profile.outside_ms),
            unselected_ms=_sum(total.unselected_ms, profile.unselected_ms),
            containers=max(total.containers, profile.containers),
            nested=max(total.nested, profile.nested),
            flops=_sum(total.flops, profile.flops),
            layers_flops=_sum(total.layers_flops, profile.layers_flops),
            backward_flops=_sum(total.backward_flops, profile.backward_flops),
            flops_note=total.flops_note or profile.flops_note,
        )
        for key, p in by_call.items():
            mine = self.by_call.get(key)
            self.by_call[key] = p if mine is None else _add_call(mine, p)

    def calls(self) -> dict[CallKey, CallProfile]:
        """Each call's sums, its share against the summed unhooked passes."""
        assert self.profile is not None
        unhooked = self.profile.unhooked_ms
        return {
            key: dataclasses.replace(p, share=p.forward_ms / unhooked if unhooked else None)
            for key, p in self.by_call.items()
        }


def _add_call(a: CallProfile, b: CallProfile) -> CallProfile:
    return CallProfile(
        a.forward_ms + b.forward_ms,
        _sum(a.backward_ms, b.backward_ms),
        a.output_bytes + b.output_bytes,
        None,
        _sum(a.self_ms, b.self_ms),
        _sum(a.flops, b.flops),
    )


def _sum(a: _N | None, b: _N | None) -> _N | None:
    """Both added, or None when either is unknown (a partial sum would pass for a whole)."""
    return None if a is None or b is None else a + b


def _backward_ms(p: PendingCall) -> float | None:
    return (p.t_backward[1] - p.t_backward[0]) / 1e6 if len(p.t_backward) == 2 else None


def _forward_ms(p: PendingCall) -> float:
    if len(p.events) == 2:  # CUDA: the device's own time between the two events
        return float(p.events[0].elapsed_time(p.events[1]))
    return (p.t_forward[1] - p.t_forward[0]) / 1e6 if len(p.t_forward) == 2 else 0.0
