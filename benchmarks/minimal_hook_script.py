"""The hand-written script `benchmarks/startup.py` compares `hookcli inspect` with: what a user
writes to see every leaf layer's output statistics of resnet34 on one image, and nothing more
(random init, torchvision's own preprocessing, a forward hook per leaf, `.item()` per value).

Usage: python benchmarks/minimal_hook_script.py IMAGE [--quick-exit]

--quick-exit ends the script as hookcli's CLI ends its worker: output flushed, atexit handlers
run, then os._exit, skipping the interpreter's teardown of torch (~0.7 s). startup.py times the
script both ways, so hookcli's own cost is seen apart from that saving.
"""

from __future__ import annotations

import atexit
import os
import sys

import torch
from PIL import Image
from torchvision.models import ResNet34_Weights, resnet34


def main(path: str) -> None:
    torch.manual_seed(0)
    model = resnet34().eval()
    x = ResNet34_Weights.IMAGENET1K_V1.transforms()(Image.open(path).convert("RGB"))[None]
    rows: list[str] = []

    def hook(name: str):  # type: ignore[no-untyped-def]
        def record(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
            o = out.detach().double()
            rows.append(
                f"{name:28} {type(module).__name__:12} {'x'.join(map(str, o.shape)):14} "
                f"{o.mean().item():10.4g} {o.std(correction=0).item():10.4g} "
                f"{o.min().item():10.4g} {o.max().item():10.4g} "
                f"{(o == 0).double().mean().item():6.1%}"
            )

        return record

    handles = [
        m.register_forward_hook(hook(n)) for n, m in model.named_modules() if not list(m.children())
    ]
    with torch.no_grad():
        logits = model(x)
    for h in handles:
        h.remove()
    print("\n".join(rows))
    top = logits.softmax(-1).topk(5)
    print(
        [(int(i), round(float(p), 4)) for p, i in zip(top.values[0], top.indices[0], strict=True)]
    )


if __name__ == "__main__":
    main(sys.argv[1])
    if "--quick-exit" in sys.argv[2:]:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        os._exit(0)
