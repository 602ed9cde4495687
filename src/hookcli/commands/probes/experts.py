"""MoE routing as a probe: every router's counts over the real tokens (engine/experts.py), in
every one-batch run of a model that has routers; a fused MoE block whose expert pairs are not
known is said. Read on one batch: expert rules refuse a run in batches."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from hookcli.commands.experts import routing_report
from hookcli.engine import fused_experts
from hookcli.engine.experts import Routing, counting_routes
from hookcli.engine.probes import Armed, Measured, Probe
from hookcli.options import DEFAULT_BATCH
from hookcli.records import Report

if TYPE_CHECKING:
    from hookcli.commands.checks import Rules


class Experts(Probe):
    refusal = (
        "expert routing is read on one batch, not over a run in batches (a folder, or more "
        "texts than one batch holds).",
        f"give at most {DEFAULT_BATCH} texts (--text, --text-file) without --batch-size/--limit, "
        "or drop the "
        "expert rules.",
    )

    def __init__(self) -> None:
        self.routing: Routing | None = None

    @classmethod
    def ruled(cls, rules: Rules) -> bool:
        return "dead-experts" in rules.fail_on or bool(rules.max_expert_imbalance)

    @contextlib.contextmanager
    def arm(self, armed: Armed) -> Iterator[None]:
        module = armed.prepared.loaded.module
        types = [e.type for e in armed.prepared.entries]  # (this pass's table: no walk)
        with counting_routes(module, armed.model_input.token_mask, types) as routing:
            self.routing = routing
            yield

    def finish(self, measured: Measured, report: Report) -> None:
        if self.routing is not None and self.routing.routers:
            report.experts, routed = routing_report(self.routing)
            report.notes += routed


class ExpertPairs(Probe):
    """A padded batch through a fused MoE block whose experts' projections cannot be paired
    with their tokens: said (engine/fused_experts.py). Always on, notes only."""

    batched = True

    def finish(self, measured: Measured, report: Report) -> None:
        if measured.model_input.token_mask is not None:
            prepared = measured.armed.prepared
            selected = (t.name for t in prepared.targets)
            report.notes += fused_experts.pair_notes(prepared.loaded.module, selected)
