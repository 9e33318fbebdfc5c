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


class NeedsWholeModelError(ConfigError):
    """A method (or setting) that reads the whole float model at once, asked to run on blocks read one at a
    time from disk; the command line then quantizes in memory instead."""
