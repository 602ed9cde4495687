"""Token ids as readable labels: the one place that spells a token for the predictions, the
tokens of a text (the header, --per-token, attention's axes, JSON `tokens`), the lens and the
generated tokens.

- Byte-level BPE (GPT-2, Llama 3, Qwen, …: vocabulary pieces such as 'Ġthe'): a piece is
  bytes, shown as the text they make (' the', 'é'); a byte that is no whole UTF-8 character
  within the piece is shown as `<0xF0>` (SentencePiece's own spelling of a byte), never '�'.
- SentencePiece (a Metaspace decoder, or one replacing '▁'): the piece as its vocabulary spells
  it, the word-boundary mark kept ('▁the'); byte-fallback pieces `<0xF0>` are bytes as above.
- Added and special tokens: as written ('<s>'). Any other tokenizer (WordPiece, …): the id
  decoded alone. An id past the tokenizer's vocabulary (a model's may be larger): `<id N>`.

In a sequence, a character whose bytes are split over several tokens (an emoji in four
byte tokens) is shown whole once, on the token holding its first byte, followed by its length
in bytes ('😀<4 bytes>'); each later token shows its share of that character's bytes as
`<0x9F>`. A byte that makes no character at all (a sequence cut mid-character) stays `<0xF0>`.

Generated text is the new ids decoded together (tokenizer.decode); where that decoding prints
'�' for bytes that make no character, those bytes are shown as `<0xF0>` instead (and an id
the tokenizer lacks, which decode drops, as `<id N>`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

SPACE_MARK = "\u2581"  # SentencePiece's word-boundary mark, '▁'
BYTE_LEVEL = "byte-level"
SENTENCEPIECE = "sentencepiece"
OTHER = "other"

Unit = str | bytes  # one token: its text, or the bytes it stands for


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet read back: each of its 256 characters → the byte it is."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    chars = list(kept)
    extra = 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(kept, chars, strict=True)}


def _decoder_types(state: Any) -> list[dict[str, Any]]:
    """A tokenizers decoder's JSON state as its list of decoders (a Sequence unrolled)."""
    if not isinstance(state, dict):
        return []
    if state.get("type") == "Sequence":
        return [d for inner in state.get("decoders") or [] for d in _decoder_types(inner)]
    return [state]


def tokenizer_kind(tokenizer: Any) -> tuple[str, bool]:
    """How a tokenizer spells its pieces: byte-level, sentencepiece or other; and whether
    pieces `<0xHH>` are bytes (SentencePiece's byte fallback)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is not None:
        return _decoder_kind(decoder)
    if isinstance(getattr(tokenizer, "byte_decoder", None), dict):  # a slow GPT-2-style one
        return BYTE_LEVEL, False
    if getattr(tokenizer, "sp_model", None) is not None:  # a slow sentencepiece one
        return SENTENCEPIECE, True
    return OTHER, False


def _decoder_kind(decoder: Any) -> tuple[str, bool]:
    """tokenizer_kind of a fast tokenizer, by its decoder."""
    try:
        decoders = _decoder_types(json.loads(decoder.__getstate__()))
    except Exception:  # a decoder that does not serialize: spelled by decoding
        return OTHER, False
    types = {d.get("type") for d in decoders}
    if "ByteLevel" in types:
        return BYTE_LEVEL, False
    marked = any(
        d.get("type") == "Replace" and (d.get("pattern") or {}).get("String") == SPACE_MARK
        for d in decoders
    )
    if "Metaspace" in types or marked:
        return SENTENCEPIECE, "ByteFallback" in types
    return OTHER, False


def decode_alone(tokenizer: Any, i: int) -> str:
    """One id decoded alone ("" for an id the tokenizer does not have)."""
    try:
        return str(tokenizer.decode([i], skip_special_tokens=False))
    except Exception:  # an id past the tokenizer's vocabulary
        return ""


def _byte_piece(piece: str) -> int | None:
    """The byte of a SentencePiece byte piece `<0xF0>`; None for any other piece."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


def _char_length(data: bytes, at: int) -> int:
    """The length of the UTF-8 character starting at data[at], or 0 when no whole, valid
    character starts there."""
    lead = data[at]
    size = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    if lead >= 0xF8 or at + size > len(data):
        return 0
    try:
        data[at : at + size].decode("utf-8")
    except UnicodeDecodeError:
        return 0
    return size


def byte_text(data: bytes) -> str:
    """Bytes as the text they make, each byte that is no whole UTF-8 character as `<0xF0>`."""
    out = []
    at = 0
    while at < len(data):
        size = _char_length(data, at)
        if size:
            out.append(data[at : at + size].decode("utf-8"))
            at += size
        else:
            out.append(f"<0x{data[at]:02X}>")
            at += 1
    return "".join(out)


def _run_labels(run: Sequence[bytes]) -> list[str]:
    """Consecutive byte tokens' labels: whole characters as text; a character split over
    tokens whole on the token of its first byte with its length ('😀<4 bytes>'), its later
    bytes as `<0x9F>` on theirs; a byte of no character as `<0xF0>`."""
    data = b"".join(run)
    owner = [k for k, piece in enumerate(run) for _ in piece]
    parts: list[list[str]] = [[] for _ in run]
    at = 0
    while at < len(data):
        size = _char_length(data, at)
        if not size:
            parts[owner[at]].append(f"<0x{data[at]:02X}>")
            at += 1
            continue
        first = owner[at]
        char = data[at : at + size].decode("utf-8")
        if owner[at + size - 1] == first:
            parts[first].append(char)
        else:
            parts[first].append(f"{char}<{size} bytes>")
            for q in range(at + 1, at + size):
                if owner[q] != first:
                    parts[owner[q]].append(f"<0x{data[q]:02X}>")
        at += size
    return ["".join(p) for p in parts]


class Pieces:
    """A tokenizer's ids as labels (see the module's notes)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kind, self.byte_pieces = tokenizer_kind(tokenizer)
        try:
            added = tokenizer.added_tokens_decoder
            self.added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
        except Exception:
            self.added = {}

    def units(self, ids: Sequence[int]) -> list[Unit]:
        """Each id as its text, or as the bytes it stands for."""
        ids = [int(i) for i in ids]
        if self.kind == OTHER:
            return [decode_alone(self.tokenizer, i) or f"<id {i}>" for i in ids]
        try:
            pieces = list(self.tokenizer.convert_ids_to_tokens(ids))
        except Exception:
            pieces = [None] * len(ids)
        return [self._unit(i, piece) for i, piece in zip(ids, pieces, strict=True)]

    def _unit(self, i: int, piece: Any) -> Unit:
        if i in self.added:
            return self.added[i]
        if not isinstance(piece, str) or not piece:  # an id past the tokenizer's vocabulary
            return decode_alone(self.tokenizer, i) or f"<id {i}>"
        if self.kind == BYTE_LEVEL:
            table = _byte_of_char()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return decode_alone(self.tokenizer, i) or piece
        byte = _byte_piece(piece) if self.byte_pieces else None
        return piece if byte is None else bytes([byte])

    def alone(self, ids: Sequence[int]) -> list[str]:
        """Each id's label by itself (a prediction, a lens cell, a vocabulary entry)."""
        return [u if isinstance(u, str) else byte_text(u) for u in self.units(ids)]

    def sequence(self, ids: Sequence[int]) -> list[str]:
        """The labels of the tokens of one sequence, in order: a character split over
        several tokens shown once (see the module's notes)."""
        units = self.units(ids)
        labels: list[str] = []
        at = 0
        while at < len(units):
            unit = units[at]
            if isinstance(unit, str):
                labels.append(unit)
                at += 1
                continue
            end = at
            while end < len(units) and isinstance(units[end], bytes):
                end += 1
            labels += _run_labels([u for u in units[at:end] if isinstance(u, bytes)])
            at = end
        return labels

    def text(self, ids: Sequence[int]) -> str:
        """The ids decoded together (tokenizer.decode), bytes that make no character shown
        as `<0xF0>` where decode prints '�', an id the tokenizer lacks as `<id N>` where
        decode drops it — when the two agree on everything else (SentencePiece's decoder
        strips the first space: so is it here)."""
        ids = [int(i) for i in ids]
        try:
            decoded = str(self.tokenizer.decode(ids, skip_special_tokens=False))
        except Exception:
            return "".join(self.sequence(ids))
        try:
            size: int | None = len(self.tokenizer)
        except TypeError:
            size = None
        lacked = size is not None and any(not 0 <= i < size for i in ids)
        if ("\ufffd" not in decoded and not lacked) or self.kind == OTHER:
            return decoded
        readable, replaced = [], []
        run = b""
        for i, unit in [*zip(ids, self.units(ids), strict=True), (-1, "")]:
            if isinstance(unit, bytes):
                run += unit
                continue
            readable.append(byte_text(run))
            replaced.append(run.decode("utf-8", "replace"))
            run = b""
            spaced = unit
            if self.kind == SENTENCEPIECE and i not in self.added:
                spaced = unit.replace(SPACE_MARK, " ")
            readable.append(spaced)  # an id the tokenizer lacks: <id N>, which decode drops
            replaced.append("" if size is not None and not 0 <= i < size else spaced)
        shown, lossy = "".join(readable), "".join(replaced)
        if lossy == decoded:
            return shown
        if shown.startswith(" ") and lossy.startswith(" ") and lossy[1:] == decoded:  # (SP)
            return shown[1:]
        return decoded
