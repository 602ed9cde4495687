"""Folder runs: throughput against a plain DataLoader + forward loop, and flat memory.

Prints, measured side by side in one process (throughput) and in fresh subprocesses (memory):

(a) images/s of hookcli's folder run (statistics of every leaf, merged across batches) ÷ a
    plain DataLoader + model(x) loop over the same folder with the same batch size and workers;
(b) peak RSS growth of a folder run over 100 and over 2,000 images (flat means the second is
    within ±10% of the first).

The images are crops of the sample photos written to a temporary folder.
Usage: python benchmarks/dataset.py [--images N] [--workers W]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import PRECISE_MALLOC, interleaved, reset_peak, status_kb

ROOT = Path(__file__).resolve().parent.parent


def make_images(folder: Path, n: int) -> None:
    from PIL import Image

    photos = [
        Image.open(ROOT / "sample_images" / name).convert("RGB")
        for name in ("cat.jpeg", "coffee.jpeg")
    ]
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        src = photos[i % 2]
        x, y = (i * 7) % 150, (i * 5) % 50
        src.crop((x, y, x + 240, y + 240)).save(folder / f"{i:05d}.jpg", quality=90)


def throughput(
    folder: Path, model_name: str, batch: int, workers: int, rounds: int
) -> dict[str, float]:
    import torch
    from torch.utils.data import DataLoader

    import hookcli
    from hookcli.commands.folder import ImageFiles, _collate, image_files
    from hookcli.sources import load_model

    loaded = load_model(model_name)
    model = loaded.module.eval()
    files = image_files([str(folder)])
    preprocess = loaded.preprocess
    assert preprocess is not None

    def plain() -> None:
        loader = DataLoader(
            ImageFiles(files, preprocess, loaded.kind),
            batch_size=batch,
            num_workers=workers,
            collate_fn=_collate,
        )
        with torch.no_grad():
            for tensors, _, _ in loader:
                model(torch.stack(tensors))

    def hooked() -> None:
        hookcli.inspect(model_name, [str(folder)], batch_size=batch, workers=workers, device="cpu")

    medians = interleaved({"plain": plain, "hookcli": hooked}, rounds)
    return {k: len(files) / v for k, v in medians.items()}


def memory_child(folder: str, model_name: str, batch: int) -> None:
    import hookcli

    tiny = Path(tempfile.mkdtemp()) / "warm"
    make_images(tiny, batch)
    hookcli.inspect(model_name, [str(tiny)], batch_size=batch, device="cpu")  # warm-up
    base = reset_peak()
    hookcli.inspect(model_name, [folder], batch_size=batch, device="cpu")
    print(json.dumps({"growth_kb": status_kb("VmHWM") - base}))


def memory(folder: Path, model_name: str, batch: int) -> float:
    res = subprocess.run(
        [sys.executable, __file__, "--memory-child", str(folder), model_name, str(batch)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **PRECISE_MALLOC},
    )
    return float(json.loads(res.stdout.strip().splitlines()[-1])["growth_kb"]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=256, help="images for the throughput test")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        folder, model_name, batch = args.memory_child
        memory_child(folder, model_name, int(batch))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_images(root / "speed", args.images)
        r = throughput(root / "speed", args.model, args.batch, args.workers, rounds=3)
        print(
            f"(a) {args.model}, {args.images} images, batch {args.batch}, "
            f"{args.workers} worker(s): "
            f"plain {r['plain']:.1f} img/s, hookcli {r['hookcli']:.1f} img/s, "
            f"ratio {r['hookcli'] / r['plain']:.3f}"
        )
        make_images(root / "n100", 100)
        make_images(root / "n2000", 2000)
        small = memory(root / "n100", "mobilenet_v3_small", args.batch)
        large = memory(root / "n2000", "mobilenet_v3_small", args.batch)
        print(
            f"(b) mobilenet_v3_small peak RSS growth: 100 images {small:.0f} MiB, "
            f"2000 images {large:.0f} MiB, ratio {large / small:.3f}"
        )


if __name__ == "__main__":
    main()
