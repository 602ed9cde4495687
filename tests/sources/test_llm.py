"""Language models as first-class models (issue 34): the head a checkpoint was saved with,
text in through the checkpoint's tokenizer, next tokens out, the next-token loss, padding left
out of every statistic. Oracles: transformers' own `hidden_states`, `logits` and `loss`, on
tiny random models saved with save_pretrained beside a byte-level BPE tokenizer trained here
(nothing is downloaded)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import hookcli
from hookcli.errors import UsageError
from tests.support.cli import one_line_error, run
from tests.support.llm import LINES, VOCAB, llama_config, make_tokenizer, save
from tests.support.oracles import assert_stats_match, hooks_left
from tests.support.paths import CAT

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("tiny_llama"), "llama", chat=True)


def truth(folder: Path, texts: list[str], **kw: Any) -> tuple[Any, Any, Any]:
    """transformers' own run of the saved model: (model, encoding, output)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    enc = tok(texts, return_tensors="pt", padding=len(texts) > 1)
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True, **kw)
    return model, enc, out


# ---------------------------------------------------------------- the head it was saved with


def test_a_causal_lm_checkpoint_is_built_with_its_lm_head(llama: Path) -> None:
    result = run("inspect", f"hf:{llama}", "--text", LINES[0], "-l", "lm_head", "-f", "json")
    assert result.exit_code == 0, result.stderr
    assert "LOAD REPORT" not in result.stderr and "\x1b" not in result.stderr
    report = json.loads(result.stdout)
    assert report["model"]["task"] == "causal-lm"
    assert [c["name"] for c in report["layers"]] == ["lm_head"]
    _, _, out = truth(llama, [LINES[0]])
    assert report["layers"][0]["outputs"][0]["shape"] == list(out.logits.shape)
    assert_stats_match(
        _stats(report["layers"][0]["outputs"][0]), out.logits, rtol=1e-5, same_tensor=False
    )


def test_weights_that_do_not_fit_the_head_asked_for_are_an_error_naming_them(llama: Path) -> None:
    result = run("inspect", f"hf:{llama}", "--head", "seq-cls")
    line = one_line_error(result, 2, "score.weight", "lm_head.weight", "LlamaForCausalLM")
    assert "LOAD REPORT" not in result.stderr, line
    base = run("inspect", f"hf:{llama}", "--head", "base", "-l", "norm", "-f", "json")
    assert base.exit_code == 0, base.stderr
    report = json.loads(base.stdout)
    assert any("lm_head.weight left out" in n for n in report["notes"])
    one_line_error(run("inspect", f"hf:{llama}", "--head", "causal"), 2, "causal-lm")
    one_line_error(run("inspect", "resnet18", "--head", "base"), 2, "hf: models only")


def test_a_bare_decoder_type_is_a_causal_lm_and_an_encoder_decoder_a_seq2seq_lm() -> None:
    gpt = hookcli.inspect(
        "hf:gpt2",
        device="cpu",
        layers=["lm_head"],
        model_args={"n_embd": 16, "n_layer": 1, "n_head": 2, "vocab_size": 100},
    )
    assert gpt.model.task == "causal-lm" and gpt.layers[0].outputs[0].shape == (1, 16, 100)
    assert gpt.predictions is not None and len(gpt.predictions) == 5
    t5 = {"d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2, "vocab_size": 100}
    report = hookcli.inspect("hf:t5", device="cpu", model_args=t5, layers=["lm_head"])
    assert report.model.task == "seq2seq-lm"
    assert "decoder_input_ids the start token (0)" in report.input.description
    assert report.layers[0].outputs[0].shape == (1, 1, 100)  # the decoder's first position
    bert = hookcli.inspect(
        "hf:bert",
        device="cpu",
        depth=1,
        model_args={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                    "intermediate_size": 32, "vocab_size": 100},
    )  # fmt: skip
    assert bert.model.task == "text-classification"  # an encoder is not made a causal LM


# ---------------------------------------------------------------- text in, tokens out


def test_text_goes_through_the_checkpoints_tokenizer_and_the_tokens_are_reported(
    llama: Path,
) -> None:
    report = hookcli.inspect(f"hf:{llama}", text=LINES[0], device="cpu", layers=["lm_head"])
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    ids = tok(LINES[0])["input_ids"]
    assert report.input.texts is not None
    (seq,) = report.input.texts
    assert seq.text == LINES[0] and seq.ids == ids
    assert seq.tokens == [tok.decode([i]) for i in ids] and "".join(seq.tokens) == LINES[0]
    result = run("inspect", f"hf:{llama}", "--text", LINES[0], "-l", "lm_head")
    assert result.exit_code == 0, result.stderr
    assert f"tokens of sequence 0 ({len(ids)}): {ids[0]}:{seq.tokens[0]!r}" in result.stdout


def test_predictions_are_the_next_tokens_at_the_last_real_position(llama: Path) -> None:
    texts = [LINES[0], "hello world"]
    report = hookcli.inspect(f"hf:{llama}", text=texts, device="cpu", topk=3, layers=["lm_head"])
    _, enc, out = truth(llama, texts)
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    assert report.predictions is not None and len(report.predictions) == 6
    for seq in range(2):
        last = int(enc.attention_mask[seq].nonzero().max())
        probs = torch.softmax(out.logits[seq, last].double(), -1)
        want = probs.topk(3)
        got = [p for p in report.predictions if p.image == seq]
        assert [p.index for p in got] == want.indices.tolist()
        assert [p.prob for p in got] == pytest.approx(want.values.tolist(), rel=1e-5)
        for p in (
            got
        ):  # a cut character's byte is `<0x80>`, not '�' (tests/sources/test_token_labels.py)
            alone = tok.decode([p.index])
            assert p.label == alone if "\ufffd" not in alone else p.label.startswith("<0x")
    assert "next tokens" in str(report.prediction_note)


def test_a_left_padded_batch_reads_the_last_position(llama: Path, tmp_path: Path) -> None:
    folder = save(tmp_path / "left", "llama")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["padding_side"] = "left"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    texts = ["hello world", LINES[0]]
    report = hookcli.inspect(f"hf:{folder}", text=texts, device="cpu", topk=1, layers=["lm_head"])
    _, enc, out = truth(folder, texts)
    assert int(enc.attention_mask[0, 0]) == 0  # padded on the left indeed
    assert report.predictions is not None
    assert [p.index for p in report.predictions] == out.logits[:, -1].argmax(-1).tolist()
    assert "padded on the left" in report.input.description


@pytest.mark.parametrize("name", ["llama", "gpt2", "mixtral"])
def test_the_residual_stream_entering_every_block_is_transformers_hidden_states(
    name: str, tmp_path: Path
) -> None:
    folder = save(tmp_path / name, name)
    blocks = "model.layers.*" if name != "gpt2" else "transformer.h.*"
    from hookcli.sources import load_model

    loaded = load_model(f"hf:{folder}")
    before = hooks_left(loaded.module)  # transformers' own (its output recorders)
    report = hookcli.inspect(loaded, text=LINES[3], device="cpu", layers=[blocks])
    _, _, out = truth(folder, [LINES[3]])
    calls = [c for c in report.layers if c.name.count(".") == 2]
    assert len(calls) == 2
    for i, call in enumerate(calls):
        entering = out.hidden_states[i]
        stats = next(t for t in call.inputs if t.shape == tuple(entering.shape))
        assert_stats_match(stats, entering, rtol=1e-5, same_tensor=False)
    assert hooks_left(loaded.module) == before


def test_padding_never_enters_a_statistic(llama: Path) -> None:
    """Every statistic of a padded batch equals that of the sequences run one by one,
    unpadded, their tokens put together."""
    texts = [LINES[3], "hello", LINES[0]]
    layers = ["model.layers.0", "model.norm", "lm_head"]
    batch = hookcli.inspect(f"hf:{llama}", text=texts, device="cpu", layers=layers)
    alone = [
        hookcli.inspect(f"hf:{llama}", text=t, device="cpu", layers=layers, topk=0) for t in texts
    ]
    model, _, _ = truth(llama, [texts[0]])
    for layer in layers:
        got = next(c for c in batch.layers if c.name == layer).outputs[0]
        parts = [_layer_output(model, layer, text, llama) for text in texts]
        joined = torch.cat([p.reshape(-1, p.shape[-1]) for p in parts])
        assert_stats_match(got, joined, rtol=1e-5, same_tensor=False)
        assert got.shape[:2] == (3, max(len(s.ids) for s in batch.input.texts or []))
        assert "padding left out" in str(got.note)
        # and each sequence's own run agrees on its own tokens
        for one, part in zip(alone, parts, strict=True):
            own = next(c for c in one.layers if c.name == layer).outputs[0]
            assert_stats_match(own, part, rtol=1e-5, same_tensor=False)


def _layer_output(model: Any, layer: str, text: str, folder: Path) -> torch.Tensor:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    seen: list[torch.Tensor] = []
    module = model.get_submodule(layer)
    handle = module.register_forward_hook(
        lambda _m, _i, o: seen.append((o[0] if isinstance(o, tuple) else o).detach())
    )
    try:
        with torch.no_grad():
            model(**tok(text, return_tensors="pt"))
    finally:
        handle.remove()
    return seen[0]


def _stats(d: dict[str, Any]) -> Any:
    from hookcli.records import TensorStats

    keys = ("path", "shape", "dtype", "numel", "mean", "std", "min", "max", "zeros", "nan", "inf")
    return TensorStats(**{k: d[k] for k in keys}, norm=d["norm"])


# ---------------------------------------------------------------- the next-token loss


def test_grads_start_from_the_next_token_loss_of_the_text(llama: Path) -> None:
    texts = [LINES[0], "hello world"]
    report = hookcli.grads(f"hf:{llama}", text=texts, device="cpu", layers=["lm_head"])
    model, enc, _ = truth(llama, texts)
    labels = enc.input_ids.clone()
    labels[enc.attention_mask == 0] = -100
    loss = model(**enc, labels=labels).loss.detach()
    assert report.backward is not None
    assert report.backward.value == pytest.approx(float(loss), rel=1e-5)
    assert report.backward.perplexity == pytest.approx(float(torch.exp(loss)), rel=1e-5)
    assert "next-token cross-entropy" in report.backward.source
    result = run("grads", f"hf:{llama}", "--text", LINES[0], "-l", "lm_head")
    assert result.exit_code == 0, result.stderr
    assert "perplexity" in result.stdout


def test_the_next_token_loss_gradient_is_autograds(llama: Path) -> None:
    report = hookcli.grads(f"hf:{llama}", text=LINES[0], device="cpu", layers=["lm_head"])
    model, enc, _ = truth(llama, [LINES[0]])
    seen: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda _m, _i, o: seen.append(o))
    loss = model(**enc, labels=enc.input_ids).loss
    handle.remove()
    (want,) = torch.autograd.grad(loss, seen)
    grad = report.layers[0].grad_outputs
    assert grad is not None
    assert_stats_match(grad[0], want, rtol=1e-4, same_tensor=False)


def test_a_bare_tensor_of_ids_from_python_starts_from_the_same_next_token_loss(
    llama: Path,
) -> None:
    """`hookcli.grads(model, ids)`: the tensor of ids is the text's input_ids, as a tokenizer's
    output would be (it was refused: "--target next-token needs the text's input_ids")."""
    model, enc, _ = truth(llama, [LINES[0]])
    report = hookcli.grads(model, enc.input_ids, device="cpu", layers=["lm_head"])
    seen: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda _m, _i, o: seen.append(o))
    loss = model(enc.input_ids, labels=enc.input_ids).loss
    handle.remove()
    (want,) = torch.autograd.grad(loss, seen)
    assert report.backward is not None and "next-token cross-entropy" in report.backward.source
    assert report.backward.value == pytest.approx(float(loss), rel=1e-5)
    grad = report.layers[0].grad_outputs
    assert grad is not None
    assert_stats_match(grad[0], want, rtol=1e-4, same_tensor=False)
    with pytest.raises(hookcli.errors.UsageError, match="needs the text's input_ids"):
        hookcli.grads(model, enc.input_ids.float(), device="cpu", layers=["lm_head"])
    # two positional tensors (ids, a mask) stay positional: never labels that ignore the mask
    both = [enc.input_ids, enc.attention_mask]
    with pytest.raises(hookcli.errors.UsageError, match="needs the text's input_ids"):
        hookcli.grads(model, both, device="cpu", layers=["lm_head"])
    # a mask of another shape (a 4-D one) says nothing hookcli can read of where tokens end
    four = {"input_ids": enc.input_ids, "attention_mask": torch.ones(1, 1, 7, 7)}
    with pytest.raises(hookcli.errors.UsageError, match="not shaped as input_ids"):
        hookcli.inspect(model, four, device="cpu", layers=["lm_head"])


def test_a_bare_tensor_of_ids_is_read_as_a_tokenizers_output_would_be(llama: Path) -> None:
    """From Python, a tensor of ids given to a language model is its input_ids, as `--input`
    and a tokenizer's output give them: per-token rows, predictions and every statistic are
    the mapping's (--per-token refused it: "needs token ids")."""
    model, enc, _ = truth(llama, [LINES[0]])
    kw: dict[str, Any] = {"device": "cpu", "layers": ["model.norm", "lm_head"], "topk": 3}
    bare = hookcli.inspect(model, enc.input_ids, per_token=True, **kw)
    given = hookcli.inspect(model, {"input_ids": enc.input_ids}, per_token=True, **kw)
    assert "as input_ids" in bare.input.description
    assert [(p.index, p.prob) for p in bare.predictions or []] == [
        (p.index, p.prob) for p in given.predictions or []
    ]
    for a, b in zip(bare.layers, given.layers, strict=True):
        assert (a.name, a.outputs[0].mean, a.outputs[0].norm) == (
            b.name, b.outputs[0].mean, b.outputs[0].norm,
        )  # fmt: skip
        rows_a, rows_b = a.outputs[0].per_token or [], b.outputs[0].per_token or []
        assert len(rows_a) == enc.input_ids.shape[1]
        assert [(r.position, r.id, r.norm) for r in rows_a] == [
            (r.position, r.id, r.norm) for r in rows_b
        ]


def test_a_token_is_a_target_by_its_text(llama: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    cat = tok(" cat", add_special_tokens=False)["input_ids"]
    assert len(cat) == 1
    report = hookcli.grads(
        f"hf:{llama}", text="The dog", device="cpu", target=" cat", layers=["lm_head"]
    )
    assert report.backward is not None and f"class {cat[0]}" in report.backward.source


# ---------------------------------------------------------------- chat, files, bad inputs


def test_chat_renders_each_text_through_the_template(llama: Path) -> None:
    report = hookcli.inspect(f"hf:{llama}", text="hi", chat=True, device="cpu", topk=0, depth=1)
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    want = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert report.input.texts is not None
    assert report.input.texts[0].ids == tok(want, add_special_tokens=False)["input_ids"]
    assert "chat template" in str(report.input.preprocessing)


def test_a_text_file_gives_one_sequence_per_line(llama: Path, tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text(f"{LINES[0]}\n\n{LINES[1]}\n", encoding="utf-8")
    report = hookcli.inspect(f"hf:{llama}", text_file=str(path), device="cpu", topk=1, depth=1)
    assert [t.text for t in report.input.texts or []] == LINES[:2]


def test_bad_text_inputs_get_one_line_each(llama: Path, tmp_path: Path) -> None:
    one_line_error(run("inspect", "resnet18", "--text", "hi"), 2, "not text")
    one_line_error(run("inspect", f"hf:{llama}", "--text", "hi", str(CAT)), 2, "not both")
    one_line_error(
        run("inspect", "hf:llama", "--text", "hi", "--model-arg", "num_hidden_layers=1"),
        2,
        "no tokenizer",
        "--tokenizer",
    )
    bare = tmp_path / "no_tokenizer"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config()).save_pretrained(bare)
    one_line_error(run("inspect", f"hf:{bare}", "--text", "hi"), 2, "no tokenizer in", str(bare))
    # the same folder with --tokenizer pointing at one
    ok = run("inspect", f"hf:{bare}", "--text", "hi", "--tokenizer", str(llama), "--depth", "1")
    assert ok.exit_code == 0, ok.stderr
    one_line_error(run("inspect", f"hf:{llama}", "--text", "x " * 200), 2, "longer than", "64")
    one_line_error(run("inspect", f"hf:{llama}", "--text", "  "), 2, "empty")
    one_line_error(run("inspect", f"hf:{llama}", "--text-file", str(tmp_path / "nope")), 2)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    one_line_error(run("inspect", f"hf:{llama}", "--text-file", str(empty)), 2, "no text")
    plain = save(tmp_path / "plain", "llama", chat=False)
    one_line_error(run("inspect", f"hf:{plain}", "--text", "hi", "--chat"), 2, "chat template")
    small = tmp_path / "small_vocab"
    torch.manual_seed(0)
    config = llama_config()
    config.vocab_size = 100
    transformers.LlamaForCausalLM(config).save_pretrained(small)
    one_line_error(
        run("inspect", f"hf:{small}", "--text", LINES[0], "--tokenizer", str(llama)),
        2,
        "not this model's tokenizer",
    )


class _SinOutside(torch.nn.Module):
    """A layer that rounds alike in float32 and bfloat16 (the identity on a bfloat16-exact
    input), and outside any module a sine of its output scaled past bfloat16's precision."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.fc(x) * 1000.0)


def test_a_diff_whose_model_output_alone_is_past_tolerance_says_so() -> None:
    x = torch.tensor([[1.0, 1.5, 2.0, 0.25]])
    report = hookcli.diff(_SinOutside(), [x], b="bfloat16", device="cpu", layers=["fc"])
    assert not any(d.over for c in report.calls for d in c.b)  # the hooked layer agrees
    assert any(d.over for d in report.outputs[0].b)  # the model's output does not
    assert report.first_over is not None and "(model)" in report.first_over


def test_a_causal_lm_from_a_factory_file_is_a_language_model(llama: Path, tmp_path: Path) -> None:
    factory = tmp_path / "make.py"
    factory.write_text(
        "import transformers\n\n\n"
        "def make():\n"
        f"    return transformers.AutoModelForCausalLM.from_pretrained({str(llama)!r})\n"
    )
    report = hookcli.inspect(f"{factory}:make", text=LINES[0], device="cpu", topk=3, depth=1)
    assert report.model.task == "causal-lm"
    _, _, out = truth(llama, [LINES[0]])
    assert report.predictions is not None
    assert [p.index for p in report.predictions] == out.logits[0, -1].topk(3).indices.tolist()


class _Ids(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 3).long()


def test_topk_asked_of_an_output_it_cannot_read_says_why() -> None:
    report = hookcli.inspect(_Ids(), [torch.ones(1, 8)], device="cpu", topk=3)
    assert report.predictions is None
    assert "--topk 3: no predictions" in str(report.prediction_note)
    assert "1x8" in str(report.prediction_note)


def test_per_token_statistics_are_each_positions_own(llama: Path) -> None:
    texts = [LINES[0], "hello world"]
    report = hookcli.inspect(
        f"hf:{llama}", text=texts, device="cpu", layers=["model.layers.0"], per_token=True
    )
    _, enc, out = truth(llama, texts)
    (call,) = report.layers
    rows = call.outputs[0].per_token
    assert rows is not None
    mask = enc.attention_mask.bool()
    assert len(rows) == int(mask.sum())  # padding positions are not rows
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    block = out.hidden_states[1].double()
    for r in rows:
        x = block[r.sequence, r.position]
        assert r.id == int(enc.input_ids[r.sequence, r.position])
        assert r.token == tok.decode([r.id])
        assert r.norm == pytest.approx(float(x.norm()), rel=1e-5)
        assert r.mean == pytest.approx(float(x.mean()), rel=1e-4, abs=1e-6)
        assert r.std == pytest.approx(float(x.std(correction=0)), rel=1e-5)
        assert r.max_abs == pytest.approx(float(x.abs().max()), rel=1e-5)
        assert r.channel == int(x.abs().argmax())
    result = run("inspect", f"hf:{llama}", "--text", "hello", "-l", "model.layers.0", "--per-token")
    assert result.exit_code == 0, result.stderr
    assert "per token" in result.stdout and "'hello'" in result.stdout
    as_json = run(
        "inspect", f"hf:{llama}", "--text", "hello", "-l", "model.layers.0", "--per-token",
        "-f", "json",
    )  # fmt: skip
    row = json.loads(as_json.stdout)["layers"][0]["outputs"][0]["per_token"][0]
    assert set(row) == {"sequence", "position", "norm", "mean", "std", "max_abs", "channel",
                        "id", "token"}  # fmt: skip
    one_line_error(run("inspect", "resnet18", "--per-token"), 2, "--per-token needs token ids")


# ---------------------------------------------------------------- the logit lens


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_logit_lens_is_each_blocks_output_through_the_final_norm_and_unembedding(
    name: str, tmp_path: Path
) -> None:
    folder = save(tmp_path / name, name)
    texts = [LINES[0], "hello"]
    report = hookcli.lens(f"hf:{folder}", text=texts, device="cpu", topk=3)
    model, enc, out = truth(folder, texts)
    base = model.model if name == "llama" else model.transformer
    blocks = base.layers if name == "llama" else base.h
    final = base.norm if name == "llama" else base.ln_f
    seen: list[torch.Tensor] = []
    handles = [
        b.register_forward_hook(lambda _m, _i, o: seen.append(o[0] if isinstance(o, tuple) else o))
        for b in blocks
    ]
    with torch.no_grad():
        model(**enc)
        for h in handles:
            h.remove()
        by_hand = [torch.softmax(model.lm_head(final(h)).double(), -1).topk(3) for h in seen]
    prefix = "model.layers" if name == "llama" else "transformer.h"
    assert report.blocks == [f"{prefix}.{i}" for i in range(2)]
    assert report.norm == ("model.norm" if name == "llama" else "transformer.ln_f")
    assert report.unembed == "lm_head"
    mask = enc.attention_mask.bool()
    assert len(report.lens) == 2 * int(mask.sum())  # no padding position is read
    for cell in report.lens:
        want = by_hand[int(cell.layer.rsplit(".", 1)[1])]
        assert [t.index for t in cell.top] == want.indices[cell.sequence, cell.position].tolist()
        assert [t.prob for t in cell.top] == pytest.approx(
            want.values[cell.sequence, cell.position].tolist(), rel=1e-6
        )
    assert report.last_vs_logits == 0.0  # the last block's lens is the model's own logits
    del out


def test_lens_writes_json_csv_and_a_png_grid(llama: Path, tmp_path: Path) -> None:
    from PIL import Image

    as_json = run("lens", f"hf:{llama}", "--text", LINES[0], "-f", "json")
    assert as_json.exit_code == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    cell = data["lens"][0]
    assert set(cell) == {"layer", "sequence", "position", "top"}
    assert set(cell["top"][0]) == {"index", "token", "prob"} and len(cell["top"]) == 5
    png = tmp_path / "lens.png"
    drawn = run("lens", f"hf:{llama}", "--text", LINES[0], "-o", str(png))
    assert drawn.exit_code == 0, drawn.stderr
    with Image.open(png) as image:
        meta = json.loads(image.text["hookcli"])
        assert len(meta["cells"]) == len(data["lens"])
    table = run("lens", f"hf:{llama}", "--text", LINES[0])
    assert "layers.1" in table.stdout and "' cat'" in table.stdout
    csv_out = run("lens", f"hf:{llama}", "--text", LINES[0], "-f", "csv")
    assert csv_out.stdout.splitlines()[0] == "layer,sequence,position,rank,index,token,prob"
    one_line_error(run("lens", "resnet18"), 2, "not a language model")
    one_line_error(run("lens", f"hf:{llama}", "--text", "hi", "--unembed", "nope"), 2, "--unembed")


# ---------------------------------------------------------------- generation


def test_generate_hooks_every_step_and_makes_transformers_tokens(llama: Path) -> None:
    texts = [LINES[0], "hello"]
    report = hookcli.inspect(
        f"hf:{llama}", text=texts, device="cpu", generate=4, layers=["lm_head", "model.norm"]
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=4, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
    new = out.sequences[:, enc.input_ids.shape[1] :]
    assert report.generated is not None
    assert [g.ids for g in report.generated] == new.tolist()
    for g, ids in zip(report.generated, new.tolist(), strict=True):
        decoded = tok.decode(ids)  # where decode prints '�', the bytes (<0xA7>)
        kept = re.sub(r"<id \d+>", "", str(g.text))  # ids past the tokenizer: decode drops them
        parts = re.split(r"<0x([0-9A-F]{2})>", kept)
        raw = b"".join(bytes([int(x, 16)]) if k % 2 else x.encode() for k, x in enumerate(parts))
        assert "\ufffd" not in str(g.text) and raw.decode("utf-8", "replace") == decoded
    heads = [c for c in report.layers if c.name == "lm_head"]
    assert [c.call for c in heads] == [0, 1, 2, 3]  # one call per forward of generate
    for call, logits in zip(heads, out.logits, strict=True):
        assert call.outputs[0].shape[1] == 1  # each step's last position (the KV cache)
        assert_stats_match(call.outputs[0], logits, rtol=1e-5, same_tensor=False)
    norms = [c for c in report.layers if c.name == "model.norm"]
    assert norms[0].outputs[0].shape[1] == enc.input_ids.shape[1]  # call 0: the prompt
    assert all(c.outputs[0].shape[1] == 1 for c in norms[1:])
    assert any("call 0 is the prompt" in n for n in report.notes)


def test_generate_on_an_encoder_decoder_pads_on_the_right(tmp_path: Path) -> None:
    """--generate over a batch for BART (learned positions): the encoder's batch is padded on
    the right, so each text generates what it generates alone in transformers (left padding
    moved the short text's positions: other tokens); --padding-side left is still honoured."""
    save(tmp_path, "bart")
    texts = [LINES[0], "hello"]
    report = hookcli.inspect(f"hf:{tmp_path}", text=texts, generate=4, layers=["lm_head"])
    assert "padded on the right" in report.input.description
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    alone = []
    for text in texts:
        with torch.no_grad():
            out = model.generate(**tok(text, return_tensors="pt"), max_new_tokens=4,
                                 do_sample=False, pad_token_id=tok.pad_token_id)  # fmt: skip
        alone.append(out[0, 1:].tolist())  # (after the decoder's start token)
    assert report.generated is not None
    assert [g.ids for g in report.generated] == alone
    left = hookcli.inspect(
        f"hf:{tmp_path}", text=texts, generate=4, layers=["lm_head"], padding_side="left"
    )
    assert "padded on the left" in left.input.description


def test_topk_asked_with_generate_is_answered_not_dropped(llama: Path) -> None:
    """--topk given with --generate: no top-k table (the generated tokens are the output),
    and the report says so; not asked, nothing is said."""
    asked = hookcli.inspect(f"hf:{llama}", text="the cat", generate=2, topk=3, layers=["lm_head"])
    assert asked.predictions is None and "--topk: with --generate" in str(asked.prediction_note)
    plain = hookcli.inspect(f"hf:{llama}", text="the cat", generate=2, layers=["lm_head"])
    assert plain.prediction_note is None


def test_per_token_on_an_encoder_decoder_says_the_decoder_has_no_rows(tmp_path: Path) -> None:
    """--per-token with a target text (teacher forcing): the encoder's layers get rows by
    its tokens, and the report says the decoder's tensors have none (they had none, in
    silence)."""
    save(tmp_path, "bart")
    report = hookcli.inspect(
        f"hf:{tmp_path}", text="The cat sat on the mat.", target_text="A dog ran far away.",
        per_token=True, layers=["model.encoder.layers.0", "model.decoder.layers.0"], topk=0,
    )  # fmt: skip
    calls = {c.name: c for c in report.layers}
    assert calls["model.encoder.layers.0"].outputs[0].per_token
    assert not calls["model.decoder.layers.0"].outputs[0].per_token
    assert any("the decoder's calls (its" in n for n in report.notes)


def test_per_token_gives_a_decoder_as_long_as_the_text_no_rows_of_its_tokens(
    tmp_path: Path,
) -> None:
    """--per-token with a target as many tokens long as the text: the decoder's (batch,
    tokens, C) tensors have the encoder's shape, and were given rows labelled with the
    encoder's tokens. Rows come only from the encoder's calls; the encoder's rows are still
    its tokens' (against its own output_hidden_states)."""
    save(tmp_path, "bart")
    text = "The cat sat on the mat."
    report = hookcli.inspect(
        f"hf:{tmp_path}", text=text, target_text=text, per_token=True, topk=0,
        layers=["model.*.layers.0", "model.*.embed_tokens"],
    )  # fmt: skip
    calls = {c.name: c for c in report.layers}
    assert not calls["model.decoder.layers.0"].outputs[0].per_token
    assert not calls["model.decoder.embed_tokens"].outputs[0].per_token
    assert calls["model.encoder.embed_tokens"].outputs[0].per_token
    rows = calls["model.encoder.layers.0"].outputs[0].per_token
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        hidden = model.get_encoder()(**enc, output_hidden_states=True).hidden_states[1][0]
    assert rows is not None and [r.id for r in rows] == enc.input_ids[0].tolist()
    for r in rows:
        assert r.mean == pytest.approx(float(hidden[r.position].double().mean()), abs=1e-5)


class _EncDec(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.enc = torch.nn.Linear(8, 8)
        self.dec = torch.nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        memory = self.enc(self.embed(input_ids)).mean(1, keepdim=True)
        return self.dec(self.embed(decoder_input_ids) + memory)


class _KnownEncDec(_EncDec):
    def get_encoder(self) -> torch.nn.Module:
        return self.enc

    def get_decoder(self) -> torch.nn.Module:
        return self.dec


def test_per_token_refuses_a_decoder_as_long_as_the_text_where_no_encoder_is_known() -> None:
    """A model with decoder_input_ids as many as the tokens and no get_encoder/get_decoder:
    whose tensors are the tokens' is not known, so --per-token is refused (it guessed by
    shape); with them, the encoder's calls get rows and the decoder's none."""
    ids = {"input_ids": torch.tensor([[3, 4, 5]]), "decoder_input_ids": torch.tensor([[6, 7, 8]])}
    with pytest.raises(UsageError, match="decoder positions are as many as the tokens"):
        hookcli.inspect(_EncDec(), ids, per_token=True, topk=0)
    other = {**ids, "decoder_input_ids": torch.tensor([[6, 7]])}
    assert hookcli.inspect(_EncDec(), other, per_token=True, topk=0).layers
    report = hookcli.inspect(_KnownEncDec(), ids, per_token=True, topk=0)
    calls = {(c.name, c.call): c for c in report.layers}
    assert calls[("enc", 0)].outputs[0].per_token
    assert not calls[("embed", 0)].outputs[0].per_token  # (before the encoder starts)
    assert not calls[("dec", 0)].outputs[0].per_token


def test_ablating_a_text_models_layer_by_its_mean_keeps_channels_last(llama: Path) -> None:
    """--ablate LAYER=mean on a text model's (batch, tokens, C) output: each channel's mean
    over batch and tokens (channels last, as --channels reads them); it was refused with a
    hint to give an image. The ablated logits against a forward hooked by hand."""
    report = hookcli.inspect(
        f"hf:{llama}", text="The cat sat on the mat", ablate=["model.norm=mean"],
        layers=["lm_head"], topk=0,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    model.model.norm.register_forward_hook(
        lambda _m, _a, out: out.mean(dim=(0, 1), keepdim=True).expand_as(out).clone()
    )
    with torch.no_grad():
        want = model(**tok("The cat sat on the mat", return_tensors="pt")).logits
    assert report.ablation is not None
    assert_stats_match(report.ablation.outputs_after[0], want, rtol=1e-5, same_tensor=False)


def test_ablating_a_padded_batch_by_its_mean_leaves_the_padding_out(llama: Path) -> None:
    """--ablate LAYER=mean on a padded batch of texts: each channel's mean over the real
    positions alone (the padding's hidden states, what the model makes of a pad token, were
    averaged in). The ablated logits at the real positions against a forward hooked by hand."""
    texts = [LINES[0], "hello"]
    report = hookcli.inspect(
        f"hf:{llama}", text=texts, ablate=["model.norm=mean"], layers=["lm_head"], topk=0,
        padding_side="right",
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    tok.padding_side = "right"
    enc = tok(texts, return_tensors="pt", padding=True)
    real = enc.attention_mask.bool()
    assert not bool(real.all())  # (a padded batch)

    def mean_of_real(_m: Any, _a: Any, out: torch.Tensor) -> torch.Tensor:
        return out[real].mean(dim=0).expand_as(out).clone()

    model.model.norm.register_forward_hook(mean_of_real)
    with torch.no_grad():
        want = model(**enc).logits
    assert report.ablation is not None
    assert_stats_match(report.ablation.outputs_after[0], want[real], rtol=1e-5, same_tensor=False)


def test_generate_says_a_sequence_fed_padding_after_its_end(llama: Path, tmp_path: Path) -> None:
    """A sequence whose end token comes before the last step is fed padding by generate while
    the others run: the later calls' statistics count those rows, and the note says so (the
    header said no statistic counts padding). The end token is made the one the first text
    generates first, so that it ends at once (the oracle: transformers' generate)."""
    texts = [LINES[0], "hello"]
    model = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        first = model.generate(**enc, max_new_tokens=1, do_sample=False, pad_token_id=0)
    end = int(first[0, -1])
    assert end != int(first[1, -1])  # (the other text goes on)
    model.generation_config.eos_token_id = end
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    report = hookcli.inspect(f"hf:{tmp_path}", text=texts, device="cpu", generate=3, topk=0)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=3, do_sample=False, pad_token_id=0)
    new = out[:, enc.input_ids.shape[1] :].tolist()
    assert report.generated is not None and [g.ids for g in report.generated] == new
    assert new[0][0] == end and len(new[0]) == 3  # ended at once, then fed padding
    (note,) = [n for n in report.notes if "--generate" in n]
    assert "1 sequence ended before the last step (sequence 0 at new token 0)" in note


def test_generate_from_a_tensor_prompt_reports_the_new_tokens_alone(llama: Path) -> None:
    """The Python API's prompt as a bare tensor of ids (generate's positional `inputs`): the
    new tokens are generate's sequences after the prompt, as from text or keyword tensors,
    and the prompt counts against the model's positions (the prompt was taken as 0 tokens:
    the whole sequence was reported as new, "made 10 new tokens in 10 forwards")."""
    model = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    ids = tok(LINES[0], return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    new = out[:, ids.shape[1] :].tolist()
    report = hookcli.inspect(model, ids, device="cpu", generate=3, layers=["lm_head"])
    assert [g.ids for g in report.generated or []] == new
    assert [c.call for c in report.layers] == [0, 1, 2]
    assert any("made 3 new tokens in 3 forwards" in n for n in report.notes)
    long = torch.randint(3, VOCAB, (1, 62), generator=torch.Generator().manual_seed(0))
    with pytest.raises(hookcli.errors.UsageError, match="needs 65 positions"):
        hookcli.inspect(model, long, device="cpu", generate=3, layers=["lm_head"])
    # a seq2seq model's decoder begins from its start token, which is not a new one
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    t5 = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        out = t5.generate(ids, max_new_tokens=3, do_sample=False)
    report = hookcli.inspect(t5, ids, device="cpu", generate=3, layers=["lm_head"])
    assert [g.ids for g in report.generated or []] == out[:, 1:].tolist()
    assert any("made 3 new tokens in 3 forwards" in n for n in report.notes)
    # a decoder prompt without the start token: generate puts one before it
    for decoder in ([[5, 9]], [[0, 9]]):
        given = {"input_ids": ids, "decoder_input_ids": torch.tensor(decoder)}
        with torch.no_grad():
            out = t5.generate(**given, max_new_tokens=3, do_sample=False)
        assert out.shape[1] == 6 - (decoder[0][0] == 0)
        report = hookcli.inspect(t5, given, device="cpu", generate=3, layers=["lm_head"])
        assert [g.ids for g in report.generated or []] == out[:, -3:].tolist()
        assert any("made 3 new tokens in 3 forwards" in n for n in report.notes)


def test_check_holds_its_rules_over_every_generation_step(llama: Path) -> None:
    result = run(
        "check", f"hf:{llama}", "--text", LINES[0], "--generate", "3", "-l", "lm_head",
        "--fail-on", "nonfinite", "--max-abs", "1e-6", "-f", "json",
    )  # fmt: skip
    assert result.exit_code == 1, result.stderr
    report = json.loads(result.stdout)
    failed = next(c for c in report["checks"] if c["rule"] == "max-abs")
    assert sorted({f["call"] for f in failed["failures"]}) == [0, 1, 2]
    assert len(report["generated"][0]["ids"]) == 3


def test_generate_is_refused_where_it_cannot_run(llama: Path) -> None:
    one_line_error(run("inspect", "resnet18", "--generate", "2"), 2, "cannot generate")
    one_line_error(run("inspect", f"hf:{llama}", "--text", "hi", "--sample"), 2, "--generate")
    with pytest.raises(hookcli.errors.UsageError, match="no backward"):
        hookcli.grads(f"hf:{llama}", text="hi", device="cpu", generate=2)
    sampled = [
        hookcli.inspect(f"hf:{llama}", text="hi", generate=5, sample=True, seed=s, depth=1)
        for s in (1, 1, 2)
    ]
    ids = [r.generated[0].ids for r in sampled if r.generated]
    assert ids[0] == ids[1]  # sampling is seeded by --seed


# ---------------------------------------------------------------- attn on text


def test_attn_on_text_labels_its_axes_with_the_tokens(llama: Path, tmp_path: Path) -> None:
    text = "The cat sat on the mat. A dog ran in the park."
    drawing = hookcli.attn(f"hf:{llama}", text=text, device="cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(llama, attn_implementation="eager")
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        want = model(**enc, output_attentions=True).attentions[-1]
    assert drawing.raw is not None
    assert torch.allclose(torch.from_numpy(drawing.raw), want.float(), atol=1e-6)
    words = [tok.decode([i]) for i in enc.input_ids[0].tolist()]
    assert drawing.picture.row_tokens == words and drawing.picture.col_tokens == words
    assert "sequence 0" in drawing.picture.title
    last = hookcli.attn(f"hf:{llama}", text=text, device="cpu", queries="-4:")
    assert last.picture.tiles is not None and last.picture.tiles.shape[1] == 4  # 4 query rows
    assert last.picture.row_tokens == words[-4:]
    png = tmp_path / "attn.png"
    result = run("attn", f"hf:{llama}", "--text", text, "--queries", "-4:", "-o", str(png))
    assert result.exit_code == 0, result.stderr
    one_line_error(
        run("attn", f"hf:{llama}", "--text", text, "--queries", "x", "-o", str(png)),
        2,
        "START:END",
    )


def test_diff_gives_each_position_of_the_logits_its_error(llama: Path) -> None:
    import copy

    report = hookcli.diff(f"hf:{llama}", b="bfloat16", text=LINES[0], device="cpu", depth=1)
    (logits,) = [d for d in report.outputs[0].b if d.path == 'out["logits"]']
    model, enc, out = truth(llama, [LINES[0]])
    low = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        b = low(**enc).logits.double()
    a = out.logits.double()
    want = ((b - a).norm(dim=-1) / a.norm(dim=-1)).tolist()
    assert logits.per_position is not None
    assert logits.per_position == [pytest.approx(row, rel=1e-6) for row in want]
    result = run("diff", f"hf:{llama}", "--text", LINES[0], "--b", "bfloat16", "--depth", "1")
    assert 'worst positions of ["logits"]' in result.stdout, result.stdout


def test_position_picks_the_real_token_predicted_after(llama: Path) -> None:
    texts = [LINES[0], "hello world"]
    report = hookcli.inspect(
        f"hf:{llama}", text=texts, device="cpu", topk=2, position=1, layers=["lm_head"]
    )
    _, _, out = truth(llama, texts)
    assert report.predictions is not None
    want = out.logits[:, 1].double().softmax(-1).topk(2).indices.tolist()
    assert [[p.index for p in report.predictions if p.image == s] for s in (0, 1)] == want
    assert "after real token 1" in str(report.prediction_note)
    first = hookcli.inspect(f"hf:{llama}", text=texts, device="cpu", topk=1, position=-1)
    last = hookcli.inspect(f"hf:{llama}", text=texts, device="cpu", topk=1)
    assert first.predictions == last.predictions
    short = len(transformers.AutoTokenizer.from_pretrained(llama)("hello world")["input_ids"])
    one_line_error(
        run("inspect", f"hf:{llama}", "--text", LINES[0], "--text", "hello world", "--position",
            str(short)),
        2,
        "--position",
    )  # fmt: skip
    one_line_error(run("inspect", "resnet18", "--position", "0"), 2, "--position")


def test_a_causal_lm_in_the_hub_cache_comes_with_its_tokenizer(
    llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hf:ORG/NAME from a hub cache laid out as huggingface_hub writes it (offline)."""
    import shutil

    base = tmp_path / "hub" / "models--org--tiny-llama"
    snap = base / "snapshots" / ("b" * 40)
    shutil.copytree(llama, snap)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text("b" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    report = hookcli.inspect("hf:org/tiny-llama", text=LINES[0], device="cpu", topk=1, depth=1)
    assert report.model.task == "causal-lm"
    assert "from the local cache" in str(report.input.preprocessing)
    _, _, out = truth(llama, [LINES[0]])
    assert report.predictions is not None
    assert report.predictions[0].index == int(out.logits[0, -1].argmax())


# ---------------------------------------------------------------- review round: edge cases


def test_a_target_text_must_be_one_token_and_ids_past_the_tokenizer_are_labelled(
    llama: Path,
) -> None:
    from hookcli.sources import load_model
    from hookcli.sources.lm import TokenLabels

    tok = transformers.AutoTokenizer.from_pretrained(llama)
    labels = TokenLabels(tok, len(tok) + 3)  # a model vocabulary larger than its tokenizer's
    assert labels[len(tok) + 1] == f"<id {len(tok) + 1}>"
    assert labels.find_token("zzzq") is None
    one_line_error(
        run("grads", f"hf:{llama}", "--text", "The cat", "--target", "zzzq"),
        2,
        "not one token",
    )
    assert load_model(f"hf:{llama}").kind.name == "causal-lm"


def test_the_next_token_loss_of_a_left_padded_batch_is_each_sequences_own(
    llama: Path, tmp_path: Path
) -> None:
    folder = save(tmp_path / "left", "llama")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["padding_side"] = "left"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    texts = [LINES[0], "hello world"]
    report = hookcli.grads(f"hf:{folder}", text=texts, device="cpu", layers=["lm_head"])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:  # each alone, unpadded: HF's mean over its predicted tokens
            enc = tok(text, return_tensors="pt")
            n = enc.input_ids.shape[1] - 1
            total += float(model(**enc, labels=enc.input_ids).loss) * n
            count += n
    assert report.backward is not None
    assert report.backward.value == pytest.approx(total / count, rel=1e-5)
    assert f"{count} tokens predicted" in report.backward.source


def test_attention_probabilities_leave_padding_queries_out_even_when_heads_equal_tokens(
    llama: Path,
) -> None:
    texts = ["The cat sat on", "hi"]  # 4 tokens, 4 heads: (B, heads, T, T) with heads == T
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    enc = tok(texts, return_tensors="pt", padding=True)
    assert enc.input_ids.shape[1] == 4
    report = hookcli.inspect(
        f"hf:{llama}", text=texts, device="cpu", layers=["model.layers.0.self_attn"],
        model_args={"attn_implementation": "eager"},
    )  # fmt: skip
    probs = next(t for t in report.layers[0].outputs if len(t.shape) == 4)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama, attn_implementation="eager")
    with torch.no_grad():
        want = model(**enc, output_attentions=True).attentions[0]
    rows = want.transpose(1, 2)[enc.attention_mask.bool()]  # (real queries, heads, keys)
    assert probs.numel == rows.numel() == int(enc.attention_mask.sum()) * 4 * 4
    assert_stats_match(probs, rows, rtol=1e-5, same_tensor=False)


def test_a_models_tokenizer_is_left_as_it_was(llama: Path) -> None:
    from hookcli.sources import load_model

    loaded = load_model(f"hf:{llama}")
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    tok.pad_token = None
    loaded.tokenizer, loaded.tokenizer_label = tok, "test"
    side = tok.padding_side
    hookcli.inspect(loaded, text=[LINES[0], "hi"], device="cpu", generate=2, depth=1)
    assert tok.padding_side == side and tok.pad_token is None
    again = hookcli.inspect(loaded, text=[LINES[0], "hi"], device="cpu", depth=1)
    assert f"padded on the {side}" in again.input.description


def test_lens_blocks_glob_keeps_the_outermost_and_generate_is_bounded(llama: Path) -> None:
    report = hookcli.lens(f"hf:{llama}", text="The cat", device="cpu", blocks="model.layers.*")
    assert report.blocks == ["model.layers.0", "model.layers.1"]
    one_line_error(
        run("inspect", f"hf:{llama}", "--text", LINES[0], "--generate", "100"),
        2,
        "positions",
    )


def test_the_lens_of_a_seq2seq_lm_reads_the_decoder_through_the_norm_that_runs_last() -> None:
    torch.manual_seed(0)
    config = transformers.MBartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.MBartForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms that are not the identity: the wrong one would show
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
    report = hookcli.lens(model, input_specs=[f"input_ids=randint:3:{VOCAB}:1x6"], device="cpu")
    assert report.norm == "model.decoder.layer_norm"  # not layernorm_embedding (runs first)
    assert report.blocks == ["model.decoder.layers.0", "model.decoder.layers.1"]
    assert {c.position for c in report.lens} == {0}  # the decoder's one start position


def test_a_seq2seq_lm_predicts_the_decoders_first_token_as_transformers_does(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    make_tokenizer().save_pretrained(tmp_path / "t5")
    report = hookcli.inspect(f"hf:{tmp_path / 't5'}", text=LINES[0], device="cpu", topk=3)
    assert report.model.task == "seq2seq-lm"
    model = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "t5").eval()
    enc = transformers.AutoTokenizer.from_pretrained(tmp_path / "t5")(LINES[0], return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc, decoder_input_ids=torch.tensor([[0]])).logits
    want = logits[0, -1].double().softmax(-1).topk(3)
    assert report.predictions is not None
    assert [p.index for p in report.predictions] == want.indices.tolist()
    assert [p.prob for p in report.predictions] == pytest.approx(want.values.tolist(), rel=1e-6)
    generated = hookcli.inspect(f"hf:{tmp_path / 't5'}", text=LINES[0], generate=3, depth=1)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert generated.generated is not None
    assert generated.generated[0].ids == out[0, 1:].tolist()  # after the start token


def test_second_review_round_targets_globs_and_position(llama: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    (cat,) = tok(" cat", add_special_tokens=False)["input_ids"]
    report = hookcli.grads(f"hf:{llama}", text="The", device="cpu", target=" cat", depth=1)
    assert report.backward is not None and f"class {cat} (' cat')" in report.backward.source
    for odd in ("²", "--5", "٣"):  # never an index, never an internal error
        one_line_error(run("grads", f"hf:{llama}", "--text", "The cat", f"--target={odd}"), 2)
    inner = hookcli.lens(
        f"hf:{llama}", text="The cat", device="cpu", blocks="model.layers.*.self_attn"
    )
    assert inner.norm == "model.norm"  # not the last layer's post_attention_layernorm
    # outputs the unembedding cannot read are left out (model.rotary_emb's), and a glob that
    # leaves none (the outermost of * is the whole base model) is one line, not a crash
    result = run("lens", f"hf:{llama}", "--text", "The cat", "--blocks", "model.*", "-f", "json")
    assert result.exit_code == 0, result.stderr
    assert "model.rotary_emb" not in json.loads(result.stdout)["blocks"]
    one_line_error(run("lens", f"hf:{llama}", "--text", "hi", "--blocks", "*"), 2, "unembedding")
    one_line_error(
        run("inspect", f"hf:{llama}", "--text", "hi", "--generate", "2", "--position", "0"),
        2,
        "--position",
    )


def test_a_bare_tensor_not_of_token_ids_is_refused_in_one_line_naming_it(llama: Path) -> None:
    """A tensor read as a language model's input_ids that is not (batch, tokens) of integers
    is a usage error naming what was given, before the model runs (it failed inside the model
    with the mask made for it counted: "the model was given 6, 6")."""
    model, _, _ = truth(llama, [LINES[0]])
    cases = {
        torch.randint(0, 50, (6,)): ("(batch, tokens)", "given a tensor 6 (1-D)", "unsqueeze(0)"),
        torch.ones(1, 6, dtype=torch.bool): ("integers", "tensor 1x6 of bool", "input_ids"),
        torch.randint(0, 50, (1, 2, 3)): ("(batch, tokens)", "tensor 1x2x3 (3-D)", "(batch,"),
    }
    for given, (says, shows, hint) in cases.items():
        with pytest.raises(UsageError) as err:
            hookcli.inspect(model, given, device="cpu", topk=0)
        assert says in err.value.message and shows in err.value.message, err.value.message
        assert hint in err.value.hint and "\n" not in str(err.value)
