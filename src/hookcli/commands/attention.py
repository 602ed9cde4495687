"""attn: the attention probabilities of one transformer block, per head, and the attention
rollout over every block, as the arrays render/images.py draws.

engine.attention reads the probabilities (torch MultiheadAttention, timm, Hugging Face) in one
pass that leaves the model as found. Here they become a Picture: for an image model, each
head's attention from the class token (a model with no class token: the mean over query
tokens) to every patch, laid on the patch grid engine.layout finds (prefix tokens, grid), and
the rollout's class-token row on the same grid; for a text model (no image input, or tokens
that lie on no grid of the image), the token x token matrices and the rollout matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hookcli.commands.pictures import (
    Picture,
    check_image_index,
    input_image,
    input_notes,
    scaled_each,
    tiles_uint8,
)
from hookcli.engine.attention import (
    DECODER,
    ENCODER,
    HF,
    HOW,
    AttentionCall,
    AttentionPass,
    capture_attention,
    find_attention,
    pick_block,
    rollout,
)
from hookcli.engine.layout import Layout, image_of, reader
from hookcli.engine.prepare import Prepared, prepare
from hookcli.errors import UsageError
from hookcli.options import AttnOptions, InputOptions, ModelOptions

_CLASS_TOKENS = ("class_token", "cls_token")


def has_class_token(model: torch.nn.Module) -> bool:
    """Whether the model holds a class token (torchvision `class_token`, timm and Hugging Face
    `cls_token`): the first token of its sequences. Register tokens are not one."""
    return any(
        name.rpartition(".")[2] in _CLASS_TOKENS
        for name, _ in [*model.named_parameters(), *model.named_buffers()]
    )


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _heat(m: torch.Tensor) -> np.ndarray[Any, np.dtype[np.float32]]:
    """One map scaled to its own range, float32 in [0, 1]."""
    out: np.ndarray[Any, np.dtype[np.float32]] = (
        scaled_each(m.unsqueeze(0))[0].float().cpu().numpy().astype(np.float32)
    )
    return out


def attention_maps(model: ModelOptions, inputs: InputOptions, options: AttnOptions) -> Picture:
    """One block's per-head attention of one image, and the rollout over every block."""
    prepared = prepare(model, inputs=inputs)
    loaded, model_input = prepared.loaded, prepared.model_input
    assert model_input is not None
    sites = find_attention(loaded.module)
    block = pick_block(prepared, sites, options.layer)
    got = capture_attention(prepared, sites, keep={s.name for s in sites if s.block == block})
    calls = [c for c in got.calls if c.site.block == block]
    if not calls:
        names = ", ".join(s.name for s in sites if s.block == block)
        raise UsageError(
            f"block {block}'s attention ({names}) gave no probabilities in this forward pass: "
            "it did not run, or computes them where hookcli does not read them.",
            "pick a block that runs (`hookcli layers MODEL --shapes` shows calls).",
        )
    first = calls[0]
    probs = first.probs
    if probs is None:
        raise UsageError(
            f"block {block}'s attention ({first.site.name}, {first.site.type}) returned "
            f"attentions of shape {_shape(first.shape)}, not (batch, heads, queries, keys): "
            "which dimension is the head cannot be told, and hookcli does not guess one.",
            "load the model with eager attention (attn_implementation='eager'); flash "
            "attention returns no probabilities.",
        )
    if first.cross:
        return _cross_maps(prepared, got, first, probs, options)
    if not first.square:
        raise UsageError(
            f"block {block}'s attention ({first.site.name}, {first.site.type}) gave "
            f"probabilities of shape {_shape(first.shape)}, not (batch, heads, L, L): it is "
            "not self-attention over one token sequence.",
            "pick another block: attn reads self-attention (ViT, DeiT, BERT …).",
        )
    b, heads, length, _ = probs.shape
    size, batch = image_of(model_input.forward_values())
    if batch is not None and b != batch:
        raise UsageError(
            f"block {block}'s attention has {b} rows for {batch} input image(s) "
            f"({_shape(first.shape)}): it attends within windows, so there is no "
            "token x token map of the whole input.",
            "attn reads global self-attention (ViT, DeiT, BERT …), not windowed attention.",
        )
    index = options.image_index
    check_image_index(index, probs)
    usable = _stack(got.calls, first.site.side, b, length)
    rolled = rollout([c.mean for c in usable if c.mean is not None])
    notes = prepared.notes + got.notes + input_notes(model_input, index)
    if len(calls) > 1:
        notes.append(f"block {block} ran {len(calls)} times: call 0 drawn; the rollout has all")
    if len(usable) < len(got.calls):
        notes.append(
            f"{len(got.calls) - len(usable)} attention call(s) over another token sequence "
            "left out of the rollout"
        )
    layout = None
    if size is not None:
        try:
            layout = reader(loaded.module, size, batch)(block, (b, length, heads))
        except UsageError as exc:
            notes.append(f"{exc.message} Drawn as token x token matrices")
    legend = [
        f"block {block}: {first.site.name} ({first.site.type}), {heads} heads; "
        f"probabilities {_shape(first.shape)} (batch x heads x query x key tokens)",
    ]
    blocks = len({c.site.block for c in usable})
    rolled_how = (
        f"rollout over {len(usable)} attention calls of {blocks} blocks (Abnar & Zuidema): "
        "heads averaged, identity added for the residual, rows renormalised, multiplied "
        "through the blocks"
    )
    p = probs[index].double()
    r = rolled[index]
    row_tokens = col_tokens = None
    if layout is not None:
        if options.queries is not None:  # (it would be ignored: no token rows are drawn)
            raise UsageError(
                f"--queries picks rows of a token x token map; {block}'s attention is drawn "
                f"on the image's grid ({layout.label}), every query token at once.",
                "drop --queries.",
            )
        tiles, heat, lines = _on_grid(p, r, layout, has_class_token(loaded.module))
        legend += lines
        shown = layout.label
    else:
        rows = query_rows(options.queries, length)
        tiles, heat = tiles_uint8(p[:, rows]), _heat(r[rows])
        side = "the decoder's " if first.site.side == DECODER else ""
        span = (
            f"rows are {side or 'the '}query tokens {rows.start}-{rows.stop - 1} of {length}"
            if rows != slice(0, length)
            else f"rows are {side or 'the '}{_tokens(length, 'query')}"
        )
        legend.append(
            f"token x token: {span}, columns the key tokens; each head and the rollout scaled "
            "from their own minimum to maximum"
        )
        shown = f"tokens:{length}x{length}"
        if first.site.side == DECODER:
            words = decoder_tokens(prepared, index, length)
        else:
            words = position_tokens(model_input, index, length)
        if words is not None:
            row_tokens, col_tokens = words[rows], words
    legend += [rolled_how, f"read: {_how(got, first)}"]
    if not loaded.pretrained:
        notes.append("weights are random (--weights none): the attention shows nothing learned")
    return Picture(
        title=f"attention · {loaded.spec} · {block} · {loaded.kind.item} {index}",
        image=input_image(model_input, index, loaded) if layout is not None else None,
        tiles=tiles,
        labels=[f"head {h}" for h in range(heads)],
        heat=heat,
        raw=probs.cpu().numpy().astype(np.float32),
        legend=legend,
        notes=notes,
        layer=block,
        call=first.call,
        layout=shown,
        rollout=rolled.float().cpu().numpy(),
        row_tokens=row_tokens,
        col_tokens=col_tokens,
    )


def _tokens(n: int, what: str) -> str:
    return f"{n} {what} token{'s' if n != 1 else ''}"


def _how(got: AttentionPass, call: AttentionCall) -> str:
    kind = call.site.kind
    return HOW[kind] + (f"; it was {got.hf_was}" if kind == HF and got.hf_was else "")


def _stack(calls: Sequence[AttentionCall], side: str, b: int, length: int) -> list[AttentionCall]:
    """The self-attention calls one rollout multiplies through: over sequences of `length`
    tokens, `b` of them, on the same side of an encoder-decoder as the block drawn (the
    encoder's blocks for the encoder, the decoder's for the decoder)."""
    return [
        c
        for c in calls
        if c.mean is not None
        and c.self_attention
        and c.shape[0] == b
        and c.shape[2] == length
        and c.site.side == side
    ]


def _cross_maps(
    prepared: Prepared,
    got: AttentionPass,
    first: AttentionCall,
    probs: torch.Tensor,
    options: AttnOptions,
) -> Picture:
    """A cross-attention block: queries are the decoder's tokens, keys the encoder's (the
    text's), drawn as query x key matrices; the rollout is the encoder's, carried through this
    cross-attention (its heads averaged): R = Ā_cross · R_encoder, each decoder query's
    attention traced to the input tokens (the decoder's own self-attention not included)."""
    loaded, model_input = prepared.loaded, prepared.model_input
    assert model_input is not None
    block = first.site.block
    b, heads, queries, keys = probs.shape
    index = options.image_index
    check_image_index(index, probs)
    encoder = _stack(got.calls, ENCODER if first.site.side else "", b, keys)
    if not first.site.side:  # no encoder known: the self-attention that ran before this one
        at = next(i for i, c in enumerate(got.calls) if c is first)
        before = {id(c) for c in got.calls[:at]}
        encoder = [c for c in encoder if id(c) in before]
    assert first.mean is not None
    if encoder:
        carried = first.mean.double() @ rollout([c.mean for c in encoder if c.mean is not None])
        rolled_how = (
            f"rollout: the encoder's over its {len(encoder)} self-attention calls (Abnar & "
            "Zuidema: heads averaged, identity added, rows renormalised, multiplied through), "
            "carried through this cross-attention (heads averaged): each decoder query's "
            "attention traced to the input tokens; the decoder's self-attention not included"
        )
    else:
        carried = first.mean.double()
        rolled_how = (
            "rollout: no encoder self-attention over these keys was read, so this is the "
            "cross-attention's mean over heads"
        )
    calls = [c for c in got.calls if c.site.block == block]
    notes = prepared.notes + got.notes + input_notes(model_input, index)
    if len(calls) > 1:
        notes.append(f"block {block} ran {len(calls)} times: call 0 drawn")
    rows = query_rows(options.queries, queries)
    p, r = probs[index].double(), carried[index]
    span = (
        f"rows are the decoder's query tokens {rows.start}-{rows.stop - 1} of {queries}"
        if rows != slice(0, queries)
        else f"rows are the decoder's {_tokens(queries, 'query')}"
    )
    legend = [
        f"block {block}: {first.site.name} ({first.site.type}), cross-attention, {heads} heads; "
        f"probabilities {_shape(first.shape)} (batch x heads x decoder query tokens x encoder "
        "key tokens)",
        f"query x key: {span}, columns the encoder's {_tokens(keys, 'key')} (the text); each head "
        "and the rollout scaled from their own minimum to maximum",
        rolled_how,
        f"read: {_how(got, first)}",
    ]
    decoder = decoder_tokens(prepared, index, queries)
    words = position_tokens(model_input, index, keys)
    if not loaded.pretrained:
        notes.append("weights are random (--weights none): the attention shows nothing learned")
    return Picture(
        title=f"cross-attention · {loaded.spec} · {block} · {loaded.kind.item} {index}",
        image=None,
        tiles=tiles_uint8(p[:, rows]),
        labels=[f"head {h}" for h in range(heads)],
        heat=_heat(r[rows]),
        raw=probs.cpu().numpy().astype(np.float32),
        legend=legend,
        notes=notes,
        layer=block,
        call=first.call,
        layout=f"tokens:{queries}x{keys}",
        rollout=carried.float().cpu().numpy(),
        row_tokens=decoder[rows] if decoder is not None else None,
        col_tokens=words,
    )


def query_rows(spec: str | None, length: int) -> slice:
    """--queries START:END (Python's slice, negatives from the end: -16: the last 16) as the
    rows of a length x length matrix."""
    if spec is None:
        return slice(0, length)
    start_s, sep, end_s = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        start = int(start_s) if start_s.strip() else None
        end = int(end_s) if end_s.strip() else None
    except ValueError:
        raise UsageError(
            f"--queries {spec!r} is not START:END.", "for example --queries -16: (the last 16)."
        ) from None
    rows = slice(*slice(start, end).indices(length)[:2])
    if rows.stop <= rows.start:
        raise UsageError(
            f"--queries {spec} selects no query of the {length} tokens.",
            f"give a range within 0:{length}, e.g. --queries -16:",
        )
    return rows


def position_tokens(model_input: Any, index: int, length: int) -> list[str] | None:
    """The token at each position of sequence `index` (padding as <pad>), when the input is
    text of that length; None otherwise."""
    texts = model_input.texts
    ids = model_input.kwargs.get("input_ids")
    if not texts or not isinstance(ids, torch.Tensor) or ids.shape[-1] != length:
        return None
    mask = model_input.token_mask
    real = [True] * length if mask is None else mask[index].cpu().tolist()
    words = iter(texts[index].tokens)
    return [next(words, "?") if keep else "<pad>" for keep in real]


def decoder_tokens(prepared: Prepared, index: int, length: int) -> list[str] | None:
    """The token at each position of the decoder's input of sequence `index`
    (decoder_input_ids through the model's tokenizer; padding as <pad>), when it has that
    length; None otherwise."""
    model_input = prepared.model_input
    tokenizer = prepared.loaded.tokenizer
    ids = model_input.kwargs.get("decoder_input_ids") if model_input is not None else None
    if tokenizer is None or not isinstance(ids, torch.Tensor) or ids.shape[-1] != length:
        return None
    from hookcli.sources.tokentext import Pieces

    assert model_input is not None
    mask = model_input.kwargs.get("decoder_attention_mask")
    row = ids[index].tolist()
    real = [True] * length if not isinstance(mask, torch.Tensor) else mask[index].bool().tolist()
    words = iter(Pieces(tokenizer).sequence([i for i, keep in zip(row, real, strict=True) if keep]))
    return [next(words, "?") if keep else "<pad>" for keep in real]


def _on_grid(
    p: torch.Tensor, r: torch.Tensor, layout: Layout, class_token: bool
) -> tuple[np.ndarray[Any, np.dtype[np.uint8]], np.ndarray[Any, np.dtype[np.float32]], list[str]]:
    """Per-head maps (H, h, w) and the rollout map (h, w) of one image on the patch grid:
    the class token's row (no class token: the mean over query tokens), prefix tokens
    dropped."""
    k = layout.prefix
    h, w = layout.grid
    use_class = class_token and k >= 1
    rows = p[:, 0, :] if use_class else p.mean(dim=1)  # (heads, L)
    row = r[0] if use_class else r.mean(dim=0)  # (L,)
    maps = rows[:, k:].reshape(-1, h, w)
    source = "the class token" if use_class else f"every query token (mean of {p.shape[1]})"
    lines = [
        f"tokens: {k} prefix + {h}x{w} patches ({layout.how}); each head: attention from "
        f"{source} to each patch, scaled from its own minimum to maximum"
    ]
    if k:
        lines.append(
            f"attention to the {k} prefix token{'s' if k != 1 else ''} is not drawn "
            f"({float(rows[:, :k].sum(dim=1).mean()):.0%} of each row, mean over heads)"
        )
    lines.append(
        f"rollout: its {'class-token row' if use_class else 'mean row'} on the patch grid, "
        "scaled the same way"
    )
    return tiles_uint8(maps), _heat(row[k:].reshape(h, w)), lines
