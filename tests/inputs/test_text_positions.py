"""A causal LM's text batch padded on the left: each text's positions counted from its own
first token, as model.generate counts them. GPT-2's positions are learned and absolute, so a
short text run at the positions its padding pushed it to gives other numbers (predictions,
heads, the loss) than the text alone. Oracle: transformers on each text alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import hookcli
from hookcli.engine.prepare import prepare
from hookcli.options import InputOptions, ModelOptions
from tests.support.attention import numbers_by_hand
from tests.support.llm import LINES, save

transformers = pytest.importorskip("transformers")

TEXTS = [LINES[3], "hello", "A dog"]


def _saved(folder: Path, side: str) -> Path:
    save(folder, "gpt2")
    config = folder / "tokenizer_config.json"
    fields = json.loads(config.read_text())
    config.write_text(json.dumps({**fields, "padding_side": side}))
    assert transformers.AutoTokenizer.from_pretrained(folder).padding_side == side
    return folder


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved(tmp_path_factory.mktemp("gpt2_left"), "left")


@pytest.fixture(scope="module")
def gpt2_right(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved(tmp_path_factory.mktemp("gpt2_right"), "right")


def test_a_left_padded_batch_reads_each_text_as_it_runs_alone(gpt2: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(gpt2, attn_implementation="eager")
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(gpt2)
    report = hookcli.inspect(
        f"hf:{gpt2}", text=TEXTS, layers=["lm_head"], topk=1, heads=True, device="cpu"
    )
    assert report.input is not None and "position_ids from the attention mask" in str(
        report.input.description
    )
    for seq, text in enumerate(TEXTS):
        with torch.no_grad():
            alone = model(**tok(text, return_tensors="pt"), output_attentions=True)
        want = alone.logits[0, -1].double().softmax(-1)
        (top,) = [p for p in report.predictions if p.image == seq]
        assert top.index == int(want.argmax())
        assert top.prob == pytest.approx(float(want.max()), rel=1e-5)
        if len(tok(text)["input_ids"]) < 2:
            continue  # (a one-token text has no query past its first)
        want_heads = numbers_by_hand([alone.attentions[0][0].double()])  # block 0, by hand
        mine = [h for h in report.heads or [] if h.sequence == seq and h.layer == "transformer.h.0"]
        assert len(mine) == len(want_heads)
        for h, (sink, entropy, _, _, queries) in zip(mine, want_heads, strict=True):
            assert h.sink == pytest.approx(sink, rel=1e-5), (seq, h.head)
            assert h.entropy == pytest.approx(entropy, rel=1e-5), (seq, h.head)
            assert h.queries == queries


def test_the_next_token_loss_of_a_left_padded_batch_is_the_texts_own(
    gpt2: Path, gpt2_right: Path
) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(gpt2).eval()
    tok = transformers.AutoTokenizer.from_pretrained(gpt2)
    report = hookcli.grads(f"hf:{gpt2}", text=TEXTS, layers=["lm_head"], device="cpu")
    right = hookcli.grads(f"hf:{gpt2_right}", text=TEXTS, layers=["lm_head"], device="cpu")
    # the oracle: the mean over every predicted token of the texts, each text alone
    total, count = 0.0, 0
    for text in TEXTS:
        ids = tok(text, return_tensors="pt")["input_ids"]
        if ids.shape[1] < 2:
            continue
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].double()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    assert report.backward is not None and right.backward is not None
    assert report.backward.value == pytest.approx(total / count, rel=1e-5)
    assert right.backward.value == pytest.approx(total / count, rel=1e-5)


def test_generate_makes_its_own_positions_and_a_right_padded_batch_gets_none(
    gpt2: Path, gpt2_right: Path
) -> None:
    inputs = InputOptions(text=tuple(TEXTS))
    left = prepare(ModelOptions(f"hf:{gpt2}"), None, inputs).model_input
    right = prepare(ModelOptions(f"hf:{gpt2_right}"), None, inputs).model_input
    assert left is not None and right is not None
    mask = left.kwargs["attention_mask"]
    positions = left.kwargs["position_ids"]
    assert positions[mask.bool()].tolist() == [p for n in mask.sum(-1).tolist() for p in range(n)]
    assert "position_ids" not in right.kwargs and not right.positions_from_mask
    model = transformers.AutoModelForCausalLM.from_pretrained(gpt2).eval()
    tok = transformers.AutoTokenizer.from_pretrained(gpt2)
    report = hookcli.inspect(f"hf:{gpt2}", text=TEXTS, layers=["lm_head"], generate=2)
    assert report.generated is not None
    for seq, text in enumerate(TEXTS):
        with torch.no_grad():
            out = model.generate(
                **tok(text, return_tensors="pt"), max_new_tokens=2, do_sample=False,
                pad_token_id=tok.pad_token_id,
            )  # fmt: skip
        assert report.generated[seq].ids == out[0, -2:].tolist()


def test_a_forward_that_does_not_name_position_ids_gets_none_and_the_input_says_so(
    gpt2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrapper's forward (input_ids, attention_mask, **kwargs) may not pass position_ids on:
    hookcli gives none, as model.generate gives none, and says that a text's positions then
    count from the batch's first column (never a padding guessed silently). Oracle: the
    model on the same left-padded batch without position_ids."""
    cls = transformers.GPT2LMHeadModel
    original = cls.forward

    def forward(self: Any, input_ids: Any = None, attention_mask: Any = None, **kw: Any) -> Any:
        return original(self, input_ids=input_ids, attention_mask=attention_mask, **kw)

    monkeypatch.setattr(cls, "forward", forward)
    report = hookcli.inspect(f"hf:{gpt2}", text=TEXTS, layers=["lm_head"], topk=1, device="cpu")
    assert report.input is not None
    description = str(report.input.description)
    assert "position_ids from the attention mask" not in description
    assert "no position_ids (the model's forward does not name them)" in description
    model = transformers.AutoModelForCausalLM.from_pretrained(gpt2).eval()
    tok = transformers.AutoTokenizer.from_pretrained(gpt2)
    with torch.no_grad():
        logits = model(**tok(TEXTS, return_tensors="pt", padding=True)).logits[:, -1].double()
    for seq in range(len(TEXTS)):
        (top,) = [p for p in report.predictions if p.image == seq]
        assert top.index == int(logits[seq].argmax())
        assert top.prob == pytest.approx(float(logits[seq].softmax(-1).max()), rel=1e-5)


def test_padding_side_on_the_command_line_pads_as_asked(gpt2_right: Path) -> None:
    """--padding-side left on a tokenizer that pads on the right: the batch is padded on the
    left, each text's positions counted from its first token, and each text's next-token
    prediction is its own alone (the oracle: transformers on each text alone)."""
    from typer.testing import CliRunner

    from hookcli.cli import app

    args = ["inspect", f"hf:{gpt2_right}", "-l", "lm_head", "--topk", "1", "-f", "json"]
    texts = [a for t in TEXTS for a in ("--text", t)]
    r = CliRunner().invoke(app, [*args, *texts, "--padding-side", "left"])
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert "padded on the left" in report["input"]["description"]
    assert "position_ids from the attention mask" in report["input"]["description"]
    model = transformers.AutoModelForCausalLM.from_pretrained(gpt2_right).eval()
    tok = transformers.AutoTokenizer.from_pretrained(gpt2_right)
    for seq, text in enumerate(TEXTS):
        with torch.no_grad():
            want = model(**tok(text, return_tensors="pt")).logits[0, -1].double().softmax(-1)
        (top,) = [p for p in report["predictions"] if p["image"] == seq]
        assert top["index"] == int(want.argmax())
        assert top["prob"] == pytest.approx(float(want.max()), rel=1e-5)


def test_a_left_padded_seq2seq_batch_says_its_positions_count_from_the_first_column(
    tmp_path: Path,
) -> None:
    """An encoder-decoder (BART, learned positions) padded on the left gets no position_ids:
    a short text runs at the positions its padding pushed it to, and its numbers differ from
    the text's alone (the oracle: the encoder's output for the text alone) — said, never
    silent; padded on the right, nothing to say."""
    save(tmp_path, "bart")
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    layer = "model.encoder.layers.0"
    said = "this model gets no position_ids"
    options: dict[str, Any] = {"text": TEXTS, "layers": [layer], "topk": 0, "device": "cpu"}
    report = {
        side: hookcli.inspect(f"hf:{tmp_path}", padding_side=side, **options)
        for side in ("left", "right")
    }
    assert said in str(report["left"].input.description)  # type: ignore[union-attr]
    assert said not in str(report["right"].input.description)  # type: ignore[union-attr]
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    alone = []
    for text in TEXTS:
        with torch.no_grad():
            out = model.model.encoder(**tok(text, return_tensors="pt")).last_hidden_state
        alone.append(out[0])
    whole = torch.cat(alone).double()
    right = report["right"].layers[0].outputs[0]
    left = report["left"].layers[0].outputs[0]
    assert right.max == pytest.approx(float(whole.max()), rel=1e-4)
    assert right.min == pytest.approx(float(whole.min()), rel=1e-4)
    assert (left.max, left.min) != pytest.approx((float(whole.max()), float(whole.min())), rel=1e-4)


def test_a_left_padded_encoder_classifier_says_its_positions_and_first_token_move(
    tmp_path: Path,
) -> None:
    """BERT classifying a batch padded on the left: learned positions and the [CLS] token
    read at the batch's first column make the short text's probabilities differ from the
    text's alone (the oracle: transformers on it alone) — said on the input line; padded on
    the right, they are the text's own and nothing is said."""
    from tests.support.llm import make_tokenizer

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, num_labels=2, pad_token_id=0,
    )  # fmt: skip
    transformers.BertForSequenceClassification(config).eval().save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    said = "a first-token classifier (BERT's [CLS]) reads padding"
    report = {
        side: hookcli.inspect(f"hf:{tmp_path}", text=TEXTS, padding_side=side, topk=2)
        for side in ("left", "right")
    }
    assert said in str(report["left"].input.description)
    assert said not in str(report["right"].input.description)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    short = min(range(len(TEXTS)), key=lambda i: len(tok(TEXTS[i])["input_ids"]))
    with torch.no_grad():
        want = model(**tok(TEXTS[short], return_tensors="pt")).logits[0].double().softmax(-1)
    right = {p.index: p.prob for p in report["right"].predictions or [] if p.image == short}
    assert right == pytest.approx({i: float(v) for i, v in enumerate(want)}, rel=1e-5)


def test_a_left_padded_decoder_only_classifier_gets_each_texts_own_positions(
    tmp_path: Path,
) -> None:
    """GPT-2's sequence classifier over a batch padded on the left: a decoder-only model, so
    each text's positions come from the mask (as for its causal LM): every text's
    probabilities are the text's alone (the oracle: transformers on each); its input line
    said BERT's [CLS] read padding, and its learned positions were the batch's columns."""
    from tests.support.llm import make_tokenizer

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=512, n_embd=32, n_layer=2, n_head=4, n_positions=64, num_labels=3,
        pad_token_id=0,
    )  # fmt: skip
    transformers.GPT2ForSequenceClassification(config).eval().save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    report = hookcli.inspect(f"hf:{tmp_path}", text=TEXTS, padding_side="left", topk=3)
    said = str(report.input.description)  # type: ignore[union-attr]
    assert "[CLS]" not in said and "position_ids from the attention mask" in said
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for i, text in enumerate(TEXTS):
        with torch.no_grad():
            want = model(**tok(text, return_tensors="pt")).logits[0].double().softmax(-1)
        got = {p.index: p.prob for p in report.predictions or [] if p.image == i}
        assert got == pytest.approx({k: float(v) for k, v in enumerate(want)}, rel=1e-5)
