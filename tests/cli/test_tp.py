"""`--tp` (issue 51): a checkpoint loaded under torchrun with transformers' tensor-parallel plan
(`tp_plan="auto"`, gloo, 2 processes) and measured as the model it is. The oracle is the same
command without --tp in one process: every layer call's input, output and gradient statistics
and every parameter's norm and gradient equal within float rounding (inspect, grads, a padded
text file, --generate, check); the lens's tokens the same; rank 0 alone writes; a shard no style
declares (eager attention's per-head weights) says it is one rank's part; a model without a
plan, heads that do not divide, and --tp outside torchrun are each one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import assert_one_line_error, run
from tests.support.launch import run_torchrun
from tests.support.paths import ROOT
from tests.support.shardcmp import assert_same, entries
from tests.support.tp_cli import REFUSED, checkpoints, commands, watched
from tests.support.watchlogs import assert_same_run, read_steps

pytest.importorskip("transformers")
SCRIPT = ROOT / "tests" / "support" / "tp_cli.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[int, Any]]:
    """The checkpoints, the folder of the --tp runs' reports, and each rank's exit codes and
    output."""
    folder = tmp_path_factory.mktemp("checkpoints")
    out = tmp_path_factory.mktemp("tp")
    checkpoints(folder)
    run_torchrun(SCRIPT, [str(folder), str(out)], out)
    ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    return folder, out, ranks


def _single(folder: Path, tmp_path: Path, name: str) -> dict[str, Any]:
    args = commands(folder)[name]
    res = run(*args, "-o", str(tmp_path / f"{name}.json"))
    assert res.exit_code == 0, res.stderr
    return json.loads((tmp_path / f"{name}.json").read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", ["inspect", "grads", "qwen3", "texts", "generate", "check"])
def test_every_number_is_the_unsharded_models(
    runs: tuple[Path, Path, dict[int, Any]], tmp_path: Path, name: str
) -> None:
    folder, out, ranks = runs
    assert ranks[0][name]["code"] == 0, ranks[0][name]["stderr"]
    assert ranks[1][name]["code"] == 0, ranks[1][name]["stderr"]
    sharded = json.loads((out / f"{name}.json").read_text())
    single = _single(folder, tmp_path, name)
    assert_same(sharded, single)
    found = entries(sharded)
    # a colwise projection's output: its whole features, not this rank's half
    q = next(
        v
        for k, v in found.items()
        if k[0].endswith("layers.0.self_attn.q_proj") and k[1] == "outputs"
    )
    assert q["shape"][-1] == 32
    if name == "grads":  # parameters whole: a rowwise weight's gradient over both shards
        grad = found[("model.layers.0.mlp.down_proj", "param grad", "weight")]
        assert grad["shape"] == [32, 64]
    if name == "generate":
        assert sharded["generated"] == single["generated"]
    if name == "check":
        assert sharded["checks"] == single["checks"]
    assert any("--tp: spread over 2 processes" in n for n in sharded["notes"])


def test_the_lens_reads_the_same_tokens(
    runs: tuple[Path, Path, dict[int, Any]], tmp_path: Path
) -> None:
    folder, out, ranks = runs
    assert ranks[0]["lens"]["code"] == 0, ranks[0]["lens"]["stderr"]
    sharded = json.loads((out / "lens.json").read_text())
    single = _single(folder, tmp_path, "lens")
    top = lambda r: [  # noqa: E731
        (c["layer"], c["position"], [t["index"] for t in c["top"]]) for c in r["lens"]
    ]
    assert top(sharded) == top(single)
    probs = [t["prob"] for c in sharded["lens"] for t in c["top"]]
    assert probs == pytest.approx([t["prob"] for c in single["lens"] for t in c["top"]], rel=1e-5)


def test_a_watched_training_run_logs_the_unsharded_models_numbers(
    runs: tuple[Path, Path, dict[int, Any]], tmp_path: Path
) -> None:
    """hookcli.watch on the model transformers' plan spread: every rank's log, step by step,
    equals one process's (each layer call's tensors, each parameter's norms and update)."""
    folder, out, _ = runs
    watched(folder, tmp_path / "single.jsonl", tp=False)
    single = read_steps(tmp_path / "single.jsonl")
    for rank in (0, 1):
        assert_same_run(read_steps(out / f"watch.rank{rank}.jsonl"), single, rtol=1e-4)


def test_rank_0_alone_writes(runs: tuple[Path, Path, dict[int, Any]]) -> None:
    _, _, ranks = runs
    assert ranks[0]["stdout"]["code"] == ranks[1]["stdout"]["code"] == 0
    assert json.loads(ranks[0]["stdout"]["stdout"])["layers"]
    assert ranks[1]["stdout"]["stdout"] == ""


def test_a_shard_no_style_declares_says_it_is_one_ranks_part(
    runs: tuple[Path, Path, dict[int, Any]],
) -> None:
    _, out, _ = runs
    report = json.loads((out / "eager.json").read_text())
    weights = entries(report)[("model.layers.0.self_attn", "outputs", "out[1]")]
    assert weights["shape"] == [1, 2, 7, 7]  # this rank's 2 of the 4 heads' attention
    assert "this rank's part only" in weights["note"]
    whole = entries(report)[("model.layers.0.self_attn", "outputs", "out[0]")]
    assert not whole.get("note")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_model_tensor_parallel_cannot_spread_is_one_line(
    runs: tuple[Path, Path, dict[int, Any]], name: str
) -> None:
    _, _, ranks = runs
    for rank in (0, 1):
        seen = ranks[rank][name]
        assert seen["code"] == 2, seen
        lines = seen["stderr"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), seen["stderr"]
        assert REFUSED[name][1] in lines[0]


def test_tp_outside_torchrun_is_one_line(tmp_path: Path) -> None:
    res = run("inspect", "hf:llama", "--text", "x", "--tp")
    assert_one_line_error(res, 2, "--tp", "torchrun")
    res = run("inspect", "resnet18", "--tp", "--offload")
    assert_one_line_error(res, 2, "--offload and --tp", "choose one")
