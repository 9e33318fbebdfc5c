"""`option()`: a settings field that carries its meaning. Every config and settings dataclass in leanlm (the
methods' configs, evaluation, streaming, chat, fine-tuning, the swarm) declares its fields with it, so that a
default and its help text live in one place and the command line is generated from them (`leanlm.cli.options`)."""

from __future__ import annotations

from dataclasses import field


def option(
    default,
    help: str,
    *,
    flag: str | None = None,
    none_word: str | None = None,
    choices: tuple = (),
    cli: bool = True,
    off: str | None = None,
):
    """A field with its default and help text. `flag` is the command line's spelling where it is not
    `--field-name`; `none_word` is how the command line says None (`row` for one block per row); `choices` the
    values a string field takes; `cli=False` keeps a field off the command line; `off`, for a setting that is on
    by default, what its `--no-...` flag does."""
    if default is True and cli and not off:
        raise TypeError(f"an option on by default needs `off`, what its --no- flag does ({help!r})")
    metadata = {"help": help, "flag": flag, "none_word": none_word, "choices": choices, "cli": cli, "off": off}
    return field(default=default, metadata=metadata)


SEEDS = 2**63  # seeds are whole numbers below this: what every generator leanlm seeds (torch's, numpy's) accepts


def check_seed(seed, name: str = "seed") -> None:
    from leanlm.errors import ConfigError

    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < SEEDS:
        raise ConfigError(f"{name} must be a whole number from 0 to 2**63 - 1, got {seed!r}")
