"""--offload and --meta (issue 39): a checkpoint run block by block gives every number the
in-memory run gives (transformers' own from_pretrained is the in-memory run); a model built on
the meta device has the real model's parameter counts, shapes and FLOPs, with no weight read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app

transformers = pytest.importorskip("transformers")
runner = CliRunner()
TEXT = ["The cat sat on the mat.", "A dog ran in the park today."]


def _save(folder: Path, model: Any, **kw: Any) -> Path:
    from tests.support.llm import make_tokenizer

    model.save_pretrained(folder, **kw)
    make_tokenizer().save_pretrained(folder)
    return folder


def _llama(**extra: Any) -> Any:
    from tests.support.llm import llama_config

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config(**extra)).eval()


def _gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=320, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


CASES = {
    "llama": lambda f: _save(f, _llama()),
    "llama-bf16-sharded": lambda f: _save(f, _llama().to(torch.bfloat16), max_shard_size="20KB"),
    "gpt2-tied": lambda f: _save(f, _gpt2()),
}


def _numbers(report: Any) -> dict[str, Any]:
    d = report.to_dict()
    return {k: d[k] for k in ("layers", "outputs", "predictions", "never_called")}


@pytest.mark.parametrize("case", list(CASES))
def test_offloaded_numbers_equal_the_in_memory_run(case: str, tmp_path: Path) -> None:
    folder = CASES[case](tmp_path / case)
    if "sharded" in case:
        assert (folder / "model.safetensors.index.json").is_file()
    spec = f"hf:{folder}"
    whole = hookcli.inspect(spec, text=TEXT, channels=True)
    off = hookcli.inspect(spec, text=TEXT, channels=True, offload=True)
    assert _numbers(off) == _numbers(whole)
    assert any("--offload" in n for n in off.notes)
    # and the in-memory run is transformers' own: the logits' statistics are its logits'
    one = hookcli.inspect(spec, text=TEXT[:1], offload=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        logits = model(**tok(TEXT[:1], return_tensors="pt")).logits.double()
    out = next(t for t in one.outputs if "logits" in t.path)
    assert out.max == float(logits.max()) and out.min == float(logits.min())
    assert out.mean == pytest.approx(float(logits.mean()), rel=1e-6)
    assert whole.model.params == off.model.params == sum(p.numel() for p in model.parameters())


def _no_dtype(folder: Path) -> Path:
    """A config.json that names no dtype (from_pretrained then takes the weights')."""
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _t5_fp16(folder: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=320, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0,
    )  # fmt: skip
    return _save(folder, transformers.T5ForConditionalGeneration(config).half().eval())


@pytest.mark.parametrize("case", ["bf16-no-dtype", "t5-fp16"])
def test_offloaded_parameters_take_the_dtype_from_pretrained_gives_them(
    case: str, tmp_path: Path
) -> None:
    if case == "t5-fp16":
        folder = _t5_fp16(tmp_path / case)
    else:
        folder = _no_dtype(_save(tmp_path / case, _llama().to(torch.bfloat16)))
    from hookcli.engine.prepare import prepare
    from hookcli.options import ModelOptions

    loaded = (
        transformers.AutoModelForCausalLM
        if case != "t5-fp16"
        else (transformers.AutoModelForSeq2SeqLM)
    )
    truth = {n: p.dtype for n, p in loaded.from_pretrained(folder).named_parameters()}
    skeleton = prepare(ModelOptions(f"hf:{folder}", offload=True)).loaded.module
    assert {n: p.dtype for n, p in skeleton.named_parameters()} == truth
    assert len(set(truth.values())) == (2 if case == "t5-fp16" else 1)  # (kept in float32)
    spec = f"hf:{folder}"
    whole = hookcli.inspect(spec, text=TEXT[:1])
    off = hookcli.inspect(spec, text=TEXT[:1], offload=True)
    assert _numbers(off) == _numbers(whole)


def test_generate_and_check_run_offloaded(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", _llama())
    spec = f"hf:{folder}"
    whole = hookcli.inspect(spec, text=TEXT[:1], generate=4)
    off = hookcli.inspect(spec, text=TEXT[:1], generate=4, offload=True)
    assert off.generated == whole.generated and _numbers(off) == _numbers(whole)
    r = runner.invoke(
        app, ["check", spec, "--text", TEXT[0], "--offload", "--fail-on", "nonfinite"]
    )
    assert r.exit_code == 0, r.stderr


def test_offload_refusals_are_one_line_each(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", _llama())
    cases = [
        (["grads", f"hf:{folder}", "--text", "hi", "--offload"], 2, "--offload"),
        (["check", f"hf:{folder}", "--text", "hi", "--offload", "--backward"], 2, "backward"),
        (["inspect", "resnet18", "--offload"], 2, "Hugging Face checkpoint"),
        (["inspect", "hf:llama", "--offload"], 2, "model type"),
        (["inspect", f"hf:{folder}", "--offload", "--weights", str(folder / "w.pt")], 2,
         "--weights"),
    ]  # fmt: skip
    for args, code, needle in cases:
        r = runner.invoke(app, args)
        assert r.exit_code == code, (args, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (args, r.stderr)
    # a checkpoint that misses a weight, or is cut short: named, nothing run
    bad = _save(tmp_path / "bad", _llama())
    from safetensors.torch import load_file, save_file

    weights = load_file(bad / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    r = runner.invoke(app, ["inspect", f"hf:{bad}", "--text", "hi", "--offload"])
    assert r.exit_code == 2 and "model.layers.1.mlp.up_proj.weight" in r.stderr
    # a checkpoint whose shapes do not fit the config the model is built from
    r = runner.invoke(
        app, ["inspect", f"hf:{folder}", "--text", "hi", "--offload", "--model-arg",
              "intermediate_size=48"],
    )  # fmt: skip
    assert r.exit_code == 2 and "do not fit" in r.stderr and "gate_proj" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1
    cut = _save(tmp_path / "cut", _llama())
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    r = runner.invoke(app, ["inspect", f"hf:{cut}", "--text", "hi", "--offload"])
    assert r.exit_code == 2 and "not a safetensors file" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1


def _header_bytes(header: Any, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize(
    ("header", "needle"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
        ({"w": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}}, "whole numbers"),
        ({"w": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}, "whole numbers"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "whole numbers"),
        ({"w": {"dtype": "U32", "shape": [1], "data_offsets": [0, 4]}}, "dtype 'U32'"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 80]}}, "outside the file"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, "overlap"),
        ({"w": [1, 2]}, "not described by an object"),
        (b'{"w":', "not JSON"),
        # issue 49: a dtype that is a list or an object was an internal error (unhashable)
        ({"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, "of dtype ['F32']"),
        ({"w": {"dtype": {"a": 1}, "shape": [1], "data_offsets": [0, 4]}}, "of dtype {'a': 1}"),
    ],
)  # fmt: skip
def test_a_malformed_safetensors_header_is_refused_in_one_line(
    header: Any, needle: str, tmp_path: Path
) -> None:
    from hookcli.errors import UsageError
    from hookcli.sources.offload import _header

    path = tmp_path / "model.safetensors"
    path.write_bytes(_header_bytes(header, bytes(16)))
    with pytest.raises(UsageError) as caught:
        _header(path, "hf:x")
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_a_model_passed_in_cannot_be_offloaded() -> None:
    with pytest.raises(hookcli.UsageError if hasattr(hookcli, "UsageError") else Exception):
        hookcli.inspect(_llama(), input_specs=["input_ids=randint:0:320:1x4"], offload=True)


def test_a_model_accelerate_offloaded_itself_is_hooked_as_it_is() -> None:
    accelerate = pytest.importorskip("accelerate")
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(2, 3, 64, 64)
    whole = hookcli.inspect(model, x, stats_backend="kernel")
    trained = hookcli.grads(model, x, stats_backend="kernel", memory=True)
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    assert next(model.parameters()).device.type == "meta"  # weights come in per module
    off = hookcli.inspect(model, x, stats_backend="kernel")
    assert next(model.parameters()).device.type == "meta"  # left as found
    assert off.to_dict()["layers"] == whole.to_dict()["layers"]
    # a backward runs too; the parameters' own gradients are accelerate's copies': said so
    back = hookcli.grads(model, x, stats_backend="kernel", memory=True)
    assert back.memory is not None and trained.memory is not None
    # the weights' copies accelerate loads are what autograd saves; the meta ones hold nothing
    assert back.memory.saved_bytes > trained.memory.saved_bytes
    assert back.memory.parameter_bytes == 0 < trained.memory.parameter_bytes
    assert [c.grad_outputs for c in back.layers] == [c.grad_outputs for c in trained.layers]
    assert any("meta device" in n for n in back.notes)


# ---------------------------------------------------------------- --meta


SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


@pytest.mark.parametrize(
    ("name", "args"),
    [("resnet50", {}), ("vit_b_16", {}), ("hf:gpt2", {}), ("hf:llama", SMALL), ("hf:t5", {})],
)
def test_meta_layers_count_what_the_real_model_holds(name: str, args: dict[str, Any]) -> None:
    from hookcli.commands.listing import layers_report
    from hookcli.options import ModelOptions

    meta = layers_report(ModelOptions(name, meta=True, model_args=args))
    real = layers_report(ModelOptions(name, model_args=args), shapes=True)
    assert meta.model.params == real.model.params > 0
    assert [(r.name, r.params, r.tied) for r in meta.modules] == [
        (r.name, r.params, r.tied) for r in real.modules
    ]
    assert [(r.name, r.calls, r.output_shapes) for r in meta.modules] == [
        (r.name, r.calls, r.output_shapes) for r in real.modules
    ]
    assert meta.flops is not None and meta.flops > 0
    if name == "hf:gpt2":  # tied: counted once
        assert {r.name: r.tied for r in meta.modules if r.tied} == {
            "lm_head": ["weight = transformer.wte.weight"]
        }


def test_meta_flops_are_flop_counter_modes_on_the_real_model() -> None:
    import torchvision
    from torch.utils.flop_counter import FlopCounterMode

    from hookcli.commands.listing import layers_report
    from hookcli.options import ModelOptions

    meta = layers_report(ModelOptions("resnet18", meta=True))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        torchvision.models.resnet18().eval()(torch.randn(1, 3, 224, 224))
    assert meta.flops == counter.get_total_flops()
    by_name = {r.name: r.flops for r in meta.modules}
    per = counter.get_flop_counts()
    assert by_name["layer1"] == sum(per["ResNet.layer1"].values())


def test_a_70b_config_is_listed_with_no_weight_allocated(tmp_path: Path) -> None:
    from benchmarks.memory import LLAMA_70B

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    code = (
        "import sys\n"
        "from hookcli.cli import app\n"
        "from typer.testing import CliRunner\n"
        f"r = CliRunner().invoke(app, ['layers', 'hf:{tmp_path}', '--meta', '-f', 'json'])\n"
        "sys.stdout.write(r.stdout)\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')]\n"
        "sys.stderr.write(hwm[0].split()[1])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    data = json.loads(done.stdout)
    # Llama-3-70B: 70,553,706,496 parameters (8192 x 128256 embedding and head, 80 blocks)
    h, i, v, kv = 8192, 28672, 128256, 8 * 128
    block = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    assert data["model"]["params"] == 2 * v * h + 80 * block + h == 70_553_706_496
    assert int(done.stderr.strip().splitlines()[-1]) < 2 * 2**20  # KiB: under 2 GiB
    assert data["flops"] > 0


PEAK_CHILD = """
import json, sys
import hookcli
r = hookcli.inspect("hf:" + sys.argv[1], text=["The cat sat on the mat."],
                    offload=sys.argv[2] == "1")
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({"kib": int(hwm), "layers": r.to_dict()["layers"]}))
"""


@pytest.mark.slow
def test_an_offloaded_run_peaks_lower_than_the_in_memory_one(tmp_path: Path) -> None:
    """A 235 MB checkpoint (8 blocks of 12.6 MB, an embedding and a head of 65.5 MB), each
    run in a fresh process: the offloaded one holds one unit at a time."""
    from tests.support.llm import make_tokenizer

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "MALLOC_MMAP_THRESHOLD_": "65536",  # RSS follows live memory (benchmarks/_common.py)
        "MALLOC_TRIM_THRESHOLD_": "0",
    }
    runs = {}
    for flag in ("0", "1"):
        done = subprocess.run(
            [sys.executable, "-c", PEAK_CHILD, str(folder), flag],
            capture_output=True, text=True, env=env, timeout=600, check=True,
        )  # fmt: skip
        runs[flag] = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs["1"]["layers"] == runs["0"]["layers"]
    weights_kib = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1024
    # the in-memory run holds every weight; the offloaded one the largest unit (64 MiB) and
    # what it read last: measured 105 MB lower of 228 MB of weights (each run ~860 MB itself)
    assert runs["1"]["kib"] < runs["0"]["kib"] - weights_kib / 3


def test_meta_refuses_an_absurd_depth_in_one_line(tmp_path: Path) -> None:
    """issue 49: `layers --meta` of a config with 10⁶ layers ran on past 60 s."""
    r = runner.invoke(
        app, ["layers", "hf:llama", "--meta", "--model-arg", "num_hidden_layers=1000000"]
    )
    assert r.exit_code == 2, (r.exit_code, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "has 1000000 layers" in lines[0], r.stderr
    config = transformers.LlamaConfig(num_hidden_layers=1_000_000, vocab_size=32)
    config.save_pretrained(tmp_path)
    r = runner.invoke(app, ["layers", f"hf:{tmp_path}", "--meta"])
    assert r.exit_code == 2 and "has 1000000 layers" in r.stderr, r.stderr
    # a deep but real depth still builds
    r = runner.invoke(app, ["layers", "hf:llama", "--meta", "--model-arg",
                            "num_hidden_layers=130", "--model-arg", "hidden_size=64",
                            "--model-arg", "intermediate_size=128",
                            "--model-arg", "num_attention_heads=4",
                            "--model-arg", "num_key_value_heads=4"])  # fmt: skip
    assert r.exit_code == 0, r.stderr
