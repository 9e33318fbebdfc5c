from collections import OrderedDict

from leanlm import data
from leanlm.data.tokens import token_ids


def test_the_calibration_text_is_tokenized_once_per_tokenizer_and_special_token_rule(
    smollm2_tokenizer, counting_tokenizer, monkeypatch
):
    monkeypatch.setattr("leanlm.data.tokens._CACHE", OrderedDict())  # what other tests in this process cached
    tokenizer, calls = counting_tokenizer
    text = data.plain_text("lambada-dev")
    first = data.calibration_batches(tokenizer, n_samples=4, seq_len=64, seed=3)
    again = data.calibration_batches(tokenizer, n_samples=2, seq_len=128, seed=4)
    assert calls == [len(text)]
    stream = " ".join(map(str, smollm2_tokenizer(text)["input_ids"]))
    assert all(" ".join(map(str, window.tolist())) in stream for window in [*first, *again])
    assert token_ids(tokenizer, text) == smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert calls == [len(text), len(text)]  # without special tokens: another entry
