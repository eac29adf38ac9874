"""docs/guides/from-trl.md: its TRL script and its grpokit twin, as the page shows them, each run for 2 steps
on a tiny model instead of Qwen2.5-0.5B. The test changes only the model, the sizes (steps, batch, completion
length) and, for TRL, the CPU settings; every change must find its text, so a page edit that drops one fails
here. Without TRL installed (the bench extra) the TRL half skips, saying so."""

import importlib.util
import re
from pathlib import Path

import pytest

from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.pipeline.build import ASCII_ALPHABET
from grpokit.run.checkpoint import save_checkpoint
from grpokit.run.metrics import read_metrics
from test_docs import code_blocks

CHAT_TEMPLATE = Path(__file__).parent / "fixtures" / "plain_chat_template.jinja"

PAGE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "from-trl.md"
MODEL = '"Qwen/Qwen2.5-0.5B-Instruct"'


def twin(marker: str) -> str:
    return next("\n".join(body) for lang, body, _ in code_blocks(PAGE) if lang == "python" and marker in "\n".join(body))


def run_script(text: str, changes: dict[str, str]) -> dict:
    for old, new in changes.items():
        assert text.count(old) == 1, f"{PAGE.name}: expected {old!r} once in the script"
        text = text.replace(old, new)
    namespace = {"__name__": "__main__"}
    exec(compile(text, str(PAGE), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0)
    return repr(str(save_checkpoint(model, tokenizer, tmp_path_factory.mktemp("tiny") / "model")))


def test_the_twins_set_the_same_keys():
    """Each TRL key the TRL script sets has its grpokit key in the twin, with the same value."""
    trl, ours = twin("GRPOConfig("), twin("grpokit.train(")
    pairs = {"max_steps": "grpo.max_steps", "learning_rate": "grpo.learning_rate", "beta": "grpo.beta",
             "num_generations": "grpo.num_generations", "epsilon": "grpo.epsilon",
             "max_completion_length": "grpo.max_completion_length", "temperature": "grpo.temperature",
             "mask_truncated_completions": "grpo.mask_truncated_completions"}
    for key, dotted in pairs.items():
        theirs = re.search(rf"\b{key}=([^,)]+)", trl).group(1)
        mine = re.search(rf'"{re.escape(dotted)}": ([^,}}]+)', ours).group(1)
        assert eval(theirs) == eval(mine, {"True": True, "False": False}), key
    assert 'loss_type="grpo"' in trl and '"grpo.loss_aggregation": "sequence"' in ours
    assert 'scale_rewards="group"' in trl and '"grpo.scale_rewards": True' in ours
    batch = int(re.search(r"per_device_train_batch_size=(\d+)", trl).group(1))
    assert batch == 8 * int(re.search(r'"grpo.prompts_per_step": (\d+)', ours).group(1))  # completions vs prompts


def run_grpokit_twin(marker: str, model: str) -> dict:
    """The page's grpokit twin that holds `marker`, on `model`, cut to 2 small steps."""
    return run_script(twin(marker), {
        MODEL: model, '"grpo.max_steps": 200': '"grpo.max_steps": 2, "eval.k": 0, "eval.tir": False',
        '"grpo.num_generations": 8': '"grpo.num_generations": 2', '"grpo.prompts_per_step": 8': '"grpo.prompts_per_step": 2',
        '"grpo.max_completion_length": 256': '"grpo.max_completion_length": 8'})


def run_trl_twin(output_dir: str, model: str) -> dict:
    """The page's TRL script writing to `output_dir`, on `model`, cut to 2 small steps on the CPU."""
    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
        pytest.skip("TRL is not installed here: pip install -e '.[bench]' runs the TRL half of the page")
    return run_script(twin(f'output_dir="{output_dir}"'), {
        MODEL: model, "max_steps=200": "max_steps=2", "num_generations=8": "num_generations=2",
        "per_device_train_batch_size=64": "per_device_train_batch_size=4", "max_completion_length=256":
        "max_completion_length=8", f'GRPOConfig(output_dir="{output_dir}"': f'GRPOConfig(output_dir="{output_dir}", '
        'use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no", disable_tqdm=True'})


def test_the_grpokit_twin_runs(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = run_grpokit_twin("grpokit.train(", tiny)
    assert [r["step"] for r in read_metrics(tmp_path / "runs" / "grpokit" / "metrics.jsonl")] == [1, 2]
    assert "rewards/accuracy" in ns["run"].metrics[0]


def test_the_trl_script_runs(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = run_trl_twin("runs/trl", tiny)
    assert ns["trainer"].state.global_step == 2
    assert any("reward" in log for log in ns["trainer"].state.log_history)


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> str:
    """The tiny model with a chat template (its character tokenizer has none), for the conversational twins."""
    tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    tokenizer.chat_template = CHAT_TEMPLATE.read_text()
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0)
    return repr(str(save_checkpoint(model, tokenizer, tmp_path_factory.mktemp("tiny-chat") / "model")))


def test_the_conversational_twins_differ_only_in_the_import_the_call_and_the_keys():
    trl, ours = twin("runs/trl-chat"), twin("runs/grpokit-chat")
    head = lambda text: text.split("SYSTEM =")[0].replace("from datasets import Dataset\n", "")  # noqa: E731
    assert head(trl).replace("from trl import GRPOConfig, GRPOTrainer", "import grpokit") == head(ours)
    assert "reward_weights=[1.0, 0.5]" in trl and "reward_weights=[1.0, 0.5]" in ours
    assert 'completion[0]["content"]' in ours and '"role": "system"' in ours


def test_the_conversational_grpokit_twin_runs(tiny_chat, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = run_grpokit_twin("runs/grpokit-chat", tiny_chat)
    run = ns["run"]
    assert [r["step"] for r in run.metrics] == [1, 2]
    assert [r.weight for r in run.config.rewards] == [1.0, 0.5]
    assert len(run.summary["heldout_reward_means"]["after"]) == 2  # no answer column: each reward's mean


def test_the_conversational_trl_script_runs(tiny_chat, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = run_trl_twin("runs/trl-chat", tiny_chat)
    assert ns["trainer"].state.global_step == 2
    assert any("rewards/format_reward/mean" in log for log in ns["trainer"].state.log_history)
