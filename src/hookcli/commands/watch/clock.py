"""The step clock of hookcli.watch: which optimizer step a run is on, whether it is watched
(every `every`-th, starting with step 0), and when its gradients are complete and when it ends.

A *step* is an optimizer step (optimizer step hooks mark it, or `Watch.step()` without an
optimizer), so gradient accumulation counts right: every forward and backward between two
optimizer steps belongs to the step they lead to. With a GradScaler, its `update()` ends the
step instead, so a step the scaler skipped (inf gradients from too large a loss scale: not a
fault) is still a step.

The clock calls the watch back twice a step: `grads(optimizer, skipped)` when the step's
gradients are complete and the weights not yet changed (the optimizer, or None without one or
when the scaler skipped the step), and `ended()` when the step is over; the watch then
`advance`s it to the next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_NONE = object()


class StepClock:
    """Which optimizer step is being taken and how far it has come, told by the optimizer's
    step hooks and the scaler's update() while attached."""

    def __init__(
        self,
        every: int,
        *,
        optimizer: Any,
        scaler: Any,
        grads: Callable[[Any, bool], None],
        ended: Callable[[], None],
    ) -> None:
        self.every = every
        self.optimizer = optimizer
        self.scaler = scaler
        self._grads = grads
        self._ended = ended
        self.index = 0  # the optimizer step now being taken (0: the first)
        self.grads_seen = False  # its gradients were read (before the weights changed)
        self.stepped = False  # the optimizer's step ran (a scaler may skip it)
        self.skipped = False  # the scaler skipped it: the gradients held inf/NaN at its scale
        self.scale: float | None = None  # a watched step's loss scale (GradScaler), as it ran
        self._handles: list[Any] = []
        self._scaler_update: Any = None
        self._scaler_own: Any = _NONE

    @property
    def watched(self) -> bool:
        """Whether the step now being taken is a watched one."""
        return not self.index % self.every

    def advance(self) -> None:
        """The step ended: the next one is being taken."""
        self._forget()
        self.index += 1

    def _forget(self) -> None:
        self.grads_seen = False
        self.stepped = False
        self.skipped = False
        self.scale = None

    def attach(self) -> None:
        """The optimizer's step hooks, and the scaler's update(), mark the steps from now on."""
        if self.optimizer is not None:
            self._handles += [
                self.optimizer.register_step_pre_hook(self._before_step),
                self.optimizer.register_step_post_hook(self._after_step),
            ]
        if self.scaler is not None:
            # the scaler's update() ends every step, the skipped ones too (an instance
            # attribute over the class's method, removed on detach)
            original = self.scaler.update

            def update(*args: Any, **kwargs: Any) -> Any:
                if self.watched:  # the scale this step ran at, before update() changes it
                    self.scale = _scale_of(self.scaler)
                result = original(*args, **kwargs)
                self._scaler_updated()
                return result

            self._scaler_own = self.scaler.__dict__.get("update", _NONE)
            self.scaler.update = update
            self._scaler_update = original

    def detach(self) -> None:
        """The hooks removed, the scaler's update() as it was; a step left unfinished is
        forgotten."""
        self._forget()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._scaler_update is not None:
            own = self._scaler_own  # an `update` the scaler instance had of its own comes back
            if own is _NONE:
                self.scaler.__dict__.pop("update", None)
            else:
                self.scaler.__dict__["update"] = own
            self._scaler_update = None

    def step(self) -> None:
        """`Watch.step()`: the end of a step without an optimizer to hook."""
        self._grads_ready(None)
        self._ended()

    def _grads_ready(self, optimizer: Any, *, skipped: bool = False) -> None:
        self.grads_seen = True
        self.skipped = skipped
        self._grads(optimizer, skipped)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        # the hook sees the step's arguments with the optimizer first: (opt, closure?)
        args = tuple(args)
        at = 1 if args and args[0] is optimizer else 0
        closure = kwargs.get("closure") if kwargs else None
        if closure is None and len(args) > at and callable(args[at]):
            closure = args[at]
        if closure is None:
            self._grads_ready(optimizer)
            return None
        # step(closure): forward and backward run inside step(), after this hook — the
        # gradients are read when the closure returns (LBFGS calls it again: the first only)

        def measured() -> Any:
            result = closure()
            if not self.grads_seen:
                self._grads_ready(optimizer)
            return result

        if kwargs and "closure" in kwargs:
            return args, dict(kwargs, closure=measured)
        return (*args[:at], measured, *args[at + 1 :]), kwargs

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.stepped = True
        if self.scaler is None:
            self._ended()

    def _scaler_updated(self) -> None:
        if not self.stepped and not self.grads_seen:
            # scaler.step() skipped optimizer.step(): the gradients held inf/NaN at this loss
            # scale. Expected, not a fault — but the forward (outputs, loss) is checked
            self._grads_ready(None, skipped=True)  # (the optimizer's state is still bundled)
        self._ended()


def _scale_of(scaler: Any) -> float | None:
    """A GradScaler's loss scale now (None when it is disabled, or a scaler-like object has
    no scale to tell)."""
    enabled, scale = getattr(scaler, "is_enabled", None), getattr(scaler, "get_scale", None)
    if not callable(enabled) or not callable(scale) or not enabled():
        return None
    return float(scale())
