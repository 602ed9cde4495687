"""The records every report is made of: a tensor's statistics, a layer call, a parameter, an
origin of NaN/Inf, a check's result, the model and its input. Plain dataclasses: numbers and
strings, never tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from hookcli.records.llm import ChannelStats
from hookcli.records.meta import ABSENT, LEAST, LENIENT, REQUIRED
from hookcli.records.statfields import Stat, stat, stats_of

SCHEMA_VERSION = 2
# the schemas this version reads (1: a check's failures were strings; the rest is the same)
READABLE_SCHEMAS = (1, 2)
LOG_SCHEMA = 1  # a hookcli.watch log line's version (StepLine, NonfiniteLine)
READABLE_LOG_SCHEMAS = (1,)  # the log line versions this version reads


@dataclass(slots=True)
class TokenRow:
    """--per-token: one position of one sequence of a (batch, tokens, channels) output: the
    L2 norm, mean and std (population) over its channels, and its largest |x| with the channel
    holding it. `token`/`id`: what sits at that position of the input (None: not known)."""

    sequence: int
    position: int
    norm: float | None
    mean: float | None
    std: float | None
    max_abs: float | None
    channel: int | None
    id: int | None = None
    token: str | None = None


@dataclass(slots=True)
class TensorStats:
    """Statistics of one tensor, taken the moment a hook saw it.

    `mean`, `std` (population, correction 0), `min`, `max` and `norm` are over the finite
    elements; `zeros` is the fraction of elements equal to zero; `nan`/`inf` are counts.
    A statistic that does not exist (empty tensor, no finite value) is None.

    Each statistic is declared here once, with how it merges, compares and shows
    (records/statfields.py); everything that handles them as a set iterates TENSOR_STATS.
    """

    path: str
    shape: tuple[int, ...] = field(metadata={LEAST: 0})
    dtype: str = field(metadata={ABSENT: ""})
    numel: int = field(metadata={LEAST: 0})
    mean: float | None = stat("mean", "rms", header="mean")
    std: float | None = stat("std", "rms", header="std")
    min: float | None = stat("min", "rms", header="min", drop=1)
    max: float | None = stat("max", "rms", header="max", drop=2)
    zeros: float | None = stat("fraction", "points", header="zeros", format="pct", drop=3)
    nan: int = stat("count", "count", label="NaN")
    inf: int = stat("count", "count", label="Inf")
    norm: float | None = stat("norm", "relative")
    note: str | None = None
    values: list[float | None] | None = None  # the elements (non-finite: None), numel <= 16
    hist: dict[str, list[float]] | None = None  # --hist: "counts" per bin, "edges" (bins + 1)
    # a layer's 3-D/4-D output: NCHW, NHWC or tokens:K+HxW (engine.layout), unknown when it
    # cannot be told; None for other tensors
    layout: str | None = None
    # --per-token: each real position's statistics
    per_token: list[TokenRow] | None = field(default=None, metadata={LENIENT: True})
    channels: ChannelStats | None = None  # --channels: per channel, kurtosis, massive values

    @property
    def nonfinite(self) -> bool:
        return self.nan > 0 or self.inf > 0


# TensorStats' statistics, in field order (the order of its JSON keys' statistics, CSV columns,
# and the engine's row after its count)
TENSOR_STATS: tuple[Stat, ...] = stats_of(TensorStats)


def rescale(t: TensorStats, scale: float) -> None:
    """t's statistics that scale with its tensor (mean, std, min, max, norm: each Stat's
    `scales`) multiplied by `scale` (> 0), in place: a gradient made another loss's."""
    for s in TENSOR_STATS:
        value = getattr(t, s.name)
        if s.scales and value is not None:
            setattr(t, s.name, value * scale)


@dataclass(slots=True)
class LayerCall:
    """One call of one selected module."""

    name: str
    type: str
    call: int = field(metadata={LEAST: 0})
    aliases: list[str] = field(default_factory=list)
    inputs: list[TensorStats] = field(default_factory=list, metadata={REQUIRED: True})
    outputs: list[TensorStats] = field(default_factory=list, metadata={REQUIRED: True})
    grad_inputs: list[TensorStats] | None = None
    grad_outputs: list[TensorStats] | None = None
    params: list[ParamStats] | None = None
    # the order hooks saw this call in: its return among the calls' returns (a child before
    # its container), and its output gradient's arrival among theirs (0: nearest the loss)
    forward_order: int | None = None
    backward_order: int | None = None
    error: str | None = None
    profile: CallProfile | None = None
    memory: CallMemory | None = None  # --memory


@dataclass(slots=True)
class CallMemory:
    """--memory: what one call holds. `saved_bytes`: the distinct storages autograd saved for
    backward between the call's entry and its return (its children's included; parameters and
    buffers left out; None without a backward, when nothing is saved); `output_bytes`: its
    output's distinct storages at return; `peak_bytes` (CUDA): the allocator's peak while it
    ran, everything allocated counted; `freed_bytes`: what it saved that nothing outside it
    saved too, less its inputs (a checkpoint keeps them): what checkpointing it would free."""

    saved_bytes: int | None
    saved_tensors: int | None
    output_bytes: int
    peak_bytes: int | None = None
    freed_bytes: int | None = None  # what checkpointing the call would free


@dataclass(slots=True)
class Candidate:
    """A checkpointing candidate: a call whose freed bytes (CallMemory.freed_bytes) would be
    recomputed in backward instead, at the cost of its forward FLOPs again (`bytes_per_flop`
    None: no FLOPs counted, an elementwise or normalisation call, the cheapest to recompute)."""

    layer: str
    call: int
    freed_bytes: int
    flops: int | None
    bytes_per_flop: float | None


@dataclass(slots=True)
class Memory:
    """--memory's totals, in bytes. Parameters and buffers count each storage once (tied
    weights once). `saved_bytes`: everything autograd saved in the pass (each storage once,
    inside layers or not; None without backward). `predicted_peak`: the most one training
    step holds at once, its backward walked on its own clock (engine.memory's step_peak:
    parameters, buffers, optimizer state and the output throughout, what is still saved, the
    gradients made so far and those in flight). `measured_peak` (CUDA): the allocator's peak
    over the pass, hookcli's own statistics included."""

    device: str
    parameters: int
    parameter_bytes: int
    buffer_bytes: int
    gradient_bytes: int | None = None
    optimizer_bytes: int | None = None
    saved_bytes: int | None = None
    saved_tensors: int | None = None
    predicted_peak: int | None = None
    measured_peak: int | None = None
    candidates: list[Candidate] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class CallProfile:
    """--profile: this call's forward (and backward) time and its output's size.

    `forward_ms` is the total from entering the module to its return; `self_ms` is that less
    the time of the modules called inside it (equal for a leaf)."""

    forward_ms: float
    backward_ms: float | None
    output_bytes: int
    share: float | None = None  # forward_ms / the unhooked pass
    self_ms: float | None = None
    flops: int | None = None  # forward FLOPs (FlopCounterMode), the modules it calls included


@dataclass(slots=True)
class Profile:
    """--profile's totals. A folder run adds each batch's up (`batches`). "Selected" counts a
    call that ran inside another selected call once, in it; the forward of the whole model
    (`model_ms`, hook work excluded) is the selected calls + `outside_ms` (a forward's own code
    outside any module, not inside a selected call) + `unselected_ms` (modules not selected)."""

    unhooked_ms: float  # the same pass without hooks, median of `runs` (per batch)
    layers_ms: float  # the selected calls' forward times, added up (nested ones counted once)
    runs: int
    unhooked_backward_ms: float | None = None
    layers_backward_ms: float | None = None
    batches: int = 1
    model_ms: float | None = None
    outside_ms: float | None = None
    unselected_ms: float | None = None
    containers: int = 0  # selected calls that ran other modules inside them
    nested: int = 0  # selected calls that ran inside another selected call
    flops: int | None = None  # the model's forward FLOPs (FlopCounterMode's total)
    layers_flops: int | None = None  # the selected calls' FLOPs (nested ones counted once)
    backward_flops: int | None = None
    flops_note: str | None = None  # why FLOPs were not counted


@dataclass(slots=True)
class ParamStats:
    """One parameter of a layer after backward: its gradient and how large it is relative to
    the weight. `grad` is None when the parameter received no gradient (never 0)."""

    name: str
    shape: tuple[int, ...]
    numel: int
    requires_grad: bool
    norm: float | None
    grad: TensorStats | None = None
    grad_norm: float | None = None
    grad_mean: float | None = None
    grad_max_abs: float | None = None
    ratio: float | None = None  # grad_norm / norm


@dataclass(slots=True)
class Origin:
    """Where non-finite values first appeared (engine.origins).

    `where` is "layer": inside this call — forward, the first call to return non-finite
    outputs from finite inputs; backward, the first whose gradient w.r.t. its outputs was finite
    and w.r.t. its inputs was not. "between": code outside the selected modules, run between
    call `after` (its `after_finite` tensors finite) and this call, whose input (forward) or
    output gradient (backward) held them; `code` names the forwards that code can be in.
    "before": already in the first call's input (the model's input, or code before it) or in
    the first gradient to arrive (the loss, or code after this call). "shared" (backward): in
    the gradient w.r.t. this call's input, which something outside the call read too — the
    gradient is every reader's sum, so it is this call's backward or one of `code` (other
    calls that read it, or code in the forwards named). "after" (forward): in the model's
    output, every call's finite — made by code after the last call (`after`). "loss"
    (hookcli.watch): in the loss the loop gave `w.loss()`, the model's outputs finite."""

    direction: str  # forward | backward
    layer: str
    type: str
    call: int = field(metadata={LEAST: 0})
    path: str
    nan: int = field(metadata={LEAST: 0})
    inf: int = field(metadata={LEAST: 0})
    where: str = field(default="layer", metadata={LENIENT: True})
    after: str | None = field(default=None, metadata={LENIENT: True})
    # "output" | "input" (forward), "input" | "output" gradient
    after_finite: str | None = field(default=None, metadata={LENIENT: True})
    code: list[str] = field(default_factory=list, metadata={LENIENT: True})

    def describe(self) -> str:  # noqa: PLR0911 (one sentence per kind of place)
        counts = ", ".join(f"{n} {k}" for n, k in ((self.nan, "NaN"), (self.inf, "Inf")) if n)
        forward = self.direction == "forward"
        here = f"{self.layer} ({self.type}) call {self.call}"
        if self.where == "layer":
            what = "output" if forward else "gradient w.r.t. input"
            return f"{self.direction}: first at {here}, {what} {self.path}: {counts}"
        what = "input" if forward else "gradient w.r.t. output"
        code = _either(self.code)
        if self.where == "loss":  # hookcli.watch: the loss given to w.loss()
            return (
                f"forward: in the loss ({counts}), the model's outputs finite: made by the loss "
                "code (a log of 0, a division by a zero count …)"
            )
        if self.where == "after":
            last = f", made after {self.after} (finite output), the last call" if self.after else ""
            return (
                f"forward: in the model's output {self.path} ({counts}){last}: code in "
                f"{code or 'the model'}"
            )
        if self.where == "shared":
            return (
                f"backward: first in the gradient w.r.t. the input {self.path} of {here} "
                f"({counts}), which was read outside it too: its backward, or another "
                f"reader's — {code or 'code in the model'}"
            )
        if self.where == "before":
            if forward:
                return (
                    f"forward: already in the input of {here}, the first selected call "
                    f"({what} {self.path}: {counts}): the model's input, or code before it"
                    + (f" in {code}" if code else "")
                )
            return (
                f"backward: already in the first gradient to arrive, at {here} ({what} "
                f"{self.path}: {counts}): from the loss or target, or code after it"
                + (f" in {code}" if code else "")
            )
        finite = (
            f"finite {self.after_finite}"
            if forward
            else f"finite gradient w.r.t. {self.after_finite}"
        )
        return (
            f"{self.direction}: entered between {self.after} ({finite}) and {here} "
            f"({what} {self.path}: {counts}): code in {code or 'the model'}"
        )


def _either(names: list[str]) -> str:
    """a, b or c."""
    if len(names) <= 1:
        return "".join(names)
    return f"{', '.join(names[:-1])} or {names[-1]}"


@dataclass(slots=True)
class Failure:
    """One entry that broke a rule: where (layer call, tensor path), the value found and the
    limit it broke, and the one line that says so. `layer`/`call` are None for the model's
    output and the input gradients (`path` names them); `value`/`limit` are numbers, or
    text where the rule compares shapes or counts several things (NaN and Inf)."""

    message: str
    layer: str | None = None
    call: int | None = None
    path: str | None = None
    value: float | str | None = None
    limit: float | str | None = None
    channel: int | None = None  # --channels' rules: the channel, and for tokens the position
    position: int | None = None


@dataclass(slots=True)
class CheckResult:
    """One rule's verdict; `failures` lists the offending layer calls or entries, `first`
    the one a reader should look at first (where the trouble began), when the rule can tell."""

    rule: str
    passed: bool
    message: str
    failures: list[Failure] = field(default_factory=list)
    first: Failure | None = None


@dataclass(slots=True)
class LayerChange:
    """One layer call's output in the ablated run against the clean run."""

    layer: str
    call: int
    path: str
    norm_before: float
    norm_after: float
    relative: float  # |after - before| / before, of the norm
    mean_before: float | None
    mean_after: float | None
    # the largest move of its mean, std, min, max or norm, in units of the clean output's rms
    # (a sign flip keeps the norm: this does not)
    moved: float | None = None


@dataclass(slots=True)
class Ablation:
    specs: list[str]
    predictions_before: list[Prediction] | None
    predictions_after: list[Prediction] | None
    outputs_before: list[TensorStats]
    outputs_after: list[TensorStats]
    changed_layers: list[LayerChange]


@dataclass(slots=True)
class Backward:
    """What backward started from: a description and the scalar's value (for the next-token
    loss of a text, also its perplexity, exp(loss))."""

    source: str
    value: float | None
    perplexity: float | None = None


@dataclass(slots=True)
class Prediction:
    """One of an image's top-k. `prob` is None when the model's score is NaN/Inf; `source` is
    the image's path (relative to the folder it was found in); `folder_class` the class
    folder of an ImageFolder tree."""

    rank: int
    index: int
    label: str | None
    prob: float | None
    image: int = 0
    source: str | None = None
    folder_class: str | None = None


@dataclass(slots=True)
class ImageNonfinite:
    """One image (batch row) whose input or the model's output held NaN/Inf: which image
    (its file, when it came from one) and how many in each."""

    image: int
    source: str | None
    input_nan: int = 0
    input_inf: int = 0
    output_nan: int = 0
    output_inf: int = 0


@dataclass(slots=True)
class ModelInfo:
    name: str
    spec: str
    task: str
    weights: str
    params: int = field(metadata={LEAST: 0})
    mode: str = "eval"
    seed: int | None = None  # --seed: random weights and random inputs come from it
    # the floating-point dtype its parameters ran in (engine.selection.dtype_of; None in a
    # report written before it was recorded)
    dtype: str | None = None


@dataclass(slots=True)
class TextInfo:
    """One sequence of a text input: the text as given, and its real tokens (padding left out)
    as ids and as readable labels (hookcli.sources.tokentext: " cat" keeps its space)."""

    text: str
    ids: list[int]
    tokens: list[str]


@dataclass(slots=True)
class Generated:
    """--generate: one sequence's new tokens (ids, and as text when a tokenizer is known)."""

    sequence: int
    ids: list[int]
    text: str | None
    tokens: list[str] | None = None


@dataclass(slots=True)
class InputInfo:
    description: str
    shapes: list[tuple[int, ...]] = field(metadata={LEAST: 0})
    sources: list[str] = field(default_factory=list)
    preprocessing: str | None = None
    texts: list[TextInfo] | None = None  # a text input: its sequences, token by token
