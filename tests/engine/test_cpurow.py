"""Small CPU tensors held for later (cpurow.Later): copied as the hook sees them, measured
together after the pass; each equals the float64 oracle on the tensor as it was, and the row
one kernel call per tensor gives, bit for bit."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from typing import Any

import numpy as np
import pytest
import torch

from hookcli.engine import cpurow
from hookcli.engine import stats as stats_mod
from hookcli.engine.stats import StatsCollector
from hookcli.records import TensorStats
from tests.support.oracles import assert_stats_match

pytestmark = pytest.mark.kernels  # the second CI pass reruns these on generic x86-64


def _small_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    nonfinite = torch.randn(300, generator=g)
    nonfinite[::7] = math.nan
    nonfinite[3::11] = math.inf
    nonfinite[5::13] = -math.inf
    return {
        "randn": torch.randn(4, 8, generator=g),
        "relu": torch.randn(64, 33, generator=g).relu(),
        "nonfinite": nonfinite,
        "all nan": torch.full((20,), math.nan),
        "constant": torch.full((3, 50), 0.1),
        "all zero": torch.zeros(8, 8),
        # Σx² carries rounding here: a constant's norm is |x|·√n, not √Σx²
        "negative constant": torch.full((33,), -0.49591073393821716),
        # and here Σx²/n - mean² is 1.5e-11, not 0: a constant's std is 0 all the same
        "large constant": torch.full((1000,), 270.1393127441406),
        # E[x^2] dwarfs the variance: the centred pass
        "ill-conditioned": 1e4 + torch.randn(500, generator=g, dtype=torch.float64).float() * 1e-3,
        "one element": torch.tensor([-2.5]),
        "at the bound": torch.randn(cpurow.TOGETHER, generator=g),
        "subnormal": torch.full((40,), 1e-42) * torch.arange(40.0),
    }


def _kernels() -> cpurow.Kernels:
    ks = stats_mod.kernels()
    if ks is None:
        pytest.skip("numba unavailable")
    return ks


def _row(s: TensorStats) -> tuple[object, ...]:
    return (s.mean, s.std, s.min, s.max, s.zeros, s.nan, s.inf, s.norm)


def test_small_tensors_are_measured_after_the_pass_as_they_were_when_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each case is held (not measured at add), then changed in place, as ReLU(inplace=True)
    or `out += identity` would after the hook: the statistics are the tensor's when seen,
    and the same, bit for bit, as one kernel call for the tensor alone."""
    _kernels()
    cases = _small_cases()
    kept = {name: t.clone() for name, t in cases.items()}
    collector = StatsCollector(backend="kernel")
    got = {name: collector.add(t, name) for name, t in cases.items()}
    assert len(collector._later.copies) == len(cases)  # held, none measured yet
    for t in cases.values():
        t.mul_(-3.0).add_(1.0)  # after the hook
    collector.finalize()
    assert collector._later.copies == []
    monkeypatch.setattr(stats_mod, "TOGETHER", 0)  # now each measured at once, alone
    alone = StatsCollector(backend="kernel")
    want = {name: alone.add(t, name) for name, t in kept.items()}
    assert alone._later.copies == []
    alone.finalize()
    for name, t in kept.items():
        assert_stats_match(got[name], t)
        assert repr(_row(got[name])) == repr(_row(want[name])), name


def test_what_is_held_is_each_tensors_values_whatever_lies_under_it() -> None:
    """Held tensors are copied into one buffer as their bytes lie, where their bytes are
    their values: a view at an offset, one that needs grad, a float32 array off a 4-byte
    boundary; a lazily negated view is copied as its values (the bytes are not). Each row
    and each small one's elements are the float64 oracle's of the tensor when it was seen,
    after every source is changed in place."""
    _kernels()
    g = torch.Generator().manual_seed(11)
    base = torch.randn(64, generator=g)
    raw = np.frombuffer(
        bytearray(
            np.random.default_rng(2).standard_normal(41).astype(np.float32).tobytes() + b"\0"
        ),
        dtype=np.uint8,
    )
    odd = torch.from_numpy(raw[1:161].view(np.float32))  # (numpy allows the misaligned view)
    assert odd.data_ptr() % 4 != 0
    cases = {
        "offset view": base[5:17],
        "negated": torch._neg_view(torch.randn(9, generator=g)),
        "needs grad": torch.randn(3, 4, generator=g, requires_grad=True),
        "odd address": odd,
        "small negated": torch._neg_view(torch.tensor([1.5, -2.0, 0.25])),
    }
    kept = {name: t.detach().resolve_neg().clone() for name, t in cases.items()}
    collector = StatsCollector(backend="kernel")
    got = {name: collector.add(t, name) for name, t in cases.items()}
    assert len(collector._later.copies) == len(cases)
    with torch.no_grad():
        base.fill_(7.0)
        odd.fill_(-1.0)
        cases["needs grad"].mul_(3.0)
    collector.finalize()
    for name, t in kept.items():
        assert_stats_match(got[name], t)
        assert got[name].mean is not None and math.isclose(
            got[name].mean, t.double().mean().item(), rel_tol=1e-12, abs_tol=1e-12
        ), name
    assert got["small negated"].values == [-1.5, 2.0, -0.25]


@pytest.mark.parametrize("default", ["float64", "bfloat16", "meta", "inference"])
def test_what_is_held_is_float32_on_the_cpu_whatever_torch_defaults_to(default: str) -> None:
    """The buffer copies go to is the same whatever the process has set when it is made:
    torch's default dtype (float64, bfloat16: no narrower buffer overrun, no wider one read
    wrong), its default device (meta), inference mode (a negated view copied by torch
    outside it later). Every row is the float64 oracle's."""
    _kernels()
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(16000, generator=g) for _ in range(3)]
    tensors.append(torch._neg_view(torch.randn(50, generator=g)))
    tensors[0][::97] = math.nan
    kept = [t.resolve_neg().clone() for t in tensors]
    collector = StatsCollector(backend="kernel")
    old_dtype = torch.get_default_dtype()
    with contextlib.ExitStack() as stack:
        if default == "meta":
            stack.enter_context(torch.device("meta"))
        elif default == "inference":
            stack.enter_context(torch.inference_mode())
        else:
            torch.set_default_dtype(getattr(torch, default))
            stack.callback(torch.set_default_dtype, old_dtype)
        got = [collector.add(tensors[0], "first")]  # (the buffer is made here)
    got += [collector.add(t, f"t{k}") for k, t in enumerate(tensors[1:], 1)]
    assert len(collector._later.copies) == len(tensors)
    collector.finalize()
    for s, t in zip(got, kept, strict=True):
        assert_stats_match(s, t)


def test_a_tensor_past_the_bound_is_held_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bound below a tensor's size (no production value is): the tensor is held alone,
    in a buffer that fits it, and measured right; nothing is written past the buffer."""
    _kernels()
    monkeypatch.setattr(cpurow, "LATER_HELD", 100)
    t = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    collector = StatsCollector(backend="kernel")
    first = collector.add(torch.randn(60), "a")
    s = collector.add(t, "big")  # (full: what is held is measured first)
    assert [c[0] for c in collector._later.copies] == [0]
    later = cpurow.Later()
    later.add(0, t)
    with pytest.raises(ValueError, match="do not fit"):
        later.add(1, torch.randn(cpurow.TOGETHER))
    collector.finalize()
    assert_stats_match(s, t)
    assert first.mean is not None


def test_copies_and_measuring_from_several_threads_stay_inside_the_buffer() -> None:
    """Hooks firing on several threads at once into one Later (not supported for the
    numbers): four threads copy, checking `full` without waiting for each other, while a
    fifth measures what is held, over and over, switches forced every microsecond. Nothing
    is written or read outside the buffer (the process lives), and every row that comes
    back is of a tensor's size, at that tensor's place."""
    ks = _kernels()
    g = torch.Generator().manual_seed(9)
    sizes = torch.randint(1, 3000, (2000,), generator=g).tolist()
    tensors = [torch.randn(n, generator=g) for n in sizes]
    later = cpurow.Later()
    later.bound = 4000  # (measured often)
    got: list[tuple[int, tuple[float, ...]]] = []
    done = threading.Event()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:

        def work(part: int) -> None:
            for k in range(part, len(tensors), 4):
                if later.full(tensors[k].numel()):
                    continue
                with contextlib.suppress(ValueError):  # (two threads past `full` at once)
                    later.add(k, tensors[k])

        def measure() -> None:
            while not done.is_set():
                got.extend(later.rows(ks))

        threads = [threading.Thread(target=work, args=(p,)) for p in range(4)]
        reader = threading.Thread(target=measure)
        reader.start()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        done.set()
        reader.join()
    finally:
        sys.setswitchinterval(interval)
    got.extend(later.rows(ks))
    assert got
    assert all(row[0] == tensors[k].numel() for k, row in got)


def test_a_run_outside_the_buffer_is_not_read() -> None:
    """A held run recorded past the buffer's end (only racing hooks could record one) is not
    read: its row is left out, the others come back."""
    ks = _kernels()
    later = cpurow.Later()
    t = torch.randn(50)
    later.add(3, t)
    assert later.store is not None
    size = later.store[0].shape[0]
    later.copies += [(size - 10, 100, 7), (-4, 10, 8), (0, 0, 9)]
    rows = later.rows(ks)
    assert [k for k, _ in rows] == [3]
    assert repr(rows[0][1]) == repr(cpurow.kernel_row(t, ks, np.empty(7)))


def test_a_tensor_without_storage_is_refused_by_what_is_held() -> None:
    """A tensor with no storage to read (freed; functionalized) is refused, not read and not
    left to whatever the buffer held; a zero tensor, with no bytes at all, is held as zeros."""
    ks = _kernels()
    later = cpurow.Later()
    later.add(0, torch.full((40,), 7.0))
    later.rows(ks)  # (the buffer holds 7s now)
    freed = torch.randn(40)
    freed.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="no storage"):
        later.add(1, freed)

    def doubled(a: torch.Tensor) -> torch.Tensor:
        b = a * 2
        with pytest.raises(ValueError, match="no storage"):
            later.add(2, b)
        return b

    torch.func.functionalize(doubled)(torch.ones(40))
    assert later.copies == []
    later.add(3, torch._efficientzerotensor(40))
    ((place, row),) = later.rows(ks)
    assert place == 3 and row[0] == 40 and row[1] == 0.0 and row[3] == row[4] == 0.0


def test_a_tensor_that_cannot_be_read_leaves_nothing_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hooked tensor whose elements cannot be read (their read raises) fails alone: nothing
    of it is held to take the next tensor's place."""
    _kernels()
    collector = StatsCollector(backend="kernel")
    unreadable = torch.full((4,), 7.0)
    real = stats_mod.small_values

    def read(t: torch.Tensor) -> Any:
        if t is unreadable:
            raise RuntimeError("cannot be read")
        return real(t)

    monkeypatch.setattr(stats_mod, "small_values", read)
    with pytest.raises(RuntimeError):
        collector.quick(unreadable, "unreadable")
    assert collector._later.copies == []
    s = collector.quick(torch.full((4,), 3.0), "three")
    collector.finalize()
    assert s.mean == 3.0 and s.values == [3.0] * 4


def test_what_is_held_is_bounded_and_measured_when_the_bound_is_reached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _kernels()
    monkeypatch.setattr(cpurow, "LATER_HELD", 100)
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(30, generator=g) for _ in range(10)]
    kept = [t.clone() for t in tensors]
    collector = StatsCollector(backend="kernel")
    got = []
    for t in tensors:
        got.append(collector.add(t, "x"))
        assert collector._later.held <= 100
        t.zero_()
    collector.finalize()
    for s, t in zip(got, kept, strict=True):
        assert_stats_match(s, t)


def test_what_is_not_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past TOGETHER elements, strided, not float32, or with histograms: measured at once."""
    _kernels()
    big = torch.randn(cpurow.TOGETHER + 1)
    strided = torch.randn(8, 8).t()
    half = torch.randn(10).double()
    collector = StatsCollector(backend="kernel")
    for t in (big, strided, half):
        collector.add(t, "x")
    assert collector._later.copies == []
    with_hist = StatsCollector(backend="kernel", hist_bins=4)
    s = with_hist.add(torch.randn(10), "x")
    assert with_hist._later.copies == []
    with_hist.finalize()
    assert s.hist is not None


def test_tensors_read_where_they_lie_give_the_row_of_one_call_each() -> None:
    """segment_rows reads each tensor at its address: views at offsets into one storage, a
    float32 array off a 4-byte boundary (numpy's may be; read from an aligned copy), each
    small one's elements; every row is the one a kernel call for the tensor alone gives, bit
    for bit, and the elements are the tensor's, non-finite ones None."""
    ks = _kernels()
    cases = list(_small_cases().values())
    base = torch.cat([t.reshape(-1) for t in cases])
    views, at = [], 0
    for t in cases:  # each case again, as a view into the joined storage at its offset
        views.append(base[at : at + t.numel()])
        at += t.numel()
    raw = bytearray(4 * 33 + 1)
    odd = torch.from_numpy(np.frombuffer(raw, dtype=np.float32, count=33, offset=1))
    odd.copy_(torch.linspace(-2.0, 3.0, 33))
    assert odd.data_ptr() % 4 != 0
    tensors = [*cases, *views, odd]
    elements: list[list[float | None] | None] = []
    rows = cpurow.segment_rows(tensors, ks, elements, 16)
    for t, row, got in zip(tensors, rows, elements, strict=True):
        want = cpurow.kernel_row(t.clone(), ks, np.empty(7))
        assert repr(row) == repr(want)
        if t.numel() <= 16:
            assert got == [v if math.isfinite(v) else None for v in t.tolist()]
        else:
            assert got is None


def test_a_tensor_without_storage_is_refused_not_read() -> None:
    ks = _kernels()
    t = torch.randn(8)
    t.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="no storage"):
        cpurow.segment_rows([torch.randn(4), t], ks)
