"""Pictures from one layer call: feature-map grids and Grad-CAM heat maps.

The torch side lives here: capture the call's output (and, for CAM, its gradient, from the
same in-place-safe tensor hooks as `grads`), choose and normalise channels, compute the CAM.
It hands plain numpy arrays to render/images.py, which composes the PNG with Pillow.

The output is copied in the hook, as the layer returned it: a later in-place op (resnet's
`bn1` → in-place `relu`, densenet's `features` → `F.relu(inplace=True)`) would otherwise
rewrite what the picture reads (docs/traps.md §12). Its gradient comes from a tensor hook
on that same returned value, which receives the gradient of the value before the op.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hookcli.engine.attention import find_attention
from hookcli.engine.hooks import HookSession, PendingCall, Target
from hookcli.engine.layout import LayoutOf, image_of, reader
from hookcli.engine.passes import hooked_pass
from hookcli.engine.prepare import Prepared, every_target, one_target, prepare
from hookcli.engine.targets import TargetSpec
from hookcli.errors import UsageError
from hookcli.inputs import IMAGENET_MEAN, IMAGENET_STD, ModelInput, skipped_note
from hookcli.options import (
    BackwardOptions,
    CamOptions,
    InputOptions,
    MapOptions,
    ModelOptions,
    need_layer,
)
from hookcli.sources import LoadedModel
from hookcli.tree import iter_tensors

_POOLS = ("AdaptiveAvgPool2d", "AvgPool2d", "MaxPool2d", "AdaptiveMaxPool2d")
_SKIP = (*_POOLS, "Permute", "Flatten", "Identity", "Dropout")  # no default CAM layer of their own


@dataclass(slots=True)
class Picture:
    """What render/images.py draws: arrays and the words to put beside them."""

    title: str
    image: np.ndarray[Any, np.dtype[np.uint8]] | None  # (H, W, 3) the input as the model saw it
    tiles: np.ndarray[Any, np.dtype[np.uint8]] | None = None  # (K, h, w) normalised channels
    labels: list[str] = field(default_factory=list)
    heat: np.ndarray[Any, np.dtype[np.float32]] | None = None  # (H, W) CAM in [0, 1]
    # (H, W) CAM before scaling; attn: the block's probabilities (B, heads, L, L)
    raw: np.ndarray[Any, np.dtype[np.float32]] | None = None
    legend: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    layer: str = ""  # the layer drawn (for CAM without -l: the one chosen)
    call: int = 0
    layout: str = ""  # how the activation was read (engine.layout), stated on the picture
    rollout: np.ndarray[Any, np.dtype[np.float32]] | None = None  # attn: (B, L, L) rollout
    # attn's token x token matrices: the tokens of the rows (queries) and columns (keys)
    row_tokens: list[str] | None = None
    col_tokens: list[str] | None = None


def default_cam_layer(prepared: Prepared, layout_of: LayoutOf) -> tuple[str, str | None]:
    """The last module to finish whose output reads as maps over the image (engine.layout:
    NCHW, NHWC or patch tokens, more than 1x1) and whose gradient for the target is non-zero on
    those cells: the last convolutional block of a CNN (resnet `layer4`, densenet `features`),
    a Swin's final `norm`, a ConvNeXt's `features`, and for a ViT the last block's
    pre-attention norm (`ln_1`): after it only the class token reaches the head, so later
    layers have no gradient on the patches (pytorch-grad-cam's ViT recipe, found rather than
    hard-coded; timm `norm1`, Hugging Face `layernorm_before` alike). Pools, pure layout moves
    (Permute, Flatten), the insides of attention modules (the q/k/v projections, whose patch
    gradient is the attention's) and a Hugging Face backbone's ModelOutput (its final norm holds
    the same hidden states) are skipped. One forward and
    backward with every module hooked. With no gradient anywhere (constant scores), the last
    such layer, and a note saying why."""
    drawable: list[tuple[int, str]] = []
    with_grad: list[tuple[int, str]] = []
    inside = _attention_modules(prepared.loaded.module)

    def watch(pending: PendingCall, out: Any) -> None:
        call = pending.call
        if call.type in _SKIP or call.name == "(model)" or pending.finished is None:
            return
        if _model_output(out) or any(
            call.name == a or call.name.startswith(a + ".") for a in inside
        ):
            return
        first = next((t for _, t in iter_tensors(out, "out")), None)
        if first is None or first.dim() not in (3, 4):
            return
        try:
            layout = layout_of(call.name, tuple(first.shape))
        except UsageError:
            return
        if min(layout.grid) < 2:
            return
        order = pending.finished
        drawable.append((order, call.name))
        if first.requires_grad:

            def seen(grad: torch.Tensor | None) -> None:
                if grad is not None and bool(layout.to_nchw(grad).abs().sum() > 0):
                    with_grad.append((order, call.name))

            session.tensor_handles.append(first.register_hook(seen))  # type: ignore[no-untyped-call]

    session = HookSession(every_target(prepared.entries), None, on_output=watch)
    with hooked_pass(prepared, session, backward=prepared.backward is not None):
        pass
    if with_grad:
        return max(with_grad)[1], None
    if not drawable:
        raise UsageError(
            f"{prepared.loaded.spec} has no layer whose output maps onto the image "
            "((N, C, H, W), (N, H, W, C) or patch tokens) to draw a CAM on.",
            "name a layer with -l.",
        )
    return max(drawable)[1], "no layer receives a gradient for this target"


_ATTENTION_CLASS = re.compile(r"(Attention|Attn|MHSA|GPSA|XCA)$")


def _attention_modules(model: nn.Module) -> tuple[str, ...]:
    """Attention modules inside a block, whose outputs and q/k/v projections the default CAM
    layer passes over: those engine.attention reads (unless the module is the whole block, as
    timm's ParallelScalingBlock and HF's SwinStage are), and any module whose class name ends
    in Attention, Attn, MHSA, GPSA or XCA (ConViT, CrossViT, XCiT), blocks aside (CaiT's
    LayerScaleBlockClassAttn holds the norm the recipe wants)."""
    names = {site.name for site in find_attention(model) if site.name != site.block}
    names.update(
        n
        for n, m in model.named_modules()
        if n and _ATTENTION_CLASS.search(type(m).__name__) and "Block" not in type(m).__name__
    )
    return tuple(sorted(names))


def _model_output(out: Any) -> bool:
    """A Hugging Face ModelOutput: a whole model's output inside the model (a classifier's
    backbone); its last layer or norm, which holds the same states, is the layer to name."""
    return any(
        c.__name__ == "ModelOutput" and c.__module__.startswith("transformers")
        for c in type(out).__mro__
    )


@dataclass(slots=True)
class Captured:
    """One call's output as the layer returned it, its gradient (CAM), the value backward
    started from, the model's output, and notes on how the pass ran."""

    out: torch.Tensor
    grad: torch.Tensor | None
    value: float | None
    output: Any
    notes: list[str]


def _capture(prepared: Prepared, target: Target, call: int, *, backward: bool = False) -> Captured:
    """The output (and its gradient, for CAM) of one call of one layer, copied in the hook
    before any later in-place op can change it."""
    captured: dict[str, torch.Tensor] = {}

    def keep(pending: PendingCall, output: Any) -> None:
        if pending.call.call != call:
            return
        first = next((t for _, t in iter_tensors(output, "out")), None)
        if first is None:
            return
        captured["out"] = first.detach().clone()  # the one copy: the picture's activation
        if backward and first.requires_grad:

            def grab(grad: torch.Tensor | None) -> None:
                if grad is not None:  # None: no gradient reaches this output
                    captured["grad"] = grad.detach().clone()

            session.tensor_handles.append(first.register_hook(grab))  # type: ignore[no-untyped-call]

    session = HookSession([target], None, on_output=keep)
    with hooked_pass(prepared, session, backward=backward) as result:
        value = float(result.scalar.detach()) if result.scalar is not None else None
        output = result.output
        notes = prepared.notes + result.notes
    calls = session.counts[0]
    if calls == 0:
        raise UsageError(
            f"layer {target.name} never ran in this forward pass.",
            "pick a layer that runs (`hookcli layers MODEL --shapes` shows calls).",
        )
    if "out" not in captured:
        raise UsageError(
            f"layer {target.name} call {call} does not exist or returned no tensor "
            f"(it ran {calls} time{'s' if calls != 1 else ''}).",
            f"use --call 0 to {calls - 1}.",
        )
    return Captured(captured["out"], captured.get("grad"), value, output, notes)


def input_image(
    model_input: ModelInput, index: int, loaded: LoadedModel
) -> np.ndarray[Any, Any] | None:
    """The input image as the model saw it (after resize/crop), de-normalised to uint8."""
    x = model_input.args[0] if model_input.args else None
    if isinstance(x, list):
        x = x[index] if index < len(x) else None
    elif isinstance(x, torch.Tensor) and x.dim() == 4:
        x = x[index]
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] not in (1, 3):
        return None
    img = x.detach().float().cpu()
    mean_std = _normalisation(loaded)
    if mean_std is not None:
        mean, std = (torch.tensor(v).view(-1, 1, 1) for v in mean_std)
        img = img * std + mean
    elif img.min() < 0 or img.max() > 1:  # unknown scaling: stretch for display
        img = (img - img.min()) / (img.max() - img.min()).clamp_min(1e-12)
    img = img.clamp(0, 1).expand(3, -1, -1)
    return (img.permute(1, 2, 0).numpy() * 255 + 0.5).astype(np.uint8)


def input_notes(model_input: ModelInput, index: int) -> list[str]:
    """What a picture of image `index` says about its input: the files a folder's listing
    skipped (unreadable), and which file the image is when there are several (the indices
    count the images read, not the files listed)."""
    notes = [skipped_note(model_input.skipped)] if model_input.skipped else []
    if len(model_input.sources) > 1 and 0 <= index < len(model_input.sources):
        notes.append(f"image {index} is {model_input.sources[index]}")
    return notes


def check_image_index(index: int, out: torch.Tensor) -> None:
    """--image I must be one of the batch's images (out: the batch first)."""
    if not 0 <= index < out.shape[0]:
        raise UsageError(
            f"--image {index} is out of range: the batch has {out.shape[0]}.",
            f"use --image 0 to {out.shape[0] - 1}.",
        )


def _normalisation(loaded: LoadedModel) -> tuple[Sequence[float], Sequence[float]] | None:
    t = loaded.preprocess
    if t is None:
        return (IMAGENET_MEAN, IMAGENET_STD) if loaded.kind.denormalise_imagenet else None
    # torchvision's weights' transforms carry mean/std; a Compose (timm's) holds a Normalize step
    for step in (t, *reversed(list(getattr(t, "transforms", None) or ()))):
        mean, std = getattr(step, "mean", None), getattr(step, "std", None)
        if mean is not None and std is not None:
            return [float(m) for m in mean], [float(s) for s in std]
    return None  # detection transforms only scale to [0, 1]


def _reader(prepared: Prepared) -> LayoutOf:
    """How to read this run's layer outputs as (N, C, h, w) maps (engine.layout; refused with
    the shape when it cannot be told)."""
    assert prepared.model_input is not None
    return reader(prepared.loaded.module, *image_of(prepared.model_input.forward_values()))


def _shape(t: torch.Tensor) -> str:
    return "x".join(map(str, t.shape))


def feature_maps(model: ModelOptions, inputs: InputOptions, options: MapOptions) -> Picture:
    """One call's output channels as normalised tiles, most active first or in index order."""
    layer, call, channels = need_layer(options.layer), options.call, options.channels
    order, image_index = options.order, options.image_index
    if channels < 1:
        raise UsageError(f"--channels must be 1 or more, got {channels}.", "e.g. --channels 64")
    if order not in ("activity", "index"):
        raise UsageError(f"--order must be activity or index, got {order!r}.", "use --order index.")
    prepared = prepare(model, inputs=inputs)
    loaded, model_input = prepared.loaded, prepared.model_input
    assert model_input is not None
    target = one_target(prepared, layer)
    got = _capture(prepared, target, call)
    layout = _reader(prepared)(target.name, tuple(got.out.shape))
    out = layout.to_nchw(got.out)
    check_image_index(image_index, out)
    maps = out[image_index].float()
    activity = maps.abs().mean(dim=(1, 2))
    picked = (
        torch.argsort(activity, descending=True)
        if order == "activity"
        else torch.arange(maps.shape[0])
    )[:channels]
    tiles = tiles_uint8(maps[picked])
    shown = len(picked)
    notes = list(got.notes) + input_notes(model_input, image_index)
    if shown < channels and channels != 64:
        notes.append(f"the layer has only {maps.shape[0]} channels")
    how = "most active first (mean |activation|)" if order == "activity" else "in channel order"
    title = (
        f"{loaded.spec} · {target.name} call {call} · image {image_index} · "
        f"{shown} of {maps.shape[0]} channels, {how}"
    )
    return Picture(
        title=title,
        image=input_image(model_input, image_index, loaded),
        tiles=tiles,
        labels=[f"{int(c)}" for c in picked.tolist()],
        legend=[
            f"output {_shape(got.out)}: {layout.describe()}",
            "each tile scaled to its own min..max",
        ],
        notes=notes,
        layer=target.name,
        call=call,
        layout=layout.describe(),
    )


def scaled_each(maps: torch.Tensor) -> torch.Tensor:
    """Each map (along the first dimension) scaled from its own minimum to its maximum (as
    matplotlib's imshow shows it), however small its range (make_grid's floor of 1e-5 drew a
    map spanning 3e-7 near black); a flat map is all 0."""
    flat = maps.flatten(1)
    shape = (-1, *([1] * (maps.dim() - 1)))
    low, high = flat.amin(dim=1).view(shape), flat.amax(dim=1).view(shape)
    span = high - low
    return torch.where(span > 0, (maps - low) / torch.where(span > 0, span, 1), 0).clamp(0, 1)


def tiles_uint8(maps: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Each map scaled to its own range (`scaled_each`), as uint8."""
    out: np.ndarray[Any, np.dtype[np.uint8]] = (
        scaled_each(maps).float().cpu().numpy() * 255 + 0.5
    ).astype(np.uint8)
    return out


def grad_cam(
    activation: torch.Tensor, gradient: torch.Tensor, size: tuple[int, int], method: str = "gradcam"
) -> torch.Tensor:
    """Grad-CAM (Selvaraju et al.) or Grad-CAM++ (Chattopadhyay et al.) of one image:
    ReLU(Σ_c w_c · A_c), upsampled bilinearly to `size`. activation, gradient: (C, H, W)."""
    a = activation.double()
    g = gradient.double()
    if method == "gradcam":
        w = g.mean(dim=(1, 2))
    elif method == "gradcam++":
        g2, g3 = g * g, g * g * g
        denom = 2 * g2 + a.sum(dim=(1, 2), keepdim=True) * g3
        alpha = g2 / torch.where(denom != 0, denom, torch.ones_like(denom))
        w = (alpha * F.relu(g)).sum(dim=(1, 2))
    else:
        raise UsageError(f"unknown --method {method!r}.", "use gradcam or gradcam++.")
    cam = F.relu((w.view(-1, 1, 1) * a).sum(dim=0))
    up = F.interpolate(cam[None, None], size=size, mode="bilinear", align_corners=False)
    return up[0, 0]


def class_activation(
    model: ModelOptions,
    inputs: InputOptions,
    backward: BackwardOptions,
    options: CamOptions,
) -> Picture:
    """Grad-CAM of one image for the target (default: top-1), from the same tensor hooks as
    `grads`."""
    layer, call, method, image_index = (
        options.layer,
        options.call,
        options.method,
        options.image_index,
    )
    if method not in ("gradcam", "gradcam++"):
        raise UsageError(f"unknown --method {method!r}.", "use gradcam or gradcam++.")
    target, loss = backward.target, backward.loss
    prepared = prepare(model, inputs=inputs, backward=BackwardOptions(target, loss))
    loaded, model_input = prepared.loaded, prepared.model_input
    assert model_input is not None
    assert prepared.backward is not None
    described = prepared.backward.describe()
    notes = []
    layout_of = _reader(prepared)
    no_gradient = None
    if layer is None:
        layer, no_gradient = default_cam_layer(prepared, layout_of)
        notes.append(
            f"layer {layer}: the last layer over the image that the target's gradient reaches "
            "(choose another with -l)"
        )
    tgt = one_target(prepared, layer)
    got = _capture(prepared, tgt, call, backward=True)
    value, model_out = got.value, got.output
    notes += got.notes
    notes += input_notes(model_input, image_index)
    try:  # the class scores the target read (logits of a ModelOutput, --output-key's element)
        scores: torch.Tensor | None = loaded.kind.scores(loaded.kind.select(model_out)).detach()
    except UsageError:
        scores = None
    layout = layout_of(tgt.name, tuple(got.out.shape))
    out, grad = layout.to_nchw(got.out), got.grad
    if grad is None:
        raise UsageError(
            f"layer {tgt.name} has no gradient for this target (its output does not reach it).",
            "pick a layer before the output, or another --target.",
        )
    grad = layout.to_nchw(grad)
    check_image_index(image_index, out)
    if out.dim() == 4 and out.shape[2] * out.shape[3] == 1:
        notes.append(
            f"layer {tgt.name}'s map is 1x1, one value for the whole image: the heat is flat "
            "and says nothing of where; pick a layer with a spatial map (without -l, the "
            "last layer over the image)"
        )
    image = input_image(model_input, image_index, loaded)
    size = (image.shape[0], image.shape[1]) if image is not None else tuple(out.shape[2:])
    raw = grad_cam(out[image_index], grad[image_index], size, method)  # type: ignore[arg-type]
    finite = torch.isfinite(raw)
    bad = int((~finite).sum())
    shown = torch.where(finite, raw, torch.zeros_like(raw))
    top = float(shown.max())
    heat = (shown / top if top > 0 else shown).float().cpu().numpy()
    if bad:
        notes.append(
            f"{bad} of {raw.numel()} map values are NaN/Inf (the activations or gradients are "
            "not finite; `hookcli grads` shows where they start): drawn as zero"
        )
    elif top == 0:
        notes.append(
            _why_zero(grad[image_index], scores, image_index, no_gradient, prepared.backward)
        )
    name = "Grad-CAM++" if method == "gradcam++" else "Grad-CAM"
    label = _target_label(
        target or loaded.kind.default_target,
        loss,
        loaded,
        scores=scores,
        image_index=image_index,
        described=described,
    )
    title = f"{name} · {loaded.spec} · {tgt.name} · {label}"
    legend = [
        f"layer output {_shape(got.out)}: {layout.describe()}",
        f"target: {described} = "
        + (f"{value:.4g}" if value is not None and np.isfinite(value) else "not finite"),
        f"heat: {name} scaled to its maximum ({top:.4g})"
        + (f"; {bad} non-finite values drawn as 0" if bad else ""),
    ]
    if loss:  # (the gradient of a loss points up the loss: never read as a class's evidence)
        legend.append(
            "sign: the loss's own gradient, so heat marks where the activations raise the "
            "loss (evidence against its target); --target IDX maps a class's evidence"
        )
    if not loaded.pretrained:
        notes.append("weights are random (--weights none): the map shows no learned evidence")
    return Picture(
        title=title,
        image=image,
        heat=heat,
        raw=raw.float().cpu().numpy(),
        legend=legend,
        notes=notes,
        layer=tgt.name,
        call=call,
        layout=layout.describe(),
    )


def _why_zero(
    grad: torch.Tensor,
    scores: torch.Tensor | None,
    image_index: int,
    no_gradient: str | None,
    spec: TargetSpec,
) -> str:
    """The real cause of an all-zero map: constant scores (a zero-initialised head: torchvision
    ViT's with random weights), an empty segmentation mask, no gradient reaching the layer, or
    no positive evidence."""
    cls = spec.index if spec.kind == "mask" else None
    predicted = scores[image_index].argmax(0) if scores is not None and scores.dim() == 4 else None
    if cls is not None and predicted is not None and not bool(torch.eq(predicted, cls).any()):
        return (
            f"the map is all zero: no pixel of this image is predicted as class {cls}, so "
            "its mask is empty; pick a class the model predicts (`hookcli inspect` lists "
            "them by share of pixels)"
        )
    row = scores[image_index] if scores is not None and scores.dim() == 2 else None
    if row is not None and bool((row == row[0]).all()):
        return (
            "the map is all zero: the model's scores are the same for every class (a "
            "zero-initialised head, as torchvision's ViT has with random weights), so no "
            "gradient reaches any layer; load weights with --weights"
        )
    if no_gradient is not None or not bool(grad.abs().sum() > 0):
        return (
            "the map is all zero: the target's gradient does not reach this layer's "
            "activations; pick an earlier layer with -l, or another --target"
        )
    return "the map is all zero: no channel has positive evidence for this target"


def _target_label(
    target: str | None,
    loss: str | None,
    loaded: LoadedModel,
    *,
    scores: torch.Tensor | None,
    image_index: int,
    described: str,
) -> str:
    """The class the map is for, named: `top-1: class 281 'tabby'`."""
    if loss:
        return f"loss {loss}"
    raw = (target or "top1").strip()
    if raw.lower() != "top1":
        return described
    if scores is not None and scores.dim() == 2:
        idx = int(scores[image_index].argmax())
        cats = loaded.categories
        name = f" {cats[idx]!r}" if cats and idx < len(cats) else ""
        return f"top-1: class {idx}{name}"
    return "top-1 score"
