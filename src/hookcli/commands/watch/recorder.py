"""hookcli.watch: statistics of a training run, one JSONL line per watched optimizer step, and
a repro bundle on the first NaN/Inf.

A *step* is an optimizer step (optimizer step hooks mark it, or `Watch.step()` without an
optimizer), so gradient accumulation counts right: every forward and backward between two
optimizer steps belongs to the step they lead to. With a GradScaler passed as `scaler=`, its
`update()` ends the step instead, so a step the scaler skipped (inf gradients from too large a
loss scale: not a fault) is still a step.

On a watched step (every `every`-th, starting with step 0) the selected modules carry
hookcli's hooks — every call's input and output statistics and its output gradients, with one
transfer to the host when the step ends — and the optimizer's pre-step hook measures each
parameter's gradient and keeps its value, so the post-step hook can give the update/weight
ratio ‖w_after - w_before‖ / ‖w_before‖. On other steps no module hook is installed below the
model itself.

Every step, watched or not, the model's own root hooks keep references to what the step needs
to run again (commands.watch.bundle: arguments, RNG, autocast, output gradients; the buffers as
the step began are the one copy), and the pre-step hook checks the loss (given to `w.loss`),
the model's outputs and every parameter gradient for NaN/Inf: one norm per tensor group and a
single read on the host. The first time one is not finite, before the optimizer changes
anything, the recorder re-runs the step with hooks on to name the first non-finite layer call
and direction, writes the repro bundle (under DDP: rank 0's, and that of any rank whose re-run
found the origin), and logs a "nonfinite" line.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from hookcli._version import __version__
from hookcli.commands.memory import gradient_bytes, optimizer_bytes, totals
from hookcli.commands.watch.bundle import (
    ForwardCapture,
    capture_forward,
    check_bundle_dest,
    rerun,
    rng_kept,
    watch_output,
    write_bundle,
)
from hookcli.commands.watch.compiled import EagerSwitch, RootCall, inner_module
from hookcli.commands.watch.logfile import LogWriter
from hookcli.commands.watch.steptools import (
    all_finite,
    device_of,
    logged_call,
    norm_sum,
    numbers_only,
    padding_mask,
    params_of,
    process_rank,
    rank_log_path,
)
from hookcli.engine.hooks import CopySafeHook, HookSession, Target
from hookcli.engine.measure import finished_calls, statistics
from hookcli.engine.memory import MemoryMeter
from hookcli.engine.origins import find_origins
from hookcli.engine.passes import BufferSnapshot, grads_left_as_found
from hookcli.engine.selection import module_entries, select
from hookcli.engine.stats import StatsCollector
from hookcli.engine.tensorbits import finite_or_none
from hookcli.errors import UsageError, one_line
from hookcli.options import DEFAULTS, WatchOptions
from hookcli.records import (
    LoggedParam,
    NonfiniteLine,
    Origin,
    StepLine,
    TensorStats,
    log_line,
)
from hookcli.tree import iter_tensors

# forwards with gradients kept per step (micro-batches); a loop that runs more between two
# optimizer steps (a forward-only loop inside a watch) does not grow memory without bound
MAX_FORWARDS = 64
_NONE = object()


@dataclass(slots=True)
class StepState:
    """What a watch holds of the optimizer step being taken, watched or not: what the step
    needs to run again (its forwards, the buffers as it began) and how far it has come."""

    loss: torch.Tensor | float | None = None  # given to w.loss()
    forwards: list[ForwardCapture] = field(default_factory=list)  # those with gradients
    buffers: BufferSnapshot | None = None  # the model's buffers as the first forward began
    dropped: int = 0  # forwards past MAX_FORWARDS, not kept
    grads_seen: bool = False  # its gradients were read (before the weights changed)
    stepped: bool = False  # the optimizer's step ran (a scaler may skip it)
    skipped: bool = False  # the scaler skipped it: the gradients held inf/NaN at its scale


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
        entries = module_entries(self.module)
        self.targets: list[Target] = select(
            entries, layers=options.layers, types=options.types, model_label="the model"
        )
        self._types = {n: e.type for e in entries for n in e.names}
        selected = {id(t.module) for t in self.targets}
        self._partial = any(e.leaf and id(e.module) not in selected for e in entries)
        self._names = {id(p): n for n, p in self.module.named_parameters()}
        self._modules = list(self.module.modules())
        self.rank, self.world_size = process_rank()
        log, bundle = options.log, options.bundle
        self.log_path = (
            None if log is None else rank_log_path(Path(log), self.rank, self.world_size)
        )
        self.bundle_path = self._bundle_path(bundle)
        self._bundle_given = bundle is not None and bundle is not True and bundle is not False
        self.recent: collections.deque[StepLine] = collections.deque(maxlen=ring)
        # the watched steps' lines: all of them without a log; with one (they are in the
        # file), the last `ring` only, so a long run does not grow in memory
        self.records: collections.deque[StepLine] | list[StepLine] = (
            self.recent if log is not None else []
        )
        # the NaN/Inf events (their log lines): the first one, once seen (the watch stops
        # checking after it, so there is at most one); a list, so `len()` and `[0]` mean that
        self.nonfinite: list[NonfiniteLine] = []
        self.step_index = 0  # the optimizer step now being taken (0: the first)
        self._session: HookSession | None = None
        self._collector: StatsCollector | None = None
        # a watched step's parameters: name, gradient statistics, the parameter, its value
        # before the step; and the norms of those values (one foreach kernel per device)
        self._params: list[tuple[str, TensorStats | None, torch.Tensor, torch.Tensor]] = []
        self._before_norms: list[torch.Tensor] = []
        self._buffers_for_copies: list[torch.Tensor] = []
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
        self._scaler_update: Any = None
        self._scaler_own: Any = _NONE
        self._root_call: RootCall | None = None
        self._file: LogWriter | None = None
        self._board: Any = None  # tensorboard=DIR: trackers.TensorBoardWriter
        # memory=True: a watched step's meter, and the saved-tensor hooks its forwards pushed
        self._meter: MemoryMeter | None = None
        self._saving: list[Any] = []

    def _bundle_path(self, bundle: str | Path | bool | None) -> Path | None:
        if bundle is False:
            return None
        if bundle is None or bundle is True:
            if self.log_path is None:
                if bundle is True:
                    raise UsageError(
                        "bundle=True needs a log= path to put the bundle next to.",
                        "pass bundle='DIR', or log='run.jsonl'.",
                    )
                return None
            return self.log_path.with_name(f"{self.log_path.stem}.bundle")
        return rank_log_path(Path(bundle), self.rank, self.world_size)

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

    # ------------------------------------------------------------ the context

    def __enter__(self) -> Watch:
        if self.bundle_path is not None:
            check_bundle_dest(self.bundle_path)  # a bundle replaces only an earlier bundle
        if self.options.tensorboard is not None:
            # its errors (not installed, a file where the folder goes) before any step, and
            # before the log is started (a refused watch leaves an earlier log as it was)
            from hookcli.commands.watch.trackers import TensorBoardWriter

            self._board = TensorBoardWriter(self._board_dir(self.options.tensorboard))
        try:
            if self.log_path is not None:
                # a new run starts a new log (a log holds one run: steps never repeat); written
                # so that it never hurts the training (logfile.py)
                self._file = LogWriter(self.log_path)
            if getattr(self.model, "_compiled_call_impl", None) is not None:
                self._root_call = RootCall(self.model, self._root_pre, self._root_post)
            else:
                self._handles += [
                    self.model.register_forward_pre_hook(
                        CopySafeHook(self._root_pre), with_kwargs=True
                    ),
                    self.model.register_forward_hook(CopySafeHook(self._root_post)),
                ]
            if self.optimizer is not None:
                self._handles += [
                    self.optimizer.register_step_pre_hook(self._before_step),
                    self.optimizer.register_step_post_hook(self._after_step),
                ]
            if self.scaler is not None:
                # the scaler's update() ends every step, the skipped ones too (an instance
                # attribute over the class's method, removed on exit)
                original = self.scaler.update

                def update(*args: Any, **kwargs: Any) -> Any:
                    result = original(*args, **kwargs)
                    self._scaler_updated()
                    return result

                self._scaler_own = self.scaler.__dict__.get("update", _NONE)
                self.scaler.update = update
                self._scaler_update = original
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
        self._buffers_for_copies = []
        self._disarm()  # a step left unfinished is not logged: its numbers are incomplete
        self._forget_step()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._root_call is not None:
            self._root_call.remove()
            self._root_call = None
        if self._scaler_update is not None:
            own = self._scaler_own  # an `update` the scaler instance had of its own comes back
            if own is _NONE:
                self.scaler.__dict__.pop("update", None)
            else:
                self.scaler.__dict__["update"] = own
            self._scaler_update = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._board is not None:
            board, self._board = self._board, None
            self._sink(board.close)

    def _sink(self, write: Callable[[], None]) -> None:
        """A TensorBoard write that never hurts the training: a failure ends the sink with one
        line on stderr."""
        try:
            write()
        except Exception as exc:
            board, self._board = self._board, None
            if board is not None:
                with contextlib.suppress(Exception):
                    board.close()
            sys.stderr.write(f"hookcli.watch: TensorBoard stopped: {one_line(exc)}\n")

    def _board_dir(self, raw: object) -> Path:
        """tensorboard=DIR; under torchrun each rank's own subfolder (rank0, rank1, …: each
        rank's numbers are its shard's), as each writes its own log."""
        if not isinstance(raw, str | Path):
            raise UsageError(
                f"tensorboard must be a folder, got {type(raw).__name__}.",
                "e.g. tensorboard='runs/exp1'",
            )
        folder = Path(raw)
        return folder / f"rank{self.rank}" if self.world_size > 1 else folder

    # ------------------------------------------------------------ what the loop calls

    def loss(self, value: torch.Tensor | float) -> None:
        """The step's loss: logged with a watched step and checked for NaN/Inf on every step
        (kept as a reference, read when the step ends: no synchronisation here)."""
        self._step.loss = value.detach() if isinstance(value, torch.Tensor) else float(value)

    def step(self) -> None:
        """Mark the end of a step when there is no optimizer to hook (its gradients and
        parameters are then not measured)."""
        if self.optimizer is not None:
            raise UsageError(
                "Watch.step() with an optimizer: its step hooks already mark the steps.",
                "drop the w.step() call, or watch without optimizer=.",
            )
        self._grads_ready(None)
        self._finish()

    @property
    def watching(self) -> bool:
        """Whether the step now being taken is a watched one."""
        return self._session is not None

    def pause(self) -> None:
        """Forwards from now until `resume()` are not the step's: a validation run between
        steps (a compiled model runs its compiled code; a watched step's hooks come off and
        go back on after; nothing is captured or checked)."""
        if self._paused:
            return
        self._paused = True
        if self._session is not None:
            self._session.remove()
            self._eager.off()

    def resume(self) -> None:
        if not self._paused:
            return
        self._paused = False
        if self._session is not None and self._open:
            self._session.__enter__()
            self._eager.on()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """`with w.paused(): evaluate(model)` — pause() and resume() around a block."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

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
            if self._session is not None:
                self._session.remove()
                self._evaluating = True
            return
        if self._collector is not None:  # a padded batch's padding left out (issue 48)
            self._collector.set_token_mask(padding_mask(module, args, kwargs))
        if self._meter is not None:  # what autograd saves in this forward, counted
            self._count_saved()
        if not self.options.check or self.nonfinite:
            return  # nothing more to bundle: no capture, no copy of the buffers
        if len(self._step.forwards) >= MAX_FORWARDS:
            self._step.dropped += 1
            return
        if self._step.buffers is None:  # the step's first forward: its buffers as it begins
            self._step.buffers = BufferSnapshot(self._modules)
        self._step.forwards.append(capture_forward(args, kwargs, self._modules))

    def _count_saved(self) -> None:
        """memory=True: the forward's saved tensors counted — unless saved-tensor hooks of
        the training's own are on (torch.utils.checkpoint around the model, save_on_cpu,
        torch.func), which ours would override: then this step is not counted, and says so."""
        assert self._meter is not None
        top: Any = torch._C._autograd._top_saved_tensors_default_hooks
        outer = top(False)
        if outer is not None:
            self._meter.skipped = "the forward ran under saved-tensor hooks of its own"
            return
        ctx = self._meter.saving()
        try:
            ctx.__enter__()
        except RuntimeError as exc:  # (torch.func refuses saved-tensor hooks)
            self._meter.skipped = f"saved-tensor hooks refused: {exc}"
            return
        self._saving.append(ctx)

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._evaluating:
            self._end_evaluation()
            return
        if self._saving and not self._busy and not self._paused:
            self._saving.pop().__exit__(None, None, None)
        if self._busy or self._paused or not self._step.forwards or not torch.is_grad_enabled():
            return
        if self._step.forwards[-1].output is not None or self._step.dropped:
            return  # a forward not kept (the cap), or one already seen (re-entrant call)
        watch_output(self._step.forwards[-1], output)

    def _end_evaluation(self) -> None:
        self._evaluating = False
        if self._session is not None and not self._paused:
            self._session.__enter__()

    # ------------------------------------------------------------ steps

    def _arm(self) -> None:
        """Hooks on, when the coming step is watched."""
        if not self._open or self.step_index % self.options.every:
            return
        self._collector = statistics(repays_kernels=True)  # a training run repays loading numba
        if self.options.memory:
            self._meter = MemoryMeter(self.module, device_of(self.module))
            self._meter.arm()
        self._session = HookSession(self.targets, self._collector, grads=True, memory=self._meter)
        self._session.__enter__()
        self._eager.on()  # a compiled model runs its eager module on a watched step

    def _disarm(self) -> None:
        self._evaluating = False
        while self._saving:  # a forward that raised left its hooks pushed
            self._saving.pop().__exit__(None, None, None)
        if self._meter is not None:
            self._meter.disarm()
        self._meter = None
        self._eager.off()
        session = self._session
        if session is not None:
            session.remove()
            session.remove_tensor_hooks()
        self._session = None
        self._collector = None
        self._params = []
        self._before_norms = []

    def _forget_step(self) -> None:
        self._step = StepState()

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
            if not self._step.grads_seen:
                self._grads_ready(optimizer)
            return result

        if kwargs and "closure" in kwargs:
            return args, dict(kwargs, closure=measured)
        return (*args[:at], measured, *args[at + 1 :]), kwargs

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._step.stepped = True
        if self.scaler is None:
            self._finish()

    def _scaler_updated(self) -> None:
        if not self._step.stepped and not self._step.grads_seen:
            # scaler.step() skipped optimizer.step(): the gradients held inf/NaN at this loss
            # scale. Expected, not a fault — but the forward (outputs, loss) is checked
            self._grads_ready(None, skipped=True)  # (the optimizer's state is still bundled)
        self._finish()

    def _grads_ready(self, optimizer: Any, *, skipped: bool = False) -> None:
        """The step's gradients are complete and the weights not yet changed. Without an
        optimizer (w.step()), the model's parameters are checked, not measured."""
        self._step.grads_seen = True
        self._step.skipped = skipped
        params = params_of(optimizer) if optimizer is not None else []
        checked = params if optimizer is not None else list(self.module.parameters())
        if self._session is not None and self._collector is not None and not skipped:
            with torch.no_grad():
                befores = self._copies(params)
                for p, before in zip(params, befores, strict=True):
                    name = self._names.get(id(p), f"param{len(self._params)}")
                    grad = (
                        None
                        if p.grad is None
                        else self._collector.add(p.grad, f"{name}.grad", positions=False)
                    )
                    self._params.append((name, grad, p, before))
                self._before_norms = list(torch._foreach_norm(befores)) if befores else []
        if self.options.check and not self.nonfinite:
            found = self._nonfinite(checked, skipped)
            if found:
                self._on_nonfinite(found, optimizer)

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

    def _nonfinite(self, params: Sequence[torch.Tensor], skipped: bool) -> list[str]:
        """Which of the loss, the model's outputs and the parameter gradients hold NaN/Inf: one
        norm per group of tensors (a NaN or Inf anywhere makes it non-finite) and a single
        read on the host. A norm that overflows from finite values is checked exactly."""
        groups: dict[str, list[torch.Tensor]] = {"loss": [], "output": [], "grad": []}
        if isinstance(self._step.loss, torch.Tensor) and self._step.loss.is_floating_point():
            groups["loss"].append(self._step.loss)
        elif isinstance(self._step.loss, float):
            groups["loss"].append(torch.tensor(self._step.loss))  # a number: on the CPU
        for f in self._step.forwards:
            groups["output"] += [
                t.detach()
                for _, t in iter_tensors(f.output, "out")
                if t.is_floating_point() and t.numel()
            ]
        if not skipped:
            groups["grad"] = [p.grad for p in params if p.grad is not None and p.grad.numel()]
        names = [k for k, v in groups.items() if v]
        if not names:
            return []
        home = groups[names[-1]][0].device  # the gradients' device when there are any
        with torch.no_grad():
            sums = torch.stack([norm_sum(groups[k]).to(home) for k in names])
            ok = torch.isfinite(sums).tolist()  # the one read on the host
        found = [k for k, good in zip(names, ok, strict=True) if not good]
        # a norm of huge finite values overflows: such a group is looked at element by element
        return [k for k in found if not all(bool(torch.isfinite(t).all()) for t in groups[k])]

    def _finish(self) -> None:
        """The step ended: a watched step's record written, then the next step armed."""
        if self._session is not None and self._collector is not None:
            try:
                record = self._record()
            finally:
                self._disarm()
            if self.records is not self.recent:
                self.records.append(record)
            self.recent.append(record)
            self._write(record)
        self._forget_step()
        self.step_index += 1
        self._arm()

    def _write(self, line: StepLine | NonfiniteLine) -> None:
        if self._file is not None:
            data = log_line(line)
            self._file.write(data)  # marks the line with the run's id
            line.run = data.get("run")
        board = self._board
        if board is not None and isinstance(line, StepLine):
            from hookcli.commands.watch.trackers import step_scalars

            def write() -> None:
                board.add(step_scalars(line))
                board.flush()

            self._sink(write)

    # ------------------------------------------------------------ the first NaN/Inf

    def _on_nonfinite(self, found: list[str], optimizer: Any) -> None:
        """Bundle, hooked re-run, log line, one line on stderr — while the weights and the
        optimizer state are still the step's own."""
        if self._session is not None:
            self._session.remove()  # the watched step's hooks must not see the re-run
        notes: list[str] = []
        if self._step.dropped:
            notes.append(
                f"the step ran {MAX_FORWARDS + self._step.dropped} forwards with gradients; "
                f"only the first {MAX_FORWARDS} were kept, so the re-run and the bundle hold those"
            )
        if any(f.written_since() for f in self._step.forwards):
            notes.append(
                "an argument of the model was changed in place after its forward began: the "
                "saved batch is the changed one, and a replay may differ"
            )
        params = list(self.module.parameters())
        bad_params = [n for n, p in self.module.named_parameters() if not all_finite(p)]
        bad_grads = [
            self._names.get(id(p), f"a parameter outside the model {tuple(p.shape)}")
            for p in (params_of(optimizer) if optimizer is not None else params)
            if p.grad is not None and not all_finite(p.grad)
        ]
        now = BufferSnapshot(self._modules)  # as the step left them
        bundle = self.bundle_path
        origins: list[Origin] = []
        self._busy = True
        self._eager.on()
        try:
            with rng_kept(), grads_left_as_found(params), torch.no_grad():
                if self._step.buffers is not None:
                    self._step.buffers.restore()  # as the step began
                with torch.enable_grad():
                    try:
                        again = rerun(
                            self.module, self._step.forwards, self.targets, self._types,
                            partial=self._partial,
                        )  # fmt: skip
                        origins = again.origins
                        notes += again.errors
                    except Exception as exc:  # the step itself raised on the re-run
                        notes.append(f"the hooked re-run failed: {one_line(exc)}")
                if "loss" in found and not any(o.direction == "forward" for o in origins):
                    origins.insert(0, self._loss_origin())
                if not (self._bundle_given or self.rank == 0 or origins):
                    # under DDP by default rank 0 writes a bundle, and any rank whose own
                    # step made the NaN/Inf (the others hold gradients the all-reduce spread)
                    bundle = None
                if bundle is not None:
                    if self._step.buffers is not None:
                        self._step.buffers.restore()  # the re-run moved them: as the step began
                    try:
                        notes += write_bundle(
                            bundle,
                            info=self._bundle_info(found, bad_params, origins, notes),
                            module=self.module,
                            optimizer=optimizer or self.optimizer,
                            forwards=self._step.forwards,
                            records=[log_line(r) for r in self.recent],
                        )
                    except Exception as exc:  # training goes on; the log line says why
                        bundle = None
                        notes.append(f"no bundle written to {self.bundle_path}: {one_line(exc)}")
        finally:
            self._busy = False
            if self._session is None:
                self._eager.off()
            now.restore()
        line = NonfiniteLine(
            step=self.step_index,
            rank=self.rank,
            world_size=self.world_size,
            found=found,
            origins=list(origins),
            nonfinite_params=bad_params,
            nonfinite_grads=bad_grads,
            bundle=None if bundle is None else str(bundle),
            notes=notes,
        )
        self.nonfinite.append(line)
        self._write(line)
        where = "; ".join(o.describe() for o in origins) or "no layer call held it on the re-run"
        saved = f" Bundle: {bundle} (hookcli replay)." if bundle is not None else ""
        print(
            f"hookcli.watch: NaN/Inf in the {', '.join(found)} at step {self.step_index}: "
            f"{where}.{saved}",
            file=sys.stderr,
        )

    def _bundle_info(
        self, found: list[str], bad_params: list[str], origins: list[Origin], notes: list[str]
    ) -> dict[str, Any]:
        return {
            "step": self.step_index,
            "rank": self.rank,
            "world_size": self.world_size,
            "found": found,
            "nonfinite_params": bad_params,
            "origins": [dataclasses.asdict(o) for o in origins],
            "model": f"{type(self.module).__module__}.{type(self.module).__qualname__}",
            "device": str(device_of(self.module)),
            "layers": list(self.options.layers),
            "types": list(self.options.types),
            "forwards": len(self._step.forwards),
            "hookcli_version": __version__,
            "torch_version": torch.__version__,
            "notes": list(notes),
        }

    def _loss_origin(self) -> Origin:
        """The loss is NaN/Inf, the model's outputs finite: the loss code made it."""
        loss = self._step.loss
        t = loss.detach().float() if isinstance(loss, torch.Tensor) else torch.tensor(loss)
        nan = int(torch.isnan(t).sum())
        return Origin("forward", "", "", 0, "loss", nan, int(t.numel()) - nan - int(
            torch.isfinite(t).sum()), where="loss")  # fmt: skip

    def _record(self) -> StepLine:
        session = self._session
        assert session is not None
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
        if self._meter is not None:
            self._meter.finish()  # (before the calls are completed: their freed bytes)
        calls = finished_calls(session, backward=True)
        origins = find_origins(session.calls, self._types, partial=self._partial)
        loss = self._step.loss
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
            step=self.step_index,
            rank=self.rank,
            world_size=self.world_size,
            loss=finite_or_none(loss) if isinstance(loss, float) else None,
            layers=[logged_call(c) for c in calls],
            params=params,
            nonfinite_origins=list(origins),
            # "loss": null alone would read as "not given"
            loss_nonfinite=isinstance(loss, float) and not math.isfinite(loss),
        )
        if self._meter is not None:
            opt = self.optimizer
            record.memory = totals(
                self.module,
                device_of(self.module),
                self._meter,
                backward=True,
                gradients=gradient_bytes(self.module),
                optimizer=optimizer_bytes(opt) if opt is not None else None,
            )
            if self._meter.skipped:
                record.memory.notes.append(f"saved bytes not counted: {self._meter.skipped}")
            if self._meter.forwards > 1:
                record.memory.notes.append(
                    f"{self._meter.forwards} forwards in this step (gradient accumulation?): "
                    "saved bytes add them all up, and the predicted peak takes them as alive "
                    "at once"
                )
        if self.scaler is not None:
            record.skipped = self._step.skipped
            scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
            record.scale = None if scale is None else float(scale)
        return record
