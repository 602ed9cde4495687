"""Models sharded by torch's distributed engine, measured as the tensors they stand for (issue 51):
tensor parallel (ColwiseParallel then RowwiseParallel, on 2 and 4 processes), FSDP2 and DDP (each
rank on its own rows, merged into the global batch), and both on a (dp, tp) mesh of 4, under a
real torchrun (gloo, CPU). The oracle is the same model unsharded in one
process on the same input: every layer call's input, output and gradient statistics and every
parameter's norm and gradient equal within float rounding, in `grads` and in a `watch`ed run's
log; a shard no parallel style declares says it is one rank's part. Also: the merge of parts'
rows against float64 torch, and a failure inside `watch` that leaves the training running."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookcli
from hookcli.commands.watch import runmerge
from hookcli.engine.sharded import merged_row
from hookcli.engine.stats import StatsCollector
from tests.support.launch import run_python, run_torchrun
from tests.support.paths import ROOT
from tests.support.shardcmp import STATS, assert_same, entries
from tests.support.watchlogs import assert_same_run, read_steps

SCRIPT = ROOT / "tests" / "support" / "sharded_run.py"


def _run(tmp_path: Path, kind: str, procs: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sharded run (torchrun, `procs` processes) and the single one: their reports."""
    run_torchrun(SCRIPT, [str(tmp_path), kind], tmp_path, procs)
    run_python([str(SCRIPT), str(tmp_path), kind, "--single"], tmp_path)
    read = lambda name: json.loads((tmp_path / name).read_text())  # noqa: E731
    return read(f"{kind}.sharded.json"), read(f"{kind}.single.json")


@pytest.mark.parametrize("procs", [2, 4])
def test_tensor_parallel_layers_are_measured_as_the_whole_tensors(
    tmp_path: Path, procs: int
) -> None:
    """Colwise then Rowwise: the first Linear's output (sharded on its last dimension, handed on
    as a local shard), the ReLU between (a plain module fed that shard), the Rowwise output
    (a partial sum), the weights (Shard(0), Shard(1)) and every gradient: the global numbers,
    on every rank, with the global shapes; and the same in a watched training run's log."""
    sharded, single = _run(tmp_path, "tp", procs)
    assert_same(sharded, single)
    assert entries(sharded)[("1", "outputs", "out")]["shape"] == [6, 32]
    assert_same_run(
        read_steps(tmp_path / "tp.sharded.rank0.jsonl"), read_steps(tmp_path / "tp.single.jsonl")
    )
    for r in range(1, procs):  # every rank logs the whole tensors' numbers
        assert_same_run(
            read_steps(tmp_path / f"tp.sharded.rank{r}.jsonl"),
            read_steps(tmp_path / "tp.single.jsonl"),
        )
    # merged as `hookcli report` merges rank logs: the ranks share one batch, counted once
    merged = runmerge.load_run([tmp_path / f"tp.sharded.rank{r}.jsonl" for r in range(procs)])
    assert merged.ranks == 1 and "ranks share their data" in merged.notes[0]
    assert_same_run(merged.steps, read_steps(tmp_path / "tp.single.jsonl"))


def test_a_row_wise_embedding_is_measured_and_its_style_still_reduces_it(tmp_path: Path) -> None:
    """A token embedding split by rows (RowwiseParallel, torchtitan's plan): its output is a
    partial sum whose mask its style's own reduction uses up after hookcli's hook has read
    the whole tensor; grads and the watched training run as they do unsharded (the training
    was stopped at its first watched step)."""
    sharded, single = _run(tmp_path, "tp-emb", 2)
    assert_same(sharded, single)
    assert entries(sharded)[("0", "outputs", "out")]["shape"] == [6, 5, 8]
    for r in range(2):
        assert_same_run(
            read_steps(tmp_path / f"tp-emb.sharded.rank{r}.jsonl"),
            read_steps(tmp_path / "tp-emb.single.jsonl"),
        )


def test_a_target_reads_the_whole_output_a_style_hands_on_as_a_rank_part(
    tmp_path: Path,
) -> None:
    """The last Linear ColwiseParallel: the model's output is each rank's columns, a plain
    tensor. grads' top-1 target is each row's largest of every column (it was each rank's own
    columns' largest: twice the ones in the output gradient, every gradient wrong), its value
    the whole's on every rank."""
    sharded, single = _run(tmp_path, "tp-last", 2)
    assert_same(sharded, single)
    assert sharded["backward"]["value"] == pytest.approx(single["backward"]["value"], rel=1e-6)
    grad = entries(sharded)[("2", "grad_outputs", "out")]
    assert grad["shape"] == [6, 8] and grad["zeros"] == pytest.approx(1 - 6 / 48)
    # a loss against a plain target (it refused the DTensor), and the top-3 predictions over
    # every class (they were each rank's columns')
    mse, alone = sharded["mse"], single["mse"]
    assert_same(mse, alone)
    assert mse["backward"]["value"] == pytest.approx(alone["backward"]["value"], rel=1e-6)
    picks = [(p["image"], p["index"]) for p in mse["predictions"]]
    assert picks == [(p["image"], p["index"]) for p in alone["predictions"]]
    for p, q in zip(mse["predictions"], alone["predictions"], strict=True):
        assert p["prob"] == pytest.approx(q["prob"], rel=1e-5)


@pytest.mark.parametrize("kind", ["tp-shared", "fsdp-shared"])
def test_an_input_two_parallel_layers_read_has_its_whole_gradient_in_each(
    tmp_path: Path, kind: str
) -> None:
    """A gated MLP's input, read by `gate` and `up`: each one's input gradient is the whole
    ∂target/∂input, through both, as in one process (docs/grads.md) — not the part through
    itself alone, which is what the tensor a style's or FSDP's input hook makes from it gets."""
    if kind == "tp-shared":
        sharded, single = _run(tmp_path, kind, 2)
        assert_same(sharded, single)
    else:
        sharded = _assert_global_batch(tmp_path, kind, 2, first="pre")
    a = entries(sharded)
    gate, up = a[("gate", "grad_inputs", "in[0]")], a[("up", "grad_inputs", "in[0]")]
    pre = a[("pre", "grad_outputs", "out")]  # (the same tensor's gradient: the whole one)
    for s in ("mean", "norm", "min", "max"):
        assert gate[s] == pytest.approx(pre[s], rel=1e-6) and up[s] == pytest.approx(pre[s])


def test_sequence_parallel_blocks_are_measured_as_the_whole_tensors(tmp_path: Path) -> None:
    """Sequence parallel: each rank's block of rows gathered by ColwiseParallel, the Rowwise
    output reduce-scattered back into blocks, a LayerNorm (SequenceParallel) on each block:
    every call and gradient the global numbers, with global shapes, in grads and in a watched
    run's log."""
    sharded, single = _run(tmp_path, "sp", 2)
    assert_same(sharded, single)
    assert entries(sharded)[("3", "outputs", "out")]["shape"] == [6, 8]
    assert_same_run(
        read_steps(tmp_path / "sp.sharded.rank0.jsonl"), read_steps(tmp_path / "sp.single.jsonl")
    )


def test_a_shard_no_style_declares_says_it_is_one_ranks_part(tmp_path: Path) -> None:
    """The ReLU after a ColwiseParallel Linear, as the model's last module: its output is this
    rank's columns, which nothing later declares. Its row keeps the local shape and says so
    — never the shard shown as the tensor without a word; the Linear's are whole."""
    sharded, single = _run(tmp_path, "tp-open", 2)
    assert_same(sharded, single, but=("1",))
    out = entries(sharded)[("1", "outputs", "out")]
    assert out["shape"] == [6, 16]
    assert "this rank's part only" in out["note"] and "(6x32 over 2 ranks)" in out["note"]
    assert entries(sharded)[("1", "inputs", "in[0]")].get("note") is None  # the Linear's output
    # its gradient (the target's: ones, the same numbers on every rank) is that part's too,
    # and the backward value (a sum over this rank's part) says so
    grad = entries(sharded)[("1", "grad_outputs", "out")]
    assert grad["shape"] == [6, 16] and "this rank's part only" in grad["note"]
    assert any("the backward target read this rank's part" in n for n in sharded["notes"])


def test_parts_rows_merge_into_the_whole_tensors_row() -> None:
    """merged_row (Chan's update) against float64 torch on the whole: parts of other sizes,
    one empty, one all NaN/Inf, one constant."""
    torch.manual_seed(0)
    parts = [
        torch.randn(7) * 3 + 1,
        torch.empty(0),
        torch.tensor([float("nan"), float("inf")]),
        torch.full((5,), 2.5),
        torch.tensor([0.0, -4.0, 0.0, 1e-3]),
    ]
    collector = StatsCollector(backend="torch")
    handed = [collector.add(p, f"p{i}") for i, p in enumerate(parts)]
    collector.finalize()
    rows = [
        (
            t.numel - t.nan - t.inf, t.mean or math.nan, (t.std or 0.0) ** 2,
            t.min if t.min is not None else math.nan, t.max if t.max is not None else math.nan,
            (t.zeros or 0.0) * t.numel, t.nan, t.inf, t.norm or 0.0,
        )
        for t in handed
    ]  # fmt: skip
    row = merged_row(rows, 9)
    whole = torch.cat(parts).double()
    finite = whole[torch.isfinite(whole)]
    assert row[0] == finite.numel()
    assert row[1] == pytest.approx(float(finite.mean()), rel=1e-12)
    assert row[2] == pytest.approx(float(finite.var(correction=0)), rel=1e-12)
    assert (row[3], row[4]) == (float(finite.min()), float(finite.max()))
    assert (row[5], row[6], row[7]) == (2, 1, 1)  # zeros, NaN, Inf
    assert row[8] == pytest.approx(float(finite.norm()), rel=1e-12)
    nothing = merged_row([rows[1], rows[2]], 9)
    assert nothing[0] == 0 and math.isnan(nothing[1]) and nothing[6:8] == (1, 1)


def test_a_0d_tensor_of_a_data_parallel_rank_says_it_is_the_ranks_own() -> None:
    """A 0-d activation (a module returning x.mean()) has no batch dimension to merge over
    the data-parallel ranks: its row is this rank's value, and says so."""
    from hookcli.engine.sharded import ShardBook
    from hookcli.records import TensorStats

    book = ShardBook()
    book.batch_groups = (object(),)  # (a data-parallel group; nothing is gathered here)
    scalar = TensorStats("out", (), "float32", 1)
    said = book.plain(torch.tensor(0.5), scalar, 0, ("3", 0, "out"))
    assert said is not None and "this rank's own value" in said
    assert book.shards == []  # not merged as a batch
    batch = TensorStats("out", (3, 4), "float32", 12)
    assert book.plain(torch.zeros(3, 4), batch, 1, ("3", 0, "out")) is None
    assert [s.row for s in book.shards] == [1]


def test_a_failure_inside_watch_is_one_line_and_the_training_goes_on(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception inside the recorder (its step's line, here) never reaches the training
    loop: one stderr line names it, the watch records nothing more, its hooks stand aside and
    come off at exit, and every step of the loop runs."""
    from hookcli.commands.watch.capture import StepCapture

    def broken(self: Any, **kwargs: Any) -> Any:
        raise RuntimeError(".numpy() is not supported for tensor subclasses")

    monkeypatch.setattr(StepCapture, "line", broken)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model[0].weight.detach().clone()
    steps = 0
    with hookcli.watch(model, optimizer=opt) as w:
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            steps += 1
    assert steps == 4 and not torch.equal(before, model[0].weight)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "hookcli.watch: stopped recording at step 0 on rank 0: the watch failed (RuntimeError: "
        ".numpy() is not supported for tensor subclasses); the training goes on."
    ]
    assert w.failed is not None and list(w.records) == []
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert all(not m._forward_hooks for m in model.modules())


def test_fsdp2_ranks_batches_merge_into_the_global_batch(tmp_path: Path) -> None:
    """FSDP2 with each rank on its own rows (data parallel): every activation and activation
    gradient is the global batch's (shape and statistics: the merge over the data-parallel
    group), each parameter whole; its gradient is the average FSDP's reduce-scatter makes (the
    single process's over 2 ranks' summed losses, halved). The watched run's rank logs, merged
    as `hookcli report` merges them, equal the single process's log."""
    sharded = _assert_global_batch(tmp_path, "fsdp-dp", 2)
    # the per-parameter gradient norms' squares add up to clip_grad_norm_'s total
    norms = [p["grad_norm"] for c in sharded["layers"] for p in c.get("params") or []]
    assert len(norms) == 4
    assert math.sqrt(sum(n * n for n in norms)) == pytest.approx(sharded["clip_grad_norm"])
    merged = runmerge.load_run([tmp_path / f"fsdp-dp.sharded.rank{r}.jsonl" for r in (0, 1)])
    assert merged.ranks == 2 and merged.notes == [], merged.notes
    for r in (0, 1):  # FSDP's groups are data parallel: no rank's rows taken for TP parts
        assert "tensor-parallel" not in (tmp_path / f"fsdp-dp.sharded.rank{r}.jsonl").read_text()
    assert_same_run(merged.steps, read_steps(tmp_path / "fsdp-dp.single.jsonl"))


def test_a_2d_mesh_merges_along_each_dimension(tmp_path: Path) -> None:
    """FSDP2 over `dp` and the tensor-parallel MLP over `tp` of a (2, 2) mesh, each
    data-parallel index on its own rows: parameters (_StridedShard over dp, Shard over tp)
    whole, activations whole along tp and merged into the global batch along dp, gradients
    averaged over dp. Merged as `hookcli report` merges them, the four rank logs count one
    rank per data-parallel index, and equal one process's."""
    sharded = _assert_global_batch(tmp_path, "2d", 4)
    norms = [p["grad_norm"] for c in sharded["layers"] for p in c.get("params") or []]
    assert math.sqrt(sum(n * n for n in norms)) == pytest.approx(sharded["clip_grad_norm"])
    merged = runmerge.load_run([tmp_path / f"2d.sharded.rank{r}.jsonl" for r in range(4)])
    assert merged.ranks == 2 and "(ranks 0, 2)" in merged.notes[0], merged.notes
    assert_same_run(merged.steps, read_steps(tmp_path / "2d.single.jsonl"))


def _assert_global_batch(tmp_path: Path, kind: str, procs: int, first: str = "0") -> dict[str, Any]:
    """The sharded report equals the single one, activations over the global batch (each of
    2 data-parallel indices held 3 of its 6 rows), parameter gradients averaged over them."""
    sharded, single = _run(tmp_path, kind, procs)
    a, b = entries(sharded), entries(single)
    # every gradient the mean of the 2 ranks' losses': the parameters' averaged by DDP/FSDP,
    # the activations' each rank's ÷ 2 (the single process's is of the summed losses)
    grads = ("param grad", "grad_inputs", "grad_outputs")
    halved = {k: {**v, **{s: v[s] / 2 for s in ("mean", "std", "min", "max", "norm")}}
              for k, v in b.items() if k[1] in grads}  # fmt: skip
    assert sharded["backward"]["value"] == pytest.approx(single["backward"]["value"] / 2)
    assert any("data parallel over 2 ranks: the loss is the ranks' mean" in n
               for n in sharded["notes"])  # fmt: skip
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], halved.get(key, b[key])
        assert x["shape"] == y["shape"], key
        if kind == "fsdp-dp" and key[1] != "param":  # histograms asked: they do not merge
            assert x.get("hist") is None, key
            said = "only this rank's part had them" if "param" not in key[1] else "sharded"
            assert said in x["note"], (key, x["note"])
        else:
            assert not x.get("note"), (key, x.get("note"))
        for s in STATS:
            if y.get(s) is not None:
                assert x[s] == pytest.approx(y[s], rel=1e-5, abs=1e-6), (key, s)
    assert a[(first, "inputs", "in[0]")]["shape"] == [6, 8]
    if kind in ("fsdp-dp", "ddp"):  # the input's gradient too: the global batch's, ÷ 2
        (got,), (want,) = sharded["input_grads"], single["input_grads"]
        assert got["shape"] == want["shape"] == [6, 8]
        for s in ("mean", "std", "min", "max", "norm"):
            assert got[s] == pytest.approx(want[s] / 2, rel=1e-5, abs=1e-7), s
    return sharded


def test_ddp_ranks_batches_merge_into_the_global_batch(tmp_path: Path) -> None:
    """The DDP wrapper given to grads: each rank's rows merged into the global batch over its
    process group, the replicated weights whole once, the gradients DDP's average."""
    sharded = _assert_global_batch(tmp_path, "ddp", 2)
    norms = [p["grad_norm"] for c in sharded["layers"] for p in c.get("params") or []]
    assert math.sqrt(sum(n * n for n in norms)) == pytest.approx(sharded["clip_grad_norm"])


def test_a_nan_in_a_sharded_run_is_logged_and_nothing_waits(tmp_path: Path) -> None:
    """FSDP2, a NaN in rank 1's rows at step 1: it reaches both ranks' gradients through the
    reduce-scatter; each rank logs it from its own part, and neither runs the hooked re-run,
    whose collectives the other rank would never join (the run ends: nothing hangs)."""
    _run(tmp_path, "fsdp-nan", 2)
    for r in (0, 1):
        lines = [json.loads(x) for x in (tmp_path / f"fsdp-nan.sharded.rank{r}.jsonl").open()]
        (event,) = [x for x in lines if x["kind"] == "nonfinite"]
        assert event["step"] == 1 and "grad" in event["found"], event
        assert any("the hooked re-run, which would need every rank" in n for n in event["notes"])


def test_ranks_that_measured_other_tensors_merge_nothing_and_say_so(tmp_path: Path) -> None:
    """DDP over a model whose last Linear runs on rank 1 only: the ranks' rows differ, which
    one small exchange finds before any merge. Nothing is merged (nothing waits, no rows are
    paired wrongly), and every row says it is this rank's part."""
    run_torchrun(SCRIPT, [str(tmp_path), "uneven"], tmp_path)
    report = json.loads((tmp_path / "uneven.sharded.json").read_text())
    rows = [t for c in report["layers"] for t in c["outputs"]]
    assert rows and all("not merged over the ranks" in t["note"] for t in rows)
    assert rows[0]["shape"][0] == 3  # rank 0's own rows


@pytest.fixture(scope="module")
def branch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One launch of sharded_run.py's `branch` kind: its folder and each rank's JSON."""
    folder = tmp_path_factory.mktemp("branch")
    run_torchrun(SCRIPT, [str(folder), "branch"], folder)
    return folder, [json.loads((folder / f"branch.rank{r}.json").read_text()) for r in (0, 1)]


def test_ranks_whose_rows_took_other_layers_of_one_shape_merge_nothing(branch: Any) -> None:
    """FSDP2 over a model that routes rank 0's rows through `p` and rank 1's through `q`
    (one shape, one path: `out`): the rows were merged as one tensor's, rank 0 reporting p's
    output with q's rows in it, unsaid. The ranks' rows are told apart by their layer too:
    nothing merged, said, each rank's numbers its own rows'."""
    for data, name in zip(branch[1], ("p", "q"), strict=True):
        (call,) = data["report"]["layers"]
        (out,) = call["outputs"]
        assert call["name"] == name and "not merged over the ranks" in out["note"]
        assert out["mean"] == pytest.approx(data["own_mean"], rel=1e-6)


def test_per_channel_rules_on_merged_rows_fail_and_say_why(branch: Any) -> None:
    """check's per-channel rules on FSDP2's merged rows (which keep no per-channel numbers)
    checked no tensor and passed with exit 0: they fail, saying why."""
    for data in branch[1]:
        check = data["check"]
        assert check["exit"] == 1
        rules = {c["rule"]: c for c in check["checks"]}
        for rule in ("massive", "kurtosis"):
            assert not rules[rule]["passed"], rules[rule]
            assert "nothing measured per channel" in rules[rule]["message"]
            assert "merged over the ranks" in rules[rule]["message"]


def test_grads_in_the_middle_of_fsdp_gradient_accumulation_is_refused(branch: Any) -> None:
    """FSDP2 with its gradient sync off (a micro-batch backpropagated), then on again with
    that micro-batch not yet reduced: grads reported null gradients and added its own to the
    user's accumulated ones (off by up to 3.0 in the step after). Refused, saying why; and
    DDP inside no_sync() (a backward there reduces nothing)."""
    for data in branch[1]:
        off, held, ddp = data["refused"]
        assert "middle of gradient accumulation" in off and "sync is off" in off
        assert "not yet reduced" in held
        assert "DDP's gradient sync is off (inside no_sync())" in ddp


def test_parameters_fsdp_does_not_manage_are_said_to_be_the_ranks_own(branch: Any) -> None:
    """FSDP2 on one Linear of three: the note said every parameter gradient was averaged over
    the ranks, while the others' are each rank's own (no reduction touches them)."""
    for data in branch[1]:
        (note,) = [n for n in data["part_notes"] if "does not manage" in n]
        assert "2.weight, 2.bias" in note and "0.weight" not in note
        assert "this rank's own, not averaged" in note


def test_a_rank_with_no_rows_merges_like_the_others(branch: Any) -> None:
    """FSDP2, all 6 rows on rank 0 and none on rank 1: the empty rank paired its tensors
    otherwise (an empty tensor has no address to match), the ranks' rows differed, nothing
    merged and every parameter was rank 0's shard. Now: merged, the global numbers."""
    for data in branch[1]:
        report, want = data["empty_rank"], data["empty_rank_want"]
        notes = [t.get("note") for t in entries(report).values() if isinstance(t, dict)]
        assert not any(n and "not merged" in n for n in notes), notes
        got = {f"{c['name']}.{p['name']}": p for c in report["layers"] for p in c["params"] or []}
        assert sorted(got) == sorted(want)
        for name, (norm, grad_norm) in want.items():
            assert got[name]["norm"] == pytest.approx(norm, rel=1e-5), name
            assert got[name]["grad_norm"] == pytest.approx(grad_norm, rel=1e-5), name


def test_every_rank_says_the_same_of_its_merged_rows(branch: Any) -> None:
    """Rows of 4 and 2 rows 8 wide: rank 1's part (16 elements) listed its elements, rank
    0's (32) did not, so rank 1's merged rows said "no element values" and rank 0's nothing.
    What a merged row says is the whole tensor's, the same on every rank."""
    notes = [
        {
            key: t.get("note")
            for key, t in entries(data["four_two"]).items()
            if "param" not in key[1]
        }
        for data in branch[1]
    ]
    assert notes[0] == notes[1]


def test_a_loss_parallel_loss_given_to_watch_is_logged_whole(branch: Any) -> None:
    """A DTensor loss (cross_entropy under loss_parallel) given to `w.loss` stopped the
    recording at step 0 on every rank; each rank logs the unsharded run's losses."""
    folder, ranks = branch
    for rank, data in enumerate(ranks):
        steps = read_steps(folder / f"branch-loss.rank{rank}.jsonl")
        assert [s.loss for s in steps] == pytest.approx(data["losses"], rel=1e-5)
