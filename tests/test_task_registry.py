"""Tasks by name: task.name picks a registered task or a user's class by import path, and "auto"
picks as grpokit always has (math when data names sources, else chain)."""

import pytest

from grpokit.checks import load_config
from grpokit.config import ConfigError
from grpokit.tasks import TASKS, register_task, task_for
from grpokit.tasks.base import TaskData
from grpokit.tasks.chain import ChainTask
from grpokit.tasks.math import MathTask


class MyTask:
    """A user's task, named by import path as task.name=test_task_registry:MyTask."""

    name, reward, step_labeller, hard_negative = "mine", None, None, None

    def __init__(self, config):
        self.seed = config.seed

    def data(self, tokenizer, sft=True):
        return TaskData([], [{"prompt": "Q: 1+1\n", "answer": "2"}], [])

    def extract_answer(self, completion):
        return completion.strip() or None

    def tir_rows(self, rows, tokenizer):
        return None

    def tir_answer(self, completion):
        return None

    def grade(self, rows, completions):
        return [self.extract_answer(c) == r["answer"] for r, c in zip(rows, completions)]

    def report(self, result):
        return {}


class NotATask:
    name = "half"

    def data(self, tokenizer, sft=True):
        return TaskData([], [], [])


def my_reward(prompts, completions, answer, **_):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def test_every_task_module_registers_itself():
    assert TASKS["chain"] is ChainTask and TASKS["math"] is MathTask
    assert ChainTask.name == "chain" and MathTask.name == "math"


def test_a_name_taken_by_another_class_is_refused():
    with pytest.raises(ValueError, match=r"task name 'chain' of test_task_registry.MyTask is taken by "
                                         r"grpokit.tasks.chain.ChainTask: register it under another name"):
        register_task("chain")(MyTask)
    assert TASKS["chain"] is ChainTask and register_task("chain")(ChainTask) is ChainTask


def test_auto_picks_as_before():
    assert load_config().task.name == "auto"
    assert isinstance(task_for(load_config()), ChainTask)
    sources = ["--data.sources=[{path: questions.jsonl}]"]
    assert isinstance(task_for(load_config(overrides=sources)), MathTask)
    for key in ("data.sft_sources", "data.eval_sources"):
        assert isinstance(task_for(load_config(overrides=[f"--{key}=[{{path: q.jsonl}}]"])), MathTask)


def test_an_explicit_name_picks_the_task_and_its_reward():
    chain = load_config(overrides=["--task.name=chain"])
    assert isinstance(task_for(chain), ChainTask) and [r.name for r in chain.rewards] == ["chain_accuracy"]
    math = load_config(overrides=["--task.name=math"])  # the default chain_accuracy would grade it by chain's rule
    assert isinstance(task_for(math), MathTask) and [r.name for r in math.rewards] == ["math_accuracy"]
    # the rewards a config names stay as they are
    own = load_config(overrides=["--task.name=math", "--rewards=[{name: math_accuracy, weight: 2}, {name: format}]"])
    assert [(r.name, r.weight) for r in own.rewards] == [("math_accuracy", 2.0), ("format", 1.0)]


def test_an_unknown_name_is_refused_with_the_closest_one():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["--task.name=chian"])
    message = str(err.value)
    assert message.startswith("task.name: unknown task 'chian' (did you mean 'chain'?)")
    assert "the registered ones are auto, chain, " in message and "'package.module:ClassName'" in message
    with pytest.raises(ConfigError, match=r"a colon before the ClassName: 'mypkg.tasks:MyTask'"):
        load_config(overrides=["--task.name=mypkg.tasks.MyTask"])


def test_a_reward_of_another_task_is_refused():
    with pytest.raises(ConfigError, match=r"rewards\[1\]: chain_accuracy grades the chain task, not task.name=math: "
                                          r"use --rewards='\[\{name: math_accuracy\}\]'"):
        load_config(overrides=["--task.name=math", "--rewards=[{name: format}, {name: chain_accuracy}]"])


def test_a_task_by_import_path():
    config = load_config(overrides=["--task.name=test_task_registry:MyTask",
                                    "--rewards=[{name: test_task_registry:my_reward}]"])
    task = task_for(config)
    assert isinstance(task, MyTask) and task.grade(task.data(None).train, ["2"]) == [True]
    with pytest.raises(ConfigError, match="use a reward that grades it"):
        load_config(overrides=["--task.name=test_task_registry:MyTask"])


def test_an_import_path_that_is_no_task_is_refused():
    with pytest.raises(ConfigError, match=r"task.name: task 'test_task_registry:NotATask' lacks extract_answer, "
                                          r"grade, hard_negative, report, reward, step_labeller, tir_answer, tir_rows "
                                          r"of the Task protocol"):
        load_config(overrides=["--task.name=test_task_registry:NotATask"])
    with pytest.raises(ConfigError, match="module 'test_task_registry' has no class 'Missing'"):
        load_config(overrides=["--task.name=test_task_registry:Missing"])
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        load_config(overrides=["--task.name=no_such_module:Task"])


def test_help_lists_the_registered_tasks():
    from grpokit.cli import config_keys_help

    text = config_keys_help(demo=False)
    doc = text[text.index("--task.name='auto'"):].split("\n  --", 1)[0]
    assert "'package.module:ClassName'" in doc and f"(registered: {', '.join(sorted(TASKS))})" in doc


def test_auto_with_data_files_is_graded_by_the_math_reward():
    """task.name=auto with data files is the math task: its default reward is math_accuracy, never chain's
    rule (which scores every GSM8K answer 0); rewards a config names stay."""
    files = load_config(overrides=["--data.sources=[{path: questions.jsonl}]"])
    assert [r.name for r in files.rewards] == ["math_accuracy"]
    assert [r.name for r in load_config().rewards] == ["chain_accuracy"]  # no files: the chain task
    own = load_config(overrides=["--data.sources=[{path: q.jsonl}]", "--rewards=[{name: format}]"])
    assert [r.name for r in own.rewards] == ["format"]
