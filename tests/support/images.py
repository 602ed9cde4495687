"""Image folders made from the sample photos."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from tests.support.paths import CAT, COFFEE


def make_folder(root: Path, n: int, size: int = 240) -> Path:
    """n crops of the sample photos, in two class subfolders (an ImageFolder tree)."""
    cat, coffee = Image.open(CAT).convert("RGB"), Image.open(COFFEE).convert("RGB")
    for i in range(n):
        src = cat if i % 2 else coffee
        x, y = (i * 7) % 100, (i * 5) % 50
        sub = root / ("cats" if i % 2 else "cups")
        sub.mkdir(parents=True, exist_ok=True)
        src.crop((x, y, x + size, y + size)).save(sub / f"{i:04d}.png")
    return root
