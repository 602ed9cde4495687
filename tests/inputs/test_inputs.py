"""Inputs: every PIL mode to RGB, folders, bad files, tensor specs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hookcli.errors import UsageError
from hookcli.inputs import expand_paths, parse_spec, read_image
from tests.support.paths import CAT


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "LA", "CMYK", "1", "I;16", "I", "F", "YCbCr"])
def test_every_mode_becomes_rgb(tmp_path: Path, mode: str) -> None:
    base = Image.open(CAT).convert("RGB").resize((40, 30))
    if mode in ("I;16", "I"):
        arr = (np.asarray(base.convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
        img = Image.fromarray(arr)  # uint16 → mode I;16
        if mode == "I":
            img = img.convert("I")
        path = tmp_path / (f"img_{mode.replace(';', '')}." + ("png" if mode == "I;16" else "tiff"))
    elif mode == "F":
        img = Image.fromarray(np.asarray(base.convert("L"), dtype=np.float32) / 255.0)  # mode F
        path = tmp_path / "img_F.tiff"
    else:
        img = base.convert(mode)
        path = tmp_path / f"img_{mode}.{'jpg' if mode in ('CMYK', 'YCbCr') else 'png'}"
    img.save(path)
    out = read_image(path)
    assert out.mode == "RGB" and out.size == (40, 30)
    if mode in ("L", "I;16", "I", "F"):
        # scaled into 0..255, not clipped to white
        grey = np.asarray(base.convert("L"), dtype=float)
        got = np.asarray(out, dtype=float)[..., 0]
        assert np.abs(got - grey).max() <= 2


def test_a_dark_high_depth_image_is_scaled_by_its_files_depth(tmp_path: Path) -> None:
    """A 16-bit PGM whose brightest pixel is 192 of 65535 (PIL opens it as mode I) is a dark
    16-bit image, scaled by 255/65535, not read as 8-bit (about 257 times too bright); a
    float image is intensities in [0, 1] with a little overshoot (one at 1.001 made it a
    [0, 255] one, near black); one far past 1 is a [0, 255] image."""
    grey = np.asarray(Image.open(CAT).convert("L").resize((40, 30)), dtype=np.uint16)
    dark = grey * 192 // 255
    pgm = tmp_path / "dark.pgm"
    pgm.write_bytes(b"P5\n40 30\n65535\n" + dark.astype(">u2").tobytes())
    assert Image.open(pgm).mode == "I"
    got = np.asarray(read_image(pgm), dtype=float)[..., 0]
    assert np.abs(got - np.round(dark * 255 / 65535)).max() <= 1 and got.max() <= 1
    light = grey.astype(np.float32) / 255
    light[0, 0] = 1.001
    Image.fromarray(light).save(tmp_path / "f.tiff")
    got = np.asarray(read_image(tmp_path / "f.tiff"), dtype=float)[..., 0]
    assert np.abs(got - np.clip(light, 0, 1) * 255).max() <= 1
    Image.fromarray(light * 255).save(tmp_path / "f255.tiff")  # a float image in [0, 255]
    got = np.asarray(read_image(tmp_path / "f255.tiff"), dtype=float)[..., 0]
    assert np.abs(got - np.clip(light * 255, 0, 255)).max() <= 1


def test_transparent_pixels_become_white(tmp_path: Path) -> None:
    img = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    path = tmp_path / "clear.png"
    img.save(path)
    assert read_image(path).getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize(
    ("mode", "key", "other"),
    [("L", 0, 128), ("RGB", (0, 0, 0), (9, 80, 200)), ("1", 0, 1), ("I;16", 0, 40000)],
)
def test_a_trns_keyed_colour_is_transparent_too(
    tmp_path: Path, mode: str, key: object, other: object
) -> None:
    """A grayscale or RGB PNG whose tRNS chunk keys a colour transparent: that colour's pixels
    were read as the colour (black), not composited on white as RGBA, LA and palette images
    are. Oracle: PIL's own RGBA conversion of the file, composited on white."""
    img = Image.new(mode, (4, 4), other)  # type: ignore[arg-type]
    img.putpixel((0, 0), key)  # type: ignore[arg-type]
    path = tmp_path / "keyed.png"
    img.save(path, transparency=key)
    reread = Image.open(path)
    assert "transparency" in reread.info
    white = Image.new("RGBA", reread.size, (255, 255, 255, 255))
    want = Image.alpha_composite(white, reread.convert("RGBA")).convert("RGB")
    got = read_image(path)
    assert got.getpixel((0, 0)) == (255, 255, 255) == want.getpixel((0, 0))
    if mode == "I;16":  # the rest scaled from 16 bits (PIL's own conversion clips at 255)
        level = round(40000 * 255 / 65535)
        assert np.asarray(got)[1:].tolist() == [[[level] * 3] * 4] * 3
        return
    assert np.array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "empty"), (b"hello, not an image", "not an image"), (None, "truncated")],
)
def test_bad_image_files(tmp_path: Path, content: bytes | None, message: str) -> None:
    path = tmp_path / "bad.jpg"
    path.write_bytes(CAT.read_bytes()[:3000] if content is None else content)
    with pytest.raises(UsageError, match=message):
        read_image(path)


def test_folders(tmp_path: Path) -> None:
    (tmp_path / "b.png").write_bytes(b"x")
    (tmp_path / "a.jpeg").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / ".hidden.png").write_bytes(b"x")
    assert [p.name for p in expand_paths([str(tmp_path)])] == ["a.jpeg", "b.png"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="holds no image"):
        expand_paths([str(empty)])
    with pytest.raises(UsageError, match="not found"):
        expand_paths([str(tmp_path / "missing.jpg")])


def test_a_folder_is_read_through_linked_class_folders_as_imagefolder_reads_it(
    tmp_path: Path,
) -> None:
    """A class folder that is a symbolic link to images elsewhere (a common way to build a
    dataset) is read, the same files as torchvision's ImageFolder finds; a link back up the
    tree is walked once, not forever."""
    from PIL import Image
    from torchvision.datasets import ImageFolder

    real = tmp_path / "real" / "dog"
    (tmp_path / "ds" / "cat").mkdir(parents=True)
    real.mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(tmp_path / "ds" / "cat" / "1.jpg")
    Image.new("RGB", (4, 4)).save(real / "2.jpg")
    (tmp_path / "ds" / "dog").symlink_to(real, target_is_directory=True)
    (real / "loop").symlink_to(tmp_path / "ds", target_is_directory=True)
    found = [str(f.path) for f in expand_paths([str(tmp_path / "ds")])]
    want = [path for path, _ in ImageFolder(str(tmp_path / "ds"), allow_empty=True).samples]
    assert found == [str(tmp_path / "ds" / "cat" / "1.jpg"), str(tmp_path / "ds" / "dog" / "2.jpg")]
    assert set(want) >= set(found)


def test_specs(tmp_path: Path) -> None:
    (x,) = parse_spec("randn:2x3", seed=0)
    assert x.shape == (2, 3)
    assert torch.equal(x, parse_spec("randn:2x3", seed=0)[0])
    assert parse_spec("ones:2", 0)[0].tolist() == [1.0, 1.0]
    assert parse_spec("zeros:1,4", 0)[0].shape == (1, 4)
    assert parse_spec("rand:0x3", 0)[0].shape == (0, 3)
    torch.save((torch.ones(2), torch.zeros(3)), tmp_path / "pair.pt")
    assert [t.shape for t in parse_spec(str(tmp_path / "pair.pt"), 0)] == [(2,), (3,)]
    np.save(tmp_path / "a.npy", np.arange(6).reshape(2, 3))
    assert parse_spec(str(tmp_path / "a.npy"), 0)[0].tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize(
    "spec", ["randn", "randn:", "randn:2x", "gauss:2x2", "randn:-1", "randn:2.5", "x.bin"]
)
def test_malformed_specs(spec: str) -> None:
    with pytest.raises(UsageError, match="malformed --input"):
        parse_spec(spec, 0)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("randint:0:1000:1x12:int8", r"span \[\d+, \d+\], outside torch.int8's \[-128, 127\]"),
        ("randint:-5:5:1x12:uint8", r"outside torch.uint8's \[0, 255\]"),
        ("randint:0:70000:1x12:float16", r"outside torch.float16's"),
        ("randint:0:9223372036854775808:1x2", "must be int64 numbers"),
        ("randint:-9223372036854775809:0:1x2", "must be int64 numbers"),
    ],
)
def test_a_cast_that_would_wrap_or_overflow_is_refused(spec: str, message: str) -> None:
    """A spec's values outside its :DTYPE's range (int8 would make 200 into -56, float16
    70000 into Inf) or bounds past int64 are a usage error, never values the draw did not
    give; within the range the values are the draw's own."""
    with pytest.raises(UsageError, match=message):
        parse_spec(spec, 0)
    (ids,) = parse_spec("randint:-100:100:64:int8", 0)
    assert ids.dtype is torch.int8
    assert torch.equal(ids.long(), parse_spec("randint:-100:100:64", 0)[0])


def test_an_input_spec_too_large_for_memory_is_out_of_memory_not_a_bug(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's allocator refusing the spec's tensor: out of memory (exit 3), said as the
    input's, never an internal error."""
    from hookcli.errors import ModelError
    from hookcli.inputs import specs

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9")

    monkeypatch.setattr(specs.torch, "randn", refuse)
    with pytest.raises(ModelError, match="out of memory making --input 'randn:1x3x7000x7000'"):
        specs.parse("randn:1x3x7000x7000", 0)


def test_a_plain_pickle_as_an_input_is_refused_without_torchs_advice_to_unpickle_it(
    tmp_path: Path,
) -> None:
    import pickle

    path = tmp_path / "plain.pt"
    path.write_bytes(pickle.dumps(torch.ones(2)))
    with pytest.raises(UsageError) as err:
        parse_spec(str(path), 0)
    said = str(err.value)
    assert "plain pickle" in said and "hookcli never unpickles" in said
    assert "weights_only" not in said


def test_an_input_of_another_dtype_than_the_model_gets_a_dtype_hint(tmp_path: Path) -> None:
    """numpy's default float64 into a float32 model: the layer's refusal is named, and the
    hint is the :DTYPE suffix (it said to check the input shape, which was right)."""
    from tests.support.cli import one_line_error, run

    np.save(tmp_path / "x.npy", np.random.default_rng(0).random((1, 3, 32, 32)))
    line = one_line_error(run("inspect", "resnet18", "--input", str(tmp_path / "x.npy")), 3)
    assert "the input's dtype (float64) is not the model's" in line and ":float32" in line
    assert "input shape" not in line


def test_an_image_past_pillows_warning_size_is_read_and_past_its_limit_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pillow warns past MAX_IMAGE_PIXELS (89.5 M: a 108-megapixel phone photo) and refuses
    past twice that: the first is read, as torchvision's own reading reads it (it was
    refused), the second is a one-line usage error (exit 2), never decoded."""
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    Image.new("RGB", (40, 30), (10, 20, 30)).save(tmp_path / "big.png")  # 1200 pixels
    Image.new("RGB", (50, 50)).save(tmp_path / "huge.png")  # 2500: past twice the limit
    assert read_image(tmp_path / "big.png").getpixel((0, 0)) == (10, 20, 30)
    with pytest.raises(UsageError, match="too large to decode safely"):
        read_image(tmp_path / "huge.png")
