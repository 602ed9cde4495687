"""PNG pictures with Pillow: feature-map grids beside the input, Grad-CAM overlays with a
colour bar, attention heads and rollout over the image. Reads numpy arrays and strings (a
commands.pictures.Picture), never torch.

Every PNG carries a `hookcli` text chunk (JSON): the title and, for grids, each tile's box and
label, so a test or a script can find what was drawn where.
"""

from __future__ import annotations

import json
import math
from typing import Any, Protocol

import numpy as np
from PIL import Image, ImageDraw, ImageFont, ImageOps, PngImagePlugin

BACKGROUND = (255, 255, 255)
INK = (20, 20, 20)
MIN_TILE = 64  # tiles are upscaled (nearest) to at least this many pixels a side
MAX_TILE = 96  # and larger maps scaled down to at most this
GAP = 4
MARGIN = 12
# Colour map for heat: dark blue → yellow → red, by Pillow's three-stop colorize.
COLD, WARM, HOT = (0, 0, 140), (255, 230, 0), (220, 0, 0)


class PictureLike(Protocol):
    title: str
    image: np.ndarray[Any, Any] | None
    tiles: np.ndarray[Any, Any] | None
    labels: list[str]
    heat: np.ndarray[Any, Any] | None
    legend: list[str]
    notes: list[str]
    layout: str
    row_tokens: list[str] | None
    col_tokens: list[str] | None


def label_font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _text_height(font: Any) -> int:
    box = font.getbbox("Hg")
    return int(box[3] - box[1]) + 4


def grid_layout(k: int, h: int, w: int) -> tuple[int, int, int, int]:
    """(rows, cols, tile height, tile width) of a grid of k tiles of h x w pixels."""
    cols = math.ceil(math.sqrt(k))
    rows = math.ceil(k / cols)
    if max(h, w) > MAX_TILE:
        f = MAX_TILE / max(h, w)
        return rows, cols, max(1, round(h * f)), max(1, round(w * f))
    scale = max(1, math.ceil(MIN_TILE / min(h, w)))
    return rows, cols, h * scale, w * scale


def _grid(
    tiles: np.ndarray[Any, Any], labels: list[str]
) -> tuple[Image.Image, list[dict[str, Any]]]:
    k, h, w = tiles.shape[:3]
    rows, cols, th, tw = grid_layout(k, h, w)
    grid = Image.new(
        "RGB", (cols * tw + (cols - 1) * GAP, rows * th + (rows - 1) * GAP), BACKGROUND
    )
    draw = ImageDraw.Draw(grid)
    font = label_font(max(10, min(16, th // 5)))
    boxes = []
    mode = "RGB" if tiles.ndim == 4 else "L"  # (K, h, w, 3) colour tiles, or grey ones
    for i in range(k):
        r, c = divmod(i, cols)
        x, y = c * (tw + GAP), r * (th + GAP)
        resample = Image.Resampling.NEAREST if th >= h else Image.Resampling.BILINEAR
        tile = Image.fromarray(tiles[i], mode=mode).resize((tw, th), resample)
        grid.paste(tile.convert("RGB"), (x, y))
        label = labels[i] if i < len(labels) else str(i)
        _label(draw, (x, y), label, font)
        boxes.append({"label": label, "box": [x, y, x + tw, y + th]})
    return grid, boxes


def _label(draw: ImageDraw.ImageDraw, at: tuple[int, int], text: str, font: Any) -> None:
    """A tile's label: yellow on a black box in its top-left corner."""
    x, y = at
    lb = draw.textbbox((x + 2, y + 1), text, font=font)
    draw.rectangle((lb[0] - 2, lb[1] - 1, lb[2] + 2, lb[3] + 1), fill=(0, 0, 0))
    draw.text((x + 2, y + 1), text, fill=(255, 255, 0), font=font)


def heat_rgb(heat: np.ndarray[Any, Any]) -> Image.Image:
    """A [0, 1] map coloured blue → yellow → red."""
    gray = Image.fromarray((np.clip(heat, 0, 1) * 255 + 0.5).astype(np.uint8), mode="L")
    return ImageOps.colorize(gray, black=COLD, mid=WARM, white=HOT)


def overlay(heat: np.ndarray[Any, Any], base: Image.Image, alpha: float = 0.55) -> Image.Image:
    """A [0, 1] map coloured and laid over `base`, more opaque where it is higher; a map
    coarser than the image (attention on a patch grid) is enlarged cell by cell."""
    coloured = heat_rgb(heat)
    mask = Image.fromarray((np.clip(heat, 0, 1) * 255 * alpha).astype(np.uint8), "L")
    if coloured.size != base.size:
        coloured = coloured.resize(base.size, Image.Resampling.NEAREST)
        mask = mask.resize(base.size, Image.Resampling.NEAREST)
    return Image.composite(coloured, base, mask)


def _colour_bar(width: int) -> Image.Image:
    """low (left, blue) → high (right, red), with its labels: a band of 30 pixels."""
    ramp = Image.linear_gradient("L").rotate(90, expand=True)  # black (low) on the left
    bar = ImageOps.colorize(ramp.resize((width, 12)), black=COLD, mid=WARM, white=HOT)
    band = Image.new("RGB", (width, 30), BACKGROUND)
    band.paste(bar, (0, 0))
    draw = ImageDraw.Draw(band)
    font = label_font(11)
    draw.text((0, 14), "low", fill=INK, font=font)
    draw.text((width - draw.textlength("high", font=font), 14), "high", fill=INK, font=font)
    return band


def _compose(
    panels: list[Image.Image], picture: PictureLike, under_last: Image.Image | None = None
) -> tuple[Image.Image, list[tuple[int, int]]]:
    """Panels side by side under a title; an optional band under the last panel; legend and
    notes below. Returns the canvas and the top-left of each panel."""
    title_font, text_font = label_font(16), label_font(13)
    th, lh = _text_height(title_font), _text_height(text_font)
    height = max(p.height for p in panels)
    width = sum(p.width for p in panels) + GAP * 3 * (len(panels) - 1)
    lines = picture.legend + [f"note: {n}" for n in picture.notes]
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    text_w = max(
        [probe.textlength(picture.title, font=title_font)]
        + [probe.textlength(s, font=text_font) for s in lines]
    )
    band = (under_last.height + GAP) if under_last is not None else 0
    canvas_w = int(max(width, text_w)) + 2 * MARGIN
    canvas_h = MARGIN + th + GAP + height + GAP + band + lh * len(lines) + MARGIN
    canvas = Image.new("RGB", (canvas_w, canvas_h), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    draw.text((MARGIN, MARGIN), picture.title, fill=INK, font=title_font)
    x = MARGIN
    top = MARGIN + th + GAP
    places = []
    for panel in panels:
        places.append((x, top + (height - panel.height) // 2))
        canvas.paste(panel, places[-1])
        x += panel.width + GAP * 3
    y = top + height + GAP
    if under_last is not None:
        canvas.paste(under_last, (places[-1][0], y))
        y += band
    for line in lines:
        draw.text((MARGIN, y), line, fill=INK, font=text_font)
        y += lh
    return canvas, places


def _input_panel(picture: PictureLike, height: int) -> Image.Image | None:
    """The input as the model saw it, at most as tall as the grid, never upscaled."""
    if picture.image is None:
        return None
    img = Image.fromarray(picture.image, mode="RGB")
    if img.height <= height:
        return img
    return img.resize(
        (max(1, round(img.width * height / img.height)), height), Image.Resampling.BILINEAR
    )


def maps_png(picture: PictureLike) -> tuple[Image.Image, dict[str, Any]]:
    assert picture.tiles is not None
    grid, boxes = _grid(picture.tiles, picture.labels)
    panels = [p for p in (_input_panel(picture, grid.height), grid) if p is not None]
    canvas, places = _compose(panels, picture)
    gx, gy = places[-1]
    for b in boxes:  # in canvas coordinates
        x0, y0, x1, y1 = b["box"]
        b["box"] = [x0 + gx, y0 + gy, x1 + gx, y1 + gy]
    return canvas, {"title": picture.title, "layout": picture.layout, "tiles": boxes}


def cam_png(picture: PictureLike, alpha: float = 0.55) -> tuple[Image.Image, dict[str, Any]]:
    assert picture.heat is not None
    if picture.image is not None:
        base = Image.fromarray(picture.image, mode="RGB")
        panels = [base, overlay(picture.heat, base, alpha)]
    else:
        panels = [heat_rgb(picture.heat)]
    size = max(224, panels[0].height)
    panels = [
        p.resize((round(p.width * size / p.height), size), Image.Resampling.BILINEAR)
        for p in panels
    ]
    canvas, _ = _compose(panels, picture, under_last=_colour_bar(panels[-1].width))
    return canvas, {"title": picture.title, "layout": picture.layout}


TOKEN_PANEL = 512  # pixels a token matrix's longer side is drawn at, at most
TOKEN_CELL = (2, 18)  # and the pixels of one token, at least and at most
LABEL_PX = 11  # a token label's font size: labels are drawn every n tokens to fit


def token_matrices(
    tiles: np.ndarray[Any, Any],
    labels: list[str],
    rows: list[str] | None,
    cols: list[str] | None,
) -> tuple[Image.Image, list[dict[str, Any]]]:
    """Token x token matrices (K, h, w, 3) in a grid, each titled above it (never over its
    first rows and columns, where attention sinks show), the query tokens down the left of the
    first column and the key tokens (turned) along the top of the first row."""
    k, h, w = tiles.shape[:3]
    cell = min(TOKEN_CELL[1], max(TOKEN_CELL[0], TOKEN_PANEL // max(h, w)))
    tw, th = w * cell, h * cell
    font, title_font = label_font(LABEL_PX), label_font(12)
    step = max(1, math.ceil((LABEL_PX + 2) / cell))  # every step-th token labelled
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    shown_rows = [(i, repr(t)) for i, t in enumerate(rows or []) if i % step == 0]
    shown_cols = [(i, repr(t)) for i, t in enumerate(cols or []) if i % step == 0]
    left = int(max((probe.textlength(t, font=font) for _, t in shown_rows), default=0)) + 4
    top = int(max((probe.textlength(t, font=font) for _, t in shown_cols), default=0)) + 4
    band = _text_height(title_font)
    ncols = math.ceil(math.sqrt(k))
    nrows = math.ceil(k / ncols)
    grid = Image.new(
        "RGB", (left + ncols * (tw + GAP), top + nrows * (band + th + GAP)), BACKGROUND
    )
    draw = ImageDraw.Draw(grid)
    boxes = []
    for i in range(k):
        r, c = divmod(i, ncols)
        x, y = left + c * (tw + GAP), top + r * (band + th + GAP)
        label = labels[i] if i < len(labels) else str(i)
        draw.text((x, y), label, fill=INK, font=title_font)
        tile = Image.fromarray(tiles[i], mode="RGB").resize((tw, th), Image.Resampling.NEAREST)
        grid.paste(tile, (x, y + band))
        boxes.append({"label": label, "box": [x, y + band, x + tw, y + band + th]})
    y0 = top + band
    for i, text in shown_rows:
        width = probe.textlength(text, font=font)
        draw.text(
            (left - 2 - width, y0 + i * cell + (cell - LABEL_PX) // 2), text, fill=INK, font=font
        )
    for i, text in shown_cols:
        width = int(probe.textlength(text, font=font)) + 2
        strip = Image.new("RGB", (width, LABEL_PX + 3), BACKGROUND)
        ImageDraw.Draw(strip).text((0, 0), text, fill=INK, font=font)
        turned = strip.rotate(90, expand=True)
        grid.paste(turned, (left + i * cell + (cell - turned.width) // 2, top - 2 - turned.height))
    return grid, boxes


def attn_png(picture: PictureLike, alpha: float = 0.55) -> tuple[Image.Image, dict[str, Any]]:
    """attn: the input, a grid of the heads' maps (over the image, or token x token
    matrices, labelled by their tokens), and the rollout with a colour bar under it."""
    assert picture.tiles is not None
    assert picture.heat is not None
    base = Image.fromarray(picture.image, mode="RGB") if picture.image is not None else None
    heads = [t.astype(np.float32) / 255 for t in picture.tiles]
    if base is not None:
        tiles = np.stack([np.asarray(overlay(m, base, alpha)) for m in heads])
        grid, boxes = _grid(tiles, picture.labels)
        rolled = overlay(picture.heat, base, alpha)
    else:
        tiles = np.stack([np.asarray(heat_rgb(m)) for m in heads])
        rows, cols = picture.row_tokens, picture.col_tokens
        grid, boxes = token_matrices(tiles, picture.labels, rows, cols)
        rolled, _ = token_matrices(
            np.asarray(heat_rgb(picture.heat))[None], ["rollout"], rows, cols
        )
    if base is not None:
        size = max(224, grid.height)
        resample = Image.Resampling.NEAREST if rolled.height < size else Image.Resampling.BILINEAR
        rolled = rolled.resize((round(rolled.width * size / rolled.height), size), resample)
        _label(ImageDraw.Draw(rolled), (0, 0), "rollout", label_font(13))
    panels = [p for p in (_input_panel(picture, grid.height), grid, rolled) if p is not None]
    canvas, places = _compose(panels, picture, under_last=_colour_bar(rolled.width))
    (gx, gy), (rx, ry) = places[-2], places[-1]
    for b in boxes:  # in canvas coordinates
        x0, y0, x1, y1 = b["box"]
        b["box"] = [x0 + gx, y0 + gy, x1 + gx, y1 + gy]
    return canvas, {
        "title": picture.title,
        "layout": picture.layout,
        "tiles": boxes,
        "rollout": {"box": [rx, ry, rx + rolled.width, ry + rolled.height]},
    }


def png_bytes_info(meta: dict[str, Any]) -> PngImagePlugin.PngInfo:
    info = PngImagePlugin.PngInfo()
    info.add_text("hookcli", json.dumps(meta))
    return info
