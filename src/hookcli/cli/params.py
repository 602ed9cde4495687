"""The options commands share, declared once each (their defaults come from the option
objects, hookcli.options.DEFAULTS), and the project config fed to them as Click's default_map
(ConfigCommand): a value not given on the command line comes from hookcli.toml, else from the
option's default. Nothing here imports torch.
"""

from __future__ import annotations

import enum
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperCommand
from typer.models import OptionInfo

from hookcli.errors import HookcliError, UsageError
from hookcli.options import (
    InputOptions,
    ModelOptions,
    Selection,
    check_model_arg_text,
    pick,
)
from hookcli.render import Format

if TYPE_CHECKING:
    from hookcli.io.config import Key

# ------------------------------------------------------------------ model and input

ModelArg = Annotated[
    str | None,
    typer.Argument(
        help="torchvision name (resnet34), timm:NAME, hf:TYPE|PATH|ORG/NAME, "
        "path/to/file.py:Name or package.module:Name [default: `model` from hookcli.toml].",
        show_default=False,
    ),
]
InputsArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="Image files or folders (one batch). Omit for a random input of the right shape.",
        show_default=False,
    ),
]
InputSpecOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--input",
        "-i",
        metavar="SPEC",
        help="Tensor input instead of images: randn:1x3x224x224, rand:…, ones:…, zeros:…, "
        "randint:LOW:HIGH:SHAPE (token ids), file.pt, file.npy; :DTYPE after any "
        "(randn:1x3x8x8:bfloat16); NAME=SPEC for a keyword argument "
        "(input_ids=randint:0:1000:1x16). Repeat for several forward arguments.",
    ),
]
TextOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--text",
        metavar="TEXT",
        help="Text for a language model, through its tokenizer. Repeat for a batch (padded, "
        "with its attention mask; padding never enters a statistic).",
    ),
]
TextFileOpt = Annotated[
    str | None,
    typer.Option("--text-file", metavar="FILE", help="Texts, one sequence per line (UTF-8)."),
]
TargetTextOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--target-text",
        metavar="TEXT",
        help="A seq2seq model's target, one per --text: the decoder reads its tokens (teacher "
        "forcing) and grads' default loss is their cross-entropy.",
    ),
]
ChatOpt = Annotated[
    bool,
    typer.Option("--chat", help="Each text as a user turn through the tokenizer's chat template."),
]
PaddingSideOpt = Annotated[
    str | None,
    typer.Option(
        "--padding-side",
        metavar="left|right",
        help="Pad a batch of texts on the left or the right [default: the tokenizer's].",
    ),
]
TokenizerOpt = Annotated[
    str | None,
    typer.Option(
        "--tokenizer",
        metavar="PATH|ORG/NAME",
        help="The tokenizer for --text [default: the checkpoint's own folder or cache entry].",
    ),
]
GenerateOpt = Annotated[
    int,
    typer.Option(
        "--generate",
        metavar="N",
        help="Run model.generate for N new tokens (greedy): the hooks see every step, call 0 "
        "the prompt, call k the k-th new token.",
    ),
]
SampleOpt = Annotated[
    bool, typer.Option("--sample", help="--generate samples (under --seed) instead of greedy.")
]
PositionOpt = Annotated[
    int | None,
    typer.Option(
        "--position",
        metavar="P",
        help="Language models: predict the token after real token P of each sequence "
        "(0: the first, -1: the last) [default: -1].",
    ),
]
PerTokenOpt = Annotated[
    bool,
    typer.Option(
        "--per-token",
        help="Per position of each (batch, tokens, channels) output: norm, mean, std and max|x| "
        "with its channel, labelled by token.",
    ),
]
ChannelsOpt = Annotated[
    bool,
    typer.Option(
        "--channels",
        help="Per channel of each layer call's inputs and outputs (last dim of tokens, NCHW's "
        "dim 1): count, mean, std, min, max, max|x|, zeros; each tensor's kurtosis, outlier "
        "ratio and massive activations; outlier features.",
    ),
]
HeadsOpt = Annotated[
    bool,
    typer.Option(
        "--heads",
        help="Every attention head (text and vision): its sink (mean probability on the first "
        "token), mean entropy and most-attended key, in one extra forward.",
    ),
]
HeadOpt = Annotated[
    str | None,
    typer.Option(
        "--head",
        metavar="causal-lm|seq2seq-lm|seq-cls|image-cls|base",
        help="hf: models: the head to build [default: the one the checkpoint was saved with; "
        "for hf:TYPE the type's own: a causal LM for decoder types].",
    ),
]
QueriesOpt = Annotated[
    str | None,
    typer.Option(
        "--queries",
        metavar="START:END",
        help="Token matrices: only these query rows (a Python slice; -16: the last 16).",
    ),
]
WeightsOpt = Annotated[
    str,
    typer.Option(
        "--weights",
        "-w",
        metavar="none|DEFAULT|ENUM|PATH",
        help="none = random init under --seed; DEFAULT or an enum name = torchvision weights "
        "(hub cache, else download), for timm:NAME DEFAULT or a tag (local HF cache only); "
        "PATH = a local state dict.",
    ),
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for random weights and inputs.")]
DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device", metavar="auto|cpu|cuda[:N]|mps", help="auto picks a GPU when present."
    ),
]
ModelArgOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--model-arg",
        metavar="KEY=VALUE",
        help="Keyword argument for the model builder. Repeatable.",
    ),
]
OutputKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--output-key",
        metavar="KEY",
        help="The element of a dict/tuple output that predictions, targets and CAM read: a key "
        '(logits, out), an index (0) or a path (out[0]["boxes"]).',
    ),
]
TrainOpt = Annotated[
    bool,
    typer.Option(
        "--train",
        help="Run in train mode (BatchNorm batch statistics, dropout); buffers are restored.",
    ),
]

# ------------------------------------------------------------------ selection

LayerOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--layer",
        "-l",
        metavar="PATTERN",
        help="Dotted name or glob on dotted names (layer2.*.conv*). Repeatable.",
    ),
]
TypeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--type", "-t", metavar="CLASS", help="Module class name, e.g. Conv2d. Repeatable."
    ),
]
DepthOpt = Annotated[
    int | None,
    typer.Option("--depth", metavar="N", help="Modules at depth N (plus shallower leaves)."),
]

# ------------------------------------------------------------------ backward

TargetOpt = Annotated[
    str | None,
    typer.Option(
        "--target",
        metavar="top1|INDEX|LABEL|sum",
        help="What backward starts from [default: top1, the top-1 score of each image].",
        show_default=False,
    ),
]
LossOpt = Annotated[
    str | None,
    typer.Option(
        "--loss",
        metavar="KIND:ARG",
        help="Backward from a loss instead: ce:IDX, nll:IDX, l1:SPEC, mse:SPEC, "
        "bce:SPEC, bcelogits:SPEC (SPEC: ones, zeros, ones:2x10, file.pt, …).",
    ),
]

# ------------------------------------------------------------------ what a run does

TopkOpt = Annotated[
    int | None,
    typer.Option(
        "--topk",
        help="Predictions per image (0: none) [default: 5; custom models: only when given].",
        show_default=False,
    ),
]
FailOnOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--fail-on",
        metavar="nonfinite|dead|massive|dead-experts",
        help="Exit 1 when NaN/Inf appear anywhere (nonfinite), a ReLU-family output is dead, "
        "a massive activation appears (massive: |x| > 100 and > 1000x its tensor's median; "
        "implies --channels), or a MoE router leaves an expert without tokens.",
    ),
]
DeadFracOpt = Annotated[
    float,
    typer.Option("--dead-frac", help="Zero fraction at which --fail-on dead counts a layer dead."),
]
HistOpt = Annotated[
    bool,
    typer.Option("--hist", help="Add a distribution sparkline of each output (JSON: bin counts)."),
]
ProfileOpt = Annotated[
    bool,
    typer.Option(
        "--profile",
        help="Time each layer call (and its backward), count its FLOPs and size its output, "
        "against an unhooked pass timed in the same process; a folder run adds up its batches.",
    ),
]
OffloadOpt = Annotated[
    bool,
    typer.Option(
        "--offload",
        help="hf: checkpoints larger than memory: read each block's weights from the "
        "safetensors as it runs and free them after; every number equals the in-memory run's "
        "(forward only).",
    ),
]
TpOpt = Annotated[
    bool,
    typer.Option(
        "--tp",
        help="hf: checkpoints larger than one device: under torchrun, load the model with its "
        'tensor-parallel plan over every process (transformers\' tp_plan="auto"); every row is '
        "the unsharded model's unless its note says otherwise; rank 0 writes.",
    ),
]
MemoryOpt = Annotated[
    bool,
    typer.Option(
        "--memory",
        help="Size each layer call: the bytes autograd saves for backward in it (with a "
        "backward), its output's bytes and, on CUDA, the allocator's peak; totals for "
        "parameters (tied once), gradients and activations, and checkpointing candidates.",
    ),
]
LimitOpt = Annotated[
    int | None,
    typer.Option(
        "--limit",
        help="Use the first N image files (one that cannot be used is skipped, not replaced).",
    ),
]
WorkersOpt = Annotated[int, typer.Option("--workers", help="DataLoader processes decoding images.")]
StrictOpt = Annotated[
    bool,
    typer.Option(
        "--strict",
        help="An image in a folder that cannot be used (unreadable, or too extreme a shape "
        "to resize) is an error.",
    ),
]
PerImageOpt = Annotated[
    int,
    typer.Option(
        "--per-image", metavar="K", help="Folder runs: also list each image's top-K predictions."
    ),
]
BatchSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--batch-size",
        help="Images (or texts) per batch of a folder or long --text-file run [default: 32].",
        show_default=False,
    ),
]

# ------------------------------------------------------------------ output

FormatOpt = Annotated[
    Format | None,
    typer.Option(
        "--format",
        "-f",
        help="Output format [default: table, or from the -o suffix].",
        show_default=False,
    ),
]
OutputOpt = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        metavar="FILE",
        help="Write to FILE instead of stdout: replaced atomically (a symlink's target; a "
        "device or FIFO written through); - is stdout.",
    ),
]
PictureOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--picture",
        metavar="KIND[:LAYER]",
        help="HTML reports: embed a picture — maps:LAYER, cam[:LAYER] or attn[:BLOCK], as "
        "hookcli maps/cam/attn draw it. Repeatable.",
        show_default=False,
    ),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force", hidden=True, help="Accepted for older scripts: outputs are always replaced."
    ),
]
SaveOpt = Annotated[
    Path | None,
    typer.Option(
        "--save",
        metavar="FILE.safetensors",
        help="Save the selected calls' inputs, outputs (and gradients) to a safetensors file.",
    ),
]
SaveBaselineOpt = Annotated[
    Path | None,
    typer.Option(
        "--save-baseline",
        metavar="FILE",
        help="Also write this run's JSON report to FILE, for a later `check --baseline FILE`.",
    ),
]

# ------------------------------------------------------------------ project config

ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        metavar="FILE",
        help="Config file to use instead of the nearest hookcli.toml / [tool.hookcli].",
    ),
]
NoConfigOpt = Annotated[bool, typer.Option("--no-config", help="Ignore project config files.")]

_CONFIG_FILE = "hookcli.config_file"  # ctx.meta: the config file used, as a string
_CONFIG_ERROR = "hookcli.config_error"  # ctx.meta: its error, raised inside the command
_NOT_KEYS = ("config", "no_config", "inputs")  # `input` covers images and tensor specs


class ConfigCommand(TyperCommand):
    """A command whose options not given on the command line come from the project config:
    the file (hookcli.toml, [tool.hookcli], or --config FILE) is read before the arguments are
    parsed and becomes Click's default_map, so Click itself applies it, converts it and records
    it as the value's source. A bad file is reported by the command (one line, exit 2)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            found = _project_config(self, args)
        except HookcliError as exc:
            ctx.meta[_CONFIG_ERROR] = exc
            found = None
        if found is not None:
            path, values = found
            ctx.meta[_CONFIG_FILE] = str(path)
            ctx.default_map = {**(ctx.default_map or {}), **values}
        rest = super().parse_args(ctx, args)
        if found is not None:
            _inputs_as_one_set(ctx)
        return rest


def _options_part(args: Sequence[str]) -> Sequence[str]:
    """The words before `--` (after it, everything is an argument)."""
    return args[: args.index("--")] if "--" in args else args


def _flags_given(command: Any, args: Sequence[str]) -> set[str]:
    """The options the command line sets, seen before Click parses it (`--tol 1e-2`,
    `--tol=1e-2`, `-f json`): their config values are not even checked."""
    flags = {w.partition("=")[0] for w in _options_part(args) if w.startswith("-")}
    return {
        p.name
        for p in command.params
        if p.name is not None and any(o in flags for o in p.opts if o.startswith("-"))
    }


def _config_args(args: Sequence[str]) -> tuple[str | None, bool]:
    """--config FILE and --no-config, read before Click parses the rest."""
    path, off = None, False
    words = _options_part(args)
    for i, arg in enumerate(words):
        if arg == "--no-config":
            off = True
        elif arg == "--config" and i + 1 < len(words):
            path = words[i + 1]
        elif arg.startswith("--config="):
            path = arg.partition("=")[2]
    return path, off


def _project_config(command: Any, args: Sequence[str]) -> tuple[Path, dict[str, Any]] | None:
    if any(a in ("--help", "-h") for a in _options_part(args)):
        return None  # help is shown whatever the config says
    named, off = _config_args(args)
    if off:
        return None
    from hookcli.io import config as project

    if named is not None:
        path = Path(named)
        if not path.exists():  # a pipe, <(…), is read like a file
            raise UsageError(f"config file {path} not found.", "check the --config path.")
        if path.is_dir():
            raise UsageError(f"config {path} is a folder.", "give the hookcli.toml file in it.")
    else:
        found = project.find(Path.cwd())
        if found is None:
            return None
        path = found
    assert command.name is not None
    return path, project.load(
        path, command.name, config_keys(command.name), _flags_given(command, args)
    ).values


_READS_CONFIG: dict[str, Callable[..., None]] = {}  # the commands that read the config


_REGISTERED: dict[str, tuple[Callable[..., None], bool]] = {}  # name: (function, config)


def register(command: Callable[..., None], *, config: bool) -> None:
    """A command of the app (app.Commands builds it when it is used); with `config`, its
    options not given come from the config."""
    if config:
        _READS_CONFIG[command.__name__] = command
    _REGISTERED[command.__name__.lower().replace("_", "-")] = (command, config)


def registered() -> dict[str, tuple[Callable[..., None], bool]]:
    """The registered commands, in the order `hookcli --help` lists them."""
    return dict(_REGISTERED)


def build(command: Callable[..., None], config: bool) -> Any:
    """One command's Click object, built by Typer from the function's signature (its options,
    their types and help): a Typer app of that one command, as typer.main.get_command builds
    it. A few milliseconds a command, so only the command that runs is built."""
    one = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)
    one.command(cls=ConfigCommand if config else None)(command)
    return typer.main.get_command(one)


def config_keys(current: str) -> dict[str, Key]:
    """Every config key: the long option names of every command that reads the config (a key
    at the top level of the file may be meant for another command), read from the commands'
    own declarations; the current command's own (its --format choices) first."""
    from hookcli.io.config import Key

    keys: dict[str, Key] = {"model": Key("model", "str")}
    order = sorted(_READS_CONFIG.values(), key=lambda c: c.__name__ != current)
    for command in order:
        for name, hint in typing.get_type_hints(command, include_extras=True).items():
            if name in _NOT_KEYS or typing.get_origin(hint) is not Annotated:
                continue
            kind, *meta = typing.get_args(hint)
            longs = [d for info in meta for d in _decls(info) if d.startswith("--")]
            if longs:
                keys.setdefault(longs[0][2:], _key(name, kind))
    return keys


def _decls(info: Any) -> list[str]:
    """An option's names: in `Annotated[T, typer.Option("--layer", "-l")]` the first one is
    held as the OptionInfo's `default`."""
    if not isinstance(info, OptionInfo):
        return []
    first = [info.default] if isinstance(info.default, str) else []
    return [*first, *(info.param_decls or ())]


def _key(name: str, hint: Any) -> Key:
    """A parameter's config kind, from its Python type (`int | None` → int, `list[str]` → a
    list, an Enum → its values as choices)."""
    from hookcli.io.config import Key

    types = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    kind = types[0]
    if typing.get_origin(kind) is list:
        return Key(name, "list")
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return Key(name, "str", tuple(str(m.value) for m in kind))
    names = {bool: "bool", int: "int", float: "float", Path: "path"}
    return Key(name, names.get(kind, "str"))


def _inputs_as_one_set(ctx: typer.Context) -> None:
    """Images and tensor specs are one set: given either on the command line, the config's
    other one is dropped."""
    names = ("inputs", "input_spec")
    if not any(given(ctx, n) for n in names if n in ctx.params):
        return
    for name in names:
        source = ctx.get_parameter_source(name)
        if source is not None and source.name == "DEFAULT_MAP":
            ctx.params[name] = None


def given(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT", "PROMPT")


def given_flags(ctx: typer.Context, keep: Callable[[str], bool]) -> list[str]:
    """The long flags of the command's parameters whose name `keep` accepts that the user
    gave (`given`: not a default, nor the project config's)."""
    return [
        next((o for o in p.opts if o.startswith("--")), p.name)
        for p in ctx.command.params
        if p.name and keep(p.name) and given(ctx, p.name)
    ]


def configured(ctx: typer.Context) -> tuple[dict[str, Any], str | None]:
    """The command's parameters after the project config, and the config file used (which
    the run states on stderr); a bad config file raises here, inside the command."""
    error = ctx.meta.get(_CONFIG_ERROR)
    if error is not None:
        raise error
    params = {
        k: (list(v) or None) if isinstance(v, tuple) else v
        for k, v in ctx.params.items()
        if k not in ("config", "no_config")
    }
    used = ctx.meta.get(_CONFIG_FILE)
    from_file = {}
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name) if p.name else None
        if used and source is not None and source.name == "DEFAULT_MAP":
            flag = next((o for o in p.opts if o.startswith("--")), p.name or "")
            from_file[flag] = ctx.params.get(p.name or "")
    from hookcli.cli.console import config_values

    config_values(used, from_file)
    return params, used


# ------------------------------------------------------------------ parameters → options


def need_model(params: Mapping[str, Any], command: str) -> str:
    model = params.get("model")
    if not model:
        raise UsageError(
            "no model given.",
            f"name one (hookcli {command} resnet18) or set `model` in hookcli.toml.",
        )
    return str(model)


def model_options(params: Mapping[str, Any], command: str) -> ModelOptions:
    from hookcli.sources import parse_model_args

    name = need_model(params, command)
    check_model_arg_text(params.get("model_arg") or [])
    return pick(
        ModelOptions, params, model=name, model_args=parse_model_args(params.get("model_arg") or [])
    )


def input_options(params: Mapping[str, Any]) -> InputOptions:
    return pick(
        InputOptions,
        params,
        items=tuple(params.get("inputs") or ()),
        specs=tuple(params.get("input_spec") or ()),
    )


def selection(params: Mapping[str, Any]) -> Selection:
    return Selection(
        tuple(params.get("layer") or ()), tuple(params.get("type_") or ()), params.get("depth")
    )


def single_layer(params: Mapping[str, Any]) -> str | None:
    """Pictures are of one layer: -l once, or not at all."""
    value = params.get("layer")
    if isinstance(value, list):
        if len(value) > 1:
            raise UsageError(
                "pictures are of one layer; several -l were given.", "give one -l LAYER."
            )
        return value[0] if value else None
    return value


def reads(params: Mapping[str, Any], used: str | None) -> list[str]:
    """Every file this run will read, known before any work (hookcli.io.output's registry, which
    every reader also adds to): an output may not be one of them. Names that are not files
    (randn:2, DEFAULT, ones) are dropped there."""
    p = params
    files = [*(p.get("inputs") or []), *(p.get("input_spec") or [])]
    model = p.get("model")
    if model:  # diff's first saved report, or the source of path/to/file.py:Name
        files += [model, model.rpartition(":")[0]]
    files += [str(x) for x in (p.get("baseline"), used) if x is not None]
    files.append(p.get("weights") or "")
    tokenizer = p.get("tokenizer")
    if tokenizer and os.path.isdir(os.path.expanduser(str(tokenizer))):
        files.append(f"hf:{tokenizer}")  # a tokenizer folder: every file in it
    if p.get("loss"):  # --loss mse:FILE.pt
        files.append(p["loss"].partition(":")[2])
    for side in (p.get("a"), p.get("b"), p.get("ref")):  # --b weights=FILE, --b gguf:FILE
        for part in (side or "").split(","):
            key, sep, value = part.partition("=")
            if sep and key.strip().lower() == "weights":
                files.append(value.strip())
            elif not sep and key.strip().lower().startswith("gguf:"):
                files.append(key.strip()[5:].strip())
            elif not sep and key.strip().lower().startswith("hf:"):  # every file in the folder
                files.append(f"hf:{key.strip()[3:].strip()}")
    return [os.path.expanduser(f) for f in files if f]
