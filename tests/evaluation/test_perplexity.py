import math

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model

from leanlm.errors import ConfigError
from leanlm.evaluation import perplexity
from leanlm.evaluation.tokens import bos_prefix

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def test_matches_mean_nll_over_nonoverlapping_windows(smollm2_tokenizer):
    model = tiny_model("llama", vocab_size=len(smollm2_tokenizer))
    result = perplexity(model, smollm2_tokenizer, TEXT, seq_len=32, max_tokens=100)
    ids = smollm2_tokenizer(TEXT, add_special_tokens=False)["input_ids"][:96]
    nll = 0.0
    with torch.inference_mode():
        for start in range(0, 96, 32):
            window = torch.tensor([ids[start : start + 32]])
            nll += F.cross_entropy(model(window).logits[0, :-1], window[0, 1:], reduction="sum").item()
    assert result.windows == 3 and result.tokens == 3 * 31
    assert result.perplexity == pytest.approx(math.exp(nll / 93), rel=1e-5)


def test_too_few_tokens_is_a_clear_error(smollm2_tokenizer):
    model = tiny_model("llama", vocab_size=len(smollm2_tokenizer))
    with pytest.raises(ConfigError, match="do not fill one window"):
        perplexity(model, smollm2_tokenizer, TEXT, seq_len=2048, max_tokens=100)


class _BosTokenizer:
    """A tokenizer that, like Gemma's, adds BOS by default."""

    bos_token_id = 1

    def __call__(self, text, add_special_tokens=True):
        ids = [2 + (ord(c) % 50) for c in text]
        return {"input_ids": ([1] + ids) if add_special_tokens else ids}


def test_models_that_want_bos_get_it_at_every_window():
    tokenizer = _BosTokenizer()
    assert bos_prefix(tokenizer) == [1]
    model = tiny_model("llama", vocab_size=64)
    seen = []
    original = model.forward
    model.forward = lambda input_ids=None, **kw: seen.append(input_ids) or original(input_ids=input_ids, **kw)
    result = perplexity(model, tokenizer, "abcdefghij" * 5, seq_len=10)
    assert all(ids[0, 0].item() == 1 and ids.shape[1] == 10 for ids in seen)
    assert result.windows == 50 // 9 and result.tokens == result.windows * 9
