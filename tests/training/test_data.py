import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leanlm.errors import DataError
from leanlm.training import pack_blocks, read_documents, split_documents
from leanlm.training.data import document_ids


def test_plain_text_is_one_document_per_line(tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("first line\n\n  second line \n")
    assert read_documents(path) == ["first line", "second line"]


def test_jsonl_text_chat_and_instruction_records(tmp_path, smollm2_tokenizer):
    path = tmp_path / "d.jsonl"
    records = [
        {"text": "plain"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"instruction": "Add", "input": "1+1", "output": "2"},
    ]
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


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is not UTF-8 text (invalid byte at offset 0)"),
        (b"text\x00with a NUL\n", "holds NUL bytes"),
        ("caf\u00e9 au lait\n".encode("latin-1"), "is not UTF-8 text (invalid byte at offset 3)"),
    ],
)
def test_binary_or_non_utf8_data_is_named(tmp_path, content, message):
    path = tmp_path / "d.txt"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_documents(path)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.binary(max_size=400)
    | st.lists(st.text(max_size=40), max_size=6).map(lambda lines: "\n".join(lines).encode()),
    suffix=st.sampled_from([".txt", ".jsonl"]),
)
def test_any_bytes_read_or_are_refused(tmp_path, data, suffix):
    path = tmp_path / f"d{suffix}"
    path.write_bytes(data)
    try:
        documents = read_documents(path)
    except DataError:
        return
    assert documents and all(isinstance(d, (str, list)) for d in documents)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(["text", "messages", "role", "content", "instruction", "input", "output", "x"]),
            children,
            max_size=4,
        )
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(json_values, min_size=1, max_size=4))
def test_any_jsonl_records_render_or_are_refused(tmp_path, smollm2_tokenizer, records):
    """Whatever JSON a line holds, it is refused with a DataError or becomes a document the tokenizer renders."""
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    try:
        documents = read_documents(path)
    except DataError:
        return
    for document in documents:
        assert document_ids(smollm2_tokenizer, document)


def test_a_line_longer_than_a_document_is_refused_before_it_is_tokenized(tmp_path):
    from leanlm.training.data import MAX_DOCUMENT_CHARS

    data = tmp_path / "one-line.txt"
    data.write_text("short line\n" + "word " * (MAX_DOCUMENT_CHARS // 5 + 1) + "\n")
    with pytest.raises(DataError, match=r"one-line.txt:2 is 1,048,580 characters long; a line is one document"):
        read_documents(data)
