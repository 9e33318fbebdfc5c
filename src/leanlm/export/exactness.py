"""What a checkpoint needs to be written exactly in another engine's format, said as the `leanlm quantize`
settings that would give it: every exporter checks all of its modules first and refuses with one line that
names every missing setting, before anything is written."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from leanlm.errors import ConfigError
from leanlm.nn import QUANTIZED_MODULES

# What each kind of quantized module is, in the words of the methods that make it.
MODULE_KINDS = {name: cls.kind for name, cls in QUANTIZED_MODULES.items()}


def require_exact(target: str, modules: Iterable[nn.Module], problems_of: Callable[[nn.Module], list[str]]) -> None:
    """Raise one ConfigError naming every setting `modules` would need for an exact `target` form (each once, in
    the order found); nothing if every module has one."""
    found = list(dict.fromkeys(problem for module in modules for problem in problems_of(module)))
    if found:
        raise ConfigError(f"this checkpoint has no exact {target} form; quantize it with: {'; '.join(found)}")
