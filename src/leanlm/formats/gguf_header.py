"""A GGUF file's header, read and checked before any reader allocates for it: `read_gguf_header(path)`.

GGUF (llama.cpp's format): magic, version, tensor count, key/value count, the key/value pairs (strings, numbers,
arrays of them), the tensor table (name, dimensions, block type, offset), padding to the alignment, then the
tensors' data. Every count, length and offset in it is a number the file chooses, and readers allocate by them
(the `gguf` package's reader builds an array per value; transformers builds a model of `block_count` layers).
This parser walks the header through a memory map without decoding more than names, and refuses, in one line
naming the file and the field, any length that runs past the end of the file, a count beyond `LIMITS`, an
alignment that is not a power of two, a tensor whose block type is unknown or whose data lies outside the file,
and a `block_count` that differs from the blocks whose tensors the file holds.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from leanlm.errors import CorruptModelError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
LIMITS = {
    "tensors": 1 << 16,  # a dense 405B model holds about 1,100
    "keys": 1 << 16,
    "dimensions": 4,  # ggml's GGML_MAX_DIMS
    "name bytes": 256,  # ggml's names are at most 64 bytes
    "layers": 1 << 12,
}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # as the file lists it: the fastest-varying dimension first
    block_type: int
    offset: int  # from the start of the file
    nbytes: int


@dataclass
class GGUFHeader:
    version: int
    values: dict[str, object] = field(default_factory=dict)  # scalar and string values; arrays as their length
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    data_offset: int = 0


class _Cursor:
    def __init__(self, path: Path, buffer):
        self.path, self.buffer, self.at = path, buffer, 0

    def fail(self, what: str) -> CorruptModelError:
        """The error, on one line: a name read from the file is shown with its control characters escaped."""
        printable = "".join(c if c.isprintable() else repr(c)[1:-1] for c in what)
        return CorruptModelError(f"{self.path} is not a readable GGUF file: {printable}")

    def take(self, size: int, what: str) -> int:
        if size < 0 or self.at + size > len(self.buffer):
            raise self.fail(f"{what} runs past the end of the file (byte {self.at} + {size} of {len(self.buffer)})")
        start, self.at = self.at, self.at + size
        return start

    def scalar(self, kind: int, what: str):
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, self.buffer, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, limit: int | None = None) -> bytes:
        length = self.scalar(10, f"the length of {what}")
        if limit is not None and length > limit:
            raise self.fail(f"{what} is {length} bytes long (at most {limit})")
        start = self.take(length, what)
        return bytes(self.buffer[start : start + length])

    def skip_string(self, what: str) -> None:
        self.take(self.scalar(10, f"the length of {what}"), what)

    def value(self, kind: int, key: str):
        if kind in _SCALARS:
            return self.scalar(kind, f"the value of {key}")
        if kind == _STRING:
            return self.string(f"the value of {key}").decode("utf-8", errors="replace")
        if kind != _ARRAY:
            raise self.fail(f"{key} has unknown value type {kind}")
        item = self.scalar(4, f"the item type of {key}")
        count = self.scalar(10, f"the length of {key}")
        if item in _SCALARS:
            self.take(count * struct.calcsize(_SCALARS[item]), f"the {count} values of {key}")
        elif item == _STRING:
            if count * 8 > len(self.buffer) - self.at:  # every string has at least its 8-byte length
                raise self.fail(f"{key} claims {count} strings, more than the file holds")
            for index in range(count):
                self.skip_string(f"{key}[{index}]")
        else:
            raise self.fail(f"{key} is an array of {'arrays' if item == _ARRAY else f'unknown type {item}'}")
        return count


def _check_count(cursor: _Cursor, count: int, what: str) -> None:
    if count > LIMITS[what]:
        raise cursor.fail(f"it claims {count} {what} (at most {LIMITS[what]})")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The checked header of the GGUF file `path` (see the module's docstring), or CorruptModelError."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    try:
        with open(path, "rb") as handle:
            if handle.seek(0, 2) == 0:
                raise CorruptModelError(f"{path} is empty, not a GGUF file")
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as error:
        raise CorruptModelError(f"{path} cannot be read: {error.strerror or error}") from None
    with buffer:
        cursor = _Cursor(path, buffer)
        if bytes(buffer[:4]) != MAGIC:
            raise cursor.fail("it does not start with the GGUF magic bytes")
        cursor.take(4, "the magic")
        header = GGUFHeader(cursor.scalar(4, "the version"))
        if header.version not in VERSIONS:
            raise cursor.fail(f"version {header.version} (leanlm reads {' and '.join(map(str, VERSIONS))})")
        tensor_count = cursor.scalar(10, "the tensor count")
        key_count = cursor.scalar(10, "the key count")
        _check_count(cursor, tensor_count, "tensors")
        _check_count(cursor, key_count, "keys")
        for _ in range(key_count):
            key = cursor.string("a key", LIMITS["name bytes"]).decode("utf-8", errors="replace")
            header.values[key] = cursor.value(cursor.scalar(4, f"the type of {key}"), key)
        entries = []
        for _ in range(tensor_count):
            name = cursor.string("a tensor name", LIMITS["name bytes"]).decode("utf-8", errors="replace")
            dimensions = cursor.scalar(4, f"the dimension count of {name}")
            if not 1 <= dimensions <= LIMITS["dimensions"]:
                raise cursor.fail(f"{name} has {dimensions} dimensions (1 to {LIMITS['dimensions']})")
            shape = tuple(cursor.scalar(10, f"a dimension of {name}") for _ in range(dimensions))
            kind, offset = cursor.scalar(4, f"the type of {name}"), cursor.scalar(10, f"the offset of {name}")
            if name in header.tensors or any(entry[0] == name for entry in entries):
                raise cursor.fail(f"it lists {name} twice")
            entries.append((name, shape, kind, offset))
        alignment = header.values.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise cursor.fail(f"general.alignment is {alignment!r}, not a power of two")
        header.data_offset = -(-cursor.at // alignment) * alignment
        for name, shape, kind, offset in entries:
            try:
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise cursor.fail(f"{name} has unknown block type {kind}") from None
            values = 1
            for size in shape:
                values *= size
            if values == 0 or shape[0] % block:
                raise cursor.fail(f"{name}'s shape {list(shape)} does not hold whole blocks of {block}")
            nbytes = values // block * block_bytes
            start = header.data_offset + offset
            if offset % alignment or start + nbytes > len(buffer):
                raise cursor.fail(
                    f"{name}'s data (bytes {start} to {start + nbytes}) lies outside the file's {len(buffer)} bytes"
                )
            header.tensors[name] = TensorEntry(name, shape, kind, start, nbytes)
    _check_blocks(path, header)
    return header


def _check_blocks(path: Path, header: GGUFHeader) -> None:
    """`{arch}.block_count` must be the number of blocks whose tensors the file holds: a model is built with that
    many layers, and the missing ones would be random."""
    architecture = header.values.get("general.architecture")
    count = header.values.get(f"{architecture}.block_count")
    if count is None:
        return
    held = {int(match.group(1)) for name in header.tensors if (match := _BLOCK.match(name))}
    if not isinstance(count, int) or isinstance(count, bool) or not 0 < count <= LIMITS["layers"]:
        raise CorruptModelError(f"{path}: {architecture}.block_count is {count!r} (1 to {LIMITS['layers']})")
    if held != set(range(count)):
        lacking = sorted(set(range(count)) - held)
        raise CorruptModelError(
            f"{path}: {architecture}.block_count says {count} blocks, but the file holds tensors of "
            + (f"{len(held)} (none of block {lacking[0]})" if lacking else f"block {max(held)}")
        )
