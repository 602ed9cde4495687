"""diff's sides in quantized LLMs' formats (commands/diff/quantsides.py): GGUF files written by the
`gguf` package, torchao's quantize_, bitsandbytes' layers. Oracles: the file's tensors as the
gguf package dequantizes them (q/k rows unpermuted by hand here), transformers' own logits of
a model holding them, transformers' own bitsandbytes load, torchao's and bitsandbytes' own
dequantization; KL by hand in float64."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.commands.diff.quantsides import dense_weight, weight_distances
from hookcli.commands.diff.sides import parse_side
from tests.support.cli import assert_one_line_error
from tests.support.gguf import dequantized, write_llama
from tests.support.llm import LINES, llama_config, make_tokenizer, save

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bitsandbytes' sides: its NF4 layers run on any CPU only 64 or more features wide."""
    return save(tmp_path_factory.mktemp("wide_llama"), "llama-wide")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(LINES) + "\n")
    return path


def _json(*args: str) -> dict[str, Any]:
    r = runner.invoke(app, ["diff", *args, "-f", "json"])
    assert r.exit_code == 0, (r.exit_code, r.stdout, r.stderr)
    data: dict[str, Any] = json.loads(r.stdout)
    return data


def _mean_kl(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """KL(A||B) in float64 over every position that predicts a next token of its text."""
    la, lb = a.double().log_softmax(-1), b.double().log_softmax(-1)
    kl = (la.exp() * (la - lb)).sum(-1)  # (batch, tokens)
    keep = mask.bool().clone()
    for i in range(keep.shape[0]):  # each text's last real token predicts nothing of it
        keep[i, int(keep[i].nonzero().max())] = False
    return float(kl[keep].mean())


def _logits(model: Any, folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    enc = tok(LINES, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits, enc["attention_mask"]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_a_gguf_side_holds_the_file_s_values_and_its_klds_are_transformers_own(
    tiny_llama: Path, corpus: Path, tmp_path: Path, qtype: str
) -> None:
    """The gguf side's model holds exactly the file's dequantized tensors: its KLD against A
    equals KL(A||B) computed by hand on transformers' logits of A and of A with those tensors;
    each Linear's weight SQNR is that of the file's values against A's."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    path = write_llama(model, tmp_path / f"tiny-{qtype}.gguf", qtype)
    data = _json(f"hf:{tiny_llama}", "--text-file", str(corpus), "--b", f"gguf:{path}")
    held = dequantized(path, model)
    b_model = copy.deepcopy(model)
    b_model.load_state_dict(held, strict=False)
    a, mask = _logits(model, tiny_llama)
    b, _ = _logits(b_model, tiny_llama)
    assert data["tokens"]["kld"]["mean"] == pytest.approx(_mean_kl(a, b, mask), rel=1e-6)
    weights = {w["layer"]: w for w in data["weights"]}
    q = "model.layers.1.self_attn.q_proj"
    wa = model.get_submodule(q).weight.detach().double()
    want = 10 * math.log10(float(wa.square().sum() / (wa - held[f"{q}.weight"]).square().sum()))
    assert weights[q]["sqnr_db"] == pytest.approx(want, rel=1e-9)
    assert weights[q]["type"] == "Linear"
    assert any(f"side gguf:{path}: its {qtype}" in n for n in data["notes"])
    assert data["tol"] == (0.1 if qtype == "Q8_0" else 0.3)  # the file's precision's default


def test_a_tied_models_file_with_its_own_output_weight_is_read_as_llama_cpp_reads_it(
    corpus: Path, tmp_path: Path
) -> None:
    """A model whose head is tied to its embeddings, and a GGUF file holding an output.weight
    of its own (Q8_0 beside Q4_0 embeddings): llama.cpp computes the logits with that one.
    The side put only the embeddings in (the head tied to them) and left the file's head
    unread, unsaid. Oracle: the model with the file's tensors, its head untied and set to
    the file's output.weight, KL by hand."""
    folder = tmp_path / "tied"
    torch.manual_seed(0)
    tied = transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=True)).eval()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    tied.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    path = write_llama(tied, tmp_path / "tied.gguf", "Q4_0", other={"lm_head.weight": "Q8_0"})
    data = _json(f"hf:{folder}", "--text-file", str(corpus), "--b", f"gguf:{path}", "--no-own")
    held = dequantized(path, tied)
    b_model = copy.deepcopy(tied)
    b_model.load_state_dict({k: v for k, v in held.items() if k != "lm_head.weight"}, strict=False)
    b_model.lm_head.weight = torch.nn.Parameter(held["lm_head.weight"])  # untied
    assert not torch.equal(b_model.lm_head.weight, b_model.model.embed_tokens.weight)
    a, mask = _logits(tied, folder)
    b, _ = _logits(b_model, folder)
    assert data["tokens"]["kld"]["mean"] == pytest.approx(_mean_kl(a, b, mask), rel=1e-6)
    assert any("output.weight is its own" in n for n in data["notes"])


def test_q4_0_parts_ways_more_than_q8_0(tiny_llama: Path, corpus: Path, tmp_path: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    kld = {}
    sqnr = {}
    for qtype in ("Q8_0", "Q4_0"):
        path = write_llama(model, tmp_path / f"tiny-{qtype}.gguf", qtype)
        data = _json(
            f"hf:{tiny_llama}", "--text-file", str(corpus), "--b", f"gguf:{path}", "--no-own"
        )
        kld[qtype] = data["tokens"]["kld"]["mean"]
        sqnr[qtype] = min(w["sqnr_db"] for w in data["weights"])
    assert 0 < kld["Q8_0"] < kld["Q4_0"] / 10
    assert sqnr["Q8_0"] > 35  # 8 bits: about 40 dB
    assert 15 < sqnr["Q4_0"] < 25  # 4 bits: about 20 dB


def test_a_planted_two_bit_layer_tops_the_per_layer_tables(tmp_path: Path) -> None:
    """A Llama whose every matrix is Q8_0 but one Linear, ternary (TQ2_0, 2 bits a weight):
    that layer has the lowest weight SQNR and the largest own error."""
    torch.manual_seed(0)
    config = llama_config()
    config.hidden_size, config.intermediate_size = 256, 512
    model = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path / "llama256"
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    fragile = "model.layers.0.mlp.up_proj"
    path = write_llama(
        model, tmp_path / "planted.gguf", "Q8_0", other={f"{fragile}.weight": "TQ2_0"}
    )
    r = runner.invoke(
        app,
        ["diff", f"hf:{folder}", "--text", LINES[0], "--text", LINES[1], "--b", f"gguf:{path}",
         "--sort", "own", "-f", "json"],
    )  # fmt: skip
    assert r.exit_code == 1, r.stdout  # past the default tolerance (int4's, 0.3) …
    assert "de-quantizing" not in r.stderr  # transformers' progress bar: not on stderr
    data = json.loads(r.stdout)
    assert data["first_over"].startswith(fragile), data["first_over"]  # … first there
    assert data["weights"][0]["layer"] == fragile
    assert data["weights"][0]["sqnr_db"] < 12 < data["weights"][1]["sqnr_db"]
    assert data["largest_own"][0]["name"] == fragile
    assert data["calls"][0]["name"] == fragile  # --sort own


def test_a_gguf_side_of_another_model_is_one_line(
    tiny_llama: Path, corpus: Path, tmp_path: Path
) -> None:
    torch.manual_seed(1)
    config = llama_config()
    config.vocab_size = 400
    other = transformers.LlamaForCausalLM(config).eval()
    path = write_llama(other, tmp_path / "other.gguf", "Q8_0")
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    cases = [
        (["--b", f"gguf:{path}"], "vocab_size 400 in the file, 320 in the model"),
        (["--b", f"gguf:{not_gguf}"], "cannot be read as a GGUF file"),
        (["--b", f"gguf:{tmp_path / 'missing.gguf'}"], "not found"),
    ]
    for args, says in cases:
        r = runner.invoke(app, ["diff", f"hf:{tiny_llama}", "--text-file", str(corpus), *args])
        assert r.exit_code == 2, (args, r.stdout, r.stderr)
        assert says in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = runner.invoke(app, ["diff", "resnet18", "--b", f"gguf:{path}"])
    assert r.exit_code == 2 and "not one" in r.stderr


def test_a_path_after_the_colon_keeps_its_case(tmp_path: Path) -> None:
    model = transformers.LlamaForCausalLM(llama_config()).eval()
    path = write_llama(model, tmp_path / "Tiny-Q8_0.GGUF", "Q8_0")
    side = parse_side(f"gguf:{path}", "--b")
    assert side.parts[0].path == str(path)  # type: ignore[attr-defined]
    assert parse_side("autocast:BFloat16", "--b").autocast == torch.bfloat16
    # an output may not overwrite the file the side reads
    r = runner.invoke(app, ["diff", "hf:x", "--b", f"gguf:{path}", "-o", str(path)])
    assert r.exit_code == 2 and "also an input of this run" in r.stderr, r.stderr


def test_torchao_sides_are_torchao_s_own_quantization(tiny_llama: Path, corpus: Path) -> None:
    """torchao:int8wo: every Linear's weight SQNR is that of torchao's own dequantized weight;
    int4wo on this CPU says which torchao config made it."""
    torchao = pytest.importorskip("torchao.quantization")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    own = copy.deepcopy(model)
    torchao.quantize_(own, torchao.Int8WeightOnlyConfig())
    data = _json(f"hf:{tiny_llama}", "--text-file", str(corpus), "--b", "torchao:int8wo")
    got = {w["layer"]: w["sqnr_db"] for w in data["weights"]}
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(got) == sorted(linears)
    for name in linears:
        wa = model.get_submodule(name).weight.detach().double()
        wb = own.get_submodule(name).weight.detach().dequantize().double()
        want = 10 * math.log10(float(wa.square().sum() / (wa - wb).square().sum()))
        assert got[name] == pytest.approx(want, rel=1e-9), name
    assert data["tokens"]["kld"]["mean"] > 0
    data = _json(
        f"hf:{tiny_llama}", "--text-file", str(corpus), "--b", "torchao:int4wo:32", "--no-own"
    )
    assert any("IntxWeightOnlyConfig, asymmetric" in n for n in data["notes"])
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_primitives import MappingType

    int4 = copy.deepcopy(model)
    torchao.quantize_(
        int4,
        torchao.IntxWeightOnlyConfig(
            weight_dtype=torch.int4, granularity=PerGroup(32), mapping_type=MappingType.ASYMMETRIC
        ),
    )
    got = {w["layer"]: w["sqnr_db"] for w in data["weights"]}
    for name in linears:
        wa = model.get_submodule(name).weight.detach().double()
        wb = int4.get_submodule(name).weight.detach().dequantize().double()
        want = 10 * math.log10(float(wa.square().sum() / (wa - wb).square().sum()))
        assert got[name] == pytest.approx(want, rel=1e-9), name
    assert 15 < min(got.values()) < 25  # 4 bits: about 20 dB
    # groups of 64: the 32-wide layers are left as they are, and said to be
    skipped = _json(f"hf:{tiny_llama}", "--text", LINES[0], "--b", "torchao:int4wo:64", "--no-own")
    assert any("left unquantized" in n for n in skipped["notes"])
    assert skipped["tokens"]["kld"]["mean"] > 0
    # groups of 128 (the default) fit none of them: side B would be side A, a report of
    # nothing; one line naming the group that fits (it passed every gate with exit 0)
    r = runner.invoke(
        app, ["diff", f"hf:{tiny_llama}", "--text", LINES[0], "--b", "torchao:int4wo",
              "--max-kld", "1e-9"],
    )  # fmt: skip
    assert_one_line_error(r, 2, "quantizes none of", "group 128", "torchao:int4wo:32")


@pytest.mark.parametrize("scheme", ["nf4", "int8"])
def test_a_bnb_side_computes_what_transformers_bitsandbytes_load_computes(
    wide_llama: Path, corpus: Path, scheme: str
) -> None:
    """bnb:nf4 and bnb:int8 quantize as transformers' BitsAndBytesConfig does by default (its
    output head kept): the same logits, so the same KLD, and the same dequantized weights."""
    pytest.importorskip("bitsandbytes")
    model = transformers.AutoModelForCausalLM.from_pretrained(wide_llama).eval()
    qc = (
        transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        )
        if scheme == "nf4"
        else transformers.BitsAndBytesConfig(load_in_8bit=True)
    )
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        wide_llama, quantization_config=qc, device_map="cpu"
    ).eval()
    data = _json(f"hf:{wide_llama}", "--text-file", str(corpus), "--b", f"bnb:{scheme}")
    a, mask = _logits(model, wide_llama)
    b, _ = _logits(theirs, wide_llama)
    assert data["tokens"]["kld"]["mean"] == pytest.approx(_mean_kl(a, b, mask), rel=1e-6)
    weights = {w["layer"]: w for w in data["weights"]}
    assert "lm_head" not in weights  # kept, as transformers keeps it
    q = "model.layers.0.self_attn.q_proj"
    layer = theirs.get_submodule(q)
    bf = pytest.importorskip("bitsandbytes.functional")
    if scheme == "nf4":  # bitsandbytes' own dequantization of transformers' layer
        held = bf.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    else:
        scales = layer.weight.SCB if layer.weight.SCB is not None else layer.state.SCB
        held = bf.int8_vectorwise_dequant(layer.weight.data, scales)
    wa = model.get_submodule(q).weight.detach().double()
    want = 10 * math.log10(float(wa.square().sum() / (wa - held.double()).square().sum()))
    assert weights[q]["sqnr_db"] == pytest.approx(want, rel=1e-6)
    assert weights[q]["type"] == "Linear"  # A's, and B's beside it
    assert weights[q]["type_b"] == ("Linear4bit" if scheme == "nf4" else "Linear8bitLt")
    assert dense_weight(layer) is not None


def test_weight_distances_are_the_sqnr_by_hand() -> None:
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    b = copy.deepcopy(a)  # layer 2 the same values: left out
    b[0].weight.data = a[0].weight.data.half().float()
    found, notes = weight_distances(a, b)
    assert [d.layer for d in found] == ["0"] and notes == []
    w = a[0].weight.detach().double()
    noise = (w - b[0].weight.detach().double()).square().sum()
    assert found[0].sqnr_db == pytest.approx(10 * math.log10(float(w.square().sum() / noise)))
    assert found[0].rel_l2 == pytest.approx(math.sqrt(float(noise / w.square().sum())))
    assert found[0].numel == 32


def test_a_quantized_checkpoint_folder_is_a_side_as_transformers_loads_it(
    wide_llama: Path, corpus: Path, tmp_path: Path
) -> None:
    """hf:FOLDER, a bitsandbytes NF4 checkpoint saved by transformers: its KLD is that of
    transformers' own load of the folder, and the same as bnb:nf4's (one quantization)."""
    pytest.importorskip("bitsandbytes")
    qc = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        wide_llama, quantization_config=qc, device_map="cpu"
    )
    folder = tmp_path / "nf4"
    quantized.save_pretrained(folder)
    data = _json(f"hf:{wide_llama}", "--text-file", str(corpus), "--b", f"hf:{folder}")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, device_map="cpu").eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(wide_llama).eval()
    a, mask = _logits(model, wide_llama)
    b, _ = _logits(loaded, wide_llama)
    assert data["tokens"]["kld"]["mean"] == pytest.approx(_mean_kl(a, b, mask), rel=1e-6)
    assert data["tol"] == 0.3  # its quantization_config: 4 bits
    assert any("quantized with bitsandbytes" in n for n in data["notes"])
    ours = _json(f"hf:{wide_llama}", "--text-file", str(corpus), "--b", "bnb:nf4", "--no-own")
    assert ours["tokens"]["kld"] == data["tokens"]["kld"]
    # another architecture's folder, and a folder that is not a checkpoint: one line each
    other = tmp_path / "other"
    config = llama_config(hidden_size=96)
    transformers.LlamaForCausalLM(config).save_pretrained(other)
    for side, says in (
        (f"hf:{other}", "hidden_size 96 in the folder"),
        (f"hf:{tmp_path}", "no config.json"),
    ):
        r = runner.invoke(app, ["diff", f"hf:{wide_llama}", "--text", LINES[0], "--b", side])
        assert r.exit_code == 2, r.stderr
        assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_folder_side_whose_weights_do_not_all_load_is_refused(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """hf:FOLDER loaded its model with every parameter the folder did not hold at random (a
    renamed checkpoint, one layer missing) and compared that, with exit 0; a weights file cut
    short was an internal error (exit 3). Each is one line, exit 2, and no output file."""
    from safetensors.torch import load_file, save_file

    weights = load_file(tiny_llama / "model.safetensors")
    cases = {
        "renamed": ({f"transformer.{k}": v for k, v in weights.items()}, "missing (would start"),
        "missing": (
            {k: v for k, v in weights.items() if "layers.1.mlp.down_proj" not in k},
            "model.layers.1.mlp.down_proj.weight",
        ),
    }
    for name, (tensors, says) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text((tiny_llama / "config.json").read_text())
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        out = tmp_path / f"{name}.json"
        r = runner.invoke(
            app, ["diff", f"hf:{tiny_llama}", "--text", LINES[0], "--b", f"hf:{folder}",
                  "-o", str(out)],
        )  # fmt: skip
        assert_one_line_error(r, 2, "weights do not fit", says)
        assert not out.exists()
    # the model built without its head (--head base): the folder's head has no place in
    # it, as in model A's own load; said, not refused
    r = runner.invoke(
        app, ["diff", f"hf:{tiny_llama}", "--head", "base", "--text", LINES[0],
              "--b", f"hf:{tiny_llama}", "-f", "json"],
    )  # fmt: skip
    assert r.exit_code in (0, 1), r.stderr
    assert any("not taken lm_head.weight" in n for n in json.loads(r.stdout)["notes"])
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "config.json").write_text((tiny_llama / "config.json").read_text())
    whole = (tiny_llama / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    r = runner.invoke(app, ["diff", f"hf:{tiny_llama}", "--text", LINES[0], "--b", f"hf:{cut}"])
    assert_one_line_error(r, 2, "weights cannot be read")


def test_the_weights_are_parquet_rows_read_back_by_pandas(
    tiny_llama: Path, corpus: Path, tmp_path: Path
) -> None:
    pd = pytest.importorskip("pandas")
    pytest.importorskip("torchao")
    out = tmp_path / "diff.parquet"
    args = [f"hf:{tiny_llama}", "--text-file", str(corpus), "--b", "torchao:int8wo", "--no-own"]
    r = runner.invoke(app, ["diff", *args, "-o", str(out)])
    assert r.exit_code == 0, r.stderr
    rows = pd.read_parquet(out)
    weights = rows[rows["path"] == "weight"]
    data = _json(*args)
    assert list(weights["layer"]) == [w["layer"] for w in data["weights"]]
    assert list(weights["sqnr_db"]) == pytest.approx([w["sqnr_db"] for w in data["weights"]])
    assert weights["call"].isna().all() and (weights["side"] == "B").all()
    assert len(rows) - len(weights) == sum(len(c["b"]) for c in data["calls"]) + 1  # + output


def test_isolate_on_text_says_why_there_are_no_token_statistics(tiny_llama: Path) -> None:
    data = _json(f"hf:{tiny_llama}", "--text", LINES[0], "--b", "bfloat16", "--isolate")
    assert data["tokens"] is None
    assert any(n.startswith("no token statistics under --isolate") for n in data["notes"])
    data = _json(f"hf:{tiny_llama}", "--text", LINES[0], "--b", "bfloat16", "--no-own")
    assert data["tokens"] is not None
    assert not any("under --isolate" in n for n in data["notes"])


def test_sides_whose_parts_would_undo_each_other_are_refused(tmp_path: Path) -> None:
    """A GGUF file replaces every weight (weights= would be lost), a folder's model replaces
    the loaded one (a dtype would be lost), two quantizations are one too many, and torchvision's
    int8 twin is not an LLM's: one line each, before anything loads."""
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    cases = {
        f"gguf:{gguf_file},weights=w.pt": "weights= would be lost",
        f"hf:{folder},float16": "float32|float64|float16|bfloat16 would be lost",
        "quantized,bnb:nf4": "int8 twin",
    }
    for spec, says in cases.items():
        r = runner.invoke(app, ["diff", "hf:x", "--text", "hi", "--b", spec])
        assert r.exit_code == 2, (spec, r.stderr)
        assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    side = parse_side("torchao:int8wo,bnb:nf4", "--b")  # one quantization: the later one
    assert [type(p).__name__ for p in side.parts] == ["Bnb"]
    assert parse_side(f"hf:{folder},autocast", "--b").autocast == torch.bfloat16


def test_weight_distances_from_sums_left_on_a_device_are_the_hosts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 52: on CUDA each weight's sums are the fused diff kernel's, left on the device and
    brought over together (quantsides._settled): the same SQNR as the host's float64 sums,
    and a weight with NaN on a side listed first with none. (Here the kernel's nine numbers
    come from ondevice.sums' torch ops, as a device would give them.)"""
    from hookcli.commands.diff import ondevice, quantsides

    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    b = copy.deepcopy(a)
    b[0].weight.data = a[0].weight.data.half().float()
    b[2].weight.data = a[2].weight.data.clone()
    b[2].weight.data[0, 1] = math.nan
    on_host, _ = weight_distances(a, b)
    monkeypatch.setattr(quantsides, "_sums", ondevice.sums)
    on_device, notes = weight_distances(a, b)
    assert [d.layer for d in on_device] == ["2", "0"] == [d.layer for d in on_host]
    assert on_device[0].sqnr_db is None and "NaN/Inf" in notes[0]
    assert on_device[1].sqnr_db == pytest.approx(on_host[1].sqnr_db, rel=1e-12)
    assert on_device[1].rel_l2 == pytest.approx(on_host[1].rel_l2, rel=1e-12)
