"""The quantization report's token statistics (issue 53): how far side B's next-token
distributions are from the reference's (side A) over a text corpus, position by position.

Every position that predicts a next token of its own text counts — each real token but the
last of its sequence, never padding, left- or right-padded alike. Per position, from both
sides' logits over the vocabulary (float64, a bounded number of positions at a time, so the
memory is O(vocabulary) per position whatever the corpus):

* KL(A‖B) = Σ p_A (ln p_A - ln p_B), and KL(B‖A) the other way (a token one side gives
  probability 0 adds nothing where that side is the first, +∞ where it is the second);
* Δp = p_B(next) - p_A(next), the change in the probability of the text's actual next token;
* whether the most probable token is the same (the first of equal ones, as argmax);
* -ln p(next) on each side, for the perplexity exp(mean) and the correlation of the two.

These are llama.cpp's `llama-perplexity --kl-divergence` formulas: the mean KLD's standard
error is √(var / (n - 1)) with the population variance; percentiles interpolate linearly
between the sorted values (numpy's default). A position where either side's distribution is
not finite (NaN/Inf logits) is left out of everything and counted.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hookcli import bounds
from hookcli.engine.stats import kernels
from hookcli.engine.tensorbits import finite_or_none
from hookcli.errors import UsageError
from hookcli.options import InputOptions
from hookcli.records import DiffReport, TokenDistances

PERCENTILES = (99.9, 99.0, 90.0, 50.0, 10.0, 1.0)
WORST = 10  # the positions of largest KL(A‖B) reported
CHUNK = 64  # positions whose float64 distributions are held at once


# what each position adds, in the order a chunk's rows hold them
_PARTS = ("kld", "kld_reverse", "delta_p", "same", "nll_a", "nll_b")


def _key(q: float) -> str:
    return f"p{q:g}"


# logits the numba kernel reads (widened exactly to float32, or float64 where a side is)
_READ = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def _torch_rows(a: torch.Tensor, b: torch.Tensor, target: torch.Tensor) -> np.ndarray[Any, Any]:
    """The positions' seven numbers (engine/_distkernels.py's, in its order, one per row of
    the result) by float64 torch ops where the rows are (a device, or no numba)."""
    la = a.double().log_softmax(-1)
    lb = b.double().log_softmax(-1)
    pa, pb = la.exp(), lb.exp()
    zero = torch.zeros((), dtype=torch.float64, device=la.device)
    kld = torch.where(pa > 0, pa * (la - lb), zero).sum(-1)
    kld_reverse = torch.where(pb > 0, pb * (lb - la), zero).sum(-1)
    nll_a, nll_b = -la.gather(1, target).squeeze(1), -lb.gather(1, target).squeeze(1)
    delta_p = pb.gather(1, target).squeeze(1) - pa.gather(1, target).squeeze(1)
    same = la.argmax(-1) == lb.argmax(-1)
    # a distribution on both sides: no NaN after log_softmax (NaN or +Inf logits, or none
    # finite, give NaN)
    finite = ~(la.isnan().any(-1) | lb.isnan().any(-1))
    got = torch.stack([kld, kld_reverse, delta_p, same.double(), nll_a, nll_b, finite.double()])
    return got.cpu().numpy()  # one transfer per chunk


class TokenAccumulator:
    """Token statistics over batches: `add` each batch's logits of both sides, `summary` at
    the end. Sequences are numbered across batches in the order they were added."""

    def __init__(self) -> None:
        self._parts: dict[str, list[np.ndarray[Any, Any]]] = {k: [] for k in _PARTS}
        self._worst: list[tuple[float, int, int, int]] = []  # a min-heap of (kld, seq, pos, id)
        self._first = 0  # the number of the next batch's first text
        self.nonfinite = 0

    def add(
        self,
        logits_a: torch.Tensor | np.ndarray[Any, Any],
        logits_b: torch.Tensor,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        first: int | None = None,
    ) -> None:
        """One batch: logits (batch, tokens, vocabulary) of each side (the reference's may be
        a host array: diff's spill), the token ids (batch, tokens) and the attention mask (1
        where a token is real; None: all are). `first`: the number of the batch's first text
        in the corpus (None: after those added before)."""
        if tuple(logits_a.shape) != tuple(logits_b.shape):
            raise ValueError(
                f"the sides' logits differ in shape: {tuple(logits_a.shape)} and "
                f"{tuple(logits_b.shape)}"
            )
        ids = input_ids.detach().to("cpu", torch.int64)
        real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.detach().cpu() != 0
        vocab, told = logits_b.shape[-1], ids[real]
        if told.numel() and (int(told.min()) < 0 or int(told.max()) >= vocab):  # (padding: any)
            wrong = int(told.max()) if int(told.max()) >= vocab else int(told.min())
            raise UsageError(
                f"a token id of the text ({wrong}) is outside the model's {vocab} logits: "
                "the tokenizer and the model do not agree.",
                "use the model's own tokenizer (--tokenizer), or a model of its vocabulary.",
            )
        predicts = real[:, :-1] & real[:, 1:]  # a real token followed by one of its text
        seq, pos = predicts.nonzero(as_tuple=True)
        nxt = ids[seq, pos + 1]
        own = (real.long().cumsum(1) - 1)[seq, pos]  # the position in its own text
        if first is not None:
            self._first = first
        for start in range(0, seq.numel(), CHUNK):
            part = slice(start, start + CHUNK)
            self._chunk((logits_a, logits_b), seq[part], pos[part], nxt[part], own[part])
        self._first += ids.shape[0]

    def _chunk(
        self,
        logits: tuple[torch.Tensor | np.ndarray[Any, Any], torch.Tensor],
        seq: torch.Tensor,
        pos: torch.Tensor,
        nxt: torch.Tensor,
        own: torch.Tensor,
    ) -> None:
        """Positions (seq, pos) of this batch, predicting tokens `nxt`, at `own` in their texts."""
        logits_a, logits_b = logits
        device = logits_b.device
        at_s, at_p = seq.to(device), pos.to(device)
        if isinstance(logits_a, torch.Tensor):  # these rows, where they are, then moved
            home = logits_a.device
            a = logits_a.detach()[seq.to(home), pos.to(home)].to(device)
        else:  # these positions' rows only, copied out of the host array
            a = torch.from_numpy(np.asarray(logits_a[seq.numpy(), pos.numpy()])).to(device)
        b = logits_b.detach()[at_s, at_p]
        ks = kernels() if device.type == "cpu" and {a.dtype, b.dtype} <= _READ else None
        if ks is not None:  # numba: each exponential taken once
            wide = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
            rows = ks.distances(
                a.to(wide).contiguous().numpy(), b.to(wide).contiguous().numpy(), nxt.numpy()
            ).T
        else:
            rows = _torch_rows(a, b, nxt.to(device).unsqueeze(1))
        keep = rows[6] > 0
        self.nonfinite += int((~keep).sum())
        for k, name in enumerate(_PARTS):
            self._parts[name].append(rows[k][keep])
        base = self._first
        for value, s, p, t in zip(
            rows[0][keep].tolist(),
            seq.numpy()[keep].tolist(),
            own.numpy()[keep].tolist(),
            nxt.numpy()[keep].tolist(),
            strict=True,
        ):
            self._keep((value, base + s, p, t))

    def __deepcopy__(self, memo: dict[int, Any]) -> TokenAccumulator:
        """A snapshot (diff's side-by-side rounds take one before each batch, to roll back
        to): the lists copied, the arrays they hold shared — nothing changes an array once it
        is added — so a snapshot costs the number of chunks, not their positions."""
        copy = TokenAccumulator()
        copy._parts = {k: list(v) for k, v in self._parts.items()}
        copy._worst = list(self._worst)
        copy._first, copy.nonfinite = self._first, self.nonfinite
        return copy

    def _keep(self, item: tuple[float, int, int, int]) -> None:
        """One position among the WORST largest KL(A||B) so far."""
        if len(self._worst) < WORST:
            heapq.heappush(self._worst, item)
        elif item > self._worst[0]:
            heapq.heapreplace(self._worst, item)

    def absorb(self, other: TokenAccumulator) -> None:
        """Another process's positions merged in (torchrun; each batch added with its
        `first`, so the texts' numbers are the corpus')."""
        for name, parts in other._parts.items():
            self._parts[name] += parts
        for item in other._worst:
            self._keep(item)
        self.nonfinite += other.nonfinite

    def summary(self, token_text: Callable[[int], str] | None = None) -> TokenDistances:
        """The statistics over every position added; `token_text` names a token id."""
        got = {k: np.concatenate(v) if v else np.zeros(0) for k, v in self._parts.items()}
        kld, nll_a, nll_b = got["kld"], got["nll_a"], got["nll_b"]
        count = int(kld.shape[0])
        ppl_a = _exp(float(nll_a.mean())) if count else None
        ppl_b = _exp(float(nll_b.mean())) if count else None
        worst = sorted(self._worst, key=lambda w: (-w[0], w[1], w[2]))
        return TokenDistances(
            count=count,
            kld=_spread(kld),
            kld_reverse=_spread(got["kld_reverse"]),
            same_top1=finite_or_none(float(got["same"].mean())) if count else None,
            delta_p=_delta(got["delta_p"]),
            ppl_a=ppl_a,
            ppl_b=ppl_b,
            ppl_ratio=ppl_b / ppl_a if ppl_a and ppl_b is not None else None,
            ln_ppl_corr=_correlation(nll_a, nll_b),
            worst=[
                {
                    "sequence": s,
                    "position": p,
                    "token": t,
                    "text": token_text(t) if token_text is not None else None,
                    "kld": finite_or_none(v),
                }
                for v, s, p, t in worst
            ],
            nonfinite=self.nonfinite,
        )


def _exp(v: float) -> float | None:
    return finite_or_none(math.exp(v)) if v < 709 else None


def _spread(v: np.ndarray[Any, Any]) -> dict[str, float | None]:
    """mean, its standard error (llama.cpp's: √(var / (n - 1))), max and the percentiles."""
    n = v.shape[0]
    if n == 0:
        return {"mean": None, "stderr": None, "max": None, **{_key(q): None for q in PERCENTILES}}
    mean = float(v.mean())
    var = float((v * v).mean()) - mean * mean
    out: dict[str, float | None] = {
        "mean": finite_or_none(mean),
        "stderr": finite_or_none(math.sqrt(max(var, 0.0) / (n - 1))) if n > 1 else None,
        "max": finite_or_none(float(v.max())),
    }
    for q, value in zip(PERCENTILES, np.percentile(v, PERCENTILES).tolist(), strict=True):
        out[_key(q)] = finite_or_none(value)
    return out


def _delta(v: np.ndarray[Any, Any]) -> dict[str, float | None]:
    """Δp's root mean square and percentiles."""
    if v.shape[0] == 0:
        return {"rms": None, **{_key(q): None for q in PERCENTILES if q != 99.9}}
    out: dict[str, float | None] = {"rms": finite_or_none(math.sqrt(float((v * v).mean())))}
    qs = [q for q in PERCENTILES if q != 99.9]
    for q, value in zip(qs, np.percentile(v, qs).tolist(), strict=True):
        out[_key(q)] = finite_or_none(value)
    return out


def _correlation(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float | None:
    """Pearson's correlation of the two sides' -ln p(next), position by position."""
    if a.shape[0] < 2:
        return None
    da, db = a - a.mean(), b - b.mean()
    den = math.sqrt(float((da * da).sum()) * float((db * db).sum()))
    return finite_or_none(float((da * db).sum()) / den) if den > 0 else None


def token_rules(
    inputs: InputOptions, max_kld: float | None, min_same_top1: float | None
) -> dict[str, float]:
    """--max-kld and --min-same-top1, checked (a number in range; text to measure them on)."""
    rules: dict[str, float] = {}
    if max_kld is not None:
        rules["max_kld"] = bounds.tolerance(max_kld, "--max-kld", "--max-kld 0.05")
    if min_same_top1 is not None:
        rules["min_same_top1"] = bounds.number(
            min_same_top1, "--min-same-top1", low=0, high=1, example="--min-same-top1 0.95"
        )
    if rules and not inputs.has_text:
        flag = "--max-kld" if "max_kld" in rules else "--min-same-top1"
        raise UsageError(
            f"{flag} judges a language model's next-token distributions over text, and no "
            "text was given.",
            "give --text or --text-file.",
        )
    return rules


def is_causal_lm(loaded: Any) -> bool:
    """Whether a loaded model's task is a causal LM's (its logits predict the next token)."""
    from hookcli.sources.lm import CausalLM

    return isinstance(loaded.kind, CausalLM)


def rules_apply(runs: Sequence[Any], isolate: bool) -> None:
    """--max-kld / --min-same-top1 need B's own next-token distributions: a causal LM's, from
    a hooked pass of B's own (not --isolate's, which feeds B the reference's inputs, nor a
    side that runs its own pass, ONNX Runtime's). Refused before anything runs."""
    why = None
    loaded = runs[0].prepared.loaded
    if not is_causal_lm(loaded):
        why = f"{loaded.spec} is not a causal language model (AutoModelForCausalLM)"
    elif isolate:
        why = "--isolate feeds side B the reference's inputs, so its output is not its own"
    elif any(run.side.pass_runner() is not None for run in runs[1:]):
        why = "a side that runs its own pass (onnx) keeps no next-token distributions"
    if why is not None:
        raise UsageError(
            f"--max-kld / --min-same-top1 judge side B's next-token distributions: {why}.",
            "drop the rule, or diff a causal LM's text without --isolate.",
        )


def judge_tokens(report: DiffReport, rules: dict[str, float]) -> None:
    """The rules on the report's token statistics: each one broken is named (exit 1)."""
    report.token_rules = dict(rules)
    if not rules:
        return
    tokens = report.tokens
    if tokens is None:  # (the logits could not be compared: a note says why)
        report.token_failures.append("no next-token distributions to judge")
        return
    if not tokens.count:  # (KL over no position: neither a pass nor a number past a bound)
        report.token_failures.append(
            "no position to judge: no text has a next token of its own (each is one token)"
        )
        return
    ref = "ref" if report.ref is not None else "A"
    limit = rules.get("max_kld")
    mean = tokens.kld["mean"]
    if limit is not None and (mean is None or mean > limit):
        shown = "not finite" if mean is None else f"{mean:.4g}"
        report.token_failures.append(f"mean KL({ref}||B) {shown} > --max-kld {limit:g}")
    least = rules.get("min_same_top1")
    same = tokens.same_top1
    if least is not None and (same is None or same < least):
        shown = "none" if same is None else f"{same:.4g}"
        report.token_failures.append(f"same top-1 {shown} < --min-same-top1 {least:g}")


def token_namer(tokenizer: Any) -> Callable[[int], str] | None:
    """A token id's text by the tokenizer (None: no tokenizer)."""
    if tokenizer is None:
        return None

    def text(token: int) -> str:
        try:
            return str(tokenizer.decode([token]))
        except Exception:  # a tokenizer that cannot say: the id alone
            return ""

    return text
