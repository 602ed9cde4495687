"""The seam a capability of a measured pass plugs into: a Probe.

A measured pass (engine/measure.py) takes what every command measures — each selected call's
inputs, outputs and gradients, the model's outputs, which image held NaN/Inf — and, beside it,
a list of probes: one per capability the run asked for (per-channel numbers, per-token rows,
memory, attention heads, MoE routing, timing, saved tensors, generated text, a calibration's
input channels …). The pass is the only place probes are armed; a command hands its list to it
and folds the probes' findings into its report. A probe is one class in one module:

- `option` names the RunOptions field that asks for it ("" : on in every run that lists it);
  `wanted(run, rules)` says whether a run wants it — asked for, or needed by a rule (`ruled`).
- `batched` declares where it may run: True if it merges over a run's batches (a folder of
  images, a long text file, ranks under torchrun); a run in batches refuses the others by their
  flag (`refusal`), in one place (commands/folder.py), before anything runs.
- `setup(armed)` before the pass and before any probe's hooks (--profile's own timed passes);
- `arm(armed)` then: configure the collector, hand the hook session what it needs (a saver, a
  memory meter), and return a context held around the pass (hooks of its own).
- `read(measured)` inside the pass, while the output and the gradients are alive.
- `finish(measured, report)` after it: its numbers and notes into the report.

Adding a capability is one probe module and its line in the command's list.

A watched training step (hookcli.watch) is the user's code, not a pass hookcli runs: its
capabilities are StepProbes, which follow the step (armed when it begins, told of each forward,
folded into the step's line); the recorder holds their list (commands/watch/capture.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from hookcli.engine.hooks import HookSession
from hookcli.engine.passes import PassResult
from hookcli.engine.stats import StatsCollector
from hookcli.records import ImageNonfinite, LayerCall, TensorStats

if TYPE_CHECKING:
    from hookcli.engine.layout import LayoutOf
    from hookcli.engine.memory import MemoryMeter
    from hookcli.engine.prepare import Prepared
    from hookcli.inputs import ModelInput
    from hookcli.options import RunOptions
    from hookcli.records import Report, StepLine


@dataclass
class Armed:
    """What a probe arms before a pass: the prepared run, this pass's input and collector, and
    what the hook session is to be given."""

    prepared: Prepared
    model_input: ModelInput
    collector: StatsCollector
    backward: bool = False
    train: bool = False
    saver: Any = None  # io.saving.TensorSaver: every hooked tensor written as it is measured
    memory: MemoryMeter | None = None  # --memory: what autograd saves, per call
    _layout_of: LayoutOf | None = field(default=None, repr=False)

    @property
    def layout_of(self) -> LayoutOf:
        """Each output's layout (NCHW, NHWC, tokens), read once per pass (engine/layout.py)."""
        if self._layout_of is None:
            from hookcli.engine.layout import image_of, reader

            self._layout_of = reader(
                self.prepared.loaded.module, *image_of(self.model_input.forward_values())
            )
        return self._layout_of

    @property
    def types(self) -> dict[str, str]:
        """Each module name's type, as the selection listed it."""
        return {n: e.type for e in self.prepared.entries for n in e.names}


@dataclass
class Measured:
    """A measured pass: `result` while the pass runs (its output, gradients still readable);
    `calls` once it has ended, every statistic filled in."""

    session: HookSession
    collector: StatsCollector
    armed: Armed
    result: PassResult | None = None
    outputs: list[TensorStats] = field(default_factory=list)  # the model's outputs
    by_image: list[ImageNonfinite] = field(default_factory=list)  # which image held NaN/Inf
    calls: list[LayerCall] = field(default_factory=list)

    @property
    def model_input(self) -> ModelInput:
        return self.armed.model_input


class Probe:
    """One capability of a measured pass (see the module's docstring)."""

    option: ClassVar[str] = ""  # the RunOptions field that asks for it; "": always on
    flag: ClassVar[str] = ""  # as the CLI spells it, for a refusal (--channels)
    batched: ClassVar[bool] = False  # merges over a run's batches (folder, text file, ranks)
    # why not in batches, and the way round, where "--FLAG works on one batch" does not say it
    refusal: ClassVar[tuple[str, str] | None] = None
    text_only: ClassVar[bool] = False  # reads token ids: a folder of images refuses it as such

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A probe's `option` is read by name: one that names no RunOptions field is refused
        when the probe's class is made (at import), never read as false."""
        super().__init_subclass__(**kwargs)
        if cls.option:
            from hookcli.options import RunOptions

            if cls.option not in {f.name for f in dataclasses.fields(RunOptions)}:
                raise TypeError(f"{cls.__name__}.option {cls.option!r} is not a RunOptions field")

    @classmethod
    def of(cls, run: RunOptions, command: str) -> Probe:
        """The probe a run (RunOptions) of `command` arms."""
        return cls()

    @classmethod
    def wanted(cls, run: RunOptions, rules: Any = None) -> bool:
        """Whether `run` (RunOptions) asks for it, or a rule of `rules` reads what it measures
        (a probe with no option is always on)."""
        return not cls.option or cls.asked(run, rules)

    @classmethod
    def asked(cls, run: RunOptions, rules: Any = None) -> bool:
        """Whether an option or a rule names it (a probe that is always on is asked by none)."""
        named = bool(getattr(run, cls.option)) if cls.option else False
        return named or (rules is not None and cls.ruled(rules))

    @classmethod
    def ruled(cls, rules: Any) -> bool:
        """Whether a rule reads what this probe measures. `rules` is commands.checks.Rules,
        which the engine below it does not know: a probe annotates it as that."""
        return False

    def setup(self, armed: Armed) -> None:
        """Before the pass and before any probe's context: what must not see another probe's
        hooks (--profile's own timed passes)."""

    def arm(self, armed: Armed) -> contextlib.AbstractContextManager[Any]:
        """Before the pass, every probe set up: configure, and return a context held around
        the pass."""
        return contextlib.nullcontext()

    def read(self, measured: Measured) -> None:
        """Inside the pass, its output and gradients alive."""

    def finish(self, measured: Measured, report: Report) -> None:
        """After the pass, every statistic final: into the report."""


@contextlib.contextmanager
def armed_probes(probes: list[Probe] | tuple[Probe, ...], armed: Armed) -> Iterator[None]:
    """Every probe set up, then armed, their contexts held (in order) around what runs
    inside."""
    for probe in probes:
        probe.setup(armed)
    with contextlib.ExitStack() as stack:
        for probe in probes:
            stack.enter_context(probe.arm(armed))
        yield


@dataclass
class StepArmed:
    """What a probe of a watched training step arms when the step begins: the module (its
    device) and what the step's hook session is to be given."""

    module: Any  # torch.nn.Module
    device: Any  # torch.device: where its parameters are
    memory: MemoryMeter | None = None  # what autograd saves, per call


class StepProbe:
    """One capability of a watched training step (hookcli.watch). The step is the user's own
    code, not a pass hookcli runs, so its probes follow the step: armed when a watched step
    begins (before its hook session is made), told when each forward of the model begins and
    ends, closed with `ended` once the step's weights have changed (before its calls are
    completed), folded into the step's line with `finish`, and disarmed when the step is over
    or the watch closes. The recorder (commands/watch/capture.py) holds the list."""

    def arm(self, armed: StepArmed) -> None:
        """The step begins: configure, and hand the hook session what it needs."""

    def forward_began(self) -> None:
        """A forward of the model with autograd begins."""

    def forward_ended(self) -> None:
        """That forward returned."""

    def ended(self) -> None:
        """The step's weights have changed; its calls are not yet completed."""

    def finish(self, record: StepLine, optimizer: Any) -> None:
        """Its findings into the step's line."""

    def disarm(self) -> None:
        """The step is over (or the watch closes, or a forward raised): let go of everything."""
