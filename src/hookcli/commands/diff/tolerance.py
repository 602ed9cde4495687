"""diff's default tolerance, from the precision of the sides it compares.

A row is past tolerance when its relative L2 error is larger than the sides' own rounding can
explain. Rounding to a 16-bit float dominates what a layer in that precision adds (oneDNN and
cuBLAS accumulate in float32, then round the output once), so the default for float16 and
bfloat16 is 8 times their unit roundoff u (2^-11 and 2^-8): a layer's own error is about u, and what
a network passes on grows to a few u. In float32 and float64 the order of summation is what
differs between kernels, far below 1e-3 even after many layers, so 1e-3 stays the default for
them. int8 (per-tensor affine steps) costs each layer 1-3 % of its output and grows through a
network: 1e-1, an SQNR of 20 dB. 4-bit weights (GGUF Q4, NF4, int4 groups; a weight SQNR near
20 dB) cost each layer about 10 %: 3e-1, an SQNR of about 10 dB. The default is the coarsest
side's; --tol always wins.
No torch here: a saved report's dtypes (names) pick the same defaults.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Precision:
    name: str
    tol: float
    why: str


FLOAT32 = Precision("float32", 1e-3, "kernel order and accumulation stay far below it")
PRECISIONS = {
    p.name: p
    for p in (
        Precision("float64", 1e-3, "as float32's: kernel order stays far below it"),
        FLOAT32,
        Precision("float16", 4e-3, "8 times its unit roundoff 2^-11"),
        Precision("bfloat16", 3e-2, "8 times its unit roundoff 2^-8"),
        Precision("int8", 1e-1, "an SQNR of 20 dB; int8 steps cost each layer 1-3 %"),
        Precision("int4", 3e-1, "an SQNR of about 10 dB; 4-bit weights cost a layer ~10 %"),
    )
}
# a saved report's dtype names → their precision (quantized tensors are int8's)
DTYPE_PRECISION = {
    "float64": "float64",
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "quint8": "int8",
    "qint8": "int8",
    "qint32": "int8",
    "quint4x2": "int8",
}


def default_tol(precisions: Iterable[str]) -> tuple[float, str]:
    """The coarsest of the precisions' tolerances and its reason, as the report states it."""
    found = [PRECISIONS.get(p, FLOAT32) for p in precisions] or [FLOAT32]
    top = max(found, key=lambda p: p.tol)
    return top.tol, f"default for {top.name}: {top.why}; --tol sets another"
