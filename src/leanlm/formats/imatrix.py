"""llama.cpp's importance-matrix file, the GGUF that `llama-imatrix` writes and `llama-quantize --imatrix` reads:
for every weight, the sum over calibration tokens of each input column's square (`NAME.in_sum2`, float32, one row
per expert; a dense weight's is one vector) and how many tokens were summed (`NAME.counts`, one per row), with
the metadata llama.cpp requires
(`imatrix.datasets`, `imatrix.chunk_count`, `imatrix.chunk_size`). The importance of a column is in_sum2 / count,
its mean squared input. Names are GGUF tensor names (`blk.0.attn_q.weight`). The older binary `.dat` format is not
read; `llama-imatrix --in-file FILE.dat -o FILE.gguf` converts it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from leanlm.errors import CorruptModelError, first_line
from leanlm.formats.gguf_header import read_gguf_header

SUMS, COUNTS = ".in_sum2", ".counts"


@dataclass
class ImportanceMatrix:
    sums: dict[str, np.ndarray]  # GGUF tensor name -> (columns,) float32: sum of squared inputs per column
    counts: dict[str, float]  # GGUF tensor name -> tokens summed
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0

    def mean_squares(self, name: str) -> np.ndarray:
        """The importance of each input column of `name`: its mean squared input (ones if no token was summed)."""
        count = self.counts[name]
        return self.sums[name] / count if count > 0 else np.ones_like(self.sums[name])


def write_imatrix(path: str | os.PathLike, matrix: ImportanceMatrix) -> None:
    """Write `matrix` as llama.cpp's GGUF importance matrix (the caller stages the file)."""
    writer = gguf.GGUFWriter(os.fspath(path), "imatrix")
    try:
        writer.add_type("imatrix")
        writer.add_array("imatrix.datasets", matrix.datasets or ["leanlm calibration"])
        writer.add_uint32("imatrix.chunk_count", matrix.chunk_count)
        writer.add_uint32("imatrix.chunk_size", matrix.chunk_size)
        for name in sorted(matrix.sums):
            writer.add_tensor(name + SUMS, np.asarray(matrix.sums[name], dtype=np.float32).reshape(-1))
            writer.add_tensor(name + COUNTS, np.array([matrix.counts[name]], dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def read_imatrix(path: str | os.PathLike) -> ImportanceMatrix:
    """An importance matrix from llama.cpp's GGUF file (dense weights: one row per tensor), or a CorruptModelError
    naming what is wrong."""
    path = Path(path)
    read_gguf_header(path)  # every count and offset checked before the reader allocates by them
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # the reader raises ValueError, struct and numpy errors for damaged files
        raise CorruptModelError(f"{path} cannot be read as a GGUF file: {first_line(error)}") from None
    kind = reader.fields.get("general.type")
    if kind is None or kind.contents() != "imatrix":
        raise CorruptModelError(f"{path} is not an importance matrix (its general.type is not 'imatrix')")
    tensors = {tensor.name: np.array(tensor.data, dtype=np.float32) for tensor in reader.tensors}
    sums, counts = {}, {}
    for name, values in tensors.items():
        if not name.endswith(SUMS):
            continue
        weight = name[: -len(SUMS)]
        if weight + COUNTS not in tensors:
            raise CorruptModelError(f"{path}: {weight} has sums of squares but no counts")
        tokens = tensors[weight + COUNTS].reshape(-1)
        if tokens.size != 1:
            raise CorruptModelError(f"{path}: {weight} has {tokens.size} experts; leanlm reads dense weights")
        sums[weight], counts[weight] = values.reshape(-1), float(tokens[0])
    if not sums:
        raise CorruptModelError(f"{path} holds no importance entries")

    def number(key: str) -> int:
        found = reader.fields.get(key)
        return int(found.contents()) if found is not None else 0

    found = reader.fields.get("imatrix.datasets")
    return ImportanceMatrix(
        sums,
        counts,
        list(found.contents()) if found else [],
        number("imatrix.chunk_count"),
        number("imatrix.chunk_size"),
    )
