"""maps, cam and attn: one layer call (attn: one attention block) drawn as a PNG
(hookcli.commands.maps / cam / attn)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hookcli.cli import params as opt
from hookcli.cli.console import claim, emit, err, handled, status
from hookcli.errors import UsageError
from hookcli.options import DEFAULTS
from hookcli.render import Format

if TYPE_CHECKING:
    from hookcli.commands import Drawing
    from hookcli.io.output import Destination
    from hookcli.options import InputOptions, ModelOptions
    from hookcli.render.html import EmbeddedPicture

PngOpt = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        metavar="FILE.png",
        help="The PNG to write (required).",
        show_default=False,
    ),
]
CallOpt = Annotated[int, typer.Option("--call", help="Which call of a reused module.")]
ImageOpt = Annotated[int, typer.Option("--image", help="Which image of the batch.")]


def maps(
    ctx: typer.Context,
    model: opt.ModelArg = None,
    inputs: opt.InputsArg = None,
    layer: Annotated[
        list[str] | None,
        typer.Option("--layer", "-l", metavar="LAYER", help="The layer to draw (one)."),
    ] = None,
    output: PngOpt = None,
    channels: Annotated[
        int, typer.Option("--channels", help="How many channels to draw.")
    ] = DEFAULTS.maps.channels,
    order: Annotated[
        str,
        typer.Option("--order", metavar="activity|index", help="Most active first, or by index."),
    ] = DEFAULTS.maps.order,
    call: CallOpt = DEFAULTS.maps.call,
    image_index: ImageOpt = DEFAULTS.maps.image_index,
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
    force: opt.ForceOpt = False,
    config: opt.ConfigOpt = None,
    no_config: opt.NoConfigOpt = False,
) -> None:
    """Draw one layer call's output channels as a labelled grid beside the input image (PNG).

    Example: hookcli maps resnet18 sample_images/cat.jpeg -l conv1 -o maps.png
    """
    with handled():
        p, used = opt.configured(ctx)
        if used:
            err(f"config: {used}")
        out = _png_output(p, opt.reads(p, used))
        from hookcli.options import MapOptions, need_layer, pick

        options = pick(MapOptions, p, layer=need_layer(opt.single_layer(p)))
        from hookcli import commands

        model_opts = opt.model_options(p, "maps")
        name = str(model_opts.model)
        with status(f"running {name}…"):
            drawing = commands.maps(model_opts, opt.input_options(p), options)
        _save_png(out, drawing)
        for note in drawing.notes:
            err(f"note: {note}")


def cam(
    ctx: typer.Context,
    model: opt.ModelArg = None,
    inputs: opt.InputsArg = None,
    layer: Annotated[
        list[str] | None,
        typer.Option(
            "--layer",
            "-l",
            metavar="LAYER",
            help="The layer [default: the last layer over the image the target reaches, stated].",
        ),
    ] = None,
    output: PngOpt = None,
    target: opt.TargetOpt = None,
    loss: opt.LossOpt = None,
    method: Annotated[
        str, typer.Option("--method", metavar="gradcam|gradcam++", help="CAM weighting.")
    ] = DEFAULTS.cam.method,
    save_raw: Annotated[
        Path | None,
        typer.Option(
            "--save-raw",
            metavar="FILE.npy",
            help="Also save the raw heat map (float32, input resolution).",
        ),
    ] = None,
    call: CallOpt = DEFAULTS.cam.call,
    image_index: ImageOpt = DEFAULTS.cam.image_index,
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
    output_key: opt.OutputKeyOpt = None,
    force: opt.ForceOpt = False,
    config: opt.ConfigOpt = None,
    no_config: opt.NoConfigOpt = False,
) -> None:
    """Grad-CAM heat map of one layer for a target, overlaid on the image (PNG).

    Example: hookcli cam resnet50 sample_images/cat.jpeg --weights DEFAULT -o cam.png
    """
    from hookcli import commands
    from hookcli.options import BackwardOptions, CamOptions, pick

    def draw(model_opts: ModelOptions, p: dict[str, Any]) -> Drawing:
        options = pick(CamOptions, p, layer=opt.single_layer(p))
        return commands.cam(model_opts, opt.input_options(p), pick(BackwardOptions, p), options)

    _draw_with_raw(ctx, "cam", draw)


def attn(
    ctx: typer.Context,
    model: opt.ModelArg = None,
    inputs: opt.InputsArg = None,
    layer: Annotated[
        list[str] | None,
        typer.Option(
            "--layer",
            "-l",
            metavar="BLOCK",
            help="The attention block: dotted name or glob (blocks.3, "
            "encoder.layers.encoder_layer_3; an encoder-decoder's cross-attention, "
            "model.decoder.layers.0.encoder_attn) [default: the last block; an "
            "encoder-decoder's: its encoder's last].",
        ),
    ] = None,
    output: PngOpt = None,
    save_raw: Annotated[
        Path | None,
        typer.Option(
            "--save-raw",
            metavar="FILE.npy",
            help="Also save the block's attention probabilities (float32, "
            "batch x heads x tokens x tokens).",
        ),
    ] = None,
    image_index: ImageOpt = DEFAULTS.attn.image_index,
    input_spec: opt.InputSpecOpt = None,
    text: opt.TextOpt = None,
    text_file: opt.TextFileOpt = None,
    chat: opt.ChatOpt = DEFAULTS.inputs.chat,
    padding_side: opt.PaddingSideOpt = None,
    target_text: opt.TargetTextOpt = None,
    tokenizer: opt.TokenizerOpt = None,
    head: opt.HeadOpt = None,
    queries: opt.QueriesOpt = None,
    weights: opt.WeightsOpt = DEFAULTS.model.weights,
    seed: opt.SeedOpt = DEFAULTS.model.seed,
    device: opt.DeviceOpt = DEFAULTS.model.device,
    model_arg: opt.ModelArgOpt = None,
    fmt: Annotated[
        Format | None,
        typer.Option(
            "--format",
            "-f",
            help="json: no picture; every attention head of every block in numbers (sink, "
            "entropy, most-attended key), to -o FILE.json or stdout.",
            show_default=False,
        ),
    ] = None,
    force: opt.ForceOpt = False,
    config: opt.ConfigOpt = None,
    no_config: opt.NoConfigOpt = False,
) -> None:
    """Per-head attention of one transformer block and the attention rollout over all blocks,
    over the image (token x token matrices for text models) (PNG); with -f json, every head
    of every block in numbers.

    Example: hookcli attn vit_b_16 sample_images/cat.jpeg -o attn.png
    """
    raw = ctx.params.get("output")
    if ctx.params.get("fmt") is not None or (raw is not None and str(raw).endswith(".json")):
        _heads_json(ctx)
        return
    from hookcli import commands
    from hookcli.options import AttnOptions, pick

    def draw(model_opts: ModelOptions, p: dict[str, Any]) -> Drawing:
        options = pick(AttnOptions, p, layer=opt.single_layer(p))
        return commands.attn(model_opts, opt.input_options(p), options)

    _draw_with_raw(ctx, "attn", draw)


def _heads_json(ctx: typer.Context) -> None:
    """attn -f json: every attention call's heads (commands.heads), as JSON."""
    with handled():
        p, used = opt.configured(ctx)
        if p.get("fmt") not in (None, Format.json):
            raise UsageError(
                f"attn writes a PNG, or its heads as JSON; not {p['fmt'].value}.",
                "use -f json (or -o FILE.json), or -o FILE.png.",
            )
        for name, flag in (("save_raw", "--save-raw"), ("queries", "--queries"),
                           ("image_index", "--image")):  # fmt: skip
            if opt.given(ctx, name):
                raise UsageError(
                    f"{flag} is for the drawing; -f json gives every head's numbers.",
                    f"drop {flag}, or draw with -o FILE.png.",
                )
        reads = opt.reads(p, used)
        dest = claim(p["output"], reads=reads)
        from hookcli.commands.heads import heads_data
        from hookcli.render.json import data_json

        model_opts = opt.model_options(p, "attn")
        with status(f"running {model_opts.model}…"):
            data = heads_data(model_opts, opt.input_options(p), opt.single_layer(p))
        emit(data_json(data), dest)


def _draw_with_raw(
    ctx: typer.Context, command: str, draw: Callable[[ModelOptions, dict[str, Any]], Drawing]
) -> None:
    """cam and attn: the PNG and --save-raw claimed first (no half-written file on error),
    the drawing made, both written, its notes on stderr."""
    with handled():
        p, used = opt.configured(ctx)
        if used:
            err(f"config: {used}")
        reads = opt.reads(p, used)
        out = _png_output(p, reads)
        raw_out = claim(p["save_raw"], "--save-raw", suffix=".npy", stdout_ok=False, reads=reads)
        model_opts = opt.model_options(p, command)
        with status(f"running {model_opts.model}…"):
            drawing = draw(model_opts, p)
        _save_png(out, drawing)
        if raw_out is not None:
            _save_raw(raw_out, drawing)
        for note in drawing.notes:
            err(f"note: {note}")


def _png_output(p: dict[str, Any], reads: list[str]) -> Destination | None:
    if p["output"] is None:
        raise UsageError("-o FILE.png is required.", "e.g. -o out.png (or -o - for stdout)")
    return claim(p["output"], "-o", suffix=".png", reads=reads)


def _save_png(dest: Destination | None, drawing: Drawing) -> None:
    assert dest is not None
    drawing.write(dest)
    if dest.path is not None:
        err(f"wrote {dest.label} ({drawing.image.width}x{drawing.image.height})")


def _save_raw(dest: Destination, drawing: Drawing) -> None:
    import numpy as np

    from hookcli.io.output import write_with

    raw = drawing.raw
    assert raw is not None

    def save_npy(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a handle: np.save(path) would append ".npy"
            np.save(f, raw)

    write_with(dest, save_npy)
    err(f"wrote {dest.label}")


# ------------------------------------------------------------------ pictures in an HTML report

PICTURE_KINDS = ("maps", "cam", "attn")
REPORT_CHANNELS = 16  # a report's feature maps: the most active 16 (hookcli maps draws 64)


def parse_pictures(specs: list[str] | None, fmt: str) -> list[tuple[str, str | None]]:
    """--picture KIND[:LAYER], checked before any work: (kind, layer or None)."""
    if not specs:
        return []
    if fmt != "html":
        raise UsageError(
            f"--picture embeds a picture in an HTML report; this output is {fmt}.",
            "add -o report.html (or -f html), or draw it alone: hookcli maps|cam|attn … -o "
            "FILE.png",
        )
    out: list[tuple[str, str | None]] = []
    for spec in specs:
        kind, _, layer = spec.partition(":")
        kind = kind.strip().lower()
        if kind not in PICTURE_KINDS:
            raise UsageError(
                f"--picture {spec}: {kind or 'nothing'} is not a kind of picture.",
                "give maps:LAYER, cam[:LAYER] or attn[:BLOCK].",
            )
        if kind == "maps" and not layer:
            raise UsageError(
                f"--picture {spec}: maps needs a layer.",
                "e.g. --picture maps:conv1; `hookcli layers MODEL` lists them.",
            )
        out.append((kind, layer or None))
    return out


def draw_pictures(
    specs: list[tuple[str, str | None]],
    model_opts: ModelOptions,
    inputs: InputOptions,
    p: dict[str, Any],
) -> list[EmbeddedPicture]:
    """Each picture as its own command draws it (the model and input of this run; cam from
    this run's --target/--loss), as bytes to embed. A folder run's pictures are of its first
    image: the picture commands take one batch."""
    from dataclasses import replace

    from hookcli.inputs.images import TooLargeToResize, expand_paths, try_read

    shown = list(inputs.items)
    first: list[str] = []
    # a folder's files the run could use, in order: an unreadable one, or one its resize would
    # blow up, a folder run skips (and names) and is no picture's input (--strict: the run
    # refuses it, and so would this); the first that can be drawn is drawn (read one by one
    # as needed: a folder of thousands is not decoded to pick its first)
    files = (
        expand_paths([str(x) for x in shown])
        if shown and all(isinstance(x, str) for x in shown)
        else []
    )
    if len(files) > 1:
        readable = (f for f in files if inputs.strict or try_read(f)[0] is not None)
        at = next(readable, files[0])
    if p.get("train"):  # (the picture commands have no --train: said, not left to be guessed)
        first.append("drawn in eval mode: the picture commands run the model as it predicts")
    pictures = []
    for kind, layer in specs:
        while len(files) > 1:  # (the first picture picks the image: the others follow it)
            one = replace(inputs, items=(str(at.path),))
            try:
                drawing = _drawing(kind, layer, model_opts, one, p)
            except TooLargeToResize:
                after = next(readable, None)
                if inputs.strict or after is None:
                    raise
                at = after
                continue
            first.insert(0, f"drawn on the first image it could use, {at.name}")
            inputs, shown, files = one, [str(at.path)], []
            break
        else:
            drawing = _drawing(kind, layer, model_opts, inputs, p)
        which = "block" if kind == "attn" else "layer"
        picture = drawing.embedded(_command(kind, drawing.layer, shown, p))
        title = (
            f"{kind}: {which} {drawing.layer}"
            + (f", call {drawing.call}" if kind != "attn" else "")
            + (f" ({REPORT_CHANNELS} most active channels)" if kind == "maps" else "")
        )
        notes = [*drawing.notes, *first, *picture.notes[len(drawing.notes) :]]
        pictures.append(dataclasses.replace(picture, title=title, notes=notes))
    return pictures


def _drawing(
    kind: str, layer: str | None, model_opts: ModelOptions, inputs: InputOptions, p: dict[str, Any]
) -> Any:
    """One picture as its command draws it (maps, cam or attn)."""
    from hookcli import commands
    from hookcli.inputs.images import TooLargeToResize
    from hookcli.options import AttnOptions, BackwardOptions, CamOptions, MapOptions, pick

    if kind == "maps":
        return commands.maps(model_opts, inputs, MapOptions(layer=layer, channels=REPORT_CHANNELS))
    if kind == "cam":
        backward = pick(BackwardOptions, p, input_grad=False)
        try:
            return commands.cam(model_opts, inputs, backward, CamOptions(layer=layer))
        except TooLargeToResize:
            raise
        except UsageError as exc:
            if "target" in p:
                raise
            raise UsageError(  # inspect has no --target/--loss to follow the hint with
                f"--picture cam: {exc.message}",
                "embed it from grads or check, where --target and --loss say what the "
                "map explains.",
            ) from exc
    return commands.attn(model_opts, inputs, AttnOptions(layer=layer))


def _command(kind: str, layer: str, inputs: list[Any], p: dict[str, Any]) -> str:
    """The command that draws the picture alone, quoted for a shell."""
    import shlex

    words = ["hookcli", kind, str(p.get("model")), *(str(x) for x in inputs)]
    for spec in p.get("input_spec") or ():
        words += ["--input", spec]
    words += ["-l", layer]
    if kind == "maps":
        words += ["--channels", str(REPORT_CHANNELS)]
    options = ["weights", "seed", "device", *(("target", "loss") if kind == "cam" else ())]
    for name in options:
        value = p.get(name)
        if value is not None and value != getattr(DEFAULTS.model, name, None):
            words += [f"--{name}", str(value)]
    for arg in p.get("model_arg") or ():
        words += ["--model-arg", arg]
    return shlex.join([*words, "-o", f"{kind}.png"])
