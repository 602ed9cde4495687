"""--ablate as a probe: hooks that change the named layers' outputs in a second pass
(commands/ablation.py); a layer that never ran is refused. One batch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from hookcli.commands.ablation import AblationSpec, ablated, parse
from hookcli.engine.probes import Armed, Measured, Probe
from hookcli.errors import UsageError
from hookcli.options import RunOptions
from hookcli.records import Report


class Ablate(Probe):
    option = "ablate"
    flag = "ablate"

    def __init__(self, specs: Sequence[AblationSpec]) -> None:
        self.specs = specs
        self.calls: list[int] = []

    @classmethod
    def of(cls, run: RunOptions, command: str) -> Ablate:
        return cls([parse(a) for a in run.ablate])

    @contextlib.contextmanager
    def arm(self, armed: Armed) -> Iterator[None]:
        prepared = armed.prepared
        ids = armed.model_input.kwargs.get("input_ids")
        tokens = tuple(ids.shape) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
        real = armed.model_input.token_mask if tokens is not None else None
        with ablated(
            prepared.entries, self.specs, prepared.seed, armed.layout_of, tokens=tokens, real=real
        ) as calls:
            self.calls = calls
            yield

    def finish(self, measured: Measured, report: Report) -> None:
        for spec, n in zip(self.specs, self.calls, strict=True):
            if n == 0:
                raise UsageError(
                    f"--ablate: layer {spec.layer} never ran, so ablating it changes nothing.",
                    "ablate a layer that runs (`hookcli layers MODEL --shapes` shows calls).",
                )
