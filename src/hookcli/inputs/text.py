"""Text → a language model's input: `--text` (repeatable: a padded batch with its attention
mask), `--text-file` (one sequence per line), `--chat` (each text a user turn through the
tokenizer's chat template). The tokens of each sequence are kept for the report, and a padded
batch carries the mask that keeps padding out of every statistic.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hookcli.errors import UsageError, one_line
from hookcli.records import TextInfo
from hookcli.sources.tokentext import Pieces

if TYPE_CHECKING:
    from hookcli.inputs import ModelInput
    from hookcli.options import InputOptions
    from hookcli.sources import LoadedModel

TEXT_FILE_MAX = 16 << 20  # bytes of a --text-file: far beyond any prompt list
SHOWN = 60  # characters of a text the description shows


def texts_of(inputs: InputOptions) -> list[str]:
    """--text values, then --text-file's lines (blank lines skipped)."""
    texts = list(inputs.text)
    if inputs.text_file is not None:
        texts += _lines(inputs.text_file)
    for i, text in enumerate(texts):
        if not text.strip():
            raise UsageError(
                f"text {i} is empty: there is nothing to tokenize.", "give non-empty --text."
            )
    return texts


def _lines(name: str) -> list[str]:
    from hookcli.io.output import note_read, user_path

    try:
        if name == "-":  # standard input, as other command-line tools read it
            raw = _stdin()
        else:
            path = user_path(name, "--text-file")
            note_read(path)
            _regular(path, name)
            if path.stat().st_size > TEXT_FILE_MAX:
                raise UsageError(
                    f"--text-file {name} is over {TEXT_FILE_MAX >> 20} MB.",
                    "give a shorter file, one sequence a line.",
                )
            # (bytes: no newline translation, a lone CR splits no line; a BOM is no text)
            raw = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"--text-file {name} is not UTF-8 text ({one_line(exc)}).",
            "give a UTF-8 text file, one sequence a line.",
        ) from exc
    except OSError as exc:
        raise UsageError(
            f"cannot read --text-file {name}: {one_line(exc)}.", "check the file."
        ) from exc
    lines = [line.rstrip("\r") for line in raw.split("\n") if line.strip()]
    if not lines:
        raise UsageError(f"--text-file {name} holds no text.", "give one sequence a line.")
    return lines


def _regular(path: Path, name: str) -> None:
    """A --text-file that is not a regular file, named as what it is (not "not found")."""
    import stat

    if not path.exists():
        raise UsageError(f"--text-file {name} not found.", "give a text file, one sequence a line.")
    if path.is_dir():
        raise UsageError(
            f"--text-file {name} is a folder.", "give a text file in it, one sequence a line."
        )
    if not stat.S_ISREG(path.stat().st_mode):
        what = "a pipe" if stat.S_ISFIFO(path.stat().st_mode) else "a device or special file"
        raise UsageError(
            f"--text-file {name} is {what}, not a regular file.",
            "give a text file, or pipe the text in with --text-file - (standard input).",
        )


def _stdin() -> str:
    """Standard input as text, at most TEXT_FILE_MAX bytes; a terminal is refused (nothing
    would arrive until the user typed the end of input)."""
    import sys

    stream = sys.stdin
    kept = getattr(stream, "hookcli_text", None)
    if isinstance(kept, str):  # read once (a run reads its texts more than once)
        return kept
    if stream is None or stream.isatty():
        raise UsageError(
            "--text-file - reads standard input, which is a terminal here.",
            "pipe the text in (cat prompts.txt | hookcli …), or give a file.",
        )
    buffer = getattr(stream, "buffer", None)
    data = buffer.read(TEXT_FILE_MAX + 1) if buffer is not None else stream.read().encode()
    if len(data) > TEXT_FILE_MAX:
        raise UsageError(
            f"--text-file - (standard input) is over {TEXT_FILE_MAX >> 20} MB.",
            "give a shorter text, one sequence a line.",
        )
    text = bytes(data).decode("utf-8-sig")
    with contextlib.suppress(AttributeError):
        stream.hookcli_text = text  # type: ignore[union-attr]
    return text


def from_text(
    loaded: LoadedModel,
    inputs: InputOptions,
    *,
    texts: Sequence[str] | None = None,
    shown: Sequence[str] | None = None,
    pad_to: int | None = None,
) -> ModelInput:
    """The texts through the model's tokenizer (loaded.tokenizer) into input_ids and
    attention_mask (and what the model's task adds: a seq2seq LM's decoder start). A batched
    text run (commands/folder.py) gives each batch's `texts` (rendered through the chat
    template already with --chat; `shown` as the user gave them) padded to `pad_to` tokens,
    the longest of the whole run; one batch is at most ONE_BATCH_TEXTS texts."""
    from hookcli.inputs import ModelInput

    tokenizer = loaded.tokenizer
    assert tokenizer is not None
    if texts is None:
        texts = texts_of(inputs)
        one_batch(len(texts))
        shown = texts
        if inputs.chat:
            from hookcli.inputs.chat import render_chat

            texts = render_chat(tokenizer, texts)
    texts, shown = list(texts), list(shown if shown is not None else texts)
    notes: list[str] = []
    # (one text is never padded: no pad token, no side needed)
    batch = len(texts) > 1 or pad_to is not None
    side = _generating_side(loaded, inputs) if inputs.generating else inputs.padding_side
    side = side if batch else None
    no_pad = batch and getattr(tokenizer, "pad_token_id", None) is None
    if no_pad or (side is not None and side != getattr(tokenizer, "padding_side", side)):
        tokenizer = copy.deepcopy(tokenizer)  # the model's own is left as it was
    if no_pad:
        eos = getattr(tokenizer, "eos_token", None)
        if eos is None:
            raise UsageError(
                f"{len(texts)} texts need padding to form one batch, and the tokenizer has "
                "neither a pad token nor an end-of-sequence token.",
                "give one --text at a time.",
            )
        tokenizer.pad_token = eos  # as generate() and most fine-tuning scripts do
        notes.append(f"padded with {eos!r} (the tokenizer has no pad token)")
    if side is not None:
        tokenizer.padding_side = side
    try:
        enc = tokenizer(
            texts,
            return_tensors="pt",
            padding="max_length" if pad_to is not None else len(texts) > 1,
            max_length=pad_to,
            add_special_tokens=not inputs.chat,  # a chat template writes its own
        )
    except Exception as exc:
        raise UsageError(
            f"the tokenizer could not encode the text: {one_line(exc)}.", "check the text."
        ) from exc
    ids = enc["input_ids"].long()
    mask = enc.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask.long()
    _check_ids(loaded, ids, mask)
    pieces = Pieces(tokenizer)  # each token readable: hookcli.sources.tokentext
    infos = [
        TextInfo(text, real, pieces.sequence(real))
        for text, row, keep in zip(shown, ids.tolist(), mask.tolist(), strict=True)
        for real in [[i for i, m in zip(row, keep, strict=True) if m]]
    ]
    named = {"input_ids": ids, "attention_mask": mask}
    labels, target_note = _targets(loaded, inputs, tokenizer, len(texts), named)
    positions = labels is None and _positions_from_mask(loaded, mask, named)
    _, kwargs, note = loaded.kind.spec_inputs([], named)
    note += target_note
    if positions:
        note += POSITIONS_NOTE
    elif labels is None and _left_padded(loaded, mask):  # (never silently: see below)
        note += UNPOSITIONED_NOTE
    elif _left_padded(loaded, mask, unpositioned=True):
        note += SEQ2SEQ_LEFT_NOTE
    padded = bool((mask == 0).any())
    side = getattr(tokenizer, "padding_side", "right")
    lengths = [len(t.ids) for t in infos]  # each sequence's, in order
    listed = ", ".join(map(str, lengths[:SHOWN_LENGTHS]))
    if len(lengths) > SHOWN_LENGTHS:  # a long text file: the rest are in input.texts
        listed += f", … (+{len(lengths) - SHOWN_LENGTHS})"
    size = "x".join(map(str, ids.shape))
    description = (
        f"{len(texts)} text{'s' if len(texts) != 1 else ''} ({size} tokens"
        + (f", padded on the {side}: {listed} real" if padded else "")
        + "): "
        + "; ".join(repr(_short(t)) for t in shown[:3])
        + (f", … (+{len(shown) - 3})" if len(shown) > 3 else "")
        + note.replace(", decoder_input_ids", "; decoder_input_ids")
    )
    preprocessing = f"tokenizer {loaded.tokenizer_label}" + (
        ", each text a user turn of its chat template" if inputs.chat else ""
    )
    if notes:
        preprocessing += "; " + "; ".join(notes)
    return ModelInput(
        (),
        description,
        preprocessing=preprocessing,
        kwargs=kwargs,
        texts=infos,
        token_mask=mask.bool() if padded else None,
        labels=labels,
        positions_from_mask=positions,
    )


def _positions_from_mask(
    loaded: LoadedModel, mask: torch.Tensor, named: dict[str, torch.Tensor]
) -> bool:
    """A batch padded on the left, for a decoder-only model (a causal LM, a classifier on
    one) whose forward takes position_ids: each text's positions counted from its first real
    token (named["position_ids"]), as model.generate counts them, not from the batch's first
    column. A model with learned
    absolute positions (GPT-2) would otherwise run a short text's tokens at the positions its
    padding pushed them to (rotary ones see only relative positions, and are the same
    either way). A forward that does not name position_ids (a wrapper's `**kwargs`, which
    may not pass them on) gets none, as model.generate gives none, and the input says so."""
    if not _left_padded(loaded, mask) or not _takes(loaded.module, "position_ids"):
        return False  # (a forward that does not name them: UNPOSITIONED_NOTE says so)
    positions = mask.cumsum(-1) - 1
    named["position_ids"] = positions.masked_fill(mask == 0, 1)  # (generate's fill)
    return True


def _left_padded(loaded: LoadedModel, mask: torch.Tensor, *, unpositioned: bool = False) -> bool:
    """A batch with padding before a token: a decoder-only model's (a causal LM, or a
    decoder-only classifier such as GPT2ForSequenceClassification); `unpositioned`: any other
    text model's instead (an encoder-decoder, an encoder such as BERT: given no
    position_ids)."""
    if _decoder_only(loaded) == unpositioned:
        return False
    return bool(((mask[:, :-1] == 0) & (mask[:, 1:] == 1)).any())


def _decoder_only(loaded: LoadedModel) -> bool:
    """A decoder-only model: a causal LM, or a head on one (GPT-2's, Llama's sequence
    classifier: its config's model type has a causal LM and no masked LM in transformers'
    tables, and no encoder-decoder). BERT's has a masked LM, BART's is an encoder-decoder."""
    from hookcli.sources.lm import CausalLM, Seq2SeqLM

    kind = loaded.kind
    if isinstance(kind, CausalLM):
        return not isinstance(kind, Seq2SeqLM)
    config = getattr(loaded.module, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str) or getattr(config, "is_encoder_decoder", False):
        return False
    try:
        from transformers.models.auto import modeling_auto
    except Exception:  # (a config without transformers: nothing is known)
        return False
    causal = getattr(modeling_auto, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", {})
    masked = getattr(modeling_auto, "MODEL_FOR_MASKED_LM_MAPPING_NAMES", {})
    return model_type in causal and model_type not in masked


def _generating_side(loaded: LoadedModel, inputs: InputOptions) -> str:
    """The side --generate pads a batch on: a decoder-only LM's left (model.generate appends
    each new token after the last real one), an encoder-decoder's right (its new tokens go
    to the decoder; left padding moves the encoder's learned positions)."""
    from hookcli.sources.lm import Seq2SeqLM

    if isinstance(loaded.kind, Seq2SeqLM):
        return inputs.padding_side or "right"
    if inputs.padding_side == "right":
        raise UsageError(
            "--generate pads a decoder-only model's batch of texts on the left (model.generate "
            "appends each new token after the last real one); --padding-side right cannot apply.",
            "drop --padding-side right.",
        )
    return "left"


def _takes(module: Any, name: str) -> bool:
    """Whether the module's forward names the keyword argument `name`."""
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _targets(
    loaded: LoadedModel,
    inputs: InputOptions,
    tokenizer: Any,
    count: int,
    named: dict[str, torch.Tensor],
) -> tuple[torch.Tensor | None, str]:
    """--target-text: each text's target through the tokenizer as the decoder's input
    (shifted right after the decoder's start token, as the model's own
    prepare_decoder_input_ids_from_labels makes it) and the labels, -100 at padding."""
    from hookcli.engine.targets import IGNORE
    from hookcli.sources.lm import Seq2SeqLM

    targets = list(inputs.target_text)
    if not targets:
        return None, ""
    kind = loaded.kind
    if not isinstance(kind, Seq2SeqLM):
        raise UsageError(
            f"--target-text is a seq2seq model's target (its decoder's text); {loaded.spec} is "
            f"{loaded.task}.",
            "drop --target-text: a causal LM's loss is the next token of the text itself.",
        )
    if len(targets) != count:
        raise UsageError(
            f"{len(targets)} --target-text for {count} texts: one target per text.",
            "give --target-text once for each --text, in order.",
        )
    if any(not t.strip() for t in targets):
        raise UsageError("a --target-text is empty.", "give each target its text.")
    try:
        enc = tokenizer(
            text_target=targets,
            return_tensors="pt",
            padding=len(targets) > 1,
            padding_side="right",  # the decoder starts at position 0, whatever the batch's side
        )
    except Exception as exc:
        raise UsageError(
            f"the tokenizer could not encode the target text: {one_line(exc)}.",
            "check --target-text.",
        ) from exc
    ids = enc["input_ids"].long()
    keep = enc.get("attention_mask")
    keep = torch.ones_like(ids) if keep is None else keep.long()
    _check_ids(loaded, ids, keep)
    texts = named["attention_mask"]
    if ids.shape[1] == texts.shape[1] and bool((texts == 0).any()):
        # the decoder's (batch, tokens) would read as the texts' and lose the texts' padding
        # positions: the targets one position longer, padding (ignored, masked)
        pad = getattr(tokenizer, "pad_token_id", None)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], pad if pad is not None else 0)], 1)
        keep = torch.cat([keep, torch.zeros_like(keep[:, :1])], 1)
    labels = ids.masked_fill(keep == 0, IGNORE)
    prepare = getattr(loaded.module, "prepare_decoder_input_ids_from_labels", None)
    decoder: Any = None
    if callable(prepare):
        try:
            decoder = prepare(labels=labels)
        except Exception:  # a model whose own shift needs what its config lacks
            decoder = None
    if not isinstance(decoder, torch.Tensor) or tuple(decoder.shape) != tuple(ids.shape):
        pad = getattr(tokenizer, "pad_token_id", None)
        decoder = torch.full_like(ids, kind.start)
        decoder[:, 1:] = ids[:, :-1].masked_fill(keep[:, :-1] == 0, pad if pad is not None else 0)
    named["decoder_input_ids"] = decoder.long()
    padded = bool((keep == 0).any())
    if padded:
        named["decoder_attention_mask"] = keep
    tokens = int((labels != IGNORE).sum())
    note = (
        f"; decoder_input_ids the target text{'s' if count > 1 else ''} shifted right after the "
        f"start token ({tokens} target tokens"
        + (
            "; statistics of decoder-side tensors count the targets' padding positions"
            if padded
            else ""
        )
        + ")"
    )
    return labels, note


POSITIONS_NOTE = "; position_ids from the attention mask (each text's first token at 0)"
UNPOSITIONED_NOTE = (
    "; no position_ids (the model's forward does not name them): a text's positions count from"
    " the batch's first column, its padding included — learned absolute positions (GPT-2) then"
    " differ from the text's alone: --padding-side right"
)
SEQ2SEQ_LEFT_NOTE = (
    "; padded on the left: this model gets no position_ids, so a text's positions count from"
    " the batch's first column, its padding included — learned positions (BART, BERT) then"
    " differ from the text's alone, and a first-token classifier (BERT's [CLS]) reads padding:"
    " --padding-side right"
)
SHOWN_LENGTHS = 16  # the input line's real lengths, sequence by sequence, up to this many
ONE_BATCH_TEXTS = 1024  # texts one padded batch takes; inspect, grads and check batch more


def one_batch(count: int) -> None:
    """More texts than one padded batch should hold (a --text-file of 600,000 lines would be
    gigabytes of padding and activations at once), refused where a command reads one batch."""
    if count > ONE_BATCH_TEXTS:
        raise UsageError(
            f"{count} texts in one padded batch: this reads one batch, of at most "
            f"{ONE_BATCH_TEXTS} texts.",
            "give fewer lines, or run inspect/check (they run a long --text-file in batches "
            "and merge the statistics).",
        )


def token_lengths(loaded: LoadedModel, texts: Sequence[str], chat: bool) -> list[int]:
    """Each text's number of tokens (texts rendered through the chat template already)."""
    tokenizer = loaded.tokenizer
    assert tokenizer is not None
    lengths: list[int] = []
    for start in range(0, len(texts), LENGTH_CHUNK):  # (a long file: flat memory)
        try:
            ids = tokenizer(list(texts[start : start + LENGTH_CHUNK]), add_special_tokens=not chat)[
                "input_ids"
            ]
        except Exception as exc:
            raise UsageError(
                f"the tokenizer could not encode the text: {one_line(exc)}.", "check the text."
            ) from exc
        lengths += [len(x) for x in ids]
    return lengths


LENGTH_CHUNK = 4096  # texts tokenized at once to find the longest


def _short(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= SHOWN else flat[: SHOWN - 1] + "…"


def _check_ids(loaded: LoadedModel, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Sequences the model cannot take, refused before the pass: longer than its positions,
    or ids past its vocabulary (a tokenizer of another model)."""
    if ids.shape[-1] == 0:
        raise UsageError("the text gave no tokens.", "give longer --text.")
    limit = loaded.max_tokens
    if limit is not None and ids.shape[-1] > limit:
        longest = int(mask.sum(-1).max())
        raise UsageError(
            f"a sequence of {longest} tokens is longer than {loaded.spec} takes ({limit}, its "
            "config's maximum positions).",
            f"shorten the text to at most {limit} tokens.",
        )
    vocab = getattr(loaded.kind, "vocab_size", None)
    top = int(ids.max())
    if isinstance(vocab, int) and top >= vocab:
        raise UsageError(
            f"the tokenizer gave token id {top}, past {loaded.spec}'s vocabulary of {vocab}: "
            "it is not this model's tokenizer.",
            "give the model's own tokenizer with --tokenizer PATH|ORG/NAME.",
        )


__all__: Sequence[str] = (
    "from_text", "one_batch", "texts_of", "token_lengths",
)  # fmt: skip
