"""`hookcli layers` and `hookcli models`: the module tree, the weights' bytes and the KV cache
a token costs, the models a source lists, a saved file's tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from hookcli.records.core import InputInfo, ModelInfo, TensorStats


@dataclass(slots=True)
class ModuleRow:
    """One module of `hookcli layers`."""

    name: str
    type: str
    depth: int
    params: int
    own_params: int
    leaf: bool
    aliases: list[str] = field(default_factory=list)
    output_shapes: list[str] | None = None
    calls: int | None = None
    hookable: bool = True  # False: inside TorchScript, where Python hooks cannot reach
    # own parameters that are another module's (tied weights), as "weight = other.weight";
    # the model's total counts them once
    tied: list[str] = field(default_factory=list)
    flops: int | None = None  # --meta: forward FLOPs of its calls, added up


@dataclass(slots=True)
class WeightBytes:
    """`hookcli layers`: the bytes the model's parameters take, each parameter once (a tied
    weight, lm_head = embed_tokens, counted once). `held`: by the dtype each parameter holds
    (their sum is `bytes`); `as_dtype`: every parameter in that one dtype (int8: 1 byte a
    parameter, int4: half a byte, rounded up; quantization scales and zero points are not
    counted); `assumes` says so in words. Buffers (batch norm statistics, rotary tables) are
    `buffer_bytes`, as held, apart."""

    params: int
    bytes: int
    held: dict[str, int]
    as_dtype: dict[str, int]
    buffer_bytes: int = 0
    assumes: str = ""


@dataclass(slots=True)
class KVCache:
    """`hookcli layers` of a causal LM: the key/value cache one more token of context adds,
    read from its config (None where it cannot be told: `note` says why). Attention layers
    keep 2 x kv_heads x head_dim values a token each (`per_layer_values`; an MLA layer its
    compressed latent, kv_lora_rank + qk_rope_head_dim); `sliding_layers` of them keep at
    most `window` tokens, so past that a token adds only the full layers' `full_bytes`.
    `bytes_at_context`: one sequence at the config's `context` (max_position_embeddings)."""

    dtype: str
    bytes_per_token: int | None
    formula: str = ""
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    per_layer_values: int | None = None
    full_layers: int | None = None
    sliding_layers: int = 0
    window: int | None = None
    full_bytes: int | None = None  # a token past the window: the full layers' share
    context: int | None = None
    bytes_at_context: int | None = None
    note: str | None = None


@dataclass(slots=True)
class LayersReport:
    model: ModelInfo
    modules: list[ModuleRow]
    input: InputInfo | None = None
    flops: int | None = None  # --meta: the forward's FLOPs (FlopCounterMode)
    notes: list[str] = field(default_factory=list)
    weights: WeightBytes | None = None
    kv_cache: KVCache | None = None  # a causal LM's; None for any other model


@dataclass(slots=True)
class ModelEntry:
    """One row of `hookcli models`."""

    name: str
    task: str
    weights: list[str]
    default: str | None
    params: int | None
    input_size: str | None
    metric: str | None


@dataclass(slots=True)
class SavedFile:
    """`hookcli show`: what a saved .safetensors file holds."""

    path: str
    metadata: dict[str, str]
    tensors: list[TensorStats]
