"""Rules evaluated on a finished Report, and baseline comparison. Numbers only: no torch,
no re-run — checks cost nothing beyond the hooked pass itself.

Rules: `nonfinite` (NaN/Inf anywhere), `dead` (a ReLU-family output whose zero fraction is at
least --dead-frac), `--max-abs X` (activation magnitude), `--min-std X` (collapsed activations),
`--grad-norm MIN:MAX` (vanishing or exploding gradients), `--expect-shape LAYER=1x64x112x112`,
--channels' rules (`massive` activations, `--max-outlier-ratio R`, `--max-kurtosis K`; a
position table's calls — rotary cos/sin, learned or sinusoidal position embeddings — are not
activations and are left out of these, saying so, unless named with -l),
and `--baseline FILE` (drift of any recorded statistic beyond rtol/atol, or layers that
appeared or vanished: commands/baseline.py). Each failure is an object (where, the value, the
limit, one line); a rule that can tell names the first failure in the order the hooks saw the
calls.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from hookcli import bounds
from hookcli.commands.baseline import compare_baseline, load_baseline, number_text
from hookcli.errors import UsageError
from hookcli.options import RuleOptions
from hookcli.records import CheckResult, Failure, LayerCall, Report, TensorStats
from hookcli.text import few

FAIL_ON = ("nonfinite", "dead", "massive", "dead-experts")
RELU_FAMILY = {
    "ReLU", "ReLU6", "LeakyReLU", "PReLU", "RReLU", "ELU", "CELU", "SELU", "GELU", "SiLU",
    "Hardswish", "Hardtanh", "Mish", "Softplus", "Threshold",
}  # fmt: skip


_ASKED = RuleOptions()


@dataclass(slots=True)
class Rules:
    """The rules validated (parse_rules): ranges parsed, shapes split, the baseline read."""

    fail_on: list[str] = field(default_factory=list)
    dead_frac: float = _ASKED.dead_frac
    max_abs: float | None = None
    min_std: float | None = None
    grad_norm: tuple[float | None, float | None] | None = None
    max_outlier_ratio: float | None = None
    max_kurtosis: float | None = None
    max_sink: float | None = None
    min_entropy: float | None = None
    max_expert_imbalance: float | None = None
    max_saved_mb: float | None = None
    expect_shapes: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    baseline: Report | None = None
    baseline_path: str | None = None
    rtol: float = _ASKED.rtol
    atol: float = _ASKED.atol
    backward: bool = False  # check --backward: gradients are measured (and checked) too
    # the layers the user named (-l NAME, no glob): a position table named is held to the
    # per-channel rules like any other layer
    named: tuple[str, ...] = ()

    @property
    def needs_backward(self) -> bool:
        """check runs backward: asked for (--backward), or a gradient rule needs it."""
        return self.backward or self.grad_norm is not None or self.max_saved_mb is not None

    @property
    def needs_channels(self) -> bool:
        """A rule reads per-channel statistics: the run measures them (--channels)."""
        return (
            "massive" in self.fail_on
            or self.max_outlier_ratio is not None
            or self.max_kurtosis is not None
        )

    @property
    def needs_heads(self) -> bool:
        """A rule reads attention heads: the run reads them (--heads)."""
        return self.max_sink is not None or self.min_entropy is not None

    @property
    def any(self) -> bool:
        return bool(
            self.needs_channels
            or self.needs_heads
            or self.max_expert_imbalance is not None
            or self.max_saved_mb is not None
            or self.fail_on
            or self.max_abs is not None
            or self.min_std is not None
            or self.grad_norm
            or self.expect_shapes
            or self.baseline is not None
        )


def parse_rules(options: RuleOptions = RuleOptions()) -> Rules:
    """The rules asked for, validated (one-line errors naming the option)."""
    dead_frac = bounds.number(
        options.dead_frac, "--dead-frac", low=0, high=1, low_open=True, example="--dead-frac 0.99"
    )
    max_abs = options.max_abs
    if max_abs is not None:
        max_abs = bounds.number(max_abs, "--max-abs", low=0, low_open=True, example="--max-abs 1e4")
    min_std = options.min_std
    if min_std is not None:
        min_std = bounds.number(
            min_std, "--min-std", low=0, low_open=True, example="--min-std 1e-6"
        )
    ratio, kurtosis = options.max_outlier_ratio, options.max_kurtosis
    if ratio is not None:
        ratio = bounds.number(ratio, "--max-outlier-ratio", low=1, example="--max-outlier-ratio 20")
    if kurtosis is not None:
        kurtosis = bounds.number(kurtosis, "--max-kurtosis", low=0, example="--max-kurtosis 50")
    max_sink, min_entropy = options.max_sink, options.min_entropy
    if max_sink is not None:
        max_sink = bounds.number(max_sink, "--max-sink", low=0, high=1, example="--max-sink 0.95")
    if min_entropy is not None:
        min_entropy = bounds.number(
            min_entropy, "--min-entropy", low=0, example="--min-entropy 0.1"
        )
    imbalance = options.max_expert_imbalance
    if imbalance is not None:
        imbalance = bounds.number(
            imbalance, "--max-expert-imbalance", low=1, example="--max-expert-imbalance 4"
        )
    saved_mb = options.max_saved_mb
    if saved_mb is not None:
        saved_mb = bounds.number(
            saved_mb, "--max-saved-mb", low=0, low_open=True, example="--max-saved-mb 500"
        )
    rtol = bounds.number(options.rtol, "--rtol", example="--rtol 1e-3")
    atol = bounds.number(options.atol, "--atol", example="--atol 1e-6")
    if rtol < 0 or atol < 0:
        raise UsageError(
            f"--rtol and --atol must be 0 or more (got {rtol:g}, {atol:g}).",
            "e.g. --rtol 1e-3 --atol 1e-6",
        )
    rules = Rules(
        dead_frac=dead_frac,
        max_abs=max_abs,
        min_std=min_std,
        max_outlier_ratio=ratio,
        max_kurtosis=kurtosis,
        max_sink=max_sink,
        min_entropy=min_entropy,
        max_expert_imbalance=imbalance,
        max_saved_mb=saved_mb,
        rtol=rtol,
        atol=atol,
        backward=options.backward,
    )
    for rule in options.fail_on:
        if rule not in FAIL_ON:
            raise UsageError(
                f"unknown --fail-on rule {rule!r}.", f"use one of: {', '.join(FAIL_ON)}."
            )
        if rule not in rules.fail_on:
            rules.fail_on.append(rule)
    if options.grad_norm is not None:
        rules.grad_norm = _parse_range(options.grad_norm)
    for raw in options.expect_shape:
        layer, sep, dims = raw.partition("=")
        if not sep or not layer.strip() or not re.fullmatch(r"\d+(x\d+)*", dims.strip()):
            raise UsageError(
                f"malformed --expect-shape {raw!r}: expected LAYER=SHAPE.",
                "for example --expect-shape conv1=1x64x112x112",
            )
        rules.expect_shapes.append((layer.strip(), tuple(int(d) for d in dims.strip().split("x"))))
    if options.baseline is not None:
        rules.baseline = load_baseline(options.baseline)
        rules.baseline_path = str(options.baseline)
    return rules


def for_check(rules: Rules) -> Rules:
    """`check`'s rules: with none given, --fail-on nonfinite."""
    if rules.any:
        return rules
    return dataclasses.replace(rules, fail_on=["nonfinite"])


def failures(report: Report) -> list[CheckResult]:
    """The rules the report failed."""
    return [c for c in report.checks if not c.passed]


def exit_code(report: Report) -> int:
    """The exit code a finished run ends with (the CLI's, and `hookcli.exit_code`):
    130 when a folder run was interrupted (partial results), 1 when a check failed, else 0."""
    if report.interrupted:
        return 130
    return 1 if failures(report) else 0


def passed(report: Report) -> bool:
    """Every check passed and the run was whole: exit code 0."""
    return exit_code(report) == 0


def _parse_range(raw: str) -> tuple[float | None, float | None]:
    if not isinstance(raw, str) or raw.count(":") != 1:
        raise UsageError(
            f"malformed --grad-norm {raw!r}: expected MIN:MAX (either may be empty).",
            "for example --grad-norm 1e-8:1e3 or --grad-norm :100",
        )
    lo_s, _, hi_s = raw.partition(":")
    example = "--grad-norm 1e-8:1e3"
    # norms are 0 or more; an infinite bound is no bound (allowed: inf means "no maximum")
    lo = bounds.number(lo_s, "--grad-norm MIN", low=0, example=example) if lo_s.strip() else None
    hi = (
        bounds.number(hi_s, "--grad-norm MAX", low=0, infinite=True, example=example)
        if hi_s.strip()
        else None
    )
    if (lo is None and hi is None) or (lo is not None and hi is not None and lo > hi):
        raise UsageError(
            f"--grad-norm {raw!r} is an empty range.", "for example --grad-norm 1e-8:1e3"
        )
    return lo, hi


Where = tuple[str | None, int | None, str]  # layer, call, the tensor's path (kind and path)


def _all_tensors(report: Report) -> Iterator[tuple[Where, TensorStats]]:
    for c in report.layers:
        for kind, tensors in (
            ("", c.inputs),
            ("", c.outputs),
            ("grad_input ", c.grad_inputs),
            ("grad_output ", c.grad_outputs),
        ):
            for t in tensors or []:
                yield (c.name, c.call, f"{kind}{t.path}"), t
        for p in c.params or []:
            if p.grad is not None:
                yield (c.name, c.call, f"{p.name}.grad"), p.grad
    for t in report.outputs:
        yield (None, None, f"model output {t.path}"), t
    for t in report.input_grads or []:
        yield (None, None, f"input gradient {t.path}"), t


def _failure(
    where: Where, text: str, value: float | str | None, limit: float | str | None
) -> Failure:
    layer, call, path = where
    place = path if layer is None else f"{layer} call {call} {path}"
    return Failure(f"{place}: {text}", layer, call, path, value, limit)


def _first(bad: list[tuple[LayerCall, Failure]], backward: bool) -> Failure | None:
    """The failure a reader should look at first: in the order the calls returned (a child
    before its container), or for gradients the order they arrived (nearest the loss first)."""

    def order(item: tuple[LayerCall, Failure]) -> int:
        c = item[0]
        n = c.backward_order if backward else c.forward_order
        return n if n is not None else 1 << 30

    ranked = sorted(bad, key=order)  # stable: ties keep the report's order
    return ranked[0][1] if ranked else None


def evaluate(report: Report, rules: Rules) -> list[CheckResult]:
    results = []
    if "nonfinite" in rules.fail_on:
        results.append(_nonfinite(report))
    if "dead" in rules.fail_on:
        results.append(_dead(report, rules.dead_frac))
    if rules.max_abs is not None:
        results.append(_max_abs(report, rules.max_abs))
    if rules.min_std is not None:
        results.append(_min_std(report, rules.min_std))
    if rules.grad_norm is not None:
        results.append(_grad_norm(report, *rules.grad_norm))
    if "massive" in rules.fail_on:
        results.append(_massive(report, rules))
    if rules.max_outlier_ratio is not None:
        results.append(_per_tensor(report, rules, "outlier-ratio", rules.max_outlier_ratio))
    if rules.max_kurtosis is not None:
        results.append(_per_tensor(report, rules, "kurtosis", rules.max_kurtosis))
    if rules.max_sink is not None:
        results.append(_heads(report, "sink", rules.max_sink))
    if rules.min_entropy is not None:
        results.append(_heads(report, "entropy", rules.min_entropy))
    if "dead-experts" in rules.fail_on:
        results.append(_experts(report, None))
    if rules.max_expert_imbalance is not None:
        results.append(_experts(report, rules.max_expert_imbalance))
    if rules.max_saved_mb is not None:
        results.append(_saved(report, rules.max_saved_mb))
    for layer, shape in rules.expect_shapes:
        results.append(_expect_shape(report, layer, shape))
    if rules.baseline is not None:
        results.append(
            compare_baseline(
                report, rules.baseline, rules.rtol, rules.atol, rules.baseline_path or "baseline"
            )
        )
    return results


# Modules whose outputs are tables of positions, not activations (issue 48): rotary cos/sin
# (transformers' *RotaryEmbedding, its `rotary_emb`), learned and sinusoidal position
# embeddings, T5's relative position bias. Their per-channel shape is the table's: a rule on
# outliers or kurtosis would fail first on them.
POSITION_TYPES = ("RotaryEmbedding", "PositionalEmbedding", "PositionEmbedding",
                  "PositionEmbeddings", "RotaryEmbedding1D")  # fmt: skip
POSITION_LEAVES = ("rotary_emb", "rotary_embedding", "rotary_pos_emb", "embed_positions",
                   "wpe", "position_embeddings", "relative_attention_bias")  # fmt: skip


def is_position_table(name: str, type_: str) -> bool:
    """Whether a module is a position table (its class name or its attribute name says so)."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf in POSITION_LEAVES or type_.endswith(POSITION_TYPES)


def _channel_tensors(
    report: Report, rules: Rules | None = None, left_out: list[str] | None = None
) -> Iterator[tuple[LayerCall, TensorStats]]:
    """Each selected call's tensors measured per channel; with `rules`, a position table's
    calls left out (their names put in `left_out`) unless the user named the layer."""
    named = set(rules.named) if rules is not None else set()
    for c in report.layers:
        if rules is not None and c.name not in named and is_position_table(c.name, c.type):
            if (
                left_out is not None
                and c.name not in left_out
                and any(t.channels is not None for t in (*c.inputs, *c.outputs))
            ):
                left_out.append(c.name)
            continue
        for t in (*c.inputs, *c.outputs):
            if t.channels is not None:
                yield c, t


def _unchecked(rule: str, report: Report, note: str) -> CheckResult:
    """A per-channel rule that found no tensor to hold to it fails: a gate that checked
    nothing is no pass (a sharded run's merged rows keep no per-channel numbers)."""
    merged = any(
        "per-channel numbers" in (t.note or "")
        for c in report.layers
        for t in (*c.inputs, *c.outputs)
    )
    why = (
        ": every row was merged over the ranks, and a rank's per-channel numbers do not "
        "merge — run the check on the unsharded model"
        if merged
        else ""
        if note  # (the position tables left out: the note names them)
        else ": no selected layer's input or output has a channel dimension to measure"
    )
    return CheckResult(rule, False, f"nothing measured per channel{why}{note}")


def _tables_note(left_out: list[str]) -> str:
    """The position tables a per-channel rule left out, for its message."""
    if not left_out:
        return ""
    shown = ", ".join(left_out[:3]) + (
        f" and {len(left_out) - 3} more" if len(left_out) > 3 else ""
    )
    return (
        f"; position tables left out (not activations): {shown} — "
        "name one with -l to hold it to the rule"
    )


def _massive(report: Report, rules: Rules) -> CheckResult:
    """--fail-on massive: every massive activation of a selected call's inputs and outputs,
    each naming its layer, call, channel and (tokens) position."""
    checked = 0
    bad: list[tuple[LayerCall, Failure]] = []
    left_out: list[str] = []
    for c, t in _channel_tensors(report, rules, left_out):
        checked += 1
        ch = t.channels
        assert ch is not None
        for m in ch.massive:
            where = (
                f"sequence {m.sequence} position {m.position}"
                if m.position is not None
                else "index " + "x".join(str(i) for i in m.index)
            )
            times = f" ({m.ratio:.3g}x the median |x|)" if m.ratio is not None else ""
            value = number_text(m.value)
            text = f"massive activation {value} at channel {m.channel}, {where}{times}"
            failure = _failure((c.name, c.call, t.path), text, m.value, None)
            failure.channel, failure.position = m.channel, m.position
            bad.append((c, failure))
    note = _tables_note(left_out)
    if not checked:
        return _unchecked("massive", report, note)
    if not bad:
        return CheckResult(
            "massive",
            True,
            f"no massive activation in {checked} tensors measured per channel{note}",
        )
    return _failed("massive", f"{len(bad)} massive activations in {checked} tensors{note}", bad)


def _per_tensor(report: Report, rules: Rules, rule: str, limit: float) -> CheckResult:
    """--max-outlier-ratio / --max-kurtosis: each tensor measured per channel against the
    limit; an outlier-ratio failure names the worst channel."""
    checked = 0
    bad: list[tuple[LayerCall, Failure]] = []
    left_out: list[str] = []
    unusable = 0  # measured per channel, with no value for the rule (NaN/Inf, constant)
    for c, t in _channel_tensors(report, rules, left_out):
        ch = t.channels
        assert ch is not None
        value = ch.outlier_ratio if rule == "outlier-ratio" else ch.kurtosis
        if value is None:
            unusable += 1
            continue
        checked += 1
        if value > limit:
            where = (c.name, c.call, t.path)
            if rule == "outlier-ratio":
                worst = max(range(len(ch.absmax)), key=lambda k: ch.absmax[k] or 0.0)
                text = f"channel {worst}'s max|x| is {value:.4g}x the median channel's"
                failure = _failure(where, text, value, limit)
                failure.channel = worst
            else:
                failure = _failure(where, f"kurtosis {value:.4g}", value, limit)
            bad.append((c, failure))
    what = "outlier ratio" if rule == "outlier-ratio" else "kurtosis"
    note = _tables_note(left_out)
    if not checked and unusable:
        return CheckResult(
            rule,
            False,
            f"nothing to check: the {unusable} tensors measured per channel have no {what} "
            f"(their values NaN/Inf or constant){note}",
        )
    if not checked:
        return _unchecked(rule, report, note)
    if not bad:
        return CheckResult(rule, True, f"no {what} above {limit:g} ({checked} tensors){note}")
    return _failed(rule, f"{len(bad)} of {checked} tensors with {what} above {limit:g}{note}", bad)


def _experts(report: Report, limit: float | None) -> CheckResult:
    """--fail-on dead-experts (limit None): a router's expert no token reached;
    --max-expert-imbalance: a router whose busiest expert takes more than `limit` x the mean."""
    routers = report.experts or []
    rule = "dead-experts" if limit is None else "expert-imbalance"
    bad = []
    for e in routers:
        if limit is None and e.dead:
            text = f"{len(e.dead)} of {e.experts} experts got no token: {e.dead[:8]}"
            f = Failure(f"{e.layer}: {text}", e.layer, 0, None, len(e.dead), 0)
            f.channel = e.dead[0]
            bad.append(f)
        elif limit is not None and e.imbalance is not None and e.imbalance > limit:
            busiest = max(range(e.experts), key=lambda k: e.counts[k])
            text = f"expert {busiest} takes {e.imbalance:.3g}x the mean load"
            f = Failure(f"{e.layer}: {text}", e.layer, 0, None, e.imbalance, limit)
            f.channel = busiest
            bad.append(f)
    if not routers:  # (a gate that checked nothing is no pass)
        return CheckResult(
            rule,
            False,
            "no MoE router was read, so the rule checked nothing (not a mixture-of-experts "
            "model, or a router hookcli does not know: see the notes)",
        )
    if not bad:
        what = "dead expert" if limit is None else f"imbalance above {limit:g}"
        return CheckResult(rule, True, f"no {what} ({len(routers)} routers)")
    what = "with a dead expert" if limit is None else f"with imbalance above {limit:g}"
    return CheckResult(rule, False, f"{len(bad)} of {len(routers)} routers {what}", bad, bad[0])


def _saved(report: Report, limit_mb: float) -> CheckResult:
    """--max-saved-mb: what autograd saved for backward in the step (each storage once), in
    10^6 bytes; a failure names the calls that saved most."""
    memory = report.memory
    if memory is None or memory.saved_bytes is None:
        return CheckResult("saved-mb", False, "nothing measured: the run had no backward")
    mb = memory.saved_bytes / 1e6
    if mb <= limit_mb:
        return CheckResult("saved-mb", True, f"{mb:.4g} MB saved for backward (limit {limit_mb:g})")
    top = sorted(
        (c for c in report.layers if c.memory is not None and c.memory.saved_bytes),
        key=lambda c: -(c.memory.saved_bytes or 0) if c.memory else 0,
    )
    bad = [
        Failure(
            f"{c.name} call {c.call} saved {(c.memory.saved_bytes or 0) / 1e6:.4g} MB",
            c.name,
            c.call,
            None,
            (c.memory.saved_bytes or 0) / 1e6,
            limit_mb,
        )
        for c in top[:5]
        if c.memory is not None
    ]
    text = f"{mb:.4g} MB saved for backward, above {limit_mb:g} MB"
    return CheckResult("saved-mb", False, text, bad, bad[0] if bad else None)


def _heads(report: Report, rule: str, limit: float) -> CheckResult:
    """--max-sink (a dormant head: its queries attend the first token and little else) and
    --min-entropy (a collapsed head: each query attends one key), head by head."""
    heads = report.heads or []
    several = any(h.sequence for h in heads)  # a batch: each sequence's heads are rows
    bad = []
    checked = 0
    for h in heads:
        value = h.sink if rule == "sink" else h.entropy
        if value is None:
            continue
        checked += 1
        if (value > limit) if rule == "sink" else (value < limit):
            what = "sink" if rule == "sink" else "entropy"
            of = f" of sequence {h.sequence}" if several else ""
            text = f"head {h.head}{of}: {what} {value:.4g}"
            f = Failure(f"{h.layer} call {h.call} {text}", h.layer, h.call, h.module, value, limit)
            f.channel = h.head  # a head is the channel of attention
            bad.append(f)
    name = "dormant-heads" if rule == "sink" else "collapsed-heads"
    bound = f"sink above {limit:g}" if rule == "sink" else f"entropy below {limit:g}"
    if not bad:
        return CheckResult(name, True, f"no head with {bound} ({checked} heads)")
    return CheckResult(name, False, f"{len(bad)} of {checked} heads with {bound}", bad, bad[0])


def _nonfinite(report: Report) -> CheckResult:
    seen = 0
    bad = []
    for where, t in _all_tensors(report):
        seen += 1
        if t.nonfinite:
            counts = ", ".join(f"{n} {k}" for n, k in ((t.nan, "NaN"), (t.inf, "Inf")) if n)
            bad.append(_failure(where, counts, counts, None))
    if not bad:
        return CheckResult("nonfinite", True, f"no NaN/Inf in {seen} tensors")
    origins = (
        "; ".join(o.describe() for o in report.nonfinite_origins)
        or "origin not among the selected layers"
    )
    first = None
    if report.nonfinite_origins:
        o = report.nonfinite_origins[0]
        first = next((f for f in bad if f.layer == o.layer and f.call == o.call), None) or Failure(
            o.describe(), o.layer, o.call, o.path
        )
    return CheckResult(
        "nonfinite", False, f"NaN/Inf in {len(bad)} of {seen} tensors ({origins})", bad, first
    )


def _dead(report: Report, frac: float) -> CheckResult:
    checked = 0
    bad: list[tuple[LayerCall, Failure]] = []
    for c in report.layers:
        if c.type not in RELU_FAMILY:
            continue
        for t in c.outputs:
            if t.zeros is None:
                continue
            checked += 1
            if t.zeros >= frac:
                where = (c.name, c.call, t.path)
                bad.append((c, _failure(where, f"{t.zeros:.1%} zeros", t.zeros, frac)))
    limit = "all zeros" if frac >= 1 else f"at least {frac:.0%} zeros"
    if not bad:
        return CheckResult("dead", True, f"no ReLU-family output {limit} ({checked} checked)")
    return _failed("dead", f"{len(bad)} of {checked} ReLU-family outputs {limit}", bad)


def _failed(
    rule: str, message: str, bad: list[tuple[LayerCall, Failure]], *, backward: bool = False
) -> CheckResult:
    """A failed rule: its failures in the report's order, and the first one (by the order the
    hooks saw the calls) named in its message."""
    first = _first(bad, backward)
    if first is not None and len(bad) > 1:
        which = "to arrive in backward" if backward else "in forward"
        message += f"; first {which}: {first.message}"
    return CheckResult(rule, False, message, [f for _, f in bad], first)


def _max_abs(report: Report, limit: float) -> CheckResult:
    bad: list[tuple[LayerCall, Failure]] = []
    checked = 0
    for c in report.layers:
        for t in c.outputs:
            if (t.min is None or t.max is None) and not t.inf:
                continue
            checked += 1
            # min/max are over the finite elements: an Inf is beyond any limit
            peak = math.inf if t.inf else max(abs(t.min or 0.0), abs(t.max or 0.0))
            if peak > limit:
                where = (c.name, c.call, t.path)
                value: float | str = "Inf" if math.isinf(peak) else peak  # JSON has no inf
                bad.append((c, _failure(where, f"max |x| = {peak:.4g}", value, limit)))
    if not bad:
        return CheckResult(
            "max-abs", True, f"every activation within ±{limit:g} ({checked} checked)"
        )
    return _failed("max-abs", f"{len(bad)} activations beyond ±{limit:g}", bad)


def _min_std(report: Report, limit: float) -> CheckResult:
    """Collapse: an output (of more than one element) whose spread fell below the limit — a
    layer that passes on (nearly) a constant, whatever its input."""
    bad: list[tuple[LayerCall, Failure]] = []
    checked = 0
    for c in report.layers:
        for t in c.outputs:
            if t.std is None or t.numel - t.nan - t.inf < 2:
                continue
            checked += 1
            if t.std < limit:
                where = (c.name, c.call, t.path)
                bad.append((c, _failure(where, f"std {t.std:.4g} (collapsed)", t.std, limit)))
    if not bad:
        return CheckResult(
            "min-std", True, f"every activation's std at least {limit:g} ({checked} checked)"
        )
    return _failed("min-std", f"{len(bad)} of {checked} activations with std below {limit:g}", bad)


def _grad_norm(report: Report, lo: float | None, hi: float | None) -> CheckResult:
    if report.backward is None:
        return CheckResult("grad-norm", False, "no backward pass ran", [])
    span = f"[{'' if lo is None else f'{lo:g}'}, {'' if hi is None else f'{hi:g}'}]"
    bad: list[tuple[LayerCall, Failure]] = []
    checked = 0
    absent: list[str] = []
    for c in report.layers:
        grads = [(f"grad_output {g.path}", g) for g in c.grad_outputs or []]
        grads += [(f"{p.name}.grad", p.grad) for p in c.params or [] if p.grad is not None]
        absent += [
            f"{c.name}.{p.name}" for p in c.params or [] if p.grad is None and p.requires_grad
        ]  # (none reached it: a cut graph, or a parameter only training mode reads)
        for what, g in grads:
            where = (c.name, c.call, what)
            if g.inf:  # the norm is over the finite elements: Inf is beyond any bound
                checked += 1
                text = f"{g.inf} Inf (exploding)"
                bad.append((c, _failure(where, text, "Inf", hi if hi is not None else lo)))
                continue
            if g.nan:  # neither vanishing nor exploding: not a number
                checked += 1
                bad.append((c, _failure(where, f"{g.nan} NaN (not finite)", "NaN", None)))
                continue
            norm = g.norm
            if norm is None:
                continue
            checked += 1
            low = lo is not None and norm < lo
            if low or (hi is not None and norm > hi):
                side = "vanishing" if low else "exploding"
                failure = _failure(where, f"norm {norm:.4g} ({side})", norm, lo if low else hi)
                bad.append((c, failure))
    unreached = (
        f"; {len(absent)} trainable parameters got no gradient (none reached them): "
        f"{few(absent, 4)}"
        if absent
        else ""
    )
    if not bad:
        return CheckResult(
            "grad-norm", True, f"every gradient norm within {span} ({checked} checked){unreached}"
        )
    odd = " or not finite" if any(isinstance(f.value, str) for _, f in bad) else ""
    message = f"{len(bad)} gradients with norms outside {span}{odd}{unreached}"
    return _failed("grad-norm", message, bad, backward=True)


def _expect_shape(report: Report, layer: str, shape: tuple[int, ...]) -> CheckResult:
    """LAYER's first call's (a glob's: each layer it matches, by name or alias) first output
    has this shape."""
    want = "x".join(map(str, shape))
    glob = any(ch in layer for ch in "*?[")
    firsts: dict[str, LayerCall] = {}
    for c in report.layers:
        named = [c.name, *c.aliases]
        if layer in named or (glob and any(fnmatch.fnmatchcase(n, layer) for n in named)):
            firsts.setdefault(c.name, c)
    rule = f"expect-shape {layer}"
    if not firsts:
        text = f"{layer} never ran, so it has no output shape"
        return CheckResult(rule, False, text, [Failure(text, layer, None, None, None, want)])
    failures = []
    for name, call in firsts.items():
        if not call.outputs:
            text = f"{name} produced no tensor"
            failures.append(Failure(text, name, call.call, None, None, want))
            continue
        got = "x".join(map(str, call.outputs[0].shape))
        if got != want:
            text = f"{name} output is {got}, expected {want}"
            failures.append(Failure(text, call.name, call.call, call.outputs[0].path, got, want))
    if not failures:
        n = len(firsts)
        which = layer if not glob else f"{layer} ({n} layer{'s' if n != 1 else ''})"
        return CheckResult(rule, True, f"{which} output is {want}")
    if len(firsts) == 1:
        return CheckResult(rule, False, failures[0].message, failures, failures[0])
    text = f"{len(failures)} of {len(firsts)} layers matching {layer} do not output {want}"
    return CheckResult(rule, False, text, failures, failures[0])
