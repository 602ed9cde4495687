"""What inspect, grads, check, maps, cam and attn compute: the one path the Python API
(`hookcli.inspect`, `grads`, `check`, `maps`, `cam`, `attn`) and the CLI commands both take.

The CLI parses its options into the option objects (options.py, checks.Rules), calls one
function here and renders or writes what it returns; the Python API turns keyword arguments
into the same objects (`api_report`, `picture_options`). Command rules live here and nowhere
else: check's default rule, when backward runs, no predictions and deterministic algorithms
for check, the layers --expect-shape names, and whether an image run is a folder run.

No torch at import: the engine, the dataset and the pictures are imported on use.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hookcli.commands.checks import Rules, evaluate, for_check, parse_rules
from hookcli.options import (
    API_KEYS,
    AttnOptions,
    BackwardOptions,
    Batching,
    CamOptions,
    InputOptions,
    Invocation,
    MapOptions,
    ModelOptions,
    RuleOptions,
    field_names,
    pick,
)
from hookcli.records import Report

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

    from hookcli.commands.pictures import Picture
    from hookcli.io.output import Destination
    from hookcli.render.html import EmbeddedPicture

COMMANDS = ("inspect", "grads", "check")
Progress = Callable[[int, int], None]  # (images done, images in all) of a folder run
# Entered around the model's run, told whether it is a folder run; yields a progress callback
# for folder runs (or None). The CLI's spinner and progress bar; the API passes none.
Running = Callable[[bool], AbstractContextManager[Progress | None]]

# Keyword arguments of the Python API beyond Invocation.from_api's, by command: the fields
# of the option objects they fill
RULE_KEYS = field_names(RuleOptions)
INSPECT_RULE_KEYS = ("fail_on", "dead_frac")  # --fail-on works on inspect and grads too
BATCH_KEYS = field_names(Batching)  # folder runs (check: no --per-image)
PICTURE_KEYS = (
    "weights", "seed", "device", "model_args", "output_key", "input_specs", "strict", "text",
    "text_file", "chat", "tokenizer", "head",
)  # fmt: skip


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
    from hookcli.commands.folder import folder_options, folder_report
    from hookcli.commands.inspect import report as inspection

    if command not in COMMANDS:
        raise ValueError(f"command must be one of {', '.join(COMMANDS)}, not {command!r}")
    rules = rules if rules is not None else Rules()
    if command == "check":
        rules = for_check(rules)
    inv = command_invocation(command, inv, rules)
    folder = folder_options(inv, batching)
    context = running(folder is not None) if running is not None else contextlib.nullcontext()
    with context as progress:
        if folder is not None:
            report = folder_report(inv, folder, progress)
        else:
            report = inspection(inv, "grads" if inv.backward is not None else "inspect")
    report.command = command
    report.checks = evaluate(report, rules)
    return report


def command_invocation(command: str, inv: Invocation, rules: Rules) -> Invocation:
    """What the command adds to what was asked: backward for grads, and for check when asked
    or a gradient rule needs it (target and loss apply then); --expect-shape's layers hooked
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
    return dataclasses.replace(inv, selection=selection, run=run, backward=backward)


def api_report(command: str, model: Any, inputs: Any, options: Mapping[str, Any]) -> Report:
    """hookcli.inspect/grads/check: keyword arguments → the option objects → run_command."""
    rule_keys = RULE_KEYS if command == "check" else INSPECT_RULE_KEYS
    allowed = {*API_KEYS, *rule_keys, *BATCH_KEYS}
    if command == "check":
        allowed -= {"topk", "per_image"}  # check makes no predictions
    for key in options:
        if key not in allowed:
            raise TypeError(
                f"unexpected option {key!r} for {command}; options are: "
                + ", ".join(sorted(allowed))
            )
    given = dict(options)
    rule_options = {k: given.pop(k) for k in rule_keys if k in given}
    batching = pick(Batching, {k: given.pop(k) for k in BATCH_KEYS if k in given})
    inv = Invocation.from_api(model, inputs, given, backward=command != "inspect")
    if inv.run.save is not None:
        from hookcli.io.output import claim

        save = claim(inv.run.save, "save", suffix=".safetensors", stdout_ok=False)
        inv = dataclasses.replace(inv, run=dataclasses.replace(inv.run, save=save))
    return run_command(command, inv, rules_from_api(rule_options), batching=batching)


def rules_from_api(options: Mapping[str, Any]) -> Rules:
    """The check options of the Python API, in the CLI's forms or Python's: fail_on="dead" or
    a list; grad_norm "MIN:MAX" or (min, max) with None for no bound; expect_shape
    "LAYER=1x64x112x112", a list of those, or {layer: (1, 64, 112, 112)}."""
    given = dict(options)
    if isinstance(given.get("fail_on"), str):
        given["fail_on"] = [given["fail_on"]]
    grad_norm = given.get("grad_norm")
    if isinstance(grad_norm, tuple):
        given["grad_norm"] = ":".join("" if v is None else repr(float(v)) for v in grad_norm)
    shapes = given.get("expect_shape")
    if isinstance(shapes, str):
        given["expect_shape"] = [shapes]
    elif isinstance(shapes, Mapping):
        given["expect_shape"] = [
            f"{layer}={shape if isinstance(shape, str) else 'x'.join(map(str, shape))}"
            for layer, shape in shapes.items()
        ]
    elif shapes is not None:
        given["expect_shape"] = list(shapes)
    if given.get("baseline") is not None:
        given["baseline"] = Path(given["baseline"])
    return parse_rules(pick(RuleOptions, given))


# ---------------------------------------------------------------- pictures


@dataclass(slots=True)
class Drawing:
    """A picture as `hookcli maps`/`cam`/`attn` write it: `image` is the PNG's PIL image,
    `picture` the arrays and words it was drawn from (pictures.Picture: `tiles`, `heat`, `raw`,
    `rollout`, `labels`, `legend`, `title`, `notes`), `metadata` the PNG's `hookcli` text
    chunk."""

    image: Image.Image
    picture: Picture
    metadata: dict[str, Any]

    @property
    def layer(self) -> str:
        """The layer drawn (for cam without `layer=`, the one chosen)."""
        return self.picture.layer

    @property
    def call(self) -> int:
        return self.picture.call

    @property
    def raw(self) -> np.ndarray[Any, np.dtype[np.float32]] | None:
        """`--save-raw`'s data. cam: the heat map before scaling (float32, input resolution);
        attn: the block's attention probabilities (float32, batch x heads x tokens x tokens)."""
        return self.picture.raw

    @property
    def rollout(self) -> np.ndarray[Any, np.dtype[np.float32]] | None:
        """attn: the attention rollout over every block (float32, batch x tokens x tokens)."""
        return self.picture.rollout

    @property
    def heat(self) -> np.ndarray[Any, np.dtype[np.float32]] | None:
        """cam: the heat map scaled to [0, 1], as drawn."""
        return self.picture.heat

    @property
    def notes(self) -> list[str]:
        return self.picture.notes

    def write(self, dest: Destination) -> None:
        """Into a claimed output (hookcli.io.output's policy), with the metadata chunk."""
        from hookcli.io.output import write_with
        from hookcli.render.images import png_bytes_info

        info = png_bytes_info(self.metadata)

        def fill(tmp: str) -> None:
            self.image.save(tmp, format="PNG", optimize=True, pnginfo=info)

        write_with(dest, fill)

    def embedded(self, command: str = "") -> EmbeddedPicture:
        """This picture as an HTML report embeds it (`-f html --picture`, `hookcli.html(report,
        pictures=[...])`): lossless PNG within a picture's share of the page's budget, else
        WebP, said in its notes."""
        from hookcli.render.html import EmbeddedPicture, embed_image

        data, mime, note = embed_image(self.image)
        return EmbeddedPicture(
            title=self.picture.title,
            data=data,
            width=self.image.width,
            height=self.image.height,
            mime=mime,
            command=command,
            notes=[*self.notes, *([note] if note else [])],
        )

    def save(self, path: str | Path) -> None:
        """The PNG the CLI writes, at path (replaced atomically)."""
        from hookcli.io.output import claim

        dest = claim(path, "save", suffix=".png", stdout_ok=False)
        assert dest is not None
        self.write(dest)


def maps(model: ModelOptions, inputs: InputOptions, options: MapOptions) -> Drawing:
    """One layer call's output channels as a labelled grid beside the input."""
    from hookcli.commands.pictures import feature_maps
    from hookcli.render.images import maps_png

    picture = feature_maps(model, inputs, options)
    image, metadata = maps_png(picture)
    return Drawing(image, picture, metadata)


def cam(
    model: ModelOptions,
    inputs: InputOptions,
    backward: BackwardOptions = BackwardOptions(),
    options: CamOptions = CamOptions(),
) -> Drawing:
    """Grad-CAM (or Grad-CAM++) of one image for a target, over the image."""
    from hookcli.commands.pictures import class_activation
    from hookcli.render.images import cam_png

    picture = class_activation(model, inputs, backward, options)
    image, metadata = cam_png(picture)
    return Drawing(image, picture, metadata)


def attn(
    model: ModelOptions, inputs: InputOptions, options: AttnOptions = AttnOptions()
) -> Drawing:
    """One block's per-head attention probabilities and the rollout over every block, over
    the image (or as token x token matrices)."""
    from hookcli.commands.attention import attention_maps
    from hookcli.render.images import attn_png

    picture = attention_maps(model, inputs, options)
    image, metadata = attn_png(picture)
    return Drawing(image, picture, metadata)


def picture_options(
    model: Any, inputs: Any, options: Mapping[str, Any], command: str
) -> tuple[ModelOptions, InputOptions]:
    """hookcli.maps/cam/attn's model and input keyword arguments → option objects."""
    for key in options:
        if key not in PICTURE_KEYS:
            raise TypeError(
                f"unexpected option {key!r} for {command}; options are: "
                + ", ".join(sorted(PICTURE_KEYS))
            )
    inv = Invocation.from_api(model, inputs, options, backward=False)
    return inv.model, inv.inputs
