"""--memory's totals and checkpointing candidates (records.Memory), from a pass measured with
engine.memory.MemoryMeter: parameters and buffers (each storage once: tied weights once),
gradients, optimizer state (watch), what autograd saved, the predicted peak of a training
step and, on CUDA, the allocator's measured peak."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from hookcli.engine.hooks import PendingCall
from hookcli.engine.memory import MemoryMeter, distinct_bytes
from hookcli.engine.prepare import Prepared
from hookcli.records import Candidate, LayerCall, Memory

CANDIDATES = 10  # checkpointing candidates listed
NO_BACKWARD_NOTE = (
    "no backward ran, so autograd saved nothing: saved bytes and the training step's peak "
    "need one (hookcli grads --memory, or check --backward)"
)


def gradient_bytes(module: nn.Module) -> int:
    """The parameters' gradients now (each storage once)."""
    return distinct_bytes(p.grad for p in module.parameters() if p.grad is not None)[0]


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The tensors an optimizer keeps per parameter (Adam's two moments, momentum buffers,
    step counters), each storage once."""
    return distinct_bytes(
        v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    )[0]


def totals(
    module: nn.Module,
    device: torch.device,
    meter: MemoryMeter | None,
    *,
    backward: bool,
    gradients: int | None = None,
    optimizer: int | None = None,
    output_bytes: int = 0,
) -> Memory:
    """The model's totals; with a backward, what the pass saved and the step's predicted
    peak (MemoryMeter.step_peak, from the backward's order of calls)."""
    params = list(module.parameters())  # a shared (tied) parameter once
    # offloaded parameters (on the meta device) hold no memory: their copies, loaded while
    # their module runs, are what autograd saves
    param_bytes, _ = distinct_bytes(p for p in params if not p.is_meta)
    buffer_bytes, _ = distinct_bytes(b for b in module.buffers() if not b.is_meta)
    memory = Memory(
        str(device),
        sum(p.numel() for p in params),
        param_bytes,
        buffer_bytes,
        gradient_bytes=gradients,
        optimizer_bytes=optimizer,
    )
    offloaded = sum(1 for p in params if p.is_meta)
    if offloaded:
        memory.notes.append(
            f"{offloaded} parameters are on the meta device (offloaded): they hold no memory "
            "here, and count 0 bytes"
        )
    if meter is None:
        return memory
    memory.measured_peak = meter.peak
    if not backward:
        memory.notes.append(NO_BACKWARD_NOTE)
        return memory
    memory.saved_bytes = meter.saved_bytes
    memory.saved_tensors = len(meter.saved)
    held = param_bytes + buffer_bytes + (optimizer or 0) + output_bytes
    memory.predicted_peak = meter.step_peak(held)
    return memory


def rank_candidates(
    layers: Sequence[LayerCall], flops: dict[tuple[str, int], int] | None
) -> list[Candidate]:
    """Calls whose checkpointing would free bytes, most freed bytes per forward FLOP first
    (a call with no counted FLOPs, elementwise or normalisation, first of all, largest
    first): what recomputing in backward frees most per unit of work."""
    found = []
    for c in layers:
        m = c.memory
        if m is None or not m.freed_bytes:
            continue
        f = None if flops is None else flops.get((c.name, c.call))
        per = m.freed_bytes / f if f else None
        found.append(Candidate(c.name, c.call, m.freed_bytes, f, per))
    found.sort(key=lambda k: (k.bytes_per_flop is not None, -(k.bytes_per_flop or k.freed_bytes)))
    return found[:CANDIDATES]


def memory_report(
    prepared: Prepared,
    meter: MemoryMeter,
    calls: Sequence[PendingCall],
    *,
    gradients: int | None,
    output_bytes: int,
    train: bool,
) -> Memory:
    """--memory's totals for a finished pass (its calls complete); with a backward, the
    candidates ranked by the FLOPs of a pass of their own (engine/flops.py)."""
    backward = prepared.backward is not None
    layers = [p.call for p in calls]
    memory = totals(
        prepared.loaded.module,
        prepared.device,
        meter,
        backward=backward,
        gradients=gradients,
        output_bytes=output_bytes,
    )
    if backward:
        selected = {t.name for t in prepared.targets}
        unseen = [e.name for e in prepared.entries if e.leaf and e.name not in selected]
        if unseen:
            memory.notes.append(
                f"{len(unseen)} leaf modules not selected ({', '.join(unseen[:3])}…): the "
                "step's peak takes what they save as alive until the selected call before them "
                "runs its backward; select every leaf (the default) for the closest figure"
            )
    if backward and any(c.memory is not None and c.memory.freed_bytes for c in layers):
        from hookcli.engine.flops import count_flops

        count = count_flops(prepared, train=train, backward=False)
        if count.note:
            memory.notes.append(f"{count.note}; candidates ranked by freed bytes alone")
        memory.candidates = rank_candidates(layers, count.by_call or None)
    return memory


def tied_names(module: nn.Module) -> Iterable[tuple[str, str]]:
    """(a parameter's name, the name it was first met under) for every parameter that is
    another's (tied weights: an LM's head and its embedding), in `named_parameters` order."""
    first: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            yield name, first[id(p)]
        else:
            first[id(p)] = name
