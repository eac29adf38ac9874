"""Tasks: where the prompts, the rule that grades an answer, and the held-out evaluation come
from. The demo's chain arithmetic, GSM8K/MATH files and the rest implement one interface (base.Task).

Every module of this package is imported here, and each registers the task it defines
(`@register_task`), so a new task is one new file in this folder, nothing else."""

from grpokit.tasks.base import Task, TaskData
from grpokit.tasks.registry import TASKS, load_builtin_tasks, register_task, task_class, task_for, task_names

load_builtin_tasks()

__all__ = ["TASKS", "Task", "TaskData", "register_task", "task_class", "task_for", "task_names"]
