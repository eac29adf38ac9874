"""The command line, run for real in subprocesses on tiny budgets."""

import functools
import json

import pytest
from transformers import AutoModelForCausalLM

from grpokit.checks import load_config
from run_helpers import cli

TINY = ["--model.tiny.hidden_size=32", "--model.tiny.num_layers=2", "--model.tiny.num_heads=2",
        "--model.tiny.intermediate_size=64", "--num_sft_examples=64", "--num_rl_questions=64",
        "--num_eval_questions=8", "--num_sft_tir_examples=16", "--eval.k=2", "--sft.max_steps=5", "--sft.warmup_steps=1",
        "--grpo.max_steps=2", "--prompts_per_step=2", "--num_generations=4", "--max_completion_length=16"]


grpokit = functools.partial(cli, timeout=300)


def test_demo_writes_the_run_directory(tmp_path):
    out = tmp_path / "run"
    proc = grpokit("demo", "--output-dir", str(out), "--seed", "3", "--quiet", *TINY)
    assert "greedy accuracy" in proc.stdout and "pass@2" in proc.stdout and "maj@2" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seed"] == 3
    # validation: as many questions as the held-out test here (8), greedy, before and after RL
    assert summary["validation"]["questions"] == 8 and 0 <= summary["validation"]["after"] <= 1
    assert summary["validation"]["change_points"] == 100 * (summary["validation"]["after"]
                                                            - summary["validation"]["before"])
    assert "validation (8 questions, what settings are chosen on): greedy " in proc.stdout
    # Table 5 in miniature: CoT and TIR, before and after, in the output and results.md.
    assert "greedy accuracy      CoT     TIR" in proc.stdout and "TIR" in (out / "results.md").read_text()
    assert "TIR evaluation of 8 questions: " in proc.stdout and "x CoT greedy's " in proc.stdout
    assert summary["sft"]["tir"]["num_questions"] == summary["grpo"]["tir"]["num_questions"] == 8
    assert isinstance(summary["tir_improvement_points"], float) and 0 <= summary["grpo_tir_accuracy"] <= 1
    assert "stage times: sft " in proc.stdout and all(
        key in summary for key in ("sft_seconds", "eval_before_seconds", "rl_seconds", "eval_after_seconds"))
    for key in ("sft_accuracy", "grpo_accuracy", "wall_seconds"):
        assert isinstance(summary[key], float)
    assert 0.0 <= summary["sft_accuracy"] <= 1.0 and 0.0 <= summary["grpo_accuracy"] <= 1.0
    assert 50 * 2**20 < summary["peak_rss_bytes"] < 64 * 2**30  # torch alone holds more than 50 MiB
    assert "GiB (RSS)" in proc.stdout
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    config = load_config(out / "config.yaml")
    assert config.seed == 3 and config.grpo.max_steps == 2
    for name in ("sft", "step-2"):
        AutoModelForCausalLM.from_pretrained(out / "checkpoints" / name)


def test_sft_then_train_from_the_checkpoint(tmp_path):
    grpokit("sft", "--output_dir", str(tmp_path / "sft"), "--quiet", *TINY)
    ckpt = tmp_path / "sft" / "checkpoints" / "sft"
    proc = grpokit("train", f"--model.name_or_path={ckpt}", f"--output_dir={tmp_path / 'rl'}", "--quiet", *TINY)
    assert "held-out greedy accuracy" in proc.stdout and "warning" not in proc.stderr
    assert (tmp_path / "rl" / "checkpoints" / "step-2" / "model.safetensors").is_file()
    # sft.checkpoint is the demo's key: `grpokit train` says it would start from a fresh model instead
    proc = grpokit("train", f"--sft.checkpoint={ckpt}", f"--output_dir={tmp_path / 'fresh'}", "--quiet", *TINY)
    assert f"pass --model.name_or_path={ckpt} to train that policy" in proc.stderr


def test_help_shows_every_key():
    text = grpokit("demo", "--help").stdout
    for key in ("--grpo.num_generations", "--grpo.beta", "--grpo.epsilon_high", "--sft.learning_rate",
                "--model.name_or_path", "--eval.k"):
        assert key in text


@pytest.mark.slow
def test_full_demo_meets_its_target(seed0_demo):
    """The embedded default: GRPO beats the SFT model by >= 15 points, within 450 s (it takes about
    250 s on a quiet 2-core machine; the limit leaves room for a slower one)."""
    summary = json.loads((seed0_demo / "summary.json").read_text())
    gain = summary["grpo_accuracy"] - summary["sft_accuracy"]
    assert gain >= 0.15, summary
    assert summary["wall_seconds"] <= 450, summary


def test_config_keys_take_their_value_after_a_space():
    from grpokit.cli import join_override_values

    argv = ["sft", "--output_dir", "runs/x", "--quiet", "--grpo.beta", "0.1", "cfg.yaml", "--seed", "2"]
    assert join_override_values(argv) == ["sft", "--output_dir=runs/x", "--quiet", "--grpo.beta=0.1", "cfg.yaml",
                                          "--seed", "2"]


@pytest.mark.slow
@pytest.mark.long  # a demo RL stage with a critic; test_ppo.py checks PPO's math and steps in CI
def test_ppo_demo_improves_over_the_sft_model(tmp_path, seed0_demo):
    """The PPO baseline is a real baseline: on the demo task it, too, beats pi_SFT clearly."""
    grpokit("demo", "--algo=ppo", f"--sft.checkpoint={seed0_demo / 'checkpoints' / 'sft'}",
            "--output-dir", str(tmp_path), "--seed", "0", "--quiet", timeout=900)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["algo"] == "ppo"
    assert summary["grpo_accuracy"] - summary["sft_accuracy"] >= 0.10, summary


@pytest.mark.slow
def test_lora_demo_improves_over_the_sft_model(tmp_path, seed0_demo):
    """GRPO through PEFT adapters (rank 16 on every linear layer, the reference being the base model
    with the adapters off) lifts the demo's held-out greedy accuracy by >= 10 points."""
    grpokit("demo", f"--sft.checkpoint={seed0_demo / 'checkpoints' / 'sft'}", "--model.lora.r=16",
            "--model.lora.alpha=32", "--model.lora.target_modules=[all-linear]", "--grpo.learning_rate=1e-3",
            "--output-dir", str(tmp_path), "--seed", "0", "--quiet", timeout=900)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (tmp_path / "checkpoints" / "step-150" / "adapter_model.safetensors").is_file()
    assert summary["grpo_accuracy"] - summary["sft_accuracy"] >= 0.10, summary


def test_tir_table_golden():
    from grpokit.eval.evaluate import EvalResult, TIRResult
    from grpokit.pipeline.report import tir_table

    def result(cot, tir):
        return EvalResult(cot, 0.0, 0.0, 8, 500, tir=TIRResult(tir, 500, 500, 1.0, 0.5, 0.5, True))

    assert tir_table(result(0.454, 0.8), result(0.676, 0.786)) == (
        "greedy accuracy      CoT     TIR\n"
        "pi_SFT             45.4%   80.0%\n"
        "GRPO               67.6%   78.6%\n"
        "change           +22.2pt  -1.4pt")
    assert tir_table(None, result(0.5, 0.25), "ppo") == "greedy accuracy      CoT     TIR\nPPO                50.0%   25.0%"


def test_stage_times_names_each_stage_and_what_is_left():
    from grpokit.pipeline.report import stage_times

    summary = {"sft_seconds": 100.4, "eval_before_seconds": 8.0, "reward_model_seconds": 30.2, "rl_seconds": 90.0,
               "eval_after_seconds": 9.0, "wall_seconds": 240.0}
    assert stage_times(summary, "ppo") == ("stage times: sft 100s, eval before 8s, reward model 30s, ppo 90s, "
                                           "eval after 9s, other 2s; total 240s")
    assert stage_times({"rl_seconds": 5.0, "wall_seconds": 6.0}, "grpo") == "stage times: grpo 5s, other 1s; total 6s"
