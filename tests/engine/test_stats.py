"""Statistics against an independent float64 oracle on the retained tensor."""

from __future__ import annotations

import functools
import gc
import math
import threading
import weakref

import pytest
import torch

from hookcli.engine import stats as stats_mod
from hookcli.engine.stats import StatsCollector, tensor_stats
from hookcli.records import TensorStats
from hookcli.runtime import preload
from tests.support.oracles import assert_stats_match, oracle

pytestmark = pytest.mark.kernels  # the second CI pass reruns these on generic x86-64

BIG = 3 * (1 << 15) + 123  # above the parallel threshold, not a multiple of the block size


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    relu = torch.randn(BIG, generator=g).relu()
    with_nonfinite = torch.randn(BIG, generator=g)
    with_nonfinite[::97] = math.nan
    with_nonfinite[5::101] = math.inf
    with_nonfinite[7::103] = -math.inf
    with_nonfinite[::3] = 0.0
    return {
        "randn": torch.randn(1000, generator=g),
        "relu big": relu,
        "randn big float64": torch.randn(BIG, generator=g, dtype=torch.float64),
        "nonfinite big": with_nonfinite,
        "nonfinite small": torch.tensor([1.0, math.nan, math.inf, -math.inf, 0.0, -2.0]),
        "all nan": torch.full((10,), math.nan),
        "all inf": torch.full((4,), math.inf),
        "all zero": torch.zeros(50_000),
        "signed zeros": torch.tensor([-0.0, 0.0, 1.5] * 1000),  # -0.0 is a zero
        "one element": torch.tensor([3.5]),
        "ill-conditioned": torch.randn(BIG, generator=g) * 1e-3 + 1000.0,
        "huge values": torch.tensor([3e30, -1e30, 2.5e38, 0.0]),
        # float32 subnormals: their squares underflow float32 (issue 9)
        "subnormal big": torch.randn(BIG, generator=g) * 1e-42,
        "subnormal small": torch.tensor([1e-42, -3e-42, 0.0, 2e-40]),
        "tiny normal": torch.randn(5000, generator=g) * 1e-21,
        "float16": (torch.randn(4096, generator=g) * 100).half(),
        "bfloat16": torch.randn(5000, generator=g).bfloat16(),
        "int64": torch.randint(-5, 5, (777,), generator=g),
        "int64 wide": torch.randint(-(2**40), 2**40, (1000,), generator=g),  # past float32's
        "positions": torch.arange(2048).unsqueeze(0),
        "int8": torch.randint(-128, 127, (100,), generator=g, dtype=torch.int8),
        "uint8": torch.randint(0, 255, (100,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(999, generator=g) > 0.7,
        "complex64": torch.randn(300, generator=g, dtype=torch.complex64),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.0),
        "channels_last": torch.randn(2, 8, 5, 5, generator=g).to(memory_format=torch.channels_last),
        "permuted": torch.randn(3, 4, 5, generator=g).permute(2, 0, 1),
        "strided slice": torch.randn(64, 64, generator=g)[:, ::3],
        "expanded": torch.randn(1, 7, generator=g).expand(5, 7),
        "quantized": torch.quantize_per_tensor(
            torch.randn(100, generator=g), 0.1, 10, torch.quint8
        ),
        "requires grad": torch.randn(100, generator=g, requires_grad=True),
    }


CASES = _cases()


@pytest.mark.parametrize("backend", ["kernel", "auto", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_stats_match_float64_oracle(name: str, backend: str) -> None:
    t = CASES[name]
    collector = StatsCollector(backend=backend)
    got = collector.add(t, "x")
    collector.finalize()
    assert got.shape == tuple(t.shape)
    assert got.dtype == str(t.dtype).removeprefix("torch.")
    assert_stats_match(got, t)


def test_quantized_and_complex_say_what_was_measured() -> None:
    assert "dequantized" in (tensor_stats(CASES["quantized"]).note or "")
    assert "magnitude" in (tensor_stats(CASES["complex64"]).note or "")


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[torch.Tensor]:
    calls: list[torch.Tensor] = []
    original = getattr(stats_mod, name)

    def spy(x: torch.Tensor, *rest: object) -> object:
        calls.append(x)
        return original(x, *rest)

    monkeypatch.setattr(stats_mod, name, spy)
    return calls


def test_the_kernel_is_actually_used_for_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    if stats_mod.kernels() is None:
        pytest.skip("numba unavailable")
    torch_ops = _spy(monkeypatch, "torch_row") + _spy(monkeypatch, "cpu_row")
    for name in ("relu big", "nonfinite big", "ill-conditioned"):
        collector = StatsCollector(backend="kernel")
        collector.add(CASES[name], "x")
        collector.finalize()
    assert torch_ops == []


def test_integers_and_bools_are_read_by_the_kernel_as_float64(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An integer or bool tensor (position ids, masks, token ids) is measured as its float64
    values, as torch ops measure it, by the kernel: one conversion, not twenty torch ops (a
    --generate step measures each block's position ids)."""
    if stats_mod.kernels() is None:
        pytest.skip("numba unavailable")
    torch_ops = _spy(monkeypatch, "torch_row") + _spy(monkeypatch, "cpu_row")
    fused = _spy(monkeypatch, "kernel_row")
    for name in ("int64", "int64 wide", "positions", "int8", "uint8", "bool"):
        collector = StatsCollector(backend="kernel")
        got = collector.add(CASES[name], "x")
        collector.finalize()
        assert_stats_match(got, CASES[name])
    assert torch_ops == [] and len(fused) == 6
    assert all(x.dtype == torch.float64 for x in fused)


def test_auto_measures_with_torch_until_the_kernels_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that has not loaded numba measures with torch ops (a single image's
    activations never pay for the loading); past _KERNEL_AFTER bytes it loads the kernels and
    uses them from then on, in every collector; the figures before and after agree to
    rounding."""
    if stats_mod.kernels() is None:
        pytest.skip("numba unavailable")
    t = CASES["relu big"]
    fresh = functools.cache(stats_mod._load_kernels)  # as in a process that never loaded them
    monkeypatch.setattr(stats_mod, "kernels", fresh)
    monkeypatch.setattr(stats_mod, "_without_kernels", [0])
    monkeypatch.setattr(preload, "_thread", [])  # … nor started loading them in the background
    monkeypatch.setattr(preload, "_done", threading.Event())
    monkeypatch.setattr(stats_mod, "_KERNEL_AFTER", 2 * t.numel() * 4)
    fast = _spy(monkeypatch, "cpu_row")
    fused = _spy(monkeypatch, "kernel_row")
    collector = StatsCollector()
    got = [collector.add(t.clone(), f"x{i}") for i in range(3)]
    collector.finalize()
    assert (len(fast), len(fused), fresh.cache_info().currsize) == (2, 1, 1)
    later = StatsCollector()  # a later run in the same process: the kernels at once
    got.append(later.add(t.clone(), "x"))
    later.finalize()
    assert (len(fast), len(fused)) == (2, 2)
    for a in got[1:]:
        for key in ("mean", "std", "min", "max", "zeros", "norm"):
            assert getattr(a, key) == pytest.approx(getattr(got[0], key), rel=1e-13, abs=0)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].is_floating_point()])
def test_the_torch_ops_and_the_kernel_agree_to_rounding(name: str) -> None:
    """Whichever path measured a tensor, its figures agree far below any printed digit: a
    report does not depend on how much the process had measured before."""
    if stats_mod.kernels() is None:
        pytest.skip("numba unavailable")
    rows = []
    for backend in ("kernel", "torch"):
        collector = StatsCollector(backend=backend)
        rows.append(collector.add(CASES[name], "x"))
        collector.finalize()
    a, b = rows
    assert (a.nan, a.inf, a.zeros, a.min, a.max) == (b.nan, b.inf, b.zeros, b.min, b.max)
    for key in ("mean", "std", "norm"):
        x, y = getattr(a, key), getattr(b, key)
        assert (x is None) == (y is None)
        if x is not None:
            assert x == pytest.approx(y, rel=1e-12, abs=1e-300), key


def test_a_tensor_seen_twice_unchanged_is_measured_once() -> None:
    t = torch.randn(100)
    c = StatsCollector()
    a = c.add(t, "out")
    b = c.add(t, "in[0]")
    assert len(c) == 1  # one measurement
    c.finalize()
    assert a.mean == b.mean == pytest.approx(float(t.double().mean()))  # both filled
    assert (a.path, b.path) == ("out", "in[0]")


def test_an_in_place_change_between_sightings_is_measured_again() -> None:
    t = torch.randn(100)
    c = StatsCollector()
    first = c.add(t, "in[0]")
    t.relu_()
    second = c.add(t, "out")
    assert len(c) == 2
    c.finalize()
    assert first.min is not None and first.min < 0
    assert second.min == 0


def test_the_collector_keeps_no_tensor_alive() -> None:
    t = torch.randn(1000)
    ref = weakref.ref(t)
    c = StatsCollector()
    c.add(t, "x")
    del t
    gc.collect()
    assert ref() is None
    c.finalize()


@pytest.mark.parametrize("backend", ["kernel", "auto", "torch"])
@pytest.mark.parametrize(
    "name", ["randn", "relu big", "nonfinite big", "float16", "int64", "all zero", "bool"]
)
def test_histogram_counts_match_numpy_on_float64(name: str, backend: str) -> None:
    import warnings

    import numpy as np

    t = CASES[name]
    collector = StatsCollector(backend=backend, hist_bins=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (numpy warned on a bool tensor's bins)
        got = collector.add(t, "x")
        collector.finalize()
    assert got.hist is not None
    counts, edges = got.hist["counts"], got.hist["edges"]
    d = t.double().reshape(-1)
    finite = d[torch.isfinite(d)].numpy()
    assert sum(counts) == finite.size
    assert len(edges) == 13 and edges[0] == got.min
    lo, hi = finite.min(), finite.max()
    want, _ = np.histogram(finite, bins=12, range=(lo, hi if hi > lo else lo + 1.0))
    # values that sit exactly on an inner edge may fall either side in float32 arithmetic
    assert np.abs(np.asarray(counts) - want).sum() <= 2, (counts, want.tolist())


def _together_calls(backend: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[how many calls] of the kernel that measures tensors together, counted from now on
    (the kernel backend; skipped where numba is unavailable)."""
    calls = [0]
    if backend == "kernel":
        ks = stats_mod.kernels()
        if ks is None:
            pytest.skip("numba unavailable")
        together_at = ks.at

        def counted(*args: object) -> None:
            calls[0] += 1
            together_at(*args)

        monkeypatch.setattr(ks, "at", counted)
    return calls


@pytest.mark.parametrize("backend", ["kernel", "torch"])
def test_weights_norms_match_the_oracle(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """norms (a model's weights, whose norm alone a report shows): every case's norm over its
    finite elements equals float64 torch on it (None where it has none), and what add()
    gives it alone; the small plain ones from one kernel call, read where they lie (an
    offset view; a lazily negated one is measured as add() measures it)."""
    calls = _together_calls(backend, monkeypatch)
    items = [(t, name) for name, t in CASES.items()]
    rows = torch.arange(40, dtype=torch.float32).reshape(10, 4) - 7.5
    items += [(torch.nn.Parameter(torch.randn(8, 8)), "weight"), (rows[3:5], "offset")]
    items += [(torch._neg_view(rows[1]), "negated"), (torch.full((5,), math.nan), "all nan")]
    collector = StatsCollector(backend=backend)
    got = collector.norms(items)
    assert calls == [1 if backend == "kernel" else 0]
    collector.finalize()
    for (t, name), found in zip(items, got, strict=True):
        # a TensorStats: measured as add() measures it
        norm = found.norm if isinstance(found, TensorStats) else found
        want = oracle(t)["norm"]
        alone = StatsCollector(backend=backend)
        one = alone.add(t, name, positions=False)
        alone.finalize()
        if want is None:
            assert norm is None and one.norm is None, name
            continue
        assert norm is not None and abs(norm - want) <= 2e-5 * abs(want), (name, norm, want)
        assert norm == one.norm or norm == pytest.approx(one.norm, rel=1e-12, abs=1e-300), name


@pytest.mark.parametrize("backend", ["kernel", "torch"])
def test_tensors_measured_together_match_the_oracle(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """add_whole (a model's parameters and their gradients): every case, each small float32
    one measured in one call of the segmented kernel with the others, equals float64 torch
    on it and what add() gives it alone, each small one's elements too; a tensor given twice
    is measured once. Each is read where it lies: one with an offset into its storage, one
    that is a lazily negated view of another (read as torch reads it, or not together)."""
    calls = _together_calls(backend, monkeypatch)
    items = [(t, name) for name, t in CASES.items()]
    items += [(torch.nn.Parameter(torch.randn(8, 8)), "weight"), (items[0][0], "again")]
    rows = torch.arange(40, dtype=torch.float32).reshape(10, 4) - 7.5
    items += [(rows[3:5], "offset"), (torch._neg_view(rows[1]), "negated")]
    sparse = torch.nn.Parameter(torch.eye(3).to_sparse_csr(), requires_grad=False)
    together = StatsCollector(backend=backend)
    got = together.add_whole(items)
    [csr] = together.add_whole([(sparse, "sparse")])  # measured alone, as add() measures it
    assert calls == [1 if backend == "kernel" else 0]  # (the negated one: held for later)
    together.finalize()
    assert (csr.numel, csr.mean, csr.zeros) == (9, pytest.approx(1 / 3), pytest.approx(2 / 3))
    for (t, name), stats in zip(items, got, strict=True):
        alone = StatsCollector(backend=backend)
        one = alone.add(t, name, positions=False)
        alone.finalize()
        assert stats.path == name and stats.shape == tuple(t.shape)
        assert_stats_match(stats, t)
        for field in ("mean", "std", "min", "max", "zeros", "nan", "inf", "norm"):
            a, b = getattr(stats, field), getattr(one, field)
            assert a == b or a == pytest.approx(b, rel=1e-12, abs=1e-300), (name, field)
        assert stats.values == one.values, name
        if 0 < t.numel() <= 16 and t.dtype is torch.float32:
            want = [v if math.isfinite(v) else None for v in t.resolve_neg().flatten().tolist()]
            assert stats.values == want, name


def test_parameters_measured_at_once_match_the_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    """params_now (grads' parameters and their gradients, each a plain CPU float32 tensor):
    the weights' norms and the gradients' statistics, in two kernel calls, filled at once,
    equal float64 torch and what norms()/add() give each alone, a small one's elements too;
    where one gradient is not measured together (a lazily negated view), or was measured in
    the pass already, it answers None and the caller takes the two calls."""
    calls = _together_calls("kernel", monkeypatch)
    plain = [
        (t, name)
        for name, t in CASES.items()
        if t.dtype is torch.float32
        and t.is_contiguous()
        and 0 < t.numel() <= 1 << 14
        and t.layout is torch.strided
    ]
    # cancellation: E[x²] dwarfs the variance (the rows worked out one by one)
    plain.append((1e4 + torch.linspace(-1e-2, 1e-2, 300), "cancelling"))
    assert any(t.isnan().any() for t, _ in plain) and any(0 < t.numel() <= 16 for t, _ in plain)
    weights = [t.flip(0).contiguous() for t, _ in plain]
    collector = StatsCollector(backend="kernel")
    got = collector.params_now(weights, plain)
    assert got is not None and calls == [2]
    norms, measured = got
    for w, norm in zip(weights, norms, strict=True):
        want = oracle(w)["norm"]
        assert norm == (None if want is None else pytest.approx(want, rel=2e-5)), norm
    for (t, name), stats in zip(plain, measured, strict=True):
        alone = StatsCollector(backend="kernel")
        one = alone.add(t, name, positions=False)
        alone.finalize()
        assert (stats.path, stats.shape, stats.values) == (name, tuple(t.shape), one.values)
        assert_stats_match(stats, t)
        for field in ("mean", "std", "min", "max", "zeros", "nan", "inf", "norm"):
            assert getattr(stats, field) == getattr(one, field), (name, field)
    negated = torch._neg_view(torch.arange(4.0))
    assert StatsCollector(backend="kernel").params_now(weights, [*plain, (negated, "n")]) is None
    seen = StatsCollector(backend="kernel")
    seen.add(plain[0][0], "out")
    assert seen.params_now(weights, plain) is None


@pytest.mark.parametrize("shape", [(3,), (300, 400)])
def test_autograds_memoryless_zeros_are_measured_as_zeros(shape: tuple[int, ...]) -> None:
    """A ZeroTensor (autograd's zeros with no memory behind them: data_ptr 0) is measured as
    the zeros it stands for, by `add` and a layer call's `quick`, never read where it lies
    (numpy refuses it; a GPU kernel would read address 0)."""
    from hookcli.engine.stats import StatsCollector

    c = StatsCollector()
    got = [
        c.add(torch._efficientzerotensor(shape), "a"),
        c.quick(torch._efficientzerotensor(shape), "q"),
    ]
    c.finalize()
    n = math.prod(shape)
    for s in got:
        assert (s.numel, s.mean, s.std, s.min, s.max, s.norm, s.zeros) == (n, 0, 0, 0, 0, 0, 1.0)
        assert s.nan == s.inf == 0


@pytest.mark.parametrize("backend", ["kernel", "torch"])
def test_a_large_lazily_negated_view_is_measured_as_its_values(backend: str) -> None:
    """A tensor with the negative bit set, too large to be copied with the small ones (the
    kernels read it through numpy, which cannot read it where it lies): measured as -x."""
    x = torch.randn(200, 200, generator=torch.Generator().manual_seed(0))
    collector = StatsCollector(backend=backend)
    got = collector.add(torch._neg_view(x), "negated")
    collector.finalize()
    assert_stats_match(got, -x)
