"""hookcli.watch: statistics of a training run, one JSONL line per watched optimizer step.

A *step* is an optimizer step (optimizer step hooks mark it, or `Watch.step()` without an
optimizer), so gradient accumulation counts right: every forward and backward between two
optimizer steps belongs to the step they lead to. On a watched step (every `every`-th,
starting with step 0) the selected modules carry hookcli's hooks — every call's input and
output statistics and its output gradients, with one transfer to the host when the step ends
— and the optimizer's pre-step hook measures each parameter's gradient and keeps its value,
so the post-step hook can give the update/weight ratio ‖w_after - w_before‖ / ‖w_before‖. On
other steps no module hook is installed at all: they run as if hookcli were not there.

What is not built yet (issue 17): the ring buffer and repro bundle on the first NaN/Inf,
`hookcli replay`, `check`/`report` over a log, torch.compile, DDP and Lightning.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from hookcli.engine.hooks import HookSession, Target
from hookcli.engine.origins import find_origins, number_backward
from hookcli.engine.selection import module_entries, select
from hookcli.engine.stats import StatsCollector, finite_or_none
from hookcli.errors import UsageError
from hookcli.records import TensorStats

LOG_SCHEMA = 1  # the JSONL line's own version


class Watch:
    """The context manager `hookcli.watch` returns. See the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        every: int = 1,
        layers: Sequence[str] = (),
        types: Sequence[str] = (),
        log: str | Path | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise UsageError(
                f"hookcli.watch needs an nn.Module, got {type(model).__name__}.",
                "pass the model being trained.",
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise UsageError(f"every must be 1 or more, got {every!r}.", "e.g. every=10")
        self.model = model
        self.optimizer = optimizer
        self.every = every
        entries = module_entries(model)
        self.targets: list[Target] = select(
            entries, layers=tuple(layers), types=tuple(types), model_label="the model"
        )
        self._types = {n: e.type for e in entries for n in e.names}
        selected = {id(t.module) for t in self.targets}
        self._partial = any(e.leaf and id(e.module) not in selected for e in entries)
        self._names = {id(p): n for n, p in model.named_parameters()}
        self.log_path = Path(log) if log is not None else None
        self.records: list[dict[str, Any]] = []  # every watched step's line, as written
        self.step_index = 0  # the optimizer step now being taken (0: the first)
        self._session: HookSession | None = None
        self._collector: StatsCollector | None = None
        # a watched step's parameters: name, gradient statistics, the parameter, its value
        # before the step; and the norms of those values (one foreach kernel per device)
        self._params: list[tuple[str, TensorStats | None, torch.Tensor, torch.Tensor]] = []
        self._before_norms: list[torch.Tensor] = []
        self._loss: torch.Tensor | float | None = None
        self._handles: list[Any] = []
        self._file: Any = None
        self._open = False

    # ------------------------------------------------------------ the context

    def __enter__(self) -> Watch:
        if self.log_path is not None:
            try:
                self._file = self.log_path.open("a", encoding="utf-8")
            except OSError as exc:
                raise UsageError(
                    f"cannot write the watch log {self.log_path}: {exc.strerror}.",
                    "give a writable path, e.g. log='run.jsonl'.",
                ) from exc
        if self.optimizer is not None:
            self._handles += [
                self.optimizer.register_step_pre_hook(self._before_step),
                self.optimizer.register_step_post_hook(self._after_step),
            ]
        self._open = True
        self._arm()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._open = False
        self._disarm()  # a step left unfinished is not logged: its numbers are incomplete
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._file is not None:
            self._file.close()
            self._file = None

    # ------------------------------------------------------------ what the loop calls

    def loss(self, value: torch.Tensor | float) -> None:
        """The step's loss, logged with it (read when the step ends: no synchronisation)."""
        if self._session is not None:
            self._loss = value.detach() if isinstance(value, torch.Tensor) else float(value)

    def step(self) -> None:
        """Mark the end of a step when there is no optimizer to hook (its gradients and
        parameters are then not measured)."""
        if self.optimizer is not None:
            raise UsageError(
                "Watch.step() with an optimizer: its step hooks already mark the steps.",
                "drop the w.step() call, or watch without optimizer=.",
            )
        self._finish()

    @property
    def watching(self) -> bool:
        """Whether the step now being taken is a watched one."""
        return self._session is not None

    # ------------------------------------------------------------ steps

    def _arm(self) -> None:
        """Hooks on, when the coming step is watched."""
        if not self._open or self.step_index % self.every:
            return
        self._collector = StatsCollector()
        self._session = HookSession(self.targets, self._collector, grads=True)
        self._session.__enter__()

    def _disarm(self) -> None:
        session = self._session
        if session is not None:
            session.remove()
            session.remove_tensor_hooks()
        self._session = None
        self._collector = None
        self._params = []
        self._before_norms = []
        self._loss = None

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._session is None or self._collector is None:
            return
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    name = self._names.get(id(p), f"param{len(self._params)}")
                    grad = None if p.grad is None else self._collector.add(p.grad, f"{name}.grad")
                    self._params.append((name, grad, p, p.detach().clone()))
            befores = [b for *_, b in self._params]
            self._before_norms = list(torch._foreach_norm(befores)) if befores else []

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._finish()

    def _finish(self) -> None:
        """The step ended: a watched step's record written, then the next step armed."""
        if self._session is not None and self._collector is not None:
            try:
                record = self._record()
            finally:
                self._disarm()
            self.records.append(record)
            if self._file is not None:
                self._file.write(json.dumps(record, allow_nan=False) + "\n")
                self._file.flush()
        self.step_index += 1
        self._arm()

    def _record(self) -> dict[str, Any]:
        session, collector = self._session, self._collector
        assert session is not None
        assert collector is not None
        with torch.no_grad():
            # the update, in place of the copy: one foreach subtraction and norm, one transfer
            befores = [b for *_, b in self._params]
            if befores:
                torch._foreach_sub_(befores, [p for _, _, p, _ in self._params])
                deltas = torch._foreach_norm(befores)
                norms = [*self._before_norms, *deltas]
                try:  # one transfer (parameters on one device)
                    flat = torch.stack(norms).double().cpu().tolist()
                except RuntimeError:  # spread over devices: one each
                    flat = [float(n) for n in norms]
                both = list(zip(flat[: len(deltas)], flat[len(deltas) :], strict=True))
            else:
                both = []
            updates = [
                (name, grad, w_norm, delta)
                for (name, grad, _, _), (w_norm, delta) in zip(self._params, both, strict=True)
            ]
        collector.finalize()
        calls = [p.complete(True) for p in session.calls]
        number_backward(session.calls)
        origins = find_origins(session.calls, self._types, partial=self._partial)
        loss = self._loss
        if isinstance(loss, torch.Tensor):
            loss = float(loss.double().sum()) if loss.numel() else None
        params = []
        for name, grad, w_norm, delta in updates:
            params.append(
                {
                    "name": name,
                    "norm": finite_or_none(w_norm),
                    "grad": None if grad is None else _stats(grad),
                    "update_norm": finite_or_none(delta),
                    "update_ratio": finite_or_none(delta / w_norm) if w_norm else None,
                }
            )
        return {
            "schema": LOG_SCHEMA,
            "step": self.step_index,
            "loss": finite_or_none(loss) if isinstance(loss, float) else None,
            "layers": [_call(c) for c in calls],
            "params": params,
            "nonfinite_origins": [_plain(o) for o in origins],
        }


def _stats(t: TensorStats) -> dict[str, Any]:
    """A tensor's statistics for the log: the numbers, no element values or histograms."""
    out = _plain(t)
    out.pop("values", None)
    out.pop("hist", None)
    return out


def _call(c: Any) -> dict[str, Any]:
    return {
        "name": c.name,
        "type": c.type,
        "call": c.call,
        "inputs": [_stats(t) for t in c.inputs],
        "outputs": [_stats(t) for t in c.outputs],
        "grad_outputs": None if c.grad_outputs is None else [_stats(t) for t in c.grad_outputs],
        "grad_inputs": None if c.grad_inputs is None else [_stats(t) for t in c.grad_inputs],
        "error": c.error,
    }


def _plain(obj: Any) -> dict[str, Any]:
    """A record as JSON data (its floats are finite or None already)."""
    return dataclasses.asdict(obj)
