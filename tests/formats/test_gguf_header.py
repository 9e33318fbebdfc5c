"""A GGUF's header is checked before any reader allocates by it: a crafted count, length, alignment, offset or
block count is one line naming the file and the field, whether the file is loaded or exported; and no mutation of
a real header makes loading raise anything else, hang or allocate without bound."""

import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tiny import byte_tokenizer, save_tiny_llama

from leanlm.errors import CorruptModelError, LeanLMError
from leanlm.export import export_gguf
from leanlm.formats.gguf_header import read_gguf_header
from leanlm.models import load_model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    directory = save_tiny_llama(tmp_path_factory.mktemp("tiny"), byte_tokenizer())
    return Path(export_gguf(directory, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "f32")["path"])


def _rewritten(source: Path, out: Path, values: dict | None = None, keep=lambda name: True) -> Path:
    """`source` written anew with `values` added to its metadata and only the tensors `keep` accepts."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        writer.add_key_value(key, field.contents(), kind, sub_type=field.types[-1] if kind == 9 else None)
    for key, (value, kind) in (values or {}).items():
        writer.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        if keep(tensor.name):
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _patched(source: Path, out: Path, find: bytes, skip: int, fmt: str, value: int) -> Path:
    """`source` with the number of struct format `fmt` found `skip` bytes after `find` set to `value`."""
    data = bytearray(source.read_bytes())
    at = data.index(find) + len(find) + skip
    struct.pack_into(fmt, data, at, value)
    out.write_bytes(bytes(data))
    return out


def _tensor_entry(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


CRAFTED = {
    "a tensor count of 2^40": (lambda g, o: _patched(g, o, b"GGUF", 4, "<Q", 1 << 40), "claims 1099511627776 tensors"),
    "a string length of 2^62": (
        lambda g, o: _patched(g, o, b"general.name", 4, "<Q", 1 << 62),
        "the value of general.name runs past the end of the file",
    ),
    "alignment 0": (
        lambda g, o: _rewritten(g, o, {"general.alignment": (0, gguf.GGUFValueType.UINT32)}),
        "general.alignment is 0, not a power of two",
    ),
    "a tensor offset beyond the end": (
        lambda g, o: _patched(g, o, _tensor_entry("output_norm.weight"), 4 + 8 + 4, "<Q", 1 << 40),
        "output_norm.weight's data .* lies outside the file",
    ),
    "an unknown block type": (
        lambda g, o: _patched(g, o, _tensor_entry("output_norm.weight"), 4 + 8, "<I", 99),
        "output_norm.weight has unknown block type 99",
    ),
    "block_count 100000": (
        lambda g, o: _patched(g, o, b"llama.block_count", 4, "<I", 100_000),
        "block_count is 100000",
    ),
    "every tensor of the last block missing": (
        lambda g, o: _rewritten(g, o, keep=lambda name: not name.startswith("blk.1.")),
        r"block_count says 2 blocks, but the file holds tensors of 1 \(none of block 1\)",
    ),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_header_is_one_line_in_load_and_in_export(tiny_gguf, tmp_path, monkeypatch, case):
    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path / "cache"))
    craft, message = CRAFTED[case]
    crafted = craft(tiny_gguf, tmp_path / "crafted.gguf")
    for attempt in (lambda: load_model(crafted), lambda: export_gguf(crafted, tmp_path / "out.gguf")):
        with pytest.raises(CorruptModelError, match=message) as raised:
            attempt()
        assert "\n" not in str(raised.value) and "crafted.gguf" in str(raised.value)
    assert not (tmp_path / "out.gguf").exists() and not list(tmp_path.glob(".out.gguf*"))
    assert not (tmp_path / "cache" / "models").exists() or not list((tmp_path / "cache" / "models").iterdir())


def test_the_real_header_reads(tiny_gguf):
    header = read_gguf_header(tiny_gguf)
    assert header.values["llama.block_count"] == 2 and len(header.tensors) == 2 * 9 + 2
    assert header.tensors["output_norm.weight"].nbytes == 64 * 4


@pytest.mark.timeout(600)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    edits=st.lists(
        st.tuples(
            st.sampled_from(["counts", "metadata", "tensor table"]),
            st.integers(0, 1 << 20),
            st.sampled_from(["<B", "<I", "<Q"]),
            st.integers(0, 2**64 - 1),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_any_mutation_of_a_real_header_loads_or_is_refused_cleanly(
    tiny_gguf, tmp_path, monkeypatch, bounded_data, edits
):
    """`bounded_data` makes an allocation beyond its bound fail; any failure but a LeanLMError fails the test."""
    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path / "cache"))
    data = bytearray(tiny_gguf.read_bytes())
    table = data.index(_tensor_entry("token_embd.weight"))
    regions = {
        "counts": (0, 24),
        "metadata": (24, table),
        "tensor table": (table, read_gguf_header(tiny_gguf).data_offset),
    }
    for region, position, fmt, value in edits:
        start, end = regions[region]
        size = struct.calcsize(fmt)
        at = start + position % (end - start - size)
        struct.pack_into(fmt, data, at, value % (1 << (8 * size)))
    mutated = tmp_path / f"mutated-{os.getpid()}.gguf"
    mutated.write_bytes(bytes(data))
    try:
        loaded = load_model(mutated)
    except LeanLMError as error:
        assert "\n" not in str(error)
        event(f"refused: {type(error).__name__}")
    else:
        assert loaded.model.config.num_hidden_layers == 2
        event("loaded")
