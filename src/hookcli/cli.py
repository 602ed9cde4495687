"""The command line. The only module that knows Typer and exit codes.

Commands parse options, call the core (imported lazily: `hookcli --help` never imports
torch), and render the Report it returns. Errors from the core become one line on stderr
naming the problem and the next step, with the exit code of CLI.md.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hookcli._version import __version__
from hookcli.errors import HookcliError, UsageError
from hookcli.render import SUFFIX_FORMATS, Format
from hookcli.text import escape

if TYPE_CHECKING:
    from hookcli.commands import Drawing, Running
    from hookcli.output import Destination

app = typer.Typer(
    name="hookcli",
    help="Hook any torchvision or custom PyTorch model and see what every layer does.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


class Task(StrEnum):
    classification = "classification"
    segmentation = "segmentation"
    detection = "detection"
    video = "video"
    optical_flow = "optical_flow"
    quantized = "quantized"


class ListFormat(StrEnum):
    table = "table"
    json = "json"


# ------------------------------------------------------------------ shared options

ModelArg = Annotated[
    str,
    typer.Argument(
        help="torchvision name (resnet34), path/to/file.py:Name or package.module:Name.",
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
        "file.pt, file.npy. Repeat for several forward arguments.",
    ),
]
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
WeightsOpt = Annotated[
    str,
    typer.Option(
        "--weights",
        "-w",
        metavar="none|DEFAULT|ENUM|PATH",
        help="none = random init under --seed; DEFAULT or an enum name = torchvision weights "
        "(hub cache, else download); PATH = a local state dict.",
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
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force", hidden=True, help="Accepted for older scripts: outputs are always replaced."
    ),
]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"hookcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Show the version and exit."
        ),
    ] = False,
) -> None:
    """Hook any torchvision or custom PyTorch model and see what every layer does.

    Example: hookcli inspect resnet34 sample_images/cat.jpeg
    """
    from hookcli import output

    output.begin()  # a new command: no file read, no output claimed yet


# ------------------------------------------------------------------ plumbing


def _err(message: str) -> None:
    """One line on stderr; what users and models control in it (paths, layer names, messages)
    is escaped, so it can neither split the line nor reach the terminal as a control code."""
    sys.stderr.write(escape(message.rstrip("\n")) + "\n")
    sys.stderr.flush()


@contextlib.contextmanager
def _handled() -> Iterator[None]:
    """Typed errors → one line on stderr and their exit code; Ctrl-C → 130."""
    try:
        yield
    except HookcliError as exc:
        _err(f"error: {exc}")
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        _err("interrupted")
        raise typer.Exit(130) from None
    except (typer.Exit, typer.Abort):
        raise
    except Exception as exc:
        if os.environ.get("HOOKCLI_DEBUG"):
            raise
        _err(
            f"error: internal error: {type(exc).__name__}: {exc} "
            "Hint: this is a hookcli bug; rerun with HOOKCLI_DEBUG=1 for the traceback "
            "and report it."
        )
        raise typer.Exit(3) from None


@contextlib.contextmanager
def _model_output_to_stderr() -> Iterator[None]:
    """While user code runs (model files, constructors, forward): its print() goes to stderr,
    so stdout carries only hookcli's data (a JSON report stays parseable)."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


@contextlib.contextmanager
def _status(message: str) -> Iterator[None]:
    """While the model loads and runs: a spinner on stderr for a person at a terminal, and
    the model's own print() sent to stderr."""
    if not sys.stderr.isatty() or os.environ.get("NO_COLOR") or os.environ.get("CI"):
        with _model_output_to_stderr():
            yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message), _model_output_to_stderr():
        yield


def _color() -> bool:
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def _width() -> int | None:
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    env = os.environ.get("COLUMNS", "")
    return int(env) if env.isdigit() else 200


def _claim(
    path: Path | None,
    option: str = "--output",
    *,
    suffix: str | None = None,
    stdout_ok: bool = True,
    reads: list[str] | None = None,
) -> Destination | None:
    """An output checked before any work is done (hookcli.output has the one policy)."""
    from hookcli.output import claim

    return claim(path, option, suffix=suffix, stdout_ok=stdout_ok, reads=reads or [])


def _to_file(dest: Destination | None) -> bool:
    """Output to a file (not stdout, not `-o -`)."""
    return dest is not None and dest.path is not None


def _emit(text: str, dest: Destination | None) -> None:
    """stdout, or the claimed destination (atomically replaced, or written through)."""
    from hookcli.output import write_text

    if dest is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    write_text(dest, text)
    if dest.path is not None and dest.fd is None:  # not `-o /dev/stdout`: that is the data
        _err(f"wrote {dest.label}")


def _emit_listing(data: object, fmt: ListFormat, output: Destination | None, table: str) -> None:
    """`models` and `layers`: JSON of the records, or the named table renderer."""
    if fmt == ListFormat.json:
        from hookcli.render.json import data_json

        text = data_json(data)
    else:
        from hookcli.render import table as tables

        text = getattr(tables, table)(data, color=_color() and not _to_file(output), width=_width())
    _emit(text, output)


def _format(fmt: Format | None, output: Destination | None) -> Format:
    if fmt is not None:
        return fmt
    if output is not None and output.path is not None:
        return SUFFIX_FORMATS.get(output.path.suffix.lower(), Format.table)
    return Format.table


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
OptionalModelArg = Annotated[
    str | None,
    typer.Argument(
        help="torchvision name (resnet34), path/to/file.py:Name or package.module:Name "
        "[default: `model` from hookcli.toml].",
        show_default=False,
    ),
]
TrainOpt = Annotated[
    bool,
    typer.Option(
        "--train",
        help="Run in train mode (BatchNorm batch statistics, dropout); buffers are restored.",
    ),
]


def _given(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT", "PROMPT")


@dataclass(frozen=True, slots=True)
class Given:
    """A command's options after the project config is applied: every option of every
    command, by attribute (a command leaves the ones it does not have at their defaults)."""

    model: str | None = None
    inputs: list[str] | None = None
    layer: list[str] | None = None
    type_: list[str] | None = None
    depth: int | None = None
    input_spec: list[str] | None = None
    weights: str = "none"
    seed: int = 0
    device: str = "auto"
    model_arg: list[str] | None = None
    train: bool = False
    topk: int | None = None
    batch_size: int | None = None
    limit: int | None = None
    workers: int = 0
    strict: bool = False
    per_image: int = 0
    ablate: list[str] | None = None
    fail_on: list[str] | None = None
    dead_frac: float = 1.0
    fmt: Any = None
    output: Path | None = None
    hist: bool = False
    profile: bool = False
    save: Path | None = None
    force: bool = False
    save_baseline: Path | None = None
    target: str | None = None
    loss: str | None = None
    input_grad: bool = False
    max_abs: float | None = None
    grad_norm: str | None = None
    expect_shape: list[str] | None = None
    baseline: Path | None = None
    rtol: float = 1e-3
    atol: float = 1e-6
    backward: bool = False
    quiet: bool = False
    shapes: bool = False
    channels: int = 64
    order: str = "activity"
    call: int = 0
    image: int = 0
    method: str = "gradcam"
    save_raw: Path | None = None
    a: str = "float32"
    b: str | None = None
    ref: str | None = None
    isolate: bool = False
    tol: float = 1e-3

    def model_options(self, name: str) -> Any:
        from hookcli.loading import parse_model_args
        from hookcli.options import ModelOptions, check_model_arg_text

        check_model_arg_text(self.model_arg or [])
        args = parse_model_args(self.model_arg or [])
        return ModelOptions(name, self.weights, self.seed, self.device, args)

    def input_options(self) -> Any:
        from hookcli.options import InputOptions

        return InputOptions(tuple(self.inputs or ()), tuple(self.input_spec or ()), self.strict)


def _configure(
    ctx: typer.Context, command: str, config: Path | None, no_config: bool
) -> tuple[Given, str | None]:
    """The command's options, each one not given on the command line taken from the project
    config; and the config file used, which the run also states on stderr."""
    values: dict[str, Any] = {  # Click keeps an absent repeatable option as (): Typer's None
        k: (list(v) or None) if isinstance(v, tuple) else v
        for k, v in ctx.params.items()
        if k not in ("config", "no_config")
    }
    if no_config:
        return Given(**values), None
    from hookcli import config as project

    if config is not None and not config.exists():  # a pipe, <(…), is read like a file
        raise UsageError(f"config file {config} not found.", "check the --config path.")
    if config is not None and config.is_dir():
        raise UsageError(f"config {config} is a folder.", "give the hookcli.toml file in it.")
    path = config or project.find(Path.cwd())
    if path is None:
        return Given(**values), None
    found = project.load(path, command).values
    if any(_given(ctx, n) for n in ("inputs", "input_spec")):  # inputs come as one set
        found.pop("inputs", None)
        found.pop("input_spec", None)
    for name, value in found.items():
        if name not in values or _given(ctx, name):
            continue  # not an option of this command, or overridden on the command line
        values[name] = _format_choice(value, command, path) if name == "fmt" else value
    return Given(**values), str(path)


def _format_choice(value: str, command: str, path: Path) -> Format | ListFormat:
    choices: type[Format] | type[ListFormat] = (
        Format if command in ("inspect", "grads", "check", "diff") else ListFormat
    )
    try:
        return choices(value)
    except ValueError:
        allowed = ", ".join(c.value for c in choices)
        raise UsageError(
            f"{path}: format {value!r} is not one of {allowed}.", "fix the format key."
        ) from None


def _need_model(model: str | None, command: str) -> str:
    if not model:
        raise UsageError(
            "no model given.",
            f"name one (hookcli {command} resnet18) or set `model` in hookcli.toml.",
        )
    return model


# ------------------------------------------------------------------ commands


@app.command()
def models(
    pattern: Annotated[
        str | None,
        typer.Argument(
            metavar="[GLOB]", help="Glob on model names, e.g. 'resnet*'.", show_default=False
        ),
    ] = None,
    task: Annotated[Task | None, typer.Option("--task", help="Only this task.")] = None,
    fmt: Annotated[
        ListFormat, typer.Option("--format", "-f", help="Output format.")
    ] = ListFormat.table,
    output: OutputOpt = None,
) -> None:
    """List torchvision registry models with their task, size and weight enums.

    Example: hookcli models 'resnet*' --task classification
    """
    with _handled():
        dest = _claim(output)
        from hookcli.listing import list_registry

        entries = list_registry(pattern, task.value if task else None)
        _emit_listing(entries, fmt, dest, "models_table")


@app.command()
def layers(
    ctx: typer.Context,
    model: OptionalModelArg = None,
    inputs: InputsArg = None,
    shapes: Annotated[
        bool, typer.Option("--shapes", help="Run one forward to add output shapes.")
    ] = False,
    depth: DepthOpt = None,
    input_spec: InputSpecOpt = None,
    weights: WeightsOpt = "none",
    seed: SeedOpt = 0,
    device: DeviceOpt = "auto",
    model_arg: ModelArgOpt = None,
    fmt: Annotated[
        ListFormat, typer.Option("--format", "-f", help="Output format.")
    ] = ListFormat.table,
    output: OutputOpt = None,
    config: ConfigOpt = None,
    no_config: NoConfigOpt = False,
) -> None:
    """Show the module tree: dotted names, types, parameter counts and aliases.

    Example: hookcli layers resnet18 --shapes --depth 2
    """
    with _handled():
        p, used = _configure(ctx, "layers", config, no_config)
        if used:
            _err(f"config: {used}")
        dest = _claim(p.output, reads=_reads(p, used))
        from hookcli.listing import layers_report

        name = _need_model(p.model, "layers")
        with _status(f"loading {name}…"):
            report = layers_report(
                p.model_options(name), p.input_options(), shapes=p.shapes, depth=p.depth
            )
        _emit_listing(report, p.fmt, dest, "layers_table")


TopkOpt = Annotated[
    int | None,
    typer.Option(
        "--topk",
        help="Predictions per image (0: none) [default: 5; custom models: only when given].",
        show_default=False,
    ),
]
FormatOpt = Annotated[
    Format | None,
    typer.Option(
        "--format",
        "-f",
        help="Output format [default: table, or from the -o suffix].",
        show_default=False,
    ),
]


FailOnOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--fail-on",
        metavar="nonfinite|dead",
        help="Exit 1 when NaN/Inf appear anywhere (nonfinite) or a ReLU-family output is dead.",
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


@app.command()
def inspect(
    ctx: typer.Context,
    model: OptionalModelArg = None,
    inputs: InputsArg = None,
    layer: LayerOpt = None,
    type_: TypeOpt = None,
    depth: DepthOpt = None,
    input_spec: InputSpecOpt = None,
    weights: WeightsOpt = "none",
    seed: SeedOpt = 0,
    device: DeviceOpt = "auto",
    model_arg: ModelArgOpt = None,
    train: TrainOpt = False,
    topk: TopkOpt = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--batch-size",
            help="Images per batch for a folder run [default: 32].",
            show_default=False,
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Use at most N images.")] = None,
    workers: Annotated[
        int, typer.Option("--workers", help="DataLoader processes decoding images.")
    ] = 0,
    strict: Annotated[
        bool, typer.Option("--strict", help="An unreadable image in a folder is an error.")
    ] = False,
    per_image: Annotated[
        int,
        typer.Option(
            "--per-image",
            metavar="K",
            help="Folder runs: also list each image's top-K predictions.",
        ),
    ] = 0,
    ablate: Annotated[
        list[str] | None,
        typer.Option(
            "--ablate",
            metavar="LAYER=OP",
            help="Change a layer's output for a second run and compare: zero, mean, scale:K, "
            "noise:S, clamp:LO:HI. Repeatable.",
        ),
    ] = None,
    fail_on: FailOnOpt = None,
    dead_frac: DeadFracOpt = 1.0,
    fmt: FormatOpt = None,
    output: OutputOpt = None,
    hist: HistOpt = False,
    profile: Annotated[
        bool,
        typer.Option(
            "--profile",
            help="Time each layer call (and its backward) and size its "
            "output, against an unhooked pass timed in the same process.",
        ),
    ] = False,
    save: SaveOpt = None,
    force: ForceOpt = False,
    save_baseline: SaveBaselineOpt = None,
    config: ConfigOpt = None,
    no_config: NoConfigOpt = False,
) -> None:
    """Forward pass with hooks on the selected layers: statistics of every call's inputs and
    outputs, and the top-k predictions.

    Example: hookcli inspect resnet34 sample_images/cat.jpeg -l 'layer4.*'
    """
    with _handled():
        _run_command(ctx, "inspect", config, no_config)


@app.command()
def grads(
    ctx: typer.Context,
    model: OptionalModelArg = None,
    inputs: InputsArg = None,
    layer: LayerOpt = None,
    type_: TypeOpt = None,
    depth: DepthOpt = None,
    input_spec: InputSpecOpt = None,
    target: TargetOpt = None,
    loss: LossOpt = None,
    input_grad: Annotated[
        bool, typer.Option("--input-grad", help="Also the gradient w.r.t. the model input.")
    ] = False,
    weights: WeightsOpt = "none",
    seed: SeedOpt = 0,
    device: DeviceOpt = "auto",
    model_arg: ModelArgOpt = None,
    train: TrainOpt = False,
    topk: TopkOpt = None,
    fail_on: FailOnOpt = None,
    dead_frac: DeadFracOpt = 1.0,
    fmt: FormatOpt = None,
    output: OutputOpt = None,
    hist: HistOpt = False,
    profile: Annotated[
        bool,
        typer.Option(
            "--profile",
            help="Time each layer call (and its backward) and size its "
            "output, against an unhooked pass timed in the same process.",
        ),
    ] = False,
    save: SaveOpt = None,
    force: ForceOpt = False,
    save_baseline: SaveBaselineOpt = None,
    config: ConfigOpt = None,
    no_config: NoConfigOpt = False,
) -> None:
    """Forward and backward pass: everything inspect shows, plus each call's gradients w.r.t.
    its outputs and inputs and each layer's parameter gradients.

    Example: hookcli grads resnet34 sample_images/cat.jpeg -l 'layer4.*' --target "tabby cat"
    """
    with _handled():
        _run_command(ctx, "grads", config, no_config)


@app.command()
def check(
    ctx: typer.Context,
    model: OptionalModelArg = None,
    inputs: InputsArg = None,
    fail_on: FailOnOpt = None,
    dead_frac: DeadFracOpt = 1.0,
    max_abs: Annotated[
        float | None,
        typer.Option("--max-abs", metavar="X", help="Fail when any activation exceeds |X|."),
    ] = None,
    grad_norm: Annotated[
        str | None,
        typer.Option(
            "--grad-norm",
            metavar="MIN:MAX",
            help="Fail when a gradient norm (outputs, parameters) leaves [MIN, MAX]; "
            "implies --backward. Either bound may be empty.",
        ),
    ] = None,
    expect_shape: Annotated[
        list[str] | None,
        typer.Option(
            "--expect-shape",
            metavar="LAYER=SHAPE",
            help="Fail unless LAYER's first output has this shape, e.g. conv1=1x64x112x112.",
        ),
    ] = None,
    baseline: Annotated[
        Path | None,
        typer.Option(
            "--baseline",
            metavar="FILE",
            help="Compare every statistic with a recorded JSON report (inspect -f json -o FILE).",
        ),
    ] = None,
    rtol: Annotated[
        float, typer.Option("--rtol", help="Relative tolerance for --baseline.")
    ] = 1e-3,
    atol: Annotated[
        float, typer.Option("--atol", help="Absolute tolerance for --baseline.")
    ] = 1e-6,
    backward: Annotated[
        bool, typer.Option("--backward", help="Also run backward (gradients are checked too).")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only failures.")] = False,
    layer: LayerOpt = None,
    type_: TypeOpt = None,
    depth: DepthOpt = None,
    input_spec: InputSpecOpt = None,
    target: TargetOpt = None,
    loss: LossOpt = None,
    weights: WeightsOpt = "none",
    seed: SeedOpt = 0,
    device: DeviceOpt = "auto",
    model_arg: ModelArgOpt = None,
    train: TrainOpt = False,
    fmt: FormatOpt = None,
    output: OutputOpt = None,
    save_baseline: SaveBaselineOpt = None,
    config: ConfigOpt = None,
    no_config: NoConfigOpt = False,
) -> None:
    """Run the model (and backward with --backward or a gradient rule) and check rules: exit 0
    when all pass, 1 when any fails. Without rules: --fail-on nonfinite. Deterministic.

    Example: hookcli check resnet50 --fail-on nonfinite --fail-on dead --baseline base.json
    """
    with _handled():
        _run_command(ctx, "check", config, no_config)


def _run_command(ctx: typer.Context, command: str, config: Path | None, no_config: bool) -> None:
    """inspect, grads and check: options → hookcli.commands.run_command → rendering."""
    p, used = _configure(ctx, command, config, no_config)
    reads = _reads(p, used)
    output = _claim(p.output, reads=reads)
    baseline_out = _claim(p.save_baseline, "--save-baseline", stdout_ok=False, reads=reads)
    save = _claim(p.save, "--save", suffix=".safetensors", stdout_ok=False, reads=reads)
    from hookcli.checks import exit_code, failures, parse_rules

    rules = parse_rules(
        fail_on=p.fail_on,
        dead_frac=p.dead_frac,
        max_abs=p.max_abs,
        grad_norm=p.grad_norm,
        expect_shape=p.expect_shape,
        baseline=p.baseline,
        rtol=p.rtol,
        atol=p.atol,
        backward=p.backward,
    )
    name = _need_model(p.model, command)
    from hookcli.commands import run_command
    from hookcli.options import (
        BackwardOptions,
        Batching,
        Invocation,
        RunOptions,
        Selection,
        hist_bins,
    )

    inv = Invocation(
        model=p.model_options(name),
        selection=Selection(tuple(p.layer or ()), tuple(p.type_ or ()), p.depth),
        inputs=p.input_options(),
        run=RunOptions(
            train=p.train,
            topk=p.topk,
            hist=hist_bins(p.hist),
            profile=p.profile,
            save=save,
            ablate=tuple(p.ablate or ()),
            config=used,
        ),
        backward=None if command == "inspect" else BackwardOptions(p.target, p.loss, p.input_grad),
    )
    batching = Batching(p.batch_size, p.limit, p.workers, p.per_image)
    report = run_command(command, inv, rules, batching=batching, running=_running(name))
    fmt = _format(p.fmt, output)
    if used and (fmt != Format.table or _to_file(output)):
        _err(f"config: {used}")  # a table on stdout says so in its header
    if baseline_out is not None:
        from hookcli.render.json import report_json

        _emit(report_json(report), baseline_out)
    quiet = bool(p.quiet)
    _emit(_render(report, fmt, output, checks_only=command == "check", quiet=quiet), output)
    failed = failures(report)
    if failed and command != "check" and (fmt != Format.table or _to_file(output)):
        for c in failed:  # the table shows them; other formats get them on stderr
            _err(f"check failed: {c.rule}: {c.message}")
    if report.interrupted:
        _err("interrupted: partial results above")
    code = exit_code(report)
    if code:
        raise typer.Exit(code)


def _running(name: str) -> Running:
    """What the run shows while the model runs: a spinner, or for a folder run a progress bar
    (at a terminal); the model's own print() goes to stderr either way."""

    @contextlib.contextmanager
    def running(folder: bool) -> Iterator[Any]:
        if not folder:
            with _status(f"running {name}…"):
                yield None
            return
        if not sys.stderr.isatty() or os.environ.get("CI"):
            with _model_output_to_stderr():
                yield None
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, transient=True) as bar, _model_output_to_stderr():
            task = bar.add_task(f"inspect {name}", total=None, rate="")

            def advance(done: int, total: int) -> None:
                elapsed = bar.tasks[0].elapsed or 1e-9
                bar.update(task, completed=done, total=total, rate=f"{done / elapsed:.1f} img/s")

            yield advance

    return running


@app.command()
def diff(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Argument(
            help="The model (as for inspect), or a first JSON report to compare with a second.",
            show_default=False,
        ),
    ] = None,
    inputs: InputsArg = None,
    a: Annotated[
        str,
        typer.Option("--a", metavar="SIDE", help="Side A, the reference unless --ref is given."),
    ] = "float32",
    b: Annotated[
        str | None,
        typer.Option(
            "--b",
            metavar="SIDE",
            help="Side B: float32|float64|float16|bfloat16, autocast[:DTYPE], channels_last, "
            "quantized (the int8 twin), compile (torch.compile), onnx (ONNX Runtime), "
            "weights=W, seed=N, device=D; joined with commas (float16,channels_last).",
            show_default=False,
        ),
    ] = None,
    ref: Annotated[
        str | None,
        typer.Option(
            "--ref",
            metavar="SIDE",
            help="Measure both sides against this one (e.g. float64): which side is wrong.",
        ),
    ] = None,
    isolate: Annotated[
        bool,
        typer.Option(
            "--isolate",
            help="Feed each selected layer the reference side's input: its own error only.",
        ),
    ] = False,
    tol: Annotated[
        float,
        typer.Option("--tol", help="Relative L2 error past which a call fails (exit 1)."),
    ] = 1e-3,
    layer: LayerOpt = None,
    type_: TypeOpt = None,
    depth: DepthOpt = None,
    input_spec: InputSpecOpt = None,
    weights: WeightsOpt = "none",
    seed: SeedOpt = 0,
    device: DeviceOpt = "auto",
    model_arg: ModelArgOpt = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--batch-size", help="Images per batch for a folder [default: 32].", show_default=False
        ),
    ] = None,
    fmt: FormatOpt = None,
    output: OutputOpt = None,
    config: ConfigOpt = None,
    no_config: NoConfigOpt = False,
) -> None:
    """Run two variants of one model on the same input and compare every layer call's output:
    max|Δ|, relative L2, cosine, SQNR; exit 1 when one is past --tol, naming the first.

    Example: hookcli diff resnet18 sample_images/cat.jpeg --b bfloat16 --isolate
    """
    with _handled():
        p, used = _configure(ctx, "diff", config, no_config)
        dest = _claim(p.output, reads=_reads(p, used))
        from hookcli.compare import diff_report, diff_saved, parse_side

        name = _need_model(p.model, "diff")
        saved = [x for x in [name, *(p.inputs or [])] if x.lower().endswith(".json")]
        if saved:
            if len(saved) != 2 or p.inputs is None or len(p.inputs) != 1:
                raise UsageError(
                    "diff of saved reports takes exactly two JSON files.",
                    "hookcli diff a.json b.json (or a model and --b SIDE).",
                )
            report = diff_saved(saved[0], saved[1], p.tol)
        else:
            if p.b is None:
                raise UsageError(
                    "diff needs side B: --b SIDE.", "e.g. --b bfloat16, or --b weights=new.pt"
                )
            from hookcli.options import Selection

            with _status(f"running {name} twice…"):
                report = diff_report(
                    p.model_options(name),
                    Selection(tuple(p.layer or ()), tuple(p.type_ or ()), p.depth),
                    p.input_options(),
                    parse_side(p.a, "--a"),
                    parse_side(p.b, "--b"),
                    ref=parse_side(p.ref, "--ref") if p.ref is not None else None,
                    isolate=p.isolate,
                    tol=p.tol,
                    batch_size=p.batch_size,
                )
        fmt_ = _format(p.fmt, dest)
        _emit(_render_diff(report, fmt_, dest), dest)
        if report.failed:
            if fmt_ != Format.table or _to_file(dest):
                _err(f"first past tolerance: {report.first_over}")
            raise typer.Exit(1)


def _render_diff(report: Any, fmt: Format, dest: Destination | None) -> str:
    if fmt == Format.json:
        import json

        return json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n"
    if fmt == Format.csv:
        from hookcli.render.csv import diff_csv

        return diff_csv(report)
    from hookcli.render.table import diff_markdown, diff_table

    if fmt == Format.markdown:
        return diff_markdown(report)
    return diff_table(report, color=_color() and not _to_file(dest), width=_width())


@app.command()
def show(
    file: Annotated[Path, typer.Argument(help="A .safetensors file written by --save.")],
    fmt: Annotated[
        ListFormat, typer.Option("--format", "-f", help="Output format.")
    ] = ListFormat.table,
    output: OutputOpt = None,
) -> None:
    """List what a saved .safetensors file holds: keys, shapes, dtypes and statistics.

    Example: hookcli show run.safetensors
    """
    with _handled():
        dest = _claim(output, reads=[str(file)])
        from hookcli.listing import show_file

        _emit_listing(show_file(file), fmt, dest, "saved_table")


# ------------------------------------------------------------------ pictures

PngOpt = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        metavar="FILE.png",
        help="The PNG to write (required).",
        show_default=False,
    ),
]
CallOpt = Annotated[int, typer.Option("--call", help="Which call of a reused module.")]
ImageOpt = Annotated[int, typer.Option("--image", help="Which image of the batch.")]


def _save_png(dest: Destination | None, drawing: Drawing) -> None:
    assert dest is not None
    drawing.write(dest)
    if dest.path is not None:
        _err(f"wrote {dest.label} ({drawing.image.width}x{drawing.image.height})")


def _png_output(p: Given, reads: list[str]) -> Destination | None:
    if p.output is None:
        raise UsageError("-o FILE.png is required.", "e.g. -o out.png (or -o - for stdout)")
    return _claim(p.output, "-o", suffix=".png", reads=reads)


def _reads(p: Given, used: str | None) -> list[str]:
    """Every file this run will read, known before any work (hookcli.output's registry, which
    every reader also adds to): an output may not be one of them. Names that are not files
    (randn:2, DEFAULT, ones) are dropped there."""
    files = [*(p.inputs or []), *(p.input_spec or [])]
    if p.model:  # diff's first saved report, or the source of path/to/file.py:Name
        files += [p.model, p.model.rpartition(":")[0]]
    files += [str(x) for x in (p.baseline, used) if x is not None]
    files.append(p.weights)
    if p.loss:  # --loss mse:FILE.pt
        files.append(p.loss.partition(":")[2])
    for side in (p.a, p.b, p.ref):  # diff's --b weights=FILE (hookcli.compare.parse_side)
        for part in (side or "").split(","):
            key, sep, value = part.partition("=")
            if sep and key.strip().lower() == "weights":
                files.append(value.strip())
    return [os.path.expanduser(f) for f in files if f]


def _single_layer(value: Any) -> str | None:
    if isinstance(value, list):
        if len(value) > 1:
            raise UsageError(
                "pictures are of one layer; several -l were given.", "give one -l LAYER."
            )
        return value[0] if value else None
    return value  # type: ignore[no-any-return]


@app.command()
def maps(
    ctx: typer.Context,
    model: OptionalModelArg = None,
    inputs: InputsArg = None,
    layer: Annotated[
        list[str] | None,
        typer.Option("--layer", "-l", metavar="LAYER", help="The layer to draw (one)."),
    ] = None,
    output: PngOpt = None,
    channels: Annotated[int, typer.Option("--channels", help="How many channels to draw.")] = 64,
    order: Annotated[
        str,
        typer.Option("--order", metavar="activity|index", help="Most active first, or by index."),
    ] = "activity",
    call: CallOpt = 0,
    image: ImageOpt = 0,
    input_spec: InputSpecOpt = None,
    weights: WeightsOpt = "none",
    seed: SeedOpt = 0,
    device: DeviceOpt = "auto",
    model_arg: ModelArgOpt = None,
    force: ForceOpt = False,
    config: ConfigOpt = None,
    no_config: NoConfigOpt = False,
) -> None:
    """Draw one layer call's output channels as a labelled grid beside the input image (PNG).

    Example: hookcli maps resnet18 sample_images/cat.jpeg -l conv1 -o maps.png
    """
    with _handled():
        p, used = _configure(ctx, "maps", config, no_config)
        if used:
            _err(f"config: {used}")
        out = _png_output(p, _reads(p, used))
        from hookcli.options import need_layer

        chosen = need_layer(_single_layer(p.layer))
        from hookcli import commands

        name = _need_model(p.model, "maps")
        with _status(f"running {name}…"):
            drawing = commands.maps(
                p.model_options(name),
                p.input_options(),
                layer=chosen,
                call=p.call,
                channels=p.channels,
                order=p.order,
                image_index=p.image,
            )
        _save_png(out, drawing)
        for note in drawing.notes:
            _err(f"note: {note}")


@app.command()
def cam(
    ctx: typer.Context,
    model: OptionalModelArg = None,
    inputs: InputsArg = None,
    layer: Annotated[
        list[str] | None,
        typer.Option(
            "--layer",
            "-l",
            metavar="LAYER",
            help="The layer [default: the last convolutional block, stated].",
        ),
    ] = None,
    output: PngOpt = None,
    target: TargetOpt = None,
    loss: LossOpt = None,
    method: Annotated[
        str, typer.Option("--method", metavar="gradcam|gradcam++", help="CAM weighting.")
    ] = "gradcam",
    save_raw: Annotated[
        Path | None,
        typer.Option(
            "--save-raw",
            metavar="FILE.npy",
            help="Also save the raw heat map (float32, input resolution).",
        ),
    ] = None,
    call: CallOpt = 0,
    image: ImageOpt = 0,
    input_spec: InputSpecOpt = None,
    weights: WeightsOpt = "none",
    seed: SeedOpt = 0,
    device: DeviceOpt = "auto",
    model_arg: ModelArgOpt = None,
    force: ForceOpt = False,
    config: ConfigOpt = None,
    no_config: NoConfigOpt = False,
) -> None:
    """Grad-CAM heat map of one layer for a target, overlaid on the image (PNG).

    Example: hookcli cam resnet50 sample_images/cat.jpeg --weights DEFAULT -o cam.png
    """
    with _handled():
        p, used = _configure(ctx, "cam", config, no_config)
        if used:
            _err(f"config: {used}")
        reads = _reads(p, used)
        out = _png_output(p, reads)
        raw_out = _claim(p.save_raw, "--save-raw", suffix=".npy", stdout_ok=False, reads=reads)
        from hookcli import commands
        from hookcli.options import BackwardOptions

        name = _need_model(p.model, "cam")
        with _status(f"running {name}…"):
            drawing = commands.cam(
                p.model_options(name),
                p.input_options(),
                BackwardOptions(p.target, p.loss),
                layer=_single_layer(p.layer),
                call=p.call,
                method=p.method,
                image_index=p.image,
            )
        _save_png(out, drawing)
        if raw_out is not None:
            import numpy as np

            from hookcli.output import write_with

            raw = drawing.raw
            assert raw is not None

            def save_npy(tmp: str) -> None:
                with open(tmp, "wb") as f:  # a handle: np.save(path) would append ".npy"
                    np.save(f, raw)

            write_with(raw_out, save_npy)
            _err(f"wrote {raw_out.label}")
        for note in drawing.notes:
            _err(f"note: {note}")


def _render(
    report: object,
    fmt: Format,
    output: Destination | None,
    *,
    checks_only: bool = False,
    quiet: bool = False,
) -> str:
    from hookcli.records import Report

    assert isinstance(report, Report)
    if fmt == Format.json:
        from hookcli.render.json import report_json

        return report_json(report)
    if fmt == Format.csv:
        from hookcli.render.csv import report_csv

        return report_csv(report)
    from hookcli.render.table import report_markdown, report_table

    if fmt == Format.markdown:
        return report_markdown(report)
    color = _color() and not _to_file(output)
    if checks_only:
        from hookcli.render.table import checks_table

        return checks_table(report, color=color, width=_width(), quiet=quiet)
    return report_table(report, color=color, width=_width())


def main() -> None:
    """The console script: safe standard streams, then the command in a supervised worker
    (hookcli.supervise: a native crash becomes exit 3 naming the layer)."""
    from hookcli import beacon, stdio
    from hookcli.supervise import supervise

    stdio.guard()
    if "" not in sys.path and os.getcwd() not in sys.path:
        # CLI.md: the current directory is importable (pkg.mod:Name), as with `python -m`;
        # last, so a local torch.py cannot shadow the installed one
        sys.path.append(os.getcwd())
    code = supervise(sys.argv[1:])
    if code is None:  # the worker, or a light command run in-process
        try:
            app()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except HookcliError as exc:  # stdout failing outside a command (help to a closed stdout)
            _err(f"error: {exc}")
            code = exc.exit_code
        code = stdio.finish(code)
        beacon.finish(code)  # a library dying at interpreter exit now cannot fail the run
    sys.exit(code)
