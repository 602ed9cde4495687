"""attn and --heads on models whose attention is read the other ways transformers offers
(issue 49): Falcon, whose own code collects what `output_attentions=True` returns (no
`_can_record_outputs`, no dynamic switch of implementation), in its multi-query, multi-head,
new-decoder-architecture (grouped key/value heads) and ALiBi layouts; and encoder-decoders
(BART, T5), whose default block is the encoder's self-attention over the text and whose
cross-attention, asked for, has the decoder's tokens down its rows and the text's along its
columns.

Oracles: softmax(QK^T/sqrt(d) + causal mask) by hand from each Falcon attention module's own
fused query_key_value projection, split as each layout lays it out; transformers' own eager
`output_attentions=True` outputs (`attentions`, `encoder_attentions`, `cross_attentions`) of
the same saved tiny model; the rollout by hand. Tiny random models are saved beside the
tokenizer tests/support/llm.py trains (nothing is downloaded), their weights drawn wide enough
(initializer 0.3) that no head is near uniform."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import hookcli
from tests.support.oracles import hooks_left

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from hookcli.commands.attention import attention_maps  # noqa: E402
from hookcli.commands.heads import attention_heads  # noqa: E402
from hookcli.engine.attention import find_attention  # noqa: E402
from hookcli.engine.prepare import prepare  # noqa: E402
from hookcli.options import AttnOptions, InputOptions, ModelOptions  # noqa: E402
from hookcli.sources.tokentext import Pieces  # noqa: E402
from tests.support.attention import numbers_by_hand, rollout_by_hand  # noqa: E402
from tests.support.cli import one_line_error as one_line  # noqa: E402
from tests.support.cli import run  # noqa: E402
from tests.support.llm import VOCAB, make_tokenizer  # noqa: E402

TEXT = "The cat sat on the mat."
WIDE = 0.3  # the initializer's std: peaked attention, so a wrong head or layout shows

FALCONS = {
    "multi-query": {},  # FalconConfig's default: one key/value head shared by every head
    "multi-head": {"multi_query": False},
    "new-decoder": {"new_decoder_architecture": True, "num_kv_heads": 2},
    "alibi": {"multi_query": False, "alibi": True},
}


def _saved(folder: Path, model: Any) -> Path:
    model.eval().save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def falcon_config(**extra: Any) -> Any:
    return transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        initializer_range=WIDE, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra,
    )  # fmt: skip


@pytest.fixture(scope="module", params=list(FALCONS))
def falcon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(falcon_config(**FALCONS[request.param]))
    return _saved(tmp_path_factory.mktemp(f"falcon_{request.param}"), model)


@pytest.fixture(scope="module")
def bart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, init_std=WIDE, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
    )  # fmt: skip
    return _saved(
        tmp_path_factory.mktemp("bart"), transformers.BartForConditionalGeneration(config)
    )


def eager(folder: Path, auto: Any = None) -> tuple[Any, Any]:
    """transformers' own model of the folder with eager attention, and its tokenizer."""
    model = (auto or transformers.AutoModelForCausalLM).from_pretrained(
        folder, attn_implementation="eager"
    )
    return model.eval(), transformers.AutoTokenizer.from_pretrained(folder)


def tokens_of(tok: Any, ids: torch.Tensor) -> list[str]:
    return Pieces(tok).sequence(ids.tolist())


# ---------------------------------------------------------------- Falcon


@torch.no_grad()
def falcon_by_hand(model: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's softmax(QK^T/sqrt(d) + causal mask), (1, heads, L, L) float64, from its
    attention module's input and its fused query_key_value weights, split as the layout lays
    them out: multi-head (L, heads, 3, d); multi-query (L, heads + 2, d): the queries, then
    the one key; new decoder architecture (L, groups, heads/groups + 2, d): each group's
    queries, then its key. Rotary positions as the model applies them."""
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    config = model.config
    layers = model.transformer.h
    seen: list[torch.Tensor] = []
    handles = [
        layer.self_attention.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True,
        )
        for layer in layers
    ]
    try:
        model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    heads, d = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    length = ids.shape[1]
    out = []
    for layer, x in zip(layers, seen, strict=True):
        qkv = layer.self_attention.query_key_value.weight.double() @ x[0].double().T  # (out, L)
        qkv = qkv.T  # (L, out)
        if config.new_decoder_architecture:
            groups = config.num_kv_heads
            per = heads // groups
            g = qkv.reshape(length, groups, per + 2, d)
            q = g[:, :, :per].reshape(length, heads, d)
            k = g[:, :, per].repeat_interleave(per, dim=1)  # each head: its group's key
        elif config.multi_query:
            g = qkv.reshape(length, heads + 2, d)
            q, k = g[:, :heads], g[:, heads : heads + 1].expand(length, heads, d)
        else:
            g = qkv.reshape(length, heads, 3, d)
            q, k = g[:, :, 0], g[:, :, 1]
        q, k = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # (1, heads, L, d)
        position = torch.arange(length)[None]
        cos, sin = model.transformer.rotary_emb(x, position)
        q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        out.append(torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1))
    return out


def test_falcons_attention_modules_are_its_innermost_output_attentions_takers(
    falcon: Path,
) -> None:
    model, _ = eager(falcon)
    sites = find_attention(model)
    assert [(s.name, s.block, s.type, s.cross, s.side) for s in sites] == [
        (f"transformer.h.{i}.self_attention", f"transformer.h.{i}", "FalconAttention", False, "")
        for i in range(2)
    ]


def test_falcon_attention_is_softmax_qk_by_hand_and_transformers_own(falcon: Path) -> None:
    model, tok = eager(falcon)
    enc = tok(TEXT, return_tensors="pt")
    with torch.no_grad():
        truth = [a.double() for a in model(**enc, output_attentions=True).attentions]
    assert all(float(a.max(dim=-1).values[0, :, 1:].mean()) > 0.5 for a in truth), (
        "the tiny model's heads are peaked (a wrong head or layout would show)"
    )
    by_hand = None if model.config.alibi else falcon_by_hand(model, enc["input_ids"])
    for layer in range(2):
        asked = None if layer == 1 else "transformer.h.0"  # the default: the last block
        drawn = hookcli.attn(f"hf:{falcon}", text=TEXT, layer=asked, device="cpu")
        assert drawn.layer == f"transformer.h.{layer}"
        got = torch.from_numpy(drawn.raw).double()
        assert got.shape == (1, 4, truth[layer].shape[-1], truth[layer].shape[-1])
        torch.testing.assert_close(got, truth[layer], rtol=0, atol=1e-6)
        if by_hand is not None:
            torch.testing.assert_close(got, by_hand[layer], rtol=0, atol=1e-5)
        words = tokens_of(tok, enc["input_ids"][0])
        assert drawn.picture.row_tokens == words and drawn.picture.col_tokens == words
    torch.testing.assert_close(
        torch.from_numpy(drawn.rollout).double(), rollout_by_hand(truth), rtol=0, atol=1e-5
    )
    assert any("it was sdpa" in line for line in drawn.picture.legend)


def test_falcon_heads_are_each_heads_own_numbers(falcon: Path) -> None:
    model, tok = eager(falcon)
    with torch.no_grad():
        out = model(**tok(TEXT, return_tensors="pt"), output_attentions=True)
    report = hookcli.inspect(f"hf:{falcon}", text=TEXT, device="cpu", heads=True, topk=0)
    assert report.heads is not None and len(report.heads) == 2 * 4
    for layer in range(2):
        got = [h for h in report.heads if h.layer == f"transformer.h.{layer}"]
        want = numbers_by_hand([out.attentions[layer][0].double()])
        assert [h.head for h in got] == [0, 1, 2, 3]
        for h, (sink, entropy, top, share, n) in zip(got, want, strict=True):
            assert h.sink == pytest.approx(sink, rel=1e-5)
            assert h.entropy == pytest.approx(entropy, rel=1e-5)
            assert (h.top_key, h.queries) == (top, n)
            assert h.top_share == pytest.approx(share, rel=1e-5)


def test_check_holds_its_head_rules_on_falcon(tmp_path: Path) -> None:
    torch.manual_seed(0)
    folder = _saved(tmp_path, transformers.FalconForCausalLM(falcon_config()))
    r = run("check", f"hf:{folder}", "--text", TEXT, "--max-sink", "0.01")
    assert r.exit_code == 1, (r.stdout, r.stderr)
    assert "dormant-heads: 8 of 8 heads with sink above 0.01" in r.stdout
    assert "transformer.h.0 call 0 head 0: sink" in r.stdout
    ok = run("check", f"hf:{folder}", "--text", TEXT, "--max-sink", "1", "--min-entropy", "0")
    assert ok.exit_code == 0, (ok.stdout, ok.stderr)


def test_falcon_is_left_as_found() -> None:
    """Falcon cannot switch its implementation through set_attn_implementation: its config's
    is set for the pass (its own forward reads it) and put back; no hook stays."""
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(falcon_config()).eval()
    tok = make_tokenizer()
    assert model.config._attn_implementation == "sdpa"
    ids = tok(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    drawn = hookcli.attn(model, text=TEXT, tokenizer=tok, device="cpu")
    assert drawn.layer == "transformer.h.1" and drawn.raw.shape[:2] == (1, 4)
    assert model.config._attn_implementation == "sdpa"
    assert hooks_left(model) == 0
    assert not any("_output_capturing_hooks_installed" in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain)


def test_attentions_whose_head_cannot_be_told_are_refused_not_guessed(
    falcon: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Falcon's flash attention returns its attention *output* (batch, L, hidden) as its
    `attentions`: 3-D, no head dimension. Nothing is reshaped into heads: attn refuses in one
    line, --heads leaves the calls out and says so."""
    from transformers.models.falcon import modeling_falcon

    own = modeling_falcon.FalconAttention.forward

    def flash_like(self: Any, *args: Any, **kwargs: Any) -> Any:
        out, _ = own(self, *args, **kwargs)
        return out, out  # as FalconFlashAttention2 returns with output_attentions=True

    monkeypatch.setattr(modeling_falcon.FalconAttention, "forward", flash_like)
    png = tmp_path / "a.png"
    r = run("attn", f"hf:{falcon}", "--text", TEXT, "-o", str(png))
    line = one_line(r, 2, "transformer.h.1.self_attention", "not (batch, heads, queries, keys)")
    assert "cannot be told" in line and "1x7x32" in line
    assert not png.exists()
    report = hookcli.inspect(f"hf:{falcon}", text=TEXT, device="cpu", heads=True, topk=0)
    assert report.heads == []
    assert any("2 attention call(s) returned attentions of shape 1x7x32" in n for n in report.notes)


# ---------------------------------------------------------------- encoder-decoders


def seq2seq_truth(
    folder: Path, text: str, decoder: list[int] | None = None
) -> tuple[Any, Any, Any]:
    """transformers' own eager run: the model's output, the encoding and the tokenizer."""
    model, tok = eager(folder, transformers.AutoModelForSeq2SeqLM)
    enc = tok(text, return_tensors="pt")
    start = model.config.decoder_start_token_id
    decoder_ids = torch.tensor([decoder if decoder is not None else [start]])
    with torch.no_grad():
        out = model(**enc, decoder_input_ids=decoder_ids, output_attentions=True)
    return out, enc, tok


def test_bart_draws_its_encoders_last_self_attention_by_default(bart: Path) -> None:
    out, enc, tok = seq2seq_truth(bart, TEXT)
    drawn = hookcli.attn(f"hf:{bart}", text=TEXT, device="cpu")
    assert drawn.layer == "model.encoder.layers.1"
    encoder = [a.double() for a in out.encoder_attentions]
    torch.testing.assert_close(torch.from_numpy(drawn.raw).double(), encoder[1], rtol=0, atol=1e-6)
    words = tokens_of(tok, enc["input_ids"][0])
    assert drawn.picture.row_tokens == words and drawn.picture.col_tokens == words
    # the rollout is the encoder's: the decoder's self-attention (over its start token) and
    # the cross-attention are not multiplied in
    torch.testing.assert_close(
        torch.from_numpy(drawn.rollout).double(), rollout_by_hand(encoder), rtol=0, atol=1e-5
    )
    legend = " ".join(drawn.picture.legend)
    assert "rollout over 2 attention calls of 2 blocks" in legend
    sites = {
        s.name: (s.cross, s.side)
        for s in find_attention(eager(bart, transformers.AutoModelForSeq2SeqLM)[0])
    }
    assert sites["model.decoder.layers.0.encoder_attn"] == (True, "decoder")
    assert sites["model.encoder.layers.0.self_attn"] == (False, "encoder")


def test_bart_cross_attention_when_asked_has_decoder_rows_and_text_columns(
    bart: Path, tmp_path: Path
) -> None:
    out, enc, tok = seq2seq_truth(bart, TEXT)
    for layer in range(2):
        name = f"model.decoder.layers.{layer}.encoder_attn"
        drawn = hookcli.attn(f"hf:{bart}", text=TEXT, layer=name, device="cpu")
        assert drawn.layer == name
        cross = out.cross_attentions[layer].double()
        length = enc["input_ids"].shape[1]
        assert drawn.raw.shape == (1, 4, 1, length)
        torch.testing.assert_close(torch.from_numpy(drawn.raw).double(), cross, rtol=0, atol=1e-6)
        assert drawn.picture.row_tokens == ["</s>"]  # the decoder's start token
        assert drawn.picture.col_tokens == tokens_of(tok, enc["input_ids"][0])
        carried = cross.mean(dim=1) @ rollout_by_hand([a.double() for a in out.encoder_attentions])
        torch.testing.assert_close(
            torch.from_numpy(drawn.rollout).double(), carried, rtol=0, atol=1e-5
        )
        legend = " ".join(drawn.picture.legend)
        assert "cross-attention" in legend
        assert "batch x heads x decoder query tokens x encoder key tokens" in legend
    png = tmp_path / "x.png"
    r = run("attn", f"hf:{bart}", "--text", TEXT, "-l", name, "-o", str(png))
    assert r.exit_code == 0, r.stderr
    meta = json.loads(Image.open(png).info["hookcli"])
    assert name in meta["title"] and meta["layout"] == f"tokens:1x{length}"
    both = run("attn", f"hf:{bart}", "--text", TEXT, "-l", "model.decoder.layers.0", "-o", str(png))
    one_line(both, 2, "holds 2 attention blocks", "model.decoder.layers.0.self_attn",
             "model.decoder.layers.0.encoder_attn (cross-attention)")  # fmt: skip


def test_cross_attention_is_told_by_transformers_not_by_its_shape(bart: Path) -> None:
    """A target as long as the text: the cross-attention is square, and still cross-attention
    (transformers returns it as cross_attentions): rows the decoder's tokens (the target
    shifted right after the start token), columns the text's; --heads leaves it out."""
    models = ModelOptions(f"hf:{bart}", device="cpu")
    inputs = InputOptions(text=(TEXT,), target_text=(TEXT,))
    name = "model.decoder.layers.1.encoder_attn"
    picture = attention_maps(models, inputs, AttnOptions(layer=name))
    tok = transformers.AutoTokenizer.from_pretrained(bart)
    ids = tok(TEXT, return_tensors="pt")["input_ids"][0].tolist()
    decoder = [2, *ids[:-1]]
    out, _, _ = seq2seq_truth(bart, TEXT, decoder)
    assert picture.raw is not None and picture.raw.shape == (1, 4, len(ids), len(ids))
    torch.testing.assert_close(
        torch.from_numpy(picture.raw).double(), out.cross_attentions[1].double(), rtol=0, atol=1e-6
    )
    words = tokens_of(tok, torch.tensor(ids))
    assert picture.col_tokens == words
    assert picture.row_tokens == ["</s>", *words[:-1]]
    own = attention_maps(models, inputs, AttnOptions(layer="model.decoder.layers.1.self_attn"))
    assert own.row_tokens == own.col_tokens == ["</s>", *words[:-1]]
    torch.testing.assert_close(
        torch.from_numpy(own.raw).double(), out.decoder_attentions[1].double(), rtol=0, atol=1e-6
    )
    heads, notes = attention_heads(prepare(models, inputs=inputs))
    assert {h.layer for h in heads} == {
        "model.encoder.layers.0", "model.encoder.layers.1",
        "model.decoder.layers.0.self_attn", "model.decoder.layers.1.self_attn",
    }  # fmt: skip
    assert any("2 cross-attention call(s)" in n for n in notes)
    want = numbers_by_hand([out.decoder_attentions[1][0].double()])
    for h in heads:
        if h.layer == "model.decoder.layers.1.self_attn":
            sink, entropy, top, share, n = want[h.head]
            assert h.sink == pytest.approx(sink, rel=1e-5)
            assert h.entropy == pytest.approx(entropy, rel=1e-5)
            assert (h.top_key, h.queries) == (top, n)
            assert h.top_share == pytest.approx(share, rel=1e-5)


def test_t5_draws_its_encoders_last_self_attention_by_default(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        initializer_factor=WIDE * 10, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0,
    )  # fmt: skip
    folder = _saved(tmp_path, transformers.T5ForConditionalGeneration(config))
    out, enc, tok = seq2seq_truth(folder, TEXT)
    drawn = hookcli.attn(f"hf:{folder}", text=TEXT, device="cpu")
    assert drawn.layer == "encoder.block.1"
    got = torch.from_numpy(drawn.raw).double()
    torch.testing.assert_close(got, out.encoder_attentions[1].double(), rtol=0, atol=1e-6)
    assert drawn.picture.row_tokens == tokens_of(tok, enc["input_ids"][0])
    cross = hookcli.attn(f"hf:{folder}", text=TEXT, layer="decoder.block.0.layer.1", device="cpu")
    torch.testing.assert_close(
        torch.from_numpy(cross.raw).double(), out.cross_attentions[0].double(), rtol=0, atol=1e-6
    )
    assert cross.picture.row_tokens is not None and len(cross.picture.row_tokens) == 1
    assert np.allclose(cross.raw.sum(-1), 1, atol=1e-5)


def test_heads_of_a_seq2seq_batch_leave_each_sides_own_padding_out(bart: Path) -> None:
    """A padded batch with targets: the encoder's heads leave the texts' padding out, the
    decoder's the targets' (decoder_attention_mask); each sequence's numbers are those of it
    run alone through transformers."""
    texts, targets = [TEXT, "A dog"], ["hello world, the cat", "dog"]
    models = ModelOptions(f"hf:{bart}", device="cpu")
    prepared = prepare(models, inputs=InputOptions(text=tuple(texts), target_text=tuple(targets)))
    heads, _ = attention_heads(prepared)
    tok = transformers.AutoTokenizer.from_pretrained(bart)
    for seq, (text, target) in enumerate(zip(texts, targets, strict=True)):
        ids = tok(text_target=target)["input_ids"]
        out, _, _ = seq2seq_truth(bart, text, [2, *ids[:-1]])
        sides = [
            ("model.encoder.layers.1", out.encoder_attentions[1]),
            ("model.decoder.layers.1.self_attn", out.decoder_attentions[1]),
        ]
        for side, alone in sides:
            mine = [h for h in heads if h.layer == side and h.sequence == seq]
            want = numbers_by_hand([alone[0].double()])
            assert len(mine) == 4, side
            for h, (sink, entropy, top, share, n) in zip(mine, want, strict=True):
                assert h.sink == pytest.approx(sink, rel=1e-5)
                assert h.entropy == pytest.approx(entropy, rel=1e-5)
                assert (h.top_key, h.queries) == (top, n)
                assert h.top_share == pytest.approx(share, rel=1e-5)
