"""INPUT → the arguments of the model's forward: positional ones, and keyword ones.

Image files (any PIL format, converted to RGB: grayscale, palette, RGBA composited on white,
16-bit scaled, CMYK converted, EXIF rotation applied), folders (every image in them), tensor
specs (`randn:1x3x224x224`, `rand:…`, `ones:2`, `zeros:…`, `randint:LOW:HIGH:SHAPE`,
`file.pt`, `file.npy`, a `:DTYPE` suffix on any, `NAME=SPEC` for a keyword argument), or
nothing: a deterministic random input of the shape the model expects.

images.py reads and preprocesses images, specs.py parses tensor specs; the model's Task turns
either into the forward's arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hookcli.errors import UsageError
from hookcli.inputs.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageFile,
    check_sizes,
    expand_paths,
    imagenet_preprocess,
    read_image,
    read_or_skip,
    resize_problem,
    short_side_resize,
    skip_or_raise,
    skipped_note,
    try_read,
)
from hookcli.inputs.specs import DTYPES, Spec, parse, parse_spec
from hookcli.records import TextInfo
from hookcli.sources import LoadedModel
from hookcli.tree import map_tensors

__all__ = [
    "DTYPES",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageFile",
    "ModelInput",
    "Spec",
    "default_input",
    "expand_paths",
    "from_images",
    "from_specs",
    "imagenet_preprocess",
    "parse",
    "parse_spec",
    "read_image",
    "read_or_skip",
    "resize_problem",
    "short_side_resize",
    "skip_or_raise",
    "skipped_note",
    "try_read",
]


@dataclass(slots=True)
class ModelInput:
    """The forward's arguments (`model(*args, **kwargs)`) and where they came from."""

    args: tuple[Any, ...]
    description: str
    sources: list[str] = field(default_factory=list)  # per image: path relative to its folder
    preprocessing: str | None = None
    classes: list[str | None] = field(default_factory=list)  # per image: its class folder
    skipped: list[tuple[str, str]] = field(default_factory=list)  # unreadable: (path, why)
    kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments (input_ids=…)
    texts: list[TextInfo] | None = None  # a text input: each sequence's real tokens
    # a padded text batch: True at real tokens, (batch, tokens); statistics of any tensor
    # whose leading dimensions are these leave the padding out. None: no padding
    token_mask: torch.Tensor | None = None
    # --generate: keyword arguments of model.generate (None: one forward, model(...))
    generate: dict[str, Any] | None = None
    # --target-text: a seq2seq model's target ids, -100 at padding (the teacher-forced loss's
    # labels, aligned with the decoder's logits)
    labels: torch.Tensor | None = None
    # a causal LM's text batch padded on the left: position_ids (in kwargs) made from the mask,
    # as model.generate makes them (generate, which makes its own, is not given these)
    positions_from_mask: bool = False

    def token_ids(self) -> torch.Tensor | None:
        """The forward's token ids (batch, tokens): its `input_ids` (a text model's one tensor
        of ids from Python is made them, as --input makes them: never a positional tensor,
        whose mask, if any, would be another positional one); None when there are none."""
        ids = self.kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point():
            return ids
        return None

    def replace_args(
        self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> ModelInput:
        return dataclasses.replace(
            self, args=args, kwargs=dict(self.kwargs if kwargs is None else kwargs)
        )

    def map(self, fn: Any) -> ModelInput:
        """Every tensor t (positional or keyword) replaced by fn(path, t); paths as hooks
        name the root's inputs (`in[0]`, `in["input_ids"]`)."""
        args = map_tensors(self.args, fn, "in")
        kwargs = map_tensors(self.kwargs, fn, "in")
        return self.replace_args(tuple(args), dict(kwargs))

    def forward_values(self) -> tuple[Any, ...]:
        """The positional arguments, then the keyword ones' values."""
        return (*self.args, *self.kwargs.values())

    def shapes(self) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        for a in self.forward_values():
            if isinstance(a, torch.Tensor):
                out.append(tuple(a.shape))
            elif isinstance(a, list):
                out.extend(tuple(t.shape) for t in a if isinstance(t, torch.Tensor))
        return out

    def to(self, device: torch.device) -> ModelInput:
        moved = self.map(lambda _path, t: t.to(device))
        if self.token_mask is not None:
            moved.token_mask = self.token_mask.to(device)
        return moved

    def copy(self) -> ModelInput:
        """Each tensor a copy of its own (for a pass whose forward may change its input in
        place)."""
        return self.map(lambda _path, t: t.clone())


def from_images(paths: Sequence[str], model: LoadedModel, *, strict: bool = False) -> ModelInput:
    skipped: list[tuple[str, str]] = []
    found = expand_paths(paths)
    read = [(f, read_or_skip(f, strict, skipped)) for f in found]
    files = [f for f, im in read if im is not None]
    images = [im for _, im in read if im is not None]
    if not files:
        raise UsageError(f"none of the {len(found)} images could be read.", "check the files.")
    model_input = _from_pil(files, images, model, strict, skipped)
    model_input.skipped = skipped
    return model_input


def _from_pil(
    files: list[ImageFile],
    images: list[Any],
    model: LoadedModel,
    strict: bool,
    skipped: list[tuple[str, str]],
) -> ModelInput:
    own = model.kind.images(images, model.preprocess)  # clips, frame pairs: the task's own
    if own is not None:
        args, suffix = own
        desc, sources, classes = _described(files)
        return ModelInput(args, desc + suffix, sources, model.preprocess_label, classes)
    preprocess, label = _preprocess(model)
    # one a resize would blow up (a 5000x1 strip): as an unreadable one, skipped in a folder
    files, images = check_sizes(files, images, short_side_resize(preprocess), strict, skipped)
    if not files:
        raise UsageError(
            f"none of the {len(skipped)} images can be used (unreadable, or too extreme an "
            "aspect ratio to resize).",
            "check the files.",
        )
    tensors = [preprocess(im) for im in images]
    desc, sources, classes = _described(files)
    if len(files) > 4:
        desc += f", … (+{len(files) - 4})"
    return ModelInput(model.kind.batch(tensors), desc, sources, label, classes)


def _described(files: list[ImageFile]) -> tuple[str, list[str], list[str | None]]:
    """The images' description (the first four names), each one's path and class folder."""
    desc = f"{len(files)} image{'s' if len(files) != 1 else ''}: " + ", ".join(
        f.path.name for f in files[:4]
    )
    return desc, [f.name for f in files], [f.folder_class for f in files]


def _preprocess(model: LoadedModel) -> tuple[Any, str | None]:
    """The model's own preprocessing and its label, else ImageNet's at its input size."""
    if model.preprocess is not None:
        return model.preprocess, model.preprocess_label
    size = model.input_size or (224, 224)
    preprocess = imagenet_preprocess(size)
    label = (
        f"ImageNet: resize {short_side_resize(preprocess)}, center crop {size[0]}x{size[1]}"
        ", ImageNet mean/std"
    )
    return preprocess, label


def from_specs(specs: Sequence[str], seed: int, model: LoadedModel) -> ModelInput:
    """--input values → the forward's arguments, through the model's Task (an HF text model
    takes bare token ids as `input_ids` with an all-ones `attention_mask`)."""
    positional: list[torch.Tensor] = []
    named: dict[str, torch.Tensor] = {}
    for i, raw in enumerate(specs):
        spec = parse(raw, (seed + i) % 2**64)  # torch seeds wrap at 2**64
        if spec.name is None:
            positional.extend(spec.tensors)
        elif spec.name in named:
            raise UsageError(
                f"--input names the keyword {spec.name!r} twice.", "give each keyword once."
            )
        else:
            named[spec.name] = spec.tensors[0]
    args, kwargs, note = model.kind.spec_inputs(positional, named)
    if not model.kind.takes_images and isinstance(ids := kwargs.get("input_ids"), torch.Tensor):
        from hookcli.inputs.tokenids import check_token_ids

        check_token_ids(model, ids, f"--input's input_ids {'x'.join(map(str, ids.shape))}")
    return ModelInput(args, ", ".join(specs) + note, kwargs=kwargs, token_mask=padding_mask(named))


def padding_mask(named: Mapping[str, Any]) -> torch.Tensor | None:
    """A padded batch's `attention_mask` (of `input_ids`' 2-D shape, holding zeros) as the
    token mask that keeps its padding out of every statistic; None where nothing is padded."""
    mask, ids = named.get("attention_mask"), named.get("input_ids")
    if (
        isinstance(mask, torch.Tensor)
        and isinstance(ids, torch.Tensor)
        and mask.shape == ids.shape
        and mask.dim() == 2
        and bool((mask == 0).any())
    ):
        return mask.bool()
    return None


def default_input(model: LoadedModel, seed: int) -> ModelInput:
    """A deterministic random input of the shape the model expects, described as such."""
    gen = torch.Generator().manual_seed(seed)
    if model.input_size is None:
        shape = _guess_custom(model)
        x = torch.randn(shape, generator=gen)
        dims = "x".join(map(str, shape))
        return ModelInput(
            (x,), f"no input given: randn {dims} (seed {seed}), guessed from the first layer"
        )
    args, kwargs, description = model.kind.default_input(model.input_size, gen, seed)
    return ModelInput(args, description, kwargs=kwargs)


def _guess_custom(model: LoadedModel) -> tuple[int, ...]:
    """The input of a custom model's first Conv2d/Linear (registration order)."""
    from torch import nn

    first = next((m for m in model.module.modules() if isinstance(m, nn.Conv2d | nn.Linear)), None)
    if isinstance(first, nn.Conv2d):
        return (1, first.in_channels, 224, 224)
    if isinstance(first, nn.Linear) and first.in_features > 0:
        return (1, first.in_features)
    if isinstance(first, nn.modules.lazy.LazyModuleMixin):  # LazyLinear: in_features 0 till used
        raise UsageError(
            f"{model.spec}'s first layer is lazy: its input size is set by the first input, "
            "so hookcli cannot guess it.",
            "give an input, e.g. --input randn:1x16.",
        )
    raise UsageError(
        f"{model.spec} needs an input hookcli cannot guess.",
        "give an image or a tensor spec, e.g. --input randn:1x3x224x224.",
    )
