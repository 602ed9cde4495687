"""Position tables are not activations for check's per-channel rules (issue 48): a Llama's
`rotary_emb` returns cos/sin tables whose kurtosis and outlier ratio say nothing of the
model's health. They are left out of --max-kurtosis, --max-outlier-ratio and --fail-on
massive, the check says which, and a table named with -l is held to the rules. Oracle: the
kurtosis and outlier ratio of the tables and of the activations, computed here by torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.commands.checks import is_position_table

transformers = pytest.importorskip("transformers")
runner = CliRunner()
TEXT = "Once upon a time there was a model."


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.llm import save

    return save(tmp_path_factory.mktemp("tables_llama"), "llama")


def _kurtosis(x: torch.Tensor) -> float:
    x = x.double().reshape(-1)
    d = x - x.mean()
    return float((d**4).mean() / (d**2).mean() ** 2)


def _outputs(folder: Path) -> dict[str, list[torch.Tensor]]:
    """Every module's floating outputs on TEXT, by transformers' own forward."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name: str) -> Any:
        def hook(_m: Any, _a: Any, out: Any) -> None:
            outs = out if isinstance(out, tuple) else (out,)
            seen[name] = [o.detach() for o in outs if isinstance(o, torch.Tensor)]

        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            model(**tok(TEXT, return_tensors="pt"))
    finally:
        for h in handles:
            h.remove()
    return seen


def _check(folder: Path, *extra: str) -> Any:
    r = runner.invoke(app, ["check", f"hf:{folder}", "--text", TEXT, "-f", "json", *extra])
    assert r.exit_code in (0, 1), (r.exit_code, r.stdout, r.stderr)
    return r, json.loads(r.stdout)


def test_rotary_tables_are_left_out_of_the_rules_unless_named(llama: Path) -> None:
    outputs = _outputs(llama)
    tables = outputs["model.rotary_emb"]
    assert len(tables) == 2  # cos, sin
    table_k = max(_kurtosis(t) for t in tables)
    others = {
        n: max(_kurtosis(t) for t in ts if t.is_floating_point() and t.numel() > 1)
        for n, ts in outputs.items()
        if n != "model.rotary_emb" and any(t.is_floating_point() for t in ts)
    }
    # the oracle's point: the tables' kurtosis is past every activation's output
    assert table_k > max(others.values())
    limit = (table_k + max(others.values())) / 2
    r, data = _check(llama, "--max-kurtosis", f"{limit:g}", "-l", "model.*")
    (rule,) = [c for c in data["checks"] if c["rule"] == "kurtosis"]
    failed = {f["layer"] for f in rule["failures"]}
    assert "model.rotary_emb" not in failed
    assert "position tables left out (not activations): model.rotary_emb" in rule["message"]
    # named, it is held to the rule (and fails it, as its kurtosis says)
    r, data = _check(llama, "--max-kurtosis", f"{limit:g}", "-l", "model.rotary_emb")
    (rule,) = [c for c in data["checks"] if c["rule"] == "kurtosis"]
    assert r.exit_code == 1 and {f["layer"] for f in rule["failures"]} == {"model.rotary_emb"}
    assert "left out" not in rule["message"]


def test_outlier_ratio_and_massive_leave_the_tables_out_too(llama: Path) -> None:
    _, data = _check(llama, "--max-outlier-ratio", "1", "--fail-on", "massive")
    for rule in data["checks"]:
        if rule["rule"] in ("outlier-ratio", "massive"):
            assert "model.rotary_emb" in rule["message"], rule
            assert all(f["layer"] != "model.rotary_emb" for f in rule["failures"] or [])


@pytest.mark.parametrize(
    ("name", "type_", "table"),
    [
        ("model.rotary_emb", "LlamaRotaryEmbedding", True),
        ("transformer.wpe", "Embedding", True),
        ("model.decoder.embed_positions", "OPTLearnedPositionalEmbedding", True),
        ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias", "Embedding", True),
        ("model.embed_tokens", "Embedding", False),
        ("model.layers.0.mlp", "LlamaMLP", False),
    ],
)
def test_what_counts_as_a_position_table(name: str, type_: str, table: bool) -> None:
    assert is_position_table(name, type_) is table
