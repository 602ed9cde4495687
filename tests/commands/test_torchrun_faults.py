"""torchrun runs that go wrong (issue 32): ranks started with other arguments are refused, not
merged; a rank that hangs is named within a bounded time; a rank that dies is named, never a
traceback. Real torchrun, two processes, gloo, CPU."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from tests.support.paths import ROOT

FILTER = ("error: ",)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _images(tmp_path: Path, n: int = 4) -> Path:
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(n):
        Image.new("RGB", (40, 40), (40 * i, 100, 200)).save(folder / f"{i}.png")
    return folder


def _torchrun(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[int, list[str], float]:
    """torchrun over tests/support/rank_models.py's launcher: its exit code, the error lines every
    rank printed, and how long it took."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(_port()),
        str(ROOT / "tests" / "support" / "rank_models.py"), *args,
    ]  # fmt: skip
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        **(env or {}),
    }
    t0 = time.monotonic()
    done = subprocess.run(
        cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=240, check=False
    )
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith(FILTER)]
    assert "Traceback" not in "\n".join(ln for ln in done.stderr.splitlines() if "hookcli" in ln)
    return done.returncode, lines, time.monotonic() - t0


MODEL = "tests.support.rank_models:Net"


@pytest.mark.parametrize(
    ("rank1", "named"),
    [
        ("-l fc", "the layer selection (--layer, --type, --depth): layers ('fc',) vs ()"),
        ("--per-image 2", "the batching (--batch-size, --limit, --per-image): per_image 2 vs 0"),
        ("--hist", "the run's options (--hist, --save, --profile, --train …): hist"),
    ],
)
def test_ranks_started_with_other_arguments_are_refused(
    tmp_path: Path, rank1: str, named: str
) -> None:
    folder = _images(tmp_path)
    out = tmp_path / "out.json"
    code, lines, _ = _torchrun(
        tmp_path, "inspect", MODEL, str(folder), "--batch-size", "1", "--no-config",
        "-o", str(out), env={"HOOKCLI_TEST_RANK1_ARGS": rank1},
    )  # fmt: skip
    assert code != 0
    assert any(
        "rank 1 was started with other arguments than rank 0" in ln and named in ln for ln in lines
    ), lines
    assert not out.exists()


def test_a_folder_the_ranks_list_differently_is_refused(tmp_path: Path) -> None:
    folder = _images(tmp_path)
    code, lines, _ = _torchrun(
        tmp_path, "inspect", MODEL, str(folder), "--batch-size", "1", "--no-config",
        env={"HOOKCLI_TEST_RANK1_ARGS": "--limit 3"},
    )  # fmt: skip
    assert code != 0 and any("limit 3 vs None" in ln for ln in lines), lines
    # the same arguments, another listing: rank 1 reads a folder with one image fewer
    other = tmp_path / "other"
    other.mkdir()
    for p in sorted(folder.iterdir())[:3]:
        (other / p.name).write_bytes(p.read_bytes())
    code, lines, _ = _torchrun(
        tmp_path, "inspect", MODEL, "--batch-size", "1", "--no-config",
        env={"HOOKCLI_TEST_RANK0_TAIL": str(folder), "HOOKCLI_TEST_RANK1_TAIL": str(other)},
    )  # fmt: skip
    assert code != 0
    assert any("lists the images differently from rank 0 (3 vs 4 images)" in ln for ln in lines)


def test_a_hung_rank_is_named_within_the_wait(tmp_path: Path) -> None:
    folder = _images(tmp_path)
    code, lines, took = _torchrun(
        tmp_path, "inspect", MODEL, str(folder), "--batch-size", "1", "--no-config",
        "--model-arg", "hang=1", env={"HOOKCLI_RANK_WAIT_S": "5"},
    )  # fmt: skip
    assert code != 0
    assert any(
        ln.startswith("error: rank 0 of 2: torchrun: rank 1 did not finish its batches within 5 s")
        for ln in lines
    ), lines
    assert took < 100  # not the model's 120 s sleep, and never for ever


def test_a_rank_that_dies_is_named(tmp_path: Path) -> None:
    folder = _images(tmp_path)
    code, lines, _ = _torchrun(
        tmp_path, "inspect", MODEL, str(folder), "--batch-size", "1", "--no-config",
        "--model-arg", "die=1",
    )  # fmt: skip
    assert code != 0
    assert any(ln.startswith("error: rank 1 of 2: the run died of SIGKILL") for ln in lines), lines


def test_strict_and_save_under_torchrun_are_one_line_each(tmp_path: Path) -> None:
    folder = _images(tmp_path)
    (folder / "zz.png").write_bytes(b"not an image")
    code, lines, _ = _torchrun(
        tmp_path, "inspect", MODEL, str(folder), "--batch-size", "1", "--no-config", "--strict"
    )
    assert code != 0
    assert any("rank 0 of 2: " in ln and "zz.png" in ln and "--strict" in ln for ln in lines)
    assert not any("internal error" in ln for ln in lines), lines
    code, lines, _ = _torchrun(
        tmp_path, "inspect", MODEL, str(folder), "--batch-size", "1", "--no-config",
        "--save", str(tmp_path / "s.safetensors"),
    )  # fmt: skip
    assert code != 0 and lines, lines
    assert all(ln.startswith("error: rank ") for ln in lines), lines
    assert any("--save works on one batch" in ln for ln in lines), lines
