"""maps and cam: PNGs read back with Pillow; Grad-CAM against an independent computation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.sources import load_model
from tests.support.cli import assert_one_line_error
from tests.support.paths import CAT

runner = CliRunner()


def run(*args: str) -> object:
    return runner.invoke(app, list(args))


def test_maps_of_resnet18_conv1_is_a_grid_of_64_labelled_tiles(tmp_path: Path) -> None:
    out = tmp_path / "maps.png"
    r = run("maps", "resnet18", str(CAT), "-l", "conv1", "-o", str(out))
    assert r.exit_code == 0, r.stderr
    assert "wrote" in r.stderr and r.stdout == ""
    img = Image.open(out)
    assert img.format == "PNG" and img.mode == "RGB"
    meta = json.loads(img.info["hookcli"])
    tiles = meta["tiles"]
    assert len(tiles) == 64
    assert sorted(int(t["label"]) for t in tiles) == list(range(64))
    pixels = np.asarray(img.convert("L"), dtype=np.int16)
    assert img.width > 8 * 64 and img.height > 8 * 64
    for t in tiles:
        x0, y0, x1, y1 = t["box"]
        assert x1 - x0 >= 64 and y1 - y0 >= 64
        tile = pixels[y0 + 20 : y1, x0:x1]  # below the label
        assert tile.max() - tile.min() > 10, f"tile {t['label']} is flat"
        label = pixels[y0 + 2 : y0 + 12, x0 + 2 : x0 + 12]
        assert label.min() < 40, "a dark label box in the corner"
    assert "conv1 call 0" in meta["title"] and "64 of 64 channels" in meta["title"]


def test_maps_options_channels_order_call(tmp_path: Path) -> None:
    out = tmp_path / "m.png"
    r = run(
        "maps",
        "resnet18",
        str(CAT),
        "-l",
        "layer1.0.relu",
        "--call",
        "1",
        "--channels",
        "5",
        "--order",
        "index",
        "-o",
        str(out),
    )
    assert r.exit_code == 0, r.stderr
    meta = json.loads(Image.open(out).info["hookcli"])
    assert [t["label"] for t in meta["tiles"]] == ["0", "1", "2", "3", "4"]
    assert "layer1.0.relu call 1" in meta["title"]


class _Faint(torch.nn.Module):
    """A conv whose outputs span ~1e-7: a layer of tiny activations, still a picture."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.conv = torch.nn.Conv2d(3, 4, 3)
        with torch.no_grad():
            self.conv.weight.mul_(1e-7)
            self.conv.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_maps_scales_each_tile_to_its_own_range_however_small(tmp_path: Path) -> None:
    """Each tile from its own min to its max, as the docs say (torchvision's make_grid floors
    the range at 1e-5, which drew these near black: 0..8 of 255)."""
    from hookcli import maps

    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    np.save(tmp_path / "x.npy", x.numpy())
    (tmp_path / "faint.py").write_text(
        "import torch\nfrom tests.commands.test_pictures import _Faint as Faint\n"
    )
    got = maps(f"{tmp_path / 'faint.py'}:Faint", [], layer="conv", order="index",
               input_specs=[str(tmp_path / "x.npy")]).picture.tiles  # fmt: skip
    a = _Faint().eval()(x)[0].detach().double()
    assert float(a.amax() - a.amin()) < 1e-5
    low = a.amin(dim=(1, 2), keepdim=True)
    want = ((a - low) / (a.amax(dim=(1, 2), keepdim=True) - low) * 255 + 0.5).floor()
    assert np.abs(got.astype(np.int16) - want.numpy()).max() <= 1
    assert all(t.min() == 0 and t.max() == 255 for t in got)


def _reference_cam(method: str) -> np.ndarray:
    """Grad-CAM by hand: retain_grad on layer4's output, ReLU(Σ_c w_c A_c), bilinear upsample."""
    loaded = load_model("resnet18", seed=0)
    model = loaded.module.eval()
    x = loaded.preprocess(Image.open(CAT).convert("RGB")).unsqueeze(0)  # type: ignore[misc]
    acts: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        out.retain_grad()
        acts.append(out)

    handle = model.layer4.register_forward_hook(keep)
    logits = model(x)
    handle.remove()
    logits.max(dim=1).values.sum().backward()
    a, g = acts[0][0].detach().double(), acts[0].grad[0].double()  # type: ignore[index]
    if method == "gradcam":
        w = g.mean(dim=(1, 2))
    else:
        num = g**2
        den = 2 * g**2 + a.sum(dim=(1, 2), keepdim=True) * g**3
        w = (num / torch.where(den != 0, den, torch.ones_like(den)) * F.relu(g)).sum(dim=(1, 2))
    cam = F.relu((w[:, None, None] * a).sum(0))
    return F.interpolate(cam[None, None], size=(224, 224), mode="bilinear", align_corners=False)[
        0, 0
    ].numpy()


@pytest.mark.parametrize("method", ["gradcam", "gradcam++"])
def test_grad_cam_equals_an_independent_computation(tmp_path: Path, method: str) -> None:
    png, raw = tmp_path / "cam.png", tmp_path / "cam.npy"
    r = run("cam", "resnet18", str(CAT), "-o", str(png), "--save-raw", str(raw), "--method", method)
    assert r.exit_code == 0, r.stderr
    assert "the last layer over the image" in r.stderr and "layer4" in r.stderr
    got = np.load(raw)
    want = _reference_cam(method)
    assert got.shape == (224, 224) and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-5 * max(np.abs(want).max(), 1e-12)
    assert got.max() > 0
    img = Image.open(png)
    assert img.width > 2 * 224 and "Grad-CAM" in json.loads(img.info["hookcli"])["title"]


def test_cam_names_the_class(tmp_path: Path) -> None:
    r = run(
        "cam",
        "resnet18",
        str(CAT),
        "-o",
        str(tmp_path / "c.png"),
        "--target",
        "tabby cat",
        "-l",
        "layer3",
    )
    assert r.exit_code == 0, r.stderr
    title = json.loads(Image.open(tmp_path / "c.png").info["hookcli"])["title"]
    assert "layer3" in title and "class 281 ('tabby')" in title


def test_cam_of_a_1x1_map_says_the_heat_is_flat(tmp_path: Path) -> None:
    """-l avgpool: a 1x1 map, one value for the whole image, upsampled into a flat heat that
    looked like evidence everywhere; the run says so."""
    raw = tmp_path / "c.npy"
    r = run("cam", "resnet18", str(CAT), "-o", str(tmp_path / "c.png"), "-l", "avgpool",
            "--save-raw", str(raw))  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert "map is 1x1" in r.stderr and "pick a layer with a spatial map" in r.stderr
    heat = np.load(raw)
    assert heat.min() == heat.max()
    wide = run("cam", "resnet18", str(CAT), "-o", str(tmp_path / "d.png"), "-l", "layer4")
    assert wide.exit_code == 0 and "map is 1x1" not in wide.stderr


def test_cam_of_a_loss_says_its_heat_raises_the_loss() -> None:
    """--loss ce:IDX: the map is the loss's gradient, whose heat marks evidence against class
    IDX; the legend says which way it reads (a target's map is the class's evidence)."""
    import hookcli

    model = load_model("resnet18", weights="none").module
    drawing = hookcli.cam(model, [str(CAT)], layer="layer3", loss="ce:281", device="cpu")
    assert any("raise the loss" in line for line in drawing.picture.legend)
    target = hookcli.cam(model, [str(CAT)], layer="layer3", target="281", device="cpu")
    assert not any("raise the loss" in line for line in target.picture.legend)


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["maps", "resnet18", str(CAT), "-l", "fc", "-o", "{tmp}/a.png"],
            ["outputs a 2-D tensor (1x1000)", "(N, H, W, C) or tokens"],
        ),
        (
            ["maps", "resnet18", str(CAT), "-l", "conv1", "--channels", "0", "-o", "{tmp}/a.png"],
            ["--channels must be 1 or more"],
        ),
        (
            ["maps", "resnet18", str(CAT), "-l", "layer1.*", "-o", "{tmp}/a.png"],
            ["matches", "one layer"],
        ),
        (["maps", "resnet18", str(CAT), "-l", "conv1", "-o", "{tmp}/a.jpg"], ["must end in .png"]),
        (["maps", "resnet18", str(CAT), "-l", "conv1"], ["-o FILE.png is required"]),
        (["maps", "resnet18", str(CAT), "-o", "{tmp}/a.png"], ["maps needs a layer"]),
        (
            ["maps", "resnet18", str(CAT), "-l", "conv1", "--call", "3", "-o", "{tmp}/a.png"],
            ["call 3 does not exist", "ran 1 time"],
        ),
        (
            ["maps", "resnet18", "{tmp}/exists.png", "-l", "conv1", "-o", "{tmp}/exists.png"],
            ["also an input of this run", "another output path"],
        ),
        (["maps", "resnet18", str(CAT), "-l", "conv1", "-o", "/proc/a.png"], ["not writable"]),
        (
            [
                "cam",
                "tests/support/models.py:TwoBranches",
                "--input",
                "randn:1x3x16x16",
                "-l",
                "side",
                "-o",
                "{tmp}/a.png",
            ],
            ["no gradient for this target"],
        ),
        (
            ["cam", "resnet18", str(CAT), "-l", "fc", "-o", "{tmp}/a.png"],
            ["outputs a 2-D tensor", "pictures need (N, C, H, W)"],
        ),
        (
            ["cam", "resnet18", str(CAT), "--method", "scorecam", "-o", "{tmp}/a.png"],
            ["unknown --method"],
        ),
    ],
)
def test_picture_bad_input(tmp_path: Path, args: list[str], needles: list[str]) -> None:
    (tmp_path / "exists.png").write_bytes(b"keep me")
    args = [a.format(tmp=tmp_path) for a in args]
    assert_one_line_error(run(*args), 2, *needles)
    assert (tmp_path / "exists.png").read_bytes() == b"keep me"
    assert not (tmp_path / "a.png").exists()


def test_outputs_are_replaced_and_force_is_still_accepted(tmp_path: Path) -> None:
    out = tmp_path / "m.png"
    for extra in ([], ["--force"]):
        out.write_bytes(b"old")
        r = run(
            "maps", "resnet18", str(CAT), "-l", "conv1", "--channels", "4", "-o", str(out), *extra
        )
        assert r.exit_code == 0, r.stderr
        assert out.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.png"], "no temp file left"


def test_png_to_stdout(tmp_path: Path) -> None:
    r = run("maps", "resnet18", str(CAT), "-l", "conv1", "--channels", "4", "-o", "-")
    assert r.exit_code == 0, r.stderr
    assert r.stdout_bytes[:8] == b"\x89PNG\r\n\x1a\n"
    import io

    from PIL import Image

    assert Image.open(io.BytesIO(r.stdout_bytes)).size[0] > 0


def _folder_with_an_unreadable_first_file(tmp_path: Path) -> Path:
    import shutil

    from tests.support.paths import COFFEE

    folder = tmp_path / "fold"
    folder.mkdir()
    (folder / "a_empty.png").write_bytes(b"")  # listed first, unreadable
    shutil.copy(CAT, folder / "b_cat.jpeg")
    shutil.copy(COFFEE, folder / "c_coffee.jpeg")
    return folder


def test_a_folders_picture_names_what_was_skipped_and_which_file_it_shows(tmp_path: Path) -> None:
    """maps over a folder: the unreadable file the listing skipped is named, and image 1 is
    said to be c_coffee.jpeg (the second image read, the third file listed); the picture is
    that file's, as maps on the file alone draws it. Both went unsaid."""
    folder = _folder_with_an_unreadable_first_file(tmp_path)
    r = run("maps", "resnet18", str(folder), "-l", "conv1", "--image", "1", "-o",
            str(tmp_path / "f.png"))  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert "skipped 1 image(s) that cannot be used: a_empty.png" in r.stderr
    assert "image 1 is c_coffee.jpeg" in r.stderr
    alone = run("maps", "resnet18", str(folder / "c_coffee.jpeg"), "-l", "conv1", "-o",
                str(tmp_path / "one.png"))  # fmt: skip
    assert alone.exit_code == 0, alone.stderr
    tiles = lambda p: json.loads(Image.open(p).info["hookcli"])["tiles"]  # noqa: E731
    assert [t["label"] for t in tiles(tmp_path / "f.png")] == [
        t["label"] for t in tiles(tmp_path / "one.png")
    ]


def test_a_folder_runs_picture_is_of_its_first_readable_image(tmp_path: Path) -> None:
    """inspect over a folder whose first listed file is unreadable, with --picture: the run
    skips and names that file, and the picture is of the first image it could read (the
    whole run ended with exit 2 on the unreadable file)."""
    folder = _folder_with_an_unreadable_first_file(tmp_path)
    out = tmp_path / "r.html"
    r = run("inspect", "resnet18", str(folder), "-l", "fc", "--picture", "maps:conv1", "-o",
            str(out))  # fmt: skip
    assert r.exit_code == 0, r.stderr
    page = out.read_text()
    assert "skipped 1 image(s) that cannot be used: a_empty.png" in page
    assert "drawn on the first image it could use, b_cat.jpeg" in page


def test_a_timm_models_input_panel_is_its_input_with_its_own_normalisation_undone() -> None:
    """timm's transform is a Compose whose Normalize step holds mean/std (0.5 for this ViT):
    the panel was min-max stretched instead (up to 41/255 off). Oracle: timm's own transform
    of the photo, x * std + mean, as 8-bit pixels."""
    timm = pytest.importorskip("timm")
    import hookcli

    drawing = hookcli.maps("timm:vit_tiny_patch16_224", [str(CAT)], layer="patch_embed.proj")
    model = timm.create_model("vit_tiny_patch16_224")
    config = timm.data.resolve_model_data_config(model)
    x = timm.data.create_transform(**config)(Image.open(CAT).convert("RGB"))
    mean = torch.tensor(config["mean"]).view(3, 1, 1)
    std = torch.tensor(config["std"]).view(3, 1, 1)
    want = ((x * std + mean).clamp(0, 1).permute(1, 2, 0).numpy() * 255 + 0.5).astype(np.uint8)
    got = drawing.picture.image
    assert got.shape == want.shape
    assert int(np.abs(got.astype(int) - want.astype(int)).max()) <= 1


def test_a_train_runs_embedded_picture_says_it_is_drawn_in_eval_mode(tmp_path: Path) -> None:
    """grads --train --picture cam: the report's pass ran in training mode, the picture (as
    `hookcli cam` draws it, which has no --train) in eval mode; the caption said nothing."""
    out = tmp_path / "t.html"
    r = run("grads", "resnet18", str(CAT), "-l", "fc", "--train", "--picture", "cam", "-o",
            str(out))  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert "drawn in eval mode" in out.read_text()
    r = run("grads", "resnet18", str(CAT), "-l", "fc", "--picture", "cam", "-o", str(out))
    assert r.exit_code == 0 and "drawn in eval mode" not in out.read_text()


def test_a_folder_runs_picture_skips_an_image_its_resize_would_blow_up(tmp_path: Path) -> None:
    """The first file a folder run can read is a 20000x1 strip, which the run skips (its
    resize would make gigabytes): the picture is of the next image, not an exit 2."""
    import shutil

    folder = tmp_path / "fold"
    folder.mkdir()
    Image.new("RGB", (20000, 1), "white").save(folder / "a_strip.png")
    shutil.copy(CAT, folder / "b_cat.jpeg")
    out = tmp_path / "r.html"
    r = run("inspect", "resnet18", str(folder), "-l", "fc", "--picture", "maps:conv1", "-o",
            str(out))  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert "drawn on the first image it could use, b_cat.jpeg" in out.read_text()
