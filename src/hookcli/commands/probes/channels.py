"""--channels as a probe: each measured tensor's channels (engine/channels.py), and a fused
MoE block's routed experts read per expert (engine/fused_experts.py: no Linear runs per
expert, so the block's weights are read as each expert's projections). Merges over batches."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from hookcli.commands import outliers
from hookcli.engine import fused_experts
from hookcli.engine.measure import label_layouts
from hookcli.engine.probes import Armed, Measured, Probe
from hookcli.records import Report

if TYPE_CHECKING:
    from hookcli.commands.checks import Rules

EXPERTS_NOTE = (
    "--channels: each routed expert's projections of a fused MoE block are rows of their own "
    "(EXPERTS.E.gate_up_proj, .down_proj), their input over the real tokens routed to expert E"
)


class Channels(Probe):
    option = "channels"
    flag = "channels"
    batched = True

    def __init__(self, *, per_expert: bool = True) -> None:
        self.per_expert = per_expert  # a folder run merges layers' rows, not experts' (yet)
        self.tapped: list[tuple[str, Any]] = []
        self.tap: fused_experts.ExpertTap | None = None
        self.armed: Armed | None = None

    @classmethod
    def ruled(cls, rules: Rules) -> bool:
        return bool(rules.needs_channels)

    @contextlib.contextmanager
    def arm(self, armed: Armed) -> Iterator[None]:
        self.armed = armed
        armed.collector.channels = outliers.chooser(armed.layout_of, armed.types)
        if not self.per_expert:
            yield
            return
        module = armed.prepared.loaded.module
        self.tapped = fused_experts.selected_experts(
            module, (t.module for t in armed.prepared.targets)
        )
        with fused_experts.tapping(
            self.tapped, armed.model_input.token_mask, hist=False, collector=armed.collector
        ) as tap:
            self.tap = tap
            yield

    def finish(self, measured: Measured, report: Report) -> None:
        tap = self.tap
        if tap is not None and tap.measured:
            owners = {name: type(m).__name__ for name, m in self.tapped}
            report.layers = outliers.expert_rows(report.layers, tap.measured, owners)
            label_layouts(report.layers, measured.armed.layout_of)
            report.notes.append(EXPERTS_NOTE)
        if tap is not None:
            report.notes += [
                f"{name}: not read per expert: {why}" for name, why in tap.unreadable.items()
            ]
        report.outliers = outliers.summary(report.layers)
