"""File checksums, shared by the data loaders and the model loader."""

from __future__ import annotations

import hashlib
from pathlib import Path

_KNOWN: dict[tuple[str, int, int], str] = {}  # (resolved path, size, mtime) -> sha256, for this process


def _key(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def sha256_of(path: Path) -> str:
    """sha256 of a file, computed once per process for an unchanged file."""
    key = _key(path)
    if key not in _KNOWN:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        _KNOWN[key] = digest.hexdigest()
    return _KNOWN[key]


def remember_sha256(path: Path, sha256: str) -> None:
    """Record the sha256 of the file now at `path`, computed while writing it, so that `sha256_of` does not read
    it again while it is unchanged."""
    _KNOWN[_key(path)] = sha256
