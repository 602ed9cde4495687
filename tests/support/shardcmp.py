"""A sharded run's report against the same model's in one process: every layer call's input,
output and gradient statistics, and every parameter's norm and gradient, by (layer, kind,
path)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest

STATS = ("mean", "std", "min", "max", "zeros", "nan", "inf", "norm")


def zeros_slack(kind: str, shape: Sequence[int], numel: int) -> float:
    """How far two runs' zero fractions of one tensor may differ: not at all, except for a
    gradient, whose elements that are zero only in exact arithmetic — a query's gradient at
    the first position (its attention has one key) or where no loss reads — come out of a
    fused attention backward as 0 or as rounding residue by how its GEMMs were blocked, which
    a shard changes (seen on a CPU with AVX512-BF16: one head of one position; on an AMD EPYC,
    two heads of Qwen3's q_norm input, (batch, tokens, heads, head_dim)). Up to one position's
    features either way (every head's: all that follows batch and position); the other
    statistics are held to rounding all the same."""
    if not kind.startswith("grad") or not shape or not numel:
        return 0.0
    return math.prod(shape[2:] if len(shape) > 2 else shape[-1:]) / numel


def entries(report: dict[str, Any]) -> dict[tuple[str, ...], dict[str, Any]]:
    out = {}
    for c in report["layers"]:
        name = c["name"].removeprefix("module.")  # (DDP's wrapper names them so)
        for kind in ("inputs", "outputs", "grad_inputs", "grad_outputs"):
            for t in c.get(kind) or []:
                out[(name, kind, t["path"])] = t
        for p in c.get("params") or []:
            out[(name, "param", p["name"])] = {"norm": p["norm"], "shape": p["shape"]}
            out[(name, "param grad", p["name"])] = p["grad"]
    return out


def assert_same(
    sharded: dict[str, Any], single: dict[str, Any], *, but: tuple[str, ...] = ()
) -> None:
    a, b = entries(sharded), entries(single)
    assert a.keys() == b.keys()
    for key in a:
        if key[0] in but:
            continue
        x, y = a[key], b[key]
        assert x["shape"] == y["shape"], key
        assert x.get("note") == y.get("note"), (key, x.get("note"))  # (padding left out)
        for s in STATS:
            u, v = x.get(s), y.get(s)
            assert (u is None) == (v is None), (key, s)
            if u is None:
                continue
            if s == "zeros":
                slack = zeros_slack(key[1], y["shape"], y.get("numel") or 0)
                assert abs(u - v) <= slack + 1e-12, (key, s, u, v)
            else:
                assert u == pytest.approx(v, rel=1e-5, abs=1e-6), (key, s, u, v)
