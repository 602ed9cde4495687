"""A CUDA tensor's row by the fused Triton kernel (engine/_triton.py): one read of the data
and two launches at most, instead of torch ops' dozen of each. Where Triton is missing (a
CPU-only build, macOS) or cannot build the kernel for this device, None: the caller's torch ops
measure it, exactly, as before."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from hookcli.engine.tensorbits import dense_flat
from hookcli.runtime import preload

# the dtypes the kernel reads as they are (others go to torch ops: integers, bool, float8)
_READ = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_broken = [False]  # the kernel failed to build or run once in this process: not tried again


@functools.cache
def _kernels() -> ModuleType | None:
    try:
        from hookcli.engine import _triton
    except Exception:  # no Triton here
        return None
    return _triton


def fused_row(x: torch.Tensor) -> torch.Tensor | None:
    """x's row (9 float64 numbers on its device, no synchronisation) when x is a non-empty
    CUDA tensor of a floating dtype the kernel reads; else None."""
    if not x.is_cuda or x.dtype not in _READ or x.numel() == 0 or _broken[0]:
        return None
    if preload.kept_off():  # HOOKCLI_STATS=torch: the torch-ops statistics everywhere
        return None
    kernels = _kernels()
    if kernels is None:
        return None
    try:
        if x.device.index not in (None, torch.cuda.current_device()):
            with torch.cuda.device(x.device):  # Triton launches on the current device
                row: torch.Tensor = kernels.row(dense_flat(x))
        else:
            row = kernels.row(dense_flat(x))
    except Exception:  # e.g. a device Triton cannot compile for
        _broken[0] = True
        return None
    return row
