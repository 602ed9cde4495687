"""--memory: what each selected call costs in memory, measured in the hooked pass itself.

- **Saved for backward**: every tensor autograd saves during the forward passes through one
  `torch.autograd.graph.saved_tensors_hooks` pack hook for the whole pass. Each is counted by
  its storage (a view and its base are one storage, counted once), at the storage's size;
  parameters and buffers are not activations and are left out. A call is given every storage
  saved between its entry and its return, so a container holds its children's; the pass's
  total counts each storage once. Tensors saved inside `torch.utils.checkpoint` regions are
  not saved (the region is recomputed), and its own hooks take precedence: they are not seen.
- **Freed by checkpointing**: what the call saved that nothing outside it saved too, less its
  inputs (a checkpoint keeps them): the bytes `torch.utils.checkpoint` around it would free.
- **Output**: the distinct storages of the call's output tensors, alive at its return.
- **Allocator peak** (CUDA only): the caching allocator's peak while the call ran. The
  allocator counts on the host, so reading it needs no synchronisation: at every hook event
  the peak since the last event is folded into each open call, and the peak is reset. This
  resets `torch.cuda.max_memory_allocated`'s statistics, once per event.

Totals (parameters and buffers, each storage once, so tied weights count once; gradients;
optimizer state in `watch`) and the ranking of checkpointing candidates are in
`commands/memory.py`. No statistics are read here: the numbers are sizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hookcli.tree import iter_tensors


def storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """A tensor's storage as a key that outlives the Python object (the storage's own
    address: a view and its base share it) and its size in bytes; None for a tensor with no
    plain storage (sparse, nested, a tensor subclass without one)."""
    try:
        s = t.untyped_storage()
        return int(s._cdata), int(s.nbytes())
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def distinct_bytes(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """The bytes of the distinct storages behind `tensors`, and how many there are."""
    seen: dict[int, int] = {}
    for t in tensors:
        key = storage_key(t)
        if key is not None:
            seen.setdefault(*key)
    return sum(seen.values()), len(seen)


@dataclass(slots=True, eq=False)
class CallBytes:
    """One call's memory while the pass runs."""

    saved: dict[int, int] = field(default_factory=dict)  # storage -> bytes, saved in the call
    saves: dict[int, int] = field(default_factory=dict)  # storage -> times saved in the call
    inputs: frozenset[int] = frozenset()  # its input tensors' storages
    input_bytes: int = 0
    grads: dict[int, int] = field(default_factory=dict)  # its parameters' storages (trained)
    leaf: bool = True  # no other hooked call ran inside it
    # the gradients its backward saw, in and out (an expanded scalar holds 4 bytes): None
    # until one arrives
    grad_storages: dict[int, int] = field(default_factory=dict)
    output_bytes: int = 0
    peak: int | None = None  # CUDA: the allocator's peak while it ran
    freed: int = 0  # what checkpointing it would free (MemoryMeter.finish)


class MemoryMeter:
    """Counts, for one hooked pass, what autograd saves (pass and call by call) and, on CUDA,
    the allocator's peaks. HookSession calls `enter`/`leave` around each selected call's
    forward; engine.passes wraps the forward (and the loss) in `saving()`."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.skip = {
            key[0]
            for t in (*module.parameters(), *module.buffers())
            if (key := storage_key(t)) is not None
        }
        self.open: list[CallBytes] = []
        self.saved: dict[int, int] = {}  # the pass's: storage -> bytes
        self.saves: dict[int, int] = {}  # the pass's: storage -> times saved
        self.calls: list[CallBytes] = []
        # where each saved storage's backward frees it: the leaf call it was saved in, else
        # the leaf that returned last before it was saved (an op between two leaves runs its
        # backward just before that leaf's); None: before any leaf, freed last
        self.freed_by: dict[int, list[CallBytes | None]] = {}
        self._last_leaf: CallBytes | None = None
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        self.peak: int | None = None  # CUDA: the whole pass's
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key is not None and key[1] and key[0] not in self.skip:  # (empty: nothing held)
            storage, n = key
            self.saved.setdefault(storage, n)
            self.saves[storage] = self.saves.get(storage, 0) + 1
            for call in self.open:
                call.saved.setdefault(storage, n)
                call.saves[storage] = call.saves.get(storage, 0) + 1
            inner = self.open[-1] if self.open else None
            self.freed_by.setdefault(storage, []).append(
                inner if inner is not None and inner.leaf else self._last_leaf
            )
        return t

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Every tensor autograd saves inside is counted (and kept as it is)."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, _unpacked):
            yield

    def _fold_peak(self) -> None:
        """The allocator's peak since the last event into every open call and the pass."""
        if not self.cuda:
            return
        peak = int(torch.cuda.max_memory_allocated(self.device))
        for call in self.open:
            call.peak = peak if call.peak is None else max(call.peak, peak)
        self.peak = peak if self.peak is None else max(self.peak, peak)
        torch.cuda.reset_peak_memory_stats(self.device)

    def enter(
        self, args: Any = (), kwargs: Any = None, module: nn.Module | None = None
    ) -> CallBytes:
        self._fold_peak()
        keys = {
            k[0]: k[1]
            for _, t in iter_tensors((args, kwargs or {}), "in")
            if (k := storage_key(t)) is not None
        }
        call = CallBytes(inputs=frozenset(keys), input_bytes=sum(keys.values()))
        if module is not None:
            call.grads = {
                k[0]: k[1]
                for p in module.parameters()
                if p.requires_grad and (k := storage_key(p)) is not None
            }
        if self.open:
            self.open[-1].leaf = False
        self.calls.append(call)
        if self.cuda:
            call.peak = int(torch.cuda.memory_allocated(self.device))
        self.open.append(call)
        return call

    def leave(self, call: CallBytes, output: Any) -> None:
        self._fold_peak()
        if call in self.open:  # (and any call left open inside it: it raised)
            del self.open[self.open.index(call) :]
        if call.leaf:
            self._last_leaf = call
        call.output_bytes = distinct_bytes(t for _, t in iter_tensors(output, "out"))[0]

    def finish(self) -> int | None:
        """At the pass's end: each call's bytes checkpointing it would free (what it saved
        that nothing outside it saved too, less its inputs, which a checkpoint keeps), and
        the pass's CUDA peak, read once more (after backward)."""
        for call in self.calls:
            call.freed = sum(
                n
                for s, n in call.saved.items()
                if call.saves[s] == self.saves[s] and s not in call.inputs
            )
        self._fold_peak()
        return self.peak

    def step_peak(self, order: dict[int, int], held: int) -> int:
        """The most one training step holds at once, walking its backward leaf call by leaf
        call in the order their output gradients arrived (`order`: id(CallBytes) -> rank):
        `held` (parameters, buffers, optimizer state, the model's output, alive throughout)
        + what is still saved (a storage is freed once the last backward that needs it has
        run) + the parameters' gradients made so far + the call's own gradients in and out
        (their storages as its backward saw them; else its output's and input's sizes).
        Gradients are taken to start absent (zero_grad(set_to_none=True)). A leaf no
        gradient reached frees nothing."""
        leaves = sorted(
            (c for c in self.calls if c.leaf and id(c) in order), key=lambda c: order[id(c)]
        )
        rank = {id(c): i for i, c in enumerate(leaves)}
        last = len(leaves)  # freed after every leaf's backward
        free_at: dict[int, int] = {}
        for storage, owners in self.freed_by.items():
            free_at[storage] = max(last if o is None else rank.get(id(o), last) for o in owners)
        by_rank: dict[int, int] = {}
        for storage, at in free_at.items():
            by_rank[at] = by_rank.get(at, 0) + self.saved[storage]
        live = self.saved_bytes
        grads: dict[int, int] = {}
        peak = held + live
        for i, c in enumerate(leaves):
            grads.update(c.grads)
            seen = c.grad_storages  # the gradients its backward held, else their sizes
            flowing = sum(seen.values()) if seen else c.output_bytes + c.input_bytes
            now = held + live + sum(grads.values()) + flowing
            peak = max(peak, now)
            live -= by_rank.get(i, 0)
        return max(peak, held + live + sum(grads.values()))

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())


def _unpacked(t: torch.Tensor) -> torch.Tensor:
    return t
