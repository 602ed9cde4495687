"""`hookcli diff`: two variants (sides) of one model compared layer call by layer call.

- sides.py: one class per side kind (dtype, autocast, channels_last, quantized, compile, onnx,
  weights/seed/device), the composite `Side`, `parse_side` and the kinds' registry;
- passes.py: the reference side's hooked pass (spilling) and a compared side's pass;
- onnx.py: the onnx side's own pass (ONNX Runtime, calls found in the exported graph);
- measure.py: the spill file, the exact sums of a difference, what a compared side collects;
- report.py: `diff_report`, the orchestration (batches, the twin, the passes) and its report;
- saved.py: `diff_saved`, two saved JSON reports compared by their statistics.
"""

from __future__ import annotations

from hookcli.commands.diff.report import diff_report
from hookcli.commands.diff.saved import diff_saved
from hookcli.commands.diff.sides import SIDE_HELP, Side, SideKind, parse_side, register

__all__ = ["SIDE_HELP", "Side", "SideKind", "diff_report", "diff_saved", "parse_side", "register"]
