"""Token ids given as a tensor (`--input`, the Python API), checked as `--text`'s tokens are
before a text model runs on them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hookcli.errors import UsageError

if TYPE_CHECKING:
    from hookcli.sources import LoadedModel


def check_token_ids(loaded: LoadedModel, ids: torch.Tensor, shown: str) -> None:
    """Token ids given as a tensor (`--input`, the Python API) that a text model cannot take,
    refused before the pass, as `--text`'s are: not (batch, tokens) integers, an id outside
    its vocabulary (not the model's own failure on them). Their length is the caller's (a
    rotary model runs past its config's maximum positions)."""
    dtype = str(ids.dtype).removeprefix("torch.")
    if ids.dim() != 2:
        raise UsageError(
            f"token ids are a (batch, tokens) tensor; given a {shown} ({ids.dim()}-D)",
            "give ids.unsqueeze(0) for one sequence, or a tokenizer's output."
            if ids.dim() == 1
            else "give a (batch, tokens) tensor of ids, or a tokenizer's output.",
        )
    if ids.is_floating_point() or ids.is_complex() or ids.dtype is torch.bool:
        raise UsageError(
            f"token ids are integers; given a {shown} of {dtype}",
            "give the tokenizer's input_ids (int64), or a mapping of keyword tensors.",
        )
    vocab = getattr(loaded.kind, "vocab_size", None)
    if ids.numel() and isinstance(vocab, int):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise UsageError(
                f"the token ids of {shown} reach {low if low < 0 else high}, outside "
                f"{loaded.spec}'s vocabulary [0, {vocab}).",
                f"give ids in [0, {vocab}), e.g. --input randint:0:{vocab}:1x16.",
            )
