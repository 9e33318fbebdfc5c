"""The command line's options, generated from the config and settings dataclasses (`leanlm.settings.option`).

Every command-line field is a flag (`--field-name`, or the field's own `flag`), with the field's help and its
default (a recipe's, or a command's, where it sets one over the field's own). Flags are read as text and converted
by the field's type when the config is built, and a config's error, which names its field, is reported under the
field's flag: range checks are the configs' own, and nothing here repeats a default or a bound.

`leanlm quantize`'s method options come from the method configs of `leanlm.methods.recipes`: they are converted
only once the method is known, so one flag can serve fields of several methods (`--bits`), and a flag that
belongs to no step of the chosen method is refused by name. The other commands' options come from their
settings dataclasses (`add_settings_options` / `settings_from_args`).
"""

from __future__ import annotations

import argparse
import re
import types
import typing
from dataclasses import MISSING, Field, fields
from functools import cache

from leanlm.errors import ConfigError
from leanlm.methods.quantize import Calibration, method_spec
from leanlm.methods.recipes import RECIPES, Recipe

_DEST = "option:"  # argparse dest prefix of generated flags; absent from the namespace unless given


def option_dest(flag: str) -> str:
    """Where a generated flag's value lands in the argparse namespace (for an alias that sets the same field)."""
    return _DEST + flag


def flag_of(item: Field) -> str:
    if item.metadata.get("flag"):
        return item.metadata["flag"]
    prefix = "--no-" if item.type in (bool, "bool") and item.default is True else "--"
    return prefix + item.name.replace("_", "-")


def opposite_flag(flag: str) -> str:
    """The switch that undoes `flag`: --x for --no-x, --no-x for --x."""
    return "--" + flag[len("--no-") :] if flag.startswith("--no-") else "--no-" + flag[2:]


@cache
def _type_of(config_type: type, name: str):
    return typing.get_type_hints(config_type)[name]


def command_line_fields(config_type: type) -> list[Field]:
    """The fields declared with `option()` and not kept off the command line."""
    return [item for item in fields(config_type) if "help" in item.metadata and item.metadata["cli"]]


def _flag_table() -> dict[str, list[tuple[str, type, Field]]]:
    """flag -> every (method, config type, field) it sets."""
    table: dict[str, list] = {}
    for method, recipe in RECIPES.items():
        for config_type in dict.fromkeys(recipe.step_types() + tuple(t for b in recipe.bases.values() for t in b)):
            for item in command_line_fields(config_type):
                table.setdefault(flag_of(item), []).append((method, config_type, item))
    for item in command_line_fields(Calibration):
        table.setdefault(flag_of(item), []).append(("calibration", Calibration, item))
    return table


def _default(recipe: Recipe | None, item: Field):
    if recipe is not None and item.name in recipe.defaults:
        return recipe.defaults[item.name]
    return item.default if item.default is not MISSING else None


def add_method_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--method",
        required=True,
        choices=list(RECIPES),
        help="; ".join(f"{name}: {recipe.help}" for name, recipe in RECIPES.items()),
    )
    for name, recipe in RECIPES.items():
        if recipe.bases:
            parser.add_argument(
                "--base",
                choices=list(recipe.bases),
                help=f"{name}: the int8 recipe after it (default {next(iter(recipe.bases))})",
            )
    for uses in _flag_table().values():
        _, first_type, first = uses[0]
        lines: dict[str, list[str]] = {}
        seen: set[str] = set()
        for method, _, item in uses:
            if method in seen:  # one line per method: a flag that sets two fields of one recipe means one thing
                continue
            seen.add(method)
            lines.setdefault(_help_line(_default(RECIPES.get(method), item), item), []).append(method)
        _add_flag(
            parser, first_type, first, "; ".join(f"{', '.join(methods)}: {line}" for line, methods in lines.items())
        )
    for opposite, (item, methods) in _opposite_flags().items():
        parser.add_argument(
            opposite,
            dest=option_dest(flag_of(item)),
            action="store_const",
            const=item.default,
            default=argparse.SUPPRESS,
            help=f"{', '.join(methods)}: "
            + (
                f"{item.metadata['help']} (undoes {flag_of(item)}, the default here)"
                if item.default
                else f"turn {flag_of(item)} off (it is on by default)"
            ),
        )


def _opposite_flags() -> dict[str, tuple[Field, list[str]]]:
    """For a switch that a recipe turns the other way by default (gptq's --static-groups), the flag that turns it
    back: {"--no-static-groups": (field, [methods])}."""
    opposites: dict[str, tuple[Field, list[str]]] = {}
    for flag, uses in _flag_table().items():
        for method, _, item in uses:
            recipe = RECIPES.get(method)
            if item.type in (bool, "bool") and recipe is not None and _default(recipe, item) != item.default:
                opposites.setdefault(opposite_flag(flag), (item, []))[1].append(method)
    return opposites


def add_settings_options(parser: argparse.ArgumentParser, *settings_types: type, defaults: dict | None = None) -> None:
    """A flag for every command-line field of each settings dataclass; `defaults`: this command's own defaults
    over the fields' (field name -> value)."""
    defaults = defaults or {}
    for settings_type in settings_types:
        for item in command_line_fields(settings_type):
            default = defaults.get(item.name, item.default)
            _add_flag(parser, settings_type, item, _help_line(default, item))
            if item.type in (bool, "bool") and default != item.default:  # this command turns the switch the other way
                parser.add_argument(
                    opposite_flag(flag_of(item)),
                    dest=option_dest(flag_of(item)),
                    action="store_const",
                    const=item.default,
                    default=argparse.SUPPRESS,
                    help=(item.metadata["help"] if item.default else item.metadata["off"]).replace("%", "%%"),
                )


def settings_from_args(settings_type: type, args: argparse.Namespace, defaults: dict | None = None):
    """The settings the command line gave (`defaults`, field name -> value, under the flags), checked by the
    dataclass itself; its error is reported under the flag of the field it names."""
    return _build(settings_type, _given(args), defaults or {})


def _add_flag(parser: argparse.ArgumentParser, config_type: type, item: Field, text: str) -> None:
    flag, text = flag_of(item), text.replace("%", "%%")
    if item.type in (bool, "bool"):
        parser.add_argument(
            flag,
            dest=option_dest(flag),
            action="store_const",
            const=not item.default,
            default=argparse.SUPPRESS,
            help=text,
        )
        return
    choices = _choices(config_type, item)
    metavar = "{" + ",".join(map(str, choices)) + "}" if choices else _metavar(config_type, item)
    repeated = typing.get_origin(_type_of(config_type, item.name)) is tuple  # --setting a --setting b, or a,b
    parser.add_argument(
        flag,
        dest=option_dest(flag),
        default=argparse.SUPPRESS,
        help=text,
        metavar=metavar,
        action="append" if repeated else "store",
    )


def _given(args: argparse.Namespace) -> dict:
    return {key[len(_DEST) :]: value for key, value in vars(args).items() if key.startswith(_DEST)}


def _help_line(default, item: Field) -> str:
    if item.type in (bool, "bool"):
        if default != item.default:  # a recipe sets this switch the other way: the flag restates the default
            return (
                f"{item.metadata['off']} (the default)" if item.default else f"{item.metadata['help']} (on by default)"
            )
        if item.default:  # a --no- flag: what it does, then what the default does
            return f"{item.metadata['off']} (default: {item.metadata['help']})"
        return item.metadata["help"]
    if isinstance(default, tuple):
        default = ",".join(map(str, default))
    if default is None and item.metadata.get("none_word"):
        default = item.metadata["none_word"]
    return f"{item.metadata['help']} (default {default})"


def _metavar(config_type: type, item: Field) -> str:
    hinted = _type_of(config_type, item.name)
    if typing.get_origin(hinted) is tuple:
        return "NAME"
    kinds = typing.get_args(hinted) or (hinted,)
    word = "N" if int in kinds else "X" if float in kinds else "TEXT"
    extra = [item.metadata["none_word"]] if item.metadata.get("none_word") else []
    extra += [
        literal for kind in kinds if typing.get_origin(kind) is typing.Literal for literal in typing.get_args(kind)
    ]
    return "|".join([word, *extra])


def _choices(config_type: type, item: Field) -> tuple[str, ...]:
    if item.metadata.get("choices"):
        return tuple(item.metadata["choices"])
    hinted = _type_of(config_type, item.name)
    return tuple(typing.get_args(hinted)) if typing.get_origin(hinted) is typing.Literal else ()


def _convert(text, flag: str, config_type: type, item: Field):
    """`text` as the field's type, or a ConfigError naming the flag."""
    if item.type in (bool, "bool"):
        return text
    if isinstance(text, list):  # a repeated flag: its values, each of which may be comma-separated
        return tuple(name.strip() for value in text for name in value.split(",") if name.strip())
    if item.metadata.get("none_word") is not None and text == item.metadata["none_word"]:
        return None
    choices = _choices(config_type, item)
    if choices:
        chosen = next((choice for choice in choices if str(choice) == text), None)
        if chosen is None:
            raise ConfigError(f"{flag} {text!r}: choose from {', '.join(map(str, choices))}")
        return chosen
    hinted = _type_of(config_type, item.name)
    kinds = (
        typing.get_args(hinted)
        if isinstance(hinted, types.UnionType) or typing.get_origin(hinted) is typing.Union
        else (hinted,)
    )
    words = [word for kind in kinds if typing.get_origin(kind) is typing.Literal for word in typing.get_args(kind)]
    if text in words:
        return text  # a word the field takes beside numbers (SmoothQuant's alpha 'auto')
    words += [item.metadata["none_word"]] if item.metadata.get("none_word") else []
    for kind in (int, float):
        if kind in kinds:
            try:
                return kind(text)
            except ValueError:
                what = "a whole number" if kind is int else "a number"
                raise ConfigError(
                    f"{flag}: expected {what}{''.join(f' or {w!r}' for w in words)}, got {text!r}"
                ) from None
    return text


def method_configs(args: argparse.Namespace) -> tuple[list, Calibration]:
    """The configs `--method` and its flags describe, and the calibration settings: built (so every value is
    checked by its config) before anything slow happens."""
    recipe = RECIPES[args.method]
    if args.base is not None and not recipe.bases:
        raise ConfigError(f"--base applies to --method {', '.join(n for n, r in RECIPES.items() if r.bases)}")
    step_types = recipe.step_types(args.base)
    given = _given(args)
    table = _flag_table()
    allowed = {flag_of(item) for config_type in (*step_types, Calibration) for item in command_line_fields(config_type)}
    for flag in given:
        if flag not in allowed:
            owners = sorted({method for method, _, _ in table[flag]})
            raise ConfigError(
                f"{flag} is not an option of --method {args.method}"
                + (f" --base {args.base or next(iter(recipe.bases))}" if recipe.bases else "")
                + f" (it is one of {', '.join(owners)})"
            )
    configs = [_build(config_type, given, recipe.defaults, f"--method {args.method}") for config_type in step_types]
    if not any(method_spec(config).needs_calibration(config) for config in configs):
        unused = [flag_of(item) for item in command_line_fields(Calibration) if flag_of(item) in given]
        if unused:
            raise ConfigError(f"{', '.join(unused)}: --method {args.method} as set reads no calibration text")
    return configs, _build(Calibration, given, {})


def _build(config_type: type, given: dict, defaults: dict, what: str | None = None):
    """`config_type` from the given flags over `defaults`; its error is reported under the flag of the field it
    names (or under `what`, if given)."""
    names = {item.name for item in fields(config_type)}
    settings = {name: value for name, value in defaults.items() if name in names}
    for item in command_line_fields(config_type):
        flag = flag_of(item)
        if flag in given:
            settings[item.name] = _convert(given[flag], flag, config_type, item)
    try:
        return config_type(**settings)
    except ConfigError as error:  # it names the field; say which flag that is
        named = sorted(
            (
                item
                for item in command_line_fields(config_type)
                if re.search(rf"\b({item.name}|{item.name.replace('_', ' ')})\b", str(error))
            ),
            key=lambda item: -len(item.name),
        )  # "statistic bits" names statistic_bits, not bits
        where = flag_of(named[0]) if named else what
        raise ConfigError(f"{where}: {error}" if where else str(error)) from None
