"""Language models: the tasks of causal and seq2seq LMs (next tokens out, the next-token loss
as grads' default), their tokenizer (the checkpoint's, offline, never remote code) and the
tokens as labels.

A causal LM's predictions are the top-k next tokens after the last real token of each
sequence (padding is never a position predicted from); a seq2seq LM's, the decoder's next
tokens after the start token (or after the decoder ids given).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import torch
from torch import nn

from hookcli.errors import UsageError, one_line
from hookcli.records import Generated, Prediction
from hookcli.sources.hfbase import HFText, logits_of
from hookcli.sources.tasks import Forward, Row, Task
from hookcli.sources.tokentext import Pieces

if TYPE_CHECKING:
    from hookcli.sources.model import LoadedModel

ModelInput = Any  # hookcli.inputs.ModelInput (inputs sits beside sources: not imported here)

# config fields that bound a sequence's length (the first one set is the bound)
_LENGTH_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")


def max_tokens(config: Any) -> int | None:
    """The most tokens the model takes, by its config (None: not bounded there)."""
    for name in _LENGTH_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class CausalLM(HFText):
    """A causal LM: input_ids (+ attention_mask) in, (B, T, vocab) logits out."""

    name = "causal-lm"
    item = "sequence"
    takes_images = False
    default_target = "next-token"
    ids_key = "input_ids"  # the ids whose next token is predicted

    def __init__(self, vocab_size: int, bos: int | None = None) -> None:
        super().__init__(vocab_size)
        self.bos = bos
        self.positions: list[int] | None = None  # per sequence: where the next token is read
        # per sequence: that token's position in its own text (past any left padding)
        self.own: list[int] | None = None
        self.asked: int | None = None  # --position: the real token read (None: the last)

    def at_position(self, position: int | None) -> CausalLM:
        """This task reading the next token after each sequence's real token `position`
        (0: the first, -1: the last), for_input resolving it per sequence."""
        twin = copy.copy(self)
        twin.asked = position
        return twin

    def for_input(self, model_input: ModelInput) -> Task:
        ids = model_input.kwargs.get(self.ids_key)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return self
        twin = copy.copy(self)
        mask = model_input.kwargs.get("attention_mask") if self.ids_key == "input_ids" else None
        mask = mask if isinstance(mask, torch.Tensor) else None
        if mask is not None and tuple(mask.shape) != tuple(ids.shape):
            raise UsageError(
                f"attention_mask {'x'.join(map(str, mask.shape))} is not shaped as input_ids "
                f"{'x'.join(map(str, ids.shape))}: hookcli reads which tokens are real (where "
                "the next token is read) from a (batch, tokens) mask.",
                "give the (batch, tokens) mask a tokenizer makes.",
            )
        real = (
            [list(range(ids.shape[-1]))] * ids.shape[0]
            if mask is None
            else [[p for p, m in enumerate(row) if m] for row in mask.cpu().tolist()]
        )
        if self.asked is None:  # each sequence's last real token, whichever side is padded
            twin.positions = [r[-1] if r else 0 for r in real]
            twin.own = [len(r) - 1 for r in real]
            return twin
        shortest = min(len(r) for r in real)
        if not -shortest <= self.asked < shortest:
            raise UsageError(
                f"--position {self.asked} is past a sequence of {shortest} tokens.",
                f"give a position from {-shortest} to {shortest - 1} (-1: the last token).",
            )
        twin.positions = [r[self.asked] for r in real]
        twin.own = [self.asked % len(r) for r in real]
        return twin

    def _next(self, output: Any) -> torch.Tensor | None:
        """(B, vocab) logits of each sequence's next token."""
        logits = logits_of(output)
        if not (
            isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.is_floating_point()
        ):
            return None
        positions = self.positions or [logits.shape[1] - 1] * logits.shape[0]
        if len(positions) != logits.shape[0] or max(positions) >= logits.shape[1]:
            positions = [logits.shape[1] - 1] * logits.shape[0]
        rows = torch.arange(logits.shape[0], device=logits.device)
        at = torch.tensor(positions, device=logits.device)
        return logits[rows, at]

    def predict(self, output: Any, topk: int, row: Row) -> tuple[list[Prediction], str] | None:
        scores = self._next(output)
        if scores is None:
            return None
        probs = torch.softmax(scores.detach().double(), dim=-1).cpu()
        shown = min(topk, probs.shape[-1])
        values, idxs = probs.topk(shown, dim=-1)
        preds = [
            row(rank, i, v, seq)
            for seq in range(probs.shape[0])
            for rank, (v, i) in enumerate(
                zip(values[seq].tolist(), idxs[seq].tolist(), strict=True), 1
            )
        ]
        return preds, f"top-{shown} next tokens {self._where()}, by softmax probability"

    def _where(self) -> str:
        """Where the next tokens are read, each a position in its own text."""
        positions = self.own if self.own is not None else self.positions
        if self.asked is not None and positions:
            return f"after real token {self.asked} (position {', '.join(map(str, positions))})"
        if positions and len(set(positions)) == 1:
            return f"after the last real token (position {positions[0]})"
        if positions:
            return (
                "after each sequence's last real token (positions "
                + ", ".join(map(str, positions))
                + ")"
            )
        return "after the last token"

    def scores(self, output: Any) -> torch.Tensor:
        """The next token's logits (B, vocab): --target top1, an id or a token read them."""
        scores = self._next(output)
        if scores is None:
            return super().scores(output)
        return scores


class Seq2SeqLM(CausalLM):
    """An encoder-decoder LM: input_ids (+ mask) into the encoder, decoder_input_ids (by default
    the decoder's start token) into the decoder; predictions are the decoder's next tokens."""

    name = "seq2seq-lm"
    default_target = "top1"  # the next-token loss needs a target text: not the input's
    ids_key = "decoder_input_ids"

    def __init__(self, vocab_size: int, start: int, bos: int | None = None) -> None:
        super().__init__(vocab_size, bos)
        self.start = start

    def decoder(self, kwargs: dict[str, Any]) -> str:
        ids = kwargs.get("input_ids")
        if "decoder_input_ids" in kwargs or not isinstance(ids, torch.Tensor):
            return ""
        kwargs["decoder_input_ids"] = torch.full(
            (ids.shape[0], 1), self.start, dtype=torch.long, device=ids.device
        )
        return f", decoder_input_ids the start token ({self.start})"

    def spec_inputs(
        self, tensors: Sequence[torch.Tensor], named: Mapping[str, torch.Tensor]
    ) -> Forward:
        args, kwargs, note = super().spec_inputs(tensors, named)
        return args, kwargs, note + self.decoder(kwargs)

    def default_input(self, size: tuple[int, int], gen: torch.Generator, seed: int) -> Forward:
        args, kwargs, note = super().default_input(size, gen, seed)
        return args, kwargs, note + self.decoder(kwargs)

    def _where(self) -> str:
        return "of the decoder " + super()._where().replace("real token", "decoder token")


def lm_task(model: nn.Module, head: str) -> CausalLM:
    """The task of a causal or seq2seq LM, from its config."""
    config = getattr(model, "config", None)
    vocab = _vocab_size(model)
    bos = _first_int(getattr(config, "bos_token_id", None))
    if head == "seq2seq-lm":
        start = _first_int(getattr(config, "decoder_start_token_id", None))
        if start is None:
            start = _first_int(getattr(config, "pad_token_id", None))
        return Seq2SeqLM(vocab, 0 if start is None else start, bos)
    return CausalLM(vocab, bos)


def _vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        vocab = getattr(getattr(config, "text_config", None), "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        with _suppress():
            vocab = int(model.get_input_embeddings().num_embeddings)  # type: ignore[operator]
    return vocab if isinstance(vocab, int) and vocab > 0 else 1000


def _suppress() -> Any:
    import contextlib

    return contextlib.suppress(Exception)


def _first_int(value: Any) -> int | None:
    value = value[0] if isinstance(value, list | tuple) and value else value
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class TokenLabels(Sequence[str]):
    """A tokenizer's tokens as class labels: label i is token i spelled alone, readable
    (hookcli.sources.tokentext: ' cat', '▁cat', 'é', '<0xF0>'), for the first `size` ids (the
    model's vocabulary, which may be larger than the tokenizer's: an id the tokenizer lacks
    is labelled `<id N>`)."""

    def __init__(self, tokenizer: Any, size: int) -> None:
        self.tokenizer = tokenizer
        self.size = size
        self.pieces = Pieces(tokenizer)
        self._all: list[str] | None = None
        try:
            self.known = len(tokenizer)
        except TypeError:
            self.known = size

    def label(self, i: int) -> str:
        if i >= self.known:
            return f"<id {i}>"
        text = self.pieces.alone([i])[0]
        return text or f"<id {i}>"

    def find_token(self, text: str) -> int | None:
        """The id of `text` as one token: the one id the tokenizer encodes it to; else the one
        sentencepiece word token spelled as it (▁ read as a space: " cat" is ▁cat); else the
        one id whose label is it. None when no single token is it, or several are."""
        try:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        except Exception:
            ids = []
        if len(ids) == 1 and 0 <= ids[0] < self.size:
            return int(ids[0])
        try:
            raw = self.tokenizer.convert_ids_to_tokens(list(range(min(self.known, self.size))))
        except Exception:
            raw = []
        spelled = [  # sentencepiece: "▁cat" is " cat", which decoding alone strips
            i
            for i, t in enumerate(raw)
            if isinstance(t, str) and t.startswith("\u2581") and t.replace("\u2581", " ") == text
        ]
        if len(spelled) == 1:
            return spelled[0]
        decoded = [i for i, label in enumerate(self) if label == text]
        return decoded[0] if len(decoded) == 1 else None

    def encoded(self, text: str) -> list[str]:
        """text as this tokenizer splits it (for messages)."""
        try:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        except Exception:
            return []
        return self.sequence([int(i) for i in ids])

    def sequence(self, ids: Sequence[int]) -> list[str]:
        """The labels of one sequence's tokens, in order: as each alone, except that a
        character split over several tokens is shown once (hookcli.sources.tokentext)."""
        out: list[str] = []
        run: list[int] = []  # ids the tokenizer has, spelled together
        for i in ids:
            if 0 <= i < self.known:
                run.append(i)
                continue
            out += [*self.pieces.sequence(run), f"<id {i}>"]
            run = []
        out += self.pieces.sequence(run)
        return [t or f"<id {i}>" for i, t in zip(ids, out, strict=True)]

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...
    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.size))]
        if not -self.size <= i < self.size:
            raise IndexError(i)
        if self._all is not None:
            return self._all[i]
        return self.label(i % self.size)

    def __iter__(self) -> Iterator[str]:
        if self._all is None:
            known = min(self.known, self.size)
            spelled = self.pieces.alone(range(known))  # the whole vocabulary in one call
            self._all = [t or f"<id {i}>" for i, t in enumerate(spelled)]
            self._all += [f"<id {i}>" for i in range(known, self.size)]
        return iter(self._all)


# files a folder holds when it has a tokenizer
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
    "spiece.model", "sentencepiece.bpe.model",
)  # fmt: skip


def load_tokenizer(asked: str | None, found: str | None, spec: str) -> tuple[Any, str]:
    """The tokenizer --tokenizer names, else the one beside the checkpoint; and where it came
    from. Offline, never remote code; a folder's JSON files are checked first."""
    from hookcli.sources.base import hf_cache_dir, hf_cache_path
    from hookcli.sources.hfbase import json_file, quiet_transformers, transformers_module

    where = asked if asked is not None else found
    if where is None:
        raise UsageError(
            f"no tokenizer for {spec}: a model built from its type (random init) has none.",
            "give one with --tokenizer PATH|ORG/NAME, or token ids with --input "
            "input_ids=randint:0:VOCAB:1x16.",
        )
    if not where.strip():
        raise UsageError(
            "--tokenizer is empty.", "give a tokenizer folder (PATH) or ORG/NAME from the cache."
        )
    tf = transformers_module()
    from hookcli.io.output import user_path

    local = user_path(where, "--tokenizer")
    if local.exists() and not local.is_dir():
        raise UsageError(
            f"--tokenizer {where} is a file; a tokenizer is a folder (tokenizer.json with "
            "tokenizer_config.json and special_tokens_map.json, as save_pretrained writes).",
            f"give the folder that holds it: --tokenizer {local.parent}",
        )
    is_local = local.is_dir() or where.startswith((".", "/", "~"))
    kwargs: dict[str, Any] = {"trust_remote_code": False}
    if is_local:
        if not local.is_dir():
            raise UsageError(f"tokenizer folder {where} not found.", "check the path.")
        if not any((local / name).is_file() for name in TOKENIZER_FILES):
            raise UsageError(
                f"no tokenizer in {local} (looked for {', '.join(TOKENIZER_FILES[:4])}, …).",
                "give one with --tokenizer PATH|ORG/NAME (a folder tokenizer.save_pretrained "
                "wrote).",
            )
        from hookcli.io.output import MODEL_FOLDER, note_read

        note_read(f"{MODEL_FOLDER}{local}")  # every file of it: no output may replace one
        config = json_file(f"--tokenizer {where}", local / "tokenizer_config.json") or {}
        _refuse_remote(config, where)
        source: str | Path = local
        label = str(local)
    else:
        kwargs.update(local_files_only=True, cache_dir=str(hf_cache_dir()))
        source = where
        label = f"{where} from the local cache"
    try:
        with quiet_transformers(tf):
            tokenizer = tf.AutoTokenizer.from_pretrained(source, **kwargs)
    except Exception as exc:  # a data file's fault, whatever the library
        # raises for it (tokenizers' own errors, a RecursionError on a file nested 10⁵ deep)
        looked = str(local) if is_local else f"{hf_cache_path(where)}/<revision>/"
        raise UsageError(
            f"no tokenizer could be loaded from {looked} ({one_line(exc)}).",
            "give one with --tokenizer PATH|ORG/NAME; hookcli does not download.",
        ) from exc
    if isinstance(tokenizer, bool) or not callable(tokenizer):
        raise UsageError(f"{where} holds no tokenizer.", "give one with --tokenizer PATH.")
    return tokenizer, f"{type(tokenizer).__name__} from {label}"


def _refuse_remote(config: Mapping[str, Any], where: str) -> None:
    if config.get("auto_map"):
        raise UsageError(
            f"the tokenizer in {where} needs code of its own (auto_map in "
            "tokenizer_config.json): hookcli never runs a folder's code.",
            "give a tokenizer transformers ships (--tokenizer PATH|ORG/NAME).",
        )


def generation_args(loaded: LoadedModel, new: int, sample: bool, prompt: int = 0) -> dict[str, Any]:
    """model.generate's keyword arguments for --generate N (greedy, or sampled under the
    run's seed with the checkpoint's generation settings); `prompt`: its tokens, which with
    the N new ones must fit the model's positions."""
    module = loaded.module
    limit = loaded.max_tokens
    if limit is not None and not isinstance(loaded.kind, Seq2SeqLM) and prompt + new > limit:
        raise UsageError(
            f"--generate {new} after a prompt of {prompt} tokens needs {prompt + new} positions; "
            f"{loaded.spec} takes {limit}.",
            f"generate at most {max(limit - prompt, 0)} tokens, or shorten the text.",
        )
    can = getattr(module, "can_generate", None)
    if not isinstance(loaded.kind, CausalLM) or not callable(can) or not can():
        raise UsageError(
            f"{loaded.spec} cannot generate ({loaded.task}): --generate needs a causal or "
            "seq2seq language model.",
            "drop --generate, or give a language model (hf:PATH of one, hf:gpt2, …).",
        )
    args: dict[str, Any] = {
        "max_new_tokens": new,
        "do_sample": sample,
        "num_beams": 1,
        "return_dict_in_generate": True,
    }
    if not sample:  # greedy: the checkpoint's sampling settings do not apply
        args.update(temperature=None, top_p=None, top_k=None)
    pad = getattr(loaded.tokenizer, "pad_token_id", None)
    config = getattr(module, "config", None)
    if pad is None:
        pad = _first_int(getattr(config, "pad_token_id", None))
    if pad is None:
        pad = _first_int(getattr(config, "eos_token_id", None))
    if pad is not None:
        args["pad_token_id"] = pad
    return args


def generation_prompt(
    model_input: ModelInput, loaded: LoadedModel, sequences: torch.Tensor | None = None
) -> int:
    """How many tokens of model.generate's sequences come before the new ones: a causal LM's
    prompt (its input_ids: `ModelInput.token_ids`), a seq2seq model's decoder prompt (its
    decoder_input_ids, and the start token generate puts before them where they lack it, as
    `sequences`, generate's output, shows; else the one start token it begins the decoder
    with); 0 for a prompt of embeddings, which generate leaves out of what it returns."""
    seq2seq = isinstance(loaded.kind, Seq2SeqLM)
    ids = model_input.kwargs.get("decoder_input_ids") if seq2seq else model_input.token_ids()
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point()):
        return 1 if seq2seq else 0
    given = int(ids.shape[-1])
    if seq2seq and sequences is not None and sequences.shape[-1] > given:
        ids = ids.to(sequences.device)
        if not torch.equal(sequences[:, :given], ids) and torch.equal(
            sequences[:, 1 : given + 1], ids
        ):
            return given + 1  # (a start token put before them)
    return given


def generated_of(
    output: Any, model_input: ModelInput, loaded: LoadedModel
) -> tuple[list[Generated], str]:
    """Each sequence's new tokens from generate's output, and a note on how the calls line up
    with the steps."""
    sequences = output.get("sequences") if isinstance(output, Mapping) else output
    if not isinstance(sequences, torch.Tensor):
        raise UsageError(
            f"{loaded.spec}'s generate returned no sequences.", "drop --generate for this model."
        )
    new = sequences[:, generation_prompt(model_input, loaded, sequences) :].cpu().tolist()
    tokenizer = loaded.tokenizer
    out = []
    pieces = None if tokenizer is None else Pieces(tokenizer)
    for i, ids in enumerate(new):
        text = tokens = None
        if pieces is not None:
            text = pieces.text(ids)  # the ids decoded together, never piece by piece
            tokens = pieces.sequence(ids)
        out.append(Generated(i, ids, text, tokens))
    steps = max((len(ids) for ids in new), default=0)
    said = (
        f"--generate: model.generate made {steps} new token{'s' if steps != 1 else ''} in "
        f"{steps} forward{'s' if steps != 1 else ''}: each layer's call 0 is the prompt, call k "
        "the k-th new token (with the KV cache)"
    )
    ended = _ended_early(new, steps, loaded)
    if ended:
        shown = ", ".join(f"sequence {seq} at new token {at}" for seq, at in ended[:4])
        said += (
            f"; {len(ended)} sequence{'s' if len(ended) != 1 else ''} ended before the last "
            f"step ({shown}): generate fed {'them' if len(ended) != 1 else 'it'} padding "
            "after, whose rows the later calls' statistics count with the others"
        )
    return out, said


def _ended_early(new: list[list[int]], steps: int, loaded: LoadedModel) -> list[tuple[int, int]]:
    """(sequence, the new token that ended it) of each sequence whose end token came before
    the last step: generate goes on feeding it padding while the others run."""
    config = getattr(loaded.module, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    ends = set(eos if isinstance(eos, list | tuple) else [eos]) - {None}
    out = []
    for seq, ids in enumerate(new):
        at = next((k for k, t in enumerate(ids) if t in ends), None)
        if at is not None and at < steps - 1:
            out.append((seq, at))
    return out


def needs_text_model(loaded: LoadedModel, what: str) -> None:
    """Text given to a model that does not take token ids: refused in one line."""
    if loaded.kind.takes_images or getattr(loaded.kind, "vocab_size", None) is None:
        raise UsageError(
            f"{loaded.spec} takes {'images' if loaded.kind.takes_images else 'tensors'}, not "
            f"text ({what}).",
            "give text to a language model (hf:PATH of a causal LM, hf:gpt2, …); give this "
            "model images or --input tensors.",
        )


def ensure_tokenizer(loaded: LoadedModel, asked: Any) -> None:
    """loaded.tokenizer (and its label) from --tokenizer or beside the checkpoint."""
    if loaded.tokenizer is not None and asked is None:
        return
    if asked is not None and not isinstance(asked, str):  # the Python API's own tokenizer
        if not callable(asked) or not hasattr(asked, "convert_ids_to_tokens"):
            raise TypeError(
                "tokenizer must be a path, ORG/NAME or a transformers tokenizer, not "
                f"{type(asked).__name__}"
            )
        loaded.tokenizer = asked
        loaded.tokenizer_label = f"{type(asked).__name__} (given)"
        return
    tokenizer, label = load_tokenizer(asked, loaded.tokenizer_from, loaded.spec)
    loaded.tokenizer = tokenizer
    loaded.tokenizer_label = label


def with_tokenizer(loaded: LoadedModel, asked: Any, *, needed: bool) -> LoadedModel:
    """A language model with its tokenizer (--tokenizer, else the checkpoint's) and its tokens
    as labels. Needed (text given): a missing tokenizer is an error; else one beside the
    checkpoint only labels the predicted tokens, and none is no loss."""
    if needed:
        needs_text_model(loaded, "--text")
    elif asked is None and not (
        isinstance(loaded.kind, CausalLM) and loaded.tokenizer_from is not None
    ):
        return loaded
    if asked is not None and not needed:
        needs_text_model(loaded, "--tokenizer")
    loaded = dataclasses.replace(loaded)  # a LoadedModel passed in is left as it was
    try:
        ensure_tokenizer(loaded, asked)
    except UsageError:
        if needed or asked is not None:
            raise
        return loaded  # a checkpoint saved without its tokenizer: ids stay unlabelled
    vocab = getattr(loaded.kind, "vocab_size", None)
    if isinstance(loaded.kind, CausalLM) and loaded.categories is None and isinstance(vocab, int):
        loaded.categories = TokenLabels(loaded.tokenizer, vocab)
    return loaded
