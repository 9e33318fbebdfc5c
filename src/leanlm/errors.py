"""The exceptions leanlm raises for user mistakes: one type per kind of mistake.

Each is raised at the boundary (loading, argument parsing, data access) with a message that names the bad
value and what would be right, so that nobody has to read a traceback from deep inside torch.
"""


class LeanLMError(Exception):
    """Base class: every error leanlm raises on purpose."""


class ModelNotFoundError(LeanLMError):
    """A model name or path that resolves to nothing (or to a package that is not installed)."""


class CorruptModelError(LeanLMError):
    """A model file or checkpoint exists but cannot be read, or fails its checksum."""


class UnsupportedArchitectureError(LeanLMError):
    """A model whose family has no architecture table in leanlm."""


class DataError(LeanLMError):
    """A data set that is missing, fails its checksum, or has an unexpected layout."""


class ConfigError(LeanLMError):
    """An option value out of range, or a combination of options that does not make sense."""


class SwarmError(LeanLMError):
    """A process of a swarm run on this machine that ended before it could take part (a peer before it served,
    or a trainer); names the process and its error."""


class NeedsWholeModelError(ConfigError):
    """A method (or setting) that reads the whole float model at once, asked to run on blocks read one at a
    time from disk; the command line then quantizes in memory instead."""


class MissingExtraError(ConfigError):
    """A command or function that needs an optional dependency which is not installed; names the extra that
    adds it."""

    def __init__(self, what: str, module: str, extra: str):
        super().__init__(f'{what} needs {module}, which is not installed: pip install "leanlm[{extra}]"')


def one_line(error: BaseException) -> str:
    """A library's error message with its lines joined (for messages whose point is past the first line)."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__


def first_line(error: BaseException) -> str:
    """The first line of a library's error message (some explain themselves over a page), or its type."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# Optional dependencies (top-level module -> the extra of pyproject.toml that installs it).
EXTRAS = {
    "fastapi": "serve",
    "uvicorn": "serve",
    "starlette": "serve",
    "pydantic": "serve",
    "prometheus_client": "serve",
    "llguidance": "serve",
    "hivemind": "swarm",
    "compressed_tensors": "export",
    "matplotlib": "plots",
    "llama_cpp": "llama",
    "lm_eval": "lm-eval",
}


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The extra that installs the module `error` failed to import, or None if it is no optional dependency."""
    return EXTRAS.get((error.name or "").split(".")[0])


def require_extra(what: str, module: str) -> None:
    """Raise MissingExtraError unless `module` (an optional dependency) can be imported."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(what, module, EXTRAS[module])
