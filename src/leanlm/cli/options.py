"""`leanlm quantize`'s method options, generated from the method configs (`leanlm.methods.recipes`).

Every command-line field of a config is a flag (`--field-name`, or the field's own `flag`), with the field's
help and each recipe's default. Flags are read as text and converted by the field's type only once the method
is known, so one flag can serve fields of several methods (`--bits`) and a flag that belongs to no step of the
chosen method is refused by name. Range checks are the configs' own: nothing here repeats a default or a bound.
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


def flag_of(item: Field) -> str:
    if item.metadata.get("flag"):
        return item.metadata["flag"]
    prefix = "--no-" if item.type in (bool, "bool") and item.default is True else "--"
    return prefix + item.name.replace("_", "-")


@cache
def _type_of(config_type: type, name: str):
    return typing.get_type_hints(config_type)[name]


def command_line_fields(config_type: type) -> list[Field]:
    return [item for item in fields(config_type) if item.metadata.get("cli", True) and not item.name.startswith("_")]


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
    parser.add_argument("--method", required=True, choices=list(RECIPES),
                        help="; ".join(f"{name}: {recipe.help}" for name, recipe in RECIPES.items()))
    for name, recipe in RECIPES.items():
        if recipe.bases:
            parser.add_argument("--base", choices=list(recipe.bases),
                                help=f"{name}: the int8 recipe after it (default {next(iter(recipe.bases))})")
    for flag, uses in _flag_table().items():
        _, first_type, first = uses[0]
        lines: dict[str, list[str]] = {}
        seen: set[str] = set()
        for method, _, item in uses:
            if method in seen:  # one line per method: a flag that sets two fields of one recipe means one thing
                continue
            seen.add(method)
            lines.setdefault(_help_line(RECIPES.get(method), item), []).append(method)
        text = "; ".join(f"{', '.join(methods)}: {line}" for line, methods in lines.items()).replace("%", "%%")
        if first.type in (bool, "bool"):
            parser.add_argument(flag, dest=_DEST + flag, action="store_const", const=not first.default,
                                default=argparse.SUPPRESS, help=text)
        else:
            choices = _choices(first_type, first)
            parser.add_argument(flag, dest=_DEST + flag, default=argparse.SUPPRESS, help=text,
                                metavar="{" + ",".join(choices) + "}" if choices else _metavar(first_type, first))


def _help_line(recipe: Recipe | None, item: Field) -> str:
    if item.type in (bool, "bool"):
        return f"{item.metadata['help']}" + ("; this flag turns it off" if item.default else "")
    default = _default(recipe, item)
    if default is None and item.metadata.get("none_word"):
        default = item.metadata["none_word"]
    return f"{item.metadata['help']} (default {default})"


def _metavar(config_type: type, item: Field) -> str:
    hinted = _type_of(config_type, item.name)
    kinds = typing.get_args(hinted) or (hinted,)
    word = "N" if int in kinds else "X" if float in kinds else "TEXT"
    extra = [item.metadata["none_word"]] if item.metadata.get("none_word") else []
    extra += [literal for kind in kinds if typing.get_origin(kind) is typing.Literal
              for literal in typing.get_args(kind)]
    return "|".join([word, *extra])


def _choices(config_type: type, item: Field) -> tuple[str, ...]:
    if item.metadata.get("choices"):
        return tuple(item.metadata["choices"])
    hinted = _type_of(config_type, item.name)
    return tuple(typing.get_args(hinted)) if typing.get_origin(hinted) is typing.Literal else ()


def _convert(text: str, flag: str, config_type: type, item: Field):
    """`text` as the field's type, or a ConfigError naming the flag."""
    if item.type in (bool, "bool"):
        return text
    if item.metadata.get("none_word") is not None and text == item.metadata["none_word"]:
        return None
    choices = _choices(config_type, item)
    if choices:
        if text not in choices:
            raise ConfigError(f"{flag} {text!r}: choose from {', '.join(choices)}")
        return text
    hinted = _type_of(config_type, item.name)
    kinds = typing.get_args(hinted) if isinstance(hinted, types.UnionType) or typing.get_origin(hinted) is typing.Union \
        else (hinted,)
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
                raise ConfigError(f"{flag}: expected {what}{''.join(f' or {w!r}' for w in words)}, "
                                  f"got {text!r}") from None
    return text


def method_configs(args: argparse.Namespace) -> tuple[list, Calibration]:
    """The configs `--method` and its flags describe, and the calibration settings: built (so every value is
    checked by its config) before anything slow happens."""
    recipe = RECIPES[args.method]
    if args.base is not None and not recipe.bases:
        raise ConfigError(f"--base applies to --method {', '.join(n for n, r in RECIPES.items() if r.bases)}")
    step_types = recipe.step_types(args.base)
    given = {key[len(_DEST):]: value for key, value in vars(args).items() if key.startswith(_DEST)}
    table = _flag_table()
    allowed = {flag_of(item) for config_type in (*step_types, Calibration) for item in command_line_fields(config_type)}
    for flag in given:
        if flag not in allowed:
            owners = sorted({method for method, _, _ in table[flag]})
            raise ConfigError(f"{flag} is not an option of --method {args.method}"
                              + (f" --base {args.base or next(iter(recipe.bases))}" if recipe.bases else "")
                              + f" (it is one of {', '.join(owners)})")

    def build(config_type: type, defaults: dict):
        settings = {}
        for item in command_line_fields(config_type):
            flag = flag_of(item)
            if flag in given:
                settings[item.name] = _convert(given[flag], flag, config_type, item)
            elif item.name in defaults:
                settings[item.name] = defaults[item.name]
        try:
            return config_type(**settings)
        except ConfigError as error:  # it names the field; say which flag that is
            named = sorted((item for item in command_line_fields(config_type)
                            if re.search(rf"\b({item.name}|{item.name.replace('_', ' ')})\b", str(error))),
                           key=lambda item: -len(item.name))  # "statistic bits" names statistic_bits, not bits
            raise ConfigError(f"{flag_of(named[0]) if named else '--method ' + args.method}: {error}") from None

    configs = [build(config_type, recipe.defaults) for config_type in step_types]
    if not any(method_spec(config).needs_calibration(config) for config in configs):
        unused = [flag_of(item) for item in command_line_fields(Calibration) if flag_of(item) in given]
        if unused:
            raise ConfigError(f"{', '.join(unused)}: --method {args.method} as set reads no calibration text")
    return configs, build(Calibration, {})
