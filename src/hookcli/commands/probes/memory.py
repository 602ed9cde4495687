"""--memory as a probe: what autograd saves per call, each output's bytes and the pass's peak
(engine/memory.py; totals and candidates, commands/memory.py). Sizes one batch's pass."""

from __future__ import annotations

import contextlib
from typing import Any

from hookcli.commands.memory import gradient_bytes, memory_report
from hookcli.engine.memory import MemoryMeter, distinct_bytes
from hookcli.engine.probes import Armed, Measured, Probe
from hookcli.records import Report
from hookcli.tree import iter_tensors


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
    def ruled(cls, rules: Any) -> bool:
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
