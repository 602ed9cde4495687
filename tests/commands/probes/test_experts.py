"""Expert routing of MoE models (issue 36): read from each router's own top-k output, padding
left out, merged by adding counts; check's rules. Oracle: each sequence run alone through
transformers, the router's input kept by an independent hook and its top-k taken by hand
(softmax over h·Wᵀ, topk)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from hookcli.commands.checks import evaluate, parse_rules
from hookcli.commands.experts import expert_stats, merge_experts
from hookcli.options import RuleOptions
from tests.support.oracles import hooks_left

transformers = pytest.importorskip("transformers")
runner = CliRunner()
TEXTS = ["The cat sat on the mat.", "hello", "A dog ran in the park."]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.llm import save

    return save(tmp_path_factory.mktemp("mixtral"), "mixtral")


def routing_by_hand(folder: Path) -> dict[str, list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    seen: dict[str, list[torch.Tensor]] = {}
    routers = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("Router")}
    handles = [
        m.register_forward_hook(lambda m, a, o, n=n: seen.setdefault(n, []).append(a[0].detach()))
        for n, m in routers.items()
    ]
    try:
        with torch.no_grad():
            for t in TEXTS:
                model(**tok(t, return_tensors="pt"))
    finally:
        for h in handles:
            h.remove()
    k = model.config.num_experts_per_tok
    counts = {}
    for name, inputs in seen.items():
        w = routers[name].weight.detach()
        total = [0] * w.shape[0]
        for h in inputs:
            probs = torch.softmax(h.reshape(-1, w.shape[1]).float() @ w.T.float(), dim=-1)
            for row in probs.topk(k, dim=-1).indices.tolist():
                for e in row:
                    total[e] += 1
        counts[name] = total
    return counts


def test_routing_is_the_routers_top_k_by_hand_padding_left_out(mixtral: Path) -> None:
    report = hookcli.inspect(f"hf:{mixtral}", text=TEXTS, device="cpu", topk=0)
    want = routing_by_hand(mixtral)
    assert report.experts is not None
    assert {e.layer: e.counts for e in report.experts} == want
    tokens = sum(len(s.ids) for s in report.input.texts or [])
    for e in report.experts:
        assert e.experts == 4 and e.top_k == 2 and e.tokens == tokens
        mean = sum(e.counts) / 4
        assert e.imbalance == pytest.approx(max(e.counts) / mean)
        assert e.dead == [i for i, c in enumerate(e.counts) if c == 0]
        p = torch.tensor(e.counts, dtype=torch.float64) / sum(e.counts)
        assert e.entropy == pytest.approx(float(-(p[p > 0] * p[p > 0].log()).sum()))


def test_merged_routing_is_one_runs(mixtral: Path) -> None:
    whole = hookcli.inspect(f"hf:{mixtral}", text=TEXTS, device="cpu", topk=0)
    parts = [hookcli.inspect(f"hf:{mixtral}", text=t, device="cpu", topk=0) for t in TEXTS]
    merged = merge_experts([p.experts or [] for p in parts])
    assert whole.experts == merged


def test_expert_rules_name_the_router_and_the_expert() -> None:
    base = hookcli.inspect(torch.nn.Linear(2, 2), torch.randn(1, 2))
    assert base.experts is None
    report = dataclasses.replace(base, experts=[expert_stats("mlp.gate", 4, 2, [6, 0, 1, 1])])
    results = evaluate(report, parse_rules(RuleOptions(fail_on=("dead-experts",),
                                                      max_expert_imbalance=2.5)))  # fmt: skip
    dead, busy = results
    assert not dead.passed and dead.first is not None and dead.first.channel == 1
    assert "1 of 4 experts got no token: [1]" in dead.first.message
    assert not busy.passed and busy.first is not None and busy.first.channel == 0
    assert busy.first.value == pytest.approx(3.0)


def test_check_reads_a_moe_models_routing(mixtral: Path) -> None:
    args = ["check", f"hf:{mixtral}", "--text", TEXTS[0]]
    r = runner.invoke(app, [*args, "--fail-on", "dead-experts", "--max-expert-imbalance", "1"])
    assert r.exit_code == 1, (r.stdout, r.stderr)
    assert "expert-imbalance: 2 of 2 routers with imbalance above 1" in r.stdout
    ok = runner.invoke(app, [*args, "--max-expert-imbalance", "4"])
    assert ok.exit_code == 0, (ok.stdout, ok.stderr)
    model = transformers.AutoModelForCausalLM.from_pretrained(mixtral)
    hookcli.inspect(model, torch.randint(3, 300, (1, 5)))
    assert hooks_left(model) == 0


def test_a_router_with_dropped_tokens_is_counted_without_breaking_the_forward() -> None:
    """Indices outside the experts (a dropped token's -1) are not counted; a router that
    raises in the hook is a note, never a broken forward."""

    class TopKRouter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 8))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = x @ self.weight.T
            return logits, torch.tensor([[0, -1], [3, 9], [3, 1]])

    class Moe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = TopKRouter()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.router(x)[0]

    model = Moe()
    report = hookcli.inspect(model, torch.randn(3, 8))
    assert report.experts is not None
    (e,) = report.experts
    assert e.counts == [1, 1, 0, 2] and e.dead == [2]
    assert hooks_left(model) == 0


def test_expert_rules_are_refused_over_a_folder_run() -> None:
    from tests.support.paths import CAT, COFFEE

    r = runner.invoke(app, ["check", "resnet18", str(CAT), str(COFFEE), "--batch-size", "1",
                            "--fail-on", "dead-experts"])  # fmt: skip
    assert r.exit_code == 2 and "not over a run in batches" in r.stderr, (r.stdout, r.stderr)


def test_a_text_file_in_batches_says_its_routing_is_not_read(tmp_path: Path) -> None:
    """40 texts (two batches of 32): the routing of a one-batch run is not merged over batches;
    it vanished without a word (experts null, no note). The report says so; the expert rules
    are refused with the way round (at most 32 texts), not a folder's reason."""
    from tests.support.llm import save

    folder = save(tmp_path / "mixtral", "mixtral")
    texts = tmp_path / "t.txt"
    texts.write_text("\n".join(f"the cat sat {i}" for i in range(40)))
    args = ["hf:" + str(folder), "--text-file", str(texts), "-l", "lm_head"]
    r = runner.invoke(app, ["inspect", *args, "--topk", "0", "-f", "json"])
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["experts"] is None
    assert any("expert routing is read on one batch: this run in 2 batches" in n
               for n in report["notes"])  # fmt: skip
    r = runner.invoke(app, ["check", *args, "--fail-on", "dead-experts"])
    assert r.exit_code == 2 and "give at most 32 texts" in r.stderr, r.stderr


def test_routers_holding_their_weight_in_a_linear_are_read() -> None:
    """A router whose (experts, hidden) weight is its one Linear's (Gemma 4's router.proj) and
    a MoE gate (HunYuan's MoEV1Gate, its weight in .wg) were never read: experts null, and
    check's expert rules passed, saying the model has no experts. Oracle: top-2 by hand."""

    class ProjRouter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 4, bias=False)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.proj(x)
            return logits, logits.topk(2, dim=-1).indices

    class HunYuanMoEV1Gate(ProjRouter):
        def __init__(self) -> None:
            super().__init__()
            self.wg = self.proj  # (one Linear, under another name)
            del self.proj

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.wg(x)
            return logits, logits.topk(2, dim=-1).indices

    class Moe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router, self.gate = ProjRouter(), HunYuanMoEV1Gate()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.router(x)[0] + self.gate(x)[0]

    torch.manual_seed(0)
    model, x = Moe(), torch.randn(5, 8)
    report = hookcli.inspect(model, x, topk=0)
    assert report.experts is not None
    got = {e.layer: e.counts for e in report.experts}
    for name, linear in (("router", model.router.proj), ("gate", model.gate.wg)):
        picked = (x @ linear.weight.T).topk(2, dim=-1).indices.reshape(-1)
        assert got[name] == torch.bincount(picked, minlength=4).tolist(), name


def test_a_routers_packed_linear_counts_its_experts_by_out_features() -> None:
    """A quantized router Linear (bitsandbytes packs its weight: (n_packed, 1)) has as many
    experts as its out_features, not its weight's first dimension."""

    class Packed(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(8, 4, bias=False)
            self.dense = self.weight.detach().clone()
            self.weight = torch.nn.Parameter(torch.zeros(16, 1))  # packed bytes

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.dense.T

    class GateRouter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = Packed()

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.proj(x)
            return logits, logits.topk(2, dim=-1).indices

    report = hookcli.inspect(GateRouter(), torch.randn(5, 8), topk=0)
    assert report.experts is not None
    (e,) = report.experts
    assert e.experts == 4 and sum(e.counts) == 10


def test_expert_rules_that_read_no_router_fail_saying_why() -> None:
    """--fail-on dead-experts on a model without a router passed ("not a mixture-of-experts
    model"): a rule that checked nothing fails, and says it read no router."""
    report = hookcli.check(torch.nn.Linear(2, 2), torch.randn(1, 2), fail_on="dead-experts")
    (result,) = report.checks
    assert not result.passed and "no MoE router was read" in result.message
    assert hookcli.exit_code(report) == 1
