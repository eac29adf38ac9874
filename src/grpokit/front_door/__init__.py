"""`grpokit.train(...)`: the Python front door, the same run as the command line.

    import grpokit
    run = grpokit.train("tiny", rewards=["math_accuracy", my_reward], dataset=rows,
                        config={"grpo.max_steps": 2, "grpo.beta": 0.1})
    run.dir, run.summary, run.metrics

Each argument becomes what `grpokit train` reads from its command line, and the run goes through
the same pipeline (pipeline/stages.py): `model` is model.name_or_path ("tiny" for the built-in tiny
model, "demo" for `grpokit demo`'s preset, SFT then GRPO), `rewards` the rewards list, `dataset`
data.sources, `config` the `--key=value` overrides. A reward may be a registered name or a
function with TRL's signature, fn(prompts, completions, **columns) -> list[float | None]. Rows
given in memory are written to the run directory as dataset.jsonl, which its config.yaml names.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from transformers.utils import logging as hf_logging

from grpokit.checks import load_config  # the config with its names checked against the registries
from grpokit.config import Config, ConfigError, resolve_key
from grpokit.data.files import is_conversation, message_problem
from grpokit.models.loading import check_model_config
from grpokit.pipeline import stages
from grpokit.rewards.registry import get_reward_function, register_reward, reward_names, unregister_reward
from grpokit.run.claim import claim
from grpokit.run.directory import CLAIMED, NEW, OVERWRITE, default_run_dir
from grpokit.run.metrics import read_metrics

DEMO_PRESET = resources.files("grpokit") / "presets" / "demo.yaml"
DATASET_FILE = "dataset.jsonl"  # rows given in memory, in the run directory
TINY, DEMO = "tiny", "demo"
# What the arguments set; the same key in `config` as well would leave one of the two unread.
ARGUMENT_KEYS = {"model.name_or_path": "model", "rewards": "rewards", "data.sources": "dataset",
                 "output_dir": "output_dir", "seed": "seed"}


@dataclass(frozen=True)
class Run:
    """A finished run: its directory, summary.json (the before/after results, the checkpoint) and
    metrics.jsonl (one dict per step)."""

    dir: Path
    summary: dict
    metrics: list[dict]
    config: Config


def train(model: str = TINY, rewards: Iterable | str | Callable | None = None, dataset=None,
          config: Mapping | None = None, *, reward_weights: Iterable[float] | None = None,
          output_dir: str | os.PathLike | None = None, seed: int | None = None,
          overwrite: bool = False, progress: bool = True) -> Run:
    """Train `model` with GRPO (or what config's algo names) and return the run.

    model: a checkpoint directory or hub id; "tiny" (the built-in tiny Llama, fresh); "demo" (the
        demo's preset: SFT the tiny model on the built-in task, then GRPO from it).
    rewards: registered names (grpokit.rewards.registry: chain_accuracy, math_accuracy, ...) or
        TRL-style functions fn(prompts, completions, **columns) -> list[float | None]; a function
        that raises is counted in rewards/failed as on the command line, and the run stops only
        when a reward fails every sample for grpo.max_failed_steps steps. Default: the task's own.
    reward_weights: one weight per reward, in the order of `rewards` (TRL's GRPOConfig.reward_weights);
        default 1.0 each.
    dataset: a list of dicts with "prompt" and "answer", a `datasets.Dataset` of them, or a
        JSONL/JSON/Parquet path (read as `data.sources`). Default: the built-in chain task. A prompt
        is text, or TRL's conversational format (a list of {"role", "content"} messages, rendered
        with the chat template; rewards then get each completion as [{"role": "assistant",
        "content": text}]). With `rewards` of your own, rows need no "answer": held-out evaluation
        then reports each reward's mean before and after RL.
    config: overrides by dotted key, as the command line's --key=value: {"grpo.beta": 0.1}.
    output_dir: the run directory; default runs/train (or runs/train-N), as the command line. A
        directory holding a run is refused unless `overwrite` (it is never overwritten otherwise).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the command line sets them
    hf_logging.disable_progress_bar()
    given = _given(config if config is not None else {}, {"model": model, "rewards": rewards, "dataset": dataset,
                                                           "output_dir": output_dir, "seed": seed})
    if model not in (TINY, DEMO):
        given["model.name_or_path"] = str(model)
    if seed is not None:
        given["seed"] = int(seed)
    registered: list[str] = []  # the caller's functions, registered for this run only
    try:
        return _train(model, rewards, dataset, given, overwrite, progress, registered, reward_weights)
    finally:
        for name in registered:
            unregister_reward(name)


def _train(model, rewards, dataset, given: dict, overwrite: bool, progress: bool, registered: list[str],
           reward_weights=None) -> Run:
    command = "demo" if model == DEMO else "train"
    if rewards is not None:
        names = reward_config_names(rewards, registered)
        weights = _weights(reward_weights, len(names))
        given["rewards"] = [{"name": name, "weight": w} for name, w in zip(names, weights)]
    elif reward_weights is not None:
        raise ConfigError("reward_weights= weighs the rewards= functions, and rewards= is not given: pass rewards=[...] "
                          "in the order of the weights")
    rows = None
    if dataset is not None:
        rows, source = _dataset_source(dataset, needs_answer=rewards is None)
        if model == TINY and not given.keys() & {"model.name_or_path", "model.tiny.alphabet"}:
            given["model.tiny.alphabet"] = "ascii"  # the built-in task's characters cannot spell text
    if given.get("output_dir"):
        run_dir = Path(given["output_dir"])
    else:
        run_dir = default_run_dir(command)
        print(f"grpokit: run directory {run_dir} (output_dir= picks another)", file=sys.stderr)
    given["output_dir"] = str(run_dir)
    if dataset is not None:
        given["data.sources"] = [{"path": str(run_dir / DATASET_FILE if rows is not None else source)}]
    overrides = [f"--{key}={json.dumps(value)}" for key, value in given.items()]
    loaded = load_config([str(DEMO_PRESET)] if command == "demo" else [], overrides)
    check_model_config(loaded)
    mode = OVERWRITE if overwrite else NEW
    if rows is not None:  # claim the directory first: a used one is refused before anything is written
        claim(str(run_dir), mode)
        _write_rows(run_dir / DATASET_FILE, rows)
        mode = CLAIMED
    if command == "demo":
        summary = stages.run_demo(loaded, progress, mode)
    else:
        summary = stages.run_train(loaded, progress, run_dir_mode=mode)
    metrics = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    return Run(run_dir, summary, metrics, loaded)


def _given(config: Mapping, arguments: dict) -> dict:
    """config's {dotted key: value}, keys resolved as the command line resolves them (a bare leaf
    name works when unique); a nested {section: {key: value}} is read as its dotted keys."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a dict of dotted keys, e.g. {{'grpo.beta': 0.1}}; got "
                          f"{type(config).__name__}")
    out = {}
    for key, value in _flatten(config):
        dotted = resolve_key(key)
        argument = ARGUMENT_KEYS.get(dotted)
        if argument and arguments.get(argument) not in (None, TINY):
            raise ConfigError(f"config[{key!r}] and the {argument}= argument both set {dotted}: pass one of them")
        out[dotted] = value
    if arguments.get("output_dir") is not None:
        out["output_dir"] = str(arguments["output_dir"])
    return out


def _flatten(config: Mapping, prefix: str = ""):
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and not _is_leaf(name):
            yield from _flatten(value, name + ".")
        else:
            yield name, value


def _is_leaf(name: str) -> bool:
    try:
        resolve_key(name)
    except ConfigError:
        return False
    return True


def reward_config_names(rewards, registered: list[str] | None = None) -> list[str]:
    """The rewards list's names: a registered name as it is; a function by its import path
    ('module:function') when it can be imported from there, else registered under its own name
    (for the run: a function defined in a notebook or script); `registered` collects those names."""
    items = [rewards] if isinstance(rewards, str) or callable(rewards) else list(rewards)
    names = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            names.append(item)  # an unknown name is the config loader's one-line error, with the closest name
        elif callable(item):
            name = _importable_name(item)
            if name is None:
                name = _registered_name(item, i)
                if registered is not None:
                    registered.append(name)
            names.append(name)
        else:
            raise ConfigError(
                f"rewards[{i}]: {item!r} is neither a registered reward name nor a callable; pass a name (one of "
                f"{', '.join(reward_names())}) or a function fn(prompts, completions, **columns) -> list[float]")
    if not names:
        raise ConfigError("rewards is empty: pass at least one reward name or function, or leave rewards out for "
                          "the task's own reward")
    return names


def _importable_name(fn) -> str | None:
    """'module:qualname' when importing it there gives back `fn` (so config.yaml can name it)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname or "." in qualname:
        return None
    loaded = sys.modules.get(module) or importlib.import_module(module)
    return f"{module}:{qualname}" if getattr(loaded, qualname, None) is fn else None


def _registered_name(fn, index: int) -> str:
    """`fn` registered under its name, or under name_2, ... where that name holds another function."""
    base = getattr(fn, "__name__", "") or f"reward_{index}"
    base = base if base.isidentifier() else f"reward_{index}"  # a lambda's "<lambda>"
    name, n = base, 1
    while name in reward_names() and get_reward_function(name) is not fn:
        n += 1
        name = f"{base}_{n}"
    register_reward(name)(fn)
    return name


def _weights(reward_weights, count: int) -> list[float]:
    """TRL's reward_weights: one number per reward, in the order of rewards=; default 1.0 each."""
    if reward_weights is None:
        return [1.0] * count
    weights = [reward_weights] if isinstance(reward_weights, (int, float)) else list(reward_weights)
    if len(weights) != count:
        raise ConfigError(f"reward_weights has {len(weights)} weight{'s' * (len(weights) != 1)} and rewards has "
                          f"{count} reward{'s' * (count != 1)}: give one weight per reward, in the order of rewards")
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise ConfigError(f"reward_weights[{i}] is {w!r}, not a number")
    return [float(w) for w in weights]


def _dataset_source(dataset, needs_answer: bool = True) -> tuple[list[dict] | None, str]:
    """(rows to write, or None for a file; the file's path): a path as it is, rows checked. A
    prompt is text or a list of messages; `needs_answer`: the task's own reward grades the rows."""
    if isinstance(dataset, (str, os.PathLike)):
        if not Path(dataset).is_file():
            raise ConfigError(f"dataset={str(dataset)!r} is no file: pass a JSONL/JSON/Parquet path, a list of dicts "
                              "or a datasets.Dataset")
        return None, str(dataset)
    rows = dataset.to_list() if hasattr(dataset, "to_list") else dataset  # a datasets.Dataset
    if isinstance(rows, Mapping) or not isinstance(rows, Iterable):
        raise ConfigError(f"dataset must be a list of dicts, a datasets.Dataset or a file path; got "
                          f"{type(dataset).__name__}")
    rows = list(rows)
    if not rows:
        raise ConfigError("dataset is empty: pass rows with a 'prompt' and an 'answer' column")
    columns = (("prompt", "the text or the messages the policy completes"),
               ("answer", "the reference the task's own reward grades against; rewards of your own need none"))
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ConfigError(f"dataset row {i} is a {type(row).__name__}, not a dict: pass rows like "
                              "{'prompt': ..., 'answer': ...}")
        if is_conversation(row.get("prompt")):
            problem = message_problem(f"dataset row {i}", "prompt", list(row["prompt"]))
            if problem:
                raise ConfigError(problem)
        unchecked = {"prompt"} if is_conversation(row.get("prompt")) else set()  # its messages were checked
        if not needs_answer:
            unchecked.add("answer")
        for column, why in columns:
            if column not in unchecked and not isinstance(row.get(column), (str, int, float)) or str(row.get(column)).strip() == "":
                raise ConfigError(f"dataset row {i} has no {column!r} column ({why}; its columns: "
                                  f"{', '.join(map(str, row)) or 'none'}): add it, or rename the column that "
                                  f"holds it to {column!r}")
    return [dict(row) for row in rows], ""


def _write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")
