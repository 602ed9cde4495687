"""Tiny custom models for tests (also loadable as tests/support/models.py:Name from the CLI)."""

from __future__ import annotations

import torch
from torch import nn


class Kinds(nn.Module):
    """Emits float16, int, bool, empty and NaN tensors in one structured output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.to_half = Half()
        self.kinds = KindsHead()

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        h = self.lin(x)
        return self.kinds(self.to_half(h))


class Half(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.half()


class KindsHead(nn.Module):
    def forward(self, h: torch.Tensor) -> dict[str, object]:
        nan = h.float().log()  # log of negatives: NaN
        return {
            "half": h,
            "pair": (h.argmax(dim=1), h > 0),
            "empty": h.new_zeros((0, 3)),
            "nan": nan,
            "none": None,
        }


class Aliased(nn.Module):
    """One Linear reachable as `a` and `b`, called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = self.a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ok = nn.Linear(2, 2)
        self.bad = Boom()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bad(self.ok(x))


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom inside the model")


class KwargOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x, factor=torch.full((1,), 2.0))


class Scale(nn.Module):
    def forward(self, x: torch.Tensor, *, factor: torch.Tensor) -> torch.Tensor:
        return x * factor


class SeedLinear(nn.Module):
    """Linear(1, 1, bias=False) with weight 2: with x = [[1], [2]] and MSE against [[1], [1]],
    dL/dy = [1, 3], dL/dx = [2, 6] and dL/dw = 7."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.lin.weight.fill_(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


NOT_A_MODEL = 42


def not_a_module() -> int:
    return 3


def broken_factory() -> nn.Module:
    raise ValueError("factory exploded")


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN for negative inputs


class Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)  # infinite derivative at 0


class NanForward(nn.Module):
    """Finite until `log` takes the log of negative activations; NaN flows on after it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.log = Log()
        self.fc2 = nn.Linear(8, 3)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc2(self.log(self.fc1(x))))


class DivideByDead(nn.Module):
    """Divides by a ReLU output that is zero: Inf (and NaN) from `div` on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = nn.ReLU()
        self.div = Divide()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.div(h, self.gate(-h.abs()))


class Divide(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a / b


class NanBackward(nn.Module):
    """Finite forward; backward through sqrt at 0 makes the first non-finite gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.relu = nn.ReLU()
        self.sqrt = Sqrt()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.sqrt(self.relu(self.fc1(x))))


class Healthy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TwoBranches(nn.Module):
    """A conv whose output never reaches the logits (`side`), beside one that does."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.side = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.side(x)
        return self.head(self.conv(x).mean(dim=(2, 3)))


class NanConv(nn.Module):
    """A conv net whose feature maps are NaN: pictures and predictions of nothing finite."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.log = Log()
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.log(self.conv(x) - 100.0)  # log of negatives: NaN everywhere
        return self.head(feats.mean(dim=(2, 3)))


class Talks(nn.Module):
    """Prints while it is built and on every forward, as research code does."""

    def __init__(self) -> None:
        super().__init__()
        print("building Talks")
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("forward of Talks, input", tuple(x.shape))
        return self.fc(x)


class Exits(nn.Module):
    """Calls sys.exit(0) in forward: a success code that must not become hookcli's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import sys

        sys.exit(0)


def exits_on_build() -> nn.Module:
    import sys

    sys.exit(2)


class Chain(nn.Module):
    """Four linear layers with tanh between: a chain along which rounding error travels."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 16)
        self.l2 = nn.Linear(16, 16)
        self.l3 = nn.Linear(16, 16)
        self.l4 = nn.Linear(16, 4)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l4(self.act(self.l3(self.act(self.l2(self.act(self.l1(x)))))))


class SparseMM(nn.Module):
    """Takes a sparse COO tensor only (a dense one is refused) and returns one."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n) / n**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.layout is not torch.sparse_coo:
            raise TypeError(f"SparseMM takes a sparse COO tensor, not {x.layout}")
        return torch.sparse.mm(x, self.weight).to_sparse()


class SparseChain(nn.Module):
    """A linear layer, its ReLU made sparse (COO) for a layer that takes only that and returns
    a sparse output, then a linear layer on its dense values."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 16)
        self.smm = SparseMM(16)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.smm(torch.relu(self.l1(x)).to_sparse()).to_dense())


class InlineNet(nn.Module):
    """NaN made by code in forward, outside every module: `torch.log` between bn1 and fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.bn1 = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn1(self.fc1(x))
        return self.fc2(torch.log(h))  # negative entries: NaN, made by no module


class InlineBlock(nn.Module):
    """A block whose own forward holds the inline code (between `inner` and `out`)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        return self.out(torch.sqrt(h - h.min(1, keepdim=True).values))  # sqrt'(0) = Inf


class InlineDeep(nn.Module):
    """InlineBlock inside a model: the gap's code is in InlineBlock.forward (block)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.block = InlineBlock()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)))


class Collapse(nn.Module):
    """`squash` scales its input by 1e-9: every activation after it has collapsed."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.squash = Multiply(1e-9)
        self.fc2 = nn.Linear(8, 8, bias=False)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc2(self.squash(self.fc1(x))))


class Shrinking(nn.Module):
    """Five linear layers with small weights: gradients shrink toward the input."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(5)])
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                layer.weight.mul_(0.05 * (i + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Multiply(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class RowNet(nn.Module):
    """sqrt of the input in forward (a negative entry: NaN, made before any module)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.sqrt(x))


class DarkNan(nn.Module):
    """The log of each channel's mean, inline: NaN for a dark image (normalised below 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.log(self.pool(x).flatten(1)))


class SharedInput(nn.Module):
    """`lin` and an inline sqrt read one tensor: its gradient is both readers' sum, and the
    Inf in it is sqrt's (at 0), not lin's. With `module=True` the sqrt is a module (`sq`)."""

    def __init__(self, module: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.lin = nn.Linear(8, 8)
        self.sq = Sqrt() if module else None
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.fc1(x))
        root = self.sq(x) if self.sq is not None else torch.sqrt(x)
        return self.head(self.lin(x) + root)


class SharedLeafInput(nn.Module):
    """The model's input itself is read by `lin` and by an inline sqrt: with the input's
    gradient asked for, that leaf's gradient is both readers' sum, and its Inf (sqrt's, at
    0) is not lin's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lin(x) + torch.sqrt(x))


class SharedSquare(nn.Module):
    """`lin` and inline code (sqrt(h·h), whose gradient at 0 is Inf·0 = NaN) read one tensor
    h; fc1's first feature is 0, so h's gradient — both readers' sum — is NaN there, and
    the NaN reaches fc1's parameters: a training step's gradients hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.fc1.weight[0].zero_()
            self.fc1.bias[0] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.head(self.lin(h) + torch.sqrt(h * h))


class Overflow(nn.Module):
    """`big` multiplies by 1e39: every float32 output after it is Inf."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.big = Multiply(1e39)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.big(self.fc(x)))


class LogAfter(nn.Module):
    """NaN made after the last module returned: log in the model's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.fc(x))


class EatsInput(nn.Module):
    """Takes the log of its own input in place, before any module sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.log_()
        return self.fc(x)


class Spike(nn.Linear):
    """A Linear whose output holds 4000 at sequence 0, position 2, channel 3."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x).clone()
        y[0, 2, 3] = 4000.0
        return y


class MassiveAt(nn.Module):
    """A massive activation at a known place: `spike`'s output
    (tests/commands/probes/test_channels.py)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 16)
        self.spike = Spike(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.spike(self.proj(x) * 0.1)


class Wide(nn.Module):
    """A Linear as wide as `width` (a constructor argument for --model-arg)."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(3, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Unused(nn.Module):
    """A Linear the forward calls and one it never calls (`never`)."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.never = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class WideConv(nn.Module):
    """A Conv2d as wide as `width`: 0 warns (zero-element weights) and fails in forward."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class NoClasses(nn.Module):
    """Scores of no class: (N, 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)[:, :0]
