"""What a watched step of hookcli.watch measures, and its line.

The selected modules carry hookcli's hooks — every call's input and output statistics and its
output gradients, with one transfer to the host when the step ends — and, when the step's
gradients are complete, each parameter's gradient is measured and its value kept, so the
step's end gives the update/weight ratio ‖w_after - w_before‖ / ‖w_before‖. What the watch
asks for beyond that comes as step probes (engine/probes.StepProbe), each told of the step's
forwards and folding its findings into the line: memory=True's (commands/probes/memory.py)
counts the bytes autograd saved in each layer call and the step's memory totals. On other steps
no module hook is installed below the model itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookcli.commands.watch.steptools import device_of, logged_call, numbers_only, padding_mask
from hookcli.engine.hooks import HookSession, Target
from hookcli.engine.measure import finished_calls, rows_only, statistics
from hookcli.engine.origins import find_origins
from hookcli.engine.probes import StepArmed, StepProbe
from hookcli.engine.selection import module_entries, select
from hookcli.engine.sharded import Squares, data_parallel_groups, groups_of, local_of
from hookcli.engine.stats import StatsCollector
from hookcli.engine.tensorbits import finite_or_none
from hookcli.records import LoggedParam, StepLine, TensorStats, rescale


@dataclass(frozen=True, slots=True)
class WatchedModel:
    """The model as a watch sees it: the module that holds the layers, the selected ones."""

    module: nn.Module
    targets: list[Target]
    types: dict[str, str]  # each module's type by each of its names
    partial: bool  # some leaf is not selected
    names: dict[int, str]  # each parameter's name by its id
    modules: list[nn.Module]

    @classmethod
    def of(cls, module: nn.Module, layers: tuple[str, ...], types: tuple[str, ...]) -> WatchedModel:
        entries = module_entries(module)
        targets = select(entries, layers=layers, types=types, model_label="the model")
        selected = {id(t.module) for t in targets}
        return cls(
            module=module,
            targets=targets,
            types={n: e.type for e in entries for n in e.names},
            partial=any(e.leaf and id(e.module) not in selected for e in entries),
            names={id(p): n for n, p in module.named_parameters()},
            modules=list(module.modules()),
        )


class StepCapture:
    """A watched step's hooks and what they measure: armed when a watched step begins,
    disarmed when it ends (its `line()` made first) or when the watch closes."""

    def __init__(self, watched: WatchedModel, *, probes: Sequence[StepProbe] = ()) -> None:
        self.watched = watched
        self.probes = tuple(probes)  # what the watch asked for beyond the statistics
        # ranks sharing their data (tensor parallel): this rank's [index, count] among the
        # data-parallel ones, written on each line (engine/sharded.data_parallel_position)
        self.data_parallel: list[int] | None = None
        self._session: HookSession | None = None
        self._collector: StatsCollector | None = None
        # a watched step's parameters: name, gradient statistics, the parameter, its value
        # before the step; and the norms of those values (one foreach kernel per device)
        self._params: list[tuple[str, TensorStats | None, torch.Tensor, torch.Tensor]] = []
        self._before_norms: list[torch.Tensor] = []
        self._groups: list[tuple[Any, ...]] = []  # each parameter's shards' process groups
        self._buffers_for_copies: list[torch.Tensor] = []
        self._dp: tuple[Any, ...] | None = None  # the model's data-parallel groups, once found

    @property
    def armed(self) -> bool:
        """Whether the step now being taken is watched (its hooks may be off for a while)."""
        return self._session is not None

    def arm(self) -> None:
        self._collector = statistics(repays_kernels=True)  # a training run repays loading numba
        module = self.watched.module
        # tensor parallel: which plain tensors are shards, and the groups rows are compared
        # over (each rank logs its own batch: the logs merge in `hookcli report`); FSDP's
        # groups are data parallel, not tensor parallel
        if self._dp is None:
            self._dp = data_parallel_groups(module)
        self._collector.book.arm_tensor_parallel(module, dp=self._dp)
        self._collector.rows_only = rows_only(self.watched.targets, module)
        armed = StepArmed(module, device_of(module))
        for probe in self.probes:
            probe.arm(armed)
        self._session = HookSession(
            self.watched.targets, self._collector, grads=True, memory=armed.memory
        )
        self._session.__enter__()

    def disarm(self) -> None:
        for probe in self.probes:
            probe.disarm()
        session = self._session
        if session is not None:
            session.remove()
            session.remove_tensor_hooks()
        self._session = None
        self._collector = None
        self._params = []
        self._before_norms = []
        self._groups = []

    def release(self) -> None:
        """The copies of the weights kept between watched steps let go (the watch closes)."""
        self._buffers_for_copies = []

    def hooks_off(self) -> None:
        """The layers' hooks off (a forward that is not the step's), the step still watched."""
        if self._session is not None:
            self._session.remove()

    def hooks_on(self) -> None:
        if self._session is not None:
            self._session.__enter__()

    # ------------------------------------------------------------ during the step

    def forward_began(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """A forward of the model with autograd begins."""
        if self._collector is not None:  # a padded batch's padding left out (issue 48)
            self._collector.set_token_mask(padding_mask(module, args, kwargs))
        if self._session is not None:
            for probe in self.probes:
                probe.forward_began()

    def forward_ended(self) -> None:
        if self._session is not None:  # (disarm lets go of what a forward left behind)
            for probe in self.probes:
                probe.forward_ended()

    def grads(self, params: list[torch.Tensor]) -> None:
        """The step's gradients are complete and the weights not yet changed: each
        parameter's gradient measured and its value kept."""
        assert self._collector is not None
        with torch.no_grad():
            # a sharded parameter (FSDP2, tensor parallel): its local part here, the norms of
            # the whole from the parts' (engine/sharded.Squares)
            values = [local_of(p.detach()) for p in params]
            self._groups = [groups_of(p) for p in params]
            befores = self._copies(values)
            for p, value, before in zip(params, values, befores, strict=True):
                name = self.watched.names.get(id(p), f"param{len(self._params)}")
                grad = (
                    None
                    if p.grad is None
                    else self._collector.add(p.grad, f"{name}.grad", positions=False)
                )
                self._params.append((name, grad, value, before))
            self._before_norms = _norms(befores)

    def _copies(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The weights before the step, copied into buffers kept from one watched step to the
        next (one copy of the parameters while watching): writing into memory already touched
        costs a fifth of a fresh clone's allocation and page faults (resnet18: 3.4 vs 19 ms)."""
        buffers = self._buffers_for_copies
        fits = len(buffers) == len(params) and all(
            b.shape == p.shape and b.dtype == p.dtype and b.device == p.device
            for b, p in zip(buffers, params, strict=True)
        )
        if not fits:
            self._buffers_for_copies = [p.detach().clone() for p in params]
        elif params:
            torch._foreach_copy_(buffers, [p.detach() for p in params])
        return self._buffers_for_copies

    # ------------------------------------------------------------ the step's end

    def line(
        self,
        *,
        step: int,
        rank: int,
        world_size: int,
        loss: torch.Tensor | float | None,
        optimizer: Any,
        grad_scale: float | None = None,
    ) -> StepLine:
        """The watched step's line, once its weights have changed. `grad_scale`: a
        GradScaler's loss scale the step's backward ran at (the layers' gradients are divided
        by it: the loss's own, as the parameters' are once the scaler unscaled them)."""
        session = self._session
        assert session is not None
        with torch.no_grad():
            # the update, in place of the copy: one foreach subtraction and norm, one transfer
            befores = [b for *_, b in self._params]
            if befores:
                norms = [*self._before_norms, *_updates(befores, [p for *_, p, _ in self._params])]
                try:  # one transfer (parameters on one device)
                    flat = torch.stack(norms).double().cpu().tolist()
                except RuntimeError:  # spread over devices: one each
                    flat = [float(n) for n in norms]
            else:
                flat = []
        # a sharded parameter's norms: its parts' squares ride along in the gather that
        # merges the step's rows (engine/sharded.Squares), added over its groups there
        sharded = self._params and any(self._groups)
        squares = Squares([v * v for v in flat], self._groups * 2) if sharded else None
        if squares is not None:
            assert self._collector is not None
            self._collector.book.squares.append(squares)
        for probe in self.probes:
            probe.ended()
        calls = finished_calls(session, backward=True)
        if grad_scale:  # (a skipped step's inf/NaN stay what they were)
            for c in calls:
                for t in (*(c.grad_inputs or ()), *(c.grad_outputs or ())):
                    rescale(t, 1.0 / grad_scale)
        if squares is not None:  # (null where the ranks did not agree: this rank's part only)
            flat = [
                math.sqrt(v) if squares.added or not gs else math.nan
                for v, gs in zip(squares.values, squares.groups, strict=True)
            ]
        half = len(flat) // 2
        updates = [
            (name, grad, w_norm, delta)
            for (name, grad, _, _), w_norm, delta in zip(
                self._params, flat[:half], flat[half:], strict=True
            )
        ]
        watched = self.watched
        origins = find_origins(session.calls, watched.types, partial=watched.partial)
        if isinstance(loss, torch.Tensor):
            loss = float(loss.double().sum()) if loss.numel() else None
        params = [
            LoggedParam(
                name=name,
                norm=finite_or_none(w_norm),
                grad=None if grad is None else numbers_only(grad),
                update_norm=finite_or_none(delta),
                update_ratio=finite_or_none(delta / w_norm) if w_norm else None,
            )
            for name, grad, w_norm, delta in updates
        ]
        record = StepLine(
            step=step,
            rank=rank,
            world_size=world_size,
            loss=finite_or_none(loss) if isinstance(loss, float) else None,
            layers=[logged_call(c) for c in calls],
            params=params,
            nonfinite_origins=list(origins),
            # "loss": null alone would read as "not given"
            loss_nonfinite=isinstance(loss, float) and not math.isfinite(loss),
            data_parallel=self.data_parallel,
        )
        for probe in self.probes:
            probe.finish(record, optimizer)
        return record


_HALF = (torch.float16, torch.bfloat16)


def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's L2 norm, accumulated in float64 whatever its dtype (a bfloat16 one's
    norm in its own dtype is off in the third digit)."""
    return list(torch._foreach_norm(tensors, 2, dtype=torch.float64)) if tensors else []


def _updates(befores: list[torch.Tensor], afters: list[torch.Tensor]) -> list[torch.Tensor]:
    """The norms of after - before, before's buffers overwritten: a half-precision weight's
    difference taken in float32 (exact unless the two differ in magnitude by over 2^16; its
    own dtype would round it)."""
    half = {i for i, b in enumerate(befores) if b.dtype in _HALF}
    rest = [i for i in range(len(befores)) if i not in half]
    if rest:
        torch._foreach_sub_([befores[i] for i in rest], [afters[i] for i in rest])
    norms = dict(zip(rest, _norms([befores[i] for i in rest]), strict=True))
    for i in half:  # one float32 difference at a time: no second copy of the weights
        norms[i] = torch.linalg.vector_norm(befores[i].float().sub_(afters[i]), dtype=torch.float64)
    return [norms[i] for i in range(len(befores))]
