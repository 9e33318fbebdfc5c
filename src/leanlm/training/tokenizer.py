"""A small byte-level BPE tokenizer trained on the shipped text, for models trained from scratch here (SmolLM2's
49K-token vocabulary would make a few-million-parameter model mostly embedding table)."""

from __future__ import annotations

import copy

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"


def train_bpe_tokenizer(texts: list[str], vocab_size: int = 4096, extra_special: tuple[str, ...] = ()) -> Tokenizer:
    """Byte-level BPE over `texts`, with the end-of-text token (id 0) and `extra_special` tokens reserved."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def as_transformers_tokenizer(tokenizer: Tokenizer, prefix_token: str | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer for transformers and leanlm's evaluation. With `prefix_token` (a learnable sink token), that
    token goes in front of every encoded text, as BOS does for models that expect one."""
    tokenizer = copy.deepcopy(tokenizer)
    if prefix_token:
        prefix_id = tokenizer.token_to_id(prefix_token)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{prefix_token} $A", pair=f"{prefix_token} $A $B", special_tokens=[(prefix_token, prefix_id)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=END_OF_TEXT, bos_token=prefix_token, pad_token=END_OF_TEXT
    )
