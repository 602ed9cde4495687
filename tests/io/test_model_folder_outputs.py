"""No output of a run replaces a file of the model folder it loads (issue 49): the weights,
shards and their index, tokenizer files, chat template, generation config — through -o,
--save or calib's file, for an hf: folder and a --tokenizer folder. Each refusal is one line
with exit 2 before any work, and every file of the folder is byte for byte as it was."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hookcli.cli import app

transformers = pytest.importorskip("transformers")
runner = CliRunner()
TEXT = "The cat sat"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.llm import llama_config, make_tokenizer

    where = tmp_path_factory.mktemp("sharded_llama")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    model.generation_config.max_new_tokens = 4
    model.save_pretrained(where, max_shard_size="20KB")  # shards and their index
    make_tokenizer(chat=True).save_pretrained(where)
    return where


def _digests(where: Path) -> dict[str, str]:
    return {
        str(p.relative_to(where)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(where.rglob("*"))
        if p.is_file()
    }


def test_the_folder_has_what_the_issue_lists(folder: Path) -> None:
    names = {p.name for p in folder.iterdir()}
    assert "model.safetensors.index.json" in names
    assert any(n.startswith("model-0000") for n in names)
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= names


@pytest.mark.parametrize(
    ("args", "target"),
    [
        (["inspect", "-l", "lm_head", "-f", "json", "-o"], "model.safetensors.index.json"),
        (["inspect", "-l", "lm_head", "--save"], "SHARD"),
        (["lens", "-o"], "tokenizer.json"),
        (["grads", "-l", "lm_head", "-f", "json", "-o"], "generation_config.json"),
        (["check", "-f", "json", "-o"], "config.json"),
        (["diff", "--b", "bfloat16", "-l", "lm_head", "-f", "json", "-o"], "tokenizer_config.json"),
        (["calib", "-o"], "SHARD"),
        (["layers", "-f", "json", "-o"], "chat_template.jinja"),
    ],
)
def test_an_output_onto_a_file_of_the_model_folder_is_refused(
    folder: Path, args: list[str], target: str
) -> None:
    if target == "SHARD":
        target = next(p.name for p in folder.iterdir() if p.name.startswith("model-0000"))
    path = folder / target
    if not path.exists():
        pytest.skip(f"this transformers writes no {target}")
    before = _digests(folder)
    command, *rest = args
    text = [] if command == "layers" else ["--text", TEXT]
    r = runner.invoke(app, [command, f"hf:{folder}", *text, *rest, str(path)])
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "is also an input of this run" in lines[0] and "model folder" in lines[0]
    assert _digests(folder) == before


def test_a_tokenizer_folder_is_protected_too_and_a_new_file_beside_them_is_not(
    folder: Path, tmp_path: Path
) -> None:
    from tests.support.llm import make_tokenizer

    tok = tmp_path / "tok"
    make_tokenizer().save_pretrained(tok)
    before = _digests(tok)
    out = str(tok / "tokenizer.json")
    r = runner.invoke(app, ["inspect", f"hf:{folder}", "--text", TEXT, "--tokenizer", str(tok),
                            "-l", "lm_head", "-f", "json", "-o", out])  # fmt: skip
    assert r.exit_code == 2 and "is also an input of this run" in r.stderr, r.stderr
    assert _digests(tok) == before
    # a report of its own beside the model's files is no file of the model's
    report = folder / "report.json"
    r = runner.invoke(app, ["inspect", f"hf:{folder}", "--text", TEXT, "-l", "lm_head", "-f",
                            "json", "-o", str(report)])  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert report.is_file()
    report.unlink()


def test_calib_past_the_file_size_limit_is_one_line_and_leaves_no_file(
    folder: Path, tmp_path: Path
) -> None:
    """`ulimit -f`: the write fails with EFBIG (Python ignores SIGXFSZ); calib's file is
    refused in one line, exit 2, as every other writer's, and nothing is left behind."""
    import resource
    import subprocess
    import sys

    text_file = tmp_path / "calib.txt"
    text_file.write_text("The cat sat on the mat.\nA dog ran in the park.\n")
    out = tmp_path / "scales.safetensors"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 1024, resource.RLIM_INFINITY))

    r = subprocess.run(
        [sys.executable, "-m", "hookcli", "calib", f"hf:{folder}", "--text-file",
         str(text_file), "-o", str(out)],
        capture_output=True, text=True, preexec_fn=limit, timeout=300, check=False,
    )  # fmt: skip
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: cannot write") and "File too large" in lines[0], r.stderr
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["calib.txt"]


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--norm", "lm_head"], ["--norm lm_head (Linear, weight 320x32)", "not a norm"]),
        (["--unembed", "model.embed_tokens"], ["is an Embedding", "not an unembedding"]),
        (["--unembed", "model.layers.0.mlp.down_proj"], ["maps to 32 outputs", "has 320"]),
        # a module of the wrong kind was accepted, and gave meaningless tokens with exit 0
        (["--unembed", "model.norm"], ["--unembed model.norm (LlamaRMSNorm)", "no (vocab"]),
    ],
)
def test_lens_modules_that_do_not_fit_are_refused_before_the_pass(
    folder: Path, extra: list[str], needles: list[str]
) -> None:
    """issue 49: `lens --norm lm_head` or `--unembed model.embed_tokens` was a raw shape error
    after the whole pass (exit 3; the API's RuntimeError)."""
    import hookcli
    from hookcli.errors import UsageError

    r = runner.invoke(app, ["lens", f"hf:{folder}", "--text", TEXT, *extra])
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    option, value = extra
    with pytest.raises(UsageError):
        hookcli.lens(f"hf:{folder}", text=TEXT, **{option.removeprefix("--"): value})


@pytest.mark.parametrize("kind", ["nested 100,000 deep", "a vocabulary id of -5"])
def test_a_tokenizer_file_the_library_refuses_is_one_line(
    folder: Path, tmp_path: Path, kind: str
) -> None:
    """issue 49: a tokenizer.json transformers does not wrap (RecursionError, the Rust
    library's own error) was an internal error, exit 3."""
    import json

    from tests.support.llm import make_tokenizer

    tok = tmp_path / "tok"
    make_tokenizer().save_pretrained(tok)
    path = tok / "tokenizer.json"
    if kind.startswith("nested"):
        path.write_text('{"version": "1.0", "model": ' + "[" * 100_000 + "]" * 100_000 + "}")
    else:
        data = json.loads(path.read_text())
        first = next(iter(data["model"]["vocab"]))
        data["model"]["vocab"][first] = -5
        path.write_text(json.dumps(data))
    r = runner.invoke(app, ["inspect", f"hf:{folder}", "--text", TEXT, "--tokenizer", str(tok),
                            "-l", "lm_head"])  # fmt: skip
    assert r.exit_code == 2, (r.exit_code, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no tokenizer could be loaded"), lines
