"""diff on a model whose layers pass sparse (COO) tensors: each compared as its dense values,
zeros included, as inspect measures it; a sparse input fed to a layer in its own layout for
the own error. Oracle: the two sides' layers run by hand, in float64."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.commands.diff import diff_report, parse_side
from hookcli.options import InputOptions, ModelOptions, Selection
from tests.support.diff import assert_differences, differences_by_hand, leaf_outputs
from tests.support.models import SparseChain

pytestmark = pytest.mark.kernels  # the second CI pass reruns these on generic x86-64

MODEL = "tests/support/models.py:SparseChain"
runner = CliRunner()


def _sides(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)  # as hookcli builds a custom model: seed, then construct
    model = SparseChain().eval().to(dtype)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    return model, x


@pytest.mark.parametrize("isolate", [False, True])
def test_sparse_tensors_are_compared_as_their_dense_values(isolate: bool) -> None:
    report = diff_report(
        ModelOptions(MODEL, device="cpu"),
        Selection(),
        InputOptions(specs=("randn:8x16",)),
        parse_side("float32", "--a"),
        parse_side("float64", "--b"),
        isolate=isolate,
    )
    a_model, xa = _sides(torch.float32)
    b_model, xb = _sides(torch.float64)
    ref = {k: v.to_dense() for k, v in leaf_outputs(a_model, xa).items()}
    got = {k: v.to_dense() for k, v in leaf_outputs(b_model, xb).items()}
    if isolate:  # smm and l2 fed A's input (smm's as A's sparse tensor, widened)
        with torch.no_grad():
            fed_smm = torch.relu(a_model.l1(xa)).double().to_sparse()
            got["smm"] = b_model.smm(fed_smm).to_dense()
            got["l2"] = b_model.l2(ref["smm"].double())
    rows = {c.name: c.b[0] for c in report.calls}
    assert sorted(rows) == ["l1", "l2", "smm"]
    assert not [c.error for c in report.calls if getattr(c, "error", None)]
    for name in ("l1", "smm", "l2"):
        assert_differences(rows[name], differences_by_hand(ref[name], got[name]))


def test_the_cli_compares_sparse_outputs_side_by_side() -> None:
    """The command's own way (the two sides' passes in lockstep): it read a sparse output's
    memory as a strided tensor's and ended in an internal error."""
    r = runner.invoke(app, ["diff", MODEL, "-i", "randn:8x16", "--b", "float64", "-f", "json"])
    assert r.exit_code == 0, r.stderr
    rows = {c["name"]: c["b"][0] for c in json.loads(r.stdout)["calls"]}
    a_model, xa = _sides(torch.float32)
    b_model, xb = _sides(torch.float64)
    ref, got = leaf_outputs(a_model, xa)["smm"], leaf_outputs(b_model, xb)["smm"]
    want = differences_by_hand(ref.to_dense(), got.to_dense())
    assert rows["smm"]["rel_l2"] == pytest.approx(want["rel_l2"], rel=1e-9)
    assert rows["smm"]["max_abs"] == pytest.approx(want["max_abs"], rel=1e-9)
