"""FLOPs of mixture-of-experts models (issue 48): transformers 5 keeps a MoE layer's routed
experts in 3-D parameters (MixtralExperts' gate_up_proj and down_proj, …) and runs them through
`aten._grouped_mm`, which FlopCounterMode has no formula for: the experts counted 0, and on the
meta device a float32 or float16 model stopped at them (torch's meta kernel takes bfloat16 only).

Oracles: 2 x active parameters x tokens, the active parameters counted by hand from the config
(every matrix a token is multiplied by: attention, router, shared experts, the top-k routed
experts and the LM head; not the embedding, a lookup), the by-hand count checked against the
model's own matrices; each expert's tokens routed, counted from the router's input by hand
(softmax, top-k); and transformers' eager experts (a loop of F.linear over each expert's
tokens), which FlopCounterMode counts with torch's own matrix-product formulas."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from typer.testing import CliRunner

import hookcli
from hookcli.cli import app

transformers = pytest.importorskip("transformers")

runner = CliRunner()
VOCAB = 512
SHAPE = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
}  # fmt: skip
CONFIGS: dict[str, Callable[..., Any]] = {
    "mixtral": lambda **kw: transformers.MixtralConfig(**(SHAPE | {"num_local_experts": 4} | kw)),
    "qwen2_moe": lambda **kw: transformers.Qwen2MoeConfig(
        **SHAPE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=96, **kw
    ),
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeConfig(
        **SHAPE, num_experts=8, moe_intermediate_size=48, head_dim=16, **kw
    ),
}


def by_hand(c: Any) -> tuple[int, int, int]:
    """(active, dense, one expert): the parameters a token is multiplied by (the top-k routed
    experts only), every matrix of the model but the embedding (every expert), and one routed
    expert's, from the config's numbers."""
    h, layers, heads, kv = (
        c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    )  # fmt: skip
    d = getattr(c, "head_dim", None) or h // heads
    experts = getattr(c, "num_local_experts", None) or c.num_experts
    inner = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    expert = 3 * h * inner  # gate and up (h -> inner, fused), down (inner -> h)
    shared = getattr(c, "shared_expert_intermediate_size", 0) or 0
    always = 2 * h * heads * d + 2 * h * kv * d + h * experts  # q, o, k, v; the router
    if shared:
        always += 3 * h * shared + h  # the shared expert and its gate
    active = layers * (always + c.num_experts_per_tok * expert) + h * c.vocab_size
    dense = layers * (always + experts * expert) + h * c.vocab_size
    return active, dense, expert


def matrices(model: nn.Module) -> int:
    """Every parameter of 2 or more dimensions but the embeddings' tables."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in tables)


def save_config(folder: Path, name: str, dtype: str) -> Any:
    config = CONFIGS[name](dtype=dtype)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    return config, model


# ---------------------------------------------------------------- --meta


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_meta_flops_are_two_times_active_parameters_per_token(
    tmp_path: Path, name: str, dtype: str
) -> None:
    """`layers --meta` runs in every dtype, and counts each routed expert's product over
    top-k x tokens rows: the model's FLOPs are 2 x active parameters x tokens (attention's
    own products, 4 x tokens² x heads x head size a block, the rest)."""
    config, model = save_config(tmp_path, name, dtype)
    active, dense, expert = by_hand(config)
    assert matrices(model) == dense  # the by-hand count is the model's
    k = config.num_experts_per_tok
    # the routed experts are no small part: leaving them out misses by far more than 5%
    assert 2 * k * expert * config.num_hidden_layers > 0.3 * active
    r = runner.invoke(app, ["layers", f"hf:{tmp_path}", "--meta", "-f", "json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    tokens = math.prod(data["input"]["shapes"][0])
    assert tokens == 16
    assert data["flops"] == pytest.approx(2 * active * tokens, rel=0.05)
    rows = {m["name"]: m for m in data["modules"]}
    for i in range(config.num_hidden_layers):
        assert rows[f"model.layers.{i}.mlp.experts"]["flops"] == 2 * tokens * k * expert


def test_meta_gives_the_same_flops_in_every_dtype(tmp_path: Path) -> None:
    got = {}
    for dtype in ("float32", "float16", "bfloat16"):
        folder = tmp_path / dtype
        save_config(folder, "mixtral", dtype)
        r = runner.invoke(app, ["layers", f"hf:{folder}", "--meta", "-f", "json"])
        assert r.exit_code == 0, r.stderr
        data = json.loads(r.stdout)
        experts = [m["flops"] for m in data["modules"] if m["name"].endswith(".experts")]
        assert len(experts) == 2 and all(f > 0 for f in experts)
        got[dtype] = (data["flops"], tuple(experts))
    assert len(set(got.values())) == 1, got


def test_meta_runs_an_expert_width_the_cuda_kernel_would_refuse(tmp_path: Path) -> None:
    """An expert 36 wide in float32 runs on the CPU (its rows 16-byte aligned there) and so on
    meta too, where torch's kernel asks what CUDA's does (bfloat16, 8-element rows): the
    experts' FLOPs there are the CPU run's."""
    config = CONFIGS["mixtral"](intermediate_size=36)
    config.architectures = ["MixtralForCausalLM"]
    config.save_pretrained(tmp_path)
    r = runner.invoke(app, ["layers", f"hf:{tmp_path}", "--meta", "-f", "json"])
    assert r.exit_code == 0, r.stderr
    rows = {m["name"]: m for m in json.loads(r.stdout)["modules"]}
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    ids = torch.randint(0, VOCAB, (1, 16))
    real = hookcli.inspect(
        model, ids, device="cpu", profile=True, topk=0, layers=["model.layers.*.mlp.experts"]
    )
    assert len(real.layers) == 2
    for call in real.layers:
        assert call.profile is not None
        assert rows[call.name]["flops"] == call.profile.flops == 2 * 16 * 2 * 3 * 64 * 36
        assert rows[call.name]["output_shapes"] == ["16x64"]


def test_grouped_products_on_meta_have_the_cpu_kernels_shapes_in_every_dtype() -> None:
    from hookcli.engine.flops import grouped_mm_on_meta

    offs = torch.tensor([3, 5, 12], dtype=torch.int32)
    layouts = [((12, 8), (3, 8, 16), offs), ((3, 4, 8), (8, 12), offs)]
    layouts += [((4, 12), (12, 8), offs), ((3, 4, 8), (3, 8, 16), None)]
    for a, b, o in layouts:
        want = F.grouped_mm(torch.randn(a), torch.randn(b), offs=o).shape
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = torch.empty(a, dtype=dtype, device="meta")
            y = torch.empty(b, dtype=dtype, device="meta")
            with grouped_mm_on_meta():
                out = F.grouped_mm(x, y, offs=None if o is None else o.to("meta"))
            assert (out.shape, out.dtype, out.device.type) == (want, dtype, "meta")
    with grouped_mm_on_meta(), pytest.raises(RuntimeError, match="do not multiply"):
        F.grouped_mm(torch.empty(12, 8, device="meta"), torch.empty(3, 9, 16, device="meta"))


def test_layers_meta_on_hf_mixtral_is_two_times_active_parameters_per_token() -> None:
    """The model type's default config, Mixtral-8x7B's shape in float32 (46.7B parameters,
    12.9B active), built on the meta device: 32 blocks of 8 experts, top 2."""
    r = runner.invoke(app, ["layers", "hf:mixtral", "--meta", "--depth", "1", "-f", "json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    config = transformers.MixtralConfig()
    active, dense, _ = by_hand(config)
    h, v = config.hidden_size, config.vocab_size
    norms = (2 * config.num_hidden_layers + 1) * h
    assert data["model"]["params"] == dense + h * v + norms == 46_702_792_704
    tokens = math.prod(data["input"]["shapes"][0])
    assert data["flops"] == pytest.approx(2 * active * tokens, rel=0.05)


# ---------------------------------------------------------------- --profile


def tiny(name: str, implementation: str = "grouped_mm") -> Any:
    torch.manual_seed(0)
    config = CONFIGS[name]()
    config._experts_implementation = implementation
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert model.config._experts_implementation == implementation
    return model


def routed_by_hand(model: nn.Module, ids: torch.Tensor) -> dict[str, list[int]]:
    """Each MoE layer's tokens per expert: the router's input kept by a hook of its own, its
    top-k taken here from softmax(h Wᵀ); a pair the router marks dropped (an index past the
    last expert) goes to none."""
    seen: dict[str, torch.Tensor] = {}
    routers = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("Router")}
    handles = [
        m.register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, a[0].detach()))
        for n, m in routers.items()
    ]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    k = model.config.num_experts_per_tok
    counts = {}
    for name, h in seen.items():
        w = routers[name].weight.detach()
        probs = torch.softmax(h.reshape(-1, w.shape[1]).double() @ w.T.double(), dim=-1)
        top = probs.topk(k, dim=-1).indices
        dropped = getattr(routers[name], "dropped", None)
        if dropped is not None:
            top = top[~dropped]
        owner = name.rsplit(".", 1)[0]  # the MoE block: its experts module beside the router
        counts[f"{owner}.experts"] = torch.bincount(top.reshape(-1), minlength=w.shape[0]).tolist()
    return counts


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_profile_counts_each_experts_tokens_routed(name: str) -> None:
    model = tiny(name)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    report = hookcli.inspect(
        model, ids, device="cpu", profile=True, topk=0, layers=["model.layers.*.mlp.experts"]
    )
    _, _, expert = by_hand(model.config)
    want = routed_by_hand(model, ids)
    assert len(want) == model.config.num_hidden_layers
    flops = {c.name: c.profile.flops for c in report.layers if c.profile is not None}
    assert flops == {layer: 2 * sum(counts) * expert for layer, counts in want.items()}
    assert all(sum(c) == ids.numel() * model.config.num_experts_per_tok for c in want.values())
    # the whole forward: what FlopCounterMode counts on transformers' eager experts
    assert report.profile is not None and report.profile.flops == eager_flops(name, ids)


def eager_flops(name: str, ids: torch.Tensor, drop: bool = False) -> int:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny(name, "eager")
    if drop:
        drop_pairs(model)
    # attention by the math kernel, whose matmuls torch's registry counts (the CPU's fused
    # kernel it has no formula for: hookcli's engine/flops.py gives it the SDPA formula)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids)
    return counter.get_total_flops()


def drop_pairs(model: nn.Module) -> None:
    """Every router marks some (token, slot) pairs dropped, as expert parallelism does with the
    pairs of experts another rank holds: their index becomes the number of experts, which the
    experts skip (eager) or sort past the grouped rows' end (grouped_mm)."""
    for m in model.modules():
        if type(m).__name__.endswith("Experts"):
            m._is_expert_parallel = True
        if not type(m).__name__.endswith("Router"):
            continue

        def hook(m: nn.Module, args: Any, out: Any) -> Any:
            logits, weights, idx = out
            dropped = torch.zeros_like(idx, dtype=torch.bool)
            dropped[::3, 0] = True  # every third token's first choice
            dropped[1::4, 1] = True  # and every fourth's second, from the second on
            m.dropped = dropped  # type: ignore[assignment]
            return (
                logits,
                weights.masked_fill(dropped, 0.0),
                idx.masked_fill(dropped, m.num_experts),
            )

        m.register_forward_hook(hook)


def test_profile_leaves_out_the_pairs_not_routed() -> None:
    """Pairs a router drops are no rows of any expert's product: the experts' FLOPs follow the
    pairs routed, not tokens x k (grouped_mm's offsets end before its rows do)."""
    model = tiny("mixtral")
    drop_pairs(model)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    report = hookcli.inspect(
        model, ids, device="cpu", profile=True, topk=0, layers=["model.layers.*.mlp.experts"]
    )
    _, _, expert = by_hand(model.config)
    want = routed_by_hand(model, ids)
    routed = {layer: sum(c) for layer, c in want.items()}
    assert all(0 < n < 16 * 2 for n in routed.values())
    flops = {c.name: c.profile.flops for c in report.layers if c.profile is not None}
    assert flops == {layer: 2 * n * expert for layer, n in routed.items()}
    assert report.profile is not None
    assert report.profile.flops == eager_flops("mixtral", ids, drop=True)


def test_experts_backward_flops_equal_the_eager_experts() -> None:
    """With gradients: the grouped products' backward (the input's gradient by each expert's
    rows, the weights' grouped along the tokens) counts what the eager loop's does."""
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(3))
    got = {}
    for implementation in ("grouped_mm", "eager"):
        report = hookcli.grads(
            tiny("mixtral", implementation), ids, target="top1", device="cpu", profile=True,
            topk=0, layers=["model.layers.0.mlp.experts"],
        )  # fmt: skip
        prof = report.profile
        assert prof is not None and prof.flops and prof.backward_flops
        got[implementation] = (prof.flops, prof.backward_flops, report.layers[0].profile)
    grouped, eager = got["grouped_mm"], got["eager"]
    assert grouped[:2] == eager[:2]
    assert grouped[2] is not None and eager[2] is not None
    assert grouped[2].flops == eager[2].flops > 0


class Grouped(nn.Module):
    """aten._grouped_mm in its four layouts, each grouped extent ending before the tensor's:
    (rows, K) by (groups, K, N); (groups, M, K) by (K, columns); (M, rows) by (rows, N) into
    (groups, M, N); (groups, M, K) by (groups, K, N)."""

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        offs = torch.tensor([3, 5, 9], dtype=torch.int32)  # 9 of 12: 3, 2 and 4
        return [
            F.grouped_mm(x[:12, :8], torch.ones(3, 8, 16), offs=offs),
            F.grouped_mm(torch.ones(3, 4, 8), x[:8, :12], offs=offs),
            F.grouped_mm(x[:4, :12], x[:12, :8], offs=offs),
            F.grouped_mm(torch.ones(3, 4, 8), torch.ones(3, 8, 16)),
        ]


def test_each_layout_counts_its_grouped_extent_only() -> None:
    model = Grouped()
    x = torch.randn(16, 16)
    for out, want in zip(model(x), [(12, 16), (4, 12), (3, 4, 8), (3, 4, 16)], strict=True):
        assert tuple(out.shape) == want  # the layouts, as torch runs them here
    report = hookcli.inspect(model, x, device="cpu", profile=True, topk=0)
    by_hand = 2 * 9 * 8 * 16 + 2 * 4 * 8 * 9 + 2 * 4 * 8 * 9 + 2 * 3 * 4 * 8 * 16
    assert report.profile is not None and report.profile.flops == by_hand
