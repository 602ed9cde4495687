"""--heads (issue 36): every attention head's sink, mean entropy and most-attended key, and
check's rules on them. Oracles: softmax(QK^T/sqrt(d)) by hand for torch's MultiheadAttention,
and transformers' own eager `attentions` of each sequence run alone (no padding), the numbers
taken by plain Python loops."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app
from tests.support.attention import numbers_by_hand
from tests.support.oracles import hooks_left

runner = CliRunner()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x, x, x, need_weights=False)[0]


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_heads_are_softmax_qk_by_hand_for_multihead_attention() -> None:
    model = Encoder().eval()
    x = torch.randn(2, 6, 8) * 3
    report = hookcli.inspect(model, x, heads=True)
    assert hooks_left(model) == 0
    assert report.heads is not None and len(report.heads) == 8  # 2 blocks x 2 sequences x 2 heads
    h_in = x
    for i, block in enumerate(model.blocks):
        attn = block.attn
        w, bias = attn.in_proj_weight.detach(), attn.in_proj_bias.detach()
        q = (h_in @ w[:8].T + bias[:8]).view(2, 6, 2, 4).transpose(1, 2)
        k = (h_in @ w[8:16].T + bias[8:16]).view(2, 6, 2, 4).transpose(1, 2)
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(4), dim=-1).double()
        want = [*numbers_by_hand([probs[0]]), *numbers_by_hand([probs[1]])]  # each its own
        got = [h for h in report.heads if h.layer == f"blocks.{i}"]
        assert [(h.sequence, h.head) for h in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for h, (sink, entropy, top, share, n) in zip(got, want, strict=True):
            assert h.sink == pytest.approx(sink, rel=1e-5)
            assert h.entropy == pytest.approx(entropy, rel=1e-5)
            assert (h.top_key, h.queries) == (top, n)
            assert h.top_share == pytest.approx(share, rel=1e-5)
        with torch.no_grad():
            h_in = block(h_in)


def test_a_sequence_first_multihead_attention_has_each_sequences_heads() -> None:
    """torch's default nn.MultiheadAttention takes (tokens, batch, features): its calls were
    all left out as "not over the input's sequences" (the input's first dimension taken as
    the batch). Oracle: softmax(QKᵀ/√d) by hand, sequence by sequence."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(8, 2)  # batch_first=False
    x = torch.randn(5, 3, 8)  # 5 tokens, 3 sequences
    report = hookcli.inspect(SeqFirst(attn).eval(), x, heads=True)
    assert report.heads is not None and len(report.heads) == 6  # 3 sequences x 2 heads
    w, bias = attn.in_proj_weight.detach(), attn.in_proj_bias.detach()
    for seq in range(3):
        h = x[:, seq]  # (tokens, features)
        q = (h @ w[:8].T + bias[:8]).view(5, 2, 4).transpose(0, 1)
        k = (h @ w[8:16].T + bias[8:16]).view(5, 2, 4).transpose(0, 1)
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(4), dim=-1).double()
        want = numbers_by_hand([probs])
        got = [r for r in report.heads if r.sequence == seq]
        for r, (sink, entropy, top, share, n) in zip(got, want, strict=True):
            assert r.sink == pytest.approx(sink, rel=1e-5)
            assert r.entropy == pytest.approx(entropy, rel=1e-5)
            assert (r.top_key, r.queries) == (top, n)
            assert r.top_share == pytest.approx(share, rel=1e-5)


def test_a_batch_first_input_made_sequence_first_inside_keeps_its_batch() -> None:
    """CLIP and DETR transpose a batch-first input before a sequence-first MultiheadAttention:
    the batch is the input's first dimension there (the second, 5 tokens here, left every
    call out)."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(8, 2)
    x = torch.randn(3, 5, 8)  # 3 sequences, batch first
    report = hookcli.inspect(Transposed(attn).eval(), x, heads=True)
    assert report.heads is not None and len(report.heads) == 6
    w, bias = attn.in_proj_weight.detach(), attn.in_proj_bias.detach()
    q = (x[1] @ w[:8].T + bias[:8]).view(5, 2, 4).transpose(0, 1)
    k = (x[1] @ w[8:16].T + bias[8:16]).view(5, 2, 4).transpose(0, 1)
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(4), dim=-1).double()
    (sink, entropy, _top, _share, _n), _ = numbers_by_hand([probs])
    got = next(r for r in report.heads if r.sequence == 1 and r.head == 0)
    assert got.sink == pytest.approx(sink, rel=1e-5)
    assert got.entropy == pytest.approx(entropy, rel=1e-5)


class Transposed(nn.Module):
    def __init__(self, attn: nn.MultiheadAttention) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.transpose(0, 1)  # (tokens, batch, features)
        return self.attn(y, y, y)[0].transpose(0, 1)


class SeqFirst(nn.Module):
    def __init__(self, attn: nn.MultiheadAttention) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x)[0]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from tests.support.llm import save

    return save(tmp_path_factory.mktemp("heads_llama"), "llama")


# a padded batch, either side, each sequence's own heads as if run alone:
# tests/commands/test_lens_positions_heads.py::test_heads_of_a_batch_are_each_sequences_own


def test_check_names_dormant_and_collapsed_heads(llama: Path) -> None:
    r = runner.invoke(app, ["check", f"hf:{llama}", "--text", "The cat sat on the mat.",
                            "--max-sink", "0.01", "--min-entropy", "5"])  # fmt: skip
    assert r.exit_code == 1, (r.stdout, r.stderr)
    assert "dormant-heads: 8 of 8 heads with sink above 0.01" in r.stdout
    assert "collapsed-heads: 8 of 8 heads with entropy below 5" in r.stdout
    assert "model.layers.0 call 0 head 0: sink" in r.stdout
    ok = runner.invoke(app, ["check", f"hf:{llama}", "--text", "The cat sat on the mat.",
                             "--max-sink", "0.99", "--min-entropy", "0"])  # fmt: skip
    assert ok.exit_code == 0, (ok.stdout, ok.stderr)
    bad = runner.invoke(app, ["check", f"hf:{llama}", "--text", "x", "--max-sink", "2"])
    assert bad.exit_code == 2 and "--max-sink" in bad.stderr
    none = runner.invoke(app, ["inspect", "tests/support/models.py:MassiveAt", "--input",
                               "randn:1x6x16", "--heads"])  # fmt: skip
    assert none.exit_code == 2 and "no attention module" in none.stderr


def test_attn_json_gives_every_heads_numbers(llama: Path, tmp_path: Path) -> None:
    text = "The cat sat on the mat."
    out = tmp_path / "heads.json"
    r = runner.invoke(app, ["attn", f"hf:{llama}", "--text", text, "-o", str(out)])
    assert r.exit_code == 0, (r.stdout, r.stderr)
    data = json.loads(out.read_text())
    report = hookcli.inspect(f"hf:{llama}", text=text, device="cpu", heads=True, topk=0)
    assert report.heads is not None
    assert [(h["layer"], h["head"]) for h in data["heads"]] == [
        (h.layer, h.head) for h in report.heads
    ]
    assert [h["sink"] for h in data["heads"]] == pytest.approx([h.sink for h in report.heads])
    bad = runner.invoke(app, ["attn", f"hf:{llama}", "--text", text, "-f", "csv"])
    assert bad.exit_code == 2 and "-f json" in bad.stderr


def test_a_query_row_left_out_never_poisons_the_numbers() -> None:
    """A padded query row of NaN (softmax over all -inf) is left out, not multiplied by 0."""
    from hookcli.engine.heads import head_numbers

    p = torch.softmax(torch.randn(1, 2, 4, 4), dim=-1)
    p[0, :, 3] = float("nan")
    real = torch.tensor([[True, True, True, False]])
    got = head_numbers(p, real)
    assert got.shape == (1, 2, 5) and torch.isfinite(got).all()
    want = numbers_by_hand([p[0, :, :3, :].double()])  # queries 0-2, every key
    for row, (sink, entropy, top, share, n) in zip(got[0].tolist(), want, strict=True):
        assert row[0] == pytest.approx(sink) and row[1] == pytest.approx(entropy)
        assert (int(row[2]), int(row[4])) == (top, n) and row[3] == pytest.approx(share)


def test_attn_json_keeps_the_block_asked_and_refuses_drawing_options(llama: Path) -> None:
    args = ["attn", f"hf:{llama}", "--text", "The cat sat", "-f", "json"]
    r = runner.invoke(app, [*args, "-l", "model.layers.1"])
    assert r.exit_code == 0, (r.stdout, r.stderr)
    assert {h["layer"] for h in json.loads(r.stdout)["heads"]} == {"model.layers.1"}
    bad = runner.invoke(app, [*args, "--queries", "0:2"])
    assert bad.exit_code == 2 and "--queries is for the drawing" in bad.stderr
