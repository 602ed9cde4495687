"""--device: auto → a GPU when present (CUDA, then MPS), else the CPU."""

from __future__ import annotations

import torch

from hookcli.errors import UsageError


def resolve_device(spec: str) -> torch.device:
    """auto → a GPU when present (CUDA, then MPS), else the CPU."""
    raw = spec.strip().lower()
    mps = getattr(torch.backends, "mps", None)
    mps_ok = bool(mps is not None and mps.is_available())
    if raw == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if mps_ok else torch.device("cpu")
    try:
        device = torch.device(raw)
    except RuntimeError as exc:
        raise UsageError(
            f"unknown device {spec!r}.", "use auto, cpu, cuda, cuda:N or mps."
        ) from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                "CUDA is not available on this machine.", "use --device cpu (or auto)."
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(
                f"no GPU {device} (this machine has {torch.cuda.device_count()}).",
                "use --device cuda:0.",
            )
    elif device.type == "mps" and not mps_ok:
        raise UsageError("MPS is not available on this machine.", "use --device cpu (or auto).")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"unsupported device {spec!r}.", "use auto, cpu, cuda, cuda:N or mps.")
    return device
