"""INPUT → the positional arguments of the model's forward.

Image files (any PIL format, converted to RGB: grayscale, palette, RGBA composited on white,
16-bit scaled, CMYK converted, EXIF rotation applied), folders (every image in them), tensor
specs (`randn:1x3x224x224`, `rand:…`, `ones:2`, `zeros:…`, `file.pt`, `file.npy`), or
nothing: a deterministic random input of the shape the model expects.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookcli.errors import UsageError
from hookcli.loading import LoadedModel

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_MAX_NUMEL = 1 << 31
_SPEC = re.compile(r"^(randn|rand|ones|zeros):([0-9]+(?:[x,][0-9]+)*)$")


@dataclass(slots=True)
class ModelInput:
    args: tuple[Any, ...]
    description: str
    sources: list[str] = field(default_factory=list)  # per image: path relative to its folder
    preprocessing: str | None = None
    classes: list[str | None] = field(default_factory=list)  # per image: its class folder
    skipped: list[tuple[str, str]] = field(default_factory=list)  # unreadable: (path, why)

    def replace_args(self, args: tuple[Any, ...]) -> ModelInput:
        return ModelInput(
            args, self.description, self.sources, self.preprocessing, self.classes, self.skipped
        )

    def shapes(self) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        for a in self.args:
            if isinstance(a, torch.Tensor):
                out.append(tuple(a.shape))
            elif isinstance(a, list):
                out.extend(tuple(t.shape) for t in a if isinstance(t, torch.Tensor))
        return out

    def to(self, device: torch.device) -> ModelInput:
        def move(a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                return a.to(device)
            if isinstance(a, list):
                return [move(x) for x in a]
            return a

        return self.replace_args(tuple(move(a) for a in self.args))


def image_extensions() -> set[str]:
    from PIL import Image

    return {ext.lower() for ext in Image.registered_extensions()}


@dataclass(frozen=True, slots=True)
class ImageFile:
    """An image to read: named on the command line (root None) or found under a folder."""

    path: Path
    root: Path | None = None

    @property
    def name(self) -> str:
        """How rows name it: the path as given, or relative to its folder (`cat/001.jpg`)."""
        return self.path.relative_to(self.root).as_posix() if self.root else str(self.path)

    @property
    def folder_class(self) -> str | None:
        """The class of an ImageFolder tree: the first subfolder under the named folder."""
        if self.root is None:
            return None
        parts = self.path.relative_to(self.root).parts
        return parts[0] if len(parts) > 1 else None


def expand_paths(paths: Sequence[str]) -> list[ImageFile]:
    """Files as given; a folder becomes every image file in it and its subfolders (an
    ImageFolder tree, whatever the number of images), sorted; hidden ones left out."""
    exts = image_extensions()
    out: list[ImageFile] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.is_file()
                and f.suffix.lower() in exts
                and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise UsageError(
                    f"folder {raw} holds no image files (subfolders are read too).",
                    "put .jpg/.png/... images in it, or name image files directly.",
                )
            out.extend(ImageFile(f, p) for f in found)
        elif p.exists():
            out.append(ImageFile(p))
        else:
            raise UsageError(
                f"input {raw} not found.", "check the path (a folder means every image in it)."
            )
    return out


def read_image(path: Path) -> Any:
    """A PIL RGB image, whatever the file's mode; one-line errors for unreadable files."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if path.stat().st_size == 0:
        raise UsageError(f"{path} is empty (0 bytes).", "give a real image file.")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(path)
            img.load()
    except UnidentifiedImageError as exc:
        raise UsageError(
            f"{path} is not an image format PIL can read.",
            "give a JPEG/PNG/... file, or a tensor with --input file.pt.",
        ) from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise UsageError(
            f"{path} is too large to decode safely: {exc}", "resize the image first."
        ) from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise UsageError(
            f"{path} is corrupt or truncated ({exc}).", "re-export or re-download the image."
        ) from exc
    return to_rgb(ImageOps.exif_transpose(img) or img)


def to_rgb(img: Any) -> Any:
    from PIL import Image

    mode = img.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        top = arr.max() if arr.size else 0.0
        if mode == "F" and top <= 1.0:
            scale = 255.0
        elif mode.startswith("I;16") or top > 255:
            scale = 255.0 / 65535.0
        else:
            scale = 1.0
        img = Image.fromarray(np.clip(arr * scale + 0.5, 0, 255).astype(np.uint8), mode="L")
        mode = "L"
    if mode in ("RGBA", "LA", "PA", "La", "RGBa") or (mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if mode != "RGB":
        try:
            return img.convert("RGB")
        except ValueError as exc:
            raise UsageError(
                f"image mode {mode} cannot be converted to RGB.", "convert the image to RGB first."
            ) from exc
    return img


def _imagenet_preprocess(size: tuple[int, int]) -> Any:
    from torchvision.transforms import v2

    return v2.Compose(
        [
            v2.Resize(round(size[0] * 256 / 224), antialias=True),
            v2.CenterCrop(size),
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def _clips(images: list[Any], model: LoadedModel) -> torch.Tensor:
    """Video models: each still image repeated as a clip, through the weights' transforms."""
    from torchvision.transforms.functional import pil_to_tensor

    from hookcli.loading import CLIP_FRAMES

    assert model.preprocess is not None
    clips = [pil_to_tensor(im).unsqueeze(0).expand(CLIP_FRAMES, -1, -1, -1) for im in images]
    return torch.stack([model.preprocess(c) for c in clips])  # (N, C, T, H, W)


def _flow_pair(images: list[Any], model: LoadedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Optical flow: two images, the second resized to the first, both to multiples of 8."""
    if len(images) != 2:
        raise UsageError(
            f"optical-flow models take two images (frame 1, frame 2); got {len(images)}.",
            "give exactly two image files.",
        )
    w, h = images[0].size
    size = (max(128, w // 8 * 8), max(128, h // 8 * 8))
    a, b = (im.resize(size) for im in images)
    assert model.preprocess is not None
    one, two = model.preprocess(a, b)  # type: ignore[call-arg]
    return one.unsqueeze(0), two.unsqueeze(0)


def try_read(file: ImageFile) -> tuple[Any | None, str | None]:
    """The image, or None and why not (safe in DataLoader workers: never raises)."""
    try:
        return read_image(file.path), None
    except UsageError as exc:
        return None, exc.message


def skip_or_raise(
    file: ImageFile, reason: str, strict: bool, skipped: list[tuple[str, str]]
) -> None:
    """The rule for an unreadable image, the same for one batch and for folder runs: a file
    named on the command line is an error; one found in a folder is skipped and listed
    (--strict: an error)."""
    if file.root is None:
        raise UsageError(reason, "give a readable image file.")
    if strict:
        raise UsageError(reason, "remove it, or drop --strict to skip unreadable images.")
    why = reason.removeprefix(f"{file.path} ").removeprefix("is ").rstrip(".")
    skipped.append((file.name, why))


def read_or_skip(file: ImageFile, strict: bool, skipped: list[tuple[str, str]]) -> Any | None:
    image, reason = try_read(file)
    if image is None:
        skip_or_raise(file, reason or "unreadable", strict, skipped)
    return image


def skipped_note(skipped: Sequence[tuple[str, str]]) -> str:
    shown = ", ".join(f"{name} ({why})" for name, why in skipped[:5])
    more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
    return f"skipped {len(skipped)} unreadable image(s): {shown}{more}"


def from_images(paths: Sequence[str], model: LoadedModel, *, strict: bool = False) -> ModelInput:
    skipped: list[tuple[str, str]] = []
    found = expand_paths(paths)
    read = [(f, read_or_skip(f, strict, skipped)) for f in found]
    files = [f for f, im in read if im is not None]
    images = [im for _, im in read if im is not None]
    if not files:
        raise UsageError(f"none of the {len(found)} images could be read.", "check the files.")
    minput = _from_pil(files, images, model)
    minput.skipped = skipped
    return minput


def _from_pil(files: list[ImageFile], images: list[Any], model: LoadedModel) -> ModelInput:
    desc = f"{len(files)} image{'s' if len(files) != 1 else ''}: " + ", ".join(
        f.path.name for f in files[:4]
    )
    sources = [f.name for f in files]
    classes = [f.folder_class for f in files]
    if model.task == "video":
        from hookcli.loading import CLIP_FRAMES

        desc += f", each repeated as a clip of {CLIP_FRAMES} frames"
        return ModelInput((_clips(images, model),), desc, sources, model.preprocess_label, classes)
    if model.task == "optical_flow":
        return ModelInput(
            _flow_pair(images, model),
            desc + " (frame 1, frame 2)",
            sources,
            model.preprocess_label,
            classes,
        )
    if model.preprocess is not None:
        preprocess = model.preprocess
        label = model.preprocess_label
    else:
        size = model.input_size or (224, 224)
        preprocess = _imagenet_preprocess(size)
        resize = round(size[0] * 256 / 224)
        label = f"ImageNet: resize {resize}, center crop {size[0]}x{size[1]}, ImageNet mean/std"
    tensors = [preprocess(im) for im in images]
    if len(files) > 4:
        desc += f", … (+{len(files) - 4})"
    if model.task == "detection":  # detection takes a list
        return ModelInput((list(tensors),), desc, sources, label, classes)
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        raise UsageError(
            "the images have different sizes after preprocessing ("
            + ", ".join("x".join(map(str, s)) for s in sorted(shapes))
            + ") and cannot form one batch.",
            "give one image at a time, or images of the same aspect ratio.",
        )
    return ModelInput((torch.stack(tensors),), desc, sources, label, classes)


def parse_spec(spec: str, seed: int) -> list[torch.Tensor]:
    """One --input spec → one or more tensors (a .pt file may hold a tuple of tensors)."""
    raw = spec.strip()
    m = _SPEC.match(raw)
    if m:
        kind, dims = m.groups()
        shape = tuple(int(d) for d in re.split(r"[x,]", dims))
        numel = int(np.prod(shape)) if shape else 1
        if numel > _MAX_NUMEL:
            raise UsageError(
                f"--input {spec}: {numel:,} elements is too many.", "use a smaller shape."
            )
        gen = torch.Generator().manual_seed(seed)
        if kind == "randn":
            return [torch.randn(shape, generator=gen)]
        if kind == "rand":
            return [torch.rand(shape, generator=gen)]
        return [torch.ones(shape) if kind == "ones" else torch.zeros(shape)]
    path = Path(raw).expanduser()
    if path.suffix.lower() in (".pt", ".pth"):
        if not path.is_file():
            raise UsageError(f"--input file {raw} not found.", "check the path.")
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise UsageError(
                f"--input {raw} is not a readable tensor file: {exc}",
                "save it with torch.save(tensor, 'x.pt').",
            ) from exc
        items = list(data) if isinstance(data, list | tuple) else [data]
        if not items or not all(isinstance(t, torch.Tensor) for t in items):
            raise UsageError(
                f"--input {raw} holds a {type(data).__name__}, not tensors.",
                "save a tensor or a tuple of tensors with torch.save.",
            )
        return items
    if path.suffix.lower() == ".npy":
        if not path.is_file():
            raise UsageError(f"--input file {raw} not found.", "check the path.")
        try:
            return [torch.from_numpy(np.load(path, allow_pickle=False))]
        except Exception as exc:
            raise UsageError(
                f"--input {raw} is not a readable .npy array: {exc}", "save it with numpy.save."
            ) from exc
    raise UsageError(
        f"malformed --input {spec!r}: expected KIND:SHAPE such as randn:1x3x224x224 "
        "(KIND randn, rand, ones or zeros), or a .pt/.npy file.",
        "for example --input randn:1x3x224x224",
    )


def from_specs(specs: Sequence[str], seed: int, model: LoadedModel) -> ModelInput:
    tensors: list[torch.Tensor] = []
    for i, spec in enumerate(specs):
        tensors.extend(parse_spec(spec, seed + i))
    desc = ", ".join(specs)
    if model.task == "detection":
        batch = tensors[0]
        images = list(batch) if batch.dim() == 4 else [batch]
        return ModelInput((images,), desc)
    return ModelInput(tuple(tensors), desc)


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
    h, w = model.input_size
    if model.task == "video":
        from hookcli.loading import CLIP_FRAMES

        x = torch.randn((1, 3, CLIP_FRAMES, h, w), generator=gen)
        return ModelInput(
            (x,), f"no input given: randn 1x3x{CLIP_FRAMES}x{h}x{w} clip (seed {seed})"
        )
    if model.task == "optical_flow":
        a, b = (torch.rand((1, 3, 224, 224), generator=gen) * 2 - 1 for _ in range(2))
        return ModelInput(
            (a, b), f"no input given: two rand 1x3x224x224 frames in [-1, 1] (seed {seed})"
        )
    if model.task == "detection":
        img = torch.rand((3, h, w), generator=gen)
        return ModelInput(([img],), f"no input given: rand 3x{h}x{w} image (seed {seed})")
    x = torch.randn((1, 3, h, w), generator=gen)
    return ModelInput((x,), f"no input given: randn 1x3x{h}x{w} (seed {seed})")


def _guess_custom(model: LoadedModel) -> tuple[int, ...]:
    """The input of a custom model's first Conv2d/Linear (registration order)."""
    from torch import nn

    first = next((m for m in model.module.modules() if isinstance(m, nn.Conv2d | nn.Linear)), None)
    if isinstance(first, nn.Conv2d):
        return (1, first.in_channels, 224, 224)
    if isinstance(first, nn.Linear):
        return (1, first.in_features)
    raise UsageError(
        f"{model.spec} needs an input hookcli cannot guess.",
        "give an image or a tensor spec, e.g. --input randn:1x3x224x224.",
    )
