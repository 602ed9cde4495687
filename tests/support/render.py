"""A laid-out table as the terminal shows it."""

from __future__ import annotations

import io
import re

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def grid_text(grid: object, color: bool, width: int, rich_only: bool) -> str:
    from rich.console import Console

    buf = io.StringIO()
    console = Console(
        file=buf, width=width, force_terminal=color, no_color=not color,
        color_system="standard" if color else None, highlight=False, soft_wrap=False,
    )  # fmt: skip
    if rich_only:
        grid._laid_out = lambda *a: None  # type: ignore[attr-defined]
    console.print(grid)
    text = buf.getvalue()
    return "\n".join(line.rstrip() for line in ANSI.sub("", text).splitlines())
