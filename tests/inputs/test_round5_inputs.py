"""Round 5 of bad inputs (issue 49): the items not covered by their own modules. Each bad
input is one line `error: … Hint: …` with its documented exit code, before any work where it
can be told before; nothing is replaced by a default without a word."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.support import paths
from tests.support.cli import one_line_error, run

transformers = pytest.importorskip("transformers")
CAT = str(paths.CAT)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.llm import save

    return save(tmp_path_factory.mktemp("r5_llama"), "llama", chat=True)


@pytest.fixture(scope="module")
def vit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("r5_vit")
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=8,
    )  # fmt: skip
    transformers.ViTForImageClassification(config).save_pretrained(where)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(where)
    return where


# ------------------------------------------------ config values transformers' typed configs refuse


@pytest.mark.parametrize(
    ("arg", "field"),
    [("num_hidden_layers=abc", "num_hidden_layers"), ("hidden_act=5", "hidden_act")],
)
def test_a_model_arg_of_the_wrong_type_is_a_usage_error_with_the_whole_reason(
    llama: Path, arg: str, field: str
) -> None:
    res = run("inspect", f"hf:{llama}", "--text", "The cat", "-l", "lm_head", "--model-arg", arg)
    line = one_line_error(res, 2, field, "expected", "Hint: check --model-arg")
    # the reason is on the validation error's second line: it is not cut off
    assert "got" in line and "internal error" not in line


def test_a_config_value_transformers_refuses_names_the_field_and_the_file(
    llama: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(llama, bad)
    config = json.loads((bad / "config.json").read_text())
    config["hidden_act"] = 5
    (bad / "config.json").write_text(json.dumps(config))
    res = run("inspect", f"hf:{bad}", "--text", "The cat", "-l", "lm_head")
    one_line_error(res, 2, "hidden_act", "expected str, got int", "config.json")


# ---------------------------------------------------- a malformed preprocessor_config.json


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"size": "abc", "image_processor_type": "ViTImageProcessor"}, "size"),
        ({"image_processor_type": "Nope"}, "cannot make an image processor"),
        ({"image_processor_type": 5}, "cannot make an image processor"),
        ({"image_processor_type": "ViTImageProcessor", "image_mean": "x"}, "image_mean"),
        (
            {"image_processor_type": "ViTImageProcessor", "size": {"height": -32, "width": 32}},
            "size height -32",
        ),
        (
            {"image_processor_type": "ViTImageProcessor", "size": {"height": 10**5, "width": 32}},
            "size height 100000",
        ),
        ({"image_processor_type": "ViTImageProcessor", "image_std": [0, 1, 1]}, "std of 0"),
    ],
)
def test_a_malformed_preprocessor_config_is_refused_not_replaced_by_the_default(
    vit: Path, tmp_path: Path, settings: dict[str, object], needle: str
) -> None:
    bad = tmp_path / "vit"
    shutil.copytree(vit, bad)
    (bad / "preprocessor_config.json").write_text(json.dumps(settings))
    res = run("inspect", f"hf:{bad}", CAT, "-l", "classifier")
    one_line_error(res, 2, "preprocessor_config.json", needle)


def test_a_sound_preprocessor_config_still_preprocesses(vit: Path) -> None:
    res = run("inspect", f"hf:{vit}", CAT, "-l", "classifier", "-f", "json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["layers"][0]["inputs"][0]["shape"] == [1, 32]


# ---------------------------------------------------- replay of a step whose forward raises

RAISING = '''
import torch
from torch import nn


class Fault(nn.Module):
    def forward(self, x):
        return x


class Counter(Fault):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))


class Bad(nn.Module):
    """FaultNet's modules and state, a forward that raises."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.act1 = nn.ReLU()
        self.fault_a = Fault()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.act2 = nn.ReLU()
        self.counter = Counter()
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc1 = nn.Linear(32, 16)
        self.fault_b = Fault()
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x):
        raise RuntimeError("boom in forward")
'''


def test_replay_of_a_model_whose_forward_raises_is_the_models_failure_exit_3(
    tmp_path: Path,
) -> None:
    from tests.support.faults import SCENARIOS, train

    s = next(x for x in SCENARIOS if x.name == "nan-weight")
    train(s, tmp_path / "run.jsonl")
    script = tmp_path / "raising.py"
    script.write_text(RAISING)
    res = run("replay", str(tmp_path / "run.bundle"), "--model", f"{script}:Bad")
    one_line_error(res, 3, "the replayed step failed", "boom in forward")
    # a state that does not fit names the keys (the reason after load_state_dict's heading)
    script.write_text(RAISING.replace('self.register_buffer("calls"', 'self.register_buffer("n"'))
    res = run("replay", str(tmp_path / "run.bundle"), "--model", f"{script}:Bad")
    one_line_error(res, 2, "does not fit", "counter.calls")


# ---------------------------------------------------- rank logs whose shapes disagree


def test_rank_logs_whose_shapes_disagree_are_merged_with_a_word(tmp_path: Path) -> None:
    from hookcli.cli import app
    from hookcli.commands.watch import runmerge
    from tests.support.watchlogs import call_dict, step_dict, tensor_dict, write_log

    a = step_dict(0, [call_dict("fc", out={**tensor_dict(numel=8), "shape": [2, 4]})], world_size=2)
    b = step_dict(
        0,
        [call_dict("fc", out={**tensor_dict(numel=63), "shape": [7, 3, 3]})],
        rank=1,
        world_size=2,
    )
    logs = [write_log(tmp_path, [a], "r.rank0.jsonl"), write_log(tmp_path, [b], "r.rank1.jsonl")]
    merged = runmerge.load_run(logs)
    (note,) = [n for n in merged.notes if "disagree on the shape" in n]
    assert "fc call 0 output out (rank 0 2x4, rank 1 7x3x3)" in note
    (out,) = merged.steps[0].layers[0].outputs
    assert out.numel == 71 and out.note is not None and "(4 and 3x3)" in out.note
    # ranks of one model (a shorter last shard) merge without a word
    c = step_dict(
        0, [call_dict("fc", out={**tensor_dict(numel=4), "shape": [1, 4]})], rank=1, world_size=2
    )
    logs[1] = write_log(tmp_path, [c], "r.rank1.jsonl")
    same = runmerge.load_run(logs)
    assert not [n for n in same.notes if "shape" in n]
    assert same.steps[0].layers[0].outputs[0].note is None
    res = CliRunner().invoke(app, ["report", str(logs[0]), str(logs[1])])
    assert res.exit_code == 0, res.output


# ------------------------------------------------------------- chat templates run with bounds

GOOD_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def _with_template(llama: Path, tmp_path: Path, template: str) -> Path:
    folder = tmp_path / "chat"
    shutil.copytree(llama, folder)
    (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        (  # a nested loop that never returns in any useful time
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
            "did not finish rendering within 2 s",
        ),
        (  # gigabytes of text, written piece by piece
            "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
            "more than",
        ),
        ("{{ 'x' * 3000000000 }}", "more than"),  # gigabytes at once
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recurses too deep"),
        ("{{ raise_exception('no system turns') }}", "failed: TemplateError: no system turns"),
    ],
)
def test_a_chat_template_runs_within_time_memory_and_text_bounds(
    llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, template: str, needle: str
) -> None:
    import resource
    import time

    from hookcli.inputs import chat

    monkeypatch.setattr(chat, "CHAT_SECONDS", 2.0)
    monkeypatch.setattr(chat, "CHAT_MEMORY", 256 << 20)
    folder = _with_template(llama, tmp_path, template)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    res = run("inspect", f"hf:{folder}", "--text", "The cat", "--chat", "-l", "lm_head")
    one_line_error(res, 2, "--chat: the tokenizer's chat template", needle)
    assert time.monotonic() - started < 30  # (a bound far above the 2 s, never a timing test)
    # the rendering ran in a child: this process did not grow by the gigabytes it tried
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 512 << 10, grown  # KiB


def test_a_bounded_chat_template_renders_as_transformers_does(llama: Path, tmp_path: Path) -> None:
    from hookcli.inputs.chat import render_chat

    folder = _with_template(llama, tmp_path, GOOD_TEMPLATE)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    texts = ["The cat", "a dog ran 'quoted' \u00e9\u6f22"]
    want = [
        tok.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
        )
        for t in texts
    ]
    assert render_chat(tok, texts) == want
    res = run("inspect", f"hf:{folder}", "--text", "The cat", "--chat", "-l", "lm_head")
    assert res.exit_code == 0, res.output


# ------------------------------------------------ a long --text-file runs in batches and merges

WORDS = [
    "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "in", "park", "hello", "world", "once",
    "upon", "time", "there", "was", "model",
]  # fmt: skip


def _lines(path: Path, count: int) -> list[str]:
    import random

    rng = random.Random(0)
    lines = [" ".join(rng.choices(WORDS, k=rng.randint(1, 12))) for _ in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return lines


def test_a_long_text_file_runs_in_batches_and_merges_to_the_whole_files_statistics(
    llama: Path, tmp_path: Path
) -> None:
    lines = _lines(tmp_path / "lines.txt", 70)
    res = run(
        "inspect", f"hf:{llama}", "--text-file", str(tmp_path / "lines.txt"),
        "-l", "model.layers.0", "-l", "lm_head", "--batch-size", "16", "-f", "json",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["input"]["description"].startswith("70 texts from ")
    assert "in 5 batches of up to 16" in data["input"]["description"]
    # the oracle: transformers over every line at once, real tokens only, in float64
    model = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    enc = tok(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    real = enc["attention_mask"].bool()
    for name, tensor in (
        ("model.layers.0", out.hidden_states[1]),
        ("lm_head", out.logits),
    ):
        (call,) = [c for c in data["layers"] if c["name"] == name]
        got = call["outputs"][0]
        want = tensor[real].double()
        assert got["numel"] == want.numel()
        assert got["shape"][:2] == [70, enc["input_ids"].shape[1]]
        assert got["mean"] == pytest.approx(float(want.mean()), rel=1e-4, abs=1e-7)
        assert got["std"] == pytest.approx(float(want.std(unbiased=False)), rel=1e-4)
        assert got["min"] == pytest.approx(float(want.min()), rel=1e-5)
        assert got["max"] == pytest.approx(float(want.max()), rel=1e-5)
        assert "padding left out" in (got["note"] or "")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--per-token"], "--per-token works on one batch of text"),
        (["--topk", "3"], "--topk works on one batch of text"),
        (["--heads"], "--heads works on one batch of text"),
        (["--workers", "2"], "--workers decode images"),
    ],
)
def test_what_reads_one_batch_is_refused_on_a_batched_text_run(
    llama: Path, tmp_path: Path, extra: list[str], needle: str
) -> None:
    _lines(tmp_path / "lines.txt", 40)
    res = run("inspect", f"hf:{llama}", "--text-file", str(tmp_path / "lines.txt"), *extra)
    one_line_error(res, 2, needle)


def test_grads_and_lens_on_more_texts_than_one_batch_are_one_line(
    llama: Path, tmp_path: Path
) -> None:
    from hookcli.inputs.text import ONE_BATCH_TEXTS

    _lines(tmp_path / "lines.txt", 40)
    res = run("grads", f"hf:{llama}", "--text-file", str(tmp_path / "lines.txt"))
    one_line_error(res, 2, "next-token loss, a mean over one batch", "40 texts")
    _lines(tmp_path / "many.txt", ONE_BATCH_TEXTS + 1)
    res = run("lens", f"hf:{llama}", "--text-file", str(tmp_path / "many.txt"))
    one_line_error(res, 2, f"{ONE_BATCH_TEXTS + 1} texts in one padded batch", "inspect/check")


# ------------------------------------------- --text-file that is not a file, --tokenizer a file


def test_a_text_file_that_is_not_a_regular_file_is_named_as_what_it_is(
    llama: Path, tmp_path: Path
) -> None:
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for name, needle in (
        (str(fifo), "is a pipe, not a regular file"),
        (str(tmp_path), "is a folder"),
        ("/dev/zero", "is a device or special file"),
        (str(tmp_path / "none.txt"), "not found"),
    ):
        res = run("inspect", f"hf:{llama}", "--text-file", name, "-l", "lm_head")
        one_line_error(res, 2, needle)


def test_text_file_dash_reads_standard_input_once(llama: Path) -> None:
    from hookcli.cli import app

    runner = CliRunner()
    args = ["inspect", f"hf:{llama}", "--text-file", "-", "-l", "lm_head", "-f", "json"]
    res = runner.invoke(app, args, input="The cat\nA dog ran\n")
    assert res.exit_code == 0, res.output
    assert [t["text"] for t in json.loads(res.stdout)["input"]["texts"]] == ["The cat", "A dog ran"]
    # more than one batch: read once, though the run looks at its texts twice
    res = runner.invoke(app, args, input="".join(f"line {i}\n" for i in range(40)))
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["input"]["description"].startswith("40 texts from standard")


def test_a_text_files_bom_and_line_ends_read_as_standard_input_reads_them(
    llama: Path, tmp_path: Path
) -> None:
    """A text file saved with a UTF-8 byte order mark (Notepad, Excel) and Windows line ends:
    the mark is no text (no tokens of its own), CRLF ends a line, a lone CR inside a line
    splits nothing, and the file reads as the same bytes through standard input do."""
    from hookcli.cli import app

    data = b"\xef\xbb\xbfThe cat\r\nA dog\rran\r\n"
    (tmp_path / "t.txt").write_bytes(data)
    args = ["inspect", f"hf:{llama}", "-l", "lm_head", "-f", "json", "--text-file"]
    texts = []
    for res in (
        run(*args, str(tmp_path / "t.txt")),
        CliRunner().invoke(app, [*args, "-"], input=data),
    ):
        assert res.exit_code == 0, res.output
        texts.append(json.loads(res.stdout)["input"]["texts"])
    assert texts[0] == texts[1]
    assert [t["text"] for t in texts[0]] == ["The cat", "A dog\rran"]
    plain = run(*args[:-1], "--text", "The cat", "-f", "json")
    assert json.loads(plain.stdout)["input"]["texts"][0]["ids"] == texts[0][0]["ids"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("randint:0:100000:1x16", r"reach \d+, outside .*vocabulary \[0, \d+\)"),
        ("randint:-3:0:1x16", r"reach -\d, outside"),
        ("randint:0:10:16", r"\(batch, tokens\) tensor; given a --input's input_ids 16 \(1-D\)"),
    ],
)
def test_token_ids_given_as_input_are_checked_as_texts_tokens_are(
    llama: Path, spec: str, message: str
) -> None:
    """--input token ids a text model cannot take (past its vocabulary, negative, 1-D) are a
    usage error naming them, exit 2, as --text's and the Python API's are, not the model's
    IndexError inside its embedding (exit 3)."""
    res = run("inspect", f"hf:{llama}", "--input", spec, "-l", "lm_head")
    assert re.search(message, one_line_error(res, 2)), res.output


def test_a_tokenizer_file_or_an_empty_name_is_refused_with_the_way_round(
    llama: Path, tmp_path: Path
) -> None:
    res = run("inspect", f"hf:{llama}", "--text", "a", "-l", "lm_head",
              "--tokenizer", str(llama / "tokenizer.json"))  # fmt: skip
    one_line_error(res, 2, "is a file; a tokenizer is a folder", f"--tokenizer {llama}")
    res = run("inspect", f"hf:{llama}", "--text", "a", "-l", "lm_head", "--tokenizer", "")
    one_line_error(res, 2, "--tokenizer is empty")


# ---------------------------------------------------------- a malformed generation_config.json


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"max_new_tokens": "abc"}, "max_new_tokens 'abc'"),
        ({"temperature": -1, "do_sample": True}, "temperature -1"),
        ({"eos_token_id": "x"}, "eos_token_id 'x'"),
        ({"num_beams": 0}, "num_beams 0"),
        ([1, 2], "holds a list, not a JSON object"),
    ],
)
def test_a_malformed_generation_config_is_named_before_the_build(
    llama: Path, tmp_path: Path, settings: object, needle: str
) -> None:
    bad = tmp_path / "gen"
    shutil.copytree(llama, bad)
    (bad / "generation_config.json").write_text(json.dumps(settings))
    for args in (["--generate", "3"], []):
        res = run("inspect", f"hf:{bad}", "--text", "The cat", "-l", "lm_head", *args)
        line = one_line_error(res, 2, "generation_config.json", needle)
        assert "input shape" not in line
    # unset fields (null) and lists of ids are what save_pretrained writes
    (bad / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 3], "temperature": None, "max_new_tokens": 4})
    )
    res = run("inspect", f"hf:{bad}", "--text", "The cat", "-l", "lm_head", "--generate", "2")
    assert res.exit_code == 0, res.output


# ------------------------------------------- --meta blames the meta device only when it is to blame

BOOM = """
import torch
from torch import nn


class Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        self.l(x)
        raise RuntimeError("shape mismatch: expected 5 got 4")


class Reads(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        y = self.l(x)
        return y if y.sum() > 0 else -y
"""


def test_meta_names_the_meta_device_only_for_a_forward_that_reads_values(tmp_path: Path) -> None:
    folder = tmp_path / "meta-models"  # "meta" in the path: not a reason to blame the device
    folder.mkdir()
    (folder / "meta_boom.py").write_text(BOOM)
    spec = f"{folder / 'meta_boom.py'}"
    res = run("layers", f"{spec}:Fails", "--meta", "--input", "randn:2x4")
    line = one_line_error(res, 3, "shape mismatch: expected 5 got 4")
    assert "meta device" not in line
    res = run("layers", f"{spec}:Reads", "--meta", "--input", "randn:2x4")
    one_line_error(res, 3, "reads a tensor's values, which the meta device does not have")


# --------------------------------------------------------------- calib never writes a NaN scale

NAN_NET = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)
        self.l4 = nn.Linear(4, 4)

    def forward(self, x):
        b = self.l1(x).clone()
        b[..., 0] = float("nan")  # channel 0 of l2's input: no finite value
        d = x.clone()
        d[0, 0] = float("inf")  # one value of l4's input
        return self.l2(b).sum() + self.l4(d).sum()


class AllNan(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        return self.l(x * float("nan"))
"""


def test_calib_never_writes_a_nan_scale_and_says_where_nan_was(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    script = tmp_path / "nan_net.py"
    script.write_text(NAN_NET)
    out = tmp_path / "scales.safetensors"
    res = run("calib", f"{script}:Net", "--input", "randn:8x4", "-o", str(out), "-f", "json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [layer["name"] for layer in data["layers"]] == ["l1", "l4"]
    (skip,) = [s for s in data["skipped"] if s["name"] == "l2"]
    assert "1 of its 4 input channels held no finite value" in skip["reason"]
    assert any(n.startswith("l4: 1 NaN/Inf value in its input") for n in data["notes"])
    tensors = load_file(out)
    assert "l2" not in tensors and "l1" in tensors
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values())
    # nothing finite anywhere: nothing written, the model's failure
    out.unlink()
    res = run("calib", f"{script}:AllNan", "--input", "randn:8x4", "-o", str(out))
    one_line_error(res, 3, "no finite value", "--fail-on nonfinite")
    assert not out.exists()


# ---------------------------------------- the Python API: text of the wrong type, tokenizer output


def test_api_text_of_the_wrong_type_is_a_typeerror_that_says_what_it_takes(llama: Path) -> None:
    import hookcli

    for kwargs, needle in (
        ({"text": 5}, "text must be a string or a list of strings"),
        ({"text": ["a", 5]}, "a list holding int"),
        ({"text_file": 5}, "text_file must be a path"),
        ({"text": "a", "tokenizer": 5}, "tokenizer must be a path, ORG/NAME or a transformers"),
    ):
        with pytest.raises(TypeError, match=needle):
            hookcli.inspect(f"hf:{llama}", layers=["lm_head"], **kwargs)


def test_api_takes_a_tokenizers_output_and_a_tokenizer_object(llama: Path) -> None:
    import hookcli

    tok = transformers.AutoTokenizer.from_pretrained(llama)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    enc = tok(["The cat sat on", "A"], return_tensors="pt", padding=True)
    report = hookcli.inspect(model, enc, layers=["lm_head"])
    (out,) = report["lm_head"][0].outputs
    with torch.no_grad():
        logits = model(**enc).logits
    real = logits[enc["attention_mask"].bool()].double()  # the oracle: real tokens only
    assert out.numel == real.numel()
    assert out.mean == pytest.approx(float(real.mean()), rel=1e-5)
    assert "input_ids 2x" in report.input.description
    with pytest.raises(TypeError, match="return_tensors='pt'"):
        hookcli.inspect(model, tok(["a"]), layers=["lm_head"])
    # a tokenizer object instead of a path
    given = hookcli.inspect(model, text="The cat", tokenizer=tok, layers=["lm_head"])
    by_path = hookcli.inspect(f"hf:{llama}", text="The cat", layers=["lm_head"])
    assert given.input.texts is not None and by_path.input.texts is not None
    assert given.input.texts[0].ids == by_path.input.texts[0].ids
    assert "(given)" in (given.input.preprocessing or "")


def test_a_script_attribute_that_is_a_built_model_is_used_as_it_is(tmp_path: Path) -> None:
    script = tmp_path / "built.py"
    script.write_text(
        "import torch\nfrom torch import nn\n\nmodel = nn.Sequential(nn.Linear(4, 4), nn.ReLU())\n"
    )
    res = run("inspect", f"{script}:model", "--input", "randn:2x4", "-f", "json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [c["name"] for c in data["layers"]] == ["0", "1"]
    assert "built it" in data["model"]["weights"]
    res = run("inspect", f"{script}:model", "--input", "randn:2x4", "--model-arg", "n=3")
    one_line_error(res, 2, "a model already built", "--model-arg n")


# ------------------------------------------------- third-party chatter kept off the CLI's stderr

PYTREE = """
import torch.utils._pytree as pytree
from torch import nn


class Box:
    pass


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        # what torchao does on import: torch warns that this is deprecated (a FutureWarning)
        pytree._register_pytree_node(Box, lambda b: ([], None), lambda c, x: Box())
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        return self.l(x)
"""


def test_library_warnings_stay_off_the_command_lines_stderr(llama: Path, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    short = tmp_path / "short_max"
    shutil.copytree(llama, short)
    config = json.loads((short / "tokenizer_config.json").read_text())
    config["model_max_length"] = 4  # transformers warns of "indexing errors" past it
    (short / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "fw.py").write_text(PYTREE)
    exe = [sys.executable, "-m", "hookcli"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS",)}
    env.pop("TRANSFORMERS_VERBOSITY", None)
    for args in (
        ["inspect", f"hf:{short}", "--text", "the cat sat on the mat and the dog", "-l", "lm_head"],
        ["inspect", f"{tmp_path / 'fw.py'}:Net", "--input", "randn:2x4"],
    ):
        res = subprocess.run(
            [*exe, *args], capture_output=True, text=True, env=env, check=False, cwd=tmp_path
        )
        assert res.returncode == 0, res.stderr
        assert res.stderr == "", res.stderr
    # a user who asks for warnings gets them
    env["PYTHONWARNINGS"] = "default"
    res = subprocess.run(
        [*exe, "inspect", f"{tmp_path / 'fw.py'}:Net", "--input", "randn:2x4"],
        capture_output=True, text=True, env=env, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert "FutureWarning" in res.stderr


# -------------------------------------------- --target-text: a seq2seq model's teacher-forced loss


@pytest.fixture(scope="module")
def bart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.llm import save

    return save(tmp_path_factory.mktemp("r5_bart"), "bart")


def test_target_text_gives_a_seq2seq_model_its_teacher_forced_loss_and_gradients(
    bart: Path,
) -> None:
    texts, targets = ["The cat sat on the mat", "A dog"], ["A dog ran in the park", "hello"]
    args = ["grads", f"hf:{bart}", "-l", "lm_head", "-f", "json"]
    for t, g in zip(texts, targets, strict=True):
        args += ["--text", t, "--target-text", g]
    res = run(*args)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["backward"]["source"].startswith("teacher-forced cross-entropy of the target")
    # the oracle: transformers' own loss from labels (it shifts them into the decoder itself)
    model = transformers.BartForConditionalGeneration.from_pretrained(bart).eval()
    tok = transformers.AutoTokenizer.from_pretrained(bart)
    enc = tok(texts, return_tensors="pt", padding=True)
    labels = tok(text_target=targets, return_tensors="pt", padding=True)
    ids = labels["input_ids"].masked_fill(labels["attention_mask"] == 0, -100)
    out = model(**enc, labels=ids, decoder_attention_mask=labels["attention_mask"])
    assert data["backward"]["value"] == pytest.approx(float(out.loss.detach()), rel=1e-5)
    (weight,) = torch.autograd.grad(out.loss, model.lm_head.weight)
    (call,) = data["layers"]
    (param,) = [p for p in call["params"] if p["name"] == "weight"]
    assert param["grad"]["norm"] == pytest.approx(float(weight.double().norm()), rel=1e-4)


def test_target_text_where_it_cannot_be_is_one_line(bart: Path, llama: Path) -> None:
    res = run("grads", f"hf:{llama}", "--text", "a", "--target-text", "b", "-l", "lm_head")
    one_line_error(res, 2, "--target-text is a seq2seq model's target", "causal LM")
    res = run("grads", f"hf:{bart}", "--text", "a", "--text", "b", "--target-text", "c")
    one_line_error(res, 2, "1 --target-text for 2 texts")
    res = run("grads", f"hf:{bart}", "--text", "a cat", "--target", "next-token", "-l", "lm_head")
    one_line_error(res, 2, "needs its target text", "--target-text")


# ---------------------------------- --per-token rows of every tensor leave the padding out


def test_per_token_rows_of_the_models_output_and_a_shared_input_are_real_tokens(
    llama: Path,
) -> None:
    res = run(
        "inspect", f"hf:{llama}", "--text", "The cat sat on the mat", "--text", "A",
        "-l", "model.layers.0", "-l", "model.layers.1", "--per-token", "-f", "json",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    texts = data["input"]["texts"]
    real = sum(len(t["ids"]) for t in texts)
    shared = next(c for c in data["layers"] if c["name"] == "model.layers.1")["inputs"][0]
    logits = data["outputs"][0]
    for t in (shared, logits):
        rows = t["per_token"]
        assert len(rows) == real, (t["path"], len(rows), real)
        want = [(s, i, tid) for s, x in enumerate(texts) for i, tid in enumerate(x["ids"])]
        assert [(r["sequence"], r["position"], r["id"]) for r in rows] == want
        assert all(r["token"] for r in rows)


def test_attn_takes_target_text_as_the_decoders_tokens(bart: Path, tmp_path: Path) -> None:
    import hookcli

    tok = transformers.AutoTokenizer.from_pretrained(bart)
    target = "A dog ran"
    drawing = hookcli.attn(
        f"hf:{bart}", text="The cat sat on", target_text=target,
        layer="model.decoder.layers.0.encoder_attn",
    )  # fmt: skip
    decoder = len(tok(text_target=target)["input_ids"])
    text = len(tok("The cat sat on")["input_ids"])
    assert tuple(drawing.picture.raw.shape[-2:]) == (decoder, text)
    res = run(
        "attn", f"hf:{bart}", "--text", "The cat sat on", "--target-text", target,
        "-l", "model.decoder.layers.0.encoder_attn", "-o", str(tmp_path / "x.png"),
    )  # fmt: skip
    assert res.exit_code == 0, res.output


def test_the_lens_of_a_padded_seq2seq_batch_reads_each_targets_own_decoder_positions(
    bart: Path,
) -> None:
    """Targets of different lengths: the shorter one's decoder positions are those it has run
    alone (the start token, then its labels but the last), with that run's probabilities;
    none for the positions its padding feeds."""
    import hookcli

    texts, targets = ["The cat sat on the mat.", "hello"], ["A dog ran in the park.", "the cat"]
    report = hookcli.lens(f"hf:{bart}", text=texts, target_text=targets, topk=1)
    model = transformers.BartForConditionalGeneration.from_pretrained(bart).eval()
    tok = transformers.AutoTokenizer.from_pretrained(bart)
    layer = "model.decoder.layers.0"
    for seq, (text, target) in enumerate(zip(texts, targets, strict=True)):
        labels = tok(text_target=target, return_tensors="pt")["input_ids"]
        decoder = model.prepare_decoder_input_ids_from_labels(labels=labels)
        with torch.no_grad():
            out = model(
                **tok(text, return_tensors="pt"), decoder_input_ids=decoder,
                output_hidden_states=True,
            )  # fmt: skip
            hidden = out.decoder_hidden_states[1][0]  # the first block's output
            probs = (model.lm_head(hidden) + model.final_logits_bias).double().softmax(-1)
        cells = sorted(
            (c.position, c.top[0]) for c in report.lens if c.sequence == seq and c.layer == layer
        )
        assert [p for p, _ in cells] == list(range(decoder.shape[1])), seq
        for (_, top), want in zip(cells, probs, strict=True):
            assert top.index == int(want.argmax())
            assert top.prob == pytest.approx(float(want.max()), rel=1e-5)
    assert len(report.tokens[1]) == len(tok(text_target=targets[1])["input_ids"])


def test_the_lens_command_takes_target_text_as_the_api_does(bart: Path) -> None:
    """`hookcli lens --target-text`: the command had no such option (a seq2seq lens from the
    command line read the decoder's start token alone). Its cells are the API's: each
    target's decoder positions (the start token, then its labels but the last)."""
    import hookcli

    text, target = "The cat sat on the mat.", "A dog ran in the park."
    res = run("lens", f"hf:{bart}", "--text", text, "--target-text", target, "-k", "1",
              "-f", "json")  # fmt: skip
    assert res.exit_code == 0, res.stderr
    cells = json.loads(res.stdout)["lens"]
    api = hookcli.lens(f"hf:{bart}", text=[text], target_text=[target], topk=1)
    tok = transformers.AutoTokenizer.from_pretrained(bart)
    positions = len(tok(text_target=target)["input_ids"])
    layer = "model.decoder.layers.0"
    got = sorted((c["position"], c["top"][0]["index"]) for c in cells if c["layer"] == layer)
    want = sorted((c.position, c.top[0].index) for c in api.lens if c.layer == layer)
    assert got == want and [p for p, _ in got] == list(range(positions))


def test_targets_as_long_as_the_padded_texts_are_not_read_with_the_texts_padding(
    bart: Path,
) -> None:
    """The decoder's (batch, tokens) the size of the texts' padded batch: the texts' padding is
    left out of the encoder's tensors only, never of the decoder's rows (whose padding is
    another); the loss is transformers' own from the labels."""
    import hookcli

    tok = transformers.AutoTokenizer.from_pretrained(bart)
    texts = ["The cat sat on the mat.", "hello"]
    targets = [texts[0], "hi"]  # as long as the longest text: the same padded length
    enc = tok(texts, return_tensors="pt", padding=True)
    lab = tok(text_target=targets, return_tensors="pt", padding=True)
    assert lab["input_ids"].shape == enc["input_ids"].shape
    assert lab["attention_mask"].tolist() != enc["attention_mask"].tolist()
    layers = ["model.encoder.layers.0", "model.decoder.layers.0"]
    report = hookcli.grads(
        f"hf:{bart}", text=texts, target_text=targets, layers=layers, device="cpu"
    )
    model = transformers.BartForConditionalGeneration.from_pretrained(bart).eval()
    labels = lab["input_ids"].masked_fill(lab["attention_mask"] == 0, -100)
    out = model(
        **enc, labels=labels, decoder_attention_mask=lab["attention_mask"],
        output_hidden_states=True,
    )  # fmt: skip
    assert report.backward is not None
    assert report.backward.value == pytest.approx(float(out.loss.detach()), rel=1e-5)
    encoder = report["model.encoder.layers.0"][0].outputs[0]
    real = out.encoder_hidden_states[1].detach()[enc["attention_mask"].bool()].double()
    assert encoder.numel == real.numel()
    assert encoder.mean == pytest.approx(float(real.mean()), rel=1e-5)
    decoder = report["model.decoder.layers.0"][0].outputs[0]
    assert decoder.shape[1] != enc["input_ids"].shape[1]  # never the texts' positions
    assert decoder.numel == math.prod(decoder.shape)
    assert "padding left out" not in str(decoder.note)


# ------------------------------------------------------------ found by the review before the stop


def test_a_seq2seq_tokenizers_text_target_through_the_api_is_its_decoders_input(
    bart: Path,
) -> None:
    import hookcli

    tok = transformers.AutoTokenizer.from_pretrained(bart)
    model = transformers.BartForConditionalGeneration.from_pretrained(bart).eval()
    enc = tok(["The cat sat"], text_target=["A dog ran in"], return_tensors="pt")
    report = hookcli.grads(model, enc, layers=["lm_head"], target="sum")
    (out,) = report["lm_head"][0].outputs
    with torch.no_grad():
        logits = model(**enc).logits  # transformers shifts the labels into the decoder itself
    assert tuple(out.shape) == tuple(logits.shape)
    assert out.mean == pytest.approx(float(logits.double().mean()), rel=1e-5)


def test_target_text_is_padded_on_the_right_whatever_the_batchs_side(bart: Path) -> None:
    from hookcli.engine.prepare import prepare
    from hookcli.options import InputOptions, ModelOptions

    texts, targets = ("The cat sat on", "A"), ("A dog ran in the park", "hello")
    built = {
        side: prepare(
            ModelOptions(f"hf:{bart}"),
            None,
            InputOptions(text=texts, target_text=targets, padding_side=side),
        ).model_input
        for side in ("left", "right")
    }
    left, right = built["left"], built["right"]
    assert left is not None and right is not None
    assert int(left.kwargs["attention_mask"][1, 0]) == 0  # the texts: padded on the left
    assert left.labels is not None and right.labels is not None
    assert left.labels.tolist() == right.labels.tolist()
    assert left.kwargs["decoder_input_ids"].tolist() == right.kwargs["decoder_input_ids"].tolist()
    assert int(left.kwargs["decoder_attention_mask"][1, 0]) == 1  # the start token is read


def test_a_batched_text_run_names_its_longest_line_and_renders_chat_in_chunks(
    llama: Path, tmp_path: Path
) -> None:
    lines = _lines(tmp_path / "lines.txt", 40)
    long = " ".join(["the cat"] * 80)  # past the tiny model's 64 positions
    (tmp_path / "long.txt").write_text("\n".join([*lines[:39], long]) + "\n")
    res = run("inspect", f"hf:{llama}", "--text-file", str(tmp_path / "long.txt"), "-l", "lm_head")
    line = one_line_error(res, 2, "is longer than", "(64,")
    assert f"{len(long.split())}" in line or "tokens" in line
    res = run(
        "inspect", f"hf:{llama}", "--text-file", str(tmp_path / "lines.txt"), "--chat",
        "-l", "lm_head", "-f", "json",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "chat template" in json.loads(res.stdout)["input"]["preprocessing"]


@pytest.mark.parametrize(
    ("option", "inputs"),
    [
        (["--chat"], ["--input", "randint:0:50:1x8"]),  # tensor ids: no text to template
        (["--target-text", "Hi"], ["--input", "randint:0:50:1x8"]),
        (["--chat"], []),  # no input at all: random ids
        (["--padding-side", "left"], ["--input", "randint:0:50:1x8"]),
    ],
)
def test_a_text_option_without_text_is_refused(
    llama: Path, option: list[str], inputs: list[str]
) -> None:
    """--chat, --target-text and --padding-side shape what a text becomes: given with token
    ids or no input,
    they were silently ignored (the run went on as if they were not there)."""
    res = run("inspect", f"hf:{llama}", *inputs, *option, "-l", "lm_head")
    one_line_error(res, 2, f"{option[0]} applies to text input", "--text")


def test_a_padding_side_that_is_neither_left_nor_right_is_refused(llama: Path) -> None:
    res = run("inspect", f"hf:{llama}", "--text", "a", "--text", "b c", "--padding-side", "top")
    one_line_error(res, 2, "--padding-side must be left or right, not 'top'")


@pytest.mark.parametrize("name", ["model.layers.0", "model.layers.0.self_attn", "model.rotary_emb"])
def test_a_lens_norm_that_cannot_take_the_hidden_states_alone_is_refused(
    llama: Path, name: str
) -> None:
    """--norm naming a block, an attention or the rotary embedding (weightless, or needing
    more arguments): tried once on one zero position before the pass and refused in one line
    (it ended in an internal error, exit 3, when the lens called it)."""
    res = run("lens", f"hf:{llama}", "--text", "hi there", "--norm", name)
    one_line_error(res, 2, f"--norm {name}", "cannot be called on the hidden states alone")


def test_per_token_with_generate_says_the_generated_tokens_calls_have_no_rows(
    llama: Path,
) -> None:
    """--per-token --generate: the prompt's call gets its rows; the generated tokens' calls (one
    position each, with the KV cache) got none without a word. The report says so."""
    res = run("inspect", f"hf:{llama}", "--text", "The cat sat", "--generate", "2",
              "--per-token", "-l", "model.layers.1", "-f", "json")  # fmt: skip
    assert res.exit_code == 0, res.stderr
    report = json.loads(res.stdout)
    calls = {c["call"]: c for c in report["layers"]}
    assert calls[0]["outputs"][0]["per_token"] and not calls[1]["outputs"][0].get("per_token")
    assert any("--per-token: the prompt's positions" in n for n in report["notes"])


def test_padding_side_right_with_generate_is_refused(llama: Path) -> None:
    """--generate pads on the left (model.generate appends after the last real token): an
    explicit --padding-side right was replaced without a word."""
    res = run("inspect", f"hf:{llama}", "--text", "the cat", "--text", "a dog ran far",
              "--padding-side", "right", "--generate", "2", "-l", "lm_head")  # fmt: skip
    one_line_error(res, 2, "--padding-side right cannot apply", "--generate")


def test_the_lens_final_norm_named_on_an_offloaded_model(llama: Path) -> None:
    """offload=True keeps the weights on meta until a hook brings them in: the --norm trial
    (one zero position) must not refuse the model's own final norm; the lens equals the
    default's, which finds the same norm."""
    import hookcli

    named = hookcli.lens(f"hf:{llama}", text="the cat sat", norm="model.norm", offload=True)
    found = hookcli.lens(f"hf:{llama}", text="the cat sat", offload=True)
    top = lambda r: [(c.layer, c.position, c.top[0].index) for c in r.lens]  # noqa: E731
    assert top(named) == top(found) and named.lens
