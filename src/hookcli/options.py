"""What a run is asked to do, as small frozen objects (no torch: the CLI builds them).

Every command — inspect, grads, check, layers, maps, cam, diff and folder runs — describes its
run with these, and the engine turns them into a prepared model and hooked passes.

An option's default lives here, in its field, and nowhere else: the CLI's parameters take
their defaults from these objects (`DEFAULTS`), the Python API's keyword arguments fill the same
objects (`pick`), and the project config feeds the CLI's parameters (Click's default_map).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hookcli import bounds
from hookcli.errors import UsageError

GENERATE_MAX = 1 << 20  # new tokens one --generate may ask for
MODEL_ARG_MAX = 1000  # characters of one --model-arg KEY=VALUE: far beyond any real one
HIST_BINS = 12  # --hist and the API's hist=True: equal bins from min to max of the finite values
DEFAULT_BATCH = 32  # images per batch of a folder run; a folder with more is batched


T = TypeVar("T")


def pick(cls: type[T], params: Mapping[str, Any], **given: Any) -> T:
    """An option object from parsed parameters (the CLI's `ctx.params`, the API's keywords):
    each field whose name is a parameter takes its value (lists as tuples); a field with no
    parameter, or one left unset (None), keeps its default; `given` are fields converted by the
    caller. So a new option is one parameter plus one field with its default."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in given:
            values[f.name] = given[f.name]
        elif params.get(f.name) is not None:
            value = params[f.name]
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def field_names(cls: type[Any]) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def hist_bins(hist: bool | int) -> int:
    """--hist / hist=True → HIST_BINS bins, False → none; an int is a bin count."""
    if isinstance(hist, bool):
        return HIST_BINS if hist else 0
    return hist


def check_model_arg_text(pairs: Sequence[str]) -> None:
    """--model-arg KEY=VALUE texts, before they are parsed as Python literals: a value of
    100k characters (or brackets nested that deep) is refused by its length."""
    for pair in pairs:
        if len(pair) > MODEL_ARG_MAX:
            key = pair.partition("=")[0][:40]
            raise UsageError(
                f"--model-arg {key}=… is {len(pair)} characters long; "
                f"at most {MODEL_ARG_MAX} are accepted.",
                "give the value in a short form (a number, a name, a short list), or build the "
                "model in a file.py:Name factory.",
            )


def need_layer(layer: str | None) -> str:
    """maps draws one named layer."""
    if not layer:
        raise UsageError(
            "maps needs a layer: -l LAYER.", "e.g. -l conv1; `hookcli layers MODEL` lists them."
        )
    return layer


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """Which model, with which weights, on which device."""

    model: Any  # a registry name, file.py:Name, pkg.mod:Name, an nn.Module or a LoadedModel
    weights: str = "none"
    seed: int = 0
    device: str = "auto"
    model_args: Mapping[str, Any] = field(default_factory=dict)
    output_key: str | None = None  # the element of a dict/tuple output read for predictions
    # hf: models: which head to build (causal-lm, seq2seq-lm, seq-cls, image-cls, base);
    # None: the one the checkpoint was saved with (a bare hf:TYPE: the type's own)
    head: str | None = None
    # where --text's tokenizer comes from (PATH or ORG/NAME); from Python, a tokenizer too
    tokenizer: Any = None
    meta: bool = False  # built on the meta device: shapes, counts and FLOPs, no weights
    offload: bool = False  # an hf: checkpoint's weights read block by block as it runs
    # an hf: checkpoint spread over torchrun's processes by its tensor-parallel plan
    tp: bool = False

    def __post_init__(self) -> None:
        bounds.integer(self.seed, "--seed", low=0, high=bounds.SEED_MAX, example="--seed 0")
        chosen = [f"--{n}" for n in ("meta", "offload", "tp") if getattr(self, n)]
        if len(chosen) > 1:
            raise UsageError(
                f"{' and '.join(chosen)} each build the model their own way (--meta without "
                "weights, --offload reading them as it runs, --tp spread over processes).",
                "choose one.",
            )

    @property
    def building(self) -> str:
        """How the model is built (sources/skeleton.py): "meta", "offload", "tp" or ""."""
        return "meta" if self.meta else "offload" if self.offload else "tp" if self.tp else ""


@dataclass(frozen=True, slots=True)
class Selection:
    """Which modules to hook: patterns, types, depth; `always` is hooked whatever the rest says
    (--expect-shape's layers); `every` hooks every module (layers --shapes, CAM's search)."""

    layers: tuple[str, ...] = ()
    types: tuple[str, ...] = ()
    depth: int | None = None
    always: tuple[str, ...] = ()
    every: bool = False


@dataclass(frozen=True, slots=True)
class InputOptions:
    """Image files/folders (or, from Python, tensors), or tensor specs, or nothing (a random
    input of the right shape). `strict`: an unreadable image found in a folder is an error
    instead of being skipped."""

    items: tuple[Any, ...] = ()
    specs: tuple[str, ...] = ()
    strict: bool = False
    text: tuple[str, ...] = ()  # --text: one sequence each (several: a padded batch)
    text_file: str | None = None  # --text-file: one sequence per line
    chat: bool = False  # each text as a user turn through the tokenizer's chat template
    padding_side: str | None = None  # a padded text batch: left or right (None: the tokenizer's)
    # --generate: a decoder-only LM's batch is padded on the left (generate appends after the
    # last real token), an encoder-decoder's on the right (new tokens go to its decoder)
    generating: bool = False
    # a seq2seq model's target for each text: the decoder's input (teacher forcing) and the
    # labels of grads' default loss
    target_text: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        given: Any = self.text
        if isinstance(given, str):  # the API's text="…": one sequence
            object.__setattr__(self, "text", (given,))
        elif not isinstance(given, tuple | list) or not all(isinstance(t, str) for t in given):
            wrong = (
                next((t for t in given if not isinstance(t, str)), given)
                if isinstance(given, tuple | list)
                else given
            )
            raise TypeError(
                "text must be a string or a list of strings (one sequence each), not "
                f"{'a list holding ' if wrong is not given else ''}{type(wrong).__name__}"
            )
        else:
            object.__setattr__(self, "text", tuple(given))
        target: Any = self.target_text
        if isinstance(target, str):
            object.__setattr__(self, "target_text", (target,))
        elif not isinstance(target, tuple | list) or not all(isinstance(t, str) for t in target):
            raise TypeError("target_text must be a string or a list of strings (one per text)")
        else:
            object.__setattr__(self, "target_text", tuple(target))
        if self.padding_side not in (None, "left", "right"):
            raise UsageError(
                f"--padding-side must be left or right, not {self.padding_side!r}.",
                "e.g. --padding-side right",
            )
        path: Any = self.text_file
        if isinstance(path, os.PathLike):
            object.__setattr__(self, "text_file", os.fspath(path))
        elif path is not None and not isinstance(path, str):
            raise TypeError(
                f"text_file must be a path (str or os.PathLike), not {type(path).__name__}"
            )

    @property
    def has_text(self) -> bool:
        return bool(self.text) or self.text_file is not None


@dataclass(frozen=True, slots=True)
class BackwardOptions:
    """What backward starts from (a target or a loss), and whether the input's gradient is
    reported too."""

    target: str | None = None
    loss: str | None = None
    input_grad: bool = False


# how CPU statistics are computed (engine/stats.py): torch reductions until numba pays, numba
# at once, or never numba; the figures agree to rounding
STATS_BACKENDS = ("auto", "kernel", "torch")


def stats_backend_default() -> str:
    """The process's statistics backend, from the environment, read once by the package's
    edge (hookcli's __init__): HOOKCLI_STATS=torch puts every command's statistics on torch
    ops (no numba kernels loaded, here or in the background); else "auto"."""
    return "torch" if os.environ.get("HOOKCLI_STATS", "auto").strip() == "torch" else "auto"


@dataclass(frozen=True, slots=True)
class RunOptions:
    """Everything else one inspection does."""

    train: bool = False
    topk: int | None = None
    hist: int = 0  # histogram bins, 0: none
    profile: bool = False
    memory: bool = False  # --memory: saved-for-backward, output and peak bytes per call
    per_token: bool = False  # per-position statistics of (batch, tokens, C) outputs
    channels: bool = False  # per-channel statistics, kurtosis and massive activations
    heads: bool = False  # every attention head's sink, entropy and most-attended key
    generate: int = 0  # new tokens model.generate makes (0: one forward); hooks see every step
    position: int | None = None  # a language model's predictions: after this real token
    sample: bool = False  # --generate samples (under --seed) instead of greedy decoding
    save: Any = None  # an io.output.Destination (the API claims a path it is given)
    ablate: tuple[str, ...] = ()
    deterministic: bool = False
    stats_backend: str = "auto"  # "kernel": numba at once; "torch": never; results agree
    config: str | None = None  # the project config file used, stated in the report

    def __post_init__(self) -> None:
        if self.topk is not None:
            bounds.integer(self.topk, "--topk", low=0, high=bounds.INT32_MAX, example="--topk 5")
        bounds.integer(
            self.generate, "--generate", low=0, high=GENERATE_MAX, example="--generate 8"
        )
        if self.stats_backend not in STATS_BACKENDS:
            raise UsageError(
                f"stats_backend {self.stats_backend!r} is not a statistics backend.",
                "use auto (the default), kernel (numba from the first tensor) or torch.",
            )


@dataclass(frozen=True, slots=True)
class FolderOptions:
    """A folder run: images in batches, statistics aggregated across them."""

    batch_size: int = DEFAULT_BATCH
    limit: int | None = None
    workers: int = 0  # DataLoader processes decoding images
    per_image: int = 0  # each image's top-K predictions, 0: none

    def __post_init__(self) -> None:
        bounds.integer(
            self.batch_size, "--batch-size", low=1, high=bounds.BATCH_MAX, example="--batch-size 32"
        )
        if self.limit is not None:
            bounds.integer(self.limit, "--limit", low=1, high=2**63 - 1, example="--limit 1000")
        bounds.integer(
            self.workers, "--workers", low=0, high=bounds.WORKERS_MAX, example="--workers 2"
        )
        bounds.integer(
            self.per_image, "--per-image", low=0, high=bounds.INT32_MAX, example="--per-image 3"
        )


@dataclass(frozen=True, slots=True)
class Batching:
    """What was asked of batching: --batch-size, --limit, --workers, --per-image (None or 0:
    not given). Asking for any of the first three makes an image run a folder run; so does a
    folder holding more images than one batch (dataset.folder_options decides)."""

    batch_size: int | None = None
    limit: int | None = None
    workers: int = 0
    per_image: int = 0

    def __post_init__(self) -> None:  # (--per-image is read by a one-batch run too)
        bounds.integer(
            self.per_image, "--per-image", low=0, high=bounds.INT32_MAX, example="--per-image 3"
        )

    @property
    def asked(self) -> bool:
        return self.batch_size is not None or self.limit is not None or bool(self.workers)

    def folder(self) -> FolderOptions:
        """The folder run's options (validated here)."""
        size = DEFAULT_BATCH if self.batch_size is None else self.batch_size
        return FolderOptions(size, self.limit, self.workers, self.per_image)


# The Python API's keyword arguments and where each one goes.
API_KEYS: dict[str, tuple[str, str]] = {
    "weights": ("model", "weights"),
    "seed": ("model", "seed"),
    "device": ("model", "device"),
    "model_args": ("model", "model_args"),
    "output_key": ("model", "output_key"),
    "head": ("model", "head"),
    "tokenizer": ("model", "tokenizer"),
    "offload": ("model", "offload"),
    "tp": ("model", "tp"),
    "layers": ("selection", "layers"),
    "types": ("selection", "types"),
    "depth": ("selection", "depth"),
    "also_layers": ("selection", "always"),
    "input_specs": ("inputs", "specs"),
    "strict": ("inputs", "strict"),
    "text": ("inputs", "text"),
    "text_file": ("inputs", "text_file"),
    "chat": ("inputs", "chat"),
    "padding_side": ("inputs", "padding_side"),
    "target_text": ("inputs", "target_text"),
    "target": ("backward", "target"),
    "loss": ("backward", "loss"),
    "input_grad": ("backward", "input_grad"),
    "train": ("run", "train"),
    "topk": ("run", "topk"),
    "hist": ("run", "hist"),
    "profile": ("run", "profile"),
    "memory": ("run", "memory"),
    "per_token": ("run", "per_token"),
    "channels": ("run", "channels"),
    "heads": ("run", "heads"),
    "generate": ("run", "generate"),
    "position": ("run", "position"),
    "sample": ("run", "sample"),
    "save": ("run", "save"),
    "ablate": ("run", "ablate"),
    "deterministic": ("run", "deterministic"),
    "stats_backend": ("run", "stats_backend"),
    "config": ("run", "config"),
}


@dataclass(frozen=True, slots=True)
class Invocation:
    """One inspection, whole: what `hookcli.inspect(...)` and the CLI commands ask for."""

    model: ModelOptions
    selection: Selection = Selection()
    inputs: InputOptions = InputOptions()
    run: RunOptions = RunOptions()
    backward: BackwardOptions | None = None

    @classmethod
    def from_api(
        cls, model: Any, inputs: Any, options: Mapping[str, Any], *, backward: bool
    ) -> Invocation:
        """The Python API's keyword arguments (hookcli.inspect/grads) → an Invocation."""
        parts: dict[str, dict[str, Any]] = {
            "model": {},
            "selection": {},
            "inputs": {},
            "run": {},
            "backward": {},
        }
        for key, value in options.items():
            if key not in API_KEYS:
                allowed = ", ".join(sorted(API_KEYS))
                raise TypeError(f"unexpected option {key!r}; options are: {allowed}")
            part, name = API_KEYS[key]
            parts[part][name] = tuple(value) if isinstance(value, list) else value
        if "hist" in parts["run"]:
            parts["run"]["hist"] = hist_bins(parts["run"]["hist"])
        if not backward and parts["backward"]:
            raise TypeError(f"{', '.join(parts['backward'])}: options of grads, not inspect")
        items = _input_items(inputs)
        return cls(
            model=ModelOptions(model, **parts["model"]),
            selection=Selection(**parts["selection"]),
            inputs=InputOptions(items, **parts["inputs"]),
            run=RunOptions(**parts["run"]),
            backward=BackwardOptions(**parts["backward"]) if backward else None,
        )


def _input_items(inputs: Any) -> tuple[Any, ...]:
    """Paths (str or Path), a tensor, a sequence of tensors, or a mapping of keyword
    tensors (a tokenizer's output: input_ids, attention_mask, …) → a tuple of items."""
    if isinstance(inputs, str | Path):
        return (str(inputs),)
    if hasattr(inputs, "shape") and hasattr(inputs, "dtype"):  # one tensor
        return (inputs,)
    if isinstance(inputs, Mapping):  # (transformers' BatchEncoding is one)
        return (dict(inputs),)
    if isinstance(inputs, Sequence):
        return tuple(str(x) if isinstance(x, Path) else x for x in inputs)
    return tuple(inputs)


@dataclass(frozen=True, slots=True)
class RuleOptions:
    """What check is asked to verify (inspect and grads take --fail-on and --dead-frac too);
    checks.parse_rules validates them into Rules. No rule at all means nonfinite for check."""

    fail_on: tuple[str, ...] = ()
    dead_frac: float = 1.0  # "dead": a ReLU-like output whose zero fraction reaches this
    max_abs: float | None = None
    min_std: float | None = None  # "collapse": an output whose std is below this
    grad_norm: str | None = None  # "MIN:MAX", either bound may be empty
    max_outlier_ratio: float | None = None  # a tensor's largest channel max|x| ÷ the median's
    max_kurtosis: float | None = None
    max_sink: float | None = None  # a dormant head: its queries' mean probability on token 0
    min_entropy: float | None = None  # a collapsed head: its queries' mean entropy (nats)
    max_expert_imbalance: float | None = None  # a router's busiest expert ÷ the mean load
    max_saved_mb: float | None = None  # what autograd saves in one step, in 10^6 bytes
    expect_shape: tuple[str, ...] = ()  # "LAYER=1x64x112x112"
    baseline: Path | None = None
    rtol: float = 1e-3
    atol: float = 1e-6
    backward: bool = False


@dataclass(frozen=True, slots=True)
class MapOptions:
    """maps: which layer call's channels, how many, in which order, of which image."""

    layer: str | None = None
    call: int = 0
    channels: int = 64
    order: str = "activity"
    image_index: int = 0


@dataclass(frozen=True, slots=True)
class CamOptions:
    """cam: which layer call (None: the last layer over the image that the gradient reaches),
    which method, which image."""

    layer: str | None = None
    call: int = 0
    method: str = "gradcam"
    image_index: int = 0


@dataclass(frozen=True, slots=True)
class AttnOptions:
    """attn: which attention block (a dotted name or glob; None: the last block) and which
    image of the batch."""

    layer: str | None = None
    image_index: int = 0
    queries: str | None = None  # token matrices: the query rows drawn, START:END (None: all)


@dataclass(frozen=True, slots=True)
class LensOptions:
    """lens: how many tokens per position, and the modules that read a block's output (None:
    found in the model: its blocks, its final norm, its unembedding)."""

    topk: int = 5
    blocks: str | None = None  # a glob on dotted names of the blocks
    norm: str | None = None  # a module name, or "none" for no norm
    unembed: str | None = None


@dataclass(frozen=True, slots=True)
class DiffOptions:
    """diff: the two sides (and an optional reference side), as side specs
    (compare.parse_side), whether passes run in processes of their own, the tolerance, and
    the batch size for a folder."""

    a: str = ""  # as loaded: the checkpoint's own dtype (a bf16 checkpoint runs in bf16)
    b: str | None = None
    ref: str | None = None
    isolate: bool = False
    tol: float | None = None  # None: the coarsest side's precision's (commands.diff.tolerance)
    batch_size: int | None = None
    sort: str = "order"
    own: bool = True
    max_kld: float | None = None  # a causal LM's text: exit 1 past this mean KL(A||B)
    min_same_top1: float | None = None  # … or below this fraction of the same top-1 token


@dataclass(frozen=True, slots=True)
class CalibOptions:
    """calib: sequences (or images) per pass, and SmoothQuant's migration strength."""

    batch_size: int = 8
    alpha: float = 0.5


@dataclass(frozen=True, slots=True)
class WatchOptions:
    """hookcli.watch: which optimizer steps are watched (every `every`-th, from step 0) and
    which layers (globs on dotted names, types; neither: every leaf), where the log goes (None:
    kept in memory) and the repro bundle (None: next to the log; True: there, a log required;
    False: none), how many recent records a bundle keeps, whether every step is checked for
    NaN/Inf."""

    every: int = 1
    layers: tuple[str, ...] = ()
    types: tuple[str, ...] = ()
    log: str | Path | None = None
    ring: int = 8
    bundle: str | Path | bool | None = None
    check: bool = True
    tensorboard: str | Path | None = None  # a log folder: each watched step's scalars there
    memory: bool = False  # each watched step's saved-for-backward bytes and memory totals


@dataclass(frozen=True, slots=True)
class Defaults:
    """One instance of each option object: what the CLI's parameters default to."""

    model: ModelOptions = ModelOptions(None)
    inputs: InputOptions = InputOptions()
    backward: BackwardOptions = BackwardOptions()
    run: RunOptions = RunOptions()
    batching: Batching = Batching()
    rules: RuleOptions = RuleOptions()
    maps: MapOptions = MapOptions()
    cam: CamOptions = CamOptions()
    attn: AttnOptions = AttnOptions()
    lens: LensOptions = LensOptions()
    diff: DiffOptions = DiffOptions()
    watch: WatchOptions = WatchOptions()
    calib: CalibOptions = CalibOptions()


DEFAULTS = Defaults()
