"""The Python API's keyword arguments, typed (`hookcli.inspect(model, x, layers=…, …)`): editors
complete them and type checkers catch a misspelt or mistyped one. The keys are exactly those the
API takes (tests/test_api.py holds them to options.API_KEYS, RuleOptions and Batching). No torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict

PathLike = str | os.PathLike[str]


class _Shared(TypedDict, total=False):
    """What inspect, grads and check all take (the CLI's flags of the same names)."""

    # the model
    weights: str
    seed: int
    device: str
    model_args: Mapping[str, Any] | None
    output_key: str | None
    head: str | None
    tokenizer: Any  # a folder, ORG/NAME, or a transformers tokenizer
    offload: bool
    tp: bool
    # which layers
    layers: str | Sequence[str]
    types: str | Sequence[str]
    depth: int | None
    also_layers: str | Sequence[str]
    # the input
    input_specs: str | Sequence[str]
    strict: bool
    text: str | Sequence[str]
    text_file: PathLike | None
    chat: bool
    padding_side: str | None
    target_text: str | Sequence[str]
    # the run
    train: bool
    hist: bool | int
    profile: bool
    memory: bool
    per_token: bool
    channels: bool
    heads: bool
    generate: int | None
    position: int | None
    sample: bool
    save: PathLike | None
    ablate: str | Sequence[str]
    deterministic: bool
    stats_backend: Literal["auto", "kernel", "torch"]
    config: str | None
    # rules inspect and grads hold too
    fail_on: str | Sequence[str]
    dead_frac: float
    # batching (a folder of images, a long text file)
    batch_size: int | None
    limit: int | None
    workers: int


class _Backward(TypedDict, total=False):
    """What backward starts from."""

    target: str | int | None
    loss: str | None
    input_grad: bool


class InspectKeywords(_Shared, total=False):
    """hookcli.inspect's options."""

    topk: int | None
    per_image: int


class GradsKeywords(InspectKeywords, _Backward, total=False):
    """hookcli.grads' options: inspect's, and what backward starts from."""


class CheckKeywords(_Shared, _Backward, total=False):
    """hookcli.check's options (no predictions: no topk, no per_image; target and loss apply
    when backward runs) and the rules."""

    max_abs: float | None
    min_std: float | None
    grad_norm: str | tuple[float | None, float | None] | None
    max_outlier_ratio: float | None
    max_kurtosis: float | None
    max_sink: float | None
    min_entropy: float | None
    max_expert_imbalance: float | None
    max_saved_mb: float | None
    expect_shape: str | Sequence[str] | Mapping[str, Sequence[int]]
    baseline: PathLike | None
    rtol: float
    atol: float
    backward: bool


__all__ = ("CheckKeywords", "GradsKeywords", "InspectKeywords")
