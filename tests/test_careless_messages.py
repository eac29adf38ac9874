"""A careless user never sees a traceback: each mistake below is one line on stderr naming the key,
file or path and the fix, with exit status 1 or 2. Each runs the real command in a subprocess; the
mistakes that can be found before any model loads are found there."""

import functools
import json
import re
from pathlib import Path

import pytest
import torch

from grpokit.config import EvalConfig, ModelConfig, RolloutConfig
from grpokit.rewards.registry import reward_function, reward_names
from grpokit.train.step_metrics import NO_SIGNAL_STEPS, no_signal_warning
from run_helpers import cli

DOCS = Path(__file__).resolve().parents[1] / "docs"
TINY = ["--model.tiny.hidden_size=32", "--model.tiny.num_layers=2", "--model.tiny.num_heads=2",
        "--model.tiny.intermediate_size=64", "--num_rl_questions=64", "--num_eval_questions=8", "--eval.k=2",
        "--eval.before=false", "--eval.tir=false", "--prompts_per_step=2", "--num_generations=4",
        "--max_completion_length=16", "--grpo.max_steps=2", "--quiet"]


grpokit = functools.partial(cli, check=False, timeout=300)  # each test checks how the command failed


def one_line_error(proc, status: int) -> str:
    """The one stderr line of a command that failed as it should, without a traceback."""
    assert proc.returncode == status, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --- 1. devices this machine lacks, and values out of range -----------------------------------------

@pytest.mark.parametrize("device, available", [
    ("cuda", torch.cuda.is_available()), ("cuda:3", torch.cuda.device_count() > 3),
    ("mps", torch.backends.mps.is_available())])
def test_a_device_the_machine_lacks_is_one_line_before_loading(tmp_path, device, available):
    if available:
        pytest.skip(f"this machine has {device}")
    line = one_line_error(grpokit("train", f"--model.device={device}", f"--output_dir={tmp_path}"), 2)
    assert line.startswith(f"grpokit: config error: model.device='{device}' but ")
    assert line.endswith("use cpu or auto")
    assert not (tmp_path / "config.yaml").exists()  # refused before the run started
    line = one_line_error(grpokit("eval", "some/model", "--data", "none.jsonl", "--output-dir", str(tmp_path),
                                  "--device", device), 1)
    assert line.startswith(f"grpokit: error: --device='{device}' but ") and line.endswith("use cpu or auto")


def test_a_gpu_index_beyond_the_visible_ones_names_the_ones_there(monkeypatch):
    from grpokit.models.loading import DeviceUnavailable, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeviceUnavailable, match=r"reward_model.device='cuda:3' but only 2 CUDA device\(s\) are "
                                                r"visible: use one of cuda:0 to cuda:1, cuda or auto"):
        resolve_device("cuda:3", "reward_model.device")
    assert resolve_device("cuda:1") == torch.device("cuda:1")


def test_a_negative_learning_rate_is_refused_with_the_default():
    line = one_line_error(grpokit("train", "--grpo.learning_rate=-1"), 2)
    assert line == "grpokit: config error: grpo.learning_rate must be > 0, got -1 (the default is 3e-05)"


# --- 2. and 3. a run directory or a LoRA adapter as the model -----------------------------------------

def test_a_run_directory_as_the_model_points_at_its_checkpoints(tmp_path):
    run = tmp_path / "runs" / "x"
    (run / "checkpoints" / "step-4").mkdir(parents=True)
    (run / "checkpoints" / "step-12").mkdir()
    (run / "checkpoints" / "sft").mkdir()
    (run / "checkpoints" / "sft" / "config.json").write_text("{}")
    (run / "config.yaml").write_text("seed: 0\n")
    proc = grpokit("train", "--model.name_or_path=runs/x", "--output_dir=out", *TINY, cwd=tmp_path)
    line = one_line_error(proc, 1)
    assert line == ("grpokit: error: model.name_or_path 'runs/x' is a grpokit run directory, not a model: pass one "
                    "of its checkpoints, e.g. --model.name_or_path=runs/x/checkpoints/step-12 (the latest) or "
                    "runs/x/checkpoints/sft (its pi_SFT)")
    assert "sentencepiece" not in proc.stderr
    assert not (tmp_path / "out").exists()  # refused before the run started


def test_a_run_directory_without_checkpoints_says_so(tmp_path):
    (tmp_path / "runs" / "y").mkdir(parents=True)
    (tmp_path / "runs" / "y" / "config.yaml").write_text("seed: 0\n")
    line = one_line_error(grpokit("sft", "--model.name_or_path=runs/y", "--output_dir=out", cwd=tmp_path), 1)
    assert "'runs/y' is a grpokit run directory, not a model: it holds no checkpoint yet" in line


@pytest.fixture
def lora_adapter(tmp_path):
    """(adapter directory, its PEFT model): a tiny base saved to base/, an adapter with non-zero B on it."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from grpokit.config import LoraConfig
    from grpokit.data import arithmetic
    from grpokit.models import build_char_tokenizer, build_tiny_model
    from grpokit.models.lora import apply_lora

    tokenizer = build_char_tokenizer(arithmetic.TIR_ALPHABET)
    build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64).save_pretrained(
        tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    peft_model = apply_lora(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), LoraConfig(r=4))
    torch.manual_seed(0)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    peft_model.save_pretrained(tmp_path / "adapter")
    tokenizer.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter", peft_model.eval()


def test_a_lora_adapter_loads_as_its_base_with_the_adapter_merged(lora_adapter):
    from grpokit.eval.benchmark import resolve_model
    from grpokit.models.loading import load_model_and_tokenizer

    adapter, peft_model = lora_adapter
    assert resolve_model(str(adapter)) == str(adapter)  # grpokit eval takes it as it is
    model, tokenizer = load_model_and_tokenizer(str(adapter))
    ids = tokenizer(["Q: 3+4-2\n"], return_tensors="pt")
    with torch.no_grad():
        assert torch.allclose(model(**ids).logits, peft_model(**ids).logits, atol=1e-5)
    assert not hasattr(model, "peft_config") and all(p.requires_grad for p in model.parameters())


def test_training_from_a_lora_adapter_runs(lora_adapter, tmp_path):
    adapter, _ = lora_adapter
    proc = grpokit("train", f"--model.name_or_path={adapter}", f"--output_dir={tmp_path / 'rl'}", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"grpokit: {adapter} is a LoRA adapter; loading its base model {adapter.parent / 'base'} with the " \
           "adapter merged in" in proc.stderr
    assert len(metrics(tmp_path / "rl")) == 2


def test_a_lora_adapter_whose_base_is_gone_says_how_to_load_it(lora_adapter, tmp_path):
    adapter, _ = lora_adapter
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "gone/base"}))
    line = one_line_error(grpokit("train", f"--model.name_or_path={adapter}", f"--output_dir={tmp_path / 'rl'}",
                                  *TINY), 1)
    assert line == (f"grpokit: error: {adapter} is a LoRA adapter on the base model 'gone/base' (adapter_config.json's "
                    "base_model_name_or_path), which does not load from here (a relative path counts from the "
                    "working directory): train with model.lora.save_merged=true to get a merged/ model, or set "
                    "adapter_config.json's base_model_name_or_path to the model the adapter was trained on")


# --- 4. reward names, checked before any model loads; custom ones from the working directory --------

def test_an_unknown_reward_lists_the_built_in_names_before_loading():
    proc = grpokit("train", "--rewards=[{name: math_acuracy}]")
    line = one_line_error(proc, 2)
    assert line == ("grpokit: config error: rewards[0]: unknown reward function 'math_acuracy' (did you mean "
                    "'math_accuracy'?); the built-in ones are chain_accuracy, chain_steps, format, gsm8k_steps, "
                    "math_accuracy, overlong_penalty, or name your own as 'package.module:function'")
    assert "parameters" not in proc.stdout  # no model was built


def test_a_custom_reward_that_does_not_import_is_refused_before_loading(tmp_path):
    (tmp_path / "broken_reward.py").write_text("import no_such_package\n")
    line = one_line_error(grpokit("train", "--rewards=[{name: 'broken_reward:score'}]", cwd=tmp_path), 2)
    assert line == ("grpokit: config error: rewards[0]: reward function 'broken_reward:score': cannot import module "
                    f"'broken_reward' (No module named 'no_such_package'); looked in the working directory "
                    f"{tmp_path} and on PYTHONPATH")


# --- 5. overlong_penalty by the name the docs give -----------------------------------------------

def test_overlong_penalty_scores_as_documented():
    penalty = reward_function("overlong_penalty", {"max_length": 10, "soft_cache": 4})
    # free up to 10 - 4 = 6 characters, then (6 - n) / 4 down to -1 at 10, and -1 beyond
    assert penalty(prompts=["p"] * 6, completions=["x" * n for n in (0, 6, 7, 8, 10, 13)]) == \
        [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    by_path = reward_function("grpokit.rewards.math_rewards:overlong_penalty", {"max_length": 10, "soft_cache": 4})
    assert by_path(prompts=["p"], completions=["x" * 9]) == [-0.75]


def test_overlong_penalty_counts_the_policys_tokens(tokenizer):
    penalty = reward_function("overlong_penalty", {"max_length": 4, "soft_cache": 2}, tokenizer=tokenizer)
    assert penalty(prompts=["p"] * 3, completions=["1+2", "1+2=", "1+2=3"]) == [-0.5, -1.0, -1.0]


def test_the_docs_example_of_overlong_penalty_trains(tmp_path):
    guide = (DOCS / "guides" / "gsm8k-math.md").read_text()
    example = re.search(r"\{name: overlong_penalty, args: \{[^}]*\}, weight: [0-9.]+\}", guide).group()
    proc = grpokit("train", f"--rewards=[{{name: chain_accuracy}}, {example}]", f"--output_dir={tmp_path}", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in metrics(tmp_path):
        assert -1.0 <= row["rewards/overlong_penalty"] <= 0.0 and row["rewards/failed"] == 0


def test_overlong_penalty_without_its_args_says_what_to_write():
    line = one_line_error(grpokit("train", "--rewards=[{name: overlong_penalty}]"), 2)
    assert line.startswith("grpokit: config error: rewards[0]: reward 'overlong_penalty' is made from its args")
    assert line.endswith("write {name: overlong_penalty, args: {max_length: 1024, soft_cache: 256}}")


# --- 6. a bad value from the command line is blamed on the command line ----------------------------

def test_a_bad_override_is_blamed_on_the_override_not_the_file(tmp_path):
    (tmp_path / "run.yaml").write_text("grpo:\n  max_steps: 10\n")
    line = one_line_error(grpokit("train", str(tmp_path / "run.yaml"), "--grpo.max_steps", "ten"), 2)
    assert line == ("grpokit: config error: grpo.max_steps: expected an integer, got str 'ten' (from the "
                    "command-line override --grpo.max_steps=ten)")
    (tmp_path / "bad.yaml").write_text("grpo:\n  max_steps: ten\n")
    line = one_line_error(grpokit("train", str(tmp_path / "bad.yaml"), "--grpo.beta=0.1"), 2)
    assert line == f"grpokit: config error: {tmp_path / 'bad.yaml'}: grpo.max_steps: expected an integer, got str 'ten'"


# --- 7. one tracker name is a list of one ---------------------------------------------------------

def test_one_tracker_name_is_a_list_of_one(tmp_path):
    pytest.importorskip("tensorboard")
    proc = grpokit("train", "--report_to=tensorboard", f"--output_dir={tmp_path / 'run'}", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any((tmp_path / "run" / "tensorboard").iterdir())


# --- 8. to 10. help -------------------------------------------------------------------------------

def test_bench_help_exits_zero_with_its_usage():
    proc = grpokit("bench", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: grpokit bench cost")


def test_demo_help_shows_the_presets_values():
    demo, train = grpokit("demo", "--help").stdout, grpokit("train", "--help").stdout
    assert "with the demo preset's values" in demo
    assert "--stages=['sft', 'train']" in demo and "--model.tiny.num_layers=2 " in demo
    assert "--stages=['train']" in train and "--model.tiny.num_layers=4 " in train


def test_eval_options_take_the_configs_defaults():
    from grpokit.config import Config
    from grpokit.eval.benchmark import EvalSettings
    from grpokit.eval.command import _parser

    args, e, r, m = _parser().parse_args([]), EvalConfig(), RolloutConfig(), ModelConfig()
    shared = {"temperature": e.temperature, "max_tool_calls": e.max_tool_calls, "tool_timeout": e.tool_timeout_s,
              "engine": r.engine, "kv_cache_gb": r.kv_cache_gb, "max_model_len": r.max_model_len,
              "seed": Config().seed, "device": m.device, "dtype": m.dtype}
    assert {key: getattr(args, key) for key in shared} == shared
    settings = EvalSettings()
    assert (settings.max_tool_calls, settings.tool_timeout, settings.temperature) == \
        (e.max_tool_calls, e.tool_timeout_s, e.temperature)


def test_eval_help_shows_the_defaults():
    proc = grpokit("eval", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert f"(default: {EvalConfig().max_tool_calls}, as eval.max_tool_calls)" in text
    assert "(default: 1024)" in text and "(default: cot,tir)" in text and "(default: auto)" in text


def test_rewards_help_lists_the_registered_names():
    text = grpokit("train", "--help").stdout
    assert f"(built-in names: {', '.join(reward_names())}; or 'package.module:function')" in text
    assert "overlong_penalty" in reward_names()


# --- 11. a warning when nothing can learn ---------------------------------------------------------

def row(step: int, zero_std_frac: float, grad_norm: float = 0.0) -> dict:
    return {"step": step, "reward/zero_std_frac": zero_std_frac, "grad_norm": grad_norm}


def test_no_signal_warning_needs_every_one_of_the_last_steps():
    flat = [row(i, 1.0) for i in range(1, NO_SIGNAL_STEPS + 1)]
    assert no_signal_warning(flat[:-1]) is None  # too few steps yet
    assert no_signal_warning([*flat[:-1], row(NO_SIGNAL_STEPS, 0.5)]) is None  # the last step had a spread
    message = no_signal_warning(flat)
    assert message.startswith(f"grpokit: warning: reward/zero_std_frac = 1.0 and grad_norm = 0 in {NO_SIGNAL_STEPS} "
                              f"steps in a row (through step {NO_SIGNAL_STEPS}): ")
    for cause in ("a reward that never varies", "always right or always wrong", "a broken verifier"):
        assert cause in message
    drifting = [row(i, 1.0, grad_norm=0.1) for i in range(1, 8)]  # the KL term still moves the weights
    assert "grad_norm" not in no_signal_warning(drifting) and "through step 7" in no_signal_warning(drifting)
    assert no_signal_warning([row(1, 0.0)] + flat, steps=NO_SIGNAL_STEPS) is not None


def test_a_reward_that_never_varies_warns_once(tmp_path):
    # a custom reward in the working directory, found without PYTHONPATH=.
    (tmp_path / "my_rewards.py").write_text("def always_one(prompts, completions, **_):\n"
                                            "    return [1.0] * len(completions)\n")
    proc = grpokit("train", "--rewards=[{name: 'my_rewards:always_one'}]", "--output_dir=run", *TINY,
                   f"--grpo.max_steps={NO_SIGNAL_STEPS + 2}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("grpokit: warning: reward/zero_std_frac = 1.0") == 1
    assert f"in {NO_SIGNAL_STEPS} steps in a row (through step {NO_SIGNAL_STEPS})" in proc.stderr
    assert all(r["reward/zero_std_frac"] == 1.0 and r["rewards/my_rewards:always_one"] == 1.0
               for r in metrics(tmp_path / "run"))


# --- 12. every key of metrics.jsonl is explained in the metrics reference ----------------------

def readme_metric_keys() -> set[str]:
    """The first column of the metrics reference's table (docs/reference/metrics.md)."""
    text = (DOCS / "reference" / "metrics.md").read_text()
    table = text[text.index("| key |"):].split("\n\n", 1)[0]
    return {m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", table, re.MULTILINE)}


def documented(key: str, keys: set[str]) -> bool:
    return key in keys or (key.startswith("rewards/") and "rewards/<name>" in keys)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_every_metrics_key_is_in_the_readme_table(tmp_path, algo):
    proc = grpokit("train", f"--algo={algo}", f"--output_dir={tmp_path}", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    keys = readme_metric_keys()
    written = {key for r in metrics(tmp_path) for key in r}
    assert {"step", "policy_loss", "loss", "perf/step_time_s", "rewards/<name>"} <= keys
    assert [key for key in sorted(written) if not documented(key, keys)] == []
