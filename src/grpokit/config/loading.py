"""Reading a config: YAML files, then `--key=value` overrides, into the dataclass tree, validated.

pydantic checks the tree (types, Literals, nested sections, unknown keys); its errors are re-worded
here so that a message names the dotted key, says what was expected and where the value came from."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import typing
from pathlib import Path
from typing import Literal

import pydantic
import yaml

from grpokit.config.schema import Config, leaf_paths, to_dict
from grpokit.config.validation import validate
from grpokit.errors import ConfigError

_EXPECTED = {"int": "expected an integer", "float": "expected a number", "bool": "expected true or false",
             "string": "expected a string", "list": "expected a list", "dataclass": "expected a mapping of keys",
             "dict": "expected a mapping of keys", "none": "expected null"}


def _dotted(loc: tuple) -> str:
    key = ""
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
        elif not part[:1].isupper() and part not in ("function-after", "tagged-union"):  # skip pydantic's type tags
            key += f".{part}" if key else part
    return key


def _config_error(err: pydantic.ValidationError, cls) -> ConfigError:
    """The first validation error, named by its dotted key, with a 'did you mean' for unknown keys."""
    first = err.errors(include_url=False)[0]
    key, kind, value = _dotted(first["loc"]), first["type"], first.get("input")
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        parent, _, leaf = key.rpartition(".")
        section = cls
        for part in filter(None, parent.split(".")):  # down to the section (a list's item type for [i])
            tp = typing.get_type_hints(section)[part.split("[")[0]]
            section = typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp
        names = [f.name for f in dataclasses.fields(section)]
        close = difflib.get_close_matches(leaf, names, n=1)
        hint = f" (did you mean '{parent + '.' if parent else ''}{close[0]}'?)" if close else \
            f"; valid keys: {', '.join(names)}"
        return ConfigError(f"unknown config key '{key}'{hint}")
    if kind == "literal_error":  # pydantic says "'a', 'b' or 'c'"
        choices = re.findall(r"'([^']*)'", first["ctx"]["expected"])
        return ConfigError(f"{key}: {value!r} is not one of {choices}")
    expected = next((text for name, text in _EXPECTED.items() if kind.startswith(name)), first["msg"])
    return ConfigError(f"{key}: {expected}, got {type(value).__name__} {value!r}")


def from_dict(cls, data: dict):
    """Build dataclass `cls` from a mapping; unknown keys and wrong types raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping, got {data!r}")
    try:
        return pydantic.TypeAdapter(cls).validate_python(_yaml_switches(cls, data))
    except pydantic.ValidationError as err:
        error = _config_error(err, cls)
        error.key = _dotted(err.errors(include_url=False)[0]["loc"])
        raise error from None


def _yaml_switches(cls, data):
    """`data` with the booleans YAML makes of on/off (and yes/no) turned back into "on"/"off" where
    the key takes those words: `distributed.fsdp: on` and `--distributed.fsdp=on` mean "on". A
    single name where a list of names goes is that list: `report_to: tensorboard` = [tensorboard]."""
    if not (dataclasses.is_dataclass(cls) and isinstance(data, dict)):
        return data
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in data.items():
        tp = hints.get(key)
        if isinstance(value, bool) and typing.get_origin(tp) is Literal and {"on", "off"} <= set(typing.get_args(tp)):
            value = "on" if value else "off"
        elif isinstance(value, str) and value and _is_list_of_names(tp):
            value = [value]
        elif dataclasses.is_dataclass(tp):
            value = _yaml_switches(tp, value)
        out[key] = value
    return out


def _is_list_of_names(tp) -> bool:
    """list[str] or list[Literal[...]]: a list whose items are plain words."""
    item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
    return item is str or typing.get_origin(item) is Literal


def resolve_key(key: str, cls=Config) -> str:
    """A dotted key, or a bare leaf name when it is unique in the tree (`beta` -> `grpo.beta`)."""
    paths = leaf_paths(cls)
    if key in paths:
        return key
    matches = [p for p in paths if p.rsplit(".", 1)[-1] == key]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise ConfigError(f"override --{key} is ambiguous: write one of {', '.join('--' + m for m in matches)}")
    leaves = {p.rsplit(".", 1)[-1]: p for p in paths}
    close = difflib.get_close_matches(key, list(paths), n=1) or [
        leaves[m] for m in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaves), n=1)
    ]
    raise ConfigError(f"unknown config key '{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))


def apply_overrides(data: dict, overrides: list[str], cls=Config) -> dict:
    """Apply `--key=value` (or `key=value`) overrides to a raw mapping; values are YAML scalars."""
    data = copy.deepcopy(data)
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        if "=" not in text:
            raise ConfigError(f"override {item!r} must look like --key=value")
        key, raw = text.split("=", 1)
        path = resolve_key(key.strip(), cls).split(".")
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{part}' is not a section")
        node[path[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return data


def load_config(path: str | Path | list | None = None, overrides: list[str] | None = None, cls=Config):
    """Config from optional YAML files (later files override earlier ones, key by key) plus
    overrides, fully validated."""
    data: dict = {}
    paths = [p for p in (path if isinstance(path, list) else [path]) if p is not None]
    for p in map(Path, paths):
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            layer = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{p}: not valid YAML ({err})") from err
        if not isinstance(layer, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of config keys")
        data = _merge(data, layer)
    data = apply_overrides(data, overrides or [], cls)
    try:
        config = from_dict(cls, data)
    except ConfigError as err:
        raise ConfigError(_with_source(err, paths, overrides or [], cls)) from None
    validate(config)
    return config


def _with_source(err: ConfigError, paths: list, overrides: list[str], cls) -> str:
    """The error with where the bad value came from: the command-line override that set its key
    (the last one wins, as in apply_overrides), else the YAML file."""
    key = err.key
    for item in reversed(overrides):
        try:
            dotted = resolve_key(item.removeprefix("--").split("=", 1)[0].strip(), cls)
        except ConfigError:
            continue
        if key == dotted or key.startswith((dotted + ".", dotted + "[")):
            return f"{err} (from the command-line override {item})"
    return f"{paths[-1]}: {err}" if paths else str(err)


def _merge(base: dict, layer: dict) -> dict:
    out = dict(base)
    for key, value in layer.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def save_config(config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
