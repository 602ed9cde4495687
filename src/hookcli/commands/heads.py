"""--heads: every attention block's heads in numbers — the sink, the mean entropy and the
most-attended key (engine.heads) — read in one extra forward through engine.attention (eager
attention for Hugging Face models; the model is left as found).

Self-attention only: an encoder-decoder's cross-attention (queries of the decoder, keys of
the text) is left out and said, as is a call whose probabilities are not (batch, heads, L, L).
A padded batch's real tokens are the encoder's mask on its side (and in any other model), the
decoder's own mask (`decoder_attention_mask`) on the decoder's side."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from hookcli.engine.attention import (
    DECODER,
    AttentionSite,
    capture_attention,
    find_attention,
    no_attention,
    pick_block,
)
from hookcli.engine.heads import HEAD_COLUMNS, head_numbers
from hookcli.engine.prepare import Prepared, prepare
from hookcli.options import InputOptions, ModelOptions
from hookcli.records import HeadStats


def attention_heads(prepared: Prepared) -> tuple[list[HeadStats], list[str]]:
    """Each attention call's heads, each sequence's own (its padding left out, as if it ran
    alone): in the order the calls ran, then by sequence, then by head; and notes (calls not
    over the input's sequences, such as windowed attention, are left out and said)."""
    model_input = prepared.model_input
    assert model_input is not None
    sites = find_attention(prepared.loaded.module)
    if not sites:
        raise no_attention(prepared.loaded.spec)
    encoder_mask = model_input.token_mask
    decoder_mask = model_input.kwargs.get("decoder_attention_mask")
    shapes = model_input.shapes()
    first = shapes[0] if shapes else ()

    def per_head(site: AttentionSite, probs: torch.Tensor) -> torch.Tensor | None:
        # the input's batch: its first dimension; for a sequence-first nn.MultiheadAttention
        # (torch's default, batch_first=False) fed the input as it is, (tokens, batch, …), its
        # second (a model that transposes a batch-first input inside keeps the first)
        seq_first = isinstance(site.module, torch.nn.MultiheadAttention) and not (
            site.module.batch_first
        )
        batches = {first[i] for i in ((0, 1) if seq_first else (0,)) if len(first) > i}
        if batches and probs.shape[0] not in batches:
            return None  # windows, not the input's sequences
        mask = decoder_mask if site.side == DECODER else encoder_mask
        real = (
            mask
            if isinstance(mask, torch.Tensor)
            and tuple(mask.shape) == (probs.shape[0], probs.shape[2])
            else None
        )
        return head_numbers(probs, real)

    got = capture_attention(prepared, sites, keep=set(), per_head=per_head)
    measured = [c for c in got.calls if c.heads is not None]
    notes = list(got.notes)
    cross = sum(1 for c in got.calls if c.cross)
    shapeless = [c for c in got.calls if not c.cross and len(c.shape) != 4]
    skipped = len(got.calls) - len(measured) - cross - len(shapeless)
    if cross:
        notes.append(
            f"--heads: {cross} cross-attention call(s) (queries of the decoder, keys of the "
            "encoder's tokens) left out: the numbers are self-attention's"
        )
    if shapeless:
        shape = "x".join(map(str, shapeless[0].shape))
        notes.append(
            f"--heads: {len(shapeless)} attention call(s) returned attentions of shape {shape} "
            f"({shapeless[0].site.name}), not (batch, heads, queries, keys): which dimension "
            "is the head cannot be told, so they are left out"
        )
    if skipped:
        notes.append(
            f"--heads: {skipped} attention call(s) not over the input's sequences (windowed, "
            "or not square) left out"
        )
    if not measured:
        return [], notes
    flat = torch.cat([c.heads.reshape(-1) for c in measured if c.heads is not None]).cpu().tolist()
    out: list[HeadStats] = []
    at = 0
    for c in measured:
        assert c.heads is not None
        sequences, heads = c.heads.shape[0], c.heads.shape[1]
        for seq, h in itertools.product(range(sequences), range(heads)):
            sink, entropy, top, share, queries = flat[at : at + HEAD_COLUMNS]
            at += HEAD_COLUMNS
            out.append(
                HeadStats(
                    layer=c.site.block,
                    module=c.site.name,
                    call=c.call,
                    sequence=seq,
                    head=h,
                    sink=sink if queries else None,
                    entropy=entropy if queries else None,
                    top_key=int(top) if queries else None,
                    top_share=share if queries else None,
                    queries=int(queries),
                )
            )
    return out, notes


def heads_data(
    model: ModelOptions, inputs: InputOptions, block: str | None = None
) -> dict[str, Any]:
    """attn -f json: the model, its input, and every attention call's heads (`block`: the
    block -l names, as attn picks it; None: every block)."""
    prepared = prepare(model, inputs=inputs)
    heads, notes = attention_heads(prepared)
    if block is not None:
        picked = pick_block(prepared, find_attention(prepared.loaded.module), block)
        heads = [h for h in heads if h.layer == picked]
    assert prepared.model_input is not None
    return {
        "model": prepared.loaded.spec,
        "input": prepared.model_input.description,
        "heads": [dataclasses.asdict(h) for h in heads],
        "notes": [*prepared.notes, *notes],
    }
