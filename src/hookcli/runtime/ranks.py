"""Which process writes: under torchrun (or inside a process group) rank 0 alone. No torch
import: a process that never loaded torch is in no process group."""

from __future__ import annotations

import os
import sys


def writer() -> bool:
    """Whether this process writes the results: always, except a rank other than 0 of a
    process group, or of torchrun's environment (after hookcli's own group has ended)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is not None and dist.is_available() and dist.is_initialized():
        return bool(dist.get_world_size() < 2 or dist.get_rank() == 0)
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) < 2 or int(os.environ["RANK"]) == 0
    except (KeyError, ValueError):
        return True
