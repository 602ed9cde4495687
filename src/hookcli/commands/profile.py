"""--profile: each selected call's forward (and backward) time and output size, against the
same pass unhooked and timed in the same process."""

from __future__ import annotations

import statistics

import torch

from hookcli.engine.hooks import HookSession, PendingCall
from hookcli.engine.passes import Prepared, every_target, hooked_pass, unhooked_pass
from hookcli.options import RunOptions
from hookcli.records import CallProfile, Profile


def profile_calls(
    prepared: Prepared, run: RunOptions, *, runs: int = 3
) -> tuple[Profile, dict[tuple[str, int], CallProfile]]:
    """Per call times from a pass whose hooks only read the clock (no statistics between
    layers to disturb the caches), against the same pass unhooked (median of `runs` after a
    warm-up). Every module is timed, so a container's self time is its total less its
    children's; the selected calls are reported."""
    backward = prepared.backward is not None
    reference = [
        unhooked_pass(prepared, train=run.train, backward=backward, timed=True)
        for _ in range(runs + 1)
    ][1:]
    unhooked_ms = statistics.median(r.forward_ms for r in reference)
    unhooked_bwd = statistics.median(r.backward_ms or 0.0 for r in reference) if backward else None
    session = HookSession(every_target(prepared.entries), None, grads=backward, profile=True)
    with hooked_pass(prepared, session, train=run.train, backward=backward):
        pass
    if any(p.events for p in session.calls):
        torch.cuda.synchronize()  # once: every recorded event has completed
    total = {id(p): _forward_ms(p) for p in session.calls}
    children = {id(p): 0.0 for p in session.calls}
    for p in session.calls:
        if p.parent is not None:
            children[id(p.parent)] += total[id(p)]
    wanted = {t.name for t in prepared.targets}
    leaves = {t.name for t in prepared.targets if next(t.module.children(), None) is None}
    by_call: dict[tuple[str, int], CallProfile] = {}
    layers_ms = layers_bwd = 0.0
    for p in session.calls:
        name = p.call.name
        if name not in wanted:
            continue
        f = total[id(p)]
        b = (p.t_backward[1] - p.t_backward[0]) / 1e6 if len(p.t_backward) == 2 else None
        by_call[(name, p.call.call)] = CallProfile(
            f,
            b,
            p.output_bytes,
            f / unhooked_ms if unhooked_ms else None,
            max(f - children[id(p)], 0.0),
        )
        if name in leaves:
            layers_ms += f
            layers_bwd += b or 0.0
    profile = Profile(unhooked_ms, layers_ms, runs, unhooked_bwd, layers_bwd if backward else None)
    return profile, by_call


def _forward_ms(p: PendingCall) -> float:
    if len(p.events) == 2:  # CUDA: the device's own time between the two events
        return float(p.events[0].elapsed_time(p.events[1]))
    return (p.t_forward[1] - p.t_forward[0]) / 1e6 if len(p.t_forward) == 2 else 0.0
