"""A saved hf: folder whose weights cannot be read or do not fit: one line, exit 2 (an
unreadable file is the input's fault), naming the file's problem or the keys — never an
internal error with transformers' own text."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.cli import assert_one_line_error, run
from tests.support.llm import save

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


def _junk(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"junk")


def _cut(folder: Path) -> None:
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])


def _index_without_fields(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))


def _other_size(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))


@pytest.mark.parametrize(
    ("spoil", "needles"),
    [
        (_junk, ["its weights cannot be read", "SafetensorError", "save_pretrained"]),
        (_cut, ["its weights cannot be read", "SafetensorError"]),
        (_index_without_fields, ["its weights cannot be read", "metadata"]),
        (_other_size, ["weights do not fit", "of another shape", "mlp"]),
    ],
)
def test_unreadable_or_unfitting_weights_are_one_line_exit_2(
    llama: Path, tmp_path: Path, spoil: Callable[[Path], None], needles: list[str]
) -> None:
    folder = tmp_path / "spoilt"
    shutil.copytree(llama, folder)
    spoil(folder)
    assert_one_line_error(run("layers", f"hf:{folder}"), 2, *needles)
