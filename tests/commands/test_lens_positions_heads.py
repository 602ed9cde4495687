"""Issue 48, items 4, 7 and 8: numbers that were wrong with nothing on screen saying so.

- The logit lens applies what the model applies around its unembedding (Gemma 2's final soft
  cap, T5's d_model**-0.5 scale of its tied embeddings), so the last block's lens is the
  model's own logits; what it cannot tell, it says.
- A left-padded batch: --per-token rows, the lens and the predictions are at each token's own
  position in its text, and the input line gives each sequence's length in order.
- --heads gives each sequence of a batch its own numbers.

Oracle: transformers on each text alone (no padding), the numbers taken by hand."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tests.support.attention import numbers_by_hand  # noqa: E402
from tests.support.llm import LINES, VOCAB, llama_config, make_tokenizer, save  # noqa: E402

runner = CliRunner()
CAP = 0.3  # small beside the tiny model's logits (|x| ~ 0.4): the cap changes them by ~20%


def _saved(folder: Path, model: Any) -> Path:
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def _left_padded(folder: Path) -> Path:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["padding_side"] = "left"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _alone(folder: Path, text: str, auto: Any = None) -> tuple[Any, Any]:
    """transformers' model of a folder, and one text's encoding, alone (unpadded)."""
    model = (auto or transformers.AutoModelForCausalLM).from_pretrained(folder).eval()
    enc = transformers.AutoTokenizer.from_pretrained(folder)(text, return_tensors="pt")
    return model, enc


def _block_outputs(model: Any, blocks: Any, **inputs: Any) -> tuple[list[torch.Tensor], Any]:
    """Each block's output in one run of the model, and the run's output."""
    seen: list[torch.Tensor] = []
    handles = [
        b.register_forward_hook(
            lambda _m, _i, o: seen.append((o[0] if isinstance(o, tuple) else o).detach())
        )
        for b in blocks
    ]
    try:
        with torch.no_grad():
            out = model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return seen, out


def _topk(logits: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    want = torch.softmax(logits.double(), -1).topk(k)
    return want.indices.tolist(), want.values.tolist()


# ---------------------------------------------------------------- item 4: around the unembedding


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        final_logit_softcapping=CAP, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.Gemma2ForCausalLM(config).eval()
    return _saved(tmp_path_factory.mktemp("gemma2"), model)


def test_the_lens_applies_gemma2s_final_soft_cap(gemma2: Path) -> None:
    """Every block's lens goes through the model's soft cap; the last block's is the model's
    own logits of each text alone."""
    texts = [LINES[0], "hello"]
    report = hookcli.lens(f"hf:{gemma2}", text=texts, device="cpu", topk=3)
    assert report.applied == [
        f"soft cap {CAP:g}*tanh(x/{CAP:g}) (config.final_logit_softcapping) after lm_head"
    ]
    assert report.last_vs_logits == 0.0
    assert not any("differs" in n for n in report.notes), report.notes
    for seq, text in enumerate(texts):
        model, enc = _alone(gemma2, text)
        outputs, out = _block_outputs(model, model.model.layers, **enc)
        with torch.no_grad():  # each block by hand: final norm, lm_head, the cap
            lens = [torch.tanh(model.lm_head(model.model.norm(h)) / CAP) * CAP for h in outputs]
        assert lens[-1] == pytest.approx(out.logits, rel=1e-5, abs=1e-7)  # the oracle itself
        cells = [c for c in report.lens if c.sequence == seq]
        assert len(cells) == 2 * enc.input_ids.shape[1]
        for c in cells:
            ids, probs = _topk(lens[int(c.layer.rsplit(".", 1)[1])][0, c.position], 3)
            assert [t.index for t in c.top] == ids
            assert [t.prob for t in c.top] == pytest.approx(probs, rel=1e-5)
        last = [c for c in cells if c.layer == "model.layers.1"]
        for c in last:  # the last block's lens is the model's next-token distribution
            ids, probs = _topk(out.logits[0, c.position], 3)
            assert [t.index for t in c.top] == ids
            assert [t.prob for t in c.top] == pytest.approx(probs, rel=1e-5)
    table = runner.invoke(app, ["lens", f"hf:{gemma2}", "--text", LINES[0]])
    assert table.exit_code == 0, table.stderr
    assert "as the model does: soft cap 0.3*tanh(x/0.3)" in table.stdout
    assert "last block's lens vs the model's logits: equal" in table.stdout


@pytest.mark.parametrize("tied", [True, False])
def test_the_lens_applies_t5s_scale_of_its_tied_embeddings(tmp_path: Path, tied: bool) -> None:
    """T5 scales the decoder's output by d_model**-0.5 before lm_head where its embeddings
    are tied (T5 v1.0); v1.1 (untied) does not: the lens does as the model does."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=2, tie_word_embeddings=tied,
    )  # fmt: skip
    folder = _saved(tmp_path / "t5", transformers.T5ForConditionalGeneration(config).eval())
    report = hookcli.lens(f"hf:{folder}", text=LINES[0], device="cpu", topk=4)
    model, enc = _alone(folder, LINES[0], transformers.T5ForConditionalGeneration)
    outputs, out = _block_outputs(
        model, model.decoder.block, **enc, decoder_input_ids=torch.tensor([[0]])
    )
    scale = 16**-0.5 if tied else 1.0
    with torch.no_grad():
        lens = [model.lm_head(model.decoder.final_layer_norm(h) * scale) for h in outputs]
    assert lens[-1] == pytest.approx(out.logits, rel=1e-5, abs=1e-7)  # the oracle itself
    if tied:
        assert len(report.applied) == 1 and report.applied[0].startswith("× d_model**-0.5")
        assert report.applied[0].endswith("before lm_head")
    else:
        assert report.applied == []
    assert report.last_vs_logits == 0.0
    assert [c.layer for c in report.lens] == ["decoder.block.0", "decoder.block.1"]
    for c, want in zip(report.lens, lens, strict=True):
        ids, probs = _topk(want[0, 0], 4)
        assert [t.index for t in c.top] == ids
        assert [t.prob for t in c.top] == pytest.approx(probs, rel=1e-5)
    ids, probs = _topk(out.logits[0, 0], 4)
    assert [t.index for t in report.lens[-1].top] == ids


def test_what_the_lens_cannot_tell_it_says(tmp_path: Path) -> None:
    from hookcli.commands.lens import around_unembedding

    folder = save(tmp_path / "llama", "llama")
    inner = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[5, 9, 30, 41]])
    with torch.no_grad():
        out = inner(input_ids=ids, output_hidden_states=True)
        z = out.logits
        normed = out.hidden_states[-1]
    # the model's own path: nothing applied; a cube is none of what can be told
    same = around_unembedding(inner, normed=normed, x=normed, z=z, logits=z)
    assert (same.said, same.unknown) == ([], [])
    cubed = around_unembedding(inner, normed=normed, x=normed, z=z, logits=z**3)
    assert cubed.said == [] and "cannot tell what the model applies" in cubed.unknown[0]
    # a scale no config number is: applied, measured, and said so
    scaled = around_unembedding(
        inner, normed=normed, x=normed, z=z, logits=z * 1.7, unembed="lm_head"
    )
    assert scaled.said == ["× 1.7 (measured: no config number of the model is it) after lm_head"]
    assert torch.equal(scaled.after(z), z * 1.7)
    # and a report whose last block's lens differs says by how much, and why

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config()).eval()
    plain = model.forward

    @functools.wraps(plain)
    def cubed(*args: Any, **kw: Any) -> Any:  # nothing in the model says so
        out = plain(*args, **kw)
        out.logits = out.logits**3
        return out

    model.forward = cubed
    report = hookcli.lens(model, input_specs=[f"input_ids=randint:3:{VOCAB}:1x4"], device="cpu")
    assert report.last_vs_logits is not None and report.last_vs_logits > 0
    (note,) = [n for n in report.notes if "differs from the model's logits" in n]
    assert "cannot tell what the model applies after it" in note


# ---------------------------------------------------------------- item 7: left padding


def test_a_left_padded_batch_gives_each_token_its_own_position(tmp_path: Path) -> None:
    """--per-token rows, the lens and the predictions of a left-padded batch are at each
    token's position in its own text, as each text run alone gives them; the input line
    lists each sequence's length in order."""
    folder = _left_padded(save(tmp_path / "left", "llama"))
    texts = [LINES[0], "hello"]  # the longer first: sorted lengths would read otherwise
    layer = "model.layers.0"
    report = hookcli.inspect(
        f"hf:{folder}", text=texts, device="cpu", layers=[layer], per_token=True, topk=2
    )
    lens = hookcli.lens(f"hf:{folder}", text=texts, device="cpu", topk=2)
    assert report.input.texts is not None
    lengths = []
    rows = report.layers[0].outputs[0].per_token
    assert rows is not None
    assert report.predictions is not None
    for seq, text in enumerate(texts):
        model, enc = _alone(folder, text)
        n = enc.input_ids.shape[1]
        lengths.append(n)
        outputs, out = _block_outputs(model, model.model.layers, **enc)
        mine = [r for r in rows if r.sequence == seq]
        assert [r.position for r in mine] == list(range(n))
        for r in mine:
            x = outputs[0][0, r.position].double()
            assert r.id == int(enc.input_ids[0, r.position])
            assert r.token == report.input.texts[seq].tokens[r.position]
            assert r.norm == pytest.approx(float(x.norm()), rel=1e-5)
            assert r.channel == int(x.abs().argmax())
        cells = [c for c in lens.lens if c.sequence == seq and c.layer == "model.layers.1"]
        assert [c.position for c in cells] == list(range(n))
        for c in cells:
            ids, probs = _topk(out.logits[0, c.position], 2)
            assert [t.index for t in c.top] == ids
            assert [t.prob for t in c.top] == pytest.approx(probs, rel=1e-5)
        ids, probs = _topk(out.logits[0, -1], 2)
        got = [p for p in report.predictions if p.image == seq]
        assert [p.index for p in got] == ids
    assert lengths[0] > lengths[1] > 0
    assert f"padded on the left: {lengths[0]}, {lengths[1]} real" in report.input.description
    where = f"after each sequence's last real token (positions {lengths[0] - 1}, {lengths[1] - 1})"
    assert where in str(report.prediction_note)
    one = hookcli.inspect(f"hf:{folder}", text=texts, device="cpu", layers=[layer], position=0)
    assert "after real token 0 (position 0, 0)" in str(one.prediction_note)
    table = runner.invoke(app, ["lens", f"hf:{folder}", "--text", texts[0], "--text", texts[1]])
    assert table.exit_code == 0, table.stderr
    assert "| 0 'hello'" in table.stdout.rsplit("sequence 1", 1)[1]  # its column, from 0


# ---------------------------------------------------------------- item 8: heads per sequence


@pytest.mark.parametrize("side", ["right", "left"])
def test_heads_of_a_batch_are_each_sequences_own(tmp_path: Path, side: str) -> None:
    """--heads on a padded batch: one row per call, sequence and head, each equal to that
    sequence run alone through transformers' eager attention."""
    folder = save(tmp_path / side, "llama")
    if side == "left":
        _left_padded(folder)
    texts = [LINES[3], "hello world", LINES[0]]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager"
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    alone = []
    for t in texts:
        with torch.no_grad():
            out = model(**tok(t, return_tensors="pt"), output_attentions=True)
        alone.append([a[0].double() for a in out.attentions])
    report = hookcli.inspect(f"hf:{folder}", text=texts, device="cpu", heads=True, topk=0)
    assert report.heads is not None and len(report.heads) == 2 * 3 * 4
    assert ("padded on the left" in report.input.description) == (side == "left")
    for layer in range(2):
        got = [h for h in report.heads if h.layer == f"model.layers.{layer}"]
        assert [(h.sequence, h.head) for h in got] == [(s, h) for s in range(3) for h in range(4)]
        for seq in range(3):
            want = numbers_by_hand([alone[seq][layer]])
            mine = [h for h in got if h.sequence == seq]
            for h, (sink, entropy, top, share, n) in zip(mine, want, strict=True):
                assert h.sink == pytest.approx(sink, rel=1e-5)
                assert h.entropy == pytest.approx(entropy, rel=1e-5)
                assert (h.top_key, h.queries) == (top, n)
                assert h.top_share == pytest.approx(share, rel=1e-5)
    if side == "right":
        return
    args = ["inspect", f"hf:{folder}", "--text", texts[0], "--text", texts[1], "--heads"]
    table = runner.invoke(app, [*args, "-l", "model.norm", "--topk", "0"])
    assert table.exit_code == 0, table.stderr
    assert "| seq |" in table.stdout.replace("  ", " ")
    as_json = runner.invoke(app, [*args, "-l", "model.norm", "-f", "json"])
    heads = json.loads(as_json.stdout)["heads"]
    assert {h["sequence"] for h in heads} == {0, 1}
    check = runner.invoke(app, ["check", *args[1:], "--max-sink", "0.01"])
    assert check.exit_code == 1, check.stderr
    assert "model.layers.0 call 0 head 0 of sequence 1: sink" in check.stdout


def test_merged_reports_number_each_parts_sequences_after_the_last() -> None:
    from hookcli.engine.aggregate import merge_heads

    def row(call: int, seq: int, head: int, sink: float) -> dict[str, Any]:
        where = {"layer": "b", "module": "b.attn", "call": call, "sequence": seq, "head": head}
        return {**where, "sink": sink, "entropy": 1.0, "top_key": 0, "top_share": sink,
                "queries": 3}  # fmt: skip

    one = [row(0, s, h, 0.1 * s + h) for s in range(2) for h in range(2)]
    two = [row(0, 0, h, 0.5 + h) for h in range(2)]
    merged = merge_heads([one, two])
    assert [(h["sequence"], h["head"], h["sink"]) for h in merged] == [
        (0, 0, 0.0), (0, 1, 1.0), (1, 0, 0.1), (1, 1, 1.1), (2, 0, 0.5), (2, 1, 1.5),
    ]  # fmt: skip
    # a report saved before heads were per sequence still reads, its rows pooled as then
    from hookcli.io.recordjson import from_json
    from hookcli.records import HeadStats

    old = [{k: v for k, v in h.items() if k != "sequence"} for h in two]
    assert from_json(HeadStats, old[0]).sequence is None
    pooled = merge_heads([old, old])
    assert [(h["head"], h["queries"]) for h in pooled] == [(0, 6), (1, 6)]
