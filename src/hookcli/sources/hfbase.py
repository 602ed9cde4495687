"""What every Hugging Face source shares: transformers imported on use (the `hf` extra named
when it is missing), its own log held back, a saved folder's JSON files read safely, and the
tasks of HF classifiers (logits in a ModelOutput)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hookcli.errors import UsageError, one_line
from hookcli.records import Prediction
from hookcli.sources.base import import_extra, quiet_warnings
from hookcli.sources.tasks import Classification, Forward, Row, Task

TEXT_LENGTH = 16  # tokens in the default random input of a text model


def transformers_module() -> Any:
    tf = import_extra("transformers", "hf", "hf: models")
    with contextlib.suppress(AttributeError):  # "Loading checkpoint shards" never drawn raw
        tf.utils.logging.disable_progress_bar()
    return tf


@contextlib.contextmanager
def quiet_transformers(tf: Any) -> Iterator[None]:
    """transformers' own log (its multi-line LOAD REPORT with raw escape codes) held back
    while a model or tokenizer loads: what matters is said in hookcli's words."""
    log = tf.utils.logging
    level = log.get_verbosity()
    log.set_verbosity_error()
    try:
        with quiet_warnings():
            yield
    finally:
        log.set_verbosity(level)


def logits_of(output: Any) -> Any:
    """`logits` of a ModelOutput (or a dict holding it); other outputs as they are."""
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    return output


class HFVision(Classification):
    """An HF image classifier: pixel_values in, ModelOutput(logits) out."""

    name = "classification"

    def predict(self, output: Any, topk: int, row: Row) -> tuple[list[Prediction], str] | None:
        return super().predict(logits_of(output), topk, row)

    def scores(self, output: Any) -> torch.Tensor:
        return super().scores(logits_of(output))


class HFText(HFVision):
    """An HF sequence classifier: input_ids (+ attention_mask) in, logits out."""

    name = "text-classification"
    item = "sequence"
    takes_images = False

    def __init__(self, vocab_size: int, eos: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos = eos  # ends the default sequence: BART-like heads classify at the last <eos>

    def spec_inputs(
        self, tensors: Sequence[torch.Tensor], named: Mapping[str, torch.Tensor]
    ) -> Forward:
        kwargs = dict(named)
        args = list(tensors)
        if args and "input_ids" not in kwargs and not args[0].is_floating_point():
            kwargs["input_ids"] = args.pop(0)
        ids = kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and "attention_mask" not in kwargs and not args:
            kwargs["attention_mask"] = torch.ones_like(ids)
            return tuple(args), kwargs, " (as input_ids, attention_mask all ones)"
        return tuple(args), kwargs, ""

    def default_input(self, size: tuple[int, int], gen: torch.Generator, seed: int) -> Forward:
        ids = torch.randint(0, self.vocab_size, (1, TEXT_LENGTH), generator=gen)
        ended = ""
        if self.eos is not None and 0 <= self.eos < self.vocab_size:
            ids[ids == self.eos] = (self.eos + 1) % self.vocab_size  # one <eos>, at the end
            ids[:, -1] = self.eos
            ended = f", the last one <eos> ({self.eos})"
        return (
            (),
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
            f"no input given: input_ids randint:0:{self.vocab_size}:1x{TEXT_LENGTH}{ended}, "
            f"attention_mask all ones (seed {seed})",
        )


class HFOther(Task):
    """An HF model with no classification head: its outputs are reported, not predicted."""

    name = "hf"
    item = "input"

    def scores(self, output: Any) -> torch.Tensor:
        out = logits_of(output)
        if isinstance(out, torch.Tensor):
            return out
        return super().scores(out)


MAX_JSON = 16 << 20  # a config or preprocessor file larger than this is not one


def json_file(spec: str, path: Path) -> dict[str, Any] | None:
    """A folder's JSON file as a dict (None when absent); anything else is a UsageError."""
    from hookcli.io.output import note_read

    if not path.exists():
        return None
    note_read(path)
    try:
        if not path.is_file() or path.stat().st_size > MAX_JSON:
            raise ValueError("not a regular file of at most 16 MB")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise UsageError(
            f"{spec}: {path.name} is not a readable JSON file ({one_line(exc)}).",
            f"fix or regenerate {path.name} (save_pretrained writes it).",
        ) from exc
    if not isinstance(data, dict):
        raise UsageError(
            f"{spec}: {path.name} holds a {type(data).__name__}, not a JSON object.",
            f"fix or regenerate {path.name} (save_pretrained writes it).",
        )
    return data
