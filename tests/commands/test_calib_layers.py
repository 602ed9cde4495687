"""calib over every Linear-like layer (issue 48): nn.Linear subclasses (Falcon's FalconLinear)
and the routed experts of fused MoE blocks (transformers 5 keeps them as 3-D parameters), each
expert over the tokens routed to it; a selected layer calib cannot read is listed, never
dropped. Oracles: transformers run on each text alone — every Linear's input kept by a hook of
the test's own; each expert's inputs read where transformers' eager experts implementation
calls F.linear on that expert's slice of the weights (a TorchFunctionMode of the test's own)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.commands.calib import calib_report
from hookcli.options import CalibOptions, InputOptions, ModelOptions, Selection

transformers = pytest.importorskip("transformers")
runner = CliRunner()
TEXTS = ["Once upon a time there was a model.", "hello", "The cat sat on the mat.", "a dog"]
VOCAB = 320
SMALL = {
    "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
MOE = {
    **SMALL, "intermediate_size": 48, "num_key_value_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip
MODELS: dict[str, Any] = {
    "falcon": lambda: transformers.FalconForCausalLM(
        transformers.FalconConfig(**SMALL, new_decoder_architecture=True, num_kv_heads=2)
    ),
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**MOE, num_local_experts=4, num_experts_per_tok=2)
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            **MOE,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
        )
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **MOE, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8
        )
    ),
}


def _save(folder: Path, kind: str) -> Path:
    from tests.support.llm import make_tokenizer

    torch.manual_seed(0)
    MODELS[kind]().eval().save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


class _ExpertSpy(TorchFunctionMode):
    """Keeps the input of every F.linear whose weight is one expert's slice of a 3-D
    parameter: (experts module, projection, expert) → inputs."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.params = {
            p.untyped_storage().data_ptr(): (name.rsplit(".", 1), p)
            for name, p in model.named_parameters()
            if p.dim() == 3
        }
        self.seen: dict[str, list[torch.Tensor]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            w = args[1]
            found = self.params.get(w.untyped_storage().data_ptr())
            if found is not None:
                (owner, projection), p = found
                e = (w.storage_offset() - p.storage_offset()) // p.stride(0)
                key = f"{owner}.{e}.{projection}"
                self.seen.setdefault(key, []).append(args[0].detach().clone())
        return func(*args, **kwargs)


def _inputs_alone(folder: Path) -> dict[str, torch.Tensor]:
    """Every Linear's and every expert's input over the texts run one by one, rows together."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, experts_implementation="eager"
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [
        m.register_forward_hook(
            lambda _m, a, _o, n=n: seen.setdefault(n, []).append(a[0].detach().clone())
        )
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    spy = _ExpertSpy(model)
    try:
        with torch.no_grad(), spy:
            for t in TEXTS:
                model(**tok(t, return_tensors="pt"))
    finally:
        for h in handles:
            h.remove()
    seen.update(spy.seen)
    return {k: torch.cat([x.reshape(-1, x.shape[-1]) for x in v]).double() for k, v in seen.items()}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_every_linear_like_layer_and_every_expert_is_calibrated(kind: str, tmp_path: Path) -> None:
    folder = _save(tmp_path / kind, kind)
    text_file = tmp_path / "calib.txt"
    text_file.write_text("\n".join(TEXTS) + "\n")
    report = calib_report(
        ModelOptions(f"hf:{folder}", device="cpu"),
        Selection(),
        InputOptions(text_file=str(text_file)),
        CalibOptions(batch_size=3),
    )
    truth = _inputs_alone(folder)
    got = {layer.name: layer for layer in report.layers}
    skipped = {k.name for k in report.skipped}
    # every Linear (subclasses too) and every expert projection the oracle saw: calibrated
    assert set(truth) <= set(got), sorted(set(truth) - set(got))
    # nothing else calibrated but what ran, and what was not calibrated is listed
    assert set(got) <= set(truth) | skipped
    for name, x in truth.items():
        ch = got[name].channels
        assert ch.count == [x.shape[0]] * x.shape[1], name
        absmax = torch.tensor(ch.absmax, dtype=torch.float64)
        assert torch.allclose(absmax, x.abs().amax(0), rtol=1e-5, atol=1e-7), name
        assert torch.allclose(torch.tensor(ch.min, dtype=torch.float64), x.amin(0), atol=1e-6)
    if kind == "falcon":
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        subclassed = [
            n for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear
        ]  # fmt: skip
        assert len(subclassed) >= 8 and set(subclassed) <= set(got)
    else:
        experts = [n for n in got if ".experts." in n]
        assert len(experts) == 2 * 2 * 4 - len([s for s in skipped if ".experts." in s])
        # an expert's up projection smoothed against its own slice of the weights
        name = next(n for n in experts if n.endswith("gate_up_proj"))
        assert got[name].weight_ratio is not None


def test_an_expert_no_token_reached_and_a_layer_that_never_ran_are_listed(
    tmp_path: Path,
) -> None:
    folder = _save(tmp_path / "mixtral", "mixtral")
    out = tmp_path / "scales.safetensors"
    r = runner.invoke(app, ["calib", f"hf:{folder}", "--text", "a", "-o", str(out), "-f", "json"])
    assert r.exit_code == 0, (r.stdout, r.stderr)
    data = json.loads(r.stdout)
    # one token (no BOS here), top-2 of 4 experts: two experts per block had no token
    reasons = {k["name"]: k["reason"] for k in data["skipped"]}
    unrouted = [n for n, why in reasons.items() if "no calibration token was routed" in why]
    assert len(unrouted) == 2 * 2 * 2, reasons
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        keys = set(f.keys())
    listed = {k["layer"] for k in json.loads(meta["skipped"])}
    assert listed == set(unrouted)
    assert not listed & keys
    assert "not calibrated" in r.stderr


def test_a_selected_linear_that_never_runs_is_listed(tmp_path: Path) -> None:
    (tmp_path / "net.py").write_text(
        "from torch import nn\n\n\nclass Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.used = nn.Linear(4, 4)\n        self.spare = nn.Linear(4, 4)\n\n"
        "    def forward(self, x):\n        return self.used(x)\n"
    )
    report = calib_report(
        ModelOptions(f"{tmp_path / 'net.py'}:Net", device="cpu"),
        Selection(),
        InputOptions(specs=("randn:2x4",)),
    )
    assert [layer.name for layer in report.layers] == ["used"]
    assert [(k.name, k.reason) for k in report.skipped] == [
        ("spare", "it never ran on the calibration data")
    ]


def test_inspect_channels_reads_each_expert_over_its_real_tokens(tmp_path: Path) -> None:
    """--channels on a fused MoE block: a row per expert projection, its input's channels over
    the real tokens routed to it (a padded batch), as transformers' eager experts see them run
    on each text alone; the tap's own computation is no call of the model."""
    import hookcli

    folder = _save(tmp_path / "mixtral", "mixtral")
    layers = ["model.layers.0.mlp.*"]
    plain = hookcli.inspect(f"hf:{folder}", text=TEXTS, device="cpu", layers=layers, topk=0)
    report = hookcli.inspect(
        f"hf:{folder}", text=TEXTS, device="cpu", layers=layers, topk=0, channels=True
    )
    truth = _inputs_alone(folder)
    import re

    per_expert = re.compile(r"\.experts\.\d+\.(gate_up_proj|down_proj)$")
    rows = {c.name: c for c in report.layers if per_expert.search(c.name)}
    want = {k: v for k, v in truth.items() if k.startswith("model.layers.0.mlp.experts.")}
    assert set(rows) == set(want) and len(rows) == 8
    for name, x in want.items():
        ch = rows[name].inputs[0].channels
        assert ch is not None and ch.count == [x.shape[0]] * x.shape[1], name
        got = torch.tensor(ch.absmax, dtype=torch.float64)
        assert torch.allclose(got, x.abs().amax(0), rtol=1e-5, atol=1e-7), name
        assert rows[name].inputs[0].numel == x.numel()

    # the same calls of the model's own modules as without --channels
    def calls(r: Any) -> list[tuple[str, int]]:
        return [(c.name, c.call) for c in r.layers if not per_expert.search(c.name)]

    assert calls(report) == calls(plain)
    act = [c for c in report.layers if c.name.endswith("experts.act_fn")]
    assert len(act) == len([c for c in plain.layers if c.name.endswith("experts.act_fn")])
    assert any("(token, expert) pairs" in n for n in report.notes)
