"""A text corpus through diff in batches (issue 53): the texts of `--text`/`--text-file` a
batch at a time, every batch padded to the run's longest text, so that each tensor has one
shape from batch to batch (the sums behind every figure add across them) and the memory stays
that of one batch whatever the corpus' length; padding is left out of every figure."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hookcli.engine.prepare import Prepared
from hookcli.errors import UsageError
from hookcli.inputs import ModelInput
from hookcli.options import InputOptions, ModelOptions

TEXT_BATCH = 8  # texts a batch holds, unless --batch-size says


def text_batches(inputs: InputOptions, batch_size: int | None) -> list[InputOptions]:
    """A text run of more texts than a batch holds (or any, with --batch-size): each batch's
    texts; else none (one pass, as before)."""
    if not inputs.has_text:
        return []
    if inputs.items or inputs.specs:
        raise UsageError(
            "give text or images/--input tensors, not both.", "use one kind of input per run."
        )
    from hookcli.inputs.text import texts_of

    texts = texts_of(inputs)
    size = batch_size or TEXT_BATCH
    if batch_size is None and len(texts) <= size:
        return []
    return [
        dataclasses.replace(inputs, text=tuple(texts[i : i + size]), text_file=None)
        for i in range(0, len(texts), size)
    ]


class Corpus:
    """The batches' inputs, tokenized by the reference side's tokenizer (loaded here, as a
    text run loads it) and padded to the longest text of all of them."""

    def __init__(
        self, reference: Prepared, model: ModelOptions, batches: Sequence[InputOptions]
    ) -> None:
        from hookcli.inputs.text import token_lengths
        from hookcli.sources.lm import with_tokenizer

        self.chat = bool(batches) and batches[0].chat
        loaded = with_tokenizer(reference.loaded, model.tokenizer, needed=True)
        reference.loaded = self.loaded = loaded
        self.longest = max(
            max(token_lengths(loaded, self._rendered(b), self.chat)) for b in batches
        )
        limit = loaded.max_tokens
        if limit is not None and self.longest > limit:  # every batch is padded to the longest
            raise UsageError(
                f"a text of {self.longest} tokens is longer than {loaded.spec} takes ({limit}, "
                "its config's maximum positions).",
                f"shorten the longest lines to at most {limit} tokens.",
            )

    def _rendered(self, batch: InputOptions) -> list[str]:
        """The batch's texts as the model reads them (through the chat template with --chat)."""
        if not self.chat:
            return list(batch.text)
        from hookcli.inputs.chat import render_chat

        return render_chat(self.loaded.tokenizer, list(batch.text))

    def input(self, batch: InputOptions) -> ModelInput:
        from hookcli.inputs.text import from_text

        return from_text(
            self.loaded,
            batch,
            texts=self._rendered(batch),
            shown=list(batch.text),
            pad_to=self.longest,
        )
