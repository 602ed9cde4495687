"""Shared fixtures. Tests never touch the network: TORCH_HOME and the Hugging Face cache point
at empty folders, and huggingface_hub is offline."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is imported
from collections.abc import Iterator
from pathlib import Path

import pytest

from hookcli.runtime import isa, preload
from tests.support.process_state import AT_START, ProcessState

# Before torch runs any kernel: on a CPU that advertises AMX but dies in its bfloat16 kernels,
# the suite runs under the same oneDNN limit the CLI and the API take (issue 13).
isa.ensure()
# `import hookcli` started loading the statistics' kernels in the background: done before any
# test, so that "auto" measures with them in every test, not depending on how fast it loads
# (tests that read the torch ops' numbers ask for stats_backend="torch").
preload.wait()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--reverse",
        action="store_true",
        help="run the collected tests in reverse order (CI: the suite must not depend on it)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--reverse"):
        items.reverse()


def pytest_sessionstart(session: pytest.Session) -> None:
    AT_START.append(ProcessState())


@pytest.fixture(autouse=True)
def _process_state_as_found() -> Iterator[None]:
    """Every test starts from the process state the suite started with, whatever the tests
    (and fixtures) before it left (issue 48): it is put back after every test, so no test can
    pass or fail by the order it runs in. `pytest --reverse` runs the suite backwards."""
    try:
        yield
    finally:
        AT_START[0].restore()


@pytest.fixture(autouse=True)
def _isolated_torch_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    home = tmp_path_factory.mktemp("torch_home")
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hf_hub"))  # an empty Hugging Face cache
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    return home
