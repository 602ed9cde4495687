"""`hookcli lens`: the logit lens of a language model over a text."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

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
from hookcli.options import DEFAULTS
from hookcli.render.writers import Kind

if TYPE_CHECKING:
    from hookcli.io.output import Destination
    from hookcli.records import LensReport


def lens(
    ctx: typer.Context,
    model: opt.ModelArg = None,
    text: opt.TextOpt = None,
    text_file: opt.TextFileOpt = None,
    chat: opt.ChatOpt = DEFAULTS.inputs.chat,
    padding_side: opt.PaddingSideOpt = None,
    tokenizer: opt.TokenizerOpt = None,
    target_text: opt.TargetTextOpt = None,
    input_spec: opt.InputSpecOpt = None,
    topk: Annotated[
        int, typer.Option("--topk", "-k", help="Tokens kept per block and position.")
    ] = DEFAULTS.lens.topk,
    blocks: Annotated[
        str | None,
        typer.Option(
            "--blocks",
            metavar="GLOB",
            help="The blocks whose outputs are read [default: the model's decoder layers].",
        ),
    ] = None,
    norm: Annotated[
        str | None,
        typer.Option(
            "--norm",
            metavar="MODULE|none",
            help="The final norm applied first [default: the model's own, found after its blocks].",
        ),
    ] = None,
    unembed: Annotated[
        str | None,
        typer.Option(
            "--unembed",
            metavar="MODULE",
            help="The unembedding [default: the model's output embeddings, lm_head].",
        ),
    ] = None,
    head: opt.HeadOpt = None,
    weights: opt.WeightsOpt = DEFAULTS.model.weights,
    seed: opt.SeedOpt = DEFAULTS.model.seed,
    device: opt.DeviceOpt = DEFAULTS.model.device,
    model_arg: opt.ModelArgOpt = None,
    tp: opt.TpOpt = False,
    fmt: opt.FormatOpt = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FILE",
            help="Write to FILE (lens.png: a blocks x positions grid of top-1 tokens per "
            "sequence, with a colour bar; .json, .csv, .html, .md by suffix); - is stdout.",
        ),
    ] = None,
    force: opt.ForceOpt = False,
    config: opt.ConfigOpt = None,
    no_config: opt.NoConfigOpt = False,
) -> None:
    """The logit lens: each block's output through the model's own final norm and
    unembedding, the top tokens of every position of every block.

    Example: hookcli lens hf:./tiny-llama --text "The cat sat on the" -o lens.png
    """
    with handled():
        p, used = opt.configured(ctx)
        if used:
            err(f"config: {used}")
        reads = opt.reads(p, used)
        raw = p.get("output")
        png = raw is not None and str(raw).lower().endswith(".png")
        dest = claim(raw, "-o", suffix=".png", reads=reads) if png else claim(raw, reads=reads)
        form = None if png else output_format(p["fmt"], dest, kind=Kind.lens)
        from hookcli.commands.lens import lens_report
        from hookcli.options import LensOptions, pick

        model_opts = opt.model_options(p, "lens")
        options = pick(LensOptions, p)
        with status(f"running {model_opts.model}…"):
            report = lens_report(model_opts, opt.input_options(p), options)
        if png:
            _write_png(report, dest)
        else:
            assert form is not None
            emit(rendered(report, form, dest), dest)
        if png or (dest is not None and to_file(dest)):
            for note in report.notes:
                err(f"note: {note}")


def _write_png(report: LensReport, dest: Destination | None) -> None:
    from hookcli.io.output import write_with
    from hookcli.render.images import png_bytes_info
    from hookcli.render.lens import lens_png

    assert dest is not None
    image, meta = lens_png(report)
    info = png_bytes_info(meta)
    write_with(dest, lambda tmp: image.save(tmp, format="PNG", optimize=True, pnginfo=info))
    if dest.path is not None:
        err(f"wrote {dest.label} ({image.width}x{image.height})")
    for note in meta["notes"]:
        err(f"note: {note}")
