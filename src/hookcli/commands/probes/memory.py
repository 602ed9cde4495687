"""--memory as a probe: what autograd saves per call, each output's bytes and the pass's peak
(engine/memory.py; totals and candidates, commands/memory.py). Sizes one batch's pass; and
`hookcli.watch(memory=True)`'s, which sizes each watched training step (StepMemory)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from hookcli.commands.memory import gradient_bytes, memory_report, optimizer_bytes, totals
from hookcli.engine.memory import MemoryMeter, distinct_bytes
from hookcli.engine.probes import Armed, Measured, Probe, StepArmed, StepProbe
from hookcli.records import Report, StepLine
from hookcli.tree import iter_tensors

if TYPE_CHECKING:
    from hookcli.commands.checks import Rules


class Memory(Probe):
    option = "memory"
    flag = "memory"
    refusal = (
        "--memory (and --max-saved-mb) size one batch's pass; a folder run is many.",
        "give one image (or --input randn:BxCxHxW for the batch size you train with).",
    )

    def __init__(self) -> None:
        self.meter: MemoryMeter | None = None
        self.gradients: int | None = None
        self.output_bytes = 0

    @classmethod
    def ruled(cls, rules: Rules) -> bool:
        return rules.max_saved_mb is not None

    def arm(self, armed: Armed) -> contextlib.AbstractContextManager[Any]:
        self.meter = armed.memory = MemoryMeter(armed.prepared.loaded.module, armed.prepared.device)
        return contextlib.nullcontext()

    def read(self, measured: Measured) -> None:
        assert measured.result is not None
        if measured.armed.backward:
            self.gradients = gradient_bytes(measured.armed.prepared.loaded.module)
        outputs = iter_tensors(measured.result.output, "out")
        self.output_bytes = distinct_bytes(t for _, t in outputs)[0]

    def finish(self, measured: Measured, report: Report) -> None:
        assert self.meter is not None
        report.memory = memory_report(
            measured.armed.prepared,
            self.meter,
            measured.session.calls,
            gradients=self.gradients,
            output_bytes=self.output_bytes,
            train=measured.armed.train,
        )


class StepMemory(StepProbe):
    """watch(memory=True): what each watched step's forwards save for backward, per call, and
    the step's totals (parameters, gradients, optimizer state, the predicted peak)."""

    def __init__(self) -> None:
        self.module: Any = None
        self.device: Any = None
        self.meter: MemoryMeter | None = None
        self.saving: list[Any] = []  # the saved-tensor hooks each forward pushed

    def arm(self, armed: StepArmed) -> None:
        self.module, self.device = armed.module, armed.device
        self.meter = armed.memory = MemoryMeter(armed.module, armed.device)
        self.meter.arm()

    def forward_began(self) -> None:
        """The forward's saved tensors counted — unless saved-tensor hooks of the training's
        own are on (torch.utils.checkpoint around the model, save_on_cpu, torch.func), which
        ours would override: then this step is not counted, and says so."""
        if self.meter is None:
            return
        top: Any = torch._C._autograd._top_saved_tensors_default_hooks
        if top(False) is not None:
            self.meter.skipped = "the forward ran under saved-tensor hooks of its own"
            return
        ctx = self.meter.saving()
        try:
            ctx.__enter__()
        except RuntimeError as exc:  # (torch.func refuses saved-tensor hooks)
            self.meter.skipped = f"saved-tensor hooks refused: {exc}"
            return
        self.saving.append(ctx)

    def forward_ended(self) -> None:
        if self.saving:
            self.saving.pop().__exit__(None, None, None)

    def ended(self) -> None:
        if self.meter is not None:
            self.meter.finish()  # (before the calls are completed: their freed bytes)

    def finish(self, record: StepLine, optimizer: Any) -> None:
        meter = self.meter
        assert meter is not None
        record.memory = totals(
            self.module,
            self.device,
            meter,
            backward=True,
            gradients=gradient_bytes(self.module),
            optimizer=optimizer_bytes(optimizer) if optimizer is not None else None,
        )
        if meter.skipped:
            record.memory.notes.append(f"saved bytes not counted: {meter.skipped}")
        if meter.forwards > 1:
            record.memory.notes.append(
                f"{meter.forwards} forwards in this step (gradient accumulation?): "
                "saved bytes add them all up, and the predicted peak takes them as alive "
                "at once"
            )

    def disarm(self) -> None:
        while self.saving:  # a forward that raised left its hooks pushed
            self.saving.pop().__exit__(None, None, None)
        if self.meter is not None:
            self.meter.disarm()
        self.meter = None
