"""Token labels are readable (issue 48, item 9): a byte-level BPE piece is the text its bytes
make (never '�'), a byte that is no whole character is `<0xF0>`, a character split over
several tokens is shown whole once ('😀<4 bytes>') with its other bytes on the tokens after it,
SentencePiece pieces keep their `▁`. Oracles: the tokenizer's own decode, convert_ids_to_tokens
and transformers' byte-level alphabet, on tokenizers trained here with the `tokenizers`
library (nothing is downloaded)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from hookcli.sources.lm import TokenLabels  # noqa: E402
from hookcli.sources.tokentext import BYTE_LEVEL, SENTENCEPIECE, Pieces  # noqa: E402

runner = CliRunner()
LINES = [
    "The cat sat on the mat.",
    "I love 😀 and café au lait.",
    "A naïve dog ran 😀😀 in the park.",
    "hello world, the cat and the dog",
]
VOCAB = 320
SPLIT = "naïve 🙂!"  # 🙂 is not in the training lines: its four bytes are four tokens
HEX = re.compile(r"<0x([0-9A-F]{2})>")


def byte_level() -> Any:
    from examples.tiny_llm import train_tokenizer

    return train_tokenizer(LINES, VOCAB)


def sentencepiece(byte_fallback: bool) -> Any:
    """A SentencePiece-style BPE (Metaspace pre-tokenizer: '▁' marks a word's start) as
    transformers.PreTrainedTokenizerFast; with byte fallback (Llama's and Mistral's: pieces
    <0x00>…<0xFF> and their decoder), or T5's plain Metaspace decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(LINES * 5, trainer)
    tok.decoder = decoders.Metaspace()
    if byte_fallback:
        state = json.loads(tok.to_str())["model"]
        vocab = dict(state["vocab"])
        for b in range(256):
            vocab.setdefault(f"<0x{b:02X}>", len(vocab))
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
        model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
        tok = Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.add_special_tokens(specials)
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("\u2581", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def piece_bytes(tok: Any, i: int) -> bytes:
    """What a byte-level piece stands for, read with transformers' own alphabet."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    back = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(back[c] for c in tok.convert_ids_to_tokens(i))


def label_bytes(label: str) -> bytes:
    """A label read back into bytes: its text as UTF-8, each `<0xF0>` as its byte."""
    out = b""
    at = 0
    for m in HEX.finditer(label):
        out += label[at : m.start()].encode() + bytes([int(m.group(1), 16)])
        at = m.end()
    return out + label[at:].encode()


def ids_of(tok: Any, text: str) -> list[int]:
    return [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]


# ---------------------------------------------------------------- byte-level BPE


def test_every_byte_level_piece_is_the_text_of_its_bytes_never_a_replacement_char() -> None:
    tok = byte_level()
    pieces = Pieces(tok)
    assert pieces.kind == BYTE_LEVEL
    specials = set(tok.all_special_ids)
    labels = TokenLabels(tok, len(tok))
    whole = partial = 0
    for i, label in enumerate(labels):
        assert "\ufffd" not in label
        alone = tok.decode([i])
        if i in specials:
            assert label == alone == tok.convert_ids_to_tokens(i)  # '<s>' as written
        elif "\ufffd" not in alone:  # whole UTF-8 characters: the text, as decode gives it
            assert label == alone
            whole += 1
        else:  # bytes of a character cut by the piece: <0xF0>, never '�'
            assert HEX.search(label) and label_bytes(label) == piece_bytes(tok, i)
            partial += 1
    assert whole and partial
    (space_the,) = ids_of(tok, " the")
    assert tok.convert_ids_to_tokens(space_the) == "Ġthe" and labels[space_the] == " the"
    # a model vocabulary larger than the tokenizer's: an id it lacks is <id N>, wherever it is
    past = len(tok) + 2
    assert TokenLabels(tok, past + 1)[past] == pieces.alone([past])[0] == f"<id {past}>"
    ids = ids_of(tok, SPLIT)
    assert TokenLabels(tok, past + 1).sequence([*ids[:2], past]) == [
        *pieces.sequence(ids[:2]),
        f"<id {past}>",
    ]


def test_a_byte_level_emoji_is_one_label_whole_or_split_over_its_tokens() -> None:
    tok = byte_level()
    pieces = Pieces(tok)
    ids = ids_of(tok, " 😀")  # in the training lines: one token, all four bytes
    assert len(ids) == 1 and tok.convert_ids_to_tokens(ids) == ["ĠðŁĺĢ"]
    assert pieces.sequence(ids) == pieces.alone(ids) == [tok.decode(ids)] == [" 😀"]
    ids = ids_of(tok, SPLIT)
    labels = pieces.sequence(ids)
    raw = [piece_bytes(tok, i) for i in ids]
    assert b"".join(raw).decode() == tok.decode(ids) == SPLIT
    first = next(k for k, b in enumerate(raw) if b"\xf0" in b)  # 🙂's first byte
    rest = [k for k in range(first + 1, len(ids)) if raw[k][0] & 0xC0 == 0x80]
    assert len(rest) >= 1  # the emoji is split: its later bytes are tokens of their own
    assert labels[first].endswith("🙂<4 bytes>") and labels.count("🙂<4 bytes>") == 1
    assert sum(label.count("🙂") for label in labels) == 1  # once, not once a token
    for k in rest:  # each later token: its share of the emoji's bytes, as <0x..>
        assert label_bytes(labels[k]) == raw[k]
    assert not any("\ufffd" in label for label in labels)
    assert labels[0].startswith("na") and labels[0].endswith("<2 bytes>")  # 'ï' split too
    # each label alone: the bytes it holds, read back exactly
    assert [label_bytes(t) for t in pieces.alone(ids)] == raw


def test_generated_text_is_the_ids_decoded_together_with_a_cut_character_as_bytes() -> None:
    tok = byte_level()
    pieces = Pieces(tok)
    ids = ids_of(tok, SPLIT)
    assert pieces.text(ids) == tok.decode(ids) == SPLIT  # whole: decode's own text
    cut = ids[: next(k for k, t in enumerate(pieces.sequence(ids)) if "🙂" in t) + 1]
    decoded = tok.decode(cut)
    assert decoded.endswith("\ufffd")  # what transformers prints for the cut emoji
    shown = pieces.text(cut)
    assert "\ufffd" not in shown and shown.endswith("<0xF0><0x9F>")
    assert label_bytes(shown) == b"".join(piece_bytes(tok, i) for i in cut)
    past = len(tok) + 1  # an id the tokenizer lacks (a random model's vocabulary is larger)
    assert tok.decode([*ids, past]) == SPLIT  # decode drops it in silence
    assert pieces.text([*ids, past]) == SPLIT + f"<id {past}>"


# ---------------------------------------------------------------- SentencePiece


@pytest.mark.parametrize("byte_fallback", [True, False], ids=["byte-fallback", "metaspace"])
def test_sentencepiece_pieces_keep_their_word_mark_and_byte_pieces_are_bytes(
    byte_fallback: bool,
) -> None:
    tok = sentencepiece(byte_fallback)
    pieces = Pieces(tok)
    assert pieces.kind == SENTENCEPIECE and pieces.byte_pieces == byte_fallback
    ids = ids_of(tok, "I love 😀 the café")
    spelled = tok.convert_ids_to_tokens(ids)
    assert pieces.sequence(ids) == pieces.alone(ids) == spelled  # '▁the', '▁café', '▁😀'
    assert "\u2581the" in spelled and "\u2581café" in spelled
    assert tok.decode([ids_of(tok, "the")[0]]) == "the"  # what decoding alone loses
    labels = TokenLabels(tok, len(tok))
    assert labels.find_token(" the") == labels.find_token("\u2581the") == ids_of(tok, "the")[0]
    if not byte_fallback:
        return
    ids = ids_of(tok, SPLIT)  # 🙂: four byte pieces <0xF0><0x9F><0x99><0x82>
    spelled = tok.convert_ids_to_tokens(ids)
    at = spelled.index("<0xF0>")
    assert spelled[at : at + 4] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    labels_seq = pieces.sequence(ids)
    assert labels_seq[at : at + 4] == ["🙂<4 bytes>", "<0x9F>", "<0x99>", "<0x82>"]
    assert pieces.alone(ids)[at : at + 4] == spelled[at : at + 4]
    assert tok.decode(ids) == SPLIT and pieces.text(ids) == SPLIT
    assert pieces.text(ids[: at + 1]) == tok.decode(ids[: at + 1]).replace("\ufffd", "<0xF0>")


# ---------------------------------------------------------------- through the CLI


@pytest.fixture(scope="module")
def emoji_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved beside the byte-level tokenizer trained on LINES."""
    folder = tmp_path_factory.mktemp("emoji_llama")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    byte_level().save_pretrained(folder)
    return folder


def test_per_token_rows_tokens_and_predictions_are_readable_through_the_cli(
    emoji_llama: Path,
) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(emoji_llama)
    ids = ids_of(tok, SPLIT)
    want = Pieces(tok).sequence(ids)
    args = ["inspect", f"hf:{emoji_llama}", "--text", SPLIT, "-l", "model.layers.1"]
    result = runner.invoke(app, [*args, "--per-token", "--topk", str(VOCAB)])
    assert result.exit_code == 0, result.stderr
    assert "\ufffd" not in result.stdout
    assert "'🙂<4 bytes>'" in result.stdout and "'<0x99>'" in result.stdout
    as_json = runner.invoke(app, [*args, "--per-token", "-f", "json", "--topk", str(VOCAB)])
    assert as_json.exit_code == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    (text,) = report["input"]["texts"]
    assert text["ids"] == ids and text["tokens"] == want
    rows = report["layers"][0]["outputs"][0]["per_token"]
    assert [r["id"] for r in rows] == ids and [r["token"] for r in rows] == want
    predicted = {p["index"]: p["label"] for p in report["predictions"]}
    assert len(predicted) == VOCAB and not any("\ufffd" in t for t in predicted.values())
    (space_the,) = ids_of(tok, " the")
    assert predicted[space_the] == " the"


def test_lens_positions_are_the_sequences_labels(emoji_llama: Path) -> None:
    report = hookcli.lens(f"hf:{emoji_llama}", text=SPLIT, device="cpu")
    tok = transformers.AutoTokenizer.from_pretrained(emoji_llama)
    assert report.tokens == [Pieces(tok).sequence(ids_of(tok, SPLIT))]
    assert all("\ufffd" not in str(t.token) for cell in report.lens for t in cell.top)


def test_generated_tokens_and_text_are_readable(emoji_llama: Path) -> None:
    report = hookcli.inspect(
        f"hf:{emoji_llama}", text="I love", generate=6, layers=["lm_head"], device="cpu"
    )
    tok = transformers.AutoTokenizer.from_pretrained(emoji_llama)
    assert report.generated is not None
    (g,) = report.generated
    assert g.tokens == Pieces(tok).sequence(g.ids)
    assert g.text is not None and "\ufffd" not in g.text
    decoded = tok.decode(g.ids)
    if "\ufffd" not in decoded and all(i < len(tok) for i in g.ids):
        assert g.text == decoded
    else:  # bytes that make no character: where decode says '�', the bytes
        known = [i for i in g.ids if i < len(tok)]
        kept = re.sub(r"<id \d+>", "", g.text)
        assert label_bytes(kept) == b"".join(piece_bytes(tok, i) for i in known)
