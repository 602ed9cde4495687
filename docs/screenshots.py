"""Regenerate the HTML report screenshots in docs/images (README, "HTML report").

    python docs/screenshots.py            # needs Debian's chromium and playwright (test extra)

Each report is written by the CLI, opened in headless Chromium with every request other than
the file itself aborted, and shot at 1480x820; the PNGs are reduced to 256 colours to keep the
repository small. Random weights (no download), seed 0: the same pictures on every machine.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
CAT = str(ROOT / "sample_images" / "cat.jpeg")
OUT = ROOT / "docs" / "images"

ATTN = ["--picture", "attn"]
# name: (hookcli arguments, what to do on the page before the shot)
SHOTS: dict[str, tuple[list[str], str]] = {
    "report_cnn": (
        ["inspect", "resnet18", CAT, "--hist"],
        "link:#layer=layer2.0.conv2&call=0",
    ),
    "report_vit": (
        ["inspect", "vit_b_16", CAT, "-l", "encoder.layers.encoder_layer_11.*", *ATTN],
        "scroll:#pictures",
    ),
    "report_diff": (
        ["diff", "resnet18", CAT, "--b", "bfloat16", "--tol", "0.005"],
        "tree",
    ),
    "report_nan": (
        ["check", "tests/support/models.py:InlineNet", "--input", "randn:16x8", "--backward"],
        "banner",
    ),
}


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        sys.exit("Debian's chromium is needed: apt-get install -y chromium")
    return path


def main() -> None:
    from playwright.sync_api import sync_playwright

    hookcli = [sys.executable, "-m", "hookcli"]
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium(),
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        for name, (args, action) in SHOTS.items():
            report = Path(tmp) / f"{name}.html"
            subprocess.run([*hookcli, *args, "-o", str(report)], cwd=ROOT, check=False)
            page = browser.new_page(viewport={"width": 1480, "height": 820})
            page.route(
                "**/*",
                lambda r: r.continue_() if r.request.url.startswith("file:") else r.abort(),
            )
            kind, _, arg = action.partition(":")
            url = report.as_uri()
            page.goto(url + (arg if kind == "link" else ""))
            page.wait_for_function("window.hookcliTiming && window.hookcliTiming.paint")
            if kind == "tree":
                page.click("#banner a")
                page.click("#tree > summary")
                page.evaluate("window.scrollTo(0, 0)")
            elif kind == "banner":
                page.click("#banner a")
                page.evaluate("window.scrollTo(0, 0)")
            elif kind == "scroll":
                page.evaluate(f"document.querySelector('{arg}').scrollIntoView()")
                page.evaluate("window.scrollBy(0, -220)")
            png = page.screenshot()
            image = Image.open(io.BytesIO(png)).convert("RGB").quantize(256)
            image.save(OUT / f"{name}.png", optimize=True)
            print(f"{name}.png: {(OUT / f'{name}.png').stat().st_size // 1024} KB")
            page.close()
        browser.close()


if __name__ == "__main__":
    main()
