"""A padded batch's padding is left out of tensors of (batch, tokens) leading sizes; a 2-D
tensor whose columns are features is not one of them, however its sizes fall (issue 48's
rule read by shape). A sequence classifier with as many labels as the batch has tokens, and
a BERT whose hidden size is the token count: the pooler's and the classifier's rows and the
model's logits are measured whole. Oracle: transformers run on the same padded batch, the
layers' tensors kept by a hook of the test's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hookcli
from tests.support.oracles import assert_stats_match

transformers = pytest.importorskip("transformers")

TEXTS = ["Once upon a time there was a model.", "hello", "The cat sat on the mat."]


def _tokens() -> tuple[Any, int]:
    from tests.support.llm import make_tokenizer

    tok = make_tokenizer()
    return tok, int(tok(TEXTS, padding=True, return_tensors="pt")["input_ids"].shape[1])


def _save(folder: Path, model: Any, tok: Any) -> Path:
    model.eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _truth(folder: Path, layers: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    kept: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Any:
        def hook(_m: Any, _args: Any, out: Any) -> None:
            kept[name] = out.detach().clone()

        return hook

    handles = [model.get_submodule(n).register_forward_hook(keep(n)) for n in layers]
    try:
        with torch.no_grad():
            enc = tok(TEXTS, padding=True, return_tensors="pt")
            logits = model(**enc).logits
    finally:
        for h in handles:
            h.remove()
    return kept, logits


def test_a_bert_whose_hidden_size_is_the_token_count_has_its_pooled_rows_measured_whole(
    tmp_path: Path,
) -> None:
    tok, tokens = _tokens()
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=320, hidden_size=tokens, num_hidden_layers=1, num_attention_heads=1,
        intermediate_size=16, max_position_embeddings=64, num_labels=tokens, pad_token_id=0,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    folder = _save(tmp_path / "bert", transformers.BertForSequenceClassification(config), tok)
    layers = ["bert.pooler.dense", "bert.pooler.activation", "classifier"]
    report = hookcli.inspect(f"hf:{folder}", text=TEXTS, device="cpu", layers=layers, topk=0)
    kept, logits = _truth(folder, layers)
    mask = tok(TEXTS, padding=True, return_tensors="pt")["attention_mask"]
    assert not bool(mask.all())  # a padded batch indeed
    for name in layers:
        call = next(c for c in report.layers if c.name == name)
        got = call.outputs[0]
        assert got.shape == (len(TEXTS), tokens)
        assert_stats_match(got, kept[name], rtol=1e-5, same_tensor=False)
        assert got.note is None or "padding" not in got.note
    assert_stats_match(report.outputs[0], logits, rtol=1e-5, same_tensor=False)
    # the encoder selected itself: its pooler_output is a row a text too
    whole = hookcli.inspect(f"hf:{folder}", text=TEXTS, device="cpu", layers=["bert"], topk=0)
    (pooled,) = [t for t in whole.layers[0].outputs if "pooler_output" in t.path]
    assert_stats_match(pooled, kept["bert.pooler.activation"], rtol=1e-5, same_tensor=False)
    # the embeddings' output is (batch, tokens, hidden): its padding is still left out
    emb = hookcli.inspect(
        f"hf:{folder}", text=TEXTS, device="cpu", layers=["bert.embeddings"], topk=0
    )
    out = emb.layers[0].outputs[0]
    assert out.numel == int(mask.sum()) * tokens and "padding left out" in str(out.note)


def test_a_sequence_classifiers_logits_of_as_many_labels_as_tokens_are_measured_whole(
    tmp_path: Path,
) -> None:
    from tests.support.llm import llama_config

    tok, tokens = _tokens()
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(llama_config(num_labels=tokens))
    folder = _save(tmp_path / "llama", model, tok)
    report = hookcli.inspect(f"hf:{folder}", text=TEXTS, device="cpu", layers=["score"], topk=0)
    kept, logits = _truth(folder, ["score"])
    # the score head is per token, (batch, tokens, labels): its padding left out
    score = report.layers[0].outputs[0]
    real = kept["score"][tok(TEXTS, padding=True, return_tensors="pt")["attention_mask"].bool()]
    assert_stats_match(score, real, rtol=1e-5, same_tensor=False)
    # the logits the model pools from it are a row a text, all of them
    (got,) = report.outputs
    assert got.shape == (len(TEXTS), tokens) and got.numel == logits.numel()
    assert_stats_match(got, logits, rtol=1e-5, same_tensor=False)
