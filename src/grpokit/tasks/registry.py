"""Tasks by name: each module of grpokit.tasks registers its own (`@register_task("chain")`), and
grpokit.tasks imports every module it holds, so a new task is one new file there. A config may
also name its own task class by import path, 'package.module:ClassName', as it can a reward."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import TYPE_CHECKING

from grpokit.rewards.registry import import_user_module, unknown_name
from grpokit.tasks.base import Task

if TYPE_CHECKING:
    from grpokit.config import Config

TASKS: dict[str, type] = {}


def register_task(name: str):
    """Class decorator: make the task class available to configs as task.name=`name`. A name
    taken by another class is refused (a copied task file that kept its name would shadow it)."""

    def wrap(cls: type) -> type:
        taken = TASKS.get(name)
        if taken is not None and f"{taken.__module__}.{taken.__qualname__}" != f"{cls.__module__}.{cls.__qualname__}":
            raise ValueError(f"task name {name!r} of {cls.__module__}.{cls.__qualname__} is taken by "
                             f"{taken.__module__}.{taken.__qualname__}: register it under another name")
        cls.name = name
        TASKS[name] = cls
        return cls

    return wrap


def load_builtin_tasks() -> None:
    """Import every module of this folder: each registers the task it defines, so a new task is
    one new file here. Found by listing the folder, as plugins are: nothing names them."""
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"{__package__}.{module.name}")


def task_names() -> list[str]:
    """The names task.name takes without an import path ("auto" picks one of them)."""
    load_builtin_tasks()
    return sorted(TASKS)


def task_class(name: str) -> type:
    """A registered task's class, or the class an import path 'package.module:ClassName' names;
    ValueError, naming the registered tasks, when neither."""
    names = task_names()
    if name in TASKS:
        return TASKS[name]
    if ":" not in name:
        raise ValueError(unknown_name(name, ["auto", *names], "task", "registered", "ClassName"))
    module_name, _, attr = name.partition(":")
    cls = getattr(import_user_module(module_name, name, "task"), attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"task {name!r}: module {module_name!r} has no class {attr!r}")
    missing = _missing_members(cls)
    if missing:
        raise ValueError(f"task {name!r} lacks {', '.join(missing)} of the Task protocol (grpokit.tasks.base.Task)")
    return cls


def _missing_members(cls: type) -> list[str]:
    """The members of the Task protocol that `cls` does not define."""
    members = {*Task.__annotations__, *(n for n, v in vars(Task).items() if callable(v) and not n.startswith("_"))}
    return sorted(m for m in members if not hasattr(cls, m))


def task_for(config: Config) -> Task:
    """The task task.name names. "auto": the files' math questions when the config names any
    data, else the built-in chain arithmetic."""
    return task_class(config.task.resolved_name(config.data))(config)
