"""The dtype each side ran in (issue 48): `diff --b float32` on a bfloat16 checkpoint compares
the checkpoint as loaded (bfloat16, as `inspect` runs it) with float32, and every report says
the dtype it ran in; a dtype diffed with itself says so. Oracle: transformers' own model, as
from_pretrained loads it and cast to float32 by hand, its logits compared in float64."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from hookcli.cli import app

transformers = pytest.importorskip("transformers")
runner = CliRunner()
TEXT = "The cat sat on the mat."


def _save(folder: Path, dtype: torch.dtype) -> Path:
    from tests.support.llm import llama_config, make_tokenizer

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config()).to(dtype).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("bf16_llama"), torch.bfloat16)


def _json(*args: str) -> Any:
    r = runner.invoke(app, [*args, "-f", "json"])
    assert r.exit_code in (0, 1), (r.exit_code, r.stdout, r.stderr)
    return json.loads(r.stdout)


def test_diff_of_a_bf16_checkpoint_against_float32_measures_bf16(bf16: Path) -> None:
    data = _json("diff", f"hf:{bf16}", "--text", TEXT, "--b", "float32", "-l", "lm_head")
    assert data["ran"]["A"].startswith("bfloat16") and data["ran"]["B"] == "float32"
    assert data["model"]["dtype"].startswith("bfloat16")
    # the oracle: the checkpoint as transformers loads it, and cast to float32
    model = transformers.AutoModelForCausalLM.from_pretrained(bf16).eval()
    assert next(model.parameters()).dtype == torch.bfloat16
    tok = transformers.AutoTokenizer.from_pretrained(bf16)
    enc = tok(TEXT, return_tensors="pt")
    with torch.no_grad():
        a = model(**enc).logits.double()
        b = model.float()(**enc).logits.double()
    want = float((b - a).norm() / a.norm())
    assert want > 1e-4  # bfloat16 rounds: the two sides differ
    (out,) = data["outputs"][0]["b"]
    assert out["rel_l2"] == pytest.approx(want, rel=1e-3)
    assert data["tol"] == 0.03 and "bfloat16" in data["tol_source"]  # the coarsest side
    r = runner.invoke(
        app, ["diff", f"hf:{bf16}", "--text", TEXT, "--b", "float32", "-l", "lm_head"]
    )
    assert "A (reference): as loaded (bfloat16" in r.stdout and "B: float32" in r.stdout


def test_inspect_says_the_dtype_it_ran_in(bf16: Path) -> None:
    data = _json("inspect", f"hf:{bf16}", "--text", TEXT, "-l", "lm_head", "--topk", "0")
    assert data["model"]["dtype"].startswith("bfloat16")
    assert data["layers"][0]["outputs"][0]["dtype"] == "bfloat16"
    r = runner.invoke(app, ["inspect", f"hf:{bf16}", "--text", TEXT, "-l", "lm_head"])
    assert "params, bfloat16" in r.stdout.splitlines()[0]


def test_a_dtype_diffed_with_itself_says_so(tmp_path: Path) -> None:
    folder = _save(tmp_path / "f32", torch.float32)
    data = _json("diff", f"hf:{folder}", "--text", TEXT, "--b", "float32", "-l", "lm_head")
    assert data["ran"] == {"A": "float32", "B": "float32"}
    assert any("compares the dtype with itself" in n for n in data["notes"])
    assert data["outputs"][0]["b"][0]["max_abs"] == 0
    # another dtype: no such note
    data = _json("diff", f"hf:{folder}", "--text", TEXT, "--b", "bfloat16", "-l", "lm_head")
    assert data["ran"] == {"A": "float32", "B": "bfloat16"}
    assert not any("with itself" in n for n in data["notes"])
