"""What a model's task decides, one class per task: the batch its forward takes, its default
input, how predictions and the default backward target are read from its output, and any
builder or device constraint. A source hands one Task to each model it loads; the rest of
hookcli asks the Task instead of testing `task == ...`.

A plug-in source may subclass Task (or one of these) to read its own outputs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hookcli.errors import UsageError, one_line
from hookcli.records import Prediction
from hookcli.tree import pick

CLIP_FRAMES = 16  # a still image repeated as a clip this long (MViT needs exactly 16)

# (rank, class index, probability or share, image index) → one prediction row
Row = Callable[[int, int, float, int], Prediction]
Preprocess = Callable[..., Any]
# a forward's positional arguments, keyword arguments, and a note on how they were made
Forward = tuple[tuple[Any, ...], dict[str, Any], str]


def read_scores(output: Any) -> torch.Tensor:
    """The (N, classes, ...) score tensor of a classification or segmentation output."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("out"), torch.Tensor):
        return output["out"]  # type: ignore[no-any-return]  # segmentation
    if isinstance(output, tuple) and hasattr(output, "logits"):
        return output.logits  # type: ignore[no-any-return]
    raise UsageError(
        f"the model returns a {type(output).__name__}, not class scores.",
        "use --target sum, or a --loss against a target tensor.",
    )


class Task:
    """A model whose output hookcli cannot read as predictions (the base of every task)."""

    name = "task"
    fallback_size: tuple[int, int] = (224, 224)  # H, W when the transforms do not say
    default_topk = 5  # predictions shown when --topk is not given
    stacks = True  # images form one stacked batch (False: a list of images, any sizes)
    # pictures (cam overlays) undo ImageNet's mean/std when the source gave no preprocessing
    denormalise_imagenet = False
    default_target = "top1"  # what backward starts from when --target is not given
    item = "image"  # what one row of the batch is, in words ("top-1 score of each image")
    takes_images = True  # False: image files are refused (a text model takes token ids)
    pairs = False  # True: its images come in pairs (optical flow), never a folder's one by one
    output_key: str | None = None  # --output-key: the element of the output that is read

    def keyed(self, key: str | None) -> Task:
        """This task reading the element `key` of the output (a copy; None: itself)."""
        if not key:
            return self
        twin = copy.copy(self)
        twin.output_key = key
        return twin

    def select(self, output: Any) -> Any:
        """The part of the output predictions and targets read (--output-key), else all."""
        if self.output_key is None:
            return output
        try:
            return pick(output, self.output_key)
        except (LookupError, ValueError) as exc:
            raise UsageError(
                f"--output-key {self.output_key!r} cannot be read from the model's output: "
                f"{one_line(exc, with_type=False)}.",
                'name a key, index or path of it (logits, 0, out[0]["boxes"]); '
                "`hookcli inspect MODEL -l '(model)'` lists the output's paths.",
            ) from exc

    def for_input(self, model_input: Any) -> Task:
        """This task reading the outputs of this input (a language model: where each
        sequence's next token is read, past its padding); itself when the input does not
        matter."""
        return self

    def builder_kwargs(self, kwargs: dict[str, Any]) -> None:
        """Adds what the builder needs for this task (kwargs edited in place)."""

    def device(self, spec: str, asked: str, device: torch.device, backward: bool) -> torch.device:
        """The device the model runs on, given the one asked for and the one resolved."""
        return device

    def images(
        self, images: Sequence[Any], preprocess: Preprocess | None
    ) -> tuple[tuple[Any, ...], str] | None:
        """Forward arguments and a description suffix for PIL images when the task builds its
        own; None: each image through the preprocessing, then `batch`."""
        return None

    def one_image(self, image: Any, preprocess: Preprocess) -> torch.Tensor:
        """One image of a folder's batch as its tensor (`batch` puts them together): what
        `images` builds of it alone where the task builds its own (a video model's clip),
        else the preprocessing's."""
        built = self.images([image], preprocess)
        one: torch.Tensor = preprocess(image) if built is None else built[0][0][0]
        return one

    def batch(self, tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
        """Preprocessed images → the forward's arguments: one stacked batch, or a list."""
        if not self.stacks:
            return (list(tensors),)
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1:
            raise UsageError(
                "the images have different sizes after preprocessing ("
                + ", ".join("x".join(map(str, s)) for s in sorted(shapes))
                + ") and cannot form one batch.",
                "give one image at a time, or images of the same aspect ratio.",
            )
        return (torch.stack(list(tensors)),)

    def spec_inputs(
        self, tensors: Sequence[torch.Tensor], named: Mapping[str, torch.Tensor]
    ) -> Forward:
        """Tensors from --input specs (positional, and NAME=SPEC ones) → the forward's
        arguments, keyword arguments and a note for the input's description."""
        return tuple(tensors), dict(named), ""

    def default_input(self, size: tuple[int, int], gen: torch.Generator, seed: int) -> Forward:
        """A deterministic random input of the model's size: arguments, keyword arguments
        and its description."""
        h, w = size
        x = torch.randn((1, 3, h, w), generator=gen)
        return (x,), {}, f"no input given: randn 1x3x{h}x{w} (seed {seed})"

    def predict(self, output: Any, topk: int, row: Row) -> tuple[list[Prediction], str] | None:
        """Top-k rows per image and their header; None when the output is not readable."""
        return None

    def scores(self, output: Any) -> torch.Tensor:
        """The class scores --target and --loss read (N, classes, ...)."""
        return read_scores(output)


class Classification(Task):
    name = "classification"

    def predict(self, output: Any, topk: int, row: Row) -> tuple[list[Prediction], str] | None:
        if not (
            isinstance(output, torch.Tensor)
            and output.dim() == 2
            and output.is_floating_point()
            and output.shape[1] > 1
        ):
            return None
        probs = torch.softmax(output.detach().double(), dim=1).cpu()
        values, idxs = probs.topk(min(topk, probs.shape[1]), dim=1)
        preds = [
            row(rank, i, v, img)
            for img in range(probs.shape[0])
            for rank, (v, i) in enumerate(
                zip(values[img].tolist(), idxs[img].tolist(), strict=True), 1
            )
        ]
        shown = min(topk, probs.shape[1])
        every = f" (all {shown})" if shown < topk else ""
        return preds, f"top-{shown} classes{every} by softmax probability"


class Custom(Classification):
    """A user's model: its output is not known to be class scores, so predictions are asked
    for (--topk), not shown by default."""

    name = "custom"
    default_topk = 0
    denormalise_imagenet = True


class Quantized(Classification):
    name = "quantized"

    def for_input(self, model_input: Any) -> Task:
        """This task reading the outputs of this input (a language model: where each
        sequence's next token is read, past its padding); itself when the input does not
        matter."""
        return self

    def builder_kwargs(self, kwargs: dict[str, Any]) -> None:
        # torchvision quantizes (fuse, calibrate on its own random input, convert) offline
        kwargs.setdefault("quantize", True)

    def device(self, spec: str, asked: str, device: torch.device, backward: bool) -> torch.device:
        if backward:
            raise UsageError(
                f"{spec} is quantized: int8 kernels have no autograd, so there are no gradients.",
                f"use the float model ({spec.removeprefix('quantized_')}).",
            )
        if asked.strip().lower() == "auto":
            return torch.device("cpu")  # int8 kernels exist on the CPU only
        if device.type != "cpu":
            raise UsageError(f"{spec} is quantized and runs on the CPU only.", "use --device cpu.")
        return device


class Video(Classification):
    name = "video"

    def images(
        self, images: Sequence[Any], preprocess: Preprocess | None
    ) -> tuple[tuple[Any, ...], str] | None:
        """Each still image repeated as a clip, through the weights' transforms."""
        from torchvision.transforms.functional import pil_to_tensor

        assert preprocess is not None
        clips = [pil_to_tensor(im).unsqueeze(0).expand(CLIP_FRAMES, -1, -1, -1) for im in images]
        batch = torch.stack([preprocess(c) for c in clips])  # (N, C, T, H, W)
        return (batch,), f", each repeated as a clip of {CLIP_FRAMES} frames"

    def default_input(self, size: tuple[int, int], gen: torch.Generator, seed: int) -> Forward:
        h, w = size
        x = torch.randn((1, 3, CLIP_FRAMES, h, w), generator=gen)
        return (x,), {}, f"no input given: randn 1x3x{CLIP_FRAMES}x{h}x{w} clip (seed {seed})"


class Segmentation(Task):
    name = "segmentation"

    def predict(self, output: Any, topk: int, row: Row) -> tuple[list[Prediction], str] | None:
        if not (isinstance(output, Mapping) and "out" in output):
            return None
        logits = output["out"]
        preds = []
        for img in range(logits.shape[0]):
            cls = logits[img].argmax(0).reshape(-1).cpu()
            share = torch.bincount(cls, minlength=logits.shape[1]).double() / cls.numel()
            values, idxs = share.topk(min(topk, share.numel()))
            for rank, (v, i) in enumerate(zip(values.tolist(), idxs.tolist(), strict=True), 1):
                preds.append(row(rank, i, v, img))
        return preds, "classes by share of pixels (prob = fraction of pixels)"


class Detection(Task):
    name = "detection"
    fallback_size = (320, 320)
    default_target = "box:0"  # the top detection's score (pytorch-grad-cam's box target)
    stacks = False  # detection takes a list of images of any sizes

    def spec_inputs(
        self, tensors: Sequence[torch.Tensor], named: Mapping[str, torch.Tensor]
    ) -> Forward:
        if not tensors:
            return (), dict(named), ""
        batch = tensors[0]
        return (list(batch) if batch.dim() == 4 else [batch], *tensors[1:]), dict(named), ""

    def default_input(self, size: tuple[int, int], gen: torch.Generator, seed: int) -> Forward:
        h, w = size
        img = torch.rand((3, h, w), generator=gen)
        return ([img],), {}, f"no input given: rand 3x{h}x{w} image (seed {seed})"

    def predict(self, output: Any, topk: int, row: Row) -> tuple[list[Prediction], str] | None:
        if not isinstance(output, list):
            return None
        preds = []
        for img, det in enumerate(output):
            if not isinstance(det, Mapping) or "scores" not in det:
                return None
            scores, labels = det["scores"].float().cpu(), det["labels"].cpu()
            order = torch.argsort(scores, descending=True)[:topk]
            for rank, j in enumerate(order.tolist(), 1):
                preds.append(row(rank, int(labels[j]), float(scores[j]), img))
        return preds, f"top-{topk} detections per image by score"


class OpticalFlow(Task):
    name = "optical_flow"
    pairs = True

    def images(
        self, images: Sequence[Any], preprocess: Preprocess | None
    ) -> tuple[tuple[Any, ...], str] | None:
        """Two images, the second resized to the first, both to multiples of 8."""
        if len(images) != 2:
            raise UsageError(
                f"optical-flow models take two images (frame 1, frame 2); got {len(images)}.",
                "give exactly two image files.",
            )
        w, h = images[0].size
        size = (max(128, w // 8 * 8), max(128, h // 8 * 8))
        a, b = (im.resize(size) for im in images)
        assert preprocess is not None
        one, two = preprocess(a, b)
        return (one.unsqueeze(0), two.unsqueeze(0)), " (frame 1, frame 2)"

    def default_input(self, size: tuple[int, int], gen: torch.Generator, seed: int) -> Forward:
        a, b = (torch.rand((1, 3, 224, 224), generator=gen) * 2 - 1 for _ in range(2))
        return (a, b), {}, f"no input given: two rand 1x3x224x224 frames in [-1, 1] (seed {seed})"


CUSTOM = Custom()
BY_NAME: dict[str, Task] = {
    t.name: t
    for t in (
        Classification(),
        Segmentation(),
        Detection(),
        Video(),
        OpticalFlow(),
        Quantized(),
        CUSTOM,
    )
}
TASKS = ("classification", "segmentation", "detection", "video", "optical_flow", "quantized")


def task_named(name: str) -> Task:
    """The Task of a task name (`hookcli models --task`, torchvision's packages)."""
    return BY_NAME[name]
