"""What runtime.preload's thread loads: numba, the statistics' kernels (engine._kernels,
engine._chankernels) and their cached machine code. No torch: the thread may run while the
caller imports it."""

from __future__ import annotations


def load() -> None:
    """Import numba and the kernels, and call the serial ones once: the first call loads numba's
    type registries (most of the second this takes) and each one's machine code from the
    cache. Serial only: numba's thread pool starts on the caller's first parallel call, in the
    caller's thread."""
    import numpy as np

    from hookcli.engine import _chankernels, _kernels

    values, out = np.zeros(8, np.float32), np.zeros(7)
    _kernels.fused_serial(values, out)
    _kernels.careful_serial(values, 0.0, out)
    at = np.array([values.ctypes.data, values.ctypes.data + 16], np.uint64)
    _kernels.fused_at(at, np.array([4, 4], np.int64), np.zeros((2, 7)), 4, np.zeros(8))
    rows, block, moments = np.zeros((2, 4), np.float32), np.zeros((8, 4)), np.zeros(2)
    _chankernels.first_rows_serial(rows, np.float32(6), block)  # --channels' own
    _chankernels.second_rows_serial(rows, block[1], 0.0, block, moments)
