"""The first NaN/Inf of a watched run.

Every step, watched or not, the model's own root hooks keep references to what the step needs
to run again (StepState; commands.watch.bundle: arguments, RNG, autocast, output gradients; the
buffers as the step began are the one copy), and when its gradients are complete the loss
(given to `w.loss`), the model's outputs and every parameter gradient are checked for NaN/Inf:
one norm per tensor group and a single read on the host. The first time one is not finite,
before the optimizer changes anything, the step is re-run with hooks on to name the first
non-finite layer call and direction, the repro bundle is written (under DDP: rank 0's, and that
of any rank whose re-run found the origin), and a "nonfinite" line is made (FirstNonfinite).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookcli._version import __version__
from hookcli.commands.watch.bundle import (
    BUNDLE_SCHEMA,
    ForwardCapture,
    capture_forward,
    rerun,
    watch_output,
    write_bundle,
)
from hookcli.commands.watch.capture import WatchedModel
from hookcli.commands.watch.steptools import (
    all_finite,
    device_of,
    norm_sum,
    params_of,
    rank_log_path,
)
from hookcli.engine.passes import BufferSnapshot, grads_left_as_found
from hookcli.engine.sharded import is_sharded, local_of
from hookcli.errors import UsageError, one_line
from hookcli.options import WatchOptions
from hookcli.records import BundleInfo, NonfiniteLine, Origin, StepLine, log_line
from hookcli.runtime import rng
from hookcli.tree import iter_tensors

# forwards with gradients kept per step (micro-batches); a loop that runs more between two
# optimizer steps (a forward-only loop inside a watch) does not grow memory without bound
MAX_FORWARDS = 64


@dataclass(slots=True)
class StepState:
    """What a watch holds of the optimizer step being taken, watched or not: what the step
    needs to run again (its forwards, the buffers as it began) and its loss."""

    loss: torch.Tensor | float | None = None  # given to w.loss()
    forwards: list[ForwardCapture] = field(default_factory=list)  # those with gradients
    buffers: BufferSnapshot | None = None  # the model's buffers as the first forward began
    dropped: int = 0  # forwards past MAX_FORWARDS, not kept

    def keep(self, args: Any, kwargs: Any, modules: list[nn.Module]) -> None:
        """A forward with gradients begins: what it needs to run again, kept."""
        if len(self.forwards) >= MAX_FORWARDS:
            self.dropped += 1
            return
        if self.buffers is None:  # the step's first forward: its buffers as it begins
            self.buffers = BufferSnapshot(modules)
        self.forwards.append(capture_forward(args, kwargs, modules))

    def keep_output(self, output: Any) -> None:
        """The forward with gradients returned: its output kept (to check, and for the
        gradients that reach it)."""
        if not self.forwards or self.forwards[-1].output is not None or self.dropped:
            return  # a forward not kept (the cap), or one already seen (re-entrant call)
        watch_output(self.forwards[-1], output)

    def nonfinite(self, params: Sequence[torch.Tensor], skipped: bool) -> list[str]:
        """Which of the loss, the model's outputs and the parameter gradients hold NaN/Inf: one
        norm per group of tensors (a NaN or Inf anywhere makes it non-finite) and a single
        read on the host. A norm that overflows from finite values is checked exactly."""
        groups: dict[str, list[torch.Tensor]] = {"loss": [], "output": [], "grad": []}
        if isinstance(self.loss, torch.Tensor) and self.loss.is_floating_point():
            groups["loss"].append(self.loss)
        elif isinstance(self.loss, float):
            groups["loss"].append(torch.tensor(self.loss))  # a number: on the CPU
        for f in self.forwards:  # (a DTensor: this rank's part; each rank checks its own)
            groups["output"] += [
                local_of(t.detach())
                for _, t in iter_tensors(f.output, "out")
                if t.is_floating_point() and t.numel()
            ]
        if not skipped:
            groups["grad"] = [
                local_of(p.grad) for p in params if p.grad is not None and p.grad.numel()
            ]
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

    def loss_origin(self) -> Origin:
        """The loss is NaN/Inf, the model's outputs finite: the loss code made it."""
        loss = self.loss
        t = loss.detach().float() if isinstance(loss, torch.Tensor) else torch.tensor(loss)
        nan = int(torch.isnan(t).sum())
        return Origin("forward", "", "", 0, "loss", nan, int(t.numel()) - nan - int(
            torch.isfinite(t).sum()), where="loss")  # fmt: skip


def bundle_dir(
    bundle: str | Path | bool | None, log_path: Path | None, rank: int, world_size: int
) -> Path | None:
    """Where the repro bundle goes: bundle=DIR (each rank its own), by default next to the log
    (run.bundle), nowhere with bundle=False or without a log."""
    if bundle is False:
        return None
    if bundle is None or bundle is True:
        if log_path is None:
            if bundle is True:
                raise UsageError(
                    "bundle=True needs a log= path to put the bundle next to.",
                    "pass bundle='DIR', or log='run.jsonl'.",
                )
            return None
        return log_path.with_name(f"{log_path.stem}.bundle")
    return rank_log_path(Path(bundle), rank, world_size)


class FirstNonfinite:
    """The first NaN/Inf handled: the step re-run hooked, its bundle written, its line made —
    while the weights and the optimizer state are still the step's own. The watch stands its
    own hooks aside and runs eager code around `line()`."""

    def __init__(
        self,
        watched: WatchedModel,
        options: WatchOptions,
        *,
        optimizer: Any,
        rank: int,
        world_size: int,
        bundle: Path | None,
    ) -> None:
        self.watched = watched
        self.options = options
        self.optimizer = optimizer  # the watch's (the hook's own is given to line())
        self.rank = rank
        self.world_size = world_size
        self.bundle = bundle
        given = options.bundle
        self.bundle_given = given is not None and given is not True and given is not False

    def line(
        self,
        found: list[str],
        step: StepState,
        optimizer: Any,
        *,
        index: int,
        recent: Iterable[StepLine],
    ) -> NonfiniteLine:
        """Step `index` holds NaN/Inf in `found` (its gradients complete, `optimizer` the one
        whose step hook saw it, None without): the re-run, the bundle, the line."""
        watched = self.watched
        module = watched.module
        notes: list[str] = []
        if step.dropped:
            notes.append(
                f"the step ran {MAX_FORWARDS + step.dropped} forwards with gradients; "
                f"only the first {MAX_FORWARDS} were kept, so the re-run and the bundle hold those"
            )
        if any(f.written_since() for f in step.forwards):
            notes.append(
                "an argument of the model was changed in place after its forward began: the "
                "saved batch is the changed one, and a replay may differ"
            )
        params = list(module.parameters())
        # (a sharded parameter: this rank's part, read without a collective)
        bad_params = [n for n, p in module.named_parameters() if not all_finite(local_of(p))]
        bad_grads = [
            watched.names.get(id(p), f"a parameter outside the model {tuple(p.shape)}")
            for p in (params_of(optimizer) if optimizer is not None else params)
            if p.grad is not None and not all_finite(local_of(p.grad))
        ]
        # the hooked re-run of a sharded model would run its collectives on this rank alone
        # (only the rank holding the NaN/Inf comes here): the other ranks would never answer
        sharded = any(is_sharded(p) for p in params)
        if sharded:
            notes.append(
                "the model is sharded (DTensor parameters): the hooked re-run, which would need "
                "every rank, was not run; the bundle holds this rank's part"
            )
        now = BufferSnapshot(watched.modules)  # as the step left them
        bundle = self.bundle
        origins: list[Origin] = []
        try:
            with rng.left_as_found(), grads_left_as_found(params), torch.no_grad():
                if step.buffers is not None:
                    step.buffers.restore()  # as the step began
                with torch.enable_grad():
                    try:
                        again = None if sharded else rerun(
                            module, step.forwards, watched.targets, watched.types,
                            partial=watched.partial,
                        )  # fmt: skip
                        if again is not None:
                            origins = again.origins
                            notes += again.errors
                    except Exception as exc:  # the step itself raised on the re-run
                        notes.append(f"the hooked re-run failed: {one_line(exc)}")
                if "loss" in found and not any(o.direction == "forward" for o in origins):
                    origins.insert(0, step.loss_origin())
                if not (self.bundle_given or self.rank == 0 or origins):
                    # under DDP by default rank 0 writes a bundle, and any rank whose own
                    # step made the NaN/Inf (the others hold gradients the all-reduce spread)
                    bundle = None
                if bundle is not None:
                    if step.buffers is not None:
                        step.buffers.restore()  # the re-run moved them: as the step began
                    try:
                        notes += write_bundle(
                            bundle,
                            info=self._info(
                                step,
                                index,
                                found,
                                bad_params=bad_params,
                                origins=origins,
                                notes=notes,
                            ),
                            module=module,
                            optimizer=optimizer or self.optimizer,
                            forwards=step.forwards,
                            records=[log_line(r) for r in recent],
                        )
                    except Exception as exc:  # training goes on; the log line says why
                        bundle = None
                        notes.append(f"no bundle written to {self.bundle}: {one_line(exc)}")
        finally:
            now.restore()
        return NonfiniteLine(
            step=index,
            rank=self.rank,
            world_size=self.world_size,
            found=found,
            origins=list(origins),
            nonfinite_params=bad_params,
            nonfinite_grads=bad_grads,
            bundle=None if bundle is None else str(bundle),
            notes=notes,
        )

    def _info(
        self,
        step: StepState,
        index: int,
        found: list[str],
        *,
        bad_params: list[str],
        origins: list[Origin],
        notes: list[str],
    ) -> BundleInfo:
        module = self.watched.module
        return BundleInfo(
            schema=BUNDLE_SCHEMA,
            step=index,
            rank=self.rank,
            world_size=self.world_size,
            found=list(found),
            nonfinite_params=list(bad_params),
            origins=list(origins),
            model=f"{type(module).__module__}.{type(module).__qualname__}",
            device=str(device_of(module)),
            layers=list(self.options.layers),
            types=list(self.options.types),
            forwards=len(step.forwards),
            hookcli_version=__version__,
            torch_version=torch.__version__,
            notes=list(notes),
        )


def stderr_line(line: NonfiniteLine) -> str:
    """The one line on stderr that tells of it."""
    where = "; ".join(o.describe() for o in line.origins) or "no layer call held it on the re-run"
    saved = f" Bundle: {line.bundle} (hookcli replay)." if line.bundle is not None else ""
    return (
        f"hookcli.watch: NaN/Inf in the {', '.join(line.found)} at step {line.step}: "
        f"{where}.{saved}"
    )
