"""Rules over a run (`hookcli check run.jsonl`): non-finite steps, dead and collapsed
activations, gradient norms and update ratios, each failure with its step. No torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hookcli import bounds
from hookcli.commands.checks import RELU_FAMILY, parse_rules
from hookcli.commands.watch.logread import RUN_SCHEMA
from hookcli.commands.watch.runmerge import RankOrigin, Run, loss_nonfinite, nonfinite_in
from hookcli.commands.watch.runseries import run_header
from hookcli.errors import UsageError
from hookcli.options import RuleOptions
from hookcli.records import (
    CheckResult,
    Failure,
    LoggedCall,
    NonfiniteLine,
    Origin,
    StepLine,
    TensorStats,
    log_line,
)


@dataclass(slots=True)
class StepFailure(Failure):
    """A failure in a run: the Failure fields plus the watched step where it was (for rules
    over several steps, the first) and the rank whose log said so (None: the merged run)."""

    step: int | None = None
    rank: int | None = None
    steps: int | None = None  # how many watched steps broke the rule for this entry


@dataclass(slots=True)
class RunRules:
    """The rules over a run, validated (parse_run_rules)."""

    fail_on: list[str] = field(default_factory=list)
    dead_frac: float = RuleOptions().dead_frac
    dead_after: int = 0
    min_std: float | None = None
    grad_norm: tuple[float | None, float | None] | None = None
    update_ratio: tuple[float | None, float | None] | None = None

    @property
    def any(self) -> bool:
        return bool(
            self.fail_on
            or self.min_std is not None
            or self.grad_norm is not None
            or self.update_ratio is not None
        )


LOG_FAIL_ON = ("nonfinite", "dead")  # what a log's numbers can tell


def parse_run_rules(
    options: RuleOptions = RuleOptions(),
    *,
    dead_after: int | None = None,
    min_grad_norm: float | None = None,
    max_grad_norm: float | None = None,
    min_update_ratio: float | None = None,
    max_update_ratio: float | None = None,
) -> RunRules:
    """check's rules for a run log: --fail-on, --dead-frac, --min-std and --grad-norm as for a
    model (checks.parse_rules validates them), and the run's own bounds. No rule at all:
    --fail-on nonfinite; --dead-after implies --fail-on dead."""
    base = parse_rules(options)
    model_only = [r for r in base.fail_on if r not in LOG_FAIL_ON]
    if model_only:
        raise UsageError(
            f"--fail-on {model_only[0]} reads a model's run (per-channel numbers, routing), "
            "which a training log does not record.",
            f"a log's --fail-on rules: {', '.join(LOG_FAIL_ON)}; check the model itself for "
            f"{model_only[0]}.",
        )
    rules = RunRules(fail_on=list(base.fail_on), dead_frac=base.dead_frac, min_std=base.min_std)
    if dead_after is not None:
        if isinstance(dead_after, bool) or not isinstance(dead_after, int) or dead_after < 0:
            raise UsageError(
                f"--dead-after must be a step number, 0 or more, got {dead_after!r}.",
                "e.g. --dead-after 100",
            )
        rules.dead_after = dead_after
        if "dead" not in rules.fail_on:
            rules.fail_on.append("dead")
    grads = _bounds(min_grad_norm, max_grad_norm, "grad-norm", "1e-8", "1e3")
    if grads is not None and base.grad_norm is not None:
        raise UsageError(
            "--grad-norm and --min-grad-norm/--max-grad-norm set the same bounds.",
            "give one: --grad-norm 1e-8:1e3, or --min-grad-norm 1e-8 --max-grad-norm 1e3.",
        )
    rules.grad_norm = grads if grads is not None else base.grad_norm
    rules.update_ratio = _bounds(min_update_ratio, max_update_ratio, "update-ratio", "1e-6", "1e-2")
    if not rules.any:
        rules.fail_on = ["nonfinite"]
    return rules


def _bounds(
    lo: float | None, hi: float | None, name: str, lo_eg: str, hi_eg: str
) -> tuple[float | None, float | None] | None:
    example = f"--min-{name} {lo_eg} --max-{name} {hi_eg}"
    if lo is not None:
        lo = bounds.number(lo, f"--min-{name}", low=0, example=example)
    if hi is not None:
        hi = bounds.number(hi, f"--max-{name}", low=0, infinite=True, example=example)
    if lo is None and hi is None:
        return None
    if lo is not None and hi is not None and lo > hi:
        raise UsageError(
            f"--min-{name} {lo:g} is above --max-{name} {hi:g}: an empty range.",
            f"e.g. {example}",
        )
    return lo, hi


def evaluate_run(run: Run, rules: RunRules) -> list[CheckResult]:
    """Each rule's verdict over every watched step. A log whose steps hold no layer and no
    parameter statistics is refused: every rule would pass on nothing (issue 32)."""
    if not any(s.layers or s.params for s in run.steps):
        files = ", ".join(run.files[:3]) + (" …" if len(run.files) > 3 else "")
        raise UsageError(
            f"{files}: {len(run.steps)} watched steps, but none holds a layer's or a "
            "parameter's statistics: there is nothing to check.",
            "watch layers that run (hookcli.watch(model, layers=...) or the default, every "
            "leaf) and parameters that get gradients, then check the new log.",
        )
    results = []
    if "nonfinite" in rules.fail_on:
        results.append(_nonfinite(run))
    if "dead" in rules.fail_on:
        results.append(_dead(run, rules.dead_frac, rules.dead_after))
    if rules.min_std is not None:
        results.append(_collapse(run, rules.min_std))
    if rules.grad_norm is not None:
        results.append(_grad_norm(run, *rules.grad_norm))
    if rules.update_ratio is not None:
        results.append(_update_ratio(run, *rules.update_ratio))
    return results


def _span(lo: float | None, hi: float | None) -> str:
    return f"[{'' if lo is None else f'{lo:g}'}, {'' if hi is None else f'{hi:g}'}]"


def _counts(t: TensorStats) -> str:
    return ", ".join(f"{n} {w}" for n, w in ((t.nan, "NaN"), (t.inf, "Inf")) if n)


def _tensors(step: StepLine) -> Iterator[tuple[str | None, int | None, str, TensorStats]]:
    """Every tensor entry of a step record: (layer, call, what, stats); parameters' gradients
    with layer None."""
    for c in step.layers:
        for tensors, prefix in (
            (c.inputs, ""),
            (c.outputs, ""),
            (c.grad_inputs, "grad_input "),
            (c.grad_outputs, "grad_output "),
        ):
            for t in tensors or []:
                yield c.name, c.call, f"{prefix}{t.path}", t
    for p in step.params:
        if p.grad is not None:
            yield None, None, f"{p.name}.grad", p.grad


def _origin_text(o: Origin) -> str:
    """An origin in words; in a merged run, with the rank whose log named it."""
    text = o.describe()
    return f"rank {o.rank}: {text}" if isinstance(o, RankOrigin) else text


def _nonfinite(run: Run) -> CheckResult:
    """NaN/Inf anywhere: a non-finite event, any statistic's NaN/Inf count, a non-finite loss.
    One failure per step (the step's first origin named), the earliest first. On a step
    GradScaler skipped, NaN/Inf in gradients is its overflow, handled: not a failure."""
    bad: list[StepFailure] = []
    checked = 0
    loss_bad = loss_nonfinite(run)
    events: dict[int, list[NonfiniteLine]] = {}
    for e in run.events:
        events.setdefault(e.step, []).append(e)
    skipped_overflow = []
    seen_steps = set()
    for i, s in enumerate(run.steps):
        step = s.step
        seen_steps.add(step)
        skipped = bool(s.skipped)
        tensors = list(_tensors(s))
        checked += len(tensors)
        hits = [x for x in tensors if nonfinite_in(x[3]) and not (skipped and _is_grad(x[2]))]
        excused = skipped and any(nonfinite_in(x[3]) for x in tensors if _is_grad(x[2]))
        if excused:
            skipped_overflow.append(step)
        step_events = [
            e for e in events.get(step, []) if not (skipped and set(e.found) <= {"grad"})
        ]
        if not hits and not loss_bad[i] and not step_events:
            continue
        step_origins = [*s.nonfinite_origins]
        step_origins += [o for e in step_events for o in e.origins]
        layer, call, path = None, None, None
        first = _origin_text(step_origins[0]) if step_origins else ""
        if step_origins:
            o = step_origins[0]
            layer, call, path = o.layer, o.call, o.path
        if hits:
            what = f"NaN/Inf in {len(hits)} of {len(tensors)} tensors"
            if not step_origins:
                layer, call, path, t = hits[0]
                place = path if layer is None else f"{layer} call {call} {path}"
                first = f"{place}: {_counts(t)}"
        else:
            what = "NaN/Inf"
        found_in = {f for e in step_events for f in e.found}
        found_in |= {_found(x[0], x[2]) for x in hits}
        if loss_bad[i]:
            found_in.add("loss")
        found = sorted(found_in)
        if found:
            what += f" (found in: {', '.join(found)})"
        message = f"step {step}: {what}" + (f"; first: {first}" if first else "")
        rank = next((e.rank for e in step_events), None) if run.ranks > 1 else None
        value = sum(x[3].nan + x[3].inf for x in hits)
        bad.append(StepFailure(message, layer, call, path, value, None, step=step, rank=rank))
    for step, step_events in sorted(events.items()):  # events of steps no line was logged for
        if step in seen_steps:
            continue
        e = step_events[0]
        origins = [_origin_text(o) for o in e.origins]
        message = f"step {step} (not watched): NaN/Inf in {', '.join(e.found) or 'the run'}"
        message += f"; first: {origins[0]}" if origins else ""
        layer, call, path = None, None, None
        if e.origins:
            layer, call, path = e.origins[0].layer, e.origins[0].call, e.origins[0].path
        rank = e.rank if run.ranks > 1 else None
        bad.append(StepFailure(message, layer, call, path, None, None, step=step, rank=rank))
    bad.sort(key=lambda f: f.step if f.step is not None else -1)
    handled = (
        f"; GradScaler skipped step {', '.join(map(str, skipped_overflow))} for its gradient "
        "overflow (handled, not counted)"
        if skipped_overflow
        else ""
    )
    if not bad:
        message = f"no NaN/Inf in {checked} tensors over {len(run.steps)} watched steps{handled}"
        return CheckResult("nonfinite", True, message)
    steps = f"{len(bad)} step{'s' if len(bad) > 1 else ''}"
    message = f"NaN/Inf at {steps}, first {bad[0].message}{handled}"
    return CheckResult("nonfinite", False, message, list(bad), bad[0])


def _found(layer: str | None, what: str) -> str:
    """A tensor entry's kind as a non-finite event names it: output, grad or param."""
    if layer is None:
        return "param"
    return "grad" if _is_grad(what) else "output"


def _is_grad(what: str) -> bool:
    return what.startswith("grad_") or what.endswith(".grad")


def _entries(
    run: Run, kinds: Iterable[str]
) -> dict[tuple[str, int, str], list[tuple[int, TensorStats, str]]]:
    """Each (layer, call, path) of the given kinds: (step index, stats, type) per watched step."""
    out: dict[tuple[str, int, str], list[tuple[int, TensorStats, str]]] = {}
    for i, s in enumerate(run.steps):
        for c in s.layers:
            for kind in kinds:
                for t in _of_kind(c, kind):
                    out.setdefault((c.name, c.call, t.path), []).append((i, t, c.type))
    return out


def _of_kind(c: LoggedCall, kind: str) -> list[TensorStats]:
    """A call's tensors of one kind (inputs, outputs, grad_inputs, grad_outputs): [] for none."""
    tensors: list[TensorStats] | None = getattr(c, kind)
    return tensors or []


def _run_since(flags: Sequence[bool]) -> int | None:
    """The index from which every flag to the end is set (None: the last is not)."""
    start = None
    for i in range(len(flags) - 1, -1, -1):
        if not flags[i]:
            break
        start = i
    return start


def _dead(run: Run, frac: float, after: int) -> CheckResult:
    """A ReLU-family output whose zero fraction is at least `frac` at every watched step from
    step `after` on (and which ran at one of them at least)."""
    numbers = run.step_numbers
    if numbers[-1] < after:
        raise UsageError(
            f"--dead-after {after}: the log's last watched step is {numbers[-1]}.",
            f"give a step up to {numbers[-1]}.",
        )
    limit = "all zeros" if frac >= 1 else f"at least {frac:.0%} zeros"
    bad: list[StepFailure] = []
    checked = 0
    for (name, call, path), seen in _entries(run, ("outputs",)).items():
        if seen[0][2] not in RELU_FAMILY:
            continue
        late = [(i, t.zeros) for i, t, _ in seen if numbers[i] >= after and t.zeros is not None]
        if not late:
            continue
        checked += 1
        if all(z >= frac for _, z in late):
            since = numbers[late[0][0]]
            zeros = min(z for _, z in late)
            text = (
                f"{name} call {call} {path}: {limit} at every watched step from step {since} "
                f"({len(late)} steps; fewest zeros {zeros:.1%})"
            )
            bad.append(
                StepFailure(text, name, call, path, zeros, frac, step=since, steps=len(late))
            )
    where = f"from step {after} on" if after else "at every watched step"
    if not bad:
        return CheckResult(
            "dead", True, f"no ReLU-family output {limit} {where} ({checked} checked)"
        )
    message = f"{len(bad)} of {checked} ReLU-family outputs {limit} {where}"
    if len(bad) > 1:
        message += f"; first in forward: {bad[0].message}"
    return CheckResult("dead", False, message, list(bad), bad[0])


def _collapse(run: Run, limit: float) -> CheckResult:
    """An output whose std (of two or more finite elements) stayed below `limit` from some
    watched step to the end of the run: it collapsed and did not recover."""
    numbers = run.step_numbers
    bad: list[StepFailure] = []
    checked = 0
    for (name, call, path), seen in _entries(run, ("outputs",)).items():
        usable = [(i, t.std) for i, t, _ in seen if t.std is not None and _finite(t) >= 2]
        if not usable:
            continue
        checked += 1
        start = _run_since([v < limit for _, v in usable])
        if start is None:
            continue
        since = numbers[usable[start][0]]
        low = usable[start:]
        std = max(v for _, v in low)
        text = (
            f"{name} call {call} {path}: std below {limit:g} from step {since} to the end "
            f"({len(low)} steps; at most {std:.4g}: collapsed)"
        )
        bad.append(StepFailure(text, name, call, path, std, limit, step=since, steps=len(low)))
    if not bad:
        return CheckResult(
            "min-std", True, f"no output's std stayed below {limit:g} ({checked} checked)"
        )
    bad.sort(key=lambda f: f.step if f.step is not None else 0)  # stable: forward order
    message = f"{len(bad)} of {checked} outputs collapsed (std below {limit:g} to the end)"
    if len(bad) > 1:
        message += f"; first: {bad[0].message}"
    return CheckResult("min-std", False, message, list(bad), bad[0])


def _finite(t: TensorStats) -> int:
    """A tensor entry's finite elements."""
    return int(t.numel) - int(t.nan) - int(t.inf)


def _outside(
    seen: Sequence[tuple[int, float | str]],
    lo: float | None,
    hi: float | None,
    *,
    words: tuple[str, str],
) -> list[tuple[int, float | str, str]]:
    """The (step index, value, side) of the values out of [lo, hi], the side named by `words`
    (below, above); Inf is above any bound, NaN is "not finite"."""
    out: list[tuple[int, float | str, str]] = []
    for i, v in seen:
        if v == "Inf":
            out.append((i, v, words[1]))
        elif v == "NaN":
            out.append((i, v, "not finite"))
        elif isinstance(v, float) and lo is not None and v < lo:
            out.append((i, v, words[0]))
        elif isinstance(v, float) and hi is not None and v > hi:
            out.append((i, v, words[1]))
    return out


def _norm_value(t: TensorStats) -> float | str | None:
    """A gradient's norm for a bound: "Inf"/"NaN" when it holds them (its norm is over the
    finite elements only), else its norm (None: empty)."""
    if t.inf:
        return "Inf"
    if t.nan:
        return "NaN"
    return None if t.norm is None else float(t.norm)


def _bounded(
    rule: str,
    what: str,
    run: Run,
    *,
    entries: dict[tuple[str | None, int | None, str], list[tuple[int, float | str]]],
    lo: float | None,
    hi: float | None,
    low_word: str,
    high_word: str,
) -> CheckResult:
    """One failure per entry (layer call and tensor, or parameter) out of [lo, hi] at any
    watched step: the first such step and its value (a pair, as a row exports them), how many,
    and the worst value in the message."""
    numbers = run.step_numbers
    span = _span(lo, hi)
    bad: list[StepFailure] = []
    for (layer, call, path), seen in entries.items():
        out = _outside(seen, lo, hi, words=(low_word, high_word))
        if not out:
            continue
        i, value, side = out[0]
        floats = [v for _, v, _ in out if isinstance(v, float)]
        worst: float | str = value
        if not isinstance(value, str) and floats:
            low_side = side == low_word
            worst = min(floats) if low_side else max(floats)
        place = path if layer is None else f"{layer} call {call} {path}"
        shown = worst if isinstance(worst, str) else f"{worst:.4g}"
        reach = "" if isinstance(worst, str) else "down to " if side == low_word else "up to "
        text = (
            f"{place}: {what} {reach}{shown} ({side}) at {len(out)} of {len(seen)} watched "
            f"steps, first step {numbers[i]}"
        )
        limit = hi if side == high_word else lo if side == low_word else None
        bad.append(  # (step and value a pair: the first failing step's; the worst in the text)
            StepFailure(text, layer, call, path, value, limit, step=numbers[i], steps=len(out))
        )
    checked = len(entries)
    if not bad:
        return CheckResult(rule, True, f"every {what} within {span} ({checked} checked)")
    bad.sort(key=lambda f: f.step if f.step is not None else 0)
    message = f"{len(bad)} of {checked} {what}s outside {span}"
    if len(bad) > 1:
        message += f"; first: {bad[0].message}"
    return CheckResult(rule, False, message, list(bad), bad[0])


def _grad_norm(run: Run, lo: float | None, hi: float | None) -> CheckResult:
    """Each layer call's output-gradient norm and each parameter's gradient norm, over the
    steps GradScaler did not skip."""
    entries: dict[tuple[str | None, int | None, str], list[tuple[int, float | str]]] = {}
    for i, s in enumerate(run.steps):
        if s.skipped:
            continue
        for c in s.layers:
            for g in c.grad_outputs or []:
                v = _norm_value(g)
                if v is not None:
                    entries.setdefault((c.name, c.call, f"grad_output {g.path}"), []).append((i, v))
        for p in s.params:
            v = None if p.grad is None else _norm_value(p.grad)
            if v is not None:
                entries.setdefault((None, None, f"{p.name}.grad"), []).append((i, v))
    return _bounded(
        "grad-norm", "gradient norm", run, entries=entries, lo=lo, hi=hi,
        low_word="vanishing", high_word="exploding",
    )  # fmt: skip


def _update_ratio(run: Run, lo: float | None, hi: float | None) -> CheckResult:
    """Each parameter's update/weight ratio ‖Δw‖/‖w‖, over the steps GradScaler did not skip
    and where it had a gradient (a parameter with none is not updated by design)."""
    entries: dict[tuple[str | None, int | None, str], list[tuple[int, float | str]]] = {}
    for i, s in enumerate(run.steps):
        if s.skipped:
            continue
        for p in s.params:
            ratio = p.update_ratio
            if ratio is None or p.grad is None:
                continue
            entries.setdefault((None, None, p.name), []).append((i, float(ratio)))
    return _bounded(
        "update-ratio", "update ratio", run, entries=entries, lo=lo, hi=hi,
        low_word="too small", high_word="too large",
    )  # fmt: skip


def checks_json(run: Run, results: Sequence[CheckResult]) -> dict[str, Any]:
    """`hookcli check run.jsonl -f json`: the run, each rule's verdict and failures (each with
    its step), and the non-finite events as their log lines."""
    return {
        "schema": RUN_SCHEMA,
        "command": "check",
        "run": run_header(run.files, run.ranks, run.world_size, run.step_numbers, run.notes),
        "checks": [dataclasses.asdict(c) for c in results],
        "nonfinite_events": [log_line(e) for e in run.events],
    }
