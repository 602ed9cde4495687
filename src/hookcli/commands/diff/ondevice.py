"""A difference measured where both sides' tensors are (issue 52): on a CUDA device, the
compared side reads the reference's tensor itself — the reference pass waits while it is read
(lockstep.py) — and the sums stay on the device, as a tensor, until the pass ends; then every
tensor's sums come over in one transfer (measure.settle). No copy of an activation to the host,
no synchronisation per tensor.

The sums are those of the CPU kernels (engine/_kernels.diff_serial), in float64, over the
elements finite on both sides — Σ(b - a)², Σa², Σb², Σab, max|b - a| — and the count of
elements not finite on either side, then what a note on NaN/Inf needs: the elements not finite
on each side, and the reference's largest |x|.
"""

from __future__ import annotations

import torch

# elements widened to float64 at a time: the working copies stay bounded
CHUNK = 1 << 24
SUMS = 9  # sd, sa, sb, sab, max |b - a|, not finite (either), not finite (a), (b), max |a|


def on_device(t: torch.Tensor) -> bool:
    """Whether a reference tensor is read where it is (CUDA) instead of as a host array."""
    return t.is_cuda


def sums(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """The SUMS float64 numbers of got against ref (same shape, same device), on the device."""
    a_all, b_all = ref.detach().reshape(-1), got.detach().reshape(-1)
    parts = []
    for start in range(0, max(a_all.numel(), 1), CHUNK):
        a = a_all[start : start + CHUNK].double()
        b = b_all[start : start + CHUNK].double()
        fa, fb = torch.isfinite(a), torch.isfinite(b)
        both = fa & fb
        zero = torch.zeros((), dtype=torch.float64, device=a.device)
        a0, b0 = torch.where(both, a, zero), torch.where(both, b, zero)
        d = b0 - a0
        parts.append(
            torch.stack(
                [
                    torch.dot(d, d),
                    torch.dot(a0, a0),
                    torch.dot(b0, b0),
                    torch.dot(a0, b0),
                    d.abs().amax() if d.numel() else zero,
                    (~both).sum(dtype=torch.float64),
                    (~fa).sum(dtype=torch.float64),
                    (~fb).sum(dtype=torch.float64),
                    torch.where(fa, a.abs(), zero).amax() if a.numel() else zero,
                ]
            )
        )
    if len(parts) == 1:
        return parts[0]
    stacked = torch.stack(parts)
    total = stacked.sum(0)
    return torch.where(
        torch.tensor([0, 0, 0, 0, 1, 0, 0, 0, 1], dtype=torch.bool, device=total.device),
        stacked.amax(0),
        total,
    )


def position_sums(ref: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ(b - a)² and Σa² over the last dimension, per (sequence, position), float64, on the
    device (a few positions' float64 copies at a time)."""
    batch, tokens, width = got.shape
    sd = torch.zeros(batch, tokens, dtype=torch.float64, device=got.device)
    sa = torch.zeros(batch, tokens, dtype=torch.float64, device=got.device)
    step = max(1, CHUNK // max(width, 1))
    for b in range(batch):
        for t in range(0, tokens, step):
            a64 = ref[b, t : t + step].double()
            d64 = got[b, t : t + step].detach().double() - a64
            sd[b, t : t + step] = (d64 * d64).sum(-1)
            sa[b, t : t + step] = (a64 * a64).sum(-1)
    return sd, sa
