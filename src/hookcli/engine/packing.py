"""The layout of --channels' packed vector (engine.channels), shared with its numba kernels
(engine._chankernels) without importing torch: per channel, these rows of a (PER_CHANNEL, C)
block — the count of values, their mean, Σ(x - mean)², min, max, how many are zero, how many
reach |x| >= 6, how many were masked."""

COUNT, MEAN, M2, MIN, MAX, ZEROS, LARGE_N, MASKED = range(8)
PER_CHANNEL = 8
# numba caches _chankernels' machine code with these values baked in, and sees only that
# file's own changes: change a value here, and change _chankernels.py too (or its cache).
