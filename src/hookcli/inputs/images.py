"""Image files and folders → RGB images and their preprocessing.

Any PIL raster format, converted to RGB: grayscale, palette, RGBA composited on white, 16-bit
scaled, CMYK converted, EXIF rotation applied; a folder means every image in it (an ImageFolder
tree); an unreadable file named on the command line is an error, one found in a folder skipped.
"""

from __future__ import annotations

import io
import os
import stat
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookcli.errors import UsageError
from hookcli.io.output import note_read, registry, user_path

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Decoders hookcli lets Pillow run: raster formats only. EPS/PS would run Ghostscript, PDF and
# WMF are not pictures to sample, and the scientific containers are not photographs.
RASTER_FORMATS = (
    "PNG", "JPEG", "MPO", "BMP", "DIB", "GIF", "TIFF", "WEBP", "PPM", "TGA", "ICO", "CUR",
    "PCX", "SGI", "JPEG2000", "QOI", "DDS", "PSD", "XBM", "XPM", "IM", "ICNS", "BLP", "AVIF",
    "SUN", "MSP", "FLI", "DCX",
)  # fmt: skip
MAX_RESIZED_PIXELS = 64_000_000  # what a resize may make of one image before the center crop
MAX_PIPED_BYTES = 256 << 20  # an image from a pipe or device: read into memory up to this


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
    exts: set[str] = set()  # read when a folder is: PIL's plugins cost ~0.15 s to load
    out: list[ImageFile] = []
    for raw in paths:
        p = user_path(raw, "input")
        if p.is_dir():
            note_read(p)
            exts = exts or image_extensions()
            found = sorted(
                f
                for f in _tree_files(p)
                if f.suffix.lower() in exts
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


def _tree_files(root: Path) -> Iterator[Path]:
    """Every file under root, through linked folders as torchvision's ImageFolder walks them
    (a class folder that is a symbolic link), each folder once (a link back up is no loop)."""
    seen: set[tuple[int, int]] = set()
    for top, dirs, files in os.walk(root, followlinks=True):
        st = os.stat(top)
        if (st.st_dev, st.st_ino) in seen:
            dirs.clear()
            continue
        seen.add((st.st_dev, st.st_ino))
        for name in files:
            f = Path(top, name)
            if f.is_file():
                yield f


def _image_source(path: Path) -> Path | io.BytesIO:
    """What PIL opens: the path of a regular file, or the bytes of a pipe or device (a
    `<(cat img)` argument), read once and kept for any later read of the same name."""
    key = str(path)
    piped = registry().piped  # this run's: read once, the bytes kept for any later read
    if key in piped:
        return io.BytesIO(piped[key])
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise UsageError(f"{path} cannot be read ({exc.strerror}).", "check the file.") from exc
    if stat.S_ISREG(mode):
        note_read(path)
        return path
    try:
        with open(path, "rb") as f:
            if os.isatty(f.fileno()):
                raise UsageError(
                    f"{path} is a terminal, not an image.", "give an image file or a pipe."
                )
            data = f.read(MAX_PIPED_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{path} cannot be read ({exc.strerror}).", "check the file.") from exc
    if len(data) > MAX_PIPED_BYTES:  # /dev/zero, <(yes): never read to the end
        raise UsageError(
            f"{path} gives more than {MAX_PIPED_BYTES >> 20} MiB, more than any image.",
            "give an image file.",
        )
    piped[key] = data
    if not data:
        raise UsageError(f"{path} gave no data (an empty pipe).", "give a real image file.")
    return io.BytesIO(data)


def _format_of(source: Path | io.BytesIO) -> str | None:
    """The format Pillow would take a file for, from its header alone (nothing decoded)."""
    from PIL import Image

    if isinstance(source, io.BytesIO):
        source.seek(0)
    try:
        with Image.open(source) as im:
            return str(im.format)
    except Exception:
        return None


def _open_raster(source: Path | io.BytesIO) -> Any:
    """Image.open over the raster formats only: first those Pillow loads up front (JPEG, PNG,
    BMP, GIF, PPM), then, if the file is none of them, every raster plugin (loading them all
    costs ~0.2 s a run that reads a JPEG need not pay)."""
    from PIL import Image, UnidentifiedImageError

    Image.preinit()
    common = [f for f in RASTER_FORMATS if f in Image.OPEN]
    try:
        return Image.open(source, formats=common)
    except UnidentifiedImageError:
        if isinstance(source, io.BytesIO):
            source.seek(0)
        Image.init()
        return Image.open(source, formats=[f for f in RASTER_FORMATS if f in Image.OPEN])


def read_image(path: Path) -> Any:
    """A PIL RGB image, whatever the file's mode; one-line errors for unreadable files."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    source = _image_source(path)
    if isinstance(source, Path) and path.stat().st_size == 0:
        raise UsageError(f"{path} is empty (0 bytes).", "give a real image file.")
    try:
        with warnings.catch_warnings():
            # (a 108-megapixel phone photo only warns, as torchvision's reading lets it: the
            # hard limit, twice that, stays an error)
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = _open_raster(source)
            img.load()
    except UnidentifiedImageError as exc:
        other = _format_of(source)
        if other is not None:
            raise UsageError(
                f"{path} is {other}, not a raster image format hookcli decodes "
                "(PNG, JPEG, BMP, GIF, TIFF, WebP, …); convert it to PNG or JPEG first.",
                "convert it to PNG or JPEG first.",
            ) from exc
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
    depth = _depth_of(img)  # (before the transpose: its copy keeps no format)
    return to_rgb(ImageOps.exif_transpose(img) or img, depth)


def to_rgb(img: Any, depth: int | None = None) -> Any:
    """A decoded image as RGB; `depth`: the bits of a high-depth image's values, where its file
    says (`_depth_of`)."""
    from PIL import Image

    mode = img.mode
    key = img.info.get("transparency")  # a PNG's tRNS-keyed value (the 16-bit path loses it)
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        scale = _scale_to_8bit(img.mode, arr, depth)
        img = Image.fromarray(np.clip(arr * scale + 0.5, 0, 255).astype(np.uint8), mode="L")
        mode = "L"
        if isinstance(key, int) and not isinstance(key, bool):  # keyed pixels: white
            rgb = np.asarray(img.convert("RGB")).copy()
            rgb[np.asarray(arr == key)] = 255
            return Image.fromarray(rgb, mode="RGB")
    # a palette, grayscale or RGB PNG's tRNS chunk (info["transparency"]) is transparency too
    keyed = mode in ("P", "1", "L", "RGB") and "transparency" in img.info
    if mode in ("RGBA", "LA", "PA", "La", "RGBa") or keyed:
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


def _depth_of(img: Any) -> int | None:
    """The bits of an integer image's values where its file says: 16-bit PNG and PNM (PIL
    opens only those as I), a TIFF's BitsPerSample of 8 or 16; None where it does not say."""
    if img.mode.startswith("I;16") or (img.mode == "I" and img.format in ("PNG", "PPM")):
        return 16
    if img.mode == "I" and img.format == "TIFF":
        per = getattr(img, "tag_v2", {}).get(258)  # BitsPerSample
        per = per[0] if isinstance(per, tuple) and per else per
        return per if per in (8, 16) else None  # (32-bit ones often hold 16-bit values)
    return None


def _scale_to_8bit(mode: str, arr: np.ndarray[Any, Any], depth: int | None) -> float:
    """What turns a high-depth image's values into 8-bit ones, from the file's own depth, not
    from its brightest pixel (a dark 16-bit image is no 8-bit one); a float image as
    intensities in [0, 1] up to 1.5 (a little overshoot clipped, not read as a [0, 255] image
    and drawn near black), else as values in [0, 255]."""
    top = float(arr.max()) if arr.size else 0.0
    if mode == "F":
        return 255.0 if top <= 1.5 else 1.0
    if mode.startswith("I;16"):
        depth = 16
    elif depth is None:  # a format that does not say: values past 255 can only be 16-bit
        depth = 16 if top > 255 else 8
    return 255.0 / float(2**depth - 1)


def short_side_resize(preprocess: Any) -> int | None:
    """The size a preprocessing resizes an image's short side to, when it does: torchvision's
    presets (`resize_size` of one number) or the first `Resize(N)` of a Compose (hookcli's own
    ImageNet preprocessing, a custom one); None for a fixed output size or no resize."""
    size = getattr(preprocess, "resize_size", None)
    if size is None:
        resize = next(
            (t for t in getattr(preprocess, "transforms", ()) if type(t).__name__ == "Resize"),
            None,
        )
        size = getattr(resize, "size", None)
    if isinstance(size, list | tuple) and len(size) == 1:
        size = size[0]
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def resize_problem(image: Any, short: int | None, name: str) -> str | None:
    """Why an image cannot be preprocessed (resizing the short side of a 1x5000 strip to 256
    makes 256x1280000: gigabytes before the crop), or None. Folder runs skip such an image."""
    w, h = image.size
    low = min(w, h)
    if short is None or low <= 0:
        return None
    big_w, big_h = -(-w * short // low), -(-h * short // low)
    pixels = big_w * big_h
    if pixels <= MAX_RESIZED_PIXELS:
        return None
    return (
        f"{name} is {w}x{h}: resizing its short side to {short} would make {big_w}x{big_h} "
        f"({pixels / 1e6:,.0f} megapixels); hookcli refuses more than "
        f"{MAX_RESIZED_PIXELS // 1_000_000} megapixels."
    )


class TooLargeToResize(UsageError):
    """An image named to the model that its preprocessing's resize would blow up."""


def check_sizes(
    files: list[ImageFile],
    images: list[Any],
    short: int | None,
    strict: bool,
    skipped: list[tuple[str, str]],
) -> tuple[list[ImageFile], list[Any]]:
    """The images a resize to `short` would not blow up (a 5000x1 strip: gigabytes): another
    is an error when named on the command line (or --strict), skipped and listed when found
    in a folder, as an unreadable one is (and as a run in batches skips it)."""
    kept: tuple[list[ImageFile], list[Any]] = ([], [])
    for f, im in zip(files, images, strict=True):
        problem = resize_problem(im, short, str(f.path))
        if problem is None:
            kept[0].append(f)
            kept[1].append(im)
        elif f.root is None or strict:
            raise TooLargeToResize(
                problem, "crop it to a less extreme aspect ratio first (the model sees the middle)."
            )
        else:
            skip_or_raise(f, problem, strict, skipped)  # (found in a folder: listed)
    return kept


def imagenet_preprocess(size: tuple[int, int]) -> Any:
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
    return f"skipped {len(skipped)} image(s) that cannot be used: {shown}{more}"
