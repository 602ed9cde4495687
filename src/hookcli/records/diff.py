"""`hookcli diff`: two sides of one model compared layer call by layer call."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hookcli.records.core import SCHEMA_VERSION, InputInfo, ModelInfo
from hookcli.records.report import Viewed, plural, shortened


@dataclass(slots=True)
class TensorDiff:
    """One tensor of one layer call on a compared side against the reference side. `nonfinite`
    counts the elements not finite on either side; when there are any, every metric is null
    (nothing is measured over what is left) and `note` says why, when it can be told (an
    overflow past the compared dtype's range, NaN/Inf already on the reference side).
    `rel_l2` = ‖b - a‖ / ‖a‖, `cosine` = a·b / (‖a‖‖b‖), `sqnr_db` = 10·log10(‖a‖² /
    ‖b - a‖²) (null when identical), `norm_rel` = (‖b‖ - ‖a‖) / ‖a‖, signed: below 0 when
    side b shrinks the tensor (all a report-vs-report diff can tell). `own_rel_l2`: the
    relative L2 of this tensor when the layer is fed the reference side's input (its own
    error; null when not measured)."""

    path: str
    shape: tuple[int, ...]
    numel: int
    max_abs: float | None = None
    rel_l2: float | None = None
    cosine: float | None = None
    sqnr_db: float | None = None
    norm_rel: float | None = None
    nonfinite: int = 0
    over: bool = False
    note: str | None = None
    own_rel_l2: float | None = None
    # the model's (batch, tokens, vocab) output: the relative L2 of each sequence's each
    # position over the vocabulary ([sequence][position]; null where the reference is zero)
    per_position: list[list[float | None]] | None = None


@dataclass(slots=True)
class DiffCall:
    """One layer call: side B against the reference (side A, or --ref), and with --ref side A
    against it too. `type` is the reference side's module type, `type_b` side B's when it
    differs (ConvReLU2d / QuantizedConvReLU2d); `fused_into` names the module an Identity left
    by conv+bn+relu fusion was fused into (its row compares nothing)."""

    name: str
    type: str
    call: int
    b: list[TensorDiff] = field(default_factory=list)
    a: list[TensorDiff] | None = None
    type_b: str | None = None
    fused_into: str | None = None


@dataclass(slots=True)
class TokenDistances:
    """diff over a text corpus (issue 53): side B's next-token distributions against the
    reference's (side A), over every position that predicts a next token of its text
    (commands/diff/tokens.py has the formulas, llama.cpp's `--kl-divergence` ones). `kld`
    and `kld_reverse`: KL(A‖B) and KL(B‖A) in nats — mean, stderr, max, p99.9 … p1;
    `same_top1`: the fraction of positions whose most probable token is the same; `delta_p`:
    p_B - p_A of the actual next token — rms, p99 … p1; `ppl_a`, `ppl_b`, their ratio B/A
    and `ln_ppl_corr`, the correlation of the sides' -ln p(next); `worst`: the positions of
    largest KL(A‖B) (sequence, position in its text, next token id and text, kld);
    `nonfinite`: positions left out, their distribution not finite on a side."""

    count: int
    kld: dict[str, float | None]
    kld_reverse: dict[str, float | None]
    same_top1: float | None
    delta_p: dict[str, float | None]
    ppl_a: float | None
    ppl_b: float | None
    ppl_ratio: float | None
    ln_ppl_corr: float | None
    worst: list[dict[str, Any]] = field(default_factory=list)
    nonfinite: int = 0


@dataclass(slots=True)
class WeightDistance:
    """One layer's weight on side B against the reference's (issue 53): `sqnr_db` =
    10 log10(Σa² / Σ(a-b)²) in float64 over the dense (dequantized) weights, None where the
    reference's weight is all zeros or a side's holds NaN/Inf (then `rel_l2` is None too);
    `rel_l2` = ‖a-b‖ / ‖a‖; `numel`: its elements."""

    layer: str
    type: str  # the reference's module class
    sqnr_db: float | None
    rel_l2: float | None
    numel: int
    type_b: str | None = None  # side B's, where another (Linear4bit, Linear8bitLt …)


@dataclass(slots=True, repr=False)
class DiffReport(Viewed):
    model: ModelInfo
    input: InputInfo
    device: str
    a: str  # the sides, as described
    b: str
    ref: str | None  # --ref: the side both are measured against; None: side A is
    isolate: bool  # each layer fed the reference side's input: its own error only
    tol: float
    calls: list[DiffCall]
    tol_source: str = ""  # "--tol", or the default's reason (the sides' precision)
    sort: str = "order"  # the calls' order: order (returned), error, own (largest first)
    outputs: list[DiffCall] = field(default_factory=list)  # the model's return value
    first_over: str | None = None  # the first call (in return order) past --tol
    # per compared side ("B", and "A" with --ref): top-1 flips and top-k overlap of the class
    # scores against the reference; None when the model's output is not class scores
    agreement: dict[str, dict[str, Any]] | None = None
    largest_own: list[dict[str, Any]] = field(default_factory=list)  # the top own errors
    missing: list[str] = field(default_factory=list)  # calls on one side only
    notes: list[str] = field(default_factory=list)
    command: str = "diff"
    schema: int = SCHEMA_VERSION
    # the dtype each side ran in, by its label (A, B, and ref with --ref): its parameters',
    # under autocast where it asks (commands.diff.sides.ran_in); empty in a saved-report diff
    ran: dict[str, str] = field(default_factory=dict)
    hookcli_version: str = ""
    # a causal LM's text: side B's next-token distributions against the reference's
    tokens: TokenDistances | None = None
    # --max-kld and --min-same-top1 as given, and each one the tokens broke (exit 1)
    token_rules: dict[str, float] = field(default_factory=dict)
    token_failures: list[str] = field(default_factory=list)
    # each layer whose weight differs between the sides, lowest SQNR first
    weights: list[WeightDistance] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.first_over is not None or bool(self.token_failures)

    def _calls(self) -> list[DiffCall]:
        return [*self.calls, *self.outputs]

    def side(self, label: str) -> str:
        """A side ("A", "B" or "ref") as given, and the dtype it ran in where that is not what
        it says: `as loaded (bfloat16)`."""
        described = {"A": self.a, "B": self.b}.get(label, self.ref) or ""
        ran = self.ran.get(label)
        return described if ran is None or ran == described else f"{described} ({ran})"

    def _summary(self) -> str:
        verdict = (
            f"first past tol {self.tol:g}: {shortened(self.first_over)}"
            if self.first_over
            else f"every call within tol {self.tol:g}"
        )
        sides = f"{shortened(self.side('A'), 60)} vs {shortened(self.side('B'), 60)}"
        body = f"{sides}, {len(self.calls)} layer calls, {verdict}"
        if self.notes:
            body += f"; {plural(len(self.notes), 'note')}"
        return f"<DiffReport {shortened(self.model.spec, 80)} on {self.device}: {body}>"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        ordered: dict[str, Any] = {"schema": data.pop("schema")}
        ordered.update(data)
        return ordered
