"""diff: two variants of one model (or two saved JSON reports), layer call by layer call."""

from __future__ import annotations

from typing import Annotated

import typer

from hookcli.cli import params as opt
from hookcli.cli.console import (
    claim,
    emit,
    err,
    handled,
    output_format,
    rendered,
    status,
    to_file,
)
from hookcli.errors import UsageError
from hookcli.options import DEFAULTS
from hookcli.render import Format
from hookcli.render.writers import Kind

SORTS = ("order", "error", "own")  # --sort; commands.diff.report checks them
TOL_HELP = "1e-3 float32, 4e-3 float16, 3e-2 bfloat16, 1e-1 int8"  # commands.diff.tolerance


def diff(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Argument(
            help="The model (as for inspect), or a first JSON report to compare with a second.",
            show_default=False,
        ),
    ] = None,
    inputs: opt.InputsArg = None,
    a: Annotated[
        str,
        typer.Option(
            "--a",
            metavar="SIDE",
            help="Side A, the reference unless --ref is given. Default: the model as loaded, "
            "in its checkpoint's dtype (a bfloat16 checkpoint runs in bfloat16).",
            show_default=False,
        ),
    ] = DEFAULTS.diff.a,
    b: Annotated[
        str | None,
        typer.Option(
            "--b",
            metavar="SIDE",
            help="Side B: float32|float64|float16|bfloat16, autocast[:DTYPE], channels_last, "
            "quantized (the int8 twin), compile (torch.compile), onnx (ONNX Runtime), "
            "weights=W, seed=N, device=D; a quantized LLM: gguf:FILE.gguf, "
            "torchao:int8wo|int4wo[:G]|int8dq, bnb:nf4|int8, hf:FOLDER (a quantized "
            "checkpoint); joined with commas "
            "(float16,channels_last).",
            show_default=False,
        ),
    ] = None,
    ref: Annotated[
        str | None,
        typer.Option(
            "--ref",
            metavar="SIDE",
            help="Measure both sides against this one (e.g. float64): which side is wrong.",
        ),
    ] = None,
    isolate: Annotated[
        bool,
        typer.Option(
            "--isolate",
            help="Feed each selected layer the reference side's input: its own error only.",
        ),
    ] = DEFAULTS.diff.isolate,
    tol: Annotated[
        float | None,
        typer.Option(
            "--tol",
            help="Relative L2 error past which a call fails (exit 1) [default: from the "
            f"sides' precision: {TOL_HELP}].",
            show_default=False,
        ),
    ] = None,
    max_kld: Annotated[
        float | None,
        typer.Option(
            "--max-kld",
            help="A causal LM's text: exit 1 when the mean KL divergence of B's next-token "
            "distributions from A's (nats) is past this.",
            show_default=False,
        ),
    ] = None,
    min_same_top1: Annotated[
        float | None,
        typer.Option(
            "--min-same-top1",
            help="A causal LM's text: exit 1 when B's most probable next token is A's at fewer "
            "than this fraction of positions (0.95).",
            show_default=False,
        ),
    ] = None,
    sort: Annotated[
        str,
        typer.Option(
            "--sort",
            metavar="order|error|own",
            help="Row order: order (as the calls returned), error (largest relative L2 "
            "first: accumulated, or own with --isolate), own (largest own error first).",
            autocompletion=lambda: list(SORTS),
        ),
    ] = "order",
    own: Annotated[
        bool,
        typer.Option(
            "--own/--no-own",
            help="Without --isolate, a second pass of side B fed A's input at every layer: "
            "each layer's own error (the own column, the largest-own-error summary).",
        ),
    ] = True,
    layer: opt.LayerOpt = None,
    type_: opt.TypeOpt = None,
    depth: opt.DepthOpt = None,
    input_spec: opt.InputSpecOpt = None,
    text: opt.TextOpt = None,
    text_file: opt.TextFileOpt = None,
    chat: opt.ChatOpt = DEFAULTS.inputs.chat,
    padding_side: opt.PaddingSideOpt = None,
    tokenizer: opt.TokenizerOpt = None,
    head: opt.HeadOpt = None,
    weights: opt.WeightsOpt = DEFAULTS.model.weights,
    seed: opt.SeedOpt = DEFAULTS.model.seed,
    device: opt.DeviceOpt = DEFAULTS.model.device,
    model_arg: opt.ModelArgOpt = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--batch-size",
            help="Images per batch for a folder [default: 32]; texts per batch for a text file "
            "[default: 8].",
            show_default=False,
        ),
    ] = None,
    fmt: opt.FormatOpt = None,
    output: opt.OutputOpt = None,
    config: opt.ConfigOpt = None,
    no_config: opt.NoConfigOpt = False,
) -> None:
    """Run two variants of one model on the same input and compare every layer call's output:
    max|Δ|, relative L2, cosine, SQNR, each layer's own error, a classifier's predictions, and
    on a causal LM's text the next-token distributions (KL, same top-1, perplexity); exit 1
    when a call is past --tol, naming the first, or past --max-kld / --min-same-top1.

    Example: hookcli diff resnet18 sample_images/cat.jpeg --b bfloat16 --sort own
    """
    with handled():
        p, used = opt.configured(ctx)
        dest = claim(p["output"], reads=opt.reads(p, used))
        fmt_ = output_format(p["fmt"], dest, kind=Kind.diff)
        from hookcli.commands.diff import diff_run, diff_saved
        from hookcli.options import DiffOptions, pick

        name = opt.need_model(p, "diff")
        inputs = p["inputs"]
        saved = [x for x in [name, *(inputs or [])] if x.lower().endswith(".json")]
        if saved:
            if len(saved) != 2 or inputs is None or len(inputs) != 1:
                raise UsageError(
                    "diff of saved reports takes exactly two JSON files.",
                    "hookcli diff a.json b.json (or a model and --b SIDE).",
                )
            if p["max_kld"] is not None or p["min_same_top1"] is not None:
                raise UsageError(
                    "--max-kld and --min-same-top1 judge a run over text; two saved reports "
                    "hold no next-token distributions to compare.",
                    "run the model: hookcli diff MODEL --text-file FILE --b SIDE --max-kld X.",
                )
            _nothing_to_run(ctx)
            report = diff_saved(saved[0], saved[1], p["tol"], sort=p["sort"])
        else:
            with status(f"running {name} twice…"):
                report = diff_run(
                    opt.model_options(p, "diff"),
                    opt.selection(p),
                    opt.input_options(p),
                    pick(DiffOptions, p),
                )
        from hookcli.runtime.ranks import writer

        if not writer():  # under torchrun every rank runs the diff; rank 0 writes it
            raise typer.Exit(1 if report.failed else 0)
        emit(rendered(report, fmt_, dest), dest)
        if report.failed:
            if fmt_ != Format.table or to_file(dest):
                said = [f"failed: {why}" for why in report.token_failures]
                if report.first_over is not None:
                    said.insert(0, f"first past tolerance: {report.first_over}")
                err("; ".join(said))
            raise typer.Exit(1)


# what a diff of two saved reports reads: the two files, how to compare and where to write
_SAVED_DIFF = frozenset({"model", "inputs", "tol", "sort", "fmt", "output", "config", "no_config"})


def _nothing_to_run(ctx: typer.Context) -> None:
    """Two saved reports are compared as they are: an option given on the command line that
    runs or shapes a model's pass (--b, --weights, -l, --seed …) would be ignored, so it is
    refused (the project config's values are not the user's words for this run)."""
    given = opt.given_flags(ctx, lambda name: name not in _SAVED_DIFF)
    if given:
        raise UsageError(
            f"two saved reports are compared as they were written: {', '.join(given)} "
            f"{'runs' if len(given) == 1 else 'run'} a model, and would be ignored.",
            f"drop {'it' if len(given) == 1 else 'them'}, or diff the model itself: "
            "hookcli diff MODEL INPUT --b SIDE …",
        )
