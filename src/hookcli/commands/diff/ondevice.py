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

from hookcli.engine import devicerow

# elements widened to float64 at a time: the working copies stay bounded
CHUNK = 1 << 22


def on_device(t: torch.Tensor) -> bool:
    """Whether a tensor is read where it is (CUDA) instead of as a host array: on CUDA, with
    the work of this thread queued on the device's default stream, which both passes share, so
    that the compared pass's reads come after the reference's writes and before its next ones
    (a forward on a stream of its own: as a host array, as before)."""
    return t.is_cuda and torch.cuda.current_stream(t.device) == torch.cuda.default_stream(t.device)


def after_writes(ref: torch.Tensor) -> torch.Tensor:
    """ref, with this thread's stream made to wait for the default stream's queued work (the
    reference's writes), so that it can be read here, as a host array, on any stream."""
    if ref.is_cuda:
        torch.cuda.current_stream(ref.device).wait_stream(torch.cuda.default_stream(ref.device))
    return ref


def sums(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """got against ref (same shape, same device), 9 float64 numbers on the device: Σ(b - a)²,
    Σa², Σb², Σab, max |b - a|, the elements not finite on either side, on a, on b, max |a|.
    On CUDA, by the fused kernel (engine/devicerow.diff_sums: one read of each, two launches);
    else by float64 torch ops, a bounded copy at a time."""
    fused = devicerow.diff_sums(ref, got) if ref.numel() else None
    if fused is not None:
        return fused
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
    s = torch.stack(parts)  # the chunks': sums add, maxima take the max (no host tensor)
    return torch.cat([s[:, :4].sum(0), s[:, 4:5].amax(0), s[:, 5:8].sum(0), s[:, 8:].amax(0)])


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
