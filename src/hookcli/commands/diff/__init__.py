"""`hookcli diff`: two variants (sides) of one model compared layer call by layer call.

- sides.py: one class per side kind (dtype, autocast, channels_last, quantized, compile, onnx,
  weights/seed/device), the composite `Side`, `parse_side` and the kinds' registry;
- quantsides.py: the kinds in quantized LLMs' formats (gguf:, torchao:, bnb:) and the weights'
  SQNR between two sides;
- passes.py: the reference side's hooked pass (putting each call's tensors in a sink) and a
  compared side's pass (reading them back);
- lockstep.py: the sides side by side, each pass in a thread, taking turns, the reference's
  tensors handed over call by call (the sink and source of most diffs);
- onnx.py: the onnx side's own pass (ONNX Runtime, calls found in the exported graph);
- measure.py: the spill file (the sink and source when sides cannot run side by side), the
  exact sums of a difference, what a compared side collects
  (and its predictions' agreement with the reference's);
- align.py: which calls two sides compare when their module trees differ (fused units as one,
  Identity rows left by fusion marked);
- tolerance.py: the default --tol, from the sides' precision;
- report.py: `diff_run` (the sides as specs, a DiffOptions: the CLI's and the API's door) and
  `diff_report`, the orchestration (batches, the twin, the passes, the own-error
  pass) and its report (sorted rows, the largest own errors);
- saved.py: `diff_saved`, two saved JSON reports compared by their statistics.
"""

from __future__ import annotations

from hookcli.commands.diff.report import diff_report, diff_run
from hookcli.commands.diff.saved import diff_saved
from hookcli.commands.diff.sides import SIDE_HELP, Side, SideKind, parse_side, register

__all__ = [
    "SIDE_HELP",
    "Side",
    "SideKind",
    "diff_report",
    "diff_run",
    "diff_saved",
    "parse_side",
    "register",
]
