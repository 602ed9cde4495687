"""Plain dataclasses a run produces: numbers and strings, never tensors.

Renderers read these and nothing else, so they never need torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# a report's views in a notebook or at a prompt (the CLI's table, an HTML fragment, a DataFrame)
# are rendered by hookcli.render.views, which imports this module: hookcli._views holds the
# loader the package installs, so records imports no renderer
from hookcli._views import views as _views

# what --channels, --heads and MoE routing add, kept in records/llm.py, read from here
from hookcli.records.llm import ChannelStats as ChannelStats
from hookcli.records.llm import ExpertStats as ExpertStats
from hookcli.records.llm import HeadStats as HeadStats
from hookcli.records.llm import LensViewed
from hookcli.records.llm import Massive as Massive
from hookcli.records.llm import MassiveAt as MassiveAt
from hookcli.records.llm import OutlierFeature as OutlierFeature
from hookcli.records.llm import Outliers as Outliers
from hookcli.records.llm import Rendered as Rendered

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
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    mean: float | None = None
    std: float | None = None
    min: float | None = None
    max: float | None = None
    zeros: float | None = None
    nan: int = 0
    inf: int = 0
    norm: float | None = None
    note: str | None = None
    values: list[float | None] | None = None  # the elements (non-finite: None), numel <= 16
    hist: dict[str, list[float]] | None = None  # --hist: "counts" per bin, "edges" (bins + 1)
    # a layer's 3-D/4-D output: NCHW, NHWC or tokens:K+HxW (engine.layout), unknown when it
    # cannot be told; None for other tensors
    layout: str | None = None
    per_token: list[TokenRow] | None = None  # --per-token: each real position's statistics
    channels: ChannelStats | None = None  # --channels: per channel, kurtosis, massive values

    @property
    def nonfinite(self) -> bool:
        return self.nan > 0 or self.inf > 0


@dataclass(slots=True)
class LayerCall:
    """One call of one selected module."""

    name: str
    type: str
    call: int
    aliases: list[str] = field(default_factory=list)
    inputs: list[TensorStats] = field(default_factory=list)
    outputs: list[TensorStats] = field(default_factory=list)
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
    call: int
    path: str
    nan: int
    inf: int
    where: str = "layer"
    after: str | None = None
    after_finite: str | None = None  # "output" | "input" (forward), "input" | "output" gradient
    code: list[str] = field(default_factory=list)

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
    params: int
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
    shapes: list[tuple[int, ...]]
    sources: list[str] = field(default_factory=list)
    preprocessing: str | None = None
    texts: list[TextInfo] | None = None  # a text input: its sequences, token by token


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _short(text: str, most: int = 120) -> str:
    return text if len(text) <= most else text[: most - 1] + "…"


class _Viewed:
    """What a report does in a notebook: a short repr, `report["layer"]`, the CLI's table
    (`table()`, and `print(report)`), an HTML view (`_repr_html_`) and `to_pandas()`."""

    __slots__ = ()

    def _calls(self) -> list[Any]:
        raise NotImplementedError

    def _summary(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self._summary()[:2000]

    def __str__(self) -> str:
        return self.table()

    __iter__ = None  # not a sequence: `report[name]` looks a layer up; iterate `.layers`

    def _named(self, name: str) -> list[Any]:
        """The calls of the layer named `name` (its dotted name, or an alias)."""
        return [c for c in self._calls() if c.name == name or name in getattr(c, "aliases", ())]

    def __contains__(self, name: object) -> bool:
        """Whether a layer of that name (or alias) has a call in this report."""
        return isinstance(name, str) and bool(self._named(name))

    def __getitem__(self, name: str) -> list[Any]:
        """The calls of the layer named `name` (its dotted name, or an alias it was called
        by), in call order. KeyError, naming the nearest names, when it has none here."""
        if not isinstance(name, str):
            raise TypeError(f"a report is indexed by layer name, not {type(name).__name__}")
        calls = self._named(name)
        if not calls:
            import difflib

            names = list(dict.fromkeys(c.name for c in self._calls()))
            near = difflib.get_close_matches(name, names, n=3)
            hint = f"; nearest: {', '.join(near)}" if near else ""
            raise KeyError(f"no call of a layer named {name!r} in this report{hint}")
        return calls

    def table(self, *, color: bool = False, width: int | None = None) -> Rendered:
        """The table the CLI prints (`width`: characters; None: 200)."""
        return Rendered(_views().table(self, color=color, width=width))

    def _repr_html_(self) -> str:
        return str(_views().html(self))

    def to_pandas(self) -> Any:
        """One row per measured tensor, as a pandas DataFrame (hookcli[pandas]); the same rows
        and columns as `-f csv` and `-o FILE.parquet`."""
        return _views().frame(self)


@dataclass(slots=True, repr=False)
class Report(_Viewed):
    model: ModelInfo
    input: InputInfo
    device: str
    layers: list[LayerCall]
    never_called: list[str] = field(default_factory=list)
    outputs: list[TensorStats] = field(default_factory=list)
    predictions: list[Prediction] | None = None
    prediction_note: str | None = None
    generated: list[Generated] | None = None  # --generate: each sequence's new tokens
    checks: list[CheckResult] = field(default_factory=list)
    outliers: Outliers | None = None  # --channels: massive activations, outlier features
    heads: list[HeadStats] | None = None  # --heads: every attention call's heads
    experts: list[ExpertStats] | None = None  # a MoE model's routing, router by router
    notes: list[str] = field(default_factory=list)
    nonfinite_origins: list[Origin] = field(default_factory=list)
    # the images whose input or output held NaN/Inf (a batch or folder: which image)
    nonfinite_images: list[ImageNonfinite] = field(default_factory=list)
    backward: Backward | None = None
    input_grads: list[TensorStats] | None = None
    ablation: Ablation | None = None
    profile: Profile | None = None
    memory: Memory | None = None  # --memory
    interrupted: bool = False
    config: str | None = None
    command: str = "inspect"
    schema: int = SCHEMA_VERSION
    hookcli_version: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: plain types only, NaN never appears (None instead)."""
        data = dataclasses.asdict(self)
        ordered: dict[str, Any] = {"schema": data.pop("schema")}
        ordered.update(data)
        return ordered

    def _calls(self) -> list[LayerCall]:
        return self.layers

    def _summary(self) -> str:
        tensors = [t for c in self.layers for t in (*c.inputs, *c.outputs)]
        tensors += [
            t for c in self.layers for t in (*(c.grad_inputs or []), *(c.grad_outputs or []))
        ]
        bad = sum(t.nonfinite for t in (*tensors, *self.outputs))
        named = len({c.name for c in self.layers})
        parts = [
            f"input {_short(self.input.description, 80)}",
            f"{len(self.layers)} layer calls of {named} layers",
        ]
        if self.never_called:
            parts.append(f"{len(self.never_called)} never called")
        if bad:
            first = self.nonfinite_origins[0].describe() if self.nonfinite_origins else ""
            parts.append(f"NaN/Inf in {bad} tensors" + (f" ({_short(first)})" if first else ""))
        else:
            parts.append("no NaN/Inf")
        if self.checks:
            failed = [c.rule for c in self.checks if not c.passed]
            parts.append(
                f"checks: {len(failed)} failed ({', '.join(failed)})" if failed else "checks passed"
            )
        if self.predictions:
            top = self.predictions[0]
            label = top.label if top.label is not None else f"class {top.index}"
            prob = f" {top.prob:.3g}" if top.prob is not None else ""
            parts.append(f"top-1 {_short(label, 40)}{prob}")
        if self.notes:
            parts.append(_count(len(self.notes), "note"))
        body = "; ".join(parts)
        return f"<Report {self.command} {_short(self.model.spec, 80)} on {self.device}: {body}>"


@dataclass(slots=True)
class ModuleRow:
    """One module of `hookcli layers`."""

    name: str
    type: str
    depth: int
    params: int
    own_params: int
    leaf: bool
    aliases: list[str] = field(default_factory=list)
    output_shapes: list[str] | None = None
    calls: int | None = None
    hookable: bool = True  # False: inside TorchScript, where Python hooks cannot reach
    # own parameters that are another module's (tied weights), as "weight = other.weight";
    # the model's total counts them once
    tied: list[str] = field(default_factory=list)
    flops: int | None = None  # --meta: forward FLOPs of its calls, added up


@dataclass(slots=True)
class WeightBytes:
    """`hookcli layers`: the bytes the model's parameters take, each parameter once (a tied
    weight, lm_head = embed_tokens, counted once). `held`: by the dtype each parameter holds
    (their sum is `bytes`); `as_dtype`: every parameter in that one dtype (int8: 1 byte a
    parameter, int4: half a byte, rounded up; quantization scales and zero points are not
    counted); `assumes` says so in words. Buffers (batch norm statistics, rotary tables) are
    `buffer_bytes`, as held, apart."""

    params: int
    bytes: int
    held: dict[str, int]
    as_dtype: dict[str, int]
    buffer_bytes: int = 0
    assumes: str = ""


@dataclass(slots=True)
class KVCache:
    """`hookcli layers` of a causal LM: the key/value cache one more token of context adds,
    read from its config (None where it cannot be told: `note` says why). Attention layers
    keep 2 x kv_heads x head_dim values a token each (`per_layer_values`; an MLA layer its
    compressed latent, kv_lora_rank + qk_rope_head_dim); `sliding_layers` of them keep at
    most `window` tokens, so past that a token adds only the full layers' `full_bytes`.
    `bytes_at_context`: one sequence at the config's `context` (max_position_embeddings)."""

    dtype: str
    bytes_per_token: int | None
    formula: str = ""
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    per_layer_values: int | None = None
    full_layers: int | None = None
    sliding_layers: int = 0
    window: int | None = None
    full_bytes: int | None = None  # a token past the window: the full layers' share
    context: int | None = None
    bytes_at_context: int | None = None
    note: str | None = None


@dataclass(slots=True)
class LayersReport:
    model: ModelInfo
    modules: list[ModuleRow]
    input: InputInfo | None = None
    flops: int | None = None  # --meta: the forward's FLOPs (FlopCounterMode)
    notes: list[str] = field(default_factory=list)
    weights: WeightBytes | None = None
    kv_cache: KVCache | None = None  # a causal LM's; None for any other model


@dataclass(slots=True)
class ModelEntry:
    """One row of `hookcli models`."""

    name: str
    task: str
    weights: list[str]
    default: str | None
    params: int | None
    input_size: str | None
    metric: str | None


@dataclass(slots=True)
class SavedFile:
    """`hookcli show`: what a saved .safetensors file holds."""

    path: str
    metadata: dict[str, str]
    tensors: list[TensorStats]


@dataclass(slots=True)
class TensorDiff:
    """One tensor of one layer call on a compared side against the reference side. `nonfinite`
    counts the elements not finite on either side; when there are any, every metric is null
    (nothing is measured over what is left) and `note` says why, when it can be told (an
    overflow past the compared dtype's range, NaN/Inf already on the reference side).
    `rel_l2` = ‖b - a‖ / ‖a‖, `cosine` = a·b / (‖a‖‖b‖), `sqnr_db` = 10·log10(‖a‖² /
    ‖b - a‖²) (null when identical), `norm_rel` = (‖b‖ - ‖a‖) / ‖a‖, signed: below 0 when
    side b shrinks the tensor (all a report-vs-report diff can tell). `own_rel_l2`: the
    relative L2 of this tensor when the layer is fed the reference side's input (its own
    error; null when not measured)."""

    path: str
    shape: tuple[int, ...]
    numel: int
    max_abs: float | None = None
    rel_l2: float | None = None
    cosine: float | None = None
    sqnr_db: float | None = None
    norm_rel: float | None = None
    nonfinite: int = 0
    over: bool = False
    note: str | None = None
    own_rel_l2: float | None = None
    # the model's (batch, tokens, vocab) output: the relative L2 of each sequence's each
    # position over the vocabulary ([sequence][position]; null where the reference is zero)
    per_position: list[list[float | None]] | None = None


@dataclass(slots=True)
class DiffCall:
    """One layer call: side B against the reference (side A, or --ref), and with --ref side A
    against it too. `type` is the reference side's module type, `type_b` side B's when it
    differs (ConvReLU2d / QuantizedConvReLU2d); `fused_into` names the module an Identity left
    by conv+bn+relu fusion was fused into (its row compares nothing)."""

    name: str
    type: str
    call: int
    b: list[TensorDiff] = field(default_factory=list)
    a: list[TensorDiff] | None = None
    type_b: str | None = None
    fused_into: str | None = None


@dataclass(slots=True, repr=False)
class DiffReport(_Viewed):
    model: ModelInfo
    input: InputInfo
    device: str
    a: str  # the sides, as described
    b: str
    ref: str | None  # --ref: the side both are measured against; None: side A is
    isolate: bool  # each layer fed the reference side's input: its own error only
    tol: float
    calls: list[DiffCall]
    tol_source: str = ""  # "--tol", or the default's reason (the sides' precision)
    sort: str = "order"  # the calls' order: order (returned), error, own (largest first)
    outputs: list[DiffCall] = field(default_factory=list)  # the model's return value
    first_over: str | None = None  # the first call (in return order) past --tol
    # per compared side ("B", and "A" with --ref): top-1 flips and top-k overlap of the class
    # scores against the reference; None when the model's output is not class scores
    agreement: dict[str, dict[str, Any]] | None = None
    largest_own: list[dict[str, Any]] = field(default_factory=list)  # the top own errors
    missing: list[str] = field(default_factory=list)  # calls on one side only
    notes: list[str] = field(default_factory=list)
    command: str = "diff"
    schema: int = SCHEMA_VERSION
    # the dtype each side ran in, by its label (A, B, and ref with --ref): its parameters',
    # under autocast where it asks (commands.diff.sides.ran_in); empty in a saved-report diff
    ran: dict[str, str] = field(default_factory=dict)
    hookcli_version: str = ""

    @property
    def failed(self) -> bool:
        return self.first_over is not None

    def _calls(self) -> list[DiffCall]:
        return [*self.calls, *self.outputs]

    def side(self, label: str) -> str:
        """A side ("A", "B" or "ref") as given, and the dtype it ran in where that is not what
        it says: `as loaded (bfloat16)`."""
        described = {"A": self.a, "B": self.b}.get(label, self.ref) or ""
        ran = self.ran.get(label)
        return described if ran is None or ran == described else f"{described} ({ran})"

    def _summary(self) -> str:
        verdict = (
            f"first past tol {self.tol:g}: {_short(self.first_over)}"
            if self.first_over
            else f"every call within tol {self.tol:g}"
        )
        sides = f"{_short(self.side('A'), 60)} vs {_short(self.side('B'), 60)}"
        body = f"{sides}, {len(self.calls)} layer calls, {verdict}"
        if self.notes:
            body += f"; {_count(len(self.notes), 'note')}"
        return f"<DiffReport {_short(self.model.spec, 80)} on {self.device}: {body}>"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        ordered: dict[str, Any] = {"schema": data.pop("schema")}
        ordered.update(data)
        return ordered


@dataclass(slots=True)
class LensToken:
    index: int
    token: str | None
    prob: float | None


@dataclass(slots=True)
class LensCell:
    """One block's lens at one position of one sequence: its top tokens."""

    layer: str
    sequence: int
    position: int
    top: list[LensToken]


@dataclass(slots=True)
class CalibLayer:
    """calib: one layer's input channels over every input, and its outlier ratios (largest
    channel max|x| ÷ the median channel's) of its input and weight, before and after
    SmoothQuant's smoothing (None where its weight is not per input channel)."""

    name: str
    type: str
    channels: ChannelStats
    act_ratio: float | None
    smoothed_act_ratio: float | None = None
    weight_ratio: float | None = None
    smoothed_weight_ratio: float | None = None


@dataclass(slots=True)
class CalibSkip:
    """calib: a selected layer (or one expert's projection) with no numbers, and why."""

    name: str
    type: str
    reason: str


@dataclass(slots=True)
class CalibReport:
    """`hookcli calib`: each selected layer's input channels; `hist_bounds` the inner bounds of
    every layer's |x| histogram (channels.abs_hist): bin 0 holds |x| below the first, bin k
    bounds[k-1] <= |x| < bounds[k], the last |x| at or above the last bound."""

    model: ModelInfo
    input: InputInfo
    device: str
    alpha: float
    layers: list[CalibLayer]
    hist_bounds: list[float]
    notes: list[str] = field(default_factory=list)
    command: str = "calib"
    # selected layers calib could not read (never ran, no float input, an expert no token
    # was routed to): listed, never dropped in silence
    skipped: list[CalibSkip] = field(default_factory=list)


@dataclass(slots=True, repr=False)
class LensReport(LensViewed):
    """`hookcli lens`: each block's top tokens at every real position of every sequence; in a
    notebook or at a prompt, its views (records.llm.LensViewed)."""

    model: ModelInfo
    input: InputInfo
    device: str
    blocks: list[str]
    norm: str | None
    unembed: str
    lens: list[LensCell] = field(default_factory=list)
    # per sequence, the token at each position read, in order (a seq2seq model's: the
    # decoder's tokens)
    tokens: list[list[str | None]] | None = None
    # the last block's lens against the model's own logits: the largest |difference|
    last_vs_logits: float | None = None
    # what the lens applies around the unembedding as the model does, in words (T5's scale
    # of what it reads, a final soft cap of the logits, …); empty: nothing
    applied: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    command: str = "lens"
    schema: int = 1
    hookcli_version: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        return {"schema": data.pop("schema"), **data}


# ---------------------------------------------------------------- hookcli.watch's log lines


@dataclass(slots=True)
class LoggedCall:
    """One layer call of a watched step, as its log line holds it (no element values or
    histograms). A gradient list is None when the call's tensors had no gradient."""

    name: str
    type: str
    call: int
    inputs: list[TensorStats]
    outputs: list[TensorStats]
    grad_outputs: list[TensorStats] | None = None
    grad_inputs: list[TensorStats] | None = None
    error: str | None = None
    memory: CallMemory | None = None  # watch(memory=True)


@dataclass(slots=True)
class LoggedParam:
    """One parameter of a watched step: its norm before the step, its gradient's statistics,
    and the update the optimizer made (its norm, and that ÷ the parameter's norm)."""

    name: str
    norm: float | None
    grad: TensorStats | None
    update_norm: float | None
    update_ratio: float | None


@dataclass(slots=True)
class StepLine:
    """A watched optimizer step: one line of a hookcli.watch log, and one of `w.records`."""

    step: int
    rank: int
    world_size: int
    loss: float | None
    layers: list[LoggedCall]
    params: list[LoggedParam]
    nonfinite_origins: list[Origin] = field(default_factory=list)
    loss_nonfinite: bool = False  # the loss was NaN/Inf (`loss` is null then)
    skipped: bool | None = None  # with a GradScaler: it skipped this step (inf gradients)
    scale: float | None = None  # with a GradScaler: its loss scale
    run: str | None = None  # the run's id, as the log writer marks each line
    schema: int = LOG_SCHEMA
    kind: str = "step"
    merged_ranks: int | None = None  # read back: the rank logs merged into it (runmerge)
    memory: Memory | None = None  # watch(memory=True): the step's totals


@dataclass(slots=True)
class NonfiniteLine:
    """The first NaN/Inf of a watched run (`w.nonfinite`): what held it, where the hooked
    re-run found it began, and the repro bundle written for `hookcli replay`."""

    step: int
    rank: int
    world_size: int
    found: list[str]
    origins: list[Origin] = field(default_factory=list)
    nonfinite_params: list[str] = field(default_factory=list)
    nonfinite_grads: list[str] = field(default_factory=list)
    bundle: str | None = None
    notes: list[str] = field(default_factory=list)
    run: str | None = None
    schema: int = LOG_SCHEMA
    kind: str = "nonfinite"


# a tensor's statistics in a log line: the numbers, no element values or histograms
_LOGGED_STATS = tuple(
    f.name for f in dataclasses.fields(TensorStats) if f.name not in ("values", "hist", "channels")
)
_LINE_FIRST = ("schema", "kind", "step", "rank", "world_size")
# written only when they say something: a step's loss is finite, a run has no GradScaler, a
# step is one process's (not merged from rank logs)
_UNLESS = {
    "loss_nonfinite": False,
    "skipped": None,
    "scale": None,
    "run": None,
    "merged_ranks": None,
    "memory": None,
}


def _logged_stats(t: TensorStats) -> dict[str, Any]:
    """Field by field (dataclasses.asdict's deep copy cost resnet18 30 ms a watched step)."""
    out = {name: getattr(t, name) for name in _LOGGED_STATS}
    out["shape"] = list(t.shape)
    if t.per_token is not None:
        out["per_token"] = [dataclasses.asdict(r) for r in t.per_token]
    return out


def _logged_call(c: LoggedCall) -> dict[str, Any]:
    def many(ts: list[TensorStats] | None) -> list[dict[str, Any]] | None:
        return None if ts is None else [_logged_stats(t) for t in ts]

    return {
        "name": c.name,
        "type": c.type,
        "call": c.call,
        "inputs": many(c.inputs),
        "outputs": many(c.outputs),
        "grad_outputs": many(c.grad_outputs),
        "grad_inputs": many(c.grad_inputs),
        "error": c.error,
    } | ({} if c.memory is None else {"memory": dataclasses.asdict(c.memory)})


def log_line(line: StepLine | NonfiniteLine) -> dict[str, Any]:
    """A log line as the JSON object written to disk: schema, kind, step, rank and world size
    first; optional fields only when they say something. `from_json` reads it back."""
    data: dict[str, Any] = {k: getattr(line, k) for k in _LINE_FIRST}
    for f in dataclasses.fields(line):
        if f.name in data:
            continue
        value = getattr(line, f.name)
        # a GradScaler's scale is written, null too, whenever a scaler was given
        scaled = f.name == "scale" and getattr(line, "skipped", None) is not None
        if f.name in _UNLESS and value == _UNLESS[f.name] and not scaled:
            continue
        if f.name == "layers":
            value = [_logged_call(c) for c in value]
        elif f.name == "params":
            value = [
                {
                    "name": p.name,
                    "norm": p.norm,
                    "grad": None if p.grad is None else _logged_stats(p.grad),
                    "update_norm": p.update_norm,
                    "update_ratio": p.update_ratio,
                }
                for p in value
            ]
        elif f.name in ("nonfinite_origins", "origins"):
            value = [dataclasses.asdict(o) for o in value]
        elif f.name == "memory":
            value = dataclasses.asdict(value)
        elif isinstance(value, list):
            value = list(value)
        data[f.name] = value
    return data
