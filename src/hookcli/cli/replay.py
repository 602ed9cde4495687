"""`hookcli replay BUNDLE`: a training step saved by hookcli.watch, run again with hooks on."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hookcli.cli import params as opt
from hookcli.cli.console import claim, emit, err, handled, output_format, rendered, status, to_file
from hookcli.render import Format
from hookcli.render.writers import Kind


def replay(
    bundle: Annotated[
        Path,
        typer.Argument(
            help="The directory hookcli.watch wrote on the first NaN/Inf (e.g. run.bundle)."
        ),
    ],
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            metavar="MODEL",
            help="Build the model from MODEL (file.py:Name, a registry name…) and load the "
            "bundle's state into it (nothing in the bundle is unpickled).",
        ),
    ] = None,
    unpickle: Annotated[
        bool,
        typer.Option(
            "--unpickle",
            help="Unpickle the bundle's model.pt (and any Python objects in its batch) instead "
            "of --model: this runs code from the bundle; only for bundles you wrote yourself.",
        ),
    ] = False,
    model_arg: opt.ModelArgOpt = None,
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            metavar="cpu|cuda[:N]|mps|auto",
            help="Where to run [default: the step's own device when present, else cpu].",
            show_default=False,
        ),
    ] = None,
    layer: opt.LayerOpt = None,
    type_: opt.TypeOpt = None,
    fmt: opt.FormatOpt = None,
    output: opt.OutputOpt = None,
) -> None:
    """Re-run a training step saved by hookcli.watch and name where NaN/Inf began.

    The step runs again from its own weights, buffers, batch, RNG state and autocast, with
    backward from the gradients its loss gave the model's outputs; the report is grads'
    (every selected call, default: the layers the watch had) with the non-finite origin.
    Exit 0 when the origin is the one the recorder logged, 1 when not. The model comes from
    --model (the bundle's state loaded into it) or, with --unpickle, from the bundle's own
    pickle, which runs code: unpickle only bundles you wrote.

    Example: hookcli replay run.bundle --model train.py:Net --device cpu
    """
    with handled():
        from hookcli.commands.watch import BUNDLE_FILES, PICKLED_MODEL

        parts = [str(bundle / name) for name in (*BUNDLE_FILES, PICKLED_MODEL)]
        dest = claim(output, reads=[str(bundle), *parts])
        form = output_format(fmt, dest, kind=Kind.report)
        from hookcli.commands.checks import exit_code, failures
        from hookcli.commands.watch.replay import replay as run
        from hookcli.sources import parse_model_args

        with status(f"replaying {bundle}…"):
            report = run(
                bundle,
                model=model,
                model_args=parse_model_args(model_arg or []),
                device=device,
                layers=tuple(layer or ()),
                types=tuple(type_ or ()),
                unpickle=unpickle,
            )
        emit(rendered(report, form, dest), dest)
        if form != Format.table or to_file(dest):
            for c in failures(report):
                err(f"check failed: {c.rule}: {c.message}")
        code = exit_code(report)
        if code:
            raise typer.Exit(code)
