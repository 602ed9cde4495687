"""calib -o FILE.imatrix (commands/imatrix.py): llama.cpp's importance matrix, read back by the
`gguf` package's reader, against Σx² per input channel of each Linear summed by hand over the
corpus, one text at a time and unpadded, in float64."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from hookcli.cli import app
from tests.support.llm import LINES, save

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
runner = CliRunner()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("llama"), "llama")


def _by_hand(folder: Path) -> tuple[dict[str, np.ndarray], int]:
    """Σx² of each Linear's input per channel over every token of every text, and the tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    sums: dict[str, np.ndarray] = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):

            def pre(_m: torch.nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
                x = args[0].detach().double().reshape(-1, args[0].shape[-1])
                sums[name] = sums.get(name, 0) + (x * x).sum(0).numpy()

            handles.append(m.register_forward_pre_hook(pre))
    tokens = 0
    with torch.no_grad():
        for line in LINES:  # one text at a time: no padding to leave out
            enc = tok(line, return_tensors="pt")
            tokens += enc["input_ids"].shape[1]
            model(**enc)
    for h in handles:
        h.remove()
    return sums, tokens


def test_the_imatrix_read_back_is_the_sum_of_squares_by_hand(llama: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(LINES) + "\n")
    out = tmp_path / "model.imatrix"
    r = runner.invoke(
        app,
        ["calib", f"hf:{llama}", "--text-file", str(corpus), "--batch-size", "3", "-o", str(out)],
    )
    assert r.exit_code == 0, r.stderr
    assert "wrote" in r.stderr and "15 weights" in r.stderr
    reader = gguf.GGUFReader(str(out))
    fields = {k: reader.fields[k].contents() for k in reader.fields}
    assert fields["general.type"] == "imatrix"
    assert fields["imatrix.datasets"] == [str(corpus)]
    assert fields["imatrix.chunk_count"] == len(LINES)
    tensors = {t.name: t for t in reader.tensors}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    want, tokens = _by_hand(llama)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert len(tensors) == 2 * len(want)
    for hf_name, sums in want.items():
        base = f"{names.get_name(hf_name)}.weight"
        got = tensors[f"{base}.in_sum2"]
        assert [int(d) for d in got.shape] == [len(sums), 1]  # ne: columns, one matrix
        np.testing.assert_allclose(np.asarray(got.data).reshape(-1), sums, rtol=1e-5)
        counts = tensors[f"{base}.counts"]
        assert [int(d) for d in counts.shape] == [1, 1]
        assert float(np.asarray(counts.data).reshape(-1)[0]) == tokens
    assert "blk.0.attn_q.weight.in_sum2" in tensors and "output.weight.in_sum2" in tensors


def test_an_imatrix_of_a_model_without_gguf_names_is_one_line(tmp_path: Path) -> None:
    out = tmp_path / "m.imatrix"
    r = runner.invoke(app, ["calib", "resnet18", "sample_images/cat.jpeg", "-o", str(out)])
    assert r.exit_code == 2, r.stderr
    assert "GGUF" in r.stderr and "safetensors" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_a_mixture_of_experts_writes_one_matrix_per_expert(tmp_path: Path) -> None:
    """A tiny Mixtral (transformers 5's fused experts): blk.N.ffn_gate_exps and ffn_up_exps
    hold, per expert, Σx² of the block's input over the tokens routed to it (by hand: the
    router's top-k, text by text), with those tokens as its count; ffn_down_exps the
    per-expert sums calib reports (-f json: count · (std² + mean²))."""
    import json

    folder = save(tmp_path / "mixtral", "mixtral")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(LINES) + "\n")
    out = tmp_path / "moe.imatrix"
    r = runner.invoke(app, ["calib", f"hf:{folder}", "--text-file", str(corpus), "-o", str(out)])
    assert r.exit_code == 0, r.stderr
    tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(out)).tensors}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    experts, k = model.config.num_local_experts, model.config.num_experts_per_tok
    sums = {b: np.zeros((experts, model.config.hidden_size)) for b in range(2)}
    counts = {b: np.zeros(experts) for b in range(2)}
    handles = []
    for b, layer in enumerate(model.model.layers):

        def pre(m: torch.nn.Module, args: tuple[torch.Tensor, ...], b: int = b) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            logits = torch.nn.functional.linear(x, m.gate.weight)  # the router, by hand
            chosen = logits.float().softmax(-1).topk(k, dim=-1).indices
            for e in range(experts):
                rows = x[(chosen == e).any(-1)].double()
                sums[b][e] += (rows * rows).sum(0).numpy()
                counts[b][e] += rows.shape[0]

        handles.append(layer.mlp.register_forward_pre_hook(pre))
    with torch.no_grad():
        for line in LINES:
            model(**tok(line, return_tensors="pt"))
    for h in handles:
        h.remove()
    for b in range(2):
        for proj in ("gate", "up"):
            got = tensors[f"blk.{b}.ffn_{proj}_exps.weight.in_sum2"]
            assert got.shape == (experts, model.config.hidden_size)
            np.testing.assert_allclose(got, sums[b], rtol=1e-5)
            np.testing.assert_array_equal(
                tensors[f"blk.{b}.ffn_{proj}_exps.weight.counts"].reshape(-1), counts[b]
            )
    report = json.loads(
        runner.invoke(
            app, ["calib", f"hf:{folder}", "--text-file", str(corpus), "-f", "json"]
        ).stdout
    )
    down = tensors["blk.0.ffn_down_exps.weight.in_sum2"]
    checked = 0
    for layer in report["layers"]:
        if layer["name"].startswith("model.layers.0.mlp.experts.") and layer["name"].endswith(
            ".down_proj"
        ):
            e = int(layer["name"].split(".")[-2])
            ch = layer["channels"]
            stats = zip(ch["count"], ch["mean"], ch["std"], strict=True)
            want = [n * (s * s + m * m) for n, m, s in stats]
            np.testing.assert_allclose(down[e], want, rtol=1e-6)
            checked += 1
    assert checked == int((counts[0] > 0).sum()) > 0
