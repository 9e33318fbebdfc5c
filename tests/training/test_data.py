import json

import pytest

from leanlm.errors import DataError
from leanlm.training import pack_blocks, read_documents, split_documents
from leanlm.training.data import document_ids


def test_plain_text_is_one_document_per_line(tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("first line\n\n  second line \n")
    assert read_documents(path) == ["first line", "second line"]


def test_jsonl_text_chat_and_instruction_records(tmp_path, smollm2_tokenizer):
    path = tmp_path / "d.jsonl"
    records = [{"text": "plain"},
               {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
               {"instruction": "Add", "input": "1+1", "output": "2"}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    documents = read_documents(path)
    assert documents[0] == "plain"
    assert documents[2] == [{"role": "user", "content": "Add\n\n1+1"}, {"role": "assistant", "content": "2"}]
    rendered = smollm2_tokenizer.decode(document_ids(smollm2_tokenizer, documents[1]))
    assert "<|im_start|>assistant\nhello<|im_end|>" in rendered  # through SmolLM2's chat template
    assert document_ids(smollm2_tokenizer, "plain")[-1] == smollm2_tokenizer.eos_token_id


def test_bad_data_is_named(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_documents(tmp_path / "missing.txt")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"prompt": "no"}\n')
    with pytest.raises(DataError, match="bad.jsonl:2: expected a record"):
        read_documents(bad)
    with pytest.raises(DataError, match="at least 2 documents"):
        split_documents(["one"], 0.1, 0)


def test_split_is_seeded_and_blocks_are_packed(smollm2_tokenizer):
    documents = [f"document number {i}" for i in range(40)]
    train, held = split_documents(documents, 0.1, seed=1)
    assert len(held) == 4 and sorted(train + held) == sorted(documents)
    assert split_documents(documents, 0.1, seed=1) == (train, held)
    blocks = pack_blocks(smollm2_tokenizer, train, 16)
    total = sum(len(document_ids(smollm2_tokenizer, d)) for d in train)
    assert blocks.shape == (total // 16, 16)
