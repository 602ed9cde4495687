"""hookcli.watch: statistics of a training run, one JSONL line per watched optimizer step, and
a repro bundle on the first NaN/Inf.

`Watch` composes the jobs, each in its own module: the step clock (clock.py: which optimizer
step the run is on, whether it is watched, when its gradients are complete and when it ends),
what a watched step measures (capture.py: hooks on the selected layers, the parameters'
gradients and updates, memory), the first NaN/Inf (nonfinite.py: what every step keeps to run
again, the check, the hooked re-run, the bundle), and where the lines go (sinks.py: the log,
TensorBoard). Here: the model's own root hooks, which every step's forwards pass through
(a no_grad forward or one inside `pause()` is not the step's), and the context that puts
everything on and takes it off again, leaving the model as it found it.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from hookcli.commands.probes.memory import StepMemory
from hookcli.commands.watch.bundle import check_bundle_dest
from hookcli.commands.watch.capture import StepCapture, WatchedModel
from hookcli.commands.watch.clock import StepClock
from hookcli.commands.watch.compiled import EagerSwitch, RootCall, inner_module
from hookcli.commands.watch.nonfinite import FirstNonfinite, StepState, bundle_dir, stderr_line
from hookcli.commands.watch.sinks import LineSinks
from hookcli.commands.watch.steptools import params_of, process_rank, rank_log_path
from hookcli.engine.copysafe import CopySafeHook
from hookcli.engine.hooks import Target
from hookcli.engine.sharded import data_parallel_position, whole_of
from hookcli.errors import UsageError, one_line
from hookcli.options import DEFAULTS, WatchOptions
from hookcli.records import NonfiniteLine, StepLine


class Watch:
    """The context manager `hookcli.watch` returns. See the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        options: WatchOptions = DEFAULTS.watch,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: Any = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise UsageError(
                f"hookcli.watch needs an nn.Module, got {type(model).__name__}.",
                "pass the model being trained.",
            )
        every, ring = options.every, options.ring
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise UsageError(f"every must be 1 or more, got {every!r}.", "e.g. every=10")
        if isinstance(ring, bool) or not isinstance(ring, int) or ring < 0:
            raise UsageError(f"ring must be 0 or more, got {ring!r}.", "e.g. ring=8")
        if scaler is not None and not callable(getattr(scaler, "update", None)):
            raise UsageError(
                f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}.",
                "pass the GradScaler whose scaler.step(opt) the loop calls.",
            )
        self.options = options
        self.model = model  # what the loop calls (DDP, a compiled module, or the module)
        self.module = inner_module(model)  # what holds the layers
        self.optimizer = optimizer
        self.scaler = scaler
        watched = WatchedModel.of(self.module, options.layers, options.types)
        self.targets: list[Target] = watched.targets
        self._watched = watched
        self.rank, self.world_size = process_rank()
        log = options.log
        self.log_path = (
            None if log is None else rank_log_path(Path(log), self.rank, self.world_size)
        )
        self.bundle_path = bundle_dir(options.bundle, self.log_path, self.rank, self.world_size)
        self.recent: collections.deque[StepLine] = collections.deque(maxlen=ring)
        # the watched steps' lines: all of them without a log; with one (they are in the
        # file), the last `ring` only, so a long run does not grow in memory
        self.records: collections.deque[StepLine] | list[StepLine] = (
            self.recent if log is not None else []
        )
        # the NaN/Inf events (their log lines): the first one, once seen (the watch stops
        # checking after it, so there is at most one); a list, so `len()` and `[0]` mean that
        self.nonfinite: list[NonfiniteLine] = []
        grads, ended = self._guarded(self._grads_ready), self._guarded(self._finish)
        self._clock = StepClock(every, optimizer=optimizer, scaler=scaler, grads=grads, ended=ended)
        self._capture = StepCapture(watched, probes=[StepMemory()] if options.memory else [])
        self._capture.data_parallel = data_parallel_position(model)
        self._first = FirstNonfinite(
            watched,
            options,
            optimizer=optimizer,
            rank=self.rank,
            world_size=self.world_size,
            bundle=self.bundle_path,
        )
        self._sinks = LineSinks(
            self.log_path, options.tensorboard, rank=self.rank, world_size=self.world_size
        )
        self._step = StepState()  # the step being taken: replaced whole when it ends
        self._eager = EagerSwitch(model)
        # where the watch stands: entered (`_open`) and not closed; while open, the root hooks
        # stand aside for a re-run (`_busy`) and for pause()…resume() (`_paused`, a validation
        # run, not the step's); `_evaluating` while a no_grad forward runs in a watched step
        # (its layers' hooks are off until it returns)
        self._open = False
        self._busy = False
        self._paused = False
        self._evaluating = False
        self._handles: list[Any] = []
        self._root_call: RootCall | None = None
        # what failed inside the watch (None: nothing); from then on it records nothing and
        # its hooks stand aside, the training going on
        self.failed: str | None = None

    def __repr__(self) -> str:
        """One line: what is watched, how far the run is, where it logs, NaN/Inf."""
        model = type(self.module).__name__
        state = "open" if self._open else "closed"
        parts = [
            f"{len(self.targets)} layers, every "
            + ("step" if self.options.every == 1 else f"{self.options.every} steps"),
            f"{self.step_index} steps taken, {len(self.recent)} recent records",
        ]
        if self.log_path is not None:
            parts.append(f"log {self.log_path}")
        if self.nonfinite:
            first = self.nonfinite[0]
            parts.append(f"NaN/Inf at step {first.step}")
        else:
            parts.append("no NaN/Inf")
        return f"<hookcli.watch {model} ({state}): {'; '.join(parts)}>"[:2000]

    @property
    def step_index(self) -> int:
        """The optimizer step now being taken (0: the first)."""
        return self._clock.index

    @step_index.setter
    def step_index(self, value: int) -> None:
        self._clock.index = value  # (a run resumed from a checkpoint)

    # ------------------------------------------------------------ the context

    def __enter__(self) -> Watch:
        if self.bundle_path is not None:
            check_bundle_dest(self.bundle_path)  # a bundle replaces only an earlier bundle
        try:
            self._sinks.open()
            pre, post = self._guarded(self._root_pre), self._guarded(self._root_post)
            if getattr(self.model, "_compiled_call_impl", None) is not None:
                self._root_call = RootCall(self.model, pre, post)
            else:
                self._handles += [
                    self.model.register_forward_pre_hook(CopySafeHook(pre), with_kwargs=True),
                    self.model.register_forward_hook(CopySafeHook(post)),
                ]
            self._clock.attach()
        except BaseException:
            self._close()
            raise
        self._open = True
        self._arm()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close()

    def _close(self) -> None:
        self._open = False
        self._capture.release()
        self._disarm()  # a step left unfinished is not logged: its numbers are incomplete
        self._step = StepState()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._root_call is not None:
            self._root_call.remove()
            self._root_call = None
        self._clock.detach()
        self._sinks.close()

    # ------------------------------------------------------------ what the loop calls

    def loss(self, value: torch.Tensor | float) -> None:
        """The step's loss: logged with a watched step and checked for NaN/Inf on every step
        (kept as a reference, read when the step ends: no synchronisation here). Several calls
        in one step add up: with gradient accumulation, each micro-batch's loss as it was
        backpropagated, and the step's is their sum (as the Lightning callback logs it). A
        DTensor (a loss under `loss_parallel`) is taken whole, as a plain tensor."""
        given = whole_of(value.detach()) if isinstance(value, torch.Tensor) else float(value)
        before = self._step.loss
        if before is None:
            self._step.loss = given
        else:  # (a tensor's elements summed: two micro-batches' may differ in shape)
            self._step.loss = _summed(before) + _summed(given)

    def step(self) -> None:
        """Mark the end of a step when there is no optimizer to hook (its gradients and
        parameters are then not measured)."""
        if self.optimizer is not None:
            raise UsageError(
                "Watch.step() with an optimizer: its step hooks already mark the steps.",
                "drop the w.step() call, or watch without optimizer=.",
            )
        self._clock.step()

    @property
    def watching(self) -> bool:
        """Whether the step now being taken is a watched one."""
        return self._capture.armed

    def pause(self) -> None:
        """Forwards from now until `resume()` are not the step's: a validation run between
        steps (a compiled model runs its compiled code; a watched step's hooks come off and
        go back on after; nothing is captured or checked)."""
        if self._paused:
            return
        self._paused = True
        if self._capture.armed:
            self._capture.hooks_off()
            self._eager.off()

    def resume(self) -> None:
        if not self._paused:
            return
        self._paused = False
        if self._capture.armed and self._open:
            self._capture.hooks_on()
            self._eager.on()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """`with w.paused(): evaluate(model)` — pause() and resume() around a block."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    # ------------------------------------------------------------ never the training's failure

    def _guarded(self, hook: Callable[..., None]) -> Callable[..., None]:
        """`hook` (a root hook, the clock's), which never raises into the training loop: a
        failure inside the watch is one line on stderr, and the watch records nothing more
        (its hooks stand aside; they come off when it closes), the step going on."""

        def guarded(*args: Any) -> None:
            if self.failed is not None:
                return
            try:
                hook(*args)
            except Exception as exc:
                self._fail(exc)

        return guarded

    def _fail(self, exc: Exception) -> None:
        self.failed = one_line(exc)
        step = self.step_index
        print(
            f"hookcli.watch: stopped recording at step {step} on rank {self.rank}: the watch "
            f"failed ({self.failed}); the training goes on.",
            file=sys.stderr,
        )
        self._busy = False
        self._step = StepState()  # the kept batch let go
        with contextlib.suppress(Exception):
            self._disarm()  # the layers' hooks off now; the root's and the clock's at exit
            self._capture.release()  # and the copy of the weights

    # ------------------------------------------------------------ the model's root hooks

    def _root_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._busy or self._paused:
            return
        if self._evaluating:  # the last no_grad forward raised: its post-hook never ran
            self._end_evaluation()
        if not torch.is_grad_enabled():
            # a forward without autograd (evaluation under no_grad) is not part of the step's
            # training: not kept (a validation loop would otherwise hold every batch), not
            # checked, not re-run, and on a watched step not hooked (hooks off until it ends)
            if self._capture.armed:
                self._capture.hooks_off()
                self._evaluating = True
            return
        self._capture.forward_began(module, args, kwargs)
        if self.options.check and not self.nonfinite:  # else no capture, no copy of buffers
            self._step.keep(args, kwargs, self._watched.modules)

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._evaluating:
            self._end_evaluation()
            return
        if self._busy or self._paused:
            return
        self._capture.forward_ended()
        if torch.is_grad_enabled():
            self._step.keep_output(output)

    def _end_evaluation(self) -> None:
        self._evaluating = False
        if not self._paused:
            self._capture.hooks_on()

    # ------------------------------------------------------------ steps

    def _arm(self) -> None:
        """Hooks on, when the coming step is watched."""
        if not self._open or not self._clock.watched:
            return
        self._capture.arm()
        self._eager.on()  # a compiled model runs its eager module on a watched step

    def _disarm(self) -> None:
        self._evaluating = False
        self._capture.disarm()
        self._eager.off()

    def _grads_ready(self, optimizer: Any, skipped: bool) -> None:
        """The step's gradients are complete and the weights not yet changed. Without an
        optimizer (w.step()), the model's parameters are checked, not measured."""
        params = params_of(optimizer) if optimizer is not None else []
        checked = params if optimizer is not None else list(self.module.parameters())
        if self._capture.armed and not skipped:
            self._capture.grads(params)
        if self.options.check and not self.nonfinite:
            found = self._step.nonfinite(checked, skipped)
            if found:
                self._on_nonfinite(found, optimizer)

    def _finish(self) -> None:
        """The step ended: a watched step's record written, then the next step armed."""
        if self._capture.armed:
            try:
                record = self._record()
            finally:
                self._disarm()
            if self.records is not self.recent:
                self.records.append(record)
            self.recent.append(record)
            self._sinks.write(record)
        self._step = StepState()
        self._clock.advance()
        self._arm()

    def _record(self) -> StepLine:
        scale = self._clock.scale  # (the step's own, read before the scaler's update)
        record = self._capture.line(
            step=self.step_index,
            rank=self.rank,
            world_size=self.world_size,
            loss=self._step.loss,
            optimizer=self.optimizer,
            grad_scale=scale,
        )
        if self.scaler is not None:
            record.skipped = self._clock.skipped
            record.scale = scale
        return record

    def _on_nonfinite(self, found: list[str], optimizer: Any) -> None:
        """Bundle, hooked re-run, log line, one line on stderr — while the weights and the
        optimizer state are still the step's own."""
        self._capture.hooks_off()  # the watched step's hooks must not see the re-run
        self._busy = True
        self._eager.on()
        try:
            line = self._first.line(
                found, self._step, optimizer, index=self.step_index, recent=self.recent
            )
        finally:
            self._busy = False
            if not self._capture.armed:
                self._eager.off()
        self.nonfinite.append(line)
        self._sinks.write(line)
        print(stderr_line(line), file=sys.stderr)


def _summed(loss: torch.Tensor | float) -> torch.Tensor | float:
    """A loss's elements summed in float64 (micro-batches' bfloat16 losses are not summed
    in bfloat16)."""
    return loss.double().sum() if isinstance(loss, torch.Tensor) else loss
