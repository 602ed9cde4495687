"""Where the tests' files are: the checkout's root and the sample photos."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
CAT = ROOT / "sample_images" / "cat.jpeg"
COFFEE = ROOT / "sample_images" / "coffee.jpeg"
