"""TRL's dataset formats through grpokit.train and `grpokit train`: a TRL script of the conversational kind
(system and user messages, a `solution` column, Open-R1-style rewards reading completion[0]["content"],
reward_weights) ported by changing only the import, the trainer call and the key names; prompt-only rows
(no `answer`), whose held-out evaluation reports each reward's mean; and the one-line refusals of bad input."""

import json
import os
import re
from pathlib import Path

import pytest

import grpokit
from grpokit.front_door import _dataset_source
from grpokit.config import ConfigError
from grpokit.data.files import DatasetError
from grpokit.data.templates import MESSAGES, render_messages
from grpokit.models import build_char_tokenizer
from grpokit.pipeline.build import ASCII_ALPHABET
from grpokit.rewards.scoring import WeightedReward, row_columns, score_completions
from grpokit.run.metrics import read_metrics
from run_helpers import cli

TEMPLATE = Path(__file__).parent / "fixtures" / "plain_chat_template.jinja"
SYSTEM = "Reason in <think> </think>, then answer in <answer> </answer>."
# The tiny model's sizes and a 2-step run (the TRL script's own settings are in the port below).
TINY = {"model.tiny.hidden_size": 32, "model.tiny.num_layers": 1, "model.tiny.num_heads": 2,
        "model.tiny.intermediate_size": 64, "grpo.prompts_per_step": 2, "eval.k": 0, "eval.tir": False,
        "data.heldout_fraction": 0.2, "data.chat_template_file": str(TEMPLATE)}


def conversational_rows(n: int = 24) -> list[dict]:
    return [{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"}],
             "solution": str(a + b)} for a, b in ((i % 7 + 1, i % 5 + 2) for i in range(n))]


# The TRL script's reward functions, as Open-R1 writes them, unchanged.
def accuracy_reward(completions, solution, **kwargs):
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if sol in content else 0.0 for content, sol in zip(contents, solution)]


def format_reward(completions, **kwargs):
    pattern = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, content, re.DOTALL) else 0.0 for content in contents]


# What the port changes: `from trl import GRPOConfig, GRPOTrainer` -> `import grpokit`, and
#   GRPOTrainer(model=MODEL, reward_funcs=[accuracy_reward, format_reward], train_dataset=rows,
#                args=GRPOConfig(output_dir=OUT, reward_weights=[1.0, 0.5], max_steps=2, num_generations=4,
#                                max_completion_length=16)).train()
# -> the call below (key names as docs/guides/from-trl.md maps them).
def port(model: str, rows, out: Path, extra: dict):
    return grpokit.train(model, rewards=[accuracy_reward, format_reward], reward_weights=[1.0, 0.5], dataset=rows,
                         output_dir=out, progress=False,
                         config={"grpo.max_steps": 2, "grpo.num_generations": 4, "grpo.max_completion_length": 16,
                                 **extra})


def test_a_conversational_trl_script_ports_to_grpokit_train(tmp_path):
    run = port("tiny", conversational_rows(), tmp_path / "run", TINY)
    assert [r["step"] for r in run.metrics] == [1, 2]
    names = [f"{__name__}:accuracy_reward", f"{__name__}:format_reward"]  # importable: named by import path
    assert {f"rewards/{name}" for name in names} <= set(run.metrics[0])
    assert [(r.name, r.weight) for r in run.config.rewards] == [(names[0], 1.0), (names[1], 0.5)]
    means = run.summary["heldout_reward_means"]  # no `answer`: each reward's mean on held-out rows
    assert list(means["before"]) == list(means["after"]) == names
    assert "grpo_accuracy" not in run.summary and names[0] in (run.dir / "results.md").read_text()
    first = json.loads((run.dir / "dataset.jsonl").read_text().splitlines()[0])
    assert first["prompt"][0]["role"] == "system"  # the rows as given


@pytest.mark.real
def test_the_port_trains_smollm2(tmp_path):
    model = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"
    if not (model / "config.json").is_file():
        pytest.skip("needs `make models`")
    run = port(str(model), conversational_rows(), tmp_path / "run",
               {"grpo.prompts_per_step": 2, "eval.k": 0, "eval.tir": False, "data.heldout_fraction": 0.2})
    assert [r["step"] for r in run.metrics] == [1, 2]
    assert len(run.summary["heldout_reward_means"]["after"]) == 2


def test_the_same_rows_as_jsonl_train_from_the_command_line(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversational_rows()))
    reward = "[{name: 'test_trl_formats:accuracy_reward', weight: 1.0}, {name: 'test_trl_formats:format_reward', weight: 0.5}]"
    cli("train", f"--output_dir={tmp_path / 'run'}", f"--data.sources=[{{path: {data}}}]", f"--rewards={reward}",
        "--grpo.max_steps=2", "--grpo.num_generations=4", "--grpo.max_completion_length=16", "--model.tiny.alphabet=ascii",
        "--quiet", *(f"--{k}={json.dumps(v)}" for k, v in TINY.items()),
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])})
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and "rewards/test_trl_formats:format_reward" in rows[0]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert list(summary["heldout_reward_means"]["after"]) == ["test_trl_formats:accuracy_reward",
                                                               "test_trl_formats:format_reward"]


def test_user_rewards_get_trls_arguments_and_grpokits_own_get_text():
    seen = {}

    def recording(prompts, completions, solution, **kwargs):
        seen.update(prompts=prompts, completions=completions, solution=solution, kwargs=set(kwargs))
        return [1.0] * len(completions)

    def builtin(prompts, completions, **kwargs):  # as a grpokit reward: text whatever the format
        seen["builtin"] = completions
        return [0.0] * len(completions)

    builtin.__module__ = "grpokit.rewards.math_rewards"
    messages = conversational_rows(1)[0]["prompt"]
    rows = [{"prompt": "rendered", MESSAGES: messages, "solution": "3"}, {"prompt": "plain", "solution": "4"}]
    conv = score_completions([WeightedReward("r", recording), WeightedReward("b", builtin)], ["rendered"], ["x"],
                             row_columns(rows[:1]))
    assert conv.valid.all()
    assert seen["prompts"] == [messages] and seen["completions"] == [[{"role": "assistant", "content": "x"}]]
    assert seen["solution"] == ["3"] and MESSAGES not in seen["kwargs"] and seen["builtin"] == ["x"]
    score_completions([WeightedReward("r", recording)], ["plain"], ["y"], row_columns(rows[1:]))
    assert seen["prompts"] == ["plain"] and seen["completions"] == ["y"]  # plain prompts keep strings


def test_bad_conversational_input_is_one_line_naming_the_row_and_field(tmp_path):
    rows = conversational_rows(4)
    rows[2] = {**rows[2], "prompt": [{"role": "user"}]}
    with pytest.raises(ConfigError, match=r"^dataset row 2: prompt\[0\] has no text 'content'"):
        port("tiny", rows, tmp_path / "a", TINY)
    tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    with pytest.raises(DatasetError, match="needs a chat template.*data.chat_template_file") as err:
        render_messages(rows[0]["prompt"], tokenizer, "rows.jsonl row 0")
    assert "\n" not in str(err.value)
    tokenizer.chat_template = TEMPLATE.read_text()
    with pytest.raises(DatasetError, match=r"rows.jsonl row 1: field 'prompt' \(roles narrator\).*rejects") as err:
        render_messages([{"role": "narrator", "content": "hi"}], tokenizer, "rows.jsonl row 1")
    assert "\n" not in str(err.value)
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": [{"content": "no role"}]}) + "\n")
    proc = cli("train", f"--output_dir={tmp_path / 'b'}", f"--data.sources=[{{path: {data}}}]",
               "--rewards=[{name: format}]", "--quiet", check=False)
    assert proc.returncode == 1 and f"{data}:1: prompt[0] has no text 'role'" in proc.stderr


def test_reward_weights_of_another_length_name_both_lengths(tmp_path):
    with pytest.raises(ConfigError, match="^reward_weights has 1 weight and rewards has 2 rewards"):
        grpokit.train("tiny", rewards=[accuracy_reward, format_reward], reward_weights=[1.0],
                      dataset=conversational_rows(), output_dir=tmp_path / "run", config=TINY)
    assert not (tmp_path / "run").exists()


def test_plain_prompts_without_an_answer_need_the_users_rewards(tmp_path):
    """...and what a reward logs through TRL's log_extra and log_metric lands in metrics.jsonl, beside
    the completion_ids TRL's trainer passes too."""
    rows = [{"prompt": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(24)]
    with pytest.raises(ConfigError, match="no 'answer' column"):
        grpokit.train("tiny", dataset=rows, output_dir=tmp_path / "a", config=TINY)
    lengths = []

    def contains(prompts, completions, solution, completion_ids, log_extra=None, log_metric=None, **kwargs):
        assert all(isinstance(c, str) for c in completions)  # plain prompts: plain strings
        lengths.extend(len(ids) for ids in completion_ids)
        log_extra("solution", list(solution))
        log_metric("mean_tokens", sum(map(len, completion_ids)) / len(completion_ids))
        return [float(s in c) for c, s in zip(completions, solution)]

    run = grpokit.train("tiny", rewards=[contains], dataset=rows, output_dir=tmp_path / "b", progress=False,
                        config={**TINY, "grpo.max_steps": 1, "grpo.num_generations": 2,
                                "grpo.max_completion_length": 8})
    assert set(run.summary["heldout_reward_means"]["before"]) == {"contains"}
    row = run.metrics[0]
    assert len(row["rewards/contains/solution"]) == 2 * TINY["grpo.prompts_per_step"]
    assert row["rewards/contains/mean_tokens"] == pytest.approx(row["completion/mean_length"])
    assert 0 < max(lengths) <= 8


def test_a_datasets_dataset_of_conversations_is_read_as_its_rows():
    datasets = pytest.importorskip("datasets")
    rows = conversational_rows(3)
    assert _dataset_source(datasets.Dataset.from_list(rows), needs_answer=False) == (rows, "")
