"""--per-token as a probe: statistics per position of every (batch, tokens, C) tensor, each row
labelled with its token; padding left out. Reads one batch of text."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hookcli.engine.probes import Armed, Measured, Probe
from hookcli.errors import UsageError
from hookcli.inputs import ModelInput
from hookcli.records import LayerCall, Report, TensorStats


class PerToken(Probe):
    option = "per_token"
    flag = "per-token"
    text_only = True

    @contextlib.contextmanager
    def arm(self, armed: Armed) -> Iterator[None]:
        grid = token_grid(armed.model_input)
        decoder_ids = armed.model_input.kwargs.get("decoder_input_ids")
        if not isinstance(decoder_ids, torch.Tensor):
            armed.collector.per_token = grid
            yield
            return
        # an encoder-decoder: the decoder's (batch, targets, C) tensors are no rows of the
        # encoder's tokens, even where as many targets as tokens make their shapes alike
        with encoder_window(armed.prepared.loaded.module, armed.collector, grid, decoder_ids):
            yield

    def finish(self, measured: Measured, report: Report) -> None:
        label_tokens(report.layers, measured.model_input, report.outputs)
        if measured.model_input.generate is not None:  # (never left out without a word)
            report.notes.append(
                "--per-token: the prompt's positions (each layer's call 0); the calls of the "
                "generated tokens, one position each with the KV cache, have no per-token rows"
            )
        decoder = measured.model_input.kwargs.get("decoder_input_ids")
        if isinstance(decoder, torch.Tensor) and decoder.shape[-1] > 1:  # (never in silence)
            report.notes.append(
                "--per-token: rows are of the encoder's tokens (input_ids), in the encoder's "
                f"calls; the decoder's calls (its {decoder.shape[-1]} target positions, and "
                "the encoder's states it reads) have none"
            )


@contextlib.contextmanager
def encoder_window(
    model: Any, collector: Any, grid: tuple[int, int], decoder_ids: torch.Tensor
) -> Iterator[None]:
    """--per-token on an encoder-decoder: rows only while its encoder runs (switched on as
    the encoder starts, off as the decoder starts: every encoder call, a shared embedding's
    encoder call, the encoder's own output). A model whose encoder and decoder are not known
    (no get_encoder/get_decoder) is refused where the decoder's targets are as many as the
    tokens: their tensors would read as the tokens'."""
    parts = []
    for getter in ("get_encoder", "get_decoder"):
        part = None
        with contextlib.suppress(Exception):
            part = getattr(model, getter)()
        parts.append(part if isinstance(part, torch.nn.Module) else None)
    encoder, decoder = parts
    if encoder is None or decoder is None or encoder is decoder:
        if decoder_ids.dim() == 2 and int(decoder_ids.shape[-1]) == grid[1]:
            raise UsageError(
                f"--per-token on this encoder-decoder: its {grid[1]} decoder positions are as "
                "many as the tokens, and where its encoder ends is not known "
                "(no get_encoder/get_decoder), so the decoder's tensors would read as the "
                "tokens'.",
                "give a target of another length, or drop --per-token.",
            )
        collector.per_token = grid
        yield
        return

    def on(*_: Any) -> None:
        collector.per_token = grid

    def off(*_: Any) -> None:
        collector.per_token = None

    handles = [
        encoder.register_forward_pre_hook(on, prepend=True),
        decoder.register_forward_pre_hook(off, prepend=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        collector.per_token = None


def token_grid(model_input: ModelInput) -> tuple[int, int]:
    """--per-token: the (batch, tokens) of the input's token ids."""
    ids = model_input.kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise UsageError(
            "--per-token needs token ids (a text model's input_ids, batch x tokens).",
            "give --text or --input input_ids=SPEC to a text model, or drop --per-token.",
        )
    return int(ids.shape[0]), int(ids.shape[1])


def label_tokens(
    layers: Sequence[LayerCall], model_input: ModelInput, outputs: Sequence[TensorStats] = ()
) -> None:
    """--per-token rows of every tensor that has them (a call's inputs and outputs, the
    model's own outputs): padding positions left out, each row given the id and the token at
    its position, and its position counted in its own text (a left-padded sequence's first
    real token is position 0, as when the text is run alone)."""
    ids = model_input.kwargs["input_ids"].tolist()
    mask = model_input.token_mask
    real = None if mask is None else mask.cpu().tolist()
    own: dict[tuple[int, int], int] = {}  # (sequence, column) → position in its text
    for b, row in enumerate(ids):
        where = [p for p in range(len(row)) if real is None or real[b][p]]
        own.update({(b, p): i for i, p in enumerate(where)})
    words: dict[tuple[int, int], str] = {}
    for b, text in enumerate(model_input.texts or []):
        words.update({(b, i): tok for i, tok in enumerate(text.tokens)})
    done: set[int] = set()  # a tensor's statistics shared by two places: labelled once
    tensors = [t for call in layers for t in (*call.inputs, *call.outputs)] + list(outputs)
    for t in tensors:
        if t.per_token is None or id(t) in done:
            continue
        done.add(id(t))
        rows = [dataclasses.replace(r) for r in t.per_token]  # (rows may be shared too)
        kept = [r for r in rows if (r.sequence, r.position) in own]
        for r in kept:
            r.id = int(ids[r.sequence][r.position])
            r.position = own[(r.sequence, r.position)]
            r.token = words.get((r.sequence, r.position))
        t.per_token = kept
