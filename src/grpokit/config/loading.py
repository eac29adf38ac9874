"""Reading a config: YAML files, then `--key=value` overrides, into the dataclass tree, validated.

pydantic checks the tree (types, Literals, nested sections, unknown keys); its errors are re-worded
here so that a message names the dotted key, says what was expected and where the value came from."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import pydantic
import yaml

from grpokit.config.schema import Config, leaf_paths, to_dict
from grpokit.config.validation import check_values
from grpokit.errors import ConfigError

# Keys that moved: old dotted key -> new dotted key. Wherever keys come in (YAML files, nested
# mappings, --key=value overrides, a run's saved config.yaml) an old key reads as its new one, and
# stderr gets one line per old key. An old key whose new key lies under it (reward_model.label ->
# reward_model.label.method) is the old key only when it holds a single value: a mapping there is the
# new section. Those come before the keys that move into their section.
RENAMED_KEYS = {
    "reward_model.label": "reward_model.label.method",
    "reward_model.label_rollouts": "reward_model.label.rollouts",
    "reward_model.label_skip_uniform": "reward_model.label.skip_uniform",
    "reward_model.learning_rate": "reward_model.train.learning_rate",
    "reward_model.max_steps": "reward_model.train.max_steps",
    "reward_model.train_batch_size": "reward_model.train.batch_size",
    "reward_model.warmup_steps": "reward_model.train.warmup_steps",
    "reward_model.heldout_fraction": "reward_model.train.heldout_fraction",
    "reward_model.balance_step_labels": "reward_model.train.balance_step_labels",
    "reward_model.num_questions": "reward_model.data.num_questions",
    "reward_model.samples_per_question": "reward_model.data.samples_per_question",
    "reward_model.sample_temperature": "reward_model.data.temperature",
    "reward_model.max_pairs_per_prompt": "reward_model.data.max_pairs_per_prompt",
    "reward_model.hard_negatives": "reward_model.data.hard_negatives",
    "reward_model.replay_fraction": "iterative.replay_fraction",
}
_announced: set[str] = set()  # the old keys already named on stderr: one line each per process


def _announce(old: str, new: str) -> None:
    if old not in _announced:
        _announced.add(old)
        print(f"grpokit: {old} is now {new} (the old key still works)", file=sys.stderr)


def _is_old_key(old: str, value) -> bool:
    """Whether `value` at dotted key `old` is the renamed key's, not the new section of that name."""
    return not (RENAMED_KEYS[old].startswith(old + ".") and isinstance(value, dict))


def renamed_keys(data: dict, announce: bool = True, moved: dict[str, str] | None = None) -> dict:
    """`data`, a mapping of the whole config tree, with every old key of RENAMED_KEYS moved to its
    new place (a copy; `data` is left as it is). `announce`: name each old key on stderr (once per
    process); `moved`: filled with {new key: old key} for each key moved. Both an old key and its new
    one in the same mapping is an error: which one means what is not clear."""
    if not isinstance(data, dict):
        return data
    out = copy.deepcopy(data)
    for old, new in RENAMED_KEYS.items():
        *parents, leaf = old.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node or not _is_old_key(old, node[leaf]):
            continue
        value = node.pop(leaf)
        *new_parents, new_leaf = new.split(".")
        target = out
        for part in new_parents:
            if part not in target:
                target[part] = {}
            target = target[part]
            if not isinstance(target, dict):  # not a section: pydantic names what is wrong there
                node[leaf] = value
                break
        else:
            if new_leaf in target:
                raise ConfigError(f"{old} and {new} are both set: {old} is the old name of {new}; keep only {new}")
            target[new_leaf] = value
            if announce:
                _announce(old, new)
            if moved is not None:
                moved[new] = old
    return out


def _renamed_override(key: str, value, cls) -> tuple[str, str] | None:
    """(old key, new key) when override `key` is an old key: dotted, or the bare leaf name of one old
    key that no key of the tree has now (`--train_batch_size`, as `--beta` is grpo.beta)."""
    if cls is not Config:
        return None
    old = key if key in RENAMED_KEYS else None
    if old is None and "." not in key and not any(p.rsplit(".", 1)[-1] == key for p in leaf_paths(cls)):
        olds = [o for o in RENAMED_KEYS if o.rsplit(".", 1)[-1] == key]
        old = olds[0] if len(olds) == 1 else None
    if old is None or not _is_old_key(old, value):
        return None
    return old, RENAMED_KEYS[old]


def _with_old_names(message: str, moved: dict[str, str]) -> str:
    """`message` naming each moved key as the user wrote it (the stderr line says its new name)."""
    for new, old in moved.items():
        message = re.sub(rf"(?<![\w.]){re.escape(new)}(?!\w)", old, message)
    return message


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
    if cls is Config:
        data = renamed_keys(data)
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


def apply_overrides(data: dict, overrides: list[str], cls=Config, moved: dict[str, str] | None = None) -> dict:
    """Apply `--key=value` (or `key=value`) overrides to a raw mapping; values are YAML scalars. An old
    key (RENAMED_KEYS) sets its new one, named on stderr; `moved` is filled as renamed_keys fills it."""
    data = copy.deepcopy(data)
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        if "=" not in text:
            raise ConfigError(f"override {item!r} must look like --key=value")
        key, raw = text.split("=", 1)
        value = yaml.safe_load(raw) if raw.strip() else ""
        renamed = _renamed_override(key.strip(), value, cls)
        if renamed is not None:
            _announce(*renamed)
        dotted = renamed[1] if renamed else resolve_key(key.strip(), cls)
        if moved is not None:  # the last setting names the key, as it sets the value
            moved.pop(dotted, None)
            moved.update({renamed[1]: renamed[0]} if renamed else {})
        path = dotted.split(".")
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{part}' is not a section")
        node[path[-1]] = value
    return data


def read_config(path: str | Path | list | None = None, overrides: list[str] | None = None, cls=Config,
                announce_renames: bool = True, check: Callable[[Config], None] | None = None):
    """Config from optional YAML files (later files override earlier ones, key by key) plus
    overrides, validated (grpokit.config.check_values). Old keys (RENAMED_KEYS) set their new ones, and an
    error about one names it as it was written; `announce_renames=False` for a file grpokit wrote
    itself (a run's config.yaml), whose old keys are no news to the user. `check`: more checks of the
    config, run after check_values' and reported the same way; grpokit.checks.load_config passes the
    registries' (the names of rewards, engines, tasks, ...), which this leaf package does not import."""
    data: dict = {}
    moved: dict[str, str] = {}  # {new key: old key} of the old keys given, to name them as written in errors
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
        try:
            layer = renamed_keys(layer, announce_renames, moved) if cls is Config else layer
        except ConfigError as err:
            raise ConfigError(f"{p}: {err}") from None
        data = _merge(data, layer)
    data = apply_overrides(data, overrides or [], cls, moved)
    try:
        config = from_dict(cls, data)
    except ConfigError as err:
        raise ConfigError(_with_old_names(_with_source(err, paths, overrides or [], cls), moved)) from None
    try:
        check_values(config)
        if check is not None:
            check(config)
    except ConfigError as err:
        if not moved:
            raise
        raise ConfigError(_with_old_names(str(err), moved)) from None
    return config


def _with_source(err: ConfigError, paths: list, overrides: list[str], cls) -> str:
    """The error with where the bad value came from: the command-line override that set its key
    (the last one wins, as in apply_overrides), else the YAML file."""
    key = err.key
    for item in reversed(overrides):
        name = item.removeprefix("--").split("=", 1)[0].strip()
        try:
            renamed = _renamed_override(name, None, cls)
            dotted = renamed[1] if renamed else resolve_key(name, cls)
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
    """Write the config whole or not at all (a run killed mid-write keeps the config it had: the
    resume command reads it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    os.replace(tmp, path)
