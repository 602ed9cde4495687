"""--heads as a probe: every attention block's heads in numbers (commands/heads.py), read in
one extra forward of the batch after the measured pass. One batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookcli.engine.probes import Measured, Probe
from hookcli.records import Report

if TYPE_CHECKING:
    from hookcli.commands.checks import Rules


class Heads(Probe):
    option = "heads"
    flag = "heads"

    @classmethod
    def ruled(cls, rules: Rules) -> bool:
        return bool(rules.needs_heads)

    def finish(self, measured: Measured, report: Report) -> None:
        from hookcli.commands.heads import attention_heads

        report.heads, heard = attention_heads(measured.armed.prepared)
        report.notes += heard
