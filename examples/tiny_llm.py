"""Build a tiny causal LM folder offline, as `save_pretrained` writes one: a 2-block Llama
with random weights and a byte-level BPE tokenizer trained on a few lines (with a chat
template), so every LLM command of hookcli can be tried without a download.

    python examples/tiny_llm.py tiny-llama
    hookcli inspect hf:./tiny-llama --text "The cat sat on the" -l lm_head
    hookcli lens hf:./tiny-llama --text "The cat sat on the" -o lens.png
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

LINES = [
    "The cat sat on the mat.",
    "A dog ran in the park.",
    "hello world, the cat and the dog",
    "Once upon a time there was a model.",
]
VOCAB = 320


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def train_tokenizer(
    lines: list[str], vocab: int = VOCAB, *, chat: bool = False, repeat: int = 5
) -> Any:
    """A byte-level BPE tokenizer trained on `lines`, as transformers' PreTrainedTokenizerFast
    with <pad> (0), <s> (1) and </s> (2); `chat`: with a small chat template."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines * repeat, trainer)
    fast = transformers.PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def build(folder: Path) -> None:
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    train_tokenizer(LINES, chat=True).save_pretrained(folder)


if __name__ == "__main__":
    where = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama")
    build(where)
    print(f"wrote {where}: config.json, model.safetensors, tokenizer.json")
