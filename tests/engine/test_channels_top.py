"""channels.largest: the largest |x| of a tensor, ties in the order of their indices, the same
whichever way it is computed (on the host, by the packed key a device uses, by a stable
sort), against Python's own sort of (-value, index)."""

from __future__ import annotations

import pytest
import torch

from hookcli.engine import channels
from hookcli.engine.channels import largest


def _oracle(values: torch.Tensor, k: int) -> tuple[list[float], list[int]]:
    pairs = sorted(enumerate(values.tolist()), key=lambda p: (-p[1], p[0]))[:k]
    return [v for _, v in pairs], [i for i, _ in pairs]


@pytest.mark.parametrize(
    ("host", "exact32"), [(True, True), (False, True), (False, False)], ids=["host", "key", "sort"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ties_are_kept_and_ordered_by_their_index(
    host: bool, exact32: bool, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(0)
    for n, scale in [(5000, 4.0), (300, 0.01), (40, 1.0), (9, 1.0)]:
        x = (torch.randn(n, generator=g) * scale).to(dtype).abs()  # bfloat16: many ties
        x[::7] = 0.0
        x[n // 2] = x.max()  # a tie at the top, far from the first one
        x[3] = x.max()
        k = min(16, n)
        vals, idx = largest(x, k, exact32=exact32, host=host)
        want_vals, want_idx = _oracle(x.float(), k)
        assert idx.tolist() == want_idx
        assert vals.float().tolist() == want_vals
        assert vals.dtype == x.dtype


def test_the_kth_value_shared_by_more_than_are_kept_keeps_the_first() -> None:
    x = torch.tensor([1.0, 5.0, 2.0, 2.0, 7.0, 2.0, 2.0, 0.0])
    for host, exact32 in [(True, True), (False, True), (False, False)]:
        vals, idx = largest(x, 4, exact32=exact32, host=host)
        assert idx.tolist() == [4, 1, 2, 3]
        assert vals.tolist() == [7.0, 5.0, 2.0, 2.0]
    vals, idx = largest(x, 0, exact32=True)
    assert vals.numel() == 0 and idx.numel() == 0 and idx.dtype == torch.int64


def test_float64_values_beyond_float32_are_told_apart() -> None:
    x = torch.tensor([1.0, 1.0 + 2**-40, 1.0, 1.0 + 2**-40], dtype=torch.float64)
    for host in (True, False):
        _, idx = largest(x, 3, exact32=False, host=host)
        assert idx.tolist() == [1, 3, 0]


def test_a_device_reads_a_bounded_piece_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device the values are read a piece at a time (bounded working copies, any length):
    the k largest over several pieces, ties across pieces by index, as from one piece."""
    monkeypatch.setattr(channels, "LARGEST_PIECE", 37)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(1000, generator=g) * 2).bfloat16().abs()
    x[[5, 400, 999]] = x.max()  # a tie at the top in three pieces
    for exact32 in (True, False):
        vals, idx = largest(x, 16, exact32=exact32, host=False)
        want_vals, want_idx = _oracle(x.float(), 16)
        assert idx.tolist() == want_idx
        assert vals.float().tolist() == want_vals
    _, idx = largest(x[:50], 16, exact32=True, host=False)  # 13 in the last piece: < k
    assert idx.tolist() == _oracle(x[:50].float(), 16)[1]
