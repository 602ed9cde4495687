"""Imports flow one way: the CLI entry and the renderers never import torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    [
        "hookcli",
        "hookcli.cli",
        "hookcli.records",
        "hookcli.errors",
        "hookcli.options",
        "hookcli.output",
        "hookcli.render.table",
        "hookcli.render.json",
        "hookcli.render.csv",
        "hookcli.render.fmt",
    ],
)
def test_module_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
