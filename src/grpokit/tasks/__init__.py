"""Tasks: where the prompts, the rule that grades an answer, and the held-out evaluation come
from. The demo's chain arithmetic and GSM8K/MATH files are two implementations of one interface."""

from grpokit.tasks.base import Task, TaskData, task_for

__all__ = ["Task", "TaskData", "task_for"]
