"""hookcli: hook any torchvision or custom PyTorch model and see what every layer does.

The public Python API mirrors the command line and returns the same `Report` the CLI renders
(or, for pictures, the same PNG): each function takes the path the CLI command takes.

    >>> import hookcli
    >>> report = hookcli.inspect("resnet18", ["sample_images/cat.jpeg"], layers=["layer4.*"])
    >>> report.layers[0].outputs[0].mean
    >>> report = hookcli.check("resnet18", fail_on=["nonfinite", "dead"], baseline="base.json")
    >>> hookcli.passed(report), hookcli.exit_code(report)
    >>> hookcli.cam("resnet18", "sample_images/cat.jpeg").image.save("cam.png")
    >>> hookcli.attn("vit_b_16", "sample_images/cat.jpeg").rollout.shape  # (1, 197, 197)
    >>> open("report.html", "w").write(hookcli.html(report))
    >>> report = hookcli.inspect("hf:./tiny-llama", text="The cat sat on the")  # next tokens
    >>> hookcli.lens("hf:./tiny-llama", text="The cat sat on the").lens[0].top[0].token

Importing this package never imports torch; it is imported on first use. In a Python process
(not the `hookcli` command) it starts loading the statistics' numba kernels in a background
thread (hookcli.runtime.preload), so that the first call measures as fast as later ones;
HOOKCLI_STATS=torch turns that off.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Unpack

from hookcli import _views as _view_hook
from hookcli._version import __version__
from hookcli.engine import kernelwarm
from hookcli.options import DEFAULTS, stats_backend_default
from hookcli.runtime import preload
from hookcli.runtime.rng import kept as _rng_kept

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import ModuleType

    from hookcli.apitypes import CheckKeywords, GradsKeywords, InspectKeywords
    from hookcli.commands import Drawing
    from hookcli.records import DiffReport, LensReport, Report

__all__ = [
    "__version__",
    "attn",
    "cam",
    "check",
    "diff",
    "exit_code",
    "formatted",
    "grads",
    "html",
    "inspect",
    "lens",
    "maps",
    "passed",
    "watch",
]


def _new_run() -> None:
    """Each call is a run of its own: files an earlier call read may be written by this one."""
    from hookcli.io import output

    output.begin()


@_rng_kept
def inspect(model: Any, inputs: Any = (), **options: Unpack[InspectKeywords]) -> Report:
    """One hooked forward pass; its Report, as `hookcli inspect` makes it.

    `model`: a registry name, `file.py:Name`, `pkg.mod:Name` or an nn.Module; `inputs`: image
    paths and folders, or tensors. Options (the CLI's long names in snake_case, see
    `hookcli.commands.inspect.inspect`): layers, types, depth, input_specs, weights, seed, device,
    model_args, train, topk, hist (True: the CLI's 12 bins), profile, save, ablate, strict,
    fail_on, dead_frac. A folder of more than 32 images, or batch_size=, limit=, workers=
    (per_image=K for each image's top-K), runs in batches with statistics merged exactly, as
    the CLI does: memory stays flat however many images pass.
    """
    from hookcli.commands import api_report

    _new_run()
    return api_report("inspect", model, inputs, options)


@_rng_kept
def grads(model: Any, inputs: Any = (), **options: Unpack[GradsKeywords]) -> Report:
    """Forward and backward with gradient hooks; its Report, as `hookcli grads` makes it.
    Options as inspect's (no batching), plus target ("top1", a class index or label, "sum"),
    loss ("ce:IDX", "mse:ones", …) and input_grad."""
    from hookcli.commands import api_report

    _new_run()
    return api_report("grads", model, inputs, options)


@_rng_kept
def check(model: Any, inputs: Any = (), **options: Unpack[CheckKeywords]) -> Report:
    """`hookcli check`: run the model (and backward when asked or a gradient rule needs it) and
    evaluate rules into `report.checks`; `hookcli.passed(report)` and
    `hookcli.exit_code(report)` give the CLI's verdict. Rules: fail_on ("nonfinite", "dead"
    or a list; no rule at all means nonfinite), dead_frac, max_abs, min_std (collapse: an
    output's std below it), grad_norm ("MIN:MAX" or (min, max), None for no bound),
    expect_shape ("LAYER=1x64x112x112", a list, or {layer: shape}), baseline (a JSON
    report's path), rtol, atol, backward. Runs are deterministic and make no predictions.
    Other options as grads' (target and loss apply when backward runs)."""
    from hookcli.commands import api_report

    _new_run()
    return api_report("check", model, inputs, options)


def watch(
    model: Any,
    *,
    optimizer: Any = None,
    every: int = DEFAULTS.watch.every,
    layers: Any = (),
    types: Any = (),
    log: Any = None,
    ring: int = DEFAULTS.watch.ring,
    bundle: Any = None,
    check: bool = DEFAULTS.watch.check,
    scaler: Any = None,
    tensorboard: Any = None,
    memory: bool = False,
) -> Any:
    """A training run's flight recorder: `with hookcli.watch(model, optimizer=opt, every=10,
    log="run.jsonl") as w:` around an ordinary loop. Every `every`-th optimizer step (from step
    0) is watched: each selected layer call's input and output statistics and output
    gradients, each parameter's gradient and update/weight ratio, and the loss given to
    `w.loss(loss)` — one JSONL line per watched step (also in `w.records`, as StepLine
    records). Other steps run with no hook below the model itself. Without an optimizer,
    `w.step()` marks each step's end (after backward, before the weights change).

    Every step, the loss, the model's outputs and the parameter gradients are checked for
    NaN/Inf; the first time one is not finite, the step's repro bundle is written (`bundle=`
    DIR; default next to `log`: run.bundle) with the last `ring` watched records, the step is
    re-run hooked to name the first non-finite layer call and direction, and a "nonfinite"
    line is logged (`w.nonfinite`: a list of those events, NonfiniteLines). `hookcli replay
    DIR` runs it again.
    `scaler=`: the GradScaler, whose skipped steps are steps too; `check=False`: no NaN/Inf
    check; `tensorboard=DIR`: each watched step's scalars (the loss, the layers' and the
    parameters' series of `hookcli report`) into a TensorBoard event file there as it ends;
    `memory=True`: each watched step's bytes autograd saved in each layer call and in the
    model's forwards, and its totals (parameters, gradients, optimizer state, the step's
    predicted peak; on CUDA the allocator's peak), in the line's `memory`."""
    from hookcli.commands.watch.recorder import Watch
    from hookcli.options import WatchOptions

    options = WatchOptions(
        every=every,
        layers=(layers,) if isinstance(layers, str) else tuple(layers),
        types=(types,) if isinstance(types, str) else tuple(types),
        log=log,
        ring=ring,
        bundle=bundle,
        check=check,
        tensorboard=tensorboard,
        memory=memory,
    )
    return Watch(model, options, optimizer=optimizer, scaler=scaler)


def html(report: Report | DiffReport | LensReport, pictures: Sequence[Drawing] = ()) -> str:
    """The report as the one self-contained HTML page `-o report.html` writes (a diff's and a
    lens' too): its JSON embedded, the per-call table static, sorting, filters and the module
    tree in the page's own script; no request to anywhere. `pictures`: what `hookcli.maps`,
    `cam` and `attn` return, embedded in the page as `-f html --picture` embeds them."""
    from hookcli.render.formats import render as _render

    return _render(report, "html", pictures=[d.embedded() for d in pictures])


def formatted(
    report: Report | DiffReport | LensReport,
    fmt: str = "table",
    *,
    width: int | None = None,
    color: bool = False,
    checks_only: bool = False,
    quiet: bool = False,
) -> str:
    """Any report as the CLI writes it: `fmt` one of table, json, csv, markdown, html (the
    one door every command's output goes through). `width` and `color` are the table's;
    `checks_only` shows check's verdicts alone (`quiet`: only those that failed)."""
    from hookcli.render.formats import render as _render

    return _render(report, fmt, width=width, color=color, checks_only=checks_only, quiet=quiet)


def exit_code(report: Report) -> int:
    """The exit code the CLI ends this report's run with: 0 every check passed, 1 a check
    failed, 130 a folder run was interrupted (partial statistics)."""
    from hookcli.commands.checks import exit_code as _exit_code

    return _exit_code(report)


def passed(report: Report) -> bool:
    """Every check in `report.checks` passed and the run was whole (exit code 0)."""
    from hookcli.commands.checks import passed as _passed

    return _passed(report)


@_rng_kept
def maps(
    model: Any,
    image: Any = (),
    *,
    layer: str,
    call: int = DEFAULTS.maps.call,
    channels: int = DEFAULTS.maps.channels,
    order: str = DEFAULTS.maps.order,
    image_index: int = DEFAULTS.maps.image_index,
    **options: Any,
) -> Drawing:
    """`hookcli maps`: one layer call's output channels as a labelled grid beside the input.
    Returns a Drawing: `.image` (the PIL image the CLI saves as PNG), `.picture.tiles` (the
    normalised channels, uint8), `.picture.labels` (their channel indexes), `.layer`,
    `.metadata`, `.notes`; `.save("maps.png")` writes the CLI's PNG. `image_index` is the CLI's
    --image (which image of the batch). Options: weights, seed, device, model_args,
    input_specs, strict."""
    from hookcli import commands
    from hookcli.options import MapOptions

    _new_run()
    model_options, inputs = commands.picture_options(model, image, options, "maps")
    return commands.maps(
        model_options, inputs, MapOptions(layer, call, channels, order, image_index)
    )


@_rng_kept
def cam(
    model: Any,
    image: Any = (),
    *,
    layer: str | None = None,
    target: str | None = None,
    loss: str | None = None,
    method: str = DEFAULTS.cam.method,
    call: int = DEFAULTS.cam.call,
    image_index: int = DEFAULTS.cam.image_index,
    **options: Any,
) -> Drawing:
    """`hookcli cam`: Grad-CAM (method="gradcam++": Grad-CAM++) of one image for a target
    (default top-1; or a loss), over the image. Returns a Drawing: `.image` (the PIL image the
    CLI saves), `.raw` (the heat map before scaling, float32 at input resolution: --save-raw's
    array), `.heat` (scaled to [0, 1]), `.layer` (the layer used; without `layer=`, the last
    convolutional block), `.notes`; `.save("cam.png")` writes the CLI's PNG. Options as maps'."""
    from hookcli import commands
    from hookcli.options import BackwardOptions, CamOptions

    _new_run()
    model_options, inputs = commands.picture_options(model, image, options, "cam")
    return commands.cam(
        model_options,
        inputs,
        BackwardOptions(target, loss),
        CamOptions(layer, call, method, image_index),
    )


@_rng_kept
def attn(
    model: Any,
    image: Any = (),
    *,
    layer: str | None = None,
    image_index: int = DEFAULTS.attn.image_index,
    queries: str | None = None,
    **options: Any,
) -> Drawing:
    """`hookcli attn`: the attention probabilities of one transformer block (default: the
    last, an encoder-decoder's its encoder's last; `layer=` a dotted name or glob, e.g.
    "blocks.3", or a decoder's cross-attention module), per head, and the attention rollout
    over every block, over the image (token x token matrices for text models). Works with torch
    nn.MultiheadAttention (torchvision ViT), timm attention modules and Hugging Face models;
    the model is left as found. Returns a Drawing: `.image` (the PIL image the CLI saves),
    `.raw` (the block's probabilities, float32 batch x heads x tokens x tokens: --save-raw's
    array), `.rollout` (float32 batch x tokens x tokens), `.layer` (the block drawn),
    `.picture.tiles` (each head's map as drawn, uint8), `.notes`; `.save("attn.png")` writes
    the CLI's PNG. Text models: the axes are labelled by their tokens, and `queries="-16:"`
    draws only those query rows. Options as maps' (text=, tokenizer=, head= among them)."""
    from hookcli import commands
    from hookcli.options import AttnOptions

    _new_run()
    model_options, inputs = commands.picture_options(model, image, options, "attn")
    return commands.attn(model_options, inputs, AttnOptions(layer, image_index, queries))


@_rng_kept
def lens(
    model: Any,
    inputs: Any = (),
    *,
    topk: int = DEFAULTS.lens.topk,
    blocks: str | None = None,
    norm: str | None = None,
    unembed: str | None = None,
    **options: Any,
) -> LensReport:
    """`hookcli lens`: the logit lens. Each block's output through the model's own final norm
    and unembedding (`blocks=` a glob, `norm=` a module name or "none", `unembed=` override
    what is found), the top-k tokens of every position of every block: `.lens` is a list of
    LensCell(layer, sequence, position, top=[LensToken(index, token, prob)]), each position the
    token's own in its text. What the model applies around its unembedding (a final soft cap,
    T5's scale of tied embeddings) is applied to every block and named in `.applied`, so the
    last block's lens is the model's own next-token distribution (`.last_vs_logits` is 0.0
    then; a note says why where it is not). Options:
    text, text_file, chat, tokenizer, head, input_specs, weights, seed, device, model_args."""
    from hookcli.commands.lens import lens_report
    from hookcli.options import Invocation, LensOptions

    _new_run()
    inv = Invocation.from_api(model, inputs, options, backward=False)
    return lens_report(inv.model, inv.inputs, LensOptions(topk, blocks, norm, unembed))


@_rng_kept
def diff(
    model: Any,
    inputs: Any = (),
    *,
    b: str,
    a: str = DEFAULTS.diff.a,
    ref: str | None = None,
    isolate: bool = DEFAULTS.diff.isolate,
    tol: float | None = DEFAULTS.diff.tol,
    batch_size: int | None = None,
    sort: str = DEFAULTS.diff.sort,
    own: bool = DEFAULTS.diff.own,
    max_kld: float | None = None,
    min_same_top1: float | None = None,
    **options: Any,
) -> DiffReport:
    """Two sides of one model (e.g. a="float32", b="bfloat16,channels_last") on the same input,
    compared layer call by layer call (see `hookcli.commands.diff.diff_report`). tol None: the
    coarsest side's precision's default; sort: "order", "error" or "own"; own: measure each
    layer's own error (a second pass of B). On a causal LM's text, `.tokens` holds side B's
    next-token distributions against the reference's (KL both ways, Δp, same top-1,
    perplexities); max_kld / min_same_top1 make `.failed` true past them. Options as
    inspect's: layers, types, depth, text, text_file, input_specs, weights, seed, device,
    model_args."""
    from hookcli.commands.diff import diff_run
    from hookcli.options import DiffOptions, Invocation

    _new_run()
    inv = Invocation.from_api(model, inputs, options, backward=False)
    run = DiffOptions(a, b, ref, isolate, tol, batch_size, sort, own, max_kld, min_same_top1)
    return diff_run(inv.model, inv.selection, inv.inputs, run, flags=("a", "b", "ref"))


def _the_command() -> bool:
    """Whether this process is the `hookcli` command, which forks its worker before anything
    heavy (and whose --help loads nothing): it starts no background load (runtime.preload)."""
    name = os.path.basename(sys.argv[0]) if sys.argv else ""
    return name in {"hookcli", "hookcli.exe", "-m"}


def _views() -> ModuleType:
    """What a report shows in a notebook (records imports no renderer: they import it)."""
    from hookcli.render import views

    return views


_view_hook.LOADERS.append(_views)


if stats_backend_default() == "torch":  # HOOKCLI_STATS=torch: read here, at the edge, once
    preload.keep_off()
elif not _the_command():
    preload.start(kernelwarm.load)
