"""Models with faults that can be switched on at one training step
(tests/commands/watch/test_watch_faults.py).

Module-level classes, so a repro bundle's pickled model can be rebuilt by `hookcli replay`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _NaNGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `value` (NaN or Inf)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, value: float) -> torch.Tensor:
        ctx.value = value
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.value + ctx.value, None


class Fault(nn.Module):
    """The identity until `mode` is set: then it makes NaN/Inf forward or only backward."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: PLR0911 (one return a mode)
        mode = self.mode
        if mode == "nan":
            return x * float("nan")
        if mode == "inf":
            return x + float("inf")
        if mode == "exp":
            return torch.exp(x * 1000.0 + 100.0)
        if mode == "div0":
            return x / (x - x)
        if mode == "bwd_nan":
            return _NaNGrad.apply(x, float("nan"))  # type: ignore[no-any-return]
        if mode == "bwd_inf":
            return _NaNGrad.apply(x, float("inf"))  # type: ignore[no-any-return]
        if mode == "rng":  # NaN where fresh noise is large: which elements depends on the RNG
            noise = torch.randn_like(x)
            return torch.where(noise > 1.5, torch.full_like(x, float("nan")), x)
        return x


class Counter(nn.Module):
    """Counts its calls in a buffer; at call `at` (train mode), its output is NaN. A replay
    that did not start from the step's own buffers would count past it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: torch.Tensor
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.at = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        if int(self.calls) == self.at:
            return x * float("nan")
        return x


class FaultNet(nn.Module):
    """conv → relu → fault_a → conv → relu → counter → pool → fc1 → fault_b → fc2; `sqrt_gap`
    puts sqrt of a negative between fc1 and fault_b (code, not a module)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.act1 = nn.ReLU()
        self.fault_a = Fault()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.act2 = nn.ReLU()
        self.counter = Counter()
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc1 = nn.Linear(32, 16)
        self.fault_b = Fault()
        self.fc2 = nn.Linear(16, 5)
        self.sqrt_gap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.counter(self.act2(self.conv2(self.fault_a(self.act1(self.conv1(x))))))
        h = self.fc1(self.pool(h).flatten(1))
        if self.sqrt_gap:
            h = torch.sqrt(h - 1e3)
        out: torch.Tensor = self.fc2(self.fault_b(h))
        return out


class DictNet(nn.Module):
    """A Hugging Face-like model: keyword input, dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.body = FaultNet()
        self.aux = nn.Linear(5, 2)

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.body(pixel_values)
        return {"logits": logits, "aux": self.aux(logits)}


class MaskedAttention(nn.Module):
    """Attention as often written by hand: scores masked with -inf, then softmax. A query
    whose keys are all masked gets softmax(-inf, …, -inf) = NaN."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(mask[:, None, :], float("-inf"))
        out: torch.Tensor = self.proj(scores.softmax(-1) @ v)
        return out


class AttnNet(nn.Module):
    """Token model whose attention gets a key padding mask (a keyword argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.attn = MaskedAttention(8)
        self.head = nn.Linear(8, 5)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = self.attn(self.embed(tokens), mask=mask)
        out: torch.Tensor = self.head(a.mean(1))
        return out
