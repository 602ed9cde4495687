"""A CUDA tensor's row by the fused Triton kernel (engine/_triton.py): one read of the data
and two launches at most, instead of torch ops' dozen of each (in a pass, one: the rows are
finished together after it); --per-token's rows likewise, in
one launch; --channels' per-channel numbers in two. Where Triton is missing (a CPU-only build,
macOS) or cannot build the kernel for this device, torch ops measure it, exactly, as before."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

import torch

from hookcli.engine import tensorbits
from hookcli.engine.tensorbits import dense_flat
from hookcli.runtime import preload

# the dtypes the kernel reads as they are (others go to torch ops: integers, bool, float8)
_READ = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# kernels that failed to build or run once in this process: not tried again
_broken: set[str] = set()


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
    kernels = _usable(x, "row")
    if kernels is None:
        return None
    return _launched(lambda: kernels.row(dense_flat(x)), x, "row")


def started_row(x: torch.Tensor, pools: dict[torch.device, Any]) -> int | None:
    """x's row started where the kernel reads x (one launch: its blocks' numbers written into
    the pass's pool on x's device, `_triton.Pool`), finished with every other by
    `finished_rows` after the pass; its place among them. None where the kernel does not run
    (then `fused_row` or torch ops)."""
    kernels = _usable(x, "row")
    if kernels is None:
        return None
    pool = _pool(pools, x.device, kernels)
    return _launched(lambda: pool.add(dense_flat(x)), x, "row")


def _pool(pools: dict[torch.device, Any], device: torch.device, kernels: ModuleType) -> Any:
    """The pass's pool of started rows on `device`, made on first use."""
    pool = pools.get(device)
    if pool is None:
        pool = pools[device] = kernels.Pool()
    return pool


def started_plain(x: torch.Tensor, pools: dict[torch.device, Any]) -> int | None:
    """`started_row` for a plain CUDA tensor of a layer call (StatsCollector.quick: this runs
    once per hooked tensor), without its general checks: contiguous, non-empty, of a dtype the
    kernel reads, launched as it lies (the kernel reads its elements in memory order); None
    where any of that does not hold (then `started_row`'s way)."""
    if (
        x.dtype not in _READ
        or x.layout is not torch.strided
        or "row" in _broken
        or not x.is_contiguous()
        or x.is_neg()
        or x._is_zerotensor()
        or x.numel() == 0
        or preload.kept_off()
    ):
        return None
    kernels = _kernels()
    if kernels is None:
        return None
    pool = _pool(pools, x.device, kernels)
    at: int | None = _launched(functools.partial(pool.add, x), x, "row")
    return at


def started_rows(xs: Sequence[torch.Tensor], pools: dict[torch.device, Any]) -> list[int | None]:
    """Many tensors' rows (a model's weights, their gradients: measured whole) started as
    `started_row` starts one, those of one dtype on one device by one launch (`_triton.Pool.
    add_many`): each one's place, None where the kernel does not read it together (a CPU
    tensor, one with gaps or not 16-byte aligned, a dtype it does not read, a ROCm device;
    then the caller measures it alone)."""
    out: list[int | None] = [None] * len(xs)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, x in enumerate(xs):
        if (
            _usable(x, "row") is not None
            and type(x) in tensorbits.PLAIN
            and x.layout is torch.strided
            and x.is_contiguous()
            and not x.is_neg()
            and x.data_ptr() % 16 == 0  # (the kernel's layout as a lone aligned tensor's)
            and torch.version.hip is None  # (ROCm: 32-bit buffer offsets from the first)
        ):
            groups.setdefault((x.device, x.dtype), []).append(i)
    for (device, _), idxs in groups.items():
        kernels = _kernels()
        assert kernels is not None  # (usable above)
        pool = _pool(pools, device, kernels)
        first, flats = xs[idxs[0]], [xs[i].detach().reshape(-1) for i in idxs]
        got = _launched(functools.partial(pool.add_many, flats), first, "row")
        for i, at in zip(idxs, got or (), strict=False):
            out[i] = at
    return out


def finished_rows(
    pools: dict[torch.device, Any],
) -> dict[torch.device, list[list[float]] | str]:
    """Every row the pools started, merged on their devices (one launch a buffer) and brought
    to the host in one transfer per device; where that fails, why (the kernels are then not
    tried again in this process)."""
    out: dict[torch.device, list[list[float]] | str] = {}
    for device, pool in pools.items():
        try:
            rows: list[list[float]] = _on(device, pool.rows).to("cpu").tolist()
            out[device] = rows
        except Exception as exc:  # (the rows cannot be measured again: the tensors are gone)
            _broken.add("row")
            out[device] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return out


def diff_sums(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """diff's nine sums of b against a (one shape, one CUDA device) by the fused kernel: one
    read of each in its own dtype, two launches (commands/diff/ondevice.sums' numbers, float64
    on the device); None where the kernel does not run (then torch ops measure them)."""
    kernels = _usable(a, "diff")
    if kernels is None or _usable(b, "diff") is None or a.device != b.device:
        return None
    # (reshape, not dense_flat: both sides' elements in the same order)
    fa, fb = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()
    return _launched(lambda: kernels.diff_sums(fa, fb), a, "diff")


def token_rows(t: torch.Tensor, *, fused: bool = True) -> torch.Tensor:
    """--per-token's rows of t (batch, tokens, C): (batch, tokens, 5) float64 on t's device
    (tensorbits.token_rows' numbers). On CUDA (`fused`), the fused kernel's: one launch and
    one read of t in its own dtype, no float64 copy; else torch ops'."""
    kernels = _usable(t, "tokens") if fused else None
    if kernels is not None:
        x = t.detach()
        rows: torch.Tensor | None = _launched(
            lambda: kernels.token_rows(x if x.is_contiguous() else x.contiguous()), x, "tokens"
        )
        if rows is not None:
            return rows
    return tensorbits.token_rows(t)


def channel_rows(flat: torch.Tensor, lowest: float, large: float) -> torch.Tensor | None:
    """--channels' numbers per channel of a CUDA (N, C) tensor by the fused kernels (two reads
    of it in its own dtype, no float64 copy): engine/_triton.channel_rows' (10, C) float64
    rows on its device; None where the kernels do not run (then torch ops measure it)."""
    kernels = _usable(flat, "channels")
    if kernels is None:
        return None
    x = flat.detach()
    return _launched(
        lambda: kernels.channel_rows(x if x.is_contiguous() else x.contiguous(), lowest, large),
        x,
        "channels",
    )


def _usable(x: torch.Tensor, name: str) -> ModuleType | None:
    """The kernels, where they may read x (non-empty, CUDA, a dtype they read; not turned off
    by HOOKCLI_STATS=torch, nor failed before in this process)."""
    if not x.is_cuda or x.dtype not in _READ or x.numel() == 0 or name in _broken:
        return None
    if x.is_neg() or x._is_zerotensor():  # a lazily negated view: its memory holds the values
        return None  # before negation; autograd's zeros with no memory: nothing to read
    if preload.kept_off():  # HOOKCLI_STATS=torch: the torch-ops statistics everywhere
        return None
    return _kernels()


T = TypeVar("T")


def abs_hist(flat: torch.Tensor, bounds: torch.Tensor, lowest: float) -> torch.Tensor | None:
    """calib's histogram of |x| over a CUDA tensor's valid values (finite, not `lowest`) in the
    bins of the float64 `bounds` on its device, by the fused kernel (one read in its own dtype,
    no float64 copy, no index tensor): (len(bounds) + 1,) int32 counts on its device; None
    where the kernel does not run (then torch ops count them)."""
    kernels = _usable(flat, "hist")
    if kernels is None or flat.numel() >= 2**31:  # (int32 counts and offsets)
        return None
    x = flat.detach().reshape(-1)
    return _launched(
        lambda: kernels.abs_hist(x if x.is_contiguous() else x.contiguous(), bounds, lowest),
        x,
        "hist",
    )


def head_sums(
    probs: torch.Tensor, counted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """--heads' sums of CUDA attention probabilities (B, H, L, L) over the counted queries
    (B, L) by the fused kernel (one read in their own dtype, no float64 copy):
    engine/_triton.head_sums' per-key sums (B, H, L) and Σ p log p (B, H), float64 on their
    device; None where the kernel does not run (then torch ops measure them)."""
    kernels = _usable(probs, "heads")
    if kernels is None:
        return None
    x = probs.detach()
    return _launched(
        lambda: kernels.head_sums(x if x.is_contiguous() else x.contiguous(), counted), x, "heads"
    )


def _launched(launch: Callable[[], T], x: torch.Tensor, name: str) -> T | None:
    """launch() on x's device (Triton launches on the current one); None, and the kernels not
    tried again in this process, when it fails (e.g. a device Triton cannot compile for)."""
    try:
        return _on(x.device, launch)
    except torch.OutOfMemoryError:  # (not the kernels' fault: the caller's to handle)
        raise
    except Exception:
        _broken.add(name)
        return None


@functools.cache
def _devices() -> int:
    """CUDA devices this process sees (one: every CUDA tensor is on the current device)."""
    return torch.cuda.device_count()


def _on(device: torch.device, work: Callable[[], T]) -> T:
    """work() with `device` the current CUDA device (Triton launches on the current one)."""
    index = device.index
    if (
        device.type == "cuda"
        and index is not None
        and _devices() > 1
        and index != torch.cuda.current_device()
    ):
        with torch.cuda.device(device):
            return work()
    return work()
