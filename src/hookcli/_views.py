"""Where records finds its views (the CLI's table, the notebook's HTML, a DataFrame of a report):
a loader the package installs (hookcli/__init__.py). records imports no renderer, since the
renderers import records; this module imports nothing, so neither import costs the other."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LOADERS: list[Callable[[], Any]] = []


def views() -> Any:
    """hookcli.render.views, through the installed loader."""
    if not LOADERS:  # hookcli/__init__.py runs before any of its submodules: never empty
        raise RuntimeError("hookcli's views are not installed")
    return LOADERS[0]()
