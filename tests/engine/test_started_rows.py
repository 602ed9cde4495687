"""Rows started on a device in the pass and finished at finalize (stats.Started): one the
device could not finish is reported as not measured, with why, never as numbers."""

from __future__ import annotations

import pytest
import torch

from hookcli.engine import stats


def test_a_row_the_device_could_not_finish_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    pools_seen: list[dict[torch.device, object]] = []

    def started(x: torch.Tensor, pools: dict[torch.device, object]) -> int:
        pools.setdefault(x.device, object())
        pools_seen.append(pools)
        return 0

    monkeypatch.setattr(stats, "_CPU_DTYPES", ())  # (a CPU tensor takes the device's way)
    monkeypatch.setattr(stats, "started_row", started)
    monkeypatch.setattr(
        stats, "finished_rows", lambda pools: dict.fromkeys(pools, "RuntimeError: no kernel")
    )
    c = stats.StatsCollector()
    got = c.add(torch.randn(10, dtype=torch.float64), "x")
    c.finalize()
    assert pools_seen and got.mean is None and got.std is None and got.norm is None
    assert got.note == "not measured: the device's statistics failed (RuntimeError: no kernel)"
    assert not pools_seen[0]  # the pools are let go with the pass
