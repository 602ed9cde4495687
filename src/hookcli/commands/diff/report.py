"""`hookcli diff`: where two runs of one model part ways, layer by layer.

A *side* is a variant of one model: a dtype (`float16`, `bfloat16`, `float64`), `autocast`
(`autocast:bfloat16`), `channels_last`, another `weights=…` or `seed=…`, another `device=…`,
combined with commas (`--b float16,channels_last`). Both sides run the same input through the
engine's hooked pass; every selected layer call's output is aligned by module name, call index
and tensor path, and measured against the reference: max|Δ|, relative L2, cosine, SQNR (dB),
accumulated in float64 over the elements finite on both sides.

The reference side runs first and its outputs spill to a temporary file the moment a hook sees
them; the compared side reads each one back when its own hook fires and keeps only the five
sums a difference needs. Peak memory is one activation, whatever the number of layers; the
sums add exactly across batches (folders). `--isolate` feeds each selected layer the reference
side's input, so a row shows that layer's own error rather than what it inherited; without it,
a second pass of the compared side does that for the `own` column and the largest-own-error
summary (`own=False` skips it). `--ref SIDE` (e.g. float64) measures both sides against a
third run, to say which one is wrong. A classifier's predictions are compared too: top-1 flips
and top-5 overlap. The default tolerance is the sides' precision's (tolerance.py).

This module runs the steps in order; what each side changes is its kinds' own (sides.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from hookcli import bounds
from hookcli._version import __version__
from hookcli.commands import shards
from hookcli.commands.diff import lockstep
from hookcli.commands.diff.align import align
from hookcli.commands.diff.corpus import Corpus, text_batches
from hookcli.commands.diff.measure import SCORES, Compared, ErrorSums, Spill, describe_over
from hookcli.commands.diff.passes import reference_pass, side_pass
from hookcli.commands.diff.quantsides import weight_distances
from hookcli.commands.diff.sides import (
    DType,
    Side,
    SideRun,
    parse_side,
    precisions_of,
    prepare_side,
    quantizable_twin,
    ran_in,
)
from hookcli.commands.diff.tokens import (
    is_causal_lm,
    judge_tokens,
    rules_apply,
    token_namer,
    token_rules,
)
from hookcli.commands.diff.tolerance import default_tol
from hookcli.engine.prepare import build_input
from hookcli.engine.selection import count_params
from hookcli.errors import UsageError
from hookcli.inputs import ModelInput, expand_paths
from hookcli.options import DEFAULTS, DiffOptions, InputOptions, ModelOptions, Selection
from hookcli.records import (
    DiffCall,
    DiffReport,
    InputInfo,
    ModelInfo,
    TensorDiff,
    WeightDistance,
)
from hookcli.runtime import beacon, isa

SORTS = {
    "order": "as the calls returned",
    "error": "largest relative L2 first",
    "own": "largest own error first",
}
LARGEST = 5  # layers in the largest-own-error summary


def check_sort(sort: str) -> str:
    """--sort's value, or a UsageError naming the orders."""
    key = sort.strip().lower()
    if key not in SORTS:
        orders = ", ".join(f"{k} ({v})" for k, v in SORTS.items())
        raise UsageError(f"--sort {sort!r} is not an order of the rows.", f"use one of: {orders}.")
    return key


def diff_run(
    model: ModelOptions,
    selection: Selection,
    inputs: InputOptions,
    options: DiffOptions,
    *,
    flags: tuple[str, str, str] = ("--a", "--b", "--ref"),
) -> DiffReport:
    """diff as the CLI and the API ask for it: the sides given as specs (`parse_side`; a bad
    one named by `flags`: the CLI's options, the API's keywords), the rest of `options` as
    `diff_report` takes them."""
    a, b, ref = flags
    if options.b is None:
        raise UsageError(
            f"diff needs side B: {b} SIDE.", "e.g. --b bfloat16, or --b weights=new.pt"
        )
    return diff_report(
        model,
        selection,
        inputs,
        parse_side(options.a, a),
        parse_side(options.b, b),
        ref=None if options.ref is None else parse_side(options.ref, ref),
        isolate=options.isolate,
        tol=options.tol,
        batch_size=options.batch_size,
        sort=options.sort,
        own=options.own,
        max_kld=options.max_kld,
        min_same_top1=options.min_same_top1,
    )


def diff_report(
    model: ModelOptions,
    selection: Selection,
    inputs: InputOptions,
    a: Side,
    b: Side,
    *,
    ref: Side | None = None,
    isolate: bool = DEFAULTS.diff.isolate,
    tol: float | None = None,
    batch_size: int | None = None,
    sort: str = "order",
    own: bool = True,
    max_kld: float | None = None,
    min_same_top1: float | None = None,
) -> DiffReport:
    """Side B (and, with a --ref side, side A) against the reference, per layer call; on a
    causal LM's text, its next-token distributions too (`max_kld`, `min_same_top1`: the rules
    on them, exit 1).

    tol None: the default of the coarsest side's precision (tolerance.py). own: without
    isolate, a second pass of each compared side fed the reference's inputs measures each
    layer's own error (`own_rel_l2`, the largest-own-error summary); sort: order, error, own.
    """
    reference = ref or a
    compared = [a, b] if ref is not None else [b]
    if tol is not None:
        tol, tol_source = bounds.tolerance(tol, "--tol", "--tol 1e-3"), "--tol"
    sort = check_sort(sort)
    rules = token_rules(inputs, max_kld, min_same_top1)
    if batch_size is not None:
        batch_size = bounds.integer(
            batch_size, "--batch-size", low=1, high=bounds.BATCH_MAX, example="--batch-size 32"
        )
    reference.check_role(reference=True, isolate=isolate)
    for side in compared:
        side.check_role(reference=False, isolate=isolate)
    labels = ["ref", "A", "B"][-len(compared) - 1 :]  # what a crash message calls each side
    blocked = {
        lab: why for lab, s in zip(labels[1:], compared, strict=True) if (why := s.isolatable())
    }
    own_pass = own and not isolate and len(blocked) < len(compared)
    if sort == "own" and not isolate and not own_pass:
        if not own:
            raise UsageError(
                "--sort own needs each layer's own error, which --no-own skips.",
                "drop --no-own, or use --sort error (accumulated error).",
            )
        lab, why = next(iter(blocked.items()))
        raise UsageError(
            f"--sort own needs each layer's own error, measured by feeding side {lab} the "
            f"reference's inputs: {why}",
            "use --sort error (accumulated error).",
        )
    batches = _batches(inputs, batch_size) or text_batches(inputs, batch_size)
    twin = any(s.needs_twin for s in (reference, *compared))
    runs = [  # the input is built once, by the reference side, and cast for each side
        prepare_side(
            model,
            Selection() if twin else selection,  # the twin's own modules are selected later
            s,
            with_input=None if batches or i else inputs,
        )
        for i, s in enumerate([reference, *compared])
    ]
    names = [f"{lab} ({run.side.describe()})" for lab, run in zip(labels, runs, strict=True)]
    corpus = Corpus(runs[0].prepared, model, batches) if batches and inputs.has_text else None
    if rules:
        rules_apply(runs, isolate)
    if tol is None:  # the coarsest precision the sides compute in, as they were loaded
        tol, tol_source = default_tol(p for run in runs for p in precisions_of(run))
    results = [Compared() for _ in compared]
    owns = [Compared() if own_pass and lab not in blocked else None for lab in labels[1:]]
    # torchrun: global batch k on rank k mod N; a twin is calibrated on batch 0 on every rank,
    # so that every rank compares against the same int8 model
    group = shards.join() if batches else None
    if group is not None:
        settings = {
            "command": "diff",
            "model": dataclasses.replace(
                model,
                model=model.model if isinstance(model.model, str) else type(model.model).__name__,
            ),
            "selection": selection,
            "sides": [s.describe() for s in (reference, *compared)],
            "run": (isolate, tol, sort, own),
            "folder": batch_size,
        }
        try:
            listed = [str(item) for b in batches for item in b.items] or [
                str(sum(len(b.text) for b in batches))  # a corpus: its texts
            ]
            shards.agree(group, settings, listed)
        except BaseException:
            shards.leave(group)
            raise
    mine = group.batches(len(batches)) if group is not None else list(range(len(batches)))
    started = time.monotonic()
    spill = Spill()
    side_by_side = False  # the sides run side by side (lockstep.py), else through the spill
    seen = 0
    scored = False  # the reference's output is class scores
    first_input: ModelInput | None = None
    try:
        todo: list[InputOptions | None] = [batches[k] for k in mine] if batches else [None]
        for k, batch in zip(mine if batches else [0], todo, strict=True):
            base = runs[0].prepared
            if corpus is not None:
                assert batch is not None
                model_input = corpus.input(batch)
                for r in results:  # the corpus' number of the batch's first text
                    r.texts_before = k * len(batches[0].text)
            elif batch is not None:
                model_input = build_input(base.loaded, batch, model.seed)
            else:
                assert base.model_input is not None
                model_input = base.model_input
            if first_input is None:
                if twin:  # every side the fused twin; int8 calibrated on the first batch
                    calibration = model_input
                    if batches and mine[0] != 0:  # another rank compares batch 0
                        calibration = build_input(base.loaded, batches[0], model.seed)
                    for run in runs:
                        quantizable_twin(run, selection, calibration)
                align([run.prepared for run in runs])  # fused units compared as one
                side_by_side = lockstep.fits(runs)  # till a batch does not fit
            first_input = first_input or model_input
            ref_input = reference.cast(model_input.copy(), base.device)
            consumers = [
                lockstep.Consumer(
                    f"{name}{note}",
                    run,
                    run.side.cast(model_input.copy(), run.prepared.device),
                    iso,
                    acc,
                )
                for name, run, result, own_result in zip(
                    names[1:], runs[1:], results, owns, strict=True
                )
                for iso, acc, note in ((isolate, result, ""), (True, own_result, ", own error"))
                if acc is not None
            ]
            done = None
            if side_by_side:
                with beacon.phase(f"diff sides {', '.join(names)}, side by side"):
                    done = lockstep.run(runs[0], names[0], ref_input, consumers)
                side_by_side = done is not None
            if done is not None:
                scored = scored or SCORES in done
            else:
                scored = _through_spill(runs[0], names[0], ref_input, consumers, spill) or scored
            seen += model_input.shapes()[0][0] if model_input.shapes() else 1
        info = None
        if first_input is not None:
            info = InputInfo(
                first_input.description,
                first_input.shapes(),
                first_input.sources,
                first_input.preprocessing,
                first_input.texts,
            )
        spread = None
        if group is not None:
            size = len(batches[0].items) or len(batches[0].text)  # images, or texts
            part = _RankPart(group.rank, mine, results, owns, seen, scored, info)
            elapsed = time.monotonic() - started
            merged = _merge_ranks(shards.gather(part, group, elapsed), size)
            results, owns, scored, info = merged.results, merged.owns, merged.scored, merged.info
            seen = sum(merged.seen.values())
            spread = shards.spread_note(group, list(merged.seen.items()))
    finally:
        spill.close()
        shards.leave(group)
    assert info is not None
    notes = _notes(isolate, own, blocked, scored, labels) + ([spread] if spread else [])
    if inputs.has_text and isolate and is_causal_lm(runs[0].prepared.loaded):
        notes.append(
            "no token statistics under --isolate: side B is fed the reference's inputs, so its "
            "next-token distributions are not its own (without --isolate, the own-error pass "
            "still gives each layer's own error)"
        )
    where = ", ".join(map(str, inputs.items[:2])) if batches else None
    if corpus is not None:
        where = inputs.text_file or "--text"

    if where is not None and group is not None:
        where += f" over {group.world} processes"
    report = _report(
        runs,
        results,
        owns,
        info,
        seen,
        isolate=isolate,
        tol=tol,
        tol_source=tol_source,
        sort=sort,
        notes=notes,
        folder=where,
        unit="texts" if corpus is not None else "images",
    )
    judge_tokens(report, rules)
    return report


def _through_spill(
    reference: SideRun,
    described: str,
    ref_input: ModelInput,
    consumers: list[lockstep.Consumer],
    spill: Spill,
) -> bool:
    """One batch: the reference side's pass spilling its tensors, then each compared pass
    reading them back; whether the reference's output is class scores."""
    spill.reset()
    with beacon.phase(f"diff side {described}"):
        reference_pass(reference, ref_input, spill, any(c.isolate for c in consumers))
    spill.raise_if_failed()  # a tensor not spilled is not "only on this side"
    for c in consumers:
        with beacon.phase(f"diff side {c.described}"):
            side_pass(c.run, c.model_input, spill, c.isolate, c.compared)
    return SCORES in spill.index


@dataclasses.dataclass(slots=True)
class _RankPart:
    """What one rank of a torchrun diff saw: its global batches and its sums."""

    rank: int
    batches: list[int]
    results: list[Compared]
    owns: list[Compared | None]
    seen: int
    scored: bool
    info: InputInfo | None  # its first batch's input (rank 0's is global batch 0's)


@dataclasses.dataclass(slots=True)
class _Merged:
    results: list[Compared]
    owns: list[Compared | None]
    seen: dict[int, int]  # rank → images read
    scored: bool
    info: InputInfo | None


def _merge_ranks(parts: list[_RankPart], size: int) -> _Merged:
    """The ranks' sums added as one process adds its batches' (rank 0 first: its calls' order
    and shapes are global batch 0's); a flip's image index made global from its rank's batch."""
    parts = sorted(parts, key=lambda p: p.rank)
    for p in parts:  # local image index j: the rank's (j // size)-th batch, position j % size
        for c in p.results:
            if c.agreement is not None:
                c.agreement.flips = [
                    (p.batches[j // size] * size + j % size, name, ra, rb)
                    for j, name, ra, rb in c.agreement.flips
                ]
    results = [_merge_compared([p.results[i] for p in parts]) for i in range(len(parts[0].results))]
    owns: list[Compared | None] = []
    for i, first in enumerate(parts[0].owns):
        mine = [own for p in parts if (own := p.owns[i]) is not None]
        owns.append(None if first is None else _merge_compared(mine))
    return _Merged(
        results,
        owns,
        {p.rank: p.seen for p in parts},
        any(p.scored for p in parts),
        parts[0].info,
    )


def _merge_compared(parts: list[Compared]) -> Compared:
    out = Compared()
    for part in parts:
        out.absorb(part)
    return out


def _batches(inputs: InputOptions, batch_size: int | None) -> list[InputOptions]:
    """Image folders in batches (the sums add exactly); other inputs: one pass."""
    paths = [x for x in inputs.items if isinstance(x, str)]
    if not paths or len(paths) != len(inputs.items):
        return []
    files = expand_paths(paths)
    size = batch_size or 32
    if batch_size is None and len(files) <= size:
        return []
    chunks = [files[i : i + size] for i in range(0, len(files), size)]
    return [
        dataclasses.replace(inputs, items=tuple(str(f.path) for f in chunk)) for chunk in chunks
    ]


def _notes(
    isolate: bool, own: bool, blocked: dict[str, str], scored: bool, labels: list[str]
) -> list[str]:
    """How the rows were measured: accumulated or own error, and what was not compared."""
    ref = "A's" if labels[0] == "A" else "the reference side's"
    if isolate:
        notes = [
            f"--isolate: each selected layer was fed {ref} input, so each row is that layer's "
            "own error"
        ]
        if scored:
            notes.append(
                "predictions not compared: fed the reference's inputs, the compared side's "
                "output is not its own (run without --isolate)"
            )
        return notes
    notes = [
        "errors accumulate: each row includes what the layers before it passed on"
        + (
            f"; `own` is each layer's own error, from a second pass fed {ref} input at every "
            "selected layer (--no-own skips that pass)"
            if own and len(blocked) < len(labels) - 1
            else " (--isolate separates a layer's own error)"
        )
    ]
    if own:
        notes += [
            f"own error not measured for side {lab}, which cannot be fed the reference's "
            f"inputs: {why}"
            for lab, why in blocked.items()
        ]
    return notes


def _diffs(
    accs: dict[str, ErrorSums],
    tol: float,
    own: Compared | None,
    key: tuple[str, int],
    isolate: bool,
) -> list[TensorDiff]:
    """One call's tensors on one side, with each one's own error where it was measured."""
    diffs = [acc.result(p, tol) for p, acc in accs.items()]
    own_accs = own.calls[key][1] if own is not None and key in own.calls else {}
    for d in diffs:
        if isolate:
            d.own_rel_l2 = d.rel_l2
        elif d.path in own_accs:
            d.own_rel_l2 = own_accs[d.path].result(d.path, tol).rel_l2
    return diffs


def _fused(call: DiffCall, into: str) -> None:
    """An Identity left by fusion: its row compares nothing of its own (its output is what
    `into` returned), so it carries no numbers and is never past tolerance."""
    note = f"fused into {into}"
    call.fused_into = into
    call.b = [TensorDiff(d.path, d.shape, d.numel, note=note) for d in call.b]
    if call.a is not None:
        call.a = [TensorDiff(d.path, d.shape, d.numel, note=note) for d in call.a]


def _sort_key(call: DiffCall, sort: str) -> tuple[int, float]:
    """Largest first: a call with non-finite values before any number, calls without a
    number (one side only, fused) last; ties keep the order the calls returned."""
    diffs = [*call.b, *(call.a or [])]
    if sort == "error" and any(d.nonfinite for d in diffs):
        return (0, 0.0)
    values = [v for d in diffs if (v := d.own_rel_l2 if sort == "own" else d.rel_l2) is not None]
    if call.fused_into is not None or not values:
        return (2, 0.0)
    return (1, -max(values))


def _largest_own(calls: list[DiffCall]) -> list[dict[str, Any]]:
    """The calls with the largest own error (each call's largest tensor), largest first."""
    ranked: list[dict[str, Any]] = []
    for c in calls:
        if c.fused_into is not None:
            continue
        for side, diffs in (("B", c.b), ("A", c.a or [])):
            mine = [d for d in diffs if d.own_rel_l2 is not None and d.own_rel_l2 > 0]
            if not mine:
                continue
            d = max(mine, key=lambda t: t.own_rel_l2 or 0.0)
            ranked.append(
                {
                    "name": c.name,
                    "call": c.call,
                    "type": c.type_b if side == "B" and c.type_b else c.type,
                    "side": side,
                    "path": d.path,
                    "own_rel_l2": d.own_rel_l2,
                    "rel_l2": d.rel_l2,
                }
            )
    ranked.sort(key=lambda e: -float(e["own_rel_l2"]))
    return ranked[:LARGEST]


def _report(
    runs: list[SideRun],
    results: list[Compared],
    owns: list[Compared | None],
    input_info: InputInfo,
    seen: int,
    *,
    isolate: bool,
    tol: float,
    tol_source: str,
    sort: str,
    notes: list[str],
    folder: str | None,
    unit: str = "images",
) -> DiffReport:
    with_ref = len(results) == 2
    last = results[-1]
    ref_types = {t.name: t.type for t in runs[0].prepared.targets}
    fused = runs[0].fused
    calls: list[DiffCall] = []
    first: tuple[int, str] | None = None
    for key, (type_, accs) in last.calls.items():
        call = DiffCall(key[0], ref_types.get(key[0], type_), key[1])
        call.b = _diffs(accs, tol, owns[-1], key, isolate)
        call.type_b = type_ if type_ != call.type else None
        if with_ref:
            _, a_accs = results[0].calls.get(key, (type_, {}))
            call.a = _diffs(a_accs, tol, owns[0], key, isolate)
        if key[0] in fused:
            _fused(call, fused[key[0]])
        calls.append(call)
        over = [d for d in [*call.b, *(call.a or [])] if d.over]
        if over:
            rank = last.order.get(key, 0)
            if first is None or rank < first[0]:
                first = (rank, describe_over(call, over[0], tol))
    largest = _largest_own(calls)
    if sort != "order":
        calls.sort(key=lambda c: _sort_key(c, sort))
    outputs = [
        DiffCall("(model)", "output", 0, [a.result(p, tol) for p, a in last.outputs.items()])
    ]
    if with_ref:
        outputs[0].a = [acc.result(p, tol) for p, acc in results[0].outputs.items()]
    over = [d for d in [*outputs[0].b, *(outputs[0].a or [])] if d.over]
    if first is None and over:  # no hooked call is past it, yet the model's output is
        first = (0, describe_over(outputs[0], over[0], tol))
    loaded = runs[0].prepared.loaded
    sides = ["A", "B"] if with_ref else ["B"]
    agreement = {
        side: r.agreement.result(side, "ref" if with_ref else "A", loaded.categories)
        for side, r in zip(sides, results, strict=True)
        if r.agreement is not None
    }
    params = count_params(loaded.module)  # lazy parameters as materialised by the passes
    info = ModelInfo(
        loaded.name, loaded.spec, loaded.task, loaded.weights_label, params, dtype=ran_in(runs[0])
    )
    notes = [*isa.notes(), *notes, *(n for run in runs for n in run.notes)]
    ran = [ran_in(run) for run in runs]
    if len(set(ran)) == 1 and all(
        all(isinstance(p, DType) for p in run.side.parts) for run in runs
    ):  # a dtype against itself: nothing differs between the sides but their runs
        notes.append(
            f"every side ran in {ran[0]} (the dtype the model was loaded in, or the one each "
            "side asks for): this diff compares the dtype with itself; give --b another "
            "dtype to measure one"
        )
    if tol_source != "--tol":
        notes.append(f"tol {tol:g}: {tol_source}")
    description = input_info.description
    if folder is not None:
        description = f"{seen} {unit} from {folder}"
        notes.append(f"differences are over all {seen} {unit}, summed exactly across batches")
    tokens = None
    if last.tokens_skipped is not None:
        notes.append(f"no token statistics: {last.tokens_skipped}")
    if last.tokens is not None:
        tokens = last.tokens.summary(token_namer(runs[0].prepared.loaded.tokenizer))
        if tokens.nonfinite:
            notes.append(
                f"token statistics: {tokens.nonfinite} positions left out, their next-token "
                "distribution not finite on a side (NaN/Inf logits)"
            )
    weights: list[WeightDistance] = []
    if any(run.side.changes_weights for run in runs):  # else they cannot differ: not read
        weights, weight_notes = weight_distances(
            runs[0].prepared.loaded.module, runs[-1].prepared.loaded.module
        )
        notes += weight_notes
    return DiffReport(
        weights=weights,
        tokens=tokens,
        model=info,
        input=InputInfo(
            description,
            input_info.shapes,
            input_info.sources,
            input_info.preprocessing,
            input_info.texts,
        ),
        device=str(runs[0].prepared.device),
        a=runs[1].side.describe() if with_ref else runs[0].side.describe(),
        b=runs[-1].side.describe(),
        ref=runs[0].side.describe() if with_ref else None,
        ran=dict(zip(["ref", "A", "B"] if with_ref else ["A", "B"], ran, strict=True)),
        isolate=isolate,
        tol=tol,
        tol_source=tol_source,
        sort=sort,
        calls=calls,
        outputs=outputs,
        first_over=first[1] if first else None,
        agreement=agreement or None,
        largest_own=largest,
        missing=sorted(set().union(*(r.missing for r in results))),
        notes=notes,
        hookcli_version=__version__,
    )
