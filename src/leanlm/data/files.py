"""Where the shipped data sets lie, and their checksum check.

The data ships inside the package (`leanlm/data/raw`, a copy of the project's shared data with its README and
SHA256SUMS), so a fresh clone works with nothing downloaded. `LEANLM_DATA` points elsewhere if needed.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

from leanlm.checksums import sha256_of
from leanlm.errors import DataError

_SHIPPED = Path(__file__).parent / "raw"


def data_root() -> Path:
    root = Path(os.environ.get("LEANLM_DATA", _SHIPPED))
    if not (root / "SHA256SUMS").is_file():
        raise DataError(f"no data set folder at {root} (expected a SHA256SUMS file there); check LEANLM_DATA")
    return root


@cache
def _expected_checksums(root: Path) -> dict[str, str]:
    lines = (root / "SHA256SUMS").read_text().split("\n")
    return {name.strip(): digest for digest, name in (line.split(maxsplit=1) for line in lines if line.strip())}


def verified_path(relative: str) -> Path:
    """The path of a shipped data file, after checking it exists and matches SHA256SUMS."""
    root = data_root()
    expected = _expected_checksums(root).get(relative)
    if expected is None:
        raise DataError(f"{relative!r} is not listed in {root / 'SHA256SUMS'}")
    path = root / relative
    if not path.is_file():
        raise DataError(f"data file {path} is missing")
    actual = sha256_of(path)
    if actual != expected:
        raise DataError(f"data file {path} fails its checksum (sha256 {actual}, expected {expected})")
    return path
