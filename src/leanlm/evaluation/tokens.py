"""How evaluation turns text into model input, one rule for every task."""

from __future__ import annotations

from leanlm.data.tokens import token_ids


def encode(tokenizer, text: str) -> list[int]:
    """Evaluation's rule: the text's own tokens, no special tokens added (`bos_prefix` adds BOS where the model
    expects it); a whole test set is tokenized once per process and tokenizer."""
    return token_ids(tokenizer, text)


def bos_prefix(tokenizer) -> list[int]:
    """[BOS] for tokenizers that add it by default (Gemma's sink sits on it), else nothing (SmolLM2, GPT-2).

    This is lm-evaluation-harness' behaviour: it adds special tokens only where the model expects them."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    default = tokenizer("a")["input_ids"]
    return [bos] if default and default[0] == bos else []


def max_input_length(model, cap: int = 2048) -> int:
    """The longest input a model is run on: its trained context, capped like lm-evaluation-harness does."""
    trained = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", cap)
    return min(int(trained), cap)
