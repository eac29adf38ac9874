"""grpokit.train, the Python front door (grpokit/front_door/__init__.py): the README's snippet as written, the same run as
`grpokit train`, its refusals of bad input, a reward function that raises, and run directories kept."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

import grpokit
from grpokit.front_door import _dataset_source
from grpokit.cli import main as cli_main
from grpokit.checks import load_config
from grpokit.config import ConfigError
from grpokit.run.directory import RunDirectoryInUse
from grpokit.rewards.registry import reward_names
from grpokit.run.metrics import read_metrics
from grpokit.train.failures import RewardFailure
from test_docs import README, code_blocks

# A tiny run of the built-in chain task: one small model, two steps, eight held-out questions, greedy only.
SMALL = {"grpo.max_steps": 2, "grpo.prompts_per_step": 2, "grpo.num_generations": 4,
         "grpo.max_completion_length": 12, "model.tiny.hidden_size": 32, "model.tiny.num_layers": 1,
         "model.tiny.num_heads": 2, "model.tiny.intermediate_size": 64, "task.num_eval_questions": 8,
         "task.num_rl_questions": 64, "eval.k": 0, "eval.tir": False}


def readme_snippet() -> str:
    """The README's Python block that calls grpokit.train, exactly as written."""
    return next("\n".join(body) for lang, body, _ in code_blocks(README)
                if lang == "python" and any("grpokit.train(" in line for line in body))


def test_the_readme_snippet_runs_as_written(tmp_path, monkeypatch, capsys):
    snippet = readme_snippet()
    assert len(snippet.splitlines()) <= 10
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "README.md", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out.strip().splitlines()[-1].split()
    run = tmp_path / printed[0]
    assert run == tmp_path / "runs" / "train"
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    summary = json.loads((run / "summary.json").read_text())
    assert float(printed[1]) == summary["grpo"]["greedy_accuracy"]
    config = yaml.safe_load((run / "config.yaml").read_text())  # brevity is registered for the run only
    assert [r["name"] for r in config["rewards"]] == ["math_accuracy", "brevity"]
    assert config["data"]["sources"][0]["path"] == str(Path("runs") / "train" / "dataset.jsonl")
    assert len((run / "dataset.jsonl").read_text().splitlines()) == 81
    assert "rewards/brevity" in read_metrics(run / "metrics.jsonl")[0]


def test_the_front_door_gives_the_command_lines_run(tmp_path, monkeypatch):
    """The same arguments through both doors: the same config and the same steps, number for number."""
    monkeypatch.chdir(tmp_path)
    run = grpokit.train("tiny", rewards=["chain_accuracy"], config=SMALL, output_dir="py", progress=False)
    argv = ["train", "--output-dir", "cli", "--quiet", "--rewards=[{name: chain_accuracy}]"]
    assert cli_main(argv + [f"--{k}={json.dumps(v)}" for k, v in SMALL.items()]) == 0
    as_cli = load_config("cli/config.yaml")
    as_cli.output_dir = "py"
    assert as_cli == run.config
    steps = read_metrics(Path("cli") / "metrics.jsonl")
    for key in ("reward/mean", "loss", "kl", "completion/mean_length"):
        assert [r[key] for r in run.metrics] == [r[key] for r in steps], key
    results = [{k: v for k, v in summary["grpo"].items() if not k.endswith("seconds")}
               for summary in (run.summary, json.loads(Path("cli/summary.json").read_text()))]
    assert json.dumps(results[0]) == json.dumps(results[1])  # NaN (no pass@k here) compares equal as text


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rewards": [42]}, r"rewards\[0\]: 42 is neither a registered reward name nor a callable; pass a name"),
    ({"rewards": ["chain_accuracy", None]}, r"rewards\[1\]: None is neither"),
    ({"rewards": ["chain_acuracy"]}, r"rewards\[0\]: unknown reward function 'chain_acuracy' \(did you mean "
                                     r"'chain_accuracy'\?\)"),
    ({"dataset": [{"prompt": "1+1", "answer": "2"}, {"question": "2+2", "answer": "4"}]},
     r"dataset row 1 has no 'prompt' column \(.*its columns: question, answer\): add it, or rename the column"),
    ({"dataset": [{"prompt": "1+1"}]}, r"dataset row 0 has no 'answer' column"),
    ({"dataset": ["1+1"]}, r"dataset row 0 is a str, not a dict"),
    ({"dataset": "no-such-file.jsonl"}, r"dataset='no-such-file.jsonl' is no file"),
    ({"config": {"grpo.bta": 0.1}}, r"unknown config key 'grpo.bta' \(did you mean 'grpo.beta'\?\)"),
    ({"config": {"model.name_or_path": "x"}, "model": "y"}, r"config\['model.name_or_path'\] and the model= argument"),
])
def test_bad_input_is_one_config_error_naming_the_argument(kwargs, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        grpokit.train(**{"output_dir": "run", **kwargs}, progress=False)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_datasets_dataset_is_read_as_its_rows():
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "1+1", "answer": "2", "level": 1}]
    assert _dataset_source(datasets.Dataset.from_list(rows)) == (rows, "")


def test_a_reward_that_raises_is_counted_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = []

    def flaky(prompts, completions, **columns):  # fails its first batch only
        calls.append(len(completions))
        if len(calls) == 1:
            raise RuntimeError("flaky verifier")
        return [0.0 for _ in completions]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = grpokit.train("tiny", rewards=["chain_accuracy", flaky], config=SMALL, output_dir="run",
                            progress=False)
    assert [r["rewards/failed"] for r in run.metrics] == [8, 0]  # B x G = 8 samples of step 1 lost, then none
    assert any("reward function 'flaky' failed on this batch: RuntimeError: flaky verifier" in str(w.message)
               for w in caught)
    assert "flaky" not in reward_names()  # registered for the run only: no name left behind for later errors


def test_a_reward_that_fails_every_sample_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def broken(prompts, completions, **columns):
        raise KeyError("no such column")

    with pytest.raises(RewardFailure, match="reward function 'broken' failed on every sample for 2 consecutive"):
        grpokit.train("tiny", rewards=[broken], config={**SMALL, "grpo.max_failed_steps": 2}, output_dir="run",
                      progress=False)


def test_a_run_directory_is_never_overwritten(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"{a}+1", "answer": str(a + 1)} for a in range(8)]
    first = grpokit.train("tiny", rewards=["chain_accuracy"], dataset=rows, progress=False,
                          config={**SMALL, "grpo.max_steps": 1, "data.template": "none"})
    assert first.dir == Path("runs/train")
    before = {p: p.read_bytes() for p in first.dir.rglob("*") if p.is_file()}
    with pytest.raises(RunDirectoryInUse, match="already holds a run"):
        grpokit.train("tiny", rewards=["chain_accuracy"], dataset=rows[:2], output_dir=first.dir, progress=False)
    assert before == {p: p.read_bytes() for p in first.dir.rglob("*") if p.is_file()}


def test_import_grpokit_stays_light_and_train_stays_callable():
    code = ("import sys, grpokit; light = 'transformers' not in sys.modules; import grpokit.train.loop; "
            "print(light, callable(grpokit.train), grpokit.train.loop.Trainer.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "Trainer"]
