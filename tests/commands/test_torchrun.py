"""A folder run under a real torchrun (two processes, gloo, CPU): each rank reads its own
batches, rank 0 writes one merged report, and it equals the report of one process over the
same folder — statistics within 1e-9 relative, counts and histograms exact, per-image rows and
NaN/Inf rows in order, unreadable images listed once."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageOps

from tests.support.launch import TIMEOUT, free_port, launch_env, run_python
from tests.support.paths import CAT, COFFEE


def _folder(tmp_path: Path) -> Path:
    """Seven distinct images (two subfolders: an ImageFolder tree) and one unreadable file."""
    folder = tmp_path / "images"
    for sub in ("cats", "cups"):
        (folder / sub).mkdir(parents=True)
    for i in range(4):
        img = Image.open(CAT).convert("RGB").rotate(15 * i)
        img.save(folder / "cats" / f"{i}.png")
    for i in range(3):
        img = ImageOps.mirror(Image.open(COFFEE).convert("RGB")) if i % 2 else Image.open(COFFEE)
        img.convert("RGB").resize((200 + 20 * i, 180)).save(folder / "cups" / f"{i}.jpeg")
    (folder / "cups" / "broken.jpeg").write_bytes(b"not an image")
    return folder


def _close(a: Any, b: Any, path: str = "") -> None:
    """Equal structure; floats within 1e-9 relative; everything else exact."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), (path, a, b)
    else:
        assert a == b, (path, a, b)


def _single_and_merged(tmp_path: Path, args: list[str]) -> tuple[dict[str, Any], ...]:
    """The command run by one process and by torchrun with two (gloo): both reports, with
    what must differ checked and taken out (the torchrun note, the description's suffix)."""
    run_python(["-m", "hookcli", *args, "-o", str(tmp_path / "single.json")], tmp_path)
    torchrun = [
        "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
    ]  # fmt: skip
    run_python([*torchrun, "-m", "hookcli", *args, "-o", str(tmp_path / "merged.json")], tmp_path)
    single = json.loads((tmp_path / "single.json").read_text())
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert not list(tmp_path.glob(".hookcli-*"))  # rank 1 wrote nothing, not even a temp file
    # what differs, and must: how the run was spread
    share = [n for n in merged["notes"] if n.startswith("torchrun: 2 processes (gloo)")]
    assert len(share) == 1 and "images read by rank 0: 4, rank 1: 3" in share[0]
    assert merged["input"]["description"].startswith("7 images")
    assert merged["input"]["description"].endswith(" over 2 processes")
    for report in (single, merged):
        report["notes"] = [n for n in report["notes"] if not n.startswith("torchrun:")]
        report["input"]["description"] = report["input"]["description"].removesuffix(
            " over 2 processes"
        )
    return single, merged


@pytest.mark.slow
@pytest.mark.parametrize("command", ["inspect", "grads"])
def test_two_ranks_merge_into_the_single_process_report(tmp_path: Path, command: str) -> None:
    """grads too: each call's gradient statistics merge like its activations', and each
    parameter's gradient is summed over the batches and over the ranks (all-reduce)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available here")
    folder = _folder(tmp_path)
    args = [
        command, "resnet18", str(folder), "-l", "layer4.*", "-l", "fc", "--batch-size", "2",
        "--hist", "--per-image", "2", "-f", "json",
    ]  # fmt: skip
    single, merged = _single_and_merged(tmp_path, args)
    assert any("broken.jpeg" in n for n in merged["notes"])  # skipped once, by its rank
    _close(merged, single)  # statistics, histograms, counts, predictions in order, notes
    hist = merged["layers"][0]["outputs"][0]["hist"]
    assert hist is not None and sum(hist["counts"]) > 0  # batch 0's edges served every rank
    images = [p["source"] for p in merged["predictions"] if p["rank"] == 1]
    assert images == sorted(images) and len(images) == 7
    if command == "grads":  # the gradients were there to merge
        fc = next(c for c in merged["layers"] if c["name"] == "fc")
        assert fc["grad_outputs"][0]["shape"] == [7, 1000]
        assert fc["params"][0]["grad"]["norm"] > 0 and merged["backward"]["value"] is not None


def _api_rank(rank: int, folder: str, port: int, out: str, world: int) -> None:
    """One rank of a process group the caller initialised (world 2): the API runs its share and
    returns the merged report; or (world 1) the same call in a process of its own. Both on one
    thread, so the convolutions round alike whatever the parent process set."""
    import os

    import torch
    import torch.distributed as dist

    import hookcli

    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        report = hookcli.inspect(
            "resnet18", folder, layers=["layer4.1.*"], batch_size=2, hist=True, per_image=1
        )
        Path(out, f"w{world}rank{rank}.json").write_text(json.dumps(report.to_dict()))
        if world > 1:
            # every rank here before any takes the group down: a rank that destroyed its gloo
            # group while another was still in the last collective was seen to abort it
            # ("terminate called without an active exception", SIGABRT) on a busy machine
            dist.barrier()
    finally:
        if world > 1:
            dist.destroy_process_group()


@pytest.mark.slow
def test_api_inside_a_process_group_merges_on_every_rank(tmp_path: Path) -> None:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available here")
    folder = _folder(tmp_path)
    for world in (2, 1):
        args = (str(folder), free_port(), str(tmp_path), world)
        mp.start_processes(_api_rank, args, nprocs=world, start_method="spawn")
    ranks = [json.loads((tmp_path / f"w2rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]  # every rank holds the merged report
    one = json.loads((tmp_path / "w1rank0.json").read_text())
    merged = ranks[0]
    assert any(n.startswith("torchrun: 2 processes (gloo)") for n in merged["notes"])
    for report in (one, merged):
        report["notes"] = [n for n in report["notes"] if not n.startswith("torchrun:")]
        report["input"]["description"] = report["input"]["description"].removesuffix(
            " over 2 processes"
        )
    _close(merged, one)


@pytest.mark.slow
def test_a_diff_over_a_folder_spreads_its_batches_and_merges_exactly(tmp_path: Path) -> None:
    """diff over a folder under torchrun: each rank compares its own batches, rank 0 writes the
    one report, equal to one process's — sums to rounding, counts, and every top-1 flip with
    its global image index and name, in folder order."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available here")
    folder = _folder(tmp_path)
    (folder / "cups" / "broken.jpeg").unlink()  # diff refuses an unreadable image
    args = [
        "diff", "resnet18", str(folder), "--b", "seed=1", "-l", "layer4.1.*", "-l", "fc",
        "--batch-size", "2", "--tol", "100", "-f", "json",
    ]  # fmt: skip
    single, merged = _single_and_merged(tmp_path, args)
    flips = single["agreement"]["B"]["flipped"]
    assert len(flips) >= 2 and [f["index"] for f in flips] == sorted(f["index"] for f in flips)
    assert {f["index"] for f in flips} - {0, 1}  # flips from batches rank 1 compared too
    _close(merged, single)


@pytest.mark.slow
def test_an_int8_diff_over_a_folder_is_spread_too(tmp_path: Path) -> None:
    """--b quantized under torchrun: every rank calibrates the int8 twin on batch 0 (so rank 1,
    which compares batches 1 and 3, reads batch 0 for that alone) and compares its own
    batches; the merged report equals one process's."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available here")
    folder = _folder(tmp_path)
    (folder / "cups" / "broken.jpeg").unlink()
    args = [
        "diff", "resnet18", str(folder), "--b", "quantized", "-l", "layer1.0.conv1", "-l", "fc",
        "--batch-size", "2", "--tol", "100", "-f", "json",
    ]  # fmt: skip
    single, merged = _single_and_merged(tmp_path, args)
    assert single["agreement"]["B"]["images"] == 7
    _close(merged, single)


@pytest.mark.slow
def test_two_nodes_meet_through_torchruns_rendezvous(tmp_path: Path) -> None:
    """Two machines, as torchrun sees them: two launchers (--nnodes 2, --node-rank 0 and 1, one
    process each) meeting at one master address. The report node 0 writes equals one
    process's."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available here")
    folder = _folder(tmp_path)
    args = [
        "inspect", "resnet18", str(folder), "-l", "layer4.1.*", "--batch-size", "2", "--hist",
        "-f", "json",
    ]  # fmt: skip
    run_python(["-m", "hookcli", *args, "-o", str(tmp_path / "single.json")], tmp_path)
    port = str(free_port())
    launcher = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--master-addr", "127.0.0.1", "--master-port", port,
    ]  # fmt: skip
    hookcli = ["-m", "hookcli", *args, "-o", str(tmp_path / "merged.json")]
    nodes = [
        subprocess.Popen(
            [*launcher, "--node-rank", str(rank), *hookcli],
            cwd=tmp_path,
            env=launch_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for node in nodes:
        try:
            _, stderr = node.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for n in nodes:
                n.kill()
            pytest.fail("the two nodes did not finish")
        assert node.returncode == 0, stderr[-3000:]
    single = json.loads((tmp_path / "single.json").read_text())
    merged = json.loads((tmp_path / "merged.json").read_text())
    share = [n for n in merged["notes"] if n.startswith("torchrun: 2 processes (gloo)")]
    assert len(share) == 1 and "images read by rank 0: 4, rank 1: 3" in share[0]
    for report in (single, merged):
        report["notes"] = [n for n in report["notes"] if not n.startswith("torchrun:")]
        report["input"]["description"] = report["input"]["description"].removesuffix(
            " over 2 processes"
        )
    _close(merged, single)
