"""--generate as a probe: the pass runs model.generate (every step's forward through the hooks)
and the report gains each sequence's new tokens. One batch of text."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from hookcli.engine.probes import Armed, Measured, Probe
from hookcli.options import RunOptions
from hookcli.records import Report


class Generation(Probe):
    option = "generate"
    flag = "generate"

    def __init__(self, tokens: int, sample: bool) -> None:
        self.tokens = tokens
        self.sample = sample

    @classmethod
    def of(cls, run: RunOptions, command: str) -> Generation:
        return cls(run.generate, run.sample)

    def arm(self, armed: Armed) -> contextlib.AbstractContextManager[Any]:
        from hookcli.sources.lm import generation_args

        ids = armed.model_input.kwargs.get("input_ids")
        prompt = int(ids.shape[-1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 0
        armed.model_input.generate = generation_args(
            armed.prepared.loaded, self.tokens, self.sample, prompt
        )
        return contextlib.nullcontext()

    def finish(self, measured: Measured, report: Report) -> None:
        from hookcli.sources.lm import generated_of

        assert measured.result is not None
        prepared = measured.armed.prepared
        report.generated, said = generated_of(
            measured.result.output, measured.model_input, prepared.loaded
        )
        report.notes.append(said)
