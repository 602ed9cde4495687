"""Which process writes: under torchrun (or inside a process group) rank 0 alone. No torch
import: a process that never loaded torch is in no process group."""

from __future__ import annotations

import os
import sys


def launched() -> bool:
    """Whether torchrun (torch's elastic launcher) started this process: it sets
    TORCHELASTIC_RUN_ID. WORLD_SIZE and RANK alone are not enough: a SLURM or MPI job, or a
    shell that exported them once, leaves them in the environment of a process that no other
    rank will ever join (issue 32: its output was silently not written)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def writer() -> bool:
    """Whether this process writes the results: always, except a rank other than 0 of a
    process group, or of torchrun's environment (after hookcli's own group has ended)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is not None and dist.is_available() and dist.is_initialized():
        return bool(dist.get_world_size() < 2 or dist.get_rank() == 0)
    if not launched():
        return True
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) < 2 or int(os.environ["RANK"]) == 0
    except (KeyError, ValueError):
        return True


def stray_note() -> str | None:
    """A note when WORLD_SIZE > 1 is set but no launcher started this process: it ran alone."""
    if launched():
        return None
    world = os.environ.get("WORLD_SIZE", "")
    if world.strip().isdigit() and int(world) > 1:
        rank = os.environ.get("RANK", "?")
        return (
            f"WORLD_SIZE={world} and RANK={rank} are set, but torchrun did not start this "
            "process: it ran as one process and wrote its own results"
        )
    return None


def label() -> str:
    """ "rank 1 of 2: " under torchrun with several processes, else "": the prefix of every
    error line a rank prints, so that one line names the rank it comes from."""
    if not launched():
        return ""
    world, rank = os.environ.get("WORLD_SIZE", ""), os.environ.get("RANK", "")
    if world.isdigit() and int(world) > 1 and rank.isdigit():
        return f"rank {rank} of {world}: "
    return ""
