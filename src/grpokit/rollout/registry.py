"""Rollout engines by name (`rollout.engine`), each registered in the module that defines it.

An engine is registered with what the run needs to know before building it:
`copies_weights` (it holds its own copy of the policy: the trainer pushes weights after every
update, and the engine wants the run's longest prompt + completion and the directory the policy
was loaded from), the optional package it needs, and how to install that package. Adding an
engine is one module in grpokit.rollout (every module of the package is imported with it):

    @register_engine("my_engine", copies_weights=True, package="my_lib", install="pip install my_lib",
                     check=lambda rollout_config: [])  # its own config problems, one line each
    def build(rollout_config, model, tokenizer, seed, model_len, weights_dir) -> RolloutEngine: ...
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSpec:
    name: str
    build: Callable  # (rollout_config, model, tokenizer, seed, model_len, weights_dir) -> RolloutEngine
    copies_weights: bool
    package: str | None = None  # an optional dependency, checked when the config loads
    install: str = ""  # what to run when `package` is missing
    tensor_parallel: bool = False  # rollout.tensor_parallel_size > 1 means something to it
    runs_in_worker: bool = False  # it can be built in a rollout worker process (rollout.workers, rollout/worker.py)
    # check(rollout_config) -> the engine's own config problems (one line each: the key, the fix), or None
    check: Callable | None = None


ENGINES: dict[str, EngineSpec] = {}


def register_engine(name: str, *, copies_weights: bool, package: str | None = None, install: str = "",
                    tensor_parallel: bool = False, runs_in_worker: bool = False, check: Callable | None = None):
    def decorate(build):
        ENGINES[name] = EngineSpec(name, build, copies_weights, package, install, tensor_parallel, runs_in_worker,
                                   check)
        return build
    return decorate


def engine_spec(name: str) -> EngineSpec:
    if name in ENGINES:
        return ENGINES[name]
    close = difflib.get_close_matches(name, ENGINES, n=1)
    raise ValueError(f"rollout.engine: unknown engine {name!r}{f' (did you mean {close[0]!r}?)' if close else ''}; "
                     f"registered: {', '.join(sorted(ENGINES))}")
