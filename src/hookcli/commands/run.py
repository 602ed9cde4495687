"""inspect, grads and check as the command asks: the one path the CLI and the Python API take
(a folder run in batches or one batch, then the rules). Command rules live here and nowhere
else: check's default rule, when backward runs, no predictions and deterministic algorithms
for check, the layers --expect-shape names, and whether an image run is a folder run.

No torch at import: the engine and the folder runs are imported on use.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager

from hookcli.commands.checks import Rules, evaluate, for_check
from hookcli.errors import UsageError
from hookcli.options import BackwardOptions, Batching, Invocation
from hookcli.records import Report
from hookcli.runtime import gcpause

COMMANDS = ("inspect", "grads", "check")
Progress = Callable[[int, int], None]  # (images done, images in all) of a folder run
# Entered around the model's run, told whether it is a folder run; yields a progress callback
# for folder runs (or None). The CLI's spinner and progress bar; the API passes none.
Running = Callable[[bool], AbstractContextManager[Progress | None]]


def run_command(
    command: str,
    inv: Invocation,
    rules: Rules | None = None,
    *,
    batching: Batching = Batching(),
    running: Running | None = None,
) -> Report:
    """inspect, grads or check as the command asks: the run (one batch, or a folder run in
    batches), then its rules evaluated into `report.checks`. `checks.exit_code(report)` is the
    exit decision."""
    from hookcli.commands import shards
    from hookcli.commands.folder import folder_options, folder_report
    from hookcli.commands.inspect import report as inspection

    if command not in COMMANDS:
        raise ValueError(f"command must be one of {', '.join(COMMANDS)}, not {command!r}")
    rules = rules if rules is not None else Rules()
    if command == "check":
        rules = for_check(rules)
    inv = command_invocation(command, inv, rules)
    folder = folder_options(inv, batching, rules)
    context = running(folder is not None) if running is not None else contextlib.nullcontext()
    with shards.spread_model(inv.model), context as progress:
        if folder is not None:
            return _checked(command, folder_report(inv, folder, progress), inv, rules)
        if batching.per_image:  # one batch: each image's top-K is what its predictions are
            inv = _per_image(inv, batching.per_image)
        # one pass: the collector held off from its preparation to its checks, not only around
        # the pass (runtime/gcpause.py): what they make is then never walked, nor promoted to
        # the generations whose full collections walk the whole heap
        with gcpause.held():
            report = inspection(inv, "grads" if inv.backward is not None else "inspect")
            return _checked(command, report, inv, rules)


def _per_image(inv: Invocation, k: int) -> Invocation:
    """--per-image K on a one-batch run: each image's top-K predictions, as --topk K lists
    them (it was read by folder runs only, and ignored here)."""
    topk = inv.run.topk
    if topk is not None and topk != k:
        raise UsageError(
            f"--per-image {k} and --topk {topk} ask for different numbers of predictions per "
            "image (a one-batch run lists each image's).",
            f"give one of them: --topk {k}.",
        )
    return dataclasses.replace(inv, run=dataclasses.replace(inv.run, topk=k))


def _checked(command: str, report: Report, inv: Invocation, rules: Rules) -> Report:
    report.command = command
    # a position table the user named (-l NAME, no glob) is held to the per-channel rules
    named = tuple(n for n in inv.selection.layers if not any(ch in n for ch in "*?["))
    report.checks = evaluate(report, dataclasses.replace(rules, named=named))
    return report


def command_invocation(command: str, inv: Invocation, rules: Rules) -> Invocation:
    """What the command adds to what was asked: backward for grads, and for check when asked
    or a gradient rule needs it (target and loss apply then); --channels for the rules that
    read per-channel numbers; --expect-shape's layers hooked
    whatever the selection; check makes no predictions and runs deterministic algorithms."""
    backward: BackwardOptions | None = None
    if command == "grads" or (command == "check" and rules.needs_backward):
        backward = inv.backward or BackwardOptions()
    selection = inv.selection
    also = tuple(layer for layer, _ in rules.expect_shapes)
    if also:
        selection = dataclasses.replace(selection, always=selection.always + also)
    run = inv.run
    if command == "check":
        run = dataclasses.replace(run, topk=0, deterministic=True)
    if rules.needs_channels and not run.channels:
        run = dataclasses.replace(run, channels=True)
    if rules.needs_heads and not run.heads:
        run = dataclasses.replace(run, heads=True)
    if rules.max_saved_mb is not None and not run.memory:
        run = dataclasses.replace(run, memory=True)
    return dataclasses.replace(inv, selection=selection, run=run, backward=backward)
