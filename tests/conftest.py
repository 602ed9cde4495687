"""Shared fixtures. Tests never touch the network: TORCH_HOME and the Hugging Face cache point
at empty folders, and huggingface_hub is offline."""

from __future__ import annotations

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is imported
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hookcli.runtime import isa, preload

# Before torch runs any kernel: on a CPU that advertises AMX but dies in its bfloat16 kernels,
# the suite runs under the same oneDNN limit the CLI and the API take (issue 13).
isa.ensure()
# `import hookcli` started loading the statistics' kernels in the background: done before any
# test, so that "auto" measures with them in every test, not depending on how fast it loads
# (tests that read the torch ops' numbers ask for stats_backend="torch").
preload.wait()

ROOT = Path(__file__).resolve().parent.parent
CAT = ROOT / "sample_images" / "cat.jpeg"
COFFEE = ROOT / "sample_images" / "coffee.jpeg"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--reverse",
        action="store_true",
        help="run the collected tests in reverse order (CI: the suite must not depend on it)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--reverse"):
        items.reverse()


class _ProcessState:
    """What a test can leave behind in the process: the recursion limit (torch.compile's
    inductor raises it), the default dtype, grad mode, deterministic algorithms, threads,
    matmul precision, the random states (torch's CPU generator, numpy's, Python's), the
    working folder and the environment."""

    def __init__(self) -> None:
        import random

        import numpy as np

        self.limit = sys.getrecursionlimit()
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.threads = torch.get_num_threads()
        self.matmul = torch.get_float32_matmul_precision()
        self.rng = torch.random.get_rng_state()
        self.np_rng = np.random.get_state()
        self.py_rng = random.getstate()
        self.cwd = os.getcwd()
        self.environ = dict(os.environ)

    def restore(self) -> None:
        import random

        import numpy as np

        sys.setrecursionlimit(self.limit)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        torch.use_deterministic_algorithms(self.deterministic)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        torch.set_float32_matmul_precision(self.matmul)
        torch.random.set_rng_state(self.rng)
        np.random.set_state(self.np_rng)
        random.setstate(self.py_rng)
        os.chdir(self.cwd)
        # pytest's own variables (PYTEST_CURRENT_TEST) are pytest's to set and unset
        wanted = {k: v for k, v in self.environ.items() if not k.startswith("PYTEST_")}
        wanted |= {k: v for k, v in os.environ.items() if k.startswith("PYTEST_")}
        if dict(os.environ) != wanted:
            os.environ.clear()
            os.environ.update(wanted)


_AT_START: list[_ProcessState] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _AT_START.append(_ProcessState())


@pytest.fixture(autouse=True)
def _process_state_as_found() -> Iterator[None]:
    """Every test starts from the process state the suite started with, whatever the tests
    (and fixtures) before it left (issue 48): it is put back after every test, so no test can
    pass or fail by the order it runs in. `pytest --reverse` runs the suite backwards."""
    try:
        yield
    finally:
        _AT_START[0].restore()


@pytest.fixture(autouse=True)
def _isolated_torch_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    home = tmp_path_factory.mktemp("torch_home")
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hf_hub"))  # an empty Hugging Face cache
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    return home


def hooks_left(model: nn.Module) -> int:
    """How many hooks of any kind remain on any module of model."""
    return sum(
        len(m._forward_hooks)
        + len(m._forward_pre_hooks)
        + len(m._backward_hooks)
        + len(getattr(m, "_backward_pre_hooks", {}))
        for m in model.modules()
    )


def oracle(t: torch.Tensor) -> dict[str, float | int | None]:
    """Independent float64 statistics of a retained tensor (finite elements for moments)."""
    if t.is_quantized:
        t = t.dequantize()
    if t.is_complex():
        t = t.abs()
    d = t.detach().to(torch.float64).reshape(-1)
    finite = d[torch.isfinite(d)]
    n = finite.numel()
    return {
        "numel": d.numel(),
        "mean": finite.mean().item() if n else None,
        "std": finite.std(correction=0).item() if n else None,
        "min": finite.min().item() if n else None,
        "max": finite.max().item() if n else None,
        "zeros": (d == 0).double().mean().item() if d.numel() else None,
        "nan": int(torch.isnan(d).sum()),
        "inf": int(torch.isinf(d).sum()),
        "norm": finite.norm().item() if n else None,
    }


def assert_stats_match(
    stats: object, t: torch.Tensor, rtol: float = 2e-5, *, same_tensor: bool = True
) -> None:
    """Every statistic of `stats` equals the oracle on t: moments within rtol of the data's
    scale (a mean near 0 is judged against the RMS); extremes and counts exactly when t is
    the very tensor that was measured, else (t recomputed by another path, e.g. with in-place
    ops disabled, which rounds differently) extremes within rtol of the scale too."""
    ref = oracle(t)
    assert stats.numel == ref["numel"]  # type: ignore[attr-defined]
    assert stats.nan == ref["nan"], (stats, ref)  # type: ignore[attr-defined]
    assert stats.inf == ref["inf"], (stats, ref)  # type: ignore[attr-defined]
    # no absolute floor: subnormal activations (~1e-42) must report their real spread
    scale = max(abs(ref["mean"] or 0.0), ref["std"] or 0.0)
    for key in ("min", "max", "zeros"):
        got, want = getattr(stats, key), ref[key]
        if same_tensor or want is None or key == "zeros":
            assert got == want, (key, stats, ref)
        else:
            assert got is not None and abs(got - want) <= rtol * max(scale, abs(want)), (
                key,
                got,
                want,
            )
    for key in ("mean", "std", "norm"):
        got, want = getattr(stats, key), ref[key]
        if want is None:
            assert got is None, (key, stats, ref)
            continue
        tol = rtol * (scale if key != "norm" else abs(want))
        assert got is not None and abs(got - want) <= tol, (key, got, want)


def captured_outputs(model: nn.Module, x: torch.Tensor, names: list[str]) -> dict[str, Any]:
    """Each named module's output (its first call's), cloned by an independent forward hook;
    an int8 (quantized) tensor as its real values."""
    got: dict[str, Any] = {}
    mods = dict(model.named_modules())

    def keeper(name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:  # returns None: output kept
            if name in got:
                return
            if isinstance(out, torch.Tensor):
                out = out.dequantize() if out.is_quantized else out.detach().clone()
            got[name] = out

        return hook

    handles = [mods[n].register_forward_hook(keeper(n)) for n in names]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return got


def quantized_twins(x: torch.Tensor) -> tuple[nn.Module, nn.Module]:
    """torchvision's quantizable resnet18 with hookcli's seed-0 weights, fused, and its int8
    version calibrated on x: what `diff resnet18 --a float32 --b quantized` compares, by hand."""
    import copy

    import torchvision
    from torch.ao import quantization as tq

    from hookcli.sources import load_model

    twin = torchvision.models.get_model("quantized_resnet18", weights=None, quantize=False)
    twin.load_state_dict(load_model("resnet18", seed=0).module.state_dict())
    twin.eval()
    twin.fuse_model()
    int8 = copy.deepcopy(twin)
    int8.qconfig = tq.get_default_qconfig("x86")
    tq.prepare(int8, inplace=True)
    with torch.no_grad():
        int8(x)
    tq.convert(int8, inplace=True)
    return twin, int8
