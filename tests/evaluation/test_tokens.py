from leanlm.data import datasets
from leanlm.evaluation.tokens import encode


def test_a_long_text_is_tokenized_once_per_tokenizer_and_every_call_gets_its_own_list(
    smollm2_tokenizer, counting_tokenizer
):
    import copy

    text = datasets.wikitext2_test_text()[:300_000]
    tokenizer, calls = counting_tokenizer
    first = encode(tokenizer, text)
    assert first == smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
    first.clear()
    assert encode(tokenizer, text) == encode(smollm2_tokenizer, text) and calls == [len(text)]
    marked = text + " <a-new-token>"
    assert encode(smollm2_tokenizer, marked)[-1] != len(smollm2_tokenizer)
    other = copy.deepcopy(smollm2_tokenizer)
    other.add_tokens(["<a-new-token>"])  # another definition: the same text is tokenized anew
    assert encode(other, marked)[-1] == len(other) - 1
