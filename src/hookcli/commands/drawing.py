"""maps, cam and attn: a picture of one layer (or block), as the CLI writes it and the Python
API returns it (a Drawing), and the API's keyword arguments for them. No torch at import."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hookcli.options import (
    AttnOptions,
    BackwardOptions,
    CamOptions,
    InputOptions,
    Invocation,
    MapOptions,
    ModelOptions,
)

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

    from hookcli.commands.pictures import Picture
    from hookcli.io.output import Destination
    from hookcli.render.html import EmbeddedPicture

PICTURE_KEYS = (
    "weights", "seed", "device", "model_args", "output_key", "input_specs", "strict", "text",
    "text_file", "chat", "target_text", "tokenizer", "head",
)  # fmt: skip


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
