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

import contextlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from hookcli.tree import iter_tensors


def storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """A tensor's storage as a key that outlives the Python object (the storage's own
    address: a view and its base share it) and its size in bytes; None for a tensor with no
    plain storage (sparse, nested), and for a wrapper subclass (storage_keys reads inside)."""
    if _is_wrapper(t):
        return None
    try:
        s = t.untyped_storage()
        return int(s._cdata), int(s.nbytes())
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def _is_wrapper(t: torch.Tensor) -> bool:
    """A tensor subclass that holds other tensors (float8 and NF4 wrappers, DTensor): its own
    storage is nominal; `__tensor_flatten__` names the tensors that hold its bytes."""
    return type(t) is not torch.Tensor and callable(getattr(t, "__tensor_flatten__", None))


def storage_keys(t: torch.Tensor, depth: int = 0) -> list[tuple[int, int]]:
    """The storages that hold a tensor's bytes: its own, or a wrapper subclass's inner
    tensors' (DTensor's local shard, a float8 tensor's data and scale)."""
    if not _is_wrapper(t):
        key = storage_key(t)
        return [] if key is None else [key]
    if depth > 8:
        return []
    try:
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = [getattr(t, n) for n in names]
    except Exception:
        return []
    return [k for x in inner if isinstance(x, torch.Tensor) for k in storage_keys(x, depth + 1)]


def distinct_bytes(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """The bytes of the distinct storages behind `tensors`, and how many there are."""
    seen: dict[int, int] = {}
    for t in tensors:
        for key in storage_keys(t):
            seen.setdefault(*key)
    return sum(seen.values()), len(seen)


@dataclass(slots=True, eq=False)
class CallBytes:
    """One call's memory while the pass runs."""

    saved: dict[int, int] = field(default_factory=dict)  # storage -> bytes, saved in the call
    saves: dict[int, int] = field(default_factory=dict)  # storage -> times saved in the call
    inputs: frozenset[int] = frozenset()  # its input tensors' storages
    input_bytes: int = 0
    backward_at: int | None = None  # its first output gradient's place on the backward clock
    params: frozenset[int] = frozenset()  # its module's trained parameters' storages
    leaf: bool = True  # no other hooked call ran inside it
    # the gradients its backward saw, in and out, by storage (an expanded scalar holds 4
    # bytes); empty until one arrives
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
            key[0] for t in (*module.parameters(), *module.buffers()) for key in storage_keys(t)
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
        # the backward's clock: output gradients reaching calls, and parameters' gradients
        # accumulated (post-accumulate-grad hooks, on while a pass is armed)
        self.clock = 0
        # (clock, the parameter's storage, its gradient's bytes)
        self.grads_made: list[tuple[int, int, int]] = []
        self._module = module
        self._grad_handles: list[Any] = []
        self._weak: dict[int, int] = {}  # storage address -> a weak reference to it
        self._generation: dict[int, int] = {}  # a reused address -> the key of its newest
        self.forwards = 0  # forwards counted (`saving` entered)
        self.skipped: str | None = None  # why a forward's saved tensors were not counted
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        self.peak: int | None = None  # CUDA: the whole pass's
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def arm(self) -> None:
        """Before a backward: each trained parameter's gradient, once accumulated, is put on
        the backward's clock. `disarm` removes these hooks (always: engine.passes, watch)."""
        seen: set[int] = set()
        for p in self._module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                hook = p.register_post_accumulate_grad_hook(self._grad_made)  # type: ignore[no-untyped-call]
                self._grad_handles.append(hook)

    def disarm(self) -> None:
        for handle in self._grad_handles:
            handle.remove()
        self._grad_handles.clear()
        self.release()

    def release(self) -> None:
        """The weak references to saved storages freed (after the meter's last use)."""
        for handle in self._weak.values():
            with contextlib.suppress(Exception):
                torch.UntypedStorage._free_weak_ref(handle)  # type: ignore[no-untyped-call]
        self._weak.clear()

    def _grad_made(self, p: torch.Tensor) -> None:
        own = storage_key(p)
        grad = storage_key(p.grad) if p.grad is not None else None
        if own is not None and grad is not None:
            self.grads_made.append((self.clock, own[0], grad[1]))
        self.clock += 1

    def output_grad(self, call: CallBytes) -> None:
        """A call's first output gradient arrived: its backward runs now."""
        if call.backward_at is None:
            call.backward_at = self.clock
            self.clock += 1

    def reset(self) -> None:
        """Forget a forward that failed, before it runs again (engine.passes)."""
        self.open.clear()
        self.saved.clear()
        self.saves.clear()
        self.calls.clear()
        self.freed_by.clear()
        self._last_leaf = None
        self.clock = 0
        self.grads_made.clear()

    def _live(self, t: torch.Tensor, cdata: int) -> int:
        """A storage's address, told apart from an earlier storage at the same address that
        has since been freed (gradient accumulation: one micro-batch's activations freed in
        its backward, the next one's allocated where they were)."""
        try:
            handle = self._weak.get(cdata)
            if handle is not None and not torch.UntypedStorage._expired(handle):
                return self._generation.get(cdata, cdata)
            if handle is not None:
                torch.UntypedStorage._free_weak_ref(handle)  # type: ignore[no-untyped-call]
                self._generation[cdata] = hash((cdata, len(self._generation), id(t)))
            self._weak[cdata] = cast(int, t.untyped_storage()._weak_ref())
        except (AttributeError, RuntimeError, TypeError):
            pass
        return self._generation.get(cdata, cdata)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        for key in storage_keys(t):
            self._count(t, key)
        return t

    def _count(self, t: torch.Tensor, key: tuple[int, int]) -> None:
        if key[1] and key[0] not in self.skip:  # (empty: nothing held)
            storage, n = self._live(t, key[0]), key[1]
            self.saved.setdefault(storage, n)
            self.saves[storage] = self.saves.get(storage, 0) + 1
            for call in self.open:
                call.saved.setdefault(storage, n)
                call.saves[storage] = call.saves.get(storage, 0) + 1
            inner = self.open[-1] if self.open else None
            self.freed_by.setdefault(storage, []).append(
                inner if inner is not None and inner.leaf else self._last_leaf
            )

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Every tensor autograd saves inside is counted (and kept as it is)."""
        self.forwards += 1
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
            self._live(t, k[0]) if k[0] in self._weak else k[0]: k[1]
            for _, t in iter_tensors((args, kwargs or {}), "in")
            for k in storage_keys(t)
        }
        call = CallBytes(inputs=frozenset(keys), input_bytes=sum(keys.values()))
        if module is not None:
            call.params = frozenset(
                k[0]
                for p in module.parameters()
                if p.requires_grad and (k := storage_key(p)) is not None
            )
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

    def step_peak(self, held: int) -> int:
        """The most one training step holds at once, walking its backward on its own clock:
        `held` (parameters, buffers, optimizer state, the model's output, alive throughout)
        + what is still saved (a storage is freed once the last leaf call's backward that
        needs it has run) + the parameters' gradients made so far (from the backward of the
        first leaf call using the parameter, else its accumulation) + the gradients flowing
        through the leaf call now (their storages as its hooks saw them; else its output's
        and input's sizes). Gradients are taken to start absent (zero_grad(set_to_none=True)).
        A leaf no gradient reached frees nothing."""
        leaves = [c for c in self.calls if c.leaf and c.backward_at is not None]
        end = self.clock  # after every event
        free_at: dict[int, int] = {}
        for storage, owners in self.freed_by.items():
            free_at[storage] = max(
                end if o is None or o.backward_at is None else o.backward_at for o in owners
            )
        freed: dict[int, int] = {}
        for storage, at in free_at.items():
            freed[at] = freed.get(at, 0) + self.saved[storage]
        # a parameter's gradient exists from the backward of the first leaf that uses it (a
        # tied weight's first part waits there for the rest), else from its accumulation
        first_use: dict[int, int] = {}
        for c in leaves:
            for param in c.params:
                at = c.backward_at or 0
                first_use[param] = min(first_use.get(param, at), at)
        events: list[tuple[int, CallBytes | None, int, int]] = [
            (c.backward_at or 0, c, 0, 0) for c in leaves
        ]
        events += [
            (min(at, first_use.get(param, at)), None, param, n) for at, param, n in self.grads_made
        ]
        events.sort(key=lambda e: e[0])
        live = self.saved_bytes
        made: set[int] = set()  # parameters whose gradient exists
        sizes = {param: n for _, param, n in self.grads_made}
        grads = 0
        peak = held + live
        for at, call, storage, n in events:
            if call is None:
                if storage not in made:
                    made.add(storage)
                    grads += n
                peak = max(peak, held + live + grads)
                continue
            seen = call.grad_storages  # the gradients its backward held, else their sizes
            flowing = sum(seen.values()) if seen else call.output_bytes + call.input_bytes
            # a tied weight's later use: its part made here and the sum with the part waiting
            # are held beside it at once (torch adds them into a new tensor)
            flowing += sum(
                2 * sizes.get(p, 0) for p in set(call.params) if p in made and first_use[p] < at
            )
            peak = max(peak, held + live + grads + flowing)
            live -= freed.pop(at, 0)
        return max(peak, held + live + grads)

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())


def _unpacked(t: torch.Tensor) -> torch.Tensor:
    return t
