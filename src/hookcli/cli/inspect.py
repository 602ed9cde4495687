"""inspect, grads and check: options → hookcli.commands.run_command → rendering and the exit
code (hookcli.commands.checks.exit_code decides it, for the API as for the CLI)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hookcli.cli import params as opt
from hookcli.cli import runlog
from hookcli.cli.console import (
    claim,
    emit,
    err,
    handled,
    model_output_to_stderr,
    output_format,
    rendered,
    status,
    to_file,
)
from hookcli.errors import UsageError
from hookcli.options import DEFAULTS
from hookcli.render import Format
from hookcli.render.writers import Kind

if TYPE_CHECKING:
    from hookcli.commands import Running
    from hookcli.commands.checks import Rules


def inspect(
    ctx: typer.Context,
    model: opt.ModelArg = None,
    inputs: opt.InputsArg = None,
    layer: opt.LayerOpt = None,
    type_: opt.TypeOpt = None,
    depth: opt.DepthOpt = None,
    input_spec: opt.InputSpecOpt = None,
    text: opt.TextOpt = None,
    text_file: opt.TextFileOpt = None,
    chat: opt.ChatOpt = DEFAULTS.inputs.chat,
    padding_side: opt.PaddingSideOpt = None,
    target_text: opt.TargetTextOpt = None,
    tokenizer: opt.TokenizerOpt = None,
    head: opt.HeadOpt = None,
    position: opt.PositionOpt = None,
    weights: opt.WeightsOpt = DEFAULTS.model.weights,
    seed: opt.SeedOpt = DEFAULTS.model.seed,
    device: opt.DeviceOpt = DEFAULTS.model.device,
    model_arg: opt.ModelArgOpt = None,
    output_key: opt.OutputKeyOpt = None,
    train: opt.TrainOpt = DEFAULTS.run.train,
    topk: opt.TopkOpt = None,
    batch_size: opt.BatchSizeOpt = None,
    limit: opt.LimitOpt = None,
    workers: opt.WorkersOpt = DEFAULTS.batching.workers,
    strict: opt.StrictOpt = DEFAULTS.inputs.strict,
    per_image: opt.PerImageOpt = DEFAULTS.batching.per_image,
    ablate: Annotated[
        list[str] | None,
        typer.Option(
            "--ablate",
            metavar="LAYER=OP",
            help="Change a layer's output for a second run and compare: zero, mean, scale:K, "
            "noise:S, clamp:LO:HI. Repeatable.",
        ),
    ] = None,
    fail_on: opt.FailOnOpt = None,
    dead_frac: opt.DeadFracOpt = DEFAULTS.rules.dead_frac,
    fmt: opt.FormatOpt = None,
    output: opt.OutputOpt = None,
    picture: opt.PictureOpt = None,
    hist: opt.HistOpt = False,
    profile: opt.ProfileOpt = DEFAULTS.run.profile,
    memory: opt.MemoryOpt = DEFAULTS.run.memory,
    offload: opt.OffloadOpt = False,
    tp: opt.TpOpt = False,
    per_token: opt.PerTokenOpt = DEFAULTS.run.per_token,
    channels: opt.ChannelsOpt = DEFAULTS.run.channels,
    heads: opt.HeadsOpt = DEFAULTS.run.heads,
    generate: opt.GenerateOpt = DEFAULTS.run.generate,
    sample: opt.SampleOpt = DEFAULTS.run.sample,
    save: opt.SaveOpt = None,
    force: opt.ForceOpt = False,
    save_baseline: opt.SaveBaselineOpt = None,
    config: opt.ConfigOpt = None,
    no_config: opt.NoConfigOpt = False,
) -> None:
    """Forward pass with hooks on the selected layers: statistics of every call's inputs and
    outputs, and the top-k predictions.

    Example: hookcli inspect resnet34 sample_images/cat.jpeg -l 'layer4.*'
    """
    with handled():
        run_command(ctx, "inspect")


def grads(
    ctx: typer.Context,
    model: opt.ModelArg = None,
    inputs: opt.InputsArg = None,
    layer: opt.LayerOpt = None,
    type_: opt.TypeOpt = None,
    depth: opt.DepthOpt = None,
    input_spec: opt.InputSpecOpt = None,
    text: opt.TextOpt = None,
    text_file: opt.TextFileOpt = None,
    chat: opt.ChatOpt = DEFAULTS.inputs.chat,
    padding_side: opt.PaddingSideOpt = None,
    target_text: opt.TargetTextOpt = None,
    tokenizer: opt.TokenizerOpt = None,
    head: opt.HeadOpt = None,
    position: opt.PositionOpt = None,
    target: opt.TargetOpt = None,
    loss: opt.LossOpt = None,
    input_grad: Annotated[
        bool, typer.Option("--input-grad", help="Also the gradient w.r.t. the model input.")
    ] = DEFAULTS.backward.input_grad,
    weights: opt.WeightsOpt = DEFAULTS.model.weights,
    seed: opt.SeedOpt = DEFAULTS.model.seed,
    device: opt.DeviceOpt = DEFAULTS.model.device,
    model_arg: opt.ModelArgOpt = None,
    output_key: opt.OutputKeyOpt = None,
    train: opt.TrainOpt = DEFAULTS.run.train,
    topk: opt.TopkOpt = None,
    batch_size: opt.BatchSizeOpt = None,
    limit: opt.LimitOpt = None,
    workers: opt.WorkersOpt = DEFAULTS.batching.workers,
    strict: opt.StrictOpt = DEFAULTS.inputs.strict,
    per_image: opt.PerImageOpt = DEFAULTS.batching.per_image,
    fail_on: opt.FailOnOpt = None,
    dead_frac: opt.DeadFracOpt = DEFAULTS.rules.dead_frac,
    fmt: opt.FormatOpt = None,
    output: opt.OutputOpt = None,
    picture: opt.PictureOpt = None,
    hist: opt.HistOpt = False,
    profile: opt.ProfileOpt = DEFAULTS.run.profile,
    memory: opt.MemoryOpt = DEFAULTS.run.memory,
    tp: opt.TpOpt = False,
    per_token: opt.PerTokenOpt = DEFAULTS.run.per_token,
    channels: opt.ChannelsOpt = DEFAULTS.run.channels,
    heads: opt.HeadsOpt = DEFAULTS.run.heads,
    save: opt.SaveOpt = None,
    force: opt.ForceOpt = False,
    save_baseline: opt.SaveBaselineOpt = None,
    config: opt.ConfigOpt = None,
    no_config: opt.NoConfigOpt = False,
) -> None:
    """Forward and backward pass: everything inspect shows, plus each call's gradients w.r.t.
    its outputs and inputs and each layer's parameter gradients.

    Example: hookcli grads resnet34 sample_images/cat.jpeg -l 'layer4.*' --target "tabby cat"
    """
    with handled():
        run_command(ctx, "grads")


def check(
    ctx: typer.Context,
    model: opt.ModelArg = None,
    inputs: opt.InputsArg = None,
    fail_on: opt.FailOnOpt = None,
    dead_frac: opt.DeadFracOpt = DEFAULTS.rules.dead_frac,
    max_abs: Annotated[
        float | None,
        typer.Option("--max-abs", metavar="X", help="Fail when any activation exceeds |X|."),
    ] = None,
    min_std: Annotated[
        float | None,
        typer.Option(
            "--min-std",
            metavar="X",
            help="Fail when an activation collapses: any output's std below X, e.g. 1e-6.",
        ),
    ] = None,
    grad_norm: Annotated[
        str | None,
        typer.Option(
            "--grad-norm",
            metavar="MIN:MAX",
            help="Fail when a gradient norm (outputs, parameters) leaves [MIN, MAX]; "
            "implies --backward. Either bound may be empty.",
        ),
    ] = None,
    expect_shape: Annotated[
        list[str] | None,
        typer.Option(
            "--expect-shape",
            metavar="LAYER=SHAPE",
            help="Fail unless LAYER's first output has this shape, e.g. conv1=1x64x112x112.",
        ),
    ] = None,
    baseline: Annotated[
        Path | None,
        typer.Option(
            "--baseline",
            metavar="FILE",
            help="Compare every statistic with a recorded JSON report (inspect -f json -o FILE).",
        ),
    ] = None,
    rtol: Annotated[
        float, typer.Option("--rtol", help="Relative tolerance for --baseline.")
    ] = DEFAULTS.rules.rtol,
    atol: Annotated[
        float, typer.Option("--atol", help="Absolute tolerance for --baseline.")
    ] = DEFAULTS.rules.atol,
    backward: Annotated[
        bool, typer.Option("--backward", help="Also run backward (gradients are checked too).")
    ] = DEFAULTS.rules.backward,
    max_outlier_ratio: Annotated[
        float | None,
        typer.Option(
            "--max-outlier-ratio",
            metavar="R",
            help="Fail when a tensor's largest channel max|x| exceeds R times the median "
            "channel's (implies --channels).",
        ),
    ] = None,
    max_kurtosis: Annotated[
        float | None,
        typer.Option(
            "--max-kurtosis",
            metavar="K",
            help="Fail when a tensor's kurtosis exceeds K (a normal's is 3; implies --channels).",
        ),
    ] = None,
    max_sink: Annotated[
        float | None,
        typer.Option(
            "--max-sink",
            metavar="S",
            help="Fail when an attention head puts more than S of its queries' probability on "
            "the first token: a dormant head (implies --heads).",
        ),
    ] = None,
    min_entropy: Annotated[
        float | None,
        typer.Option(
            "--min-entropy",
            metavar="E",
            help="Fail when an attention head's mean entropy is below E nats: a collapsed head "
            "(implies --heads).",
        ),
    ] = None,
    max_expert_imbalance: Annotated[
        float | None,
        typer.Option(
            "--max-expert-imbalance",
            metavar="R",
            help="Fail when a MoE router's busiest expert takes more than R times the mean load.",
        ),
    ] = None,
    max_saved_mb: Annotated[
        float | None,
        typer.Option(
            "--max-saved-mb",
            metavar="MB",
            help="Fail when the tensors autograd saves for backward in one step exceed MB "
            "megabytes (10^6 bytes; implies --backward and --memory).",
        ),
    ] = None,
    memory: opt.MemoryOpt = DEFAULTS.run.memory,
    offload: opt.OffloadOpt = False,
    tp: opt.TpOpt = False,
    channels: opt.ChannelsOpt = DEFAULTS.run.channels,
    heads: opt.HeadsOpt = DEFAULTS.run.heads,
    batch_size: opt.BatchSizeOpt = None,
    limit: opt.LimitOpt = None,
    workers: opt.WorkersOpt = DEFAULTS.batching.workers,
    strict: opt.StrictOpt = DEFAULTS.inputs.strict,
    dead_after: runlog.DeadAfterOpt = None,
    min_grad_norm: runlog.MinGradNormOpt = None,
    max_grad_norm: runlog.MaxGradNormOpt = None,
    min_update_ratio: runlog.MinUpdateRatioOpt = None,
    max_update_ratio: runlog.MaxUpdateRatioOpt = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only failures.")] = False,
    layer: opt.LayerOpt = None,
    type_: opt.TypeOpt = None,
    depth: opt.DepthOpt = None,
    input_spec: opt.InputSpecOpt = None,
    text: opt.TextOpt = None,
    text_file: opt.TextFileOpt = None,
    chat: opt.ChatOpt = DEFAULTS.inputs.chat,
    padding_side: opt.PaddingSideOpt = None,
    target_text: opt.TargetTextOpt = None,
    tokenizer: opt.TokenizerOpt = None,
    head: opt.HeadOpt = None,
    position: opt.PositionOpt = None,
    generate: opt.GenerateOpt = DEFAULTS.run.generate,
    sample: opt.SampleOpt = DEFAULTS.run.sample,
    target: opt.TargetOpt = None,
    loss: opt.LossOpt = None,
    weights: opt.WeightsOpt = DEFAULTS.model.weights,
    seed: opt.SeedOpt = DEFAULTS.model.seed,
    device: opt.DeviceOpt = DEFAULTS.model.device,
    model_arg: opt.ModelArgOpt = None,
    output_key: opt.OutputKeyOpt = None,
    train: opt.TrainOpt = DEFAULTS.run.train,
    fmt: opt.FormatOpt = None,
    output: opt.OutputOpt = None,
    picture: opt.PictureOpt = None,
    save_baseline: opt.SaveBaselineOpt = None,
    config: opt.ConfigOpt = None,
    no_config: opt.NoConfigOpt = False,
) -> None:
    """Run the model (and backward with --backward or a gradient rule) and check rules: exit 0
    when all pass, 1 when any fails. Without rules: --fail-on nonfinite. Deterministic.
    MODEL may be a training log instead (run.jsonl from hookcli.watch; every rank's log of a
    torchrun run): the rules then hold over its watched steps.

    Example: hookcli check resnet50 --fail-on nonfinite --fail-on dead --baseline base.json
    """
    with handled():
        if runlog.check_log(ctx):  # MODEL is a run log: the rules over its steps
            return
        run_command(ctx, "check")


def _given_rules(ctx: typer.Context, rules: Rules) -> None:
    """What a rule's own option given alone asks for: --dead-frac is the dead rule's threshold,
    so it turns the rule on (as --dead-after does for a log); --rtol/--atol are --baseline's
    tolerances, and without a baseline there is nothing for them to apply to (exit 2)."""
    if opt.given(ctx, "dead_frac") and "dead" not in rules.fail_on:
        rules.fail_on.append("dead")
    tolerances = opt.given_flags(ctx, lambda name: name in ("rtol", "atol"))
    if tolerances and rules.baseline is None:
        raise UsageError(
            f"{tolerances[0]} is the tolerance of --baseline, and this run has no baseline.",
            "add --baseline FILE, or drop " + " and ".join(tolerances) + ".",
        )


def run_command(ctx: typer.Context, command: str) -> None:
    """inspect, grads and check: parameters → option objects → hookcli.commands.run_command →
    rendering and the exit code."""
    p, used = opt.configured(ctx)
    reads = opt.reads(p, used)
    output = claim(p["output"], reads=reads)
    baseline_out = claim(p["save_baseline"], "--save-baseline", stdout_ok=False, reads=reads)
    save = claim(p.get("save"), "--save", suffix=".safetensors", stdout_ok=False, reads=reads)
    fmt = output_format(p["fmt"], output, kind=Kind.report)
    from hookcli.cli.pictures import parse_pictures

    specs = parse_pictures(p.get("picture"), fmt)
    from hookcli.commands import run_command as run
    from hookcli.commands.checks import exit_code, failures, parse_rules
    from hookcli.options import (
        BackwardOptions,
        Batching,
        Invocation,
        RuleOptions,
        RunOptions,
        hist_bins,
        pick,
    )

    rules = parse_rules(pick(RuleOptions, p))
    _given_rules(ctx, rules)
    if command == "check" and not rules.needs_backward:
        _no_backward_options(ctx)
    model_opts = opt.model_options(p, command)
    name = str(model_opts.model)
    inv = Invocation(
        model=model_opts,
        selection=opt.selection(p),
        inputs=opt.input_options(p),
        run=pick(RunOptions, p, hist=hist_bins(bool(p.get("hist"))), save=save, config=used),
        backward=None if command == "inspect" else pick(BackwardOptions, p),
    )
    report = run(command, inv, rules, batching=pick(Batching, p), running=_running(name))
    from hookcli.runtime.ranks import writer

    if not writer():  # torchrun: every rank holds the merged report, rank 0 writes it
        code = exit_code(report)
        if code:
            raise typer.Exit(code)
        return
    pictures = []
    if specs:
        from hookcli.cli.pictures import draw_pictures

        with status(f"drawing {len(specs)} picture{'s' if len(specs) > 1 else ''}…"):
            pictures = draw_pictures(specs, model_opts, inv.inputs, p)
    quiet = bool(p.get("quiet"))  # check --quiet: failures only, no "config:"/"wrote" lines
    if used and (fmt != Format.table or to_file(output)) and not quiet:
        err(f"config: {used}")  # a table on stdout says so in its header
    if baseline_out is not None:
        from hookcli.render.json import report_json

        emit(report_json(report), baseline_out, quiet=quiet)
    emit(
        rendered(
            report, fmt, output, checks_only=command == "check", quiet=quiet, pictures=pictures
        ),
        output,
        quiet=quiet,
    )
    failed = failures(report)
    if failed and (fmt != Format.table or to_file(output)):
        for c in failed:  # a table on stdout shows them; with any other, stderr says why
            err(f"check failed: {c.rule}: {c.message}")
    if report.interrupted:
        err("interrupted: partial results above")
    code = exit_code(report)
    if code:
        raise typer.Exit(code)


def _running(name: str) -> Running:
    """What the run shows while the model runs: a spinner, or for a folder run a progress bar
    (at a terminal); the model's own print() goes to stderr either way."""

    @contextlib.contextmanager
    def running(folder: bool) -> Iterator[Any]:
        if not folder:
            with status(f"running {name}…"):
                yield None
            return
        if not sys.stderr.isatty() or os.environ.get("CI"):
            with model_output_to_stderr():
                yield None
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, transient=True) as bar, model_output_to_stderr():
            task = bar.add_task(f"inspect {name}", total=None, rate="")

            def advance(done: int, total: int) -> None:
                elapsed = bar.tasks[0].elapsed or 1e-9
                bar.update(task, completed=done, total=total, rate=f"{done / elapsed:.1f} img/s")

            yield advance

    return running


# check's options that say how backward runs: without --backward (or a gradient rule) none runs
_BACKWARD_ONLY = ("target", "loss", "input_grad")


def _no_backward_options(ctx: typer.Context) -> None:
    """check without --backward runs no backward: an option given on the command line that
    shapes one would be ignored, so it is refused (the project config's are not the user's
    words for this run)."""
    given = opt.given_flags(ctx, lambda name: name in _BACKWARD_ONLY)
    if given:
        raise UsageError(
            f"{', '.join(given)} {'says' if len(given) == 1 else 'say'} how backward runs, "
            "and check runs none here.",
            "add --backward (or a gradient rule: --grad-norm, --max-saved-mb).",
        )
