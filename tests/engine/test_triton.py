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

from hookcli.engine import devicerow
from hookcli.engine.channels import (
    LARGE,
    from_channel_rows,
    hist_bounds,
    measure_channels,
    unpack,
)
from hookcli.engine.heads import head_numbers
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


_POOL_RUN = """
import sys, torch
from hookcli.engine import _triton
cases = torch.load(sys.argv[1])
pools, places = {}, {}
for name, (x, block, chunk) in cases.items():  # a pool per chunk size, its tensors in turn
    pool = pools.setdefault(chunk, _triton.Pool(chunk=chunk))
    places[name] = (chunk, pool.add(x.reshape(-1), block=block))
_triton.POOL_BLOCKS = 8  # a buffer of few blocks: merged when full, and used again
small = _triton.Pool()
small_places = {name: small.add(x.reshape(-1), block=block)
                for name, (x, block, chunk) in cases.items() if chunk == 1024}
rows = {chunk: pool.rows() for chunk, pool in pools.items()}
small_rows = small.rows()
out = {name: (rows[chunk][at], _triton.row(cases[name][0], block=cases[name][1], chunk=chunk))
       for name, (chunk, at) in places.items()}
out.update({"small buffers: " + name: (small_rows[at], out[name][1])
            for name, at in small_places.items()})
torch.save(out, sys.argv[2])
"""


def test_a_pool_of_a_pass_s_rows_merges_each_as_the_kernel_alone_does(tmp_path: Path) -> None:
    """Issue 52: the rows of a pass started in a pool (one launch each) and merged after it,
    many tensors in one launch, are bitwise those of `row` (two launches each) — over buffers
    big and small (a tensor that does not fit starts the next) — and equal float64 torch."""
    cases = _cases()
    got = _interpreted(_POOL_RUN, cases, tmp_path)
    big = [n for n, (_, _, chunk) in cases.items() if chunk == 1024]
    assert set(got) == set(cases) | {f"small buffers: {n}" for n in big}
    for name, (pooled, alone) in got.items():
        assert pooled.view(torch.int64).equal(alone.view(torch.int64)), name  # bitwise
        x = cases[name.removeprefix("small buffers: ")][0]
        stats = fill(TensorStats("x", tuple(x.shape), str(x.dtype), x.numel()), pooled.tolist())
        assert_stats_match(stats, x)


_MANY_RUN = """
import sys, torch
from hookcli.engine import _triton
cases = torch.load(sys.argv[1])
groups = {}
for name, (x, block, chunk) in cases.items():  # one launch a (dtype, block, chunk)
    groups.setdefault((x.dtype, block, chunk), []).append(name)
out = {}
for (dtype, block, chunk), names in groups.items():
    for size in (1 << 15, 8):  # a buffer that holds them all; one of 8 blocks
        _triton.POOL_BLOCKS = size
        pool = _triton.Pool(chunk=chunk)
        places = pool.add_many([cases[n][0].reshape(-1) for n in names], block=block)
        rows = pool.rows()
        for n, at in zip(names, places):
            alone = _triton.row(cases[n][0], block=block, chunk=chunk)
            out[f"{n}, buffer {size}"] = (rows[at], alone)
torch.save(out, sys.argv[2])
"""


def test_many_tensors_in_one_launch_give_each_one_s_row_bitwise(tmp_path: Path) -> None:
    """Issue 52 (a model's weights and gradients): many tensors of one dtype started by one
    launch, each block found by its offset from the first tensor's address — tensors of many
    blocks and of one, aligned views into one storage before and after the first, a buffer too small
    for them all (the rest start the next) — give bitwise `row`'s numbers, which equal float64
    torch."""
    cases = _cases()
    g = torch.Generator().manual_seed(9)
    storage = torch.randn(30000, generator=g)
    # (16-byte aligned, as add_many takes them)
    cases["a view late in a storage"] = (storage[20000:29000], 4096, 1024)
    cases["a view early in it"] = (storage[4:9000], 4096, 1024)  # before the first: offset < 0
    cases["the storage's tail, four elements"] = (storage[-4:], 4096, 1024)
    got = _interpreted(_MANY_RUN, cases, tmp_path)
    assert len(got) == 2 * len(cases)
    for name, (pooled, alone) in got.items():
        assert pooled.view(torch.int64).equal(alone.view(torch.int64)), name  # bitwise
        x = cases[name.rsplit(", buffer ", 1)[0]][0]
        stats = fill(TensorStats("x", tuple(x.shape), str(x.dtype), x.numel()), pooled.tolist())
        assert_stats_match(stats, x)


_OVERFLOW_RUN = """
import sys, torch
from hookcli.engine import _triton
cases = torch.load(sys.argv[1])
out = {}
for name, (x, block) in cases.items():
    pool = _triton.Pool()
    at = pool.add(x, block=block)
    out[name] = (pool.rows()[at], _triton.row(x, block=block))
torch.save(out, sys.argv[2])
"""


def test_sums_that_overflow_float64_give_an_infinite_variance_either_way(tmp_path: Path) -> None:
    """float64 values whose sum overflows: the mean is inf, and so is the variance, whether the
    tensor is one block or many, merged alone or in a pool (Chan's correction would be
    inf - inf: each block's own M2 is kept)."""
    x = torch.tensor([1e308, 1.5e308], dtype=torch.float64)
    got = _interpreted(_OVERFLOW_RUN, {"one block": (x, 4096), "blocks": (x.repeat(40), 16)},
                       tmp_path)  # fmt: skip
    for name, (pooled, alone) in got.items():
        assert pooled.view(torch.int64).equal(alone.view(torch.int64)), name
        assert pooled[1].item() == math.inf and pooled[2].item() == math.inf, name


_COLLECTOR_RUN = """
import sys, torch
from hookcli.engine import _triton, devicerow, stats
cases = torch.load(sys.argv[1])
# the interpreter's tensors are on the CPU: the kernel made usable there, the CPU's own
# kernels kept out, so that the collector takes its device way
devicerow._usable = lambda x, name: _triton if x.dtype in devicerow._READ else None
stats._CPU_DTYPES = ()
launched = []
add = _triton.Pool.add
_triton.Pool.add = lambda self, x, **k: launched.append(1) or add(self, x, **k)
c = stats.StatsCollector()
got = [c.add(x, name) for name, x in cases.items()]
again = c.add(cases["bfloat16"], "bfloat16")  # seen: measured once
c.finalize()
torch.save({"rows": [(s.mean, s.std, s.min, s.max, s.nan, s.inf, s.zeros, s.norm) for s in got],
            "again": again.mean, "launched": len(launched)}, sys.argv[2])
"""


def test_the_collector_starts_device_rows_and_finishes_them_after_the_pass(
    tmp_path: Path,
) -> None:
    """Through StatsCollector: every device tensor's row started in the pass (one launch),
    finished at finalize, each TensorStats the float64 oracle's — integers (widened to float64)
    too."""
    g = torch.Generator().manual_seed(4)
    dirty = torch.randn(3 * 4096 + 9, generator=g, dtype=torch.float64)
    dirty[::97] = math.nan
    dirty[3::101] = -math.inf
    cases = {
        "bfloat16": (torch.randn(5000, generator=g) * 3).bfloat16(),
        "float16": torch.randn(64, 7, generator=g).half().t(),  # gapped: copied dense
        "float64, dirty": dirty,
        "int64": torch.randint(-5, 5, (300,), generator=g),
        "one element": torch.tensor([2.5], dtype=torch.float64),
    }
    got = _interpreted(_COLLECTOR_RUN, cases, tmp_path)
    assert got["launched"] == len(cases)  # one launch each; none for the one seen again
    for (name, x), row in zip(cases.items(), got["rows"], strict=True):
        stats = TensorStats(name, tuple(x.shape), str(x.dtype), x.numel())
        stats.mean, stats.std, stats.min, stats.max = row[:4]
        stats.nan, stats.inf, stats.zeros, stats.norm = row[4:]
        assert_stats_match(stats, x)
    assert got["again"] == got["rows"][0][0]


_WHOLE_RUN = """
import sys, torch
from hookcli.engine import _triton, devicerow, stats
cases = torch.load(sys.argv[1])
devicerow._usable = lambda x, name: _triton if x.dtype in devicerow._READ else None
stats._CPU_DTYPES = ()
launches = []
for name in ("add", "add_many"):
    real = getattr(_triton.Pool, name)
    def counted(self, x, _real=real, _name=name, **k):
        launches.append(_name)
        return _real(self, x, **k)
    setattr(_triton.Pool, name, counted)
c = stats.StatsCollector()
items = list(cases.items())
whole = c.add_whole([(x, name) for name, x in items])
norms = c.norms([(x, name) for name, x in items])
c.finalize()
torch.save({"rows": [(s.mean, s.std, s.min, s.max, s.nan, s.inf, s.zeros, s.norm, s.values)
                     for s in whole],
            "norms": [n.norm if isinstance(n, stats.TensorStats) else n for n in norms],
            "launches": launches}, sys.argv[2])
"""


def test_a_model_s_weights_and_gradients_on_a_device_start_together(tmp_path: Path) -> None:
    """Issue 52: `add_whole` and `norms` (grads' weights and gradients) start the device
    tensors' rows together, one launch a dtype, not one each; a tensor with gaps or of a dtype
    the kernel does not read is measured alone; every TensorStats (a small one's elements too)
    and norm is the float64 oracle's."""
    g = torch.Generator().manual_seed(5)
    cases = {
        "w1": torch.randn(64, 70, generator=g).bfloat16(),
        "b1": torch.randn(7, generator=g).bfloat16(),  # small: its elements too
        "w2": torch.randn(5000, generator=g, dtype=torch.float64),
        "w3": (torch.randn(9000, generator=g) * 4).bfloat16(),
        "b2": torch.randn(3, generator=g, dtype=torch.float64),
        "gapped": torch.randn(30, 20, generator=g, dtype=torch.float64).t(),
        "int": torch.randint(-4, 4, (50,), generator=g),
    }
    got = _interpreted(_WHOLE_RUN, cases, tmp_path)
    # add_whole: one launch for the two bfloat16, one for the three float64 with the gapped
    # one alone, the integers alone; norms: all of them seen already, no launch
    assert sorted(got["launches"]) == ["add", "add", "add_many", "add_many"]
    for (name, x), row, norm in zip(cases.items(), got["rows"], got["norms"], strict=True):
        stats = TensorStats(name, tuple(x.shape), str(x.dtype), x.numel())
        stats.mean, stats.std, stats.min, stats.max = row[:4]
        stats.nan, stats.inf, stats.zeros, stats.norm = row[4:8]
        assert_stats_match(stats, x)
        assert norm == pytest.approx(x.double().norm().item(), rel=1e-12), name
        if x.numel() <= 16:
            assert row[8] == [float(v) for v in x.double().reshape(-1)], name


_PLAIN_RUN = """
import sys, torch
from hookcli.engine import _triton, devicerow
cases = torch.load(sys.argv[1])
cases["memoryless zeros"] = torch._efficientzerotensor(5)  # (torch.save refuses one)
pools = {}
places = {name: devicerow.started_plain(x, pools) for name, x in cases.items()}
rows = devicerow.finished_rows(pools)
out = {name: (None if at is None else rows[cases[name].device][at]) for name, at in places.items()}
alone = {name: _triton.row(cases[name]).tolist() for name, at in places.items() if at is not None}
torch.save({"got": out, "alone": alone}, sys.argv[2])
"""


def test_a_layer_call_s_plain_tensor_is_started_as_it_lies_or_not_at_all(
    tmp_path: Path,
) -> None:
    """Issue 52 (`StatsCollector.quick` on CUDA): `started_plain` starts a contiguous,
    non-empty tensor of a dtype the kernel reads where it lies, its row `row`'s bitwise; any
    other (gaps, empty, integers, a lazily negated view, memoryless zeros) it leaves to
    `add`'s way (None), starting nothing."""
    g = torch.Generator().manual_seed(6)
    plain = torch.randn(3, 4096 + 5, generator=g)
    cases = {
        "float32, blocks": plain,
        "bfloat16": torch.randn(70, 9, generator=g).bfloat16(),
        "gapped": plain.t(),
        "empty": torch.zeros(0, 4),
        "integers": torch.arange(12).reshape(3, 4),
        "negated view": torch._neg_view(torch.randn(8, generator=g)),
    }  # (and memoryless zeros, made in the run)
    got = _interpreted(_PLAIN_RUN, cases, tmp_path)
    started = {name for name, row in got["got"].items() if row is not None}
    assert started == {"float32, blocks", "bfloat16"}
    for name in started:
        assert got["got"][name] == got["alone"][name], name  # (floats: bitwise as compared)


_DIFF_RUN = """
import sys, torch
from hookcli.engine import _triton
cases = torch.load(sys.argv[1])
out = {name: [_triton.diff_sums(a.reshape(-1), b.reshape(-1), block=block, chunk=chunk)
              for _ in range(2)]
       for name, (a, b, block, chunk) in cases.items()}
torch.save(out, sys.argv[2])
"""


def test_the_diff_kernel_gives_the_torch_sums_and_repeats_bitwise(tmp_path: Path) -> None:
    """Issue 52 item 3: diff's nine sums on CUDA from one read of each side (float32 against
    bfloat16, as `diff --b bfloat16` compares; NaN and Inf on either side; many blocks in many
    chunks) equal commands/diff/ondevice.sums' float64 torch ops, and repeat bitwise."""
    from hookcli.commands.diff import ondevice

    g = torch.Generator().manual_seed(11)
    a = torch.randn(3 * 4096 + 77, generator=g) * 3
    dirty_a, dirty_b = a.clone(), a.bfloat16()
    dirty_a[::89] = math.nan
    dirty_b[5::97] = math.inf
    dirty_b[7::101] = math.nan
    dirty_a[9::103] = -math.inf
    cases = {
        "float32 vs bfloat16": (a, a.bfloat16(), 4096, 1024),
        "NaN and Inf on each side": (dirty_a, dirty_b, 4096, 1024),
        "many blocks in many chunks": (a[:1000], (a[:1000] * 1.001).half(), 16, 4),
        "identical": (a[:5000], a[:5000].clone(), 4096, 1024),
        "one element": (torch.tensor([2.0]), torch.tensor([-1.5]), 4096, 1024),
        "float64": (a.double()[:3000], a.double()[:3000] + 1e-9, 256, 4),
    }
    got = _interpreted(_DIFF_RUN, cases, tmp_path)
    for name, (x, y, _, _) in cases.items():
        first, second = got[name]
        assert first.view(torch.int64).equal(second.view(torch.int64)), name  # bitwise
        want = ondevice.sums(x, y)  # (CPU tensors: the torch ops)
        torch.testing.assert_close(first, want, rtol=1e-12, atol=0.0, msg=name)


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


_CHANNELS_RUN = """
import sys, torch
from hookcli.engine import _triton
cases = torch.load(sys.argv[1])
rows = {}
for name, x in cases.items():
    lowest = float(torch.finfo(x.dtype).min)
    rows[name] = [_triton.channel_rows(x, lowest, 6.0, block_c=16, block_n=32) for _ in range(2)]
torch.save(rows, sys.argv[2])
"""


def _channel_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    dirty = torch.randn(70, 40, generator=g) * 3  # some |x| >= 6
    dirty[3, 1] = math.nan
    dirty[5, 2] = math.inf
    dirty[:, 7] = -math.inf  # a channel an attention mask filled: no value, all masked
    dirty[9, 3] = torch.finfo(torch.float32).min  # the mask's fill value
    dirty[10:20, 4] = 0.0
    dirty[11, 5] = 5000.0  # a massive activation: the median |x| and the top values read
    return {
        "randn, blocks of rows and channels": torch.randn(100, 50, generator=g),
        "nan, inf, masked, zeros, massive": dirty,
        "large mean": torch.randn(90, 20, generator=g, dtype=torch.float64) * 1e-3 + 1e3,
        "float16": (torch.randn(40, 33, generator=g) * 20).half(),
        "bfloat16": torch.randn(40, 33, generator=g).bfloat16(),
        "one row": torch.randn(1, 17, generator=g),
    }


def _close_lists(got: list[Any], want: list[Any], tol: float, name: str) -> None:
    assert [g is None for g in got] == [w is None for w in want], name
    for g, w in zip(got, want, strict=True):
        if g is not None:
            assert abs(g - w) <= tol * max(1.0, abs(w)), (name, g, w)


def test_the_per_channel_kernels_equal_the_torch_path_and_repeat_bitwise(tmp_path: Path) -> None:
    """--channels on CUDA: the two kernels' per-channel rows, with the median and top values
    read from the tensor in its own dtype (channels.from_channel_rows), give the ChannelStats
    the torch path gives (float64 torch) to rounding, and repeat bitwise."""
    cases = _channel_cases()
    rows = _interpreted(_CHANNELS_RUN, cases, tmp_path)
    assert set(rows) == set(cases)
    for name, x in cases.items():
        first, second = rows[name]
        assert first.shape == (10, x.shape[1]) and first.dtype == torch.float64, name
        assert first.view(torch.int64).equal(second.view(torch.int64)), name  # bitwise
        c = x.shape[1]
        got, got_top = unpack(from_channel_rows(x, first, float(torch.finfo(x.dtype).min)), 1, c)
        want, want_top = unpack(measure_channels(x, 1), 1, c)
        assert got.count == want.count and got.zeros == want.zeros, name
        assert got.large == want.large and got.masked == want.masked, name
        for field in ("mean", "std", "min", "max", "absmax"):
            _close_lists(getattr(got, field), getattr(want, field), 1e-9, f"{name} {field}")
        _close_lists([got.kurtosis], [want.kurtosis], 1e-9, f"{name} kurtosis")
        # the median |x|, where some |x| could be massive: in float32 as the torch path reads it
        _close_lists([got.median_abs], [want.median_abs], 1e-6, f"{name} median")
        if want.median_abs is not None:  # a massive activation: the top values, exactly
            assert got_top[: len(want_top)] == want_top, name
    masked = rows["nan, inf, masked, zeros, massive"][0]
    assert masked[7, 7] == 70 and masked[0, 7] == 0  # all masked: no value
    assert masked[7, 3] == 1 and masked[0, 1] == 69 and masked[0, 2] == 69  # NaN, +inf
    assert masked[5, 4] == 10  # zeros
    assert bool((masked[6] > 0).any()) and LARGE == 6.0  # some |x| >= 6


_HEADS_RUN = """
import sys, torch
from hookcli.engine import _triton
cases = torch.load(sys.argv[1])
sums = {}
for name, (p, counted) in cases.items():
    sums[name] = [_triton.head_sums(p, counted, block_q=8, block_k=16) for _ in range(2)]
torch.save(sums, sys.argv[2])
"""


def _head_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Attention probabilities (B, H, L, L) and the real tokens (B, L) of padded batches."""
    g = torch.Generator().manual_seed(11)

    def causal(b: int, h: int, length: int, real: torch.Tensor | None = None) -> torch.Tensor:
        scores = torch.randn(b, h, length, length, generator=g, dtype=torch.float64) * 3
        allowed = torch.ones(length, length, dtype=torch.bool).tril()
        if real is not None:  # padding is never attended
            allowed = allowed & real[:, None, None, :]
        return scores.masked_fill(~allowed, -math.inf).softmax(-1).nan_to_num(0.0)

    left = torch.ones(3, 70, dtype=torch.bool)
    left[1, :9] = False  # padded on the left
    left[2, :69] = False  # one real token: no query counted
    nan = causal(2, 3, 40)
    nan[0, 1, 20, 5] = math.nan
    return {
        "float64, key and query blocks": (causal(2, 3, 70), None),
        "padded on the left, a sequence of one token": (causal(3, 2, 70, left), left),
        "float32, sharp": ((causal(1, 4, 33) ** 4).float(), None),
        "float16": (causal(2, 2, 24).half(), None),
        "bfloat16": (causal(2, 2, 24).bfloat16(), None),
        "nan in a counted query": (nan, None),
    }


def test_the_heads_kernel_gives_the_torch_path_s_numbers_and_repeats_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--heads on CUDA: the kernel's sums over the counted queries (run here by Triton's
    interpreter), made into sink, entropy, top key and top share by head_numbers, equal the
    torch path's float64 numbers to rounding, and repeat bitwise."""
    cases = _head_cases()
    asked: dict[str, torch.Tensor] = {}  # the queries head_numbers counts, as it asks

    def recorded(probs: torch.Tensor, counted: torch.Tensor) -> None:
        asked[current] = counted.clone()

    monkeypatch.setattr(devicerow, "head_sums", recorded)
    want = {}
    for current, (p, real) in cases.items():
        want[current] = head_numbers(p, real)  # the torch path (head_sums gave None)
    sums = _interpreted(
        _HEADS_RUN, {name: (p, asked[name]) for name, (p, _) in cases.items()}, tmp_path
    )
    for name, (p, real) in cases.items():
        (col, ent), (col2, ent2) = sums[name]
        assert col.dtype == torch.float64 and tuple(col.shape) == tuple(p.shape[:3]), name
        assert col.view(torch.int64).equal(col2.view(torch.int64)), name  # bitwise
        assert ent.view(torch.int64).equal(ent2.view(torch.int64)), name
        monkeypatch.setattr(devicerow, "head_sums", lambda *_a, c=col, e=ent: (c, e))
        got = head_numbers(p, real)
        assert got.shape == want[name].shape and got.dtype == torch.float64, name
        torch.testing.assert_close(got, want[name], rtol=1e-12, atol=1e-12, equal_nan=True)
    padded = want["padded on the left, a sequence of one token"]
    assert padded[2, :, 4].eq(0).all() and padded[1, :, 4].eq(70 - 9 - 1).all()  # queries
    nan = want["nan in a counted query"][0, 1]  # a NaN at key 5: its share, not the sink
    assert nan[3].isnan() and nan[:2].isfinite().all()


_HIST_RUN = """
import sys, torch
from hookcli.engine import _triton
cases = torch.load(sys.argv[1])
counts = {}
for name, (x, bounds) in cases.items():
    lowest = float(torch.finfo(x.dtype).min)
    counts[name] = _triton.abs_hist(x, bounds, lowest)
torch.save(counts, sys.argv[2])
"""


def test_the_histogram_kernel_counts_as_torch_bucketize_does(tmp_path: Path) -> None:
    """calib's |x| histogram on CUDA (run here by Triton's interpreter): every valid value
    (finite, not the dtype's lowest, an attention mask's fill) in the bin torch.bucketize
    (right=True) gives it over the float64 bounds, counted exactly; values on a bound, zeros,
    the first and the last bin."""
    g = torch.Generator().manual_seed(12)
    bounds = hist_bounds()
    dirty = torch.randn(5000, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
        -8, 8, (5000,), generator=g
    )
    dirty[:50] = bounds[100:150]  # on a bound: the bin above it
    dirty[50:60] = 0.0
    dirty[60] = math.nan
    dirty[61] = -math.inf
    dirty[62] = torch.finfo(torch.float64).min  # a float64 mask's fill: not counted
    dirty[63] = 1e300  # the last bin
    cases = {
        "float64 over 16 decades": (dirty, bounds),
        "float32": ((torch.randn(3000, generator=g) * 50).float(), bounds),
        "bfloat16, a mask's fill": (
            torch.cat(
                [torch.randn(999, generator=g), torch.tensor([torch.finfo(torch.bfloat16).min])]
            ).bfloat16(),
            bounds,
        ),
        "float16, few bounds": ((torch.randn(2000, generator=g) * 4).half(), bounds[::300]),
    }
    counts = _interpreted(_HIST_RUN, cases, tmp_path)
    for name, (x, b) in cases.items():
        v = x.double()
        valid = torch.isfinite(v) & (x != torch.finfo(x.dtype).min)
        want = torch.bincount(torch.bucketize(v[valid].abs(), b, right=True), minlength=len(b) + 1)
        assert counts[name].dtype == torch.int32, name
        assert counts[name].long().equal(want), name
    assert int(counts["float64 over 16 decades"].sum()) == 5000 - 3
    assert int(counts["bfloat16, a mask's fill"].sum()) == 999
