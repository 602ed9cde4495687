"""--profile as a probe: each call's time from passes of their own before the measured one
(commands/profile.py) and FLOPs; over a run's batches the times and FLOPs add up."""

from __future__ import annotations

from hookcli.commands.profile import ProfileSum, profile_calls
from hookcli.engine.flops import CallKey
from hookcli.engine.probes import Armed, Measured, Probe
from hookcli.records import CallProfile, Profile, Report


class Profiled(Probe):
    option = "profile"
    flag = "profile"
    batched = True

    def __init__(self, into: ProfileSum | None = None) -> None:
        self.sum = into  # a run in batches: each batch's times added here
        self.timing: tuple[Profile, dict[CallKey, CallProfile]] | None = None
        self.passes = 0

    def setup(self, armed: Armed) -> None:
        # timed before this pass's statistics are taken, and before any probe's hooks are on
        # (a fused MoE block's expert tap would be timed and read again); a later batch
        # follows a warm model
        self.timing = profile_calls(
            armed.prepared,
            train=armed.train,
            model_input=armed.model_input,
            warm_up=self.passes == 0,
        )
        self.passes += 1

    def read(self, measured: Measured) -> None:
        if self.sum is not None and self.timing is not None:
            self.sum.add(*self.timing)  # counted with the batch's statistics, never without

    def finish(self, measured: Measured, report: Report) -> None:
        assert self.timing is not None
        report.profile, by_call = self.timing
        for call in report.layers:
            call.profile = by_call.get((call.name, call.call))
