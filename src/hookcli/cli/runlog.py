"""report (a saved JSON report, or a hookcli.watch log's series), and check over a run log:
`hookcli check run.jsonl [rank logs]` is dispatched here from cli.inspect.check.

No torch: a log and a saved report are numbers; commands.watch's logread, runmerge, runseries
and runrules read, merge and judge them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hookcli.cli import params as opt
from hookcli.cli.console import claim, emit, err, handled, output_format, rendered, to_file
from hookcli.errors import UsageError
from hookcli.render import Format
from hookcli.render.writers import Kind, writer

if TYPE_CHECKING:
    from hookcli.commands.watch.runseries import RunSeries
    from hookcli.io.output import Destination

# ------------------------------------------------------------------ check's run-log options

DeadAfterOpt = Annotated[
    int | None,
    typer.Option(
        "--dead-after",
        metavar="K",
        help="Run logs: fail when a ReLU-family output is dead (--dead-frac) at every watched "
        "step from step K on; implies --fail-on dead.",
    ),
]
MinGradNormOpt = Annotated[
    float | None,
    typer.Option(
        "--min-grad-norm",
        metavar="X",
        help="Run logs: fail when a gradient norm (layer outputs, parameters) falls below X.",
    ),
]
MaxGradNormOpt = Annotated[
    float | None,
    typer.Option(
        "--max-grad-norm",
        metavar="X",
        help="Run logs: fail when a gradient norm (layer outputs, parameters) exceeds X.",
    ),
]
MinUpdateRatioOpt = Annotated[
    float | None,
    typer.Option(
        "--min-update-ratio",
        metavar="X",
        help="Run logs: fail when a parameter's update/weight ratio falls below X, e.g. 1e-6.",
    ),
]
MaxUpdateRatioOpt = Annotated[
    float | None,
    typer.Option(
        "--max-update-ratio",
        metavar="X",
        help="Run logs: fail when a parameter's update/weight ratio exceeds X, e.g. 1e-2.",
    ),
]

LOG_ONLY = ("dead_after", "min_grad_norm", "max_grad_norm", "min_update_ratio", "max_update_ratio")
# check's options that describe a model run (a log has none of these to apply)
MODEL_ONLY = (
    "input_spec", "baseline", "rtol", "atol", "expect_shape", "backward", "max_abs", "layer",
    "type_", "depth", "target", "loss", "weights", "seed", "device", "model_arg", "output_key",
    "train", "save_baseline", "picture", "text", "text_file", "chat", "tokenizer", "head",
    "generate", "sample", "position", "channels", "heads", "max_outlier_ratio", "max_kurtosis",
    "max_sink", "min_entropy", "max_expert_imbalance", "max_saved_mb",
)  # fmt: skip


def _flag(ctx: typer.Context, name: str) -> str:
    """The option as typed: --dead-after for dead_after."""
    for p in ctx.command.params:
        if p.name == name:
            longs = [o for o in p.opts if o.startswith("--")]
            return (longs or p.opts)[0]
    return name


def check_log(ctx: typer.Context) -> bool:
    """`hookcli check run.jsonl …`: the rules over a run, when the MODEL argument is a run log
    (a path ending in .jsonl; more rank logs may follow). False when it is a model: check
    runs it as before (and then refuses the run-log options)."""
    p, used = opt.configured(ctx)
    named = [x for x in [p.get("model"), *(p.get("inputs") or [])] if x]
    from hookcli.commands.watch.logread import is_log_path

    logs = [x for x in named if is_log_path(x)]
    if not logs:
        for name in LOG_ONLY:
            if opt.given(ctx, name):
                raise UsageError(
                    f"{_flag(ctx, name)} is a rule over a training log, and check was given a "
                    "model.",
                    "give the log hookcli.watch wrote: hookcli check run.jsonl "
                    f"{_flag(ctx, name)} …; for a model's gradients use --grad-norm MIN:MAX.",
                )
        return False
    if len(logs) != len(named):
        other = next(x for x in named if not is_log_path(x))
        raise UsageError(
            f"check takes a model or run logs, not both: {other} is not a .jsonl log.",
            "hookcli check run.jsonl [run.rank1.jsonl …], or hookcli check MODEL [INPUT …].",
        )
    for name in MODEL_ONLY:
        if opt.given(ctx, name):
            raise UsageError(
                f"{_flag(ctx, name)} is for checking a model; {logs[0]} is a training log, "
                "which records its statistics already.",
                "drop it; a log's rules: --fail-on, --dead-frac, --dead-after, --min-std, "
                "--grad-norm or --min/--max-grad-norm, --min/--max-update-ratio.",
            )
    from hookcli.commands.watch.logread import expand_logs
    from hookcli.commands.watch.runmerge import load_run
    from hookcli.commands.watch.runrules import checks_json, evaluate_run, parse_run_rules
    from hookcli.commands.watch.runseries import run_lines
    from hookcli.options import RuleOptions, pick
    from hookcli.render.series import ChecksReport

    paths = expand_logs(logs)
    dest = claim(p["output"], reads=[*paths, *([used] if used else [])])
    fmt = output_format(p["fmt"], dest, kind=Kind.checks)
    rules = parse_run_rules(
        pick(RuleOptions, p),
        dead_after=p.get("dead_after"),
        min_grad_norm=p.get("min_grad_norm"),
        max_grad_norm=p.get("max_grad_norm"),
        min_update_ratio=p.get("min_update_ratio"),
        max_update_ratio=p.get("max_update_ratio"),
    )
    run = load_run(paths)
    results = evaluate_run(run, rules)
    quiet = bool(p.get("quiet"))
    elsewhere = fmt != Format.table or to_file(dest)
    if used and elsewhere and not quiet:
        err(f"config: {used}")
    header = [f"check run log {line}" if i == 0 else line for i, line in enumerate(run_lines(run))]
    report = ChecksReport(header, results, run.events, run.notes, checks_json(run, results))
    emit(rendered(report, fmt, dest, quiet=quiet), dest, quiet=quiet)
    failed = [c for c in results if not c.passed]
    if elsewhere:
        for c in failed:  # a table on stdout shows them; with any other, stderr says why
            err(f"check failed: {c.rule}: {c.message}")
    if failed:
        raise typer.Exit(1)
    return True


# ------------------------------------------------------------------ report


def report(
    files: Annotated[
        list[str],
        typer.Argument(
            metavar="FILE",
            help="A saved JSON report (inspect/grads/check -f json -o FILE.json), or the log "
            "hookcli.watch wrote (run.jsonl; every rank's log of a torchrun run, merged).",
            show_default=False,
        ),
    ],
    fmt: opt.FormatOpt = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FILE",
            help="Write to FILE instead of stdout (replaced atomically); for a run log, "
            "FILE.png draws its series as a grid of small plots, and -f tensorboard|mlflow|"
            "wandb -o DIR writes them to that tracker (hookcli[tensorboard], …).",
        ),
    ] = None,
) -> None:
    """Render a saved JSON report, or a training log: per layer call, parameter and the loss,
    each metric's first and last value and a sparkline over the watched steps (rank logs of a
    DDP run merged into one process over the whole batch).

    Example: hookcli report run.jsonl -o series.png
    """
    with handled():
        from hookcli.commands.watch.logread import expand_logs, is_log_path

        logs = [f for f in files if is_log_path(f)]
        if fmt is not None and writer(fmt).folder:
            _report_tracker(fmt, files, logs, output)
            return
        if logs and len(logs) != len(files):
            other = next(f for f in files if not is_log_path(f))
            raise UsageError(
                f"report takes one saved report or run logs, not both: {other} is not a "
                ".jsonl log.",
                "hookcli report run.jsonl [run.rank1.jsonl …], or hookcli report FILE.json.",
            )
        if not logs and len(files) != 1:
            raise UsageError(
                f"report renders one saved report; {len(files)} files were given.",
                "compare two with hookcli diff a.json b.json.",
            )
        paths = expand_logs(logs) if logs else list(files)
        png = output is not None and output.suffix.lower() == ".png"
        dest = claim(output, reads=paths)
        if png and not logs:
            raise UsageError(
                "-o FILE.png draws a run log's series; a saved report has none.",
                "give a run log (hookcli report run.jsonl -o series.png), or -o FILE.md/.json.",
            )
        if png and fmt is not None:
            raise UsageError(
                f"-f {fmt.value} and -o {output}: a .png output is the picture.",
                "drop -f, or write the text to another file.",
            )
        kind = Kind.series if logs else Kind.report
        form = Format.table if png else output_format(fmt, dest, kind=kind)
        if logs:
            _report_run(paths, form, dest, png=png)
        else:
            _report_saved(paths[0], form, dest)


def _report_tracker(fmt: Format, files: list[str], logs: list[str], output: Path | None) -> None:
    """A run log's series in an experiment tracker: TensorBoard event files in the folder -o
    names, a new MLflow run in the folder's file store, or an offline W&B run in the folder.
    Each writer checks its folder (trackers.check_log_dir) before it writes."""
    from hookcli.commands.watch import trackers
    from hookcli.commands.watch.logread import expand_logs
    from hookcli.commands.watch.runmerge import load_run
    from hookcli.commands.watch.runseries import series

    name = fmt.value
    if not logs or len(logs) != len(files):
        raise UsageError(
            f"-f {name} writes a training log's series; give the run.jsonl hookcli.watch wrote.",
            f"hookcli report run.jsonl -f {name} -o runs/NAME",
        )
    if output is None:
        raise UsageError(f"-f {name} writes a folder.", "add -o runs/NAME.")
    if not trackers.installed(name):
        raise UsageError(f"{name} is not installed.", f"pip install 'hookcli[{name}]'.")
    paths = expand_logs(logs)
    data = series(load_run(paths))
    run_name = Path(paths[0]).stem
    if fmt == Format.tensorboard:
        count = trackers.write_tensorboard(data, output)
        where = f"{output} (tensorboard --logdir {output})"
    elif fmt == Format.mlflow:
        tracking, run_id, count = trackers.write_mlflow(data, output, run_name)
        where = f"MLflow run {run_id} at {tracking}"
    else:
        place, count = trackers.write_wandb(data, output, run_name)
        where = f"{place} (offline W&B run: wandb sync to upload)"
    err(f"wrote {count} scalars over {len(data.steps)} steps to {where}")


def _report_saved(path: str, fmt: Format, dest: Destination | None) -> None:
    from hookcli.io.reportfile import saved_report

    emit(rendered(saved_report(path), fmt, dest), dest)


def _report_run(paths: list[str], fmt: Format, dest: Destination | None, *, png: bool) -> None:
    from hookcli.commands.watch.runmerge import load_run
    from hookcli.commands.watch.runseries import run_lines, series

    run = load_run(paths)
    data = series(run)
    header = run_lines(data)
    if png:
        assert dest is not None
        _write_png(data, header, dest)
        return
    from hookcli.render.series import SeriesReport

    report = SeriesReport(data, [f"report run log {header[0]}", *header[1:]])
    emit(rendered(report, fmt, dest), dest)


def _write_png(data: RunSeries, header: list[str], dest: Destination) -> None:
    from hookcli.io.output import write_with
    from hookcli.render.images import png_bytes_info
    from hookcli.render.series import series_png

    image, meta = series_png(data, header[0])
    info = png_bytes_info(meta)

    def fill(tmp: str) -> None:
        image.save(tmp, format="PNG", optimize=True, pnginfo=info)

    write_with(dest, fill)
    if dest.path is not None:
        err(f"wrote {dest.label} ({image.width}x{image.height})")
