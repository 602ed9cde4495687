"""The quantization report's token statistics (commands/diff/tokens.py) against a float64
numpy re-implementation of llama-perplexity's --kl-divergence formulas, one sequence at a time
and unpadded: left- and right-padded batches (garbage logits at the padding), across chunk
boundaries; KL(A||A) = 0 exactly; non-finite positions left out."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.commands.diff import tokens as tokens_mod
from hookcli.commands.diff.tokens import PERCENTILES, TokenAccumulator
from hookcli.errors import UsageError

transformers = pytest.importorskip("transformers")
runner = CliRunner()
VOCAB = 50
LINE = "The cat sat on the mat."


def _sequences(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(ids, logits A, logits B) of texts of different lengths; B = A plus noise, larger on
    some positions."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in (9, 1, 5, 12, 2, 7):
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        a = torch.randn(length, VOCAB, generator=g) * 3
        b = a + torch.randn(length, VOCAB, generator=g) * torch.rand(length, 1, generator=g)
        out.append((ids, a, b))
    return out


def _batch(
    seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], side: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequences padded on `side`: ids, mask, and both sides' logits, padding's garbage."""
    longest = max(len(s[0]) for s in seqs)
    n = len(seqs)
    ids = torch.full((n, longest), 7, dtype=torch.int64)
    mask = torch.zeros((n, longest), dtype=torch.int64)
    la = torch.full((n, longest, VOCAB), 1e4)  # garbage where there is no token
    lb = torch.randn(n, longest, VOCAB) * 1e3
    for i, (s_ids, a, b) in enumerate(seqs):
        k = len(s_ids)
        cols = slice(longest - k, longest) if side == "left" else slice(0, k)
        ids[i, cols], mask[i, cols], la[i, cols], lb[i, cols] = s_ids, 1, a, b
    return ids, mask, la, lb


def _oracle(seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, object]:
    """llama-perplexity's formulas, position by position, float64 numpy, no padding."""
    kld, rev, dp, same, nll_a, nll_b, where = [], [], [], [], [], [], []
    for s, (ids, a, b) in enumerate(seqs):
        a64, b64, tok = a.double().numpy(), b.double().numpy(), ids.numpy()
        for t in range(len(tok) - 1):
            la = a64[t] - np.log(np.exp(a64[t] - a64[t].max()).sum()) - a64[t].max()
            lb = b64[t] - np.log(np.exp(b64[t] - b64[t].max()).sum()) - b64[t].max()
            pa, pb = np.exp(la), np.exp(lb)
            nxt = tok[t + 1]
            kld.append(float((pa * (la - lb)).sum()))
            rev.append(float((pb * (lb - la)).sum()))
            dp.append(float(pb[nxt] - pa[nxt]))
            same.append(float(np.argmax(la) == np.argmax(lb)))
            nll_a.append(float(-la[nxt]))
            nll_b.append(float(-lb[nxt]))
            where.append((s, t, int(nxt)))
    k = np.array(kld)
    n = len(k)
    var = (k * k).mean() - k.mean() ** 2
    a_, b_ = np.array(nll_a), np.array(nll_b)
    order = sorted(range(n), key=lambda i: -kld[i])[:10]
    return {
        "count": n,
        "kld": k,
        "kld_mean": k.mean(),
        "kld_stderr": math.sqrt(var / (n - 1)),
        "rev": np.array(rev),
        "dp": np.array(dp),
        "same": float(np.mean(same)),
        "ppl_a": math.exp(a_.mean()),
        "ppl_b": math.exp(b_.mean()),
        "corr": float(np.corrcoef(a_, b_)[0, 1]),
        "worst": [(*where[i], kld[i]) for i in order],
    }


@pytest.fixture(params=["kernel", "torch"])
def rows_by(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """An accumulator test twice: each position's numbers from the numba kernel (the CPU's
    path) and from float64 torch ops (a device's)."""
    if request.param == "torch":
        monkeypatch.setattr(tokens_mod, "kernels", lambda: None)
    else:
        assert tokens_mod.kernels() is not None  # numba is a dependency: the kernel runs
    return str(request.param)


def _close(got: float | None, want: float) -> bool:
    return got is not None and got == pytest.approx(want, rel=1e-9, abs=1e-12)


@pytest.mark.kernels
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("chunk", [64, 3])
def test_the_statistics_equal_llama_perplexity_s_formulas(
    side: str, chunk: int, monkeypatch: pytest.MonkeyPatch, rows_by: str
) -> None:
    monkeypatch.setattr(tokens_mod, "CHUNK", chunk)
    seqs = _sequences()
    want = _oracle(seqs)
    acc = TokenAccumulator()
    # two batches: sequences are numbered across them
    for part in (seqs[:4], seqs[4:]):
        ids, mask, la, lb = _batch(part, side)
        acc.add(la, lb, ids, mask)
    got = acc.summary(token_text=lambda t: f"<{t}>")
    assert got.count == want["count"] == sum(len(s[0]) - 1 for s in seqs)
    assert got.nonfinite == 0
    k = want["kld"]
    assert isinstance(k, np.ndarray)
    assert _close(got.kld["mean"], float(want["kld_mean"]))  # type: ignore[arg-type]
    assert _close(got.kld["stderr"], float(want["kld_stderr"]))  # type: ignore[arg-type]
    assert _close(got.kld["max"], float(k.max()))
    for q in PERCENTILES:
        assert _close(got.kld[f"p{q:g}"], float(np.percentile(k, q)))
    rev, dp = want["rev"], want["dp"]
    assert isinstance(rev, np.ndarray) and isinstance(dp, np.ndarray)
    assert _close(got.kld_reverse["mean"], float(rev.mean()))
    assert _close(got.kld_reverse["p50"], float(np.percentile(rev, 50)))
    assert _close(got.delta_p["rms"], math.sqrt(float((dp * dp).mean())))
    for q in (99.0, 90.0, 50.0, 10.0, 1.0):
        assert _close(got.delta_p[f"p{q:g}"], float(np.percentile(dp, q)))
    assert got.same_top1 == want["same"]
    assert _close(got.ppl_a, want["ppl_a"])  # type: ignore[arg-type]
    assert _close(got.ppl_b, want["ppl_b"])  # type: ignore[arg-type]
    assert _close(got.ppl_ratio, want["ppl_b"] / want["ppl_a"])  # type: ignore[operator]
    assert _close(got.ln_ppl_corr, want["corr"])  # type: ignore[arg-type]
    worst = want["worst"]
    assert isinstance(worst, list)
    assert [(w["sequence"], w["position"], w["token"]) for w in got.worst] == [
        (s, t, tok) for s, t, tok, _ in worst
    ]
    assert all(_close(w["kld"], v) for w, (*_, v) in zip(got.worst, worst, strict=True))
    assert got.worst[0]["text"] == f"<{got.worst[0]['token']}>"


@pytest.mark.kernels
def test_a_side_against_itself_is_zero_exactly(rows_by: str) -> None:
    seqs = _sequences(1)
    ids, mask, la, _ = _batch(seqs, "left")
    acc = TokenAccumulator()
    acc.add(la, la.clone(), ids, mask)
    got = acc.summary()
    assert got.kld["mean"] == 0.0 and got.kld["max"] == 0.0 and got.kld["p99.9"] == 0.0
    assert got.kld_reverse["max"] == 0.0
    assert got.same_top1 == 1.0 and got.delta_p["rms"] == 0.0
    assert got.ppl_ratio == 1.0 and got.ln_ppl_corr == pytest.approx(1.0)


@pytest.mark.kernels
def test_a_position_whose_distribution_is_not_finite_is_left_out_and_counted(rows_by: str) -> None:
    seqs = _sequences(2)
    ids, mask, la, lb = _batch(seqs, "right")
    lb[0, 2, 5] = math.nan
    lb[3, 4, :] = -math.inf  # no token possible
    acc = TokenAccumulator()
    acc.add(la, lb, ids, mask)
    got = acc.summary()
    assert got.nonfinite == 2
    assert got.count == sum(len(s[0]) - 1 for s in seqs) - 2
    assert got.kld["mean"] is not None and math.isfinite(got.kld["mean"])


@pytest.mark.kernels
def test_a_token_one_side_rules_out_adds_nothing_one_way_and_infinity_the_other(
    rows_by: str,
) -> None:
    """A logit of -inf on side A only (a token A can never give): KL(A‖B) leaves it out
    (p_A = 0), KL(B‖A) is +inf there (JSON null: no finite figure); the kernel and torch ops
    alike, float16 and bfloat16 logits read as they come."""
    seqs = _sequences(3)
    ids, mask, la, lb = _batch(seqs, "right")
    la[0, 1, 4] = -math.inf
    lb[0, 1, 4] = 2.0
    acc = TokenAccumulator()
    acc.add(la, lb, ids, mask)
    got = acc.summary()
    assert got.nonfinite == 0 and got.count == sum(len(s[0]) - 1 for s in seqs)
    assert got.kld_reverse["max"] is None and got.kld_reverse["mean"] is None  # +inf: no figure
    assert got.kld["max"] is not None and math.isfinite(got.kld["max"])
    for dtype in (torch.float16, torch.bfloat16):
        low = TokenAccumulator()
        low.add(la.to(dtype), lb.to(dtype), ids, mask)
        want = TokenAccumulator()
        want.add(la.to(dtype).double(), lb.to(dtype).double(), ids, mask)
        assert low.summary().kld == want.summary().kld


@pytest.mark.parametrize("bad", [VOCAB, -1])
def test_a_token_id_outside_the_logits_is_one_line(bad: int) -> None:
    """A tokenizer whose ids reach past the model's logits: refused, never read out of
    bounds (the kernel indexes the row by the id)."""
    ids, mask, la, lb = _batch(_sequences(4), "left")
    ids[0, -1] = bad
    with pytest.raises(UsageError, match="outside the model's 50 logits"):
        TokenAccumulator().add(la, lb, ids, mask)


def test_sides_of_different_vocabularies_are_refused() -> None:
    acc = TokenAccumulator()
    with pytest.raises(ValueError, match="differ in shape"):
        acc.add(torch.zeros(1, 3, 5), torch.zeros(1, 3, 6), torch.zeros(1, 3, dtype=torch.long))


def test_nothing_to_predict_gives_no_figures() -> None:
    acc = TokenAccumulator()
    acc.add(torch.zeros(2, 1, 5), torch.zeros(2, 1, 5), torch.zeros(2, 1, dtype=torch.long))
    got = acc.summary()
    assert got.count == 0 and got.kld["mean"] is None and got.ppl_a is None


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.llm import save

    return save(tmp_path_factory.mktemp("tiny_llama"), "llama")


def _diff_json(*args: str) -> tuple[int, dict[str, Any]]:
    r = runner.invoke(app, ["diff", *args, "-f", "json"])
    assert r.exit_code in (0, 1), (r.exit_code, r.stdout, r.stderr)
    return r.exit_code, json.loads(r.stdout)


def test_diff_on_a_text_file_reports_the_next_tokens_as_the_formulas_give_them(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """`diff --text-file` on a causal LM: the token statistics of side B (bfloat16) against A
    (float32) over the file's lines, padded into one batch, equal the oracle computed on
    transformers' own logits of the same batch, sequence by sequence without the padding."""
    from tests.support.llm import LINES

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(LINES) + "\n")
    code, data = _diff_json(f"hf:{tiny_llama}", "--text-file", str(corpus), "--b", "bfloat16")
    tokens = data["tokens"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    enc = tok(LINES, padding=True, return_tensors="pt")
    assert list(enc["input_ids"].shape) == data["input"]["shapes"][0]
    with torch.no_grad():
        a = model(**enc).logits
        b = copy.deepcopy(model).to(torch.bfloat16)(**enc).logits.float()
    seqs = []
    for i in range(len(LINES)):
        real = enc["attention_mask"][i].bool()
        seqs.append((enc["input_ids"][i][real], a[i][real], b[i][real]))
    want = _oracle(seqs)
    assert tokens["count"] == want["count"] == sum(int(m.sum()) - 1 for m in enc["attention_mask"])
    assert tokens["kld"]["mean"] == pytest.approx(want["kld_mean"], rel=1e-6)
    assert tokens["kld"]["mean"] > 0  # bfloat16 rounds: the sides differ
    assert tokens["same_top1"] == want["same"]
    assert tokens["ppl_a"] == pytest.approx(want["ppl_a"], rel=1e-6)
    assert tokens["ppl_b"] == pytest.approx(want["ppl_b"], rel=1e-6)
    worst = want["worst"]
    assert isinstance(worst, list)
    assert [(w["sequence"], w["position"], w["token"]) for w in tokens["worst"]] == [
        (s, t, n) for s, t, n, _ in worst
    ]
    assert tokens["worst"][0]["text"] == tok.decode([worst[0][2]])
    # the rules: a mean KLD past the bound fails (exit 1), naming it
    assert code == 0
    r = runner.invoke(
        app,
        ["diff", f"hf:{tiny_llama}", "--text-file", str(corpus), "--b", "bfloat16",
         "--max-kld", "1e-12", "--min-same-top1", "0.5"],
    )  # fmt: skip
    assert r.exit_code == 1, r.stdout
    assert "mean KL(A||B)" in r.stdout and "--max-kld 1e-12" in r.stdout
    assert "same top-1" in r.stdout  # the table's lines


def test_a_side_diffed_with_itself_has_no_token_distance(tiny_llama: Path) -> None:
    code, data = _diff_json(
        f"hf:{tiny_llama}", "--text", LINE, "--b", "float32", "--max-kld", "0", "--no-own"
    )
    tokens = data["tokens"]
    assert tokens["kld"]["mean"] == 0.0 and tokens["kld"]["max"] == 0.0
    assert tokens["same_top1"] == 1.0 and tokens["ppl_ratio"] == 1.0
    assert code == 0 and data["token_rules"] == {"max_kld": 0.0}


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--max-kld", "-1"], "--max-kld must be"),
        (["--min-same-top1", "1.5"], "--min-same-top1 must be"),
        (["--max-kld", "nan"], "--max-kld cannot be NaN"),
    ],
)
def test_token_rules_out_of_range_are_one_line(
    tiny_llama: Path, args: list[str], said: str
) -> None:
    r = runner.invoke(app, ["diff", f"hf:{tiny_llama}", "--text", LINE, "--b", "bfloat16", *args])
    assert r.exit_code == 2 and said in r.stderr and "Traceback" not in r.stderr


def test_token_rules_need_text() -> None:
    r = runner.invoke(app, ["diff", "resnet18", "--b", "bfloat16", "--max-kld", "0.1"])
    assert r.exit_code == 2 and "no text was given" in r.stderr


def test_token_rules_over_texts_of_one_token_fail_saying_there_was_nothing_to_judge(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """No text predicts a next token of its own: the rule said "mean KL not finite"; it
    fails (exit 1) saying there was no position to judge."""
    corpus = tmp_path / "one.txt"
    corpus.write_text("cat\na\n")  # (one token each to this tokenizer)
    code, data = _diff_json(
        f"hf:{tiny_llama}", "--text-file", str(corpus), "--b", "bfloat16", "--max-kld", "0.1"
    )
    assert code == 1 and data["tokens"]["count"] == 0
    assert data["token_failures"] == [
        "no position to judge: no text has a next token of its own (each is one token)"
    ]


def test_a_file_report_names_every_failure_on_stderr(tiny_llama: Path) -> None:
    """With -f json, stderr named the first row past tolerance alone, not the token rules
    that failed with it."""
    r = runner.invoke(
        app,
        ["diff", f"hf:{tiny_llama}", "--text", LINE, "--b", "bfloat16", "--tol", "1e-9",
         "--max-kld", "1e-12", "-f", "json"],
    )  # fmt: skip
    assert r.exit_code == 1
    assert "first past tolerance" in r.stderr and "failed: mean KL(A||B)" in r.stderr


def test_a_corpus_in_batches_gives_what_one_batch_gives(tiny_llama: Path, tmp_path: Path) -> None:
    """A --text-file longer than a batch runs in batches, each padded to the corpus' longest
    text: the same positions, the same figures as the texts in one batch, and the worst
    positions numbered by their text in the corpus."""
    from tests.support.llm import LINES

    words = " ".join(LINES).split() * 3
    lines = [" ".join(words[i : i + 3 + i % 5]) for i in range(0, 40, 2)]
    assert len(lines) == 20 and all(lines)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n")
    common = ["--text-file", str(corpus), "--b", "bfloat16", "--no-own", "-l", "lm_head"]
    _, whole = _diff_json(f"hf:{tiny_llama}", *common)
    _, batched = _diff_json(f"hf:{tiny_llama}", *common, "--batch-size", "3")
    a, b = whole["tokens"], batched["tokens"]
    assert b["count"] == a["count"] > 0
    assert b["kld"]["mean"] == pytest.approx(a["kld"]["mean"], rel=1e-4)
    assert b["ppl_a"] == pytest.approx(a["ppl_a"], rel=1e-6)
    assert b["same_top1"] == a["same_top1"]
    placed = [(w["sequence"], w["position"], w["token"]) for w in b["worst"]]
    assert placed == [(w["sequence"], w["position"], w["token"]) for w in a["worst"]]
    assert max(s for s, _, _ in placed) >= 3  # (texts past the first batch, numbered as such)
    assert batched["input"]["description"] == f"20 texts from {corpus}"
    assert any("over all 20 texts" in n for n in batched["notes"])


def test_token_rules_need_side_b_s_own_distributions(tiny_llama: Path) -> None:
    """--isolate feeds B the reference's inputs: refused before anything runs."""
    r = runner.invoke(
        app,
        ["diff", f"hf:{tiny_llama}", "--text", LINE, "--b", "bfloat16", "--isolate",
         "--max-kld", "0.1"],
    )  # fmt: skip
    assert r.exit_code == 2 and "--isolate feeds side B" in r.stderr


def test_token_rules_on_saved_reports_are_refused(tmp_path: Path) -> None:
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text("{}")
    r = runner.invoke(
        app, ["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--max-kld", "0.1"]
    )
    assert r.exit_code == 2 and "two saved reports" in r.stderr


def test_a_snapshot_of_the_accumulator_rolls_back(tiny_llama: Path) -> None:
    """diff's side-by-side rounds snapshot what a side accumulated (copy.deepcopy) and roll
    back to it when a batch must run again: the snapshot is not changed by later batches."""
    seqs = _sequences(3)
    ids, mask, la, lb = _batch(seqs[:3], "left")
    acc = TokenAccumulator()
    acc.add(la, lb, ids, mask)
    snap = copy.deepcopy(acc)
    before = snap.summary()
    ids2, mask2, la2, lb2 = _batch(seqs[3:], "left")
    acc.add(la2, lb2, ids2, mask2)
    assert acc.summary().count > before.count
    assert snap.summary() == before


@pytest.mark.parametrize("side", ["right", "left"])
def test_the_layers_figures_of_a_padded_corpus_leave_the_padding_out(
    tiny_llama: Path, tmp_path: Path, side: str
) -> None:
    """Each layer's relative L2 (and own, fed A's input) over a padded batch is that of the
    real tokens: the oracle hooks both transformers models on the same padded batch and keeps
    the real positions, float64. (It counted the padding: another figure per padding side.)"""
    from tests.support.llm import LINES

    b_folder = tmp_path / "b"
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    other = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.1 * p.std().clamp_min(1e-3))
    other.save_pretrained(b_folder)
    transformers.AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(b_folder)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(LINES) + "\n")
    names = ["model.embed_tokens", "model.layers.0.mlp.down_proj", "model.norm", "lm_head"]
    _, data = _diff_json(
        f"hf:{tiny_llama}", "--text-file", str(corpus), "--b", f"hf:{b_folder}",
        "--padding-side", side, *(x for n in names for x in ("--layer", n)), "--tol", "100",
    )  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    tok.padding_side = side
    enc = tok(LINES, padding=True, return_tensors="pt")
    real = enc["attention_mask"].bool()
    assert not bool(real.all())
    kept: dict[str, dict[str, torch.Tensor]] = {"a": {}, "b": {}, "in": {}}

    def hook(where: str, name: str) -> Any:
        def keep(_m: Any, args: Any, out: Any) -> None:
            kept[where][name] = out.detach().double()
            if where == "a" and args and args[0].is_floating_point():
                kept["in"][name] = args[0].detach()

        return keep

    handles = [
        m.get_submodule(n).register_forward_hook(hook(where, n))
        for where, m in (("a", model), ("b", other))
        for n in names
    ]
    with torch.no_grad():
        model(**enc)
        other(**enc)
        for h in handles:
            h.remove()
        own = {n: other.get_submodule(n)(kept["in"][n]).double() for n in kept["in"]}
    calls = {c["name"]: c["b"][0] for c in data["calls"]}
    for n in names:
        a, b = kept["a"][n][real], kept["b"][n][real]
        want = float((b - a).norm() / a.norm())
        assert calls[n]["rel_l2"] == pytest.approx(want, rel=1e-6), (n, side)
        assert calls[n]["numel"] == a.numel()
        if n in own:
            want_own = float((own[n][real] - a).norm() / a.norm())
            assert calls[n]["own_rel_l2"] == pytest.approx(want_own, rel=1e-5), (n, side)
