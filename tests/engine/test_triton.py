"""The fused CUDA statistics kernel (engine/_triton.py), run on this CPU by Triton's
interpreter: every row equals float64 torch on the tensor, and is bitwise the same run to run.
On a GPU, tests/engine/test_gpu.py runs the same kernel compiled."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hookcli.engine.statrow import fill
from hookcli.engine.tensorbits import token_rows
from hookcli.records import TensorStats
from tests.support.oracles import assert_stats_match
from tests.support.paths import ROOT

pytest.importorskip("triton")

_RUN = """
import sys, torch
from hookcli.engine import _triton
cases = torch.load(sys.argv[1])
rows = {}
for name, (x, block, chunk) in cases.items():
    rows[name] = [_triton.row(x, block=block, chunk=chunk) for _ in range(2)]
torch.save(rows, sys.argv[2])
"""


def _cases() -> dict[str, tuple[torch.Tensor, int, int]]:
    """Each tensor with the block and chunk sizes it is measured with: the real ones, and
    small ones that make a tensor of a few thousand elements many blocks in many chunks."""
    g = torch.Generator().manual_seed(3)
    dirty = torch.randn(3 * 4096 + 123, generator=g)
    dirty[::97] = math.nan
    dirty[5::101] = math.inf
    dirty[7::103] = -math.inf
    dirty[::5] = 0.0
    cases = {
        "randn, blocks": (torch.randn(3 * 4096 + 123, generator=g), 4096, 1024),
        "nan, inf and zeros, blocks": (dirty, 4096, 1024),
        "one block exactly": (torch.randn(4096, generator=g), 4096, 1024),
        "one block and one": (torch.randn(4097, generator=g), 4096, 1024),
        "many chunks": (torch.randn(1000, generator=g) * 3 + 1, 16, 4),
        "many chunks, dirty": (dirty[:1000].clone(), 16, 4),
        "one element": (torch.tensor([3.5]), 4096, 1024),
        "all nan": (torch.full((10,), math.nan), 4096, 1024),
        "all inf, blocks": (torch.full((40,), math.inf), 16, 4),
        "constant, blocks": (torch.full((1000,), 0.1), 64, 8),
        "ill-conditioned": (torch.randn(20000, generator=g) * 1e-3 + 1000.0, 4096, 1024),
        "huge values": (torch.tensor([3e38, -3e38, 2.5e38, 0.0]), 4096, 1024),
        "subnormal": (torch.randn(2000, generator=g) * 1e-42, 256, 4),
        "signed zeros": (torch.tensor([-0.0, 0.0, 1.5] * 1000), 256, 4),
        "float16": ((torch.randn(6000, generator=g) * 100).half(), 4096, 1024),
        "bfloat16": (torch.randn(9000, generator=g).bfloat16(), 4096, 1024),
        "float64": (torch.randn(9000, generator=g, dtype=torch.float64), 4096, 1024),
    }
    return cases


def _interpreted(script: str, cases: dict[str, Any], tmp_path: Path) -> Any:
    """`script` run on `cases` in a process of its own under Triton's interpreter (set before
    Triton is imported): what it saved."""
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src")}
    subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script, tmp_path / "cases.pt", tmp_path / "out.pt"],
        check=True,
        env=env,
        timeout=600,
    )
    return torch.load(tmp_path / "out.pt")


def test_the_fused_kernel_equals_float64_torch_and_repeats_bitwise(tmp_path: Path) -> None:
    cases = _cases()
    rows = _interpreted(_RUN, cases, tmp_path)
    assert set(rows) == set(cases)
    for name, (x, _, _) in cases.items():
        first, second = rows[name]
        assert first.dtype == torch.float64 and first.shape == (9,)
        assert first.view(torch.int64).equal(second.view(torch.int64)), name  # bitwise
        stats = fill(TensorStats("x", tuple(x.shape), str(x.dtype), x.numel()), first.tolist())
        assert_stats_match(stats, x)
    constant = rows["constant, blocks"][0].tolist()
    value = float(torch.tensor(0.1))  # the float32 nearest 0.1
    assert constant[1] == value and constant[2] == 0.0  # exactly: the value, no spread


_TOKENS_RUN = """
import sys, torch
from hookcli.engine import _triton
cases = torch.load(sys.argv[1])
rows = {name: [_triton.token_rows(x, block=block) for _ in range(2)]
        for name, (x, block) in cases.items()}
torch.save(rows, sys.argv[2])
"""


def _token_cases() -> dict[str, tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(5)
    dirty = torch.randn(2, 6, 700, generator=g)
    dirty[0, 1, 5] = math.nan
    dirty[0, 1, 600] = math.nan  # the first NaN's channel, as torch's max gives it
    dirty[0, 2, 650] = math.inf
    dirty[0, 3, 10] = -math.inf
    dirty[0, 3, 11] = math.inf  # inf - inf: NaN mean and std, the first |inf| the max
    dirty[1, 0, :] = 0.25  # a constant position
    dirty[1, 1, 100] = -40.0
    dirty[1, 1, 650] = 40.0  # a tie in |x| across blocks: the earlier channel
    dirty[1, 2, :] = 0.0
    return {
        "randn, blocks of channels": (torch.randn(3, 5, 1000, generator=g), 256),
        "nan, inf, ties, constants": (dirty, 256),
        "fewer channels than a block": (torch.randn(2, 3, 40, generator=g), 1024),
        "one position, one channel": (torch.tensor([[[-3.0]]]), 1024),
        "large mean": (torch.randn(1, 4, 3000, generator=g) * 1e-3 + 1e3, 1024),
        "float16": ((torch.randn(2, 4, 900, generator=g) * 50).half(), 256),
        "bfloat16": (torch.randn(2, 4, 900, generator=g).bfloat16(), 256),
        "float64": (torch.randn(2, 4, 900, generator=g, dtype=torch.float64), 256),
    }


def test_the_per_token_kernel_equals_torch_s_rows_and_repeats_bitwise(tmp_path: Path) -> None:
    """--per-token on CUDA: the kernel's five numbers per position equal tensorbits.token_rows
    (float64 torch) to rounding — NaN where torch has NaN, the same channel of the max — and
    are bitwise the same run to run."""
    cases = _token_cases()
    rows = _interpreted(_TOKENS_RUN, cases, tmp_path)
    assert set(rows) == set(cases)
    for name, (x, _) in cases.items():
        first, second = rows[name]
        assert first.dtype == torch.float64 and first.shape == (*x.shape[:-1], 5), name
        assert first.view(torch.int64).equal(second.view(torch.int64)), name  # bitwise
        want = token_rows(x)
        assert torch.equal(first[..., 4], want[..., 4]), name  # the channel, exactly
        assert torch.equal(first.isnan(), want.isnan()), name
        # to rounding, against each position's scale (its RMS: a std far below a large mean
        # carries the mean's rounding, in torch's figure as in the kernel's)
        rms = (want[..., :1] / math.sqrt(x.shape[-1])).nan_to_num(posinf=0.0)
        gap = (first - want).abs().nan_to_num(0.0)  # (NaN where both are NaN, checked above)
        assert bool((gap <= 1e-12 * torch.maximum(want.abs(), rms).nan_to_num(0.0)).all()), name
    constant = rows["nan, inf, ties, constants"][0][1, 0].tolist()
    assert constant[1] == 0.25 and constant[2] == 0.0 and constant[4] == 0.0
