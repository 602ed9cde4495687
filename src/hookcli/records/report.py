"""A layers report (inspect, grads, check, a folder run, replay) and what a report does in a
notebook or at a prompt (Viewed: its table, HTML view and DataFrame, through hookcli._views)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hookcli._views import views as _views
from hookcli.records.core import (
    SCHEMA_VERSION,
    Ablation,
    Backward,
    CheckResult,
    Generated,
    ImageNonfinite,
    InputInfo,
    LayerCall,
    Memory,
    ModelInfo,
    Origin,
    Prediction,
    Profile,
    TensorStats,
)
from hookcli.records.llm import ExpertStats, HeadStats, Outliers, Rendered
from hookcli.records.meta import ABSENT


def plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def shortened(text: str, most: int = 120) -> str:
    return text if len(text) <= most else text[: most - 1] + "…"


class Viewed:
    """What a report does in a notebook: a short repr, `report["layer"]`, the CLI's table
    (`table()`, and `print(report)`), an HTML view (`_repr_html_`) and `to_pandas()`."""

    __slots__ = ()

    def _calls(self) -> list[Any]:
        raise NotImplementedError

    def _summary(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self._summary()[:2000]

    def __str__(self) -> str:
        return self.table()

    __iter__ = None  # not a sequence: `report[name]` looks a layer up; iterate `.layers`

    def _named(self, name: str) -> list[Any]:
        """The calls of the layer named `name` (its dotted name, or an alias)."""
        return [c for c in self._calls() if c.name == name or name in getattr(c, "aliases", ())]

    def __contains__(self, name: object) -> bool:
        """Whether a layer of that name (or alias) has a call in this report."""
        return isinstance(name, str) and bool(self._named(name))

    def __getitem__(self, name: str) -> list[Any]:
        """The calls of the layer named `name` (its dotted name, or an alias it was called
        by), in call order. KeyError, naming the nearest names, when it has none here."""
        if not isinstance(name, str):
            raise TypeError(f"a report is indexed by layer name, not {type(name).__name__}")
        calls = self._named(name)
        if not calls:
            import difflib

            names = list(dict.fromkeys(c.name for c in self._calls()))
            near = difflib.get_close_matches(name, names, n=3)
            hint = f"; nearest: {', '.join(near)}" if near else ""
            raise KeyError(f"no call of a layer named {name!r} in this report{hint}")
        return calls

    def table(self, *, color: bool = False, width: int | None = None) -> Rendered:
        """The table the CLI prints (`width`: characters; None: 200)."""
        return Rendered(_views().table(self, color=color, width=width))

    def _repr_html_(self) -> str:
        return str(_views().html(self))

    def to_pandas(self) -> Any:
        """One row per measured tensor, as a pandas DataFrame (hookcli[pandas]); the same rows
        and columns as `-f csv` and `-o FILE.parquet`."""
        return _views().frame(self)


@dataclass(slots=True, repr=False)
class Report(Viewed):
    model: ModelInfo
    input: InputInfo
    device: str = field(metadata={ABSENT: "unknown"})  # a saved report may leave it out
    layers: list[LayerCall]
    never_called: list[str] = field(default_factory=list)
    outputs: list[TensorStats] = field(default_factory=list)
    predictions: list[Prediction] | None = None
    prediction_note: str | None = None
    generated: list[Generated] | None = None  # --generate: each sequence's new tokens
    checks: list[CheckResult] = field(default_factory=list)
    outliers: Outliers | None = None  # --channels: massive activations, outlier features
    heads: list[HeadStats] | None = None  # --heads: every attention call's heads
    experts: list[ExpertStats] | None = None  # a MoE model's routing, router by router
    notes: list[str] = field(default_factory=list)
    nonfinite_origins: list[Origin] = field(default_factory=list)
    # the images whose input or output held NaN/Inf (a batch or folder: which image)
    nonfinite_images: list[ImageNonfinite] = field(default_factory=list)
    backward: Backward | None = None
    input_grads: list[TensorStats] | None = None
    ablation: Ablation | None = None
    profile: Profile | None = None
    memory: Memory | None = None  # --memory
    interrupted: bool = False
    config: str | None = None
    command: str = "inspect"
    schema: int = SCHEMA_VERSION
    hookcli_version: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: plain types only, NaN never appears (None instead)."""
        data = dataclasses.asdict(self)
        ordered: dict[str, Any] = {"schema": data.pop("schema")}
        ordered.update(data)
        return ordered

    def _calls(self) -> list[LayerCall]:
        return self.layers

    def _summary(self) -> str:
        tensors = [t for c in self.layers for t in (*c.inputs, *c.outputs)]
        tensors += [
            t for c in self.layers for t in (*(c.grad_inputs or []), *(c.grad_outputs or []))
        ]
        bad = sum(t.nonfinite for t in (*tensors, *self.outputs))
        named = len({c.name for c in self.layers})
        parts = [
            f"input {shortened(self.input.description, 80)}",
            f"{len(self.layers)} layer calls of {named} layers",
        ]
        if self.never_called:
            parts.append(f"{len(self.never_called)} never called")
        if bad:
            first = self.nonfinite_origins[0].describe() if self.nonfinite_origins else ""
            parts.append(f"NaN/Inf in {bad} tensors" + (f" ({shortened(first)})" if first else ""))
        else:
            parts.append("no NaN/Inf")
        if self.checks:
            failed = [c.rule for c in self.checks if not c.passed]
            parts.append(
                f"checks: {len(failed)} failed ({', '.join(failed)})" if failed else "checks passed"
            )
        if self.predictions:
            top = self.predictions[0]
            label = top.label if top.label is not None else f"class {top.index}"
            prob = f" {top.prob:.3g}" if top.prob is not None else ""
            parts.append(f"top-1 {shortened(label, 40)}{prob}")
        if self.notes:
            parts.append(plural(len(self.notes), "note"))
        body = "; ".join(parts)
        return f"<Report {self.command} {shortened(self.model.spec, 80)} on {self.device}: {body}>"
