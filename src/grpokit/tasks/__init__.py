"""Tasks: where the prompts, the rule that grades an answer, and the held-out evaluation come
from. The demo's chain arithmetic, GSM8K/MATH files and the rest implement one interface (base.Task).

Every module of this package is imported here, and each registers the task it defines
(`@register_task`), so a new task is one new file in this folder, nothing else."""

import importlib
import pkgutil

from grpokit.tasks.base import Task, TaskData, task_for
from grpokit.tasks.registry import TASKS, register_task, task_class, task_names

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["TASKS", "Task", "TaskData", "register_task", "task_class", "task_for", "task_names"]
