"""`hookcli lens`: each block's top tokens at every real position (the logit lens)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hookcli.records.core import InputInfo, ModelInfo
from hookcli.records.llm import LensViewed


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
