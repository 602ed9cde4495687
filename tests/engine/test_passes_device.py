"""engine/passes: which devices are one (a model already there is not moved), and the buffers'
copies made and put back together (one foreach copy per device and dtype)."""

from __future__ import annotations

import pytest
import torch

from hookcli.engine import passes
from hookcli.engine.passes import same_device


def test_a_device_without_an_index_is_its_first_or_current_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = torch.device("cpu")
    assert same_device(cpu, torch.device("cpu"))
    assert same_device(cpu, torch.device("cpu", 0))
    assert not same_device(cpu, torch.device("meta"))
    assert same_device(torch.device("cuda", 1), torch.device("cuda:1"))
    assert not same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    # "cuda" is the current CUDA device: a model on cuda:0 is where a run on "cuda" is
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert same_device(torch.device("cuda:0"), torch.device("cuda"))
    assert same_device(torch.device("cuda"), torch.device("cuda", 0))
    assert not same_device(torch.device("cuda"), torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert same_device(torch.device("cuda:1"), torch.device("cuda"))


def test_copies_of_several_dtypes_are_made_exactly_each_group_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    original = torch._foreach_copy_
    monkeypatch.setattr(
        torch, "_foreach_copy_", lambda d, s: calls.append(len(d)) or original(d, s)
    )
    src = [
        torch.tensor([1.0, float("nan"), -0.0]),
        torch.tensor([3], dtype=torch.int64),
        torch.tensor([2.5, 7.0]),
    ]
    dst = [torch.empty_like(t) for t in src]
    versions = [t._version for t in dst]
    passes._copy_all(list(zip(src, dst, strict=True)))
    for a, b in zip(src, dst, strict=True):
        bits = torch.int64 if a.dtype == torch.int64 else torch.int32
        assert torch.equal(a.view(bits), b.view(bits))  # bit for bit: NaN and -0.0 too
    assert sorted(calls) == [1, 2]  # float32 together, int64 apart
    assert [t._version for t in dst] != versions
