"""llama.cpp's importance-matrix GGUF: what leanlm writes reads back as written (llama-quantize reads it too;
checked by hand, see docs/deployment/export.md), and files that are not an importance matrix of dense weights are
refused with one line."""

import gguf
import numpy as np
import pytest

from leanlm.errors import CorruptModelError
from leanlm.formats.imatrix import ImportanceMatrix, read_imatrix, write_imatrix


def test_an_importance_matrix_reads_back_as_written(tmp_path):
    sums = {"blk.0.attn_q.weight": np.arange(8, dtype=np.float32), "blk.0.ffn_down.weight": np.ones(16, np.float32)}
    written = ImportanceMatrix(sums, {"blk.0.attn_q.weight": 4.0, "blk.0.ffn_down.weight": 0.0}, ["lee"], 3, 512)
    write_imatrix(tmp_path / "m.gguf", written)
    read = read_imatrix(tmp_path / "m.gguf")
    assert (read.datasets, read.chunk_count, read.chunk_size) == (["lee"], 3, 512)
    np.testing.assert_array_equal(read.mean_squares("blk.0.attn_q.weight"), np.arange(8) / 4)
    np.testing.assert_array_equal(read.mean_squares("blk.0.ffn_down.weight"), np.ones(16))  # no tokens: uniform
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}  # llama.cpp's layout
    assert tensors["blk.0.attn_q.weight.in_sum2"].shape.tolist() == [8]
    assert tensors["blk.0.attn_q.weight.counts"].shape.tolist() == [1]


def _gguf(path, kind="imatrix", tensors=None):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(kind)
    for name, values in (tensors or {"w.in_sum2": np.ones(4, np.float32)}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda p: _gguf(p, kind="model"), "is not an importance matrix"),
        (lambda p: _gguf(p), "has sums of squares but no counts"),
        (
            lambda p: _gguf(
                p, tensors={"w.in_sum2": np.ones((2, 4), np.float32), "w.counts": np.ones((2, 1), np.float32)}
            ),
            "has 2 experts",
        ),
        (lambda p: p.write_bytes(b"\x01" * 64) and p, "not a readable GGUF file|GGUF magic"),
    ],
    ids=["not-imatrix", "no-counts", "experts", "not-gguf"],
)
def test_what_is_not_an_importance_matrix_of_dense_weights_is_refused_in_one_line(tmp_path, make, reason):
    path = tmp_path / "bad.gguf"
    make(path)
    with pytest.raises(CorruptModelError, match=reason) as refused:
        read_imatrix(path)
    assert "\n" not in str(refused.value)
