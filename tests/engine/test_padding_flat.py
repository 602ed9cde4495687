"""A padded batch's padding where the model flattens its tokens (issue 48): OPT reshapes
(batch, tokens, C) to (batch·tokens, C) before fc1/fc2, a Qwen2-MoE block before its shared
expert. Their statistics, --channels, calib's scales and watch's records count the real tokens
only. Oracle: transformers run on each text alone, the layer's tensors kept by a hook of the
test's own and put together."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import hookcli
from hookcli.commands.calib import calib_report
from hookcli.io.recordjson import from_json
from hookcli.options import CalibOptions, InputOptions, ModelOptions, Selection
from hookcli.records import Report
from tests.support.oracles import assert_stats_match

transformers = pytest.importorskip("transformers")

TEXTS = ["Once upon a time there was a model.", "hello", "The cat sat on the mat."]
VOCAB = 320
MODELS: dict[str, tuple[Any, list[str]]] = {
    "opt": (
        lambda: transformers.OPTForCausalLM(
            transformers.OPTConfig(
                vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                pad_token_id=0, bos_token_id=1, eos_token_id=2, dropout=0.0,
                attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
            )
        ),
        ["model.decoder.layers.0.fc1", "model.decoder.layers.1.fc2"],
    ),
    "qwen2_moe": (
        lambda: transformers.Qwen2MoeForCausalLM(
            transformers.Qwen2MoeConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            )
        ),
        # the fused experts module takes every position too, in the mask's order
        ["model.layers.0.mlp.shared_expert.gate_proj",
         "model.layers.1.mlp.shared_expert.down_proj", "model.layers.1.mlp.experts"],
    ),
}  # fmt: skip


def _save(folder: Path, kind: str) -> Path:
    from tests.support.llm import make_tokenizer

    torch.manual_seed(0)
    MODELS[kind][0]().eval().save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=sorted(MODELS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kind = request.param
    return kind, _save(tmp_path_factory.mktemp(kind), kind)


def _alone(folder: Path, layers: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Each layer's input and output over the texts run one by one (no padding), their rows
    put together: what transformers computes at the real tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    seen: dict[str, dict[str, list[torch.Tensor]]] = {n: {"in": [], "out": []} for n in layers}

    def keep(name: str) -> Any:
        def hook(_m: Any, args: Any, out: Any) -> None:
            seen[name]["in"].append(args[0].detach().reshape(-1, args[0].shape[-1]))
            seen[name]["out"].append(out.detach().reshape(-1, out.shape[-1]))

        return hook

    handles = [model.get_submodule(n).register_forward_hook(keep(n)) for n in layers]
    try:
        with torch.no_grad():
            for text in TEXTS:
                model(**tok(text, return_tensors="pt"))
    finally:
        for h in handles:
            h.remove()
    return {n: {k: torch.cat(v) for k, v in d.items()} for n, d in seen.items()}


def test_a_flattened_tensor_counts_the_real_tokens_only(saved: Any) -> None:
    kind, folder = saved
    layers = MODELS[kind][1]
    report = hookcli.inspect(
        f"hf:{folder}", text=TEXTS, device="cpu", layers=layers, channels=True, topk=0
    )
    truth = _alone(folder, layers)
    ids = [len(s.ids) for s in report.input.texts or []]
    assert len(set(ids)) > 1  # a padded batch indeed
    for name in layers:
        call = next(c for c in report.layers if c.name == name)
        pairs = ((call.inputs[0], truth[name]["in"]), (call.outputs[0], truth[name]["out"]))
        for got, want in pairs:
            # the tensor itself is (batch·tokens, C), padding rows among them
            assert got.shape[0] == len(ids) * max(ids) and got.numel == want.numel()
            assert_stats_match(got, want, rtol=1e-5, same_tensor=False)
            assert "padding left out" in str(got.note)
            ch = got.channels
            assert ch is not None and ch.count == [want.shape[0]] * want.shape[1]
            absmax = torch.tensor(ch.absmax, dtype=torch.float64)
            assert torch.allclose(absmax, want.abs().amax(0).double(), rtol=1e-5)
            for m in ch.massive:  # a massive value's index is the row it sits in
                assert m.index[0] < got.shape[0]


def test_calib_scales_of_a_flattened_layer_are_the_real_tokens_whatever_the_batch_size(
    saved: Any, tmp_path: Path
) -> None:
    kind, folder = saved
    # (calib takes a fused experts module's experts one by one: not a flattened layer's scales)
    layers = [n for n in MODELS[kind][1] if not n.endswith(".experts")]
    text_file = tmp_path / "calib.txt"
    text_file.write_text("\n".join(TEXTS) + "\n")
    truth = _alone(folder, layers)
    for size in (1, 3):
        report = calib_report(
            ModelOptions(f"hf:{folder}", device="cpu"),
            Selection(layers=tuple(layers)),
            InputOptions(text_file=str(text_file)),
            CalibOptions(batch_size=size),
        )
        for layer in report.layers:
            want = truth[layer.name]["in"].double()
            assert layer.channels.count == [want.shape[0]] * want.shape[1]
            got = torch.tensor(layer.channels.absmax, dtype=torch.float64)
            assert torch.allclose(got, want.abs().amax(0), rtol=1e-5), (size, layer.name)


def test_watch_leaves_a_training_batchs_padding_out(tmp_path: Path) -> None:
    """A training step on a padded batch (the attention_mask given as Hugging Face models
    take it): the watched fc1 statistics are those of the real tokens."""
    from tests.support.llm import make_tokenizer

    folder = _save(tmp_path / "opt", "opt")
    layer = MODELS["opt"][1][0]
    truth = _alone(folder, [layer])[layer]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.train()
    tok = make_tokenizer()
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with hookcli.watch(model, optimizer=opt, layers=[layer], check=False) as w:
        opt.zero_grad()
        model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels)[
            "loss"
        ].backward()
        opt.step()
        # and positionally, as a plain call passes it
        opt.zero_grad()
        model(enc["input_ids"], enc["attention_mask"], labels=labels)["loss"].backward()
        opt.step()
    assert len(w.records) == 2
    for record in w.records:
        (call,) = record.layers
        assert_stats_match(call.inputs[0], truth["in"], rtol=1e-5, same_tensor=False)
        assert_stats_match(call.outputs[0], truth["out"], rtol=1e-5, same_tensor=False)
        # the output gradient counts the real rows too (padding's are zero, not counted)
        assert call.grad_outputs is not None
        assert call.grad_outputs[0].numel == truth["out"].numel()


def test_a_padded_batch_given_as_input_tensors_leaves_its_padding_out(tmp_path: Path) -> None:
    """`--input input_ids=… --input attention_mask=…` on the command line (a tokenizer's
    padded batch saved as tensors): the statistics are those of the real tokens, as the
    same texts' rows run one by one give them (the padding was counted before)."""
    from tests.support.cli import run
    from tests.support.llm import make_tokenizer

    folder = _save(tmp_path / "opt", "opt")
    layer = MODELS["opt"][1][0]
    truth = _alone(folder, [layer])[layer]
    enc = make_tokenizer()(TEXTS, return_tensors="pt", padding=True)
    assert bool((enc["attention_mask"] == 0).any())
    torch.save(enc["input_ids"], tmp_path / "ids.pt")
    torch.save(enc["attention_mask"], tmp_path / "mask.pt")
    res = run(
        "inspect", f"hf:{folder}", "-l", layer, "-f", "json",
        "--input", f"input_ids={tmp_path / 'ids.pt'}",
        "--input", f"attention_mask={tmp_path / 'mask.pt'}",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    (call,) = from_json(Report, json.loads(res.stdout)).layers
    assert_stats_match(call.inputs[0], truth["in"], rtol=1e-5, same_tensor=False)
    assert_stats_match(call.outputs[0], truth["out"], rtol=1e-5, same_tensor=False)


def _collector(mask: torch.Tensor) -> Any:
    from hookcli.engine.stats import StatsCollector

    c = StatsCollector(backend="torch")
    c.set_token_mask(mask)
    c.channels = lambda _context, shape: len(shape) - 1
    return c


LEFT = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])


def test_a_parameter_or_an_unnamed_tensor_of_batch_x_tokens_rows_is_measured_whole() -> None:
    """FLAT is read by size: a weight (or its gradient) of batch·tokens rows, a tensor measured
    outside a layer call, and a routed expert's input are not positions."""
    w = torch.randn(10, 16)
    c = _collector(LEFT)
    c.context = ("fc1", 0, "in")
    as_input = c.add(w, "in[0]")
    as_weight = c.add(w.clone(), "fc1.weight", positions=False)
    c.context = None
    outside = c.add(w.clone(), "x")
    c.context = ("model.layers.0.mlp.experts.3.w1", 0, "in")
    expert = c.add(w.clone(), "in[0]")
    c.finalize()
    real = w[LEFT.reshape(-1)]
    assert as_input.numel == real.numel()
    assert as_input.norm == pytest.approx(float(real.double().norm()), rel=1e-9)
    for whole in (as_weight, outside, expert):
        assert whole.numel == w.numel()
        assert whole.norm == pytest.approx(float(w.double().norm()), rel=1e-9)
        assert "padding" not in str(whole.note)


def test_a_tensor_seen_as_positions_then_where_its_rows_are_not_is_measured_again() -> None:
    """One tensor handed to a layer that takes positions (a router) and to a routed expert:
    each sight's statistics over the rows it counts, never one's numbers with the other's
    count."""
    w = torch.randn(10, 16)
    c = _collector(LEFT)
    c.context = ("model.layers.0.mlp.gate", 0, "in")
    router = c.add(w, "in[0]")
    c.context = ("model.layers.0.mlp.experts.3.w1", 0, "in")
    expert = c.add(w, "in[0]")
    c.context = ("model.layers.0.mlp.experts", 0, "in")
    fused = c.add(w, "in[0]")
    c.finalize()
    real = w[LEFT.reshape(-1)].double()
    for positions in (router, fused):
        assert positions.numel == real.numel()
        assert positions.mean == pytest.approx(float(real.mean()), rel=1e-9)
    assert expert.numel == w.numel()
    assert expert.mean == pytest.approx(float(w.double().mean()), rel=1e-9)


@pytest.mark.parametrize("flat", [False, True])
def test_a_massive_activation_is_named_by_its_position_in_its_own_text(flat: bool) -> None:
    """Left padding: sequence 0's column 3 is its second token (position 1)."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8) * 0.1
    x[0, 3, 2] = 5000.0
    c = _collector(LEFT)
    c.context = ("fc1", 0, "out")
    stats = c.add(x.reshape(10, 8) if flat else x, "out")
    c.finalize()
    assert stats.channels is not None
    (m,) = stats.channels.massive
    assert (m.sequence, m.position, m.channel) == (0, 1, 2)
    assert m.index == ([3, 2] if flat else [0, 3, 2])  # the tensor's own index
