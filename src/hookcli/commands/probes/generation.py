"""--generate as a probe: the pass runs model.generate (every step's forward through the hooks;
its arguments are part of the prepared input, set by inspect before any pass, --profile's
included) and the report gains each sequence's new tokens. One batch of text."""

from __future__ import annotations

from hookcli.engine.probes import Measured, Probe
from hookcli.options import RunOptions
from hookcli.records import Report


class Generation(Probe):
    option = "generate"
    flag = "generate"
    text_only = True

    def __init__(self, tokens: int, sample: bool) -> None:
        self.tokens = tokens
        self.sample = sample

    @classmethod
    def of(cls, run: RunOptions, command: str) -> Generation:
        return cls(run.generate, run.sample)

    def finish(self, measured: Measured, report: Report) -> None:
        from hookcli.sources.lm import generated_of

        assert measured.result is not None
        prepared = measured.armed.prepared
        report.generated, said = generated_of(
            measured.result.output, measured.model_input, prepared.loaded
        )
        report.notes.append(said)
