"""The bfloat16-on-AMX fallback (issue 13): a probe in a child process finds the highest oneDNN
ISA whose kernels survive; the answer is cached, put in the environment before oneDNN runs, and
said in the report. This machine's CPU may not show the fault, so the platform is simulated: a
probe script that dies of a real SIGILL above a given ISA, or an injected cached answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hookcli.runtime import isa
from tests.support.paths import ROOT

# a stand-in for a CPU whose AMX bfloat16 kernels die: SIGILL unless oneDNN is held at or below
# AVX512_CORE_BF16
DIES_ABOVE_BF16 = """
import os, signal
if os.environ.get("ONEDNN_MAX_CPU_ISA") not in ("AVX512_CORE_BF16", "AVX512_CORE_VNNI"):
    os.kill(os.getpid(), signal.SIGILL)
"""
AMX = {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cache and no decision yet in this process (restored after)."""
    monkeypatch.setenv("HOOKCLI_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(isa.ENV, raising=False)
    monkeypatch.delenv("HOOKCLI_NO_PROBE", raising=False)
    monkeypatch.setattr(isa, "_decided", None)
    return tmp_path


def test_the_probe_walks_down_to_the_first_isa_that_survives(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(isa, "PROBE_CODE", DIES_ABOVE_BF16)
    tried: list[str | None] = []

    def run(limit: str | None) -> int:
        tried.append(limit)
        return isa.run_probe(limit)  # a real child process, really killed

    answer = isa.probe(run)
    assert answer == isa.IsaLimit("AVX512_CORE_BF16", "SIGILL")
    assert tried == [None, "AVX512_CORE_FP16", "AVX512_CORE_BF16"]
    assert answer.note is not None and "oneDNN limited to AVX512_CORE_BF16" in answer.note


def test_a_probe_that_fails_without_a_signal_decides_nothing() -> None:
    assert isa.probe(lambda limit: 1) is None
    # a probe stopped by Ctrl-C, SIGTERM or the OOM killer says nothing of the CPU
    for stopped in (-2, -15, -9):
        assert isa.probe(lambda limit, code=stopped: code) is None
    assert isa.probe(lambda limit: 0) == isa.IsaLimit(None, None)
    everywhere = isa.probe(lambda limit: -4)
    assert everywhere == isa.IsaLimit(None, "SIGILL")
    assert everywhere.note is not None and "every oneDNN ISA" in everywhere.note


def test_decide_probes_only_where_amx_is_advertised_and_caches(fresh: Path) -> None:
    def never(limit: str | None) -> int:
        raise AssertionError("no probe without AMX")

    assert isa.decide({}, flags={"avx2", "avx512f"}, run=never) is None
    assert list(fresh.iterdir()) == []
    calls: list[str | None] = []

    def dies_at_default(limit: str | None) -> int:
        calls.append(limit)
        return -4 if limit is None else 0

    first = isa.decide({}, flags=AMX, run=dies_at_default)
    assert first == isa.IsaLimit("AVX512_CORE_FP16", "SIGILL")
    assert calls == [None, "AVX512_CORE_FP16"]
    assert isa.decide({}, flags=AMX, run=never) == first, "read back from the cache"
    cached = json.loads(isa.cache_path(AMX).read_text())
    assert cached["limit"] == "AVX512_CORE_FP16" and cached["died"] == "SIGILL"
    # the user's own setting always wins
    assert isa.decide({isa.ENV: "AVX2"}, flags=AMX, run=never) is None


def test_a_corrupt_cache_is_probed_again(fresh: Path) -> None:
    path = isa.cache_path(AMX)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"version": 1, "limit": "rm -rf /"}')
    assert isa.decide({}, flags=AMX, run=lambda limit: 0) == isa.IsaLimit(None, None)


def test_ensure_sets_the_limit_before_torch_runs_and_reports_say_so(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(isa, "cpu_flags", lambda: AMX)
    monkeypatch.setattr(isa, "run_probe", lambda limit, timeout=0: -4 if limit is None else 0)
    env: dict[str, str] = {}
    answer = isa.ensure(env)
    assert env == {isa.ENV: "AVX512_CORE_FP16"}
    assert answer == isa.IsaLimit("AVX512_CORE_FP16", "SIGILL")
    assert isa.notes() == [answer.note]


def _run_under(limit: str, cache_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`hookcli ARGS` in a fresh process on a CPU that advertises AMX (its flags stood in for:
    on a CPU without AMX no cached answer is read) and finds the probe's answer `limit` cached
    where the CLI looks, with no limit of its own in the environment."""
    (cache_dir / isa.cache_path(AMX).name).write_text(
        json.dumps({"version": 1, "limit": limit, "died": "SIGILL"})
    )
    env = {k: v for k, v in os.environ.items() if k != isa.ENV}
    env |= {"HOOKCLI_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    code = (
        "import sys\n"
        "from hookcli.runtime import isa\n"
        f"isa.cpu_flags = lambda: {sorted(AMX)!r}\n"
        "from hookcli.cli import main\n"
        f"sys.argv = ['hookcli', *{list(args)!r}]\n"
        "main()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=False,
    )


def test_the_cli_runs_the_model_under_the_limit_and_says_so(tmp_path: Path) -> None:
    sees = ("tests.support.crash_models:SeesIsa", "--model-arg", "expect=AVX512_CORE_BF16")
    r = _run_under("AVX512_CORE_BF16", tmp_path, "inspect", *sees, "-i", "randn:2x4", "-f", "json")
    assert r.returncode == 0, r.stderr
    notes = json.loads(r.stdout)["notes"]
    assert any("oneDNN limited to AVX512_CORE_BF16" in n and "SIGILL" in n for n in notes), notes


def test_diff_in_bfloat16_takes_the_fallback_and_says_so(tmp_path: Path) -> None:
    r = _run_under("AVX512_CORE_BF16", tmp_path, "diff", "resnet18", "-i", "randn:1x3x64x64",
                   "--b", "bfloat16", "-l", "layer1.*", "-f", "json")  # fmt: skip
    assert r.returncode in (0, 1), r.stderr
    report = json.loads(r.stdout)
    assert any("oneDNN limited to AVX512_CORE_BF16" in n for n in report["notes"])
    assert report["calls"], "the bfloat16 side ran"


@pytest.mark.parametrize(
    "plant",
    [
        lambda p: p.write_text("[" * 100_000 + "]" * 100_000),  # deep JSON: a RecursionError
        lambda p: p.symlink_to("/dev/zero"),  # reading it would never end
        lambda p: p.write_text('{"version": 1, "limit": null, "died": "x" }' + " " * 10_000),
        lambda p: p.write_text("[1, 2]"),
        lambda p: p.write_text('{"version": 1, "limit": null, "died": 5}'),
    ],
)
def test_a_hostile_cache_file_is_probed_again(fresh: Path, plant: object) -> None:
    path = isa.cache_path(AMX)
    path.parent.mkdir(parents=True, exist_ok=True)
    plant(path)  # type: ignore[operator]
    assert isa.decide({}, flags=AMX, run=lambda limit: 0) == isa.IsaLimit(None, None)


def test_no_note_claims_amx_on_a_cpu_without_it(fresh: Path) -> None:
    """A cache that says AMX kernels died, found on a CPU that does not advertise AMX (copied
    from another machine, or planted): the CPU's own flags win, nothing is limited or said."""
    plain = {"avx2", "avx512f"}
    path = isa.cache_path(plain)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"version": 1, "limit": "AVX2", "died": "SIGILL"}\n')
    assert isa.decide({}, flags=plain, run=lambda limit: 0) is None
