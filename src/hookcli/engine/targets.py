"""What backward starts from: a target on the model's scores, or a loss against a tensor.

--target top1 | <class index> | "<class label>" | sum
         | next-token    a language model's next-token cross-entropy over its own text (each
                         real token predicted from the ones before it; padding left out):
                         what transformers' `model(input_ids, labels=input_ids).loss` gives
         | box:K         detection: the K-th detection's score plus its box's IoU with itself,
                         per image (pytorch-grad-cam's FasterRCNNBoxScoreTarget on that box)
         | mask:CLASS    segmentation: CLASS's scores summed over the pixels predicted as CLASS
                         (pytorch-grad-cam's SemanticSegmentationTarget)
--loss ce:<idx> | nll:<idx> | l1:<spec> | mse:<spec> | bce:<spec> | bcelogits:<spec>

where <spec> is a tensor spec: `ones`, `zeros` (shaped like the output), `ones:2x10`,
`randn:…`, `rand:…`, `file.pt`, `file.npy`. Losses use PyTorch's default mean reduction.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hookcli.errors import UsageError
from hookcli.inputs import parse_spec
from hookcli.sources.tasks import read_scores
from hookcli.tree import iter_tensors

LOSSES = ("ce", "nll", "l1", "mse", "bce", "bcelogits")
NEXT_TOKEN = ("next-token", "next_token")
IGNORE = -100  # a label no loss counts (padding), as transformers' losses use it
WHOLE = re.compile(r"-?[0-9]+")  # an index: ASCII digits only (never "²" or "٣")


@dataclass(slots=True)
class TargetSpec:
    """A parsed --target or --loss, resolved against the model's output at backward time."""

    kind: str  # top1 | index | sum | loss | box | mask
    index: int | None = None
    label: str | None = None
    loss: str | None = None
    spec: str | None = None
    item: str = "image"  # what one row of the batch is (a text model's: "sequence")
    # next-token: the ids each position predicts (the input's, -100 at padding), set by
    # prepare() from the input
    labels: torch.Tensor | None = None
    aligned: bool = False  # labels[i] is what logits[i] predicts (a seq2seq target text)

    def _lm(self) -> str:
        if self.aligned:
            n = "" if self.labels is None else f" ({int((self.labels != -100).sum())} tokens)"
            return f"teacher-forced cross-entropy of the target text, mean over its tokens{n}"
        n = "" if self.labels is None else f" ({int((self.labels[:, 1:] != -100).sum())} "
        n += "tokens predicted)" if n else ""
        return f"next-token cross-entropy of the text, mean over its tokens{n}"

    def describe(self) -> str:
        if self.kind == "lm":
            return self._lm()
        fixed = {
            "top1": f"top-1 score (logit) of each {self.item}, summed",
            "sum": "sum of every floating-point output element",
        }
        if self.kind in fixed:
            return fixed[self.kind]
        if self.kind == "index":
            named = f" ({self.label!r})" if self.label else ""
            return f"score (logit) of class {self.index}{named}, summed over {self.item}s"
        if self.kind == "box":
            return f"score + IoU of detection {self.index} (by score) of each image, summed"
        if self.kind == "mask":
            named = f" ({self.label!r})" if self.label else ""
            return f"score of class {self.index}{named} over the pixels predicted as it, summed"
        return f"{self.loss} loss against {self.spec}"


def parse_target(
    target: str | None, loss: str | None, categories: Sequence[str] | None
) -> TargetSpec:
    """--target/--loss → TargetSpec. A loss wins when both are given (it is the more specific)."""
    if loss:
        kind, sep, rest = loss.partition(":")
        kind = kind.strip().lower()
        if kind not in LOSSES or not sep or not rest.strip():
            raise UsageError(
                f"malformed --loss {loss!r}: expected KIND:ARG with KIND one of "
                f"{', '.join(LOSSES)} (ce:IDX, nll:IDX, mse:ones, l1:target.pt …).",
                "for example --loss ce:281 or --loss mse:ones",
            )
        rest = rest.strip()
        if kind in ("ce", "nll"):
            index = _class_index(rest, categories, option="--loss")
            return TargetSpec("loss", index=index, loss=kind, spec=f"class {index}")
        return TargetSpec("loss", loss=kind, spec=rest)
    raw = (target or "top1").strip()
    named = {"top1": "top1", "sum": "sum", **dict.fromkeys(NEXT_TOKEN, "lm")}
    if raw.lower() in named:
        return TargetSpec(named[raw.lower()])
    kind, sep, rest = raw.partition(":")
    if sep and kind.lower() in ("box", "mask"):
        return _region_target(raw, kind.lower(), rest.strip(), categories)
    if hasattr(categories, "find_token") and not WHOLE.fullmatch(target or raw):
        index = _token_index(target or raw, categories)  # a token's text: spaces count
    elif WHOLE.fullmatch(raw):
        index = int(raw)
    else:
        index = _class_index(raw, categories, option="--target")
    label = categories[index] if categories and 0 <= index < len(categories) else None
    return TargetSpec("index", index=index, label=label)


def _token_index(text: str, tokens: Any) -> int:
    """A --target given as text, for a language model: the one token it is (spaces count:
    " cat" is not "cat")."""
    found = tokens.find_token(text)
    if found is None:
        parts = tokens.encoded(text)
        split = f" (this tokenizer splits it into {len(parts)}: {parts[:8]})" if parts else ""
        raise UsageError(
            f"--target {text!r} is not one token of this model's tokenizer{split}.",
            "give one token exactly as it is decoded (mind its leading space: ' cat'), or a "
            "token id.",
        )
    return int(found)


def _region_target(raw: str, kind: str, rest: str, categories: Sequence[str] | None) -> TargetSpec:
    """box:K (a detection rank) or mask:CLASS (a class index or label)."""
    if kind == "box":
        if not rest.isdigit():
            raise UsageError(
                f"malformed --target {raw!r}: box:K takes a detection rank (0 = the top one).",
                "for example --target box:0",
            )
        return TargetSpec("box", index=int(rest))
    index = _class_index(rest, categories, option="--target mask:")
    label = categories[index] if categories and 0 <= index < len(categories) else None
    return TargetSpec("mask", index=index, label=label)


def _one_class(indices: list[int], raw: str, option: str) -> int:
    """The class a name picks: refused when the model's label list holds the name more than
    once (ImageNet's 'crane': the bird and the machine; 'maillot')."""
    if len(indices) > 1:
        raise UsageError(
            f"{option} {raw!r} names {len(indices)} classes of this model: "
            f"{' and '.join(map(str, indices))}.",
            f"give the class by its index instead: {' or '.join(map(str, indices))}.",
        )
    return indices[0]


def _class_index(raw: str, categories: Sequence[str] | None, option: str) -> int:
    if WHOLE.fullmatch(raw):
        return int(raw)
    if not categories:
        raise UsageError(
            f"{option} {raw!r}: this model has no class labels to look it up in.",
            "give a class index, or top1 / sum.",
        )
    lowered = [(c.lower(), i) for i, c in enumerate(categories)]
    text = raw.lower().strip()
    same = [i for c, i in lowered if c == text]
    if same:
        return _one_class(same, raw, option)
    # "tabby cat" → "tabby": exactly one category name as a whole word inside the text (a
    # name the list holds twice, ImageNet's 'crane', is two classes)
    inside = [i for c, i in lowered if re.search(rf"\b{re.escape(c)}\b", text)]
    if inside and len({categories[i].lower() for i in inside}) == 1:
        return _one_class(inside, raw, option)
    # "cat" → the classes whose names hold the word: the one, or a list to choose from
    word = rf"\b{re.escape(text)}\b"
    holding = [i for c, i in lowered if text and re.search(word, c)]
    if len(holding) == 1:
        return holding[0]
    if holding:
        shown = ", ".join(f"{categories[i]!r} ({i})" for i in holding[:8])
        more = f" and {len(holding) - 8} more" if len(holding) > 8 else ""
        raise UsageError(
            f"{option} {raw!r} names no class exactly; {len(holding)} classes hold the word: "
            f"{shown}{more}.",
            f"give one of them, e.g. {option} {categories[holding[0]]!r}, or its index.",
        )
    close = difflib.get_close_matches(raw, categories, n=3, cutoff=0.5)
    close = close or [c for c in categories if raw.lower() in c.lower()][:3]
    near = f" Close: {', '.join(repr(c) for c in close)}." if close else ""
    raise UsageError(
        f"{option} {raw!r} is not a class of this model.{near}",
        "give a label exactly as in `hookcli inspect` predictions, or a class index.",
    )


def _check_class(index: int, scores: torch.Tensor, option: str) -> None:
    if scores.dim() < 2:
        raise UsageError(
            f"{option} needs class scores of shape (N, classes, …); the output is "
            f"{'x'.join(map(str, scores.shape)) or 'a scalar'}.",
            "use --target sum, or a --loss against a target tensor.",
        )
    if scores.shape[1] == 0:
        raise UsageError(
            f"{option} needs class scores; the model's output has no classes "
            f"({'x'.join(map(str, scores.shape))}).",
            "use --target sum, or a --loss against a target tensor.",
        )
    if not 0 <= index < scores.shape[1]:
        raise UsageError(
            f"class index {index} is out of range: the model has {scores.shape[1]} classes "
            f"(0-{scores.shape[1] - 1}).",
            f"give an index from 0 to {scores.shape[1] - 1}.",
        )


def scalar(
    spec: TargetSpec,
    output: Any,
    seed: int,
    scores_of: Callable[[Any], torch.Tensor] = read_scores,
) -> torch.Tensor:
    """The scalar backward starts from, computed from the model's output (graph kept);
    scores_of reads the class scores (the model's Task says how)."""
    if spec.kind in ("sum", "lm"):
        return (
            _sum(output)
            if spec.kind == "sum"
            else next_token_loss(output, spec.labels, aligned=spec.aligned)
        )
    if spec.kind == "top1":
        scores = scores_of(output)
        _check_class(0, scores, "--target top1")
        flat = scores.flatten(2) if scores.dim() > 2 else scores.unsqueeze(-1)
        # top-1 class per image (per pixel for segmentation), its score summed
        return flat.max(dim=1).values.sum()
    if spec.kind == "index":
        assert spec.index is not None
        scores = scores_of(output)
        _check_class(spec.index, scores, "--target")
        return scores[:, spec.index].sum()
    if spec.kind == "box":
        assert spec.index is not None
        return box_score(output, spec.index)

    if spec.kind == "mask":
        assert spec.index is not None
        scores = scores_of(output)
        _check_class(spec.index, scores, "--target mask:")
        if scores.dim() < 3:
            raise UsageError(
                "--target mask: needs per-pixel scores (N, classes, H, W); the output is "
                f"{'x'.join(map(str, scores.shape))}.",
                "use a segmentation model, or --target with a class index.",
            )
        mask = (scores.argmax(dim=1) == spec.index).to(scores.dtype).detach()
        return (scores[:, spec.index] * mask).sum()
    return _loss(spec, scores_of(output), seed)


def _sum(output: Any) -> torch.Tensor:
    parts = [t.sum() for _, t in iter_tensors(output, "out") if t.is_floating_point()]
    if not parts:
        raise UsageError(
            "the model's output has no floating-point tensor to sum.",
            "use a --loss against a target tensor.",
        )
    return torch.stack(parts).sum()


def next_token_loss(
    output: Any, labels: torch.Tensor | None, *, aligned: bool = False
) -> torch.Tensor:
    """Mean cross-entropy of each real token given the ones before it (in float32 at least,
    as transformers computes its causal-LM loss). `aligned`: labels[:, i] is what
    logits[:, i] predicts (a seq2seq decoder fed its target shifted right), no shift."""
    logits = output.get("logits") if isinstance(output, Mapping) else output
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or labels is None:
        raise UsageError(
            "--target next-token needs a language model's (batch, tokens, vocab) logits and "
            "its input_ids.",
            "give a causal LM text (--text) or token ids, or use --target top1.",
        )
    if tuple(labels.shape) != tuple(logits.shape[:2]):
        raise UsageError(
            f"--target next-token: the logits cover {logits.shape[1]} positions but the input "
            f"has {labels.shape[1]} tokens.",
            "use --target top1, or give the text as input_ids.",
        )
    if aligned:
        flat = logits.reshape(-1, logits.shape[-1])
        flat = flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat
        return F.cross_entropy(flat, labels.to(logits.device).reshape(-1), ignore_index=IGNORE)
    shifted = labels[:, 1:].to(logits.device)
    if not bool((shifted != IGNORE).any()):
        raise UsageError(
            "--target next-token: no token is predicted from another (each sequence holds one "
            "token).",
            "give a longer text, or use --target top1.",
        )
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    return F.cross_entropy(flat, shifted.reshape(-1), ignore_index=IGNORE)


IOU_THRESHOLD = 0.5  # as pytorch-grad-cam's FasterRCNNBoxScoreTarget


def box_score(output: Any, rank: int) -> torch.Tensor:
    """Per image, detection `rank`'s box as the reference: the detection that overlaps it most
    (itself), if its IoU passes the threshold and its label matches, adds IoU + score."""
    from torchvision.ops import box_iou

    if not (
        isinstance(output, list | tuple)
        and output
        and all(isinstance(d, Mapping) and {"boxes", "scores", "labels"} <= set(d) for d in output)
    ):
        raise UsageError(
            "--target box:K needs detections (a list of dicts with boxes, scores and labels).",
            "use it with a detection model, or pick the detections with --output-key.",
        )
    found = [len(d["scores"]) for d in output]
    if all(n <= rank for n in found):
        raise UsageError(
            f"--target box:{rank}: no image has a detection {rank} (detections per image: "
            f"{', '.join(map(str, found))}).",
            "pick a lower rank, or lower the score threshold (--model-arg box_score_thresh=0.0).",
        )
    total: torch.Tensor | None = None
    for det in output:
        if len(det["scores"]) <= rank:
            continue
        boxes, labels = det["boxes"], det["labels"]
        ref = boxes[rank].detach()[None]
        ious = box_iou(ref, boxes)
        best = int(ious.argmax())
        if float(ious[0, best].detach()) > IOU_THRESHOLD and int(labels[best]) == int(labels[rank]):
            score = ious[0, best] + det["scores"][best]
            total = score if total is None else total + score
    assert total is not None  # the reference box overlaps itself (IoU 1)
    return total


def _loss(spec: TargetSpec, scores: torch.Tensor, seed: int) -> torch.Tensor:
    kind = spec.loss
    if kind in ("ce", "nll"):
        assert spec.index is not None
        _check_class(spec.index, scores, f"--loss {kind}")
        target = torch.full(
            (scores.shape[0], *scores.shape[2:]), spec.index, dtype=torch.long, device=scores.device
        )
        return F.cross_entropy(scores, target) if kind == "ce" else F.nll_loss(scores, target)
    assert spec.spec is not None
    target = _target_tensor(spec.spec, scores, seed)
    if kind == "l1":
        return F.l1_loss(scores, target)
    if kind == "mse":
        return F.mse_loss(scores, target)
    if kind == "bcelogits":
        return F.binary_cross_entropy_with_logits(scores, target)
    with torch.no_grad():
        lo, hi = float(scores.min()), float(scores.max())
    if lo < 0 or hi > 1:
        raise UsageError(
            f"--loss bce needs outputs in [0, 1] (probabilities); they span [{lo:.4g}, {hi:.4g}].",
            f"for logits use --loss bcelogits:{spec.spec}",
        )
    return F.binary_cross_entropy(scores, target)


def _target_tensor(raw: str, like: torch.Tensor, seed: int) -> torch.Tensor:
    if raw in ("ones", "zeros"):
        target = torch.ones_like(like) if raw == "ones" else torch.zeros_like(like)
        return target.detach()
    try:
        (target, *rest) = parse_spec(raw, seed)
    except UsageError as exc:  # (a malformed spec's words say --input: here it is --loss's)
        if not exc.message.startswith("malformed"):
            raise  # (a file's own problem, and its own next step)
        raise UsageError(
            f"--loss target {raw!r}: {exc.message.replace('--input ', '')}",
            "give ones, zeros, KIND:SHAPE (randn:1x10) or a .pt/.npy file: --loss mse:ones.",
        ) from exc
    if rest:
        raise UsageError(f"loss target {raw} holds {len(rest) + 1} tensors.", "save one tensor.")
    if tuple(target.shape) != tuple(like.shape):
        want = "x".join(map(str, like.shape)) or "a scalar"
        got = "x".join(map(str, target.shape)) or "a scalar"
        raise UsageError(
            f"loss target {raw} has shape {got} but the output has shape {want}.",
            f"give a target of shape {want}, e.g. ones:{want} (or just `ones`).",
        )
    return target.to(device=like.device, dtype=like.dtype)
