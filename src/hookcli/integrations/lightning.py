"""`hookcli.watch` as a PyTorch Lightning callback: `Trainer(callbacks=[HookcliWatch(every=10)])`.

Lightning owns the training loop, so the `with hookcli.watch(...)` block a plain loop would
write has nowhere to go: the callback opens the same recorder when training starts and closes it
when training ends or `fit` raises, and hands it each step's loss from `on_before_backward`
(`on_train_batch_end` comes after the optimizer step has ended, too late for the step's line).

Why the class is built on first access: it must subclass Lightning's own `Callback` (the
Trainer accepts nothing else), yet hookcli does not depend on Lightning and importing this
module imports no Lightning. `HookcliWatch` is made by the module's `__getattr__` from
`WatchHooks` (the behaviour, typed and free of Lightning) and Lightning's `Callback`; without
Lightning, `from hookcli.integrations.lightning import HookcliWatch` raises an ImportError that
says what to install. Which Lightning: the one the training script already imported
(`lightning.pytorch` or `pytorch_lightning`: a Trainer accepts only its own package's
callbacks), else `lightning.pytorch`, else `pytorch_lightning`.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import hookcli
from hookcli.errors import UsageError

__all__ = ["LOG_NAME", "HookcliWatch", "WatchHooks", "lightning_package"]

LOG_NAME = "hookcli-watch.jsonl"  # the log's name in the Trainer's log_dir when log= is not given

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")

# declared, not bound: the module's __getattr__ builds it on first access (see the docstring)
HookcliWatch: Any


def lightning_package() -> ModuleType:
    """The Lightning package whose `Callback` HookcliWatch subclasses (the module docstring says
    which one): build Trainers and LightningModules from it."""
    for name in _PACKAGES:
        module = sys.modules.get(name)
        if module is not None:
            return module
    for name in _PACKAGES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name not in (name, name.split(".")[0]):
                raise  # installed but broken (a dependency of its own is missing): its own error
    raise ImportError(
        "hookcli.integrations.lightning needs PyTorch Lightning, and neither lightning.pytorch "
        "nor pytorch_lightning can be imported: pip install pytorch-lightning"
    )


class WatchHooks:
    """A training run's flight recorder (`hookcli.watch`) around `trainer.fit`.

    When training starts (after the sanity check), `hookcli.watch` is entered on the
    LightningModule — or on `module=`, the dotted path of the submodule training_step calls,
    when it does not call `self(...)`: the outputs check and the NaN re-run need the forwards of
    the watched module — with the Trainer's optimizer; it is left when training ends or `fit`
    raises, with every hook removed. Steps are the optimizer's steps, so gradient accumulation
    counts right, and they are numbered as `trainer.global_step` (a resumed run goes on with its
    numbers). Validation inside `fit` is not part of any step: the recorder is paused for it
    (`Watch.pause()`: its forwards are not captured, checked or hooked) and resumed after.

    The loss of a step is the one backpropagated: the sum of what `on_before_backward` gets in
    it, which Lightning has divided by accumulate_grad_batches (the mean of training_step's
    losses) and, under a GradScaler precision ("16-mixed"), multiplied by the loss scale — the
    callback divides that back out (powers of two: exact) and passes the plugin's scaler to the
    recorder, whose skipped steps are then steps too.

    Several optimizers (manual optimization): a recorder marks steps by one optimizer, so
    `optimizer=` must say which (its index in configure_optimizers' list); the others' forwards
    and backwards then belong to its steps, and only its parameters are measured.

    `log=None`: `<trainer.log_dir>/hookcli-watch.jsonl` (the logger's version folder; without
    a logger, default_root_dir), begun anew by each fit as hookcli.watch's log is; `log=False`:
    no file, `watch.records` only; a path: that file. Under DDP each rank writes its own
    (`hookcli-watch.rank0.jsonl`, ...); `log_path` is this process's. The repro bundle goes
    next to the log (`hookcli-watch.bundle`) unless `bundle=` says otherwise; with no log, only
    `bundle=DIR` writes one. The other arguments are `hookcli.watch`'s.
    `watch` is the recorder of the current or last fit: `.records`, `.nonfinite`.
    """

    def __init__(
        self,
        *,
        every: int = 1,
        layers: str | Sequence[str] = (),
        types: str | Sequence[str] = (),
        log: str | Path | bool | None = None,
        ring: int = 8,
        bundle: str | Path | bool | None = None,
        check: bool = True,
        optimizer: int | None = None,
        module: str | None = None,
        tensorboard: str | Path | None = None,
    ) -> None:
        self.every = every
        self.layers = layers
        self.types = types
        # not `self.log`: Lightning sets every callback's `log` to the LightningModule's log()
        self.log_target = log
        self.ring = ring
        self.bundle = bundle
        self.check = check
        self.optimizer = optimizer
        self.module = module
        self.tensorboard = tensorboard
        self.watch: Any = None
        self._entered = False
        self._scaler: Any = None
        self.log_path: Path | None = None  # this process's log of the current or last fit

    # ------------------------------------------------------------ Lightning's hooks

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """The recorder is made here, so a bad argument fails before the sanity check runs;
        it is entered when training starts."""
        self._stop()  # a fit before this one that never reached its end hooks
        optimizers = list(trainer.optimizers)
        optimizer = optimizers[self._optimizer_index(len(optimizers))]
        self._scaler = getattr(trainer.precision_plugin, "scaler", None)
        log = self._log_path(trainer)
        self.watch = hookcli.watch(
            self._model(pl_module),
            optimizer=optimizer,
            every=self.every,
            layers=self.layers,
            types=self.types,
            log=log,  # each rank its own (the recorder names it by the process group's rank)
            ring=self.ring,
            bundle=self._bundle_path(log),
            check=self.check,
            scaler=self._scaler,
            tensorboard=self.tensorboard,
        )
        self.log_path = self.watch.log_path

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.watch is None:
            return
        if len(trainer.optimizers) == 1:  # global_step counts every optimizer's steps
            self.watch.step_index = trainer.global_step  # restored from a checkpoint by now
        self._enter()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._entered:
            self.watch.pause()  # validation forwards are no step's

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._entered:
            self.watch.resume()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if not self._entered:
            return
        # each micro-batch's (or backward's) loss: the watch adds up a step's
        self.watch.loss(self._unscaled(loss))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._stop()

    # ------------------------------------------------------------ helpers

    def _optimizer_index(self, count: int) -> int:
        if count == 0:
            raise UsageError(
                "HookcliWatch found no optimizer on the Trainer: its steps mark the watch's.",
                "return the optimizer from configure_optimizers.",
            )
        if self.optimizer is None:
            if count > 1:
                raise UsageError(
                    f"HookcliWatch marks steps by one optimizer, and there are {count}.",
                    "pass HookcliWatch(optimizer=I), I the index in configure_optimizers' list: "
                    "the other optimizers' forwards and backwards then belong to its steps.",
                )
            return 0
        index = self.optimizer
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise UsageError(
                f"HookcliWatch(optimizer={index!r}): there are {count} optimizers.",
                f"give an index from 0 to {count - 1}.",
            )
        return index

    def _model(self, pl_module: Any) -> Any:
        if self.module is None:
            return pl_module
        try:
            return pl_module.get_submodule(self.module)
        except AttributeError as exc:
            raise UsageError(
                f"HookcliWatch(module={self.module!r}): the LightningModule has no such submodule.",
                "give the dotted path of the module training_step calls, e.g. module='net'.",
            ) from exc

    def _log_path(self, trainer: Any) -> Path | None:
        if self.log_target is False:
            return None
        if self.log_target is None or self.log_target is True:
            # every rank asks: log_dir broadcasts rank 0's folder
            folder = Path(trainer.log_dir or trainer.default_root_dir)
            # a logger makes its folder lazily; if it cannot be made, the recorder says so
            with contextlib.suppress(OSError):
                folder.mkdir(parents=True, exist_ok=True)
            return folder / LOG_NAME
        return Path(self.log_target)

    def _bundle_path(self, log: Path | None) -> str | Path | bool | None:
        """As the recorder's default: next to the log (the recorder adds the rank)."""
        if log is not None and (self.bundle is None or self.bundle is True):
            return log.with_name(f"{log.stem}.bundle")
        return self.bundle  # without a log, None is no bundle and True an error of its own

    def _unscaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss without the GradScaler's factor: the scale tensor itself, so nothing is read
        on the host (a scale of 2^k multiplies and divides exactly)."""
        value = loss.detach()
        scaler = self._scaler
        if scaler is None or not scaler.is_enabled():
            return value
        scale = getattr(scaler, "_scale", None)
        if isinstance(scale, torch.Tensor):
            return value / scale.to(value.device)
        return value / float(scaler.get_scale())

    def _enter(self) -> None:
        if self.watch is not None and not self._entered:
            self.watch.__enter__()
            self._entered = True

    def _leave(self) -> None:
        if self._entered:
            self._entered = False
            self.watch.__exit__(None, None, None)

    def _stop(self) -> None:
        self._leave()


def __getattr__(name: str) -> Any:
    """`HookcliWatch`, built on first access (the module docstring says why)."""
    if name != "HookcliWatch":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    namespace = {"__module__": __name__, "__qualname__": name, "__doc__": WatchHooks.__doc__}
    cls = type(name, (WatchHooks, lightning_package().Callback), namespace)
    globals()[name] = cls  # built once: isinstance checks and pickling find the same class
    return cls


def __dir__() -> list[str]:
    return sorted({*globals(), "HookcliWatch"})
