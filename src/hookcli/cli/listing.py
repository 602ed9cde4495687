"""models, layers and show: what there is to hook, and what a saved file holds."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from hookcli.cli import params as opt
from hookcli.cli.console import (
    ListFormat,
    claim,
    emit_listing,
    err,
    handled,
    listing_format,
    status,
)
from hookcli.options import DEFAULTS

ListFormatOpt = Annotated[
    ListFormat | None,
    typer.Option(
        "--format",
        "-f",
        help="Output format: a table, or JSON (default: from -o FILE.json, else a table).",
        show_default=False,
    ),
]


class ModelSource(StrEnum):
    torchvision = "torchvision"
    timm = "timm"
    hf = "hf"


class Task(StrEnum):
    classification = "classification"
    segmentation = "segmentation"
    detection = "detection"
    video = "video"
    optical_flow = "optical_flow"
    quantized = "quantized"


def models(
    pattern: Annotated[
        str | None,
        typer.Argument(
            metavar="[GLOB]", help="Glob on model names, e.g. 'resnet*'.", show_default=False
        ),
    ] = None,
    task: Annotated[Task | None, typer.Option("--task", help="Only this task.")] = None,
    source: Annotated[
        ModelSource,
        typer.Option(
            "--source",
            help="Whose registry: torchvision's, timm's (hookcli[timm]) or the Hugging Face "
            "model types with a classification head (hookcli[hf]).",
        ),
    ] = ModelSource.torchvision,
    fmt: ListFormatOpt = None,
    output: opt.OutputOpt = None,
) -> None:
    """List models with their task, size and weights: torchvision's registry, timm's, or the
    Hugging Face model types.

    Example: hookcli models 'resnet*' --task classification; hookcli models --source timm 'vit*'
    """
    with handled():
        dest = claim(output)
        fmt = listing_format(fmt, dest)
        from hookcli.commands.listing import list_models

        entries = list_models(pattern, task.value if task else None, source.value)
        emit_listing(entries, fmt, dest, "models_table")


def layers(
    ctx: typer.Context,
    model: opt.ModelArg = None,
    inputs: opt.InputsArg = None,
    shapes: Annotated[
        bool, typer.Option("--shapes", help="Run one forward to add output shapes.")
    ] = False,
    meta: Annotated[
        bool,
        typer.Option(
            "--meta",
            help="Build the model on the meta device and run its forward there: shapes, "
            "parameter counts and FLOPs with no weight read or allocated (any size).",
        ),
    ] = False,
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
    fmt: ListFormatOpt = None,
    output: opt.OutputOpt = None,
    config: opt.ConfigOpt = None,
    no_config: opt.NoConfigOpt = False,
) -> None:
    """Show the module tree: dotted names, types, parameter counts and aliases.

    Example: hookcli layers resnet18 --shapes --depth 2
    """
    with handled():
        p, used = opt.configured(ctx)
        if used:
            err(f"config: {used}")
        dest = claim(p["output"], reads=opt.reads(p, used))
        form = listing_format(p["fmt"], dest)
        from hookcli.commands.listing import layers_report

        model_opts = opt.model_options(p, "layers")
        name = str(model_opts.model)
        with status(f"loading {name}…"):
            report = layers_report(
                model_opts,
                opt.input_options(p),
                shapes=p["shapes"],
                depth=p["depth"],
            )
        emit_listing(report, form, dest, "layers_table")


def show(
    file: Annotated[Path, typer.Argument(help="A .safetensors file written by --save.")],
    fmt: ListFormatOpt = None,
    output: opt.OutputOpt = None,
) -> None:
    """List what a saved .safetensors file holds: keys, shapes, dtypes and statistics.

    Example: hookcli show run.safetensors
    """
    with handled():
        dest = claim(output, reads=[str(file)])
        fmt = listing_format(fmt, dest)
        from hookcli.commands.listing import show_file

        emit_listing(show_file(file), fmt, dest, "saved_table")
