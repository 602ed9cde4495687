"""Which layout a 3-D or 4-D activation has, so a picture reads it right: NCHW, NHWC
(channels-last stages: Swin, ConvNeXt block internals), or tokens (N, L, C) with k prefix
tokens (class, distillation, register) before an hxw patch grid (ViT).

What the model says is used first: torchvision's `Permute` modules open and close channels-last
regions (walked in execution order), `class_token` counts a prefix token. Otherwise the layout is
inferred from the input size: a spatial map keeps the input's aspect with one stride in both
directions, and a token sequence holds a grid of patches of one size. When both NCHW and NHWC fit
(an 8x8x8 output of a square image), or no grid fits, the caller gets an error naming the shape:
a picture is never drawn from a guessed layout. The layout used is stated with the picture.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from hookcli.errors import UsageError

NCHW, NHWC, TOKENS = "NCHW", "NHWC", "tokens"
MAX_PREFIX = 8  # prefix tokens tried when the model does not say: class, distillation, registers


@dataclass(frozen=True, slots=True)
class Layout:
    """How to read one activation as (N, C, h, w) feature maps."""

    kind: str  # NCHW, NHWC or tokens
    grid: tuple[int, int]  # (h, w) of the map
    channels: int
    prefix: int = 0  # tokens: prefix tokens dropped before the grid
    how: str = ""  # how it is known: "the model's Permute modules", "inferred from the input size"

    @property
    def label(self) -> str:
        """The short form in reports: NCHW, NHWC, or tokens:1+14x14."""
        if self.kind == TOKENS:
            return f"tokens:{self.prefix}+{self.grid[0]}x{self.grid[1]}"
        return self.kind

    def describe(self) -> str:
        """`NHWC 7x7, 768 channels (the model's Permute modules)`."""
        h, w = self.grid
        what = f"{self.kind} {h}x{w}, {self.channels} channels"
        if self.kind == TOKENS:
            what = f"tokens: {self.prefix} prefix + {h}x{w} patches, {self.channels} channels"
        return f"{what} ({self.how})" if self.how else what

    def to_nchw(self, t: torch.Tensor) -> torch.Tensor:
        """The activation (or its gradient) as (N, C, h, w), prefix tokens dropped."""
        if self.kind == NHWC:
            return t.permute(0, 3, 1, 2)
        if self.kind == TOKENS:
            h, w = self.grid
            return t[:, self.prefix :, :].reshape(t.shape[0], h, w, t.shape[2]).permute(0, 3, 1, 2)
        return t


@dataclass(frozen=True, slots=True)
class ModelHints:
    """What the model says about its layouts: the modules whose outputs are channels-last, and
    how many prefix tokens its token sequences carry (None: it does not say)."""

    channels_last: frozenset[str] = frozenset()
    channels_first: frozenset[str] = frozenset()  # convolutions, and NCHW regions
    prefix_tokens: int | None = None
    source: str = ""  # how channels_last/channels_first are known
    prefix_source: str = ""  # how prefix_tokens is known
    convolutions: frozenset[str] = frozenset()  # modules whose output is NCHW by their type
    # outputs in window-partition space (MaxViT), each with the module that holds its windows
    windows: Mapping[str, str] = field(default_factory=dict)


_PREFIX_PARAMS = ("class_token", "cls_token", "dist_token", "distillation_token", "reg_token",
                  "register_tokens")  # fmt: skip
_CONV_LIKE = (nn.Conv2d, nn.ConvTranspose2d, nn.BatchNorm2d, nn.MaxPool2d, nn.AvgPool2d)


_MISSING = object()


def _attr(module: nn.Module, name: str) -> object:
    """getattr(module, name, None) without nn.Module.__getattr__'s raise-and-catch when the
    module has no such attribute (a walk asks every module of the model), in Python's order: a
    descriptor of the class (property, method) read through getattr, else the instance's own
    value, the class's, then nn.Module's parameters, buffers and submodules. A class with a
    `__getattr__` of its own (TorchScript keeps attributes in C++, torch.compile's wrapper
    forwards to the module it wraps) is asked through getattr."""
    cls = type(module)
    if cls.__getattr__ is not _MODULE_GETATTR:
        return getattr(module, name, None)
    found = getattr(cls, name, _MISSING)
    if found is not _MISSING and hasattr(found, "__get__"):
        return getattr(module, name, None)
    value = vars(module).get(name, _MISSING)
    if value is not _MISSING:
        return value
    if found is not _MISSING:
        return found
    for table in (module._parameters, module._buffers, module._modules):
        if name in table:
            return table[name]
    return None


_MODULE_GETATTR = nn.Module.__getattr__


def _prefix_tokens(model: nn.Module) -> tuple[int | None, str]:
    """How many tokens precede the patch grid, as the model says: timm's `num_prefix_tokens`,
    else its class/distillation/register token parameters (torchvision `class_token`, timm and
    Hugging Face `cls_token`, `distillation_token`, `register_tokens`)."""
    count = 0
    seen: set[int] = set()  # a tensor reachable by two names counts once
    for module in model.modules():  # the root first; timm: the attribute may live inside
        told = _attr(module, "num_prefix_tokens")
        if isinstance(told, int) and not isinstance(told, bool):
            return told, "the model's num_prefix_tokens"
        for table in (module._parameters, module._buffers):
            for key, value in table.items():
                if key in _PREFIX_PARAMS and value is not None and id(value) not in seen:
                    seen.add(id(value))
                    count += int(value.shape[-2]) if value.dim() == 3 else 1
    if count:
        return count, "the model's class token" + ("s" if count > 1 else "")
    return None, ""


def _format(module: nn.Module) -> str | None:
    """A module's own `output_fmt` (timm: Format.NHWC or 'NHWC'), NCHW or NHWC, else None."""
    fmt = _attr(module, "output_fmt")
    text = str(getattr(fmt, "value", fmt)) if fmt is not None else ""
    return text if text in (NCHW, NHWC) else None


def model_hints(model: nn.Module) -> ModelHints:
    """What the model's structure says. torchvision: `Permute([0, 2, 3, 1])` starts a
    channels-last region and `Permute([0, 3, 1, 2])` ends it, modules visited in registration
    order (execution order in these Sequential stages); a container's output has the layout in
    force when its last child has run. timm: a model (or module) whose `output_fmt` is NHWC
    (Swin, MambaOut, Hiera) keeps its 4-D activations channels-last, its convolutions aside.
    Everywhere: a convolution, 2-D batch norm or 2-D pooling outputs NCHW. torchvision's
    MaxViT: inside a module holding a `WindowPartition` and a `WindowDepartition` (run in
    that order whatever the registration order), outputs other than the departition's are
    (N, windows, tokens, C), not maps. Prefix tokens come from `num_prefix_tokens` or the
    class/register token parameters."""
    prefix, prefix_source = _prefix_tokens(model)
    last: set[str] = set()
    first: set[str] = set()
    convs: set[str] = set()
    windows: dict[str, str] = {}
    modules = list(model.modules())
    kinds = {type(m).__name__ for m in modules}
    permutes = "Permute" in kinds and any(
        type(m).__name__ == "Permute" and hasattr(m, "dims") for m in modules
    )
    model_fmt = _format(model)
    state = [model_fmt or NCHW]
    source = ""
    if permutes:
        source = "the model's Permute modules"
    elif model_fmt == NHWC:
        source = "the model's output_fmt NHWC"

    def visit(name: str, module: nn.Module, inherited: str) -> None:
        own = _format(module) if name else None
        if type(module).__name__ == "Permute":
            dims = list(getattr(module, "dims", []))
            if dims == [0, 2, 3, 1]:
                state[0] = NHWC
            elif dims == [0, 3, 1, 2]:
                state[0] = NCHW
        for child_name, child in module._modules.items():
            if child is not None:
                visit(f"{name}.{child_name}" if name else child_name, child, own or inherited)
        if not name:
            return
        if isinstance(module, _CONV_LIKE):
            convs.add(name)
        elif own is not None:
            (last if own == NHWC else first).add(name)
        elif permutes:
            (last if state[0] == NHWC else first).add(name)
        elif inherited == NHWC:
            last.add(name)

    visit("", model, model_fmt or "")
    for name, module in model.named_modules() if "WindowPartition" in kinds else ():
        kids = {type(m).__name__: n for n, m in module.named_children()}
        if "WindowPartition" in kids and "WindowDepartition" in kids:
            inner = f"{name}." if name else ""
            out = inner + kids["WindowDepartition"]
            windows.update(
                (f"{inner}{n}", name)
                for n, _ in module.named_modules()
                if n and f"{inner}{n}" != out
            )
    if (last or first) and not source:
        source = "the modules' output_fmt"
    return ModelHints(
        frozenset(last),
        frozenset(first),
        prefix,
        source,
        prefix_source,
        frozenset(convs),
        windows,
    )


def _fits(grid: tuple[int, int], size: tuple[int, int]) -> bool:
    """A map of `grid` cells can come from an input of `size` with one stride in both
    directions: exactly square for a square input, and the stride at least 2 unless it divides
    the input (224 → 224, 112, 56 …; 299 → 149, 147, 73 …); otherwise strides within 5%."""
    (h, w), (height, width) = grid, size
    if h < 1 or w < 1:
        return False
    if height == width:  # a stride under 2 must divide: 196x196 of 224 is no map (CaiT's L x L)
        return h == w and (height % h == 0 or height >= 2 * h)
    sh, sw = height / h, width / w
    if abs(sh / sw - 1) <= 0.05:
        return True
    # a small grid of an odd size: one integer stride, rounded up or down in both directions
    # (97x131 by 32: 4x5, though 97/4 and 131/5 differ by 8%)
    for stride in range(max(2, height // (h + 1)), height // max(h - 1, 1) + 2):
        if (-(-height // stride), -(-width // stride)) == (h, w):
            return True
        if (height // stride, width // stride) == (h, w):
            return True
    return False


def _token_grids(
    length: int, size: tuple[int, int], prefixes: range | list[int]
) -> list[tuple[int, tuple[int, int]]]:
    """(prefix, (h, w)) splits of a token sequence into prefix tokens and a patch grid whose
    patches tile the input: one patch size in both directions, dividing the input exactly when
    the input is square."""
    found = []
    height, width = size
    for k in prefixes:
        n = length - k
        if n < 1:
            continue
        if height == width:
            h = math.isqrt(n)
            if h * h == n and height % h == 0:
                found.append((k, (h, h)))
            continue
        h = round(math.sqrt(n * height / width))
        for hh in (h - 1, h, h + 1):
            if hh >= 1 and n % hh == 0 and _fits((hh, n // hh), size):
                found.append((k, (hh, n // hh)))
                break
    return found


def _dims(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def resolve(
    name: str,
    shape: tuple[int, ...],
    input_size: tuple[int, int] | None,
    hints: ModelHints,
    batch: int | None = None,
) -> Layout:
    """The layout of layer `name`'s output of `shape`, for an input image of `input_size`
    (None: no image-shaped input) holding `batch` images (None: unknown). Raises a UsageError
    naming the shape when it cannot be told."""
    if batch is not None and len(shape) in (3, 4) and shape[0] != batch:
        dims = _dims(shape)
        raise UsageError(
            f"layer {name}'s output {dims} has {shape[0]} rows for {batch} input "
            "image(s): its first dimension holds windows, heads or a flattened batch, not images.",
            "pick the block that holds the windows together (its parent in `hookcli layers`).",
        )
    if name in hints.windows:
        dims = _dims(shape)
        raise UsageError(
            f"layer {name}'s output {dims} holds windows (N, windows, tokens, C), between the "
            "model's WindowPartition and WindowDepartition, not a map over the image.",
            f"pick {hints.windows[name]}, which puts the windows back together.",
        )
    if len(shape) == 4:
        return _spatial(name, shape, input_size, hints)
    if len(shape) == 3:
        return _tokens(name, shape, input_size, hints)
    dims = _dims(shape)
    raise UsageError(
        f"layer {name} outputs a {len(shape)}-D tensor ({dims}); pictures need (N, C, H, W), "
        "(N, H, W, C) or tokens (N, L, C).",
        "pick another layer: `hookcli layers MODEL --shapes` shows output shapes.",
    )


def _spatial(
    name: str, shape: tuple[int, ...], input_size: tuple[int, int] | None, hints: ModelHints
) -> Layout:
    """A 4-D output: NCHW or NHWC."""
    _, a, b, c = shape
    if name in hints.convolutions:
        return Layout(NCHW, (b, c), a, how="a convolution's output")
    if name in hints.channels_last:
        if input_size is None or _fits((a, b), input_size):
            return Layout(NHWC, (a, b), c, how=hints.source)
        # an NHWC model's module whose output is no NHWC map of the input (a permute back to
        # NCHW inside a block, window attention's (windows, heads, L, L)): never guessed
        dims = _dims(shape)
        raise UsageError(
            f"layer {name}'s output {dims} is no NHWC map of the {input_size[0]}x"
            f"{input_size[1]} input, though {hints.source} says the model's activations are "
            "NHWC: its layout cannot be told (permuted back to NCHW, or attention scores).",
            "pick a layer whose output shape shows its layout: `hookcli layers MODEL --shapes`.",
        )
    if name in hints.channels_first:
        return Layout(NCHW, (b, c), a, how=hints.source)
    if input_size is None:
        dims = _dims(shape)
        raise UsageError(
            f"layer {name}'s output {dims} has no layout hookcli can be sure of: the input is "
            "not an image to check NCHW or NHWC against (4-D attention scores of a text model "
            "are (N, heads, L, L)).",
            "give an image input (N, C, H, W), or pick a convolution's output.",
        )
    first, last = _fits((b, c), input_size), _fits((a, b), input_size)
    if first and not last:
        return Layout(NCHW, (b, c), a, how="inferred from the input size")
    if last and not first:
        return Layout(NHWC, (a, b), c, how="inferred from the input size")
    why = "both NCHW and NHWC fit" if first else "neither NCHW nor NHWC fits"
    dims = _dims(shape)
    raise UsageError(
        f"layer {name}'s output {dims} has no layout hookcli can be sure of ({why} the "
        f"{input_size[0]}x{input_size[1]} input).",
        "pick a layer whose output shape shows its layout: `hookcli layers MODEL --shapes`.",
    )


def _tokens(
    name: str, shape: tuple[int, ...], input_size: tuple[int, int] | None, hints: ModelHints
) -> Layout:
    """A 3-D output: a token sequence (N, prefix + h*w, C)."""
    _, length, c = shape
    if input_size is None:
        dims = _dims(shape)
        raise UsageError(
            f"layer {name} outputs tokens {dims} but the input is not an image: there is no "
            "patch grid to draw them on.",
            "give an image input, or pick a layer with an (N, C, H, W) output.",
        )
    told = hints.prefix_tokens
    # the model's prefix tokens, or none: patch tokens before the class token joins (CaiT)
    prefixes = sorted({told, 0}) if told is not None else range(MAX_PREFIX + 1)
    grids = _token_grids(length, input_size, prefixes)
    how = f"{hints.prefix_source}, grid from the input size" if told is not None else ""
    if len(grids) == 1:
        k, grid = grids[0]
        if told and not k:
            how = f"patches only, before {hints.prefix_source} joins; grid from the input size"
        return Layout(TOKENS, grid, c, prefix=k, how=how or "inferred from the input size")
    why = "several prefix/grid splits fit" if grids else "no patch grid fits"
    dims = _dims(shape)
    raise UsageError(
        f"layer {name}'s output {dims} is not a token sequence hookcli can lay on the "
        f"{input_size[0]}x{input_size[1]} input ({why}).",
        "pick a layer with an (N, C, H, W) or (N, prefix + h*w, C) output: "
        "`hookcli layers MODEL --shapes`.",
    )


LayoutOf = Callable[[str, tuple[int, ...]], Layout]  # layer name, output shape → its layout
_NO_HINTS = ModelHints()


def reader(model: nn.Module, size: tuple[int, int] | None, batch: int | None = None) -> LayoutOf:
    """`resolve` for one model, input size (H, W) and batch (None: not checked; `image_of`
    reads both from the forward's arguments): the model's hints read once, on first use (a
    model with no 3-D/4-D output never walks its tree)."""
    hints: list[ModelHints] = []

    def layout_of(name: str, shape: tuple[int, ...]) -> Layout:
        if size is None and len(shape) == 3:
            # tokens of an input that is no image: no grid to lay them on, whatever the model
            # says (its walk skipped: a language model's outputs are all 3-D; windows, the
            # one hint read before, are 4-D)
            return resolve(name, shape, size, _NO_HINTS, batch)
        if not hints:
            hints.append(model_hints(model))
        return resolve(name, shape, size, hints[0], batch)

    return layout_of


def image_of(args: tuple[object, ...]) -> tuple[tuple[int, int] | None, int | None]:
    """The (H, W) of the first image-shaped input — (N, C, H, W) or (C, H, W) with C of 1, 3
    or 4, a list of (C, H, W), or a floating (N, C, H, W) batch of any C (the layout torch's
    convolutions take) — and its batch size; (None, None) when no input is an image (token
    ids, sequences)."""
    for arg in args:
        x = (arg[0] if arg else None) if isinstance(arg, list) else arg
        if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4):
            continue
        floats = x.dim() == 4 and x.is_floating_point() and not isinstance(arg, list)
        if floats and x.shape[-1] in (1, 3, 4) and x.shape[-3] not in (1, 3, 4):
            floats = False  # (N, H, W, C) pixels: not the (N, C, H, W) this reads
        if floats or x.shape[-3] in (1, 3, 4):
            batch = len(arg) if isinstance(arg, list) else (x.shape[0] if x.dim() == 4 else 1)
            return (int(x.shape[-2]), int(x.shape[-1])), int(batch)
    return None, None
