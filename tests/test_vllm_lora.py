"""A LoRA policy with the vLLM engine: the engine starts from the base model and receives the
merged weights after every update and after a resume; a push that did not land stops the run."""

import copy
import importlib.util

import pytest
import torch

from grpokit.config import GRPOConfig, LoraConfig, RolloutConfig
from grpokit.models import build_tiny_model
from grpokit.rollout import SamplingParams, WeightSyncError, make_engine, sample_groups

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or importlib.util.find_spec("peft") is None,
        reason="vllm and peft are needed (CPU: `make .venv-vllm` then `make test-vllm`; GPU: pip install vllm peft)",
    ),
]

PROMPTS = ["Q: 1+2\n", "Q: 10+20-3\n", "Q: 7-1\n"]
ENGINE = RolloutConfig(engine="vllm", kv_cache_gb=0.0625, max_model_len=128)


def _lora_policy(tokenizer):
    """vLLM's CPU attention needs a head size of at least 32: hidden 64 / 2 heads."""
    from grpokit.models.lora import apply_lora

    base = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, seed=0)
    return apply_lora(base, LoraConfig(r=8, alpha=16, target_modules=["all-linear"]))


def _trainer(policy, tokenizer, rows, run_dir, engine, **grpo):
    from grpokit.data import arithmetic
    from grpokit.rewards import WeightedReward
    from grpokit.train.grpo import GRPOTrainer

    rewards = [WeightedReward("chain_accuracy", arithmetic.chain_accuracy),
               WeightedReward("length", lambda prompts, completions, **_: [len(c) / 10 for c in completions], 0.1)]
    config = GRPOConfig(**{"num_generations": 4, "prompts_per_step": 4, "max_completion_length": 12,
                           "learning_rate": 1e-2, "warmup_steps": 0, "micro_batch_size": 64, **grpo})
    return GRPOTrainer(policy, tokenizer, rewards, rows, config, run_dir, seed=0, progress=False, engine=engine)


def _greedy(engine_or_model, tokenizer, prompts):
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    if hasattr(engine_or_model, "generate") and hasattr(engine_or_model, "sync_weights"):
        return engine_or_model.generate(prompts, 1, params).completions
    engine_or_model.eval()
    return sample_groups(engine_or_model, tokenizer, prompts, 1, params).completions


def test_after_five_lora_updates_the_engines_greedy_completions_equal_generates(tokenizer, chain_rows, tmp_path):
    policy = _lora_policy(tokenizer)
    engine = make_engine(ENGINE, policy, tokenizer)  # from the PEFT model: its base weights
    try:
        base = _greedy(engine, tokenizer, PROMPTS)
        rows = _trainer(policy, tokenizer, chain_rows, tmp_path, engine, max_steps=5).train()
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and all(r["rollout/sync_time_s"] > 0 for r in rows)
        prompts = PROMPTS + [r["prompt"] for r in chain_rows[:13]]
        expected = _greedy(policy, tokenizer, prompts)
        assert _greedy(engine, tokenizer, prompts) == expected
        assert expected[:3] != base  # the adapter changed what the policy writes
        assert engine.check_synced(policy) <= 2e-3
    finally:
        engine.close()


def test_a_resumed_lora_runs_first_rollouts_come_from_the_adapter(tokenizer, chain_rows, tmp_path):
    from grpokit.models.lora import load_lora

    policy = _lora_policy(tokenizer)
    first = make_engine(ENGINE, policy, tokenizer)
    try:
        _trainer(policy, tokenizer, chain_rows, tmp_path, first, max_steps=4, save_steps=4).train()
    finally:
        first.close()
    checkpoint = tmp_path / "checkpoints" / "step-4"
    base = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, seed=0)
    base_completions = _greedy(copy.deepcopy(base), tokenizer, PROMPTS)
    base.save_pretrained(tmp_path / "base")  # model.name_or_path: where run_train's engine reads the base
    resumed = load_lora(base, checkpoint)  # as run_train resumes: the base plus the saved adapter
    engine = make_engine(ENGINE, resumed, tokenizer, weights_dir=str(tmp_path / "base"))
    try:
        assert _greedy(engine, tokenizer, PROMPTS) == base_completions  # built from the base's files
        trainer = _trainer(resumed, tokenizer, chain_rows, tmp_path, engine, max_steps=5)
        trainer.resume_from(checkpoint)
        adapter_completions = _greedy(resumed, tokenizer, PROMPTS)
        assert adapter_completions != base_completions
        assert _greedy(engine, tokenizer, PROMPTS) == adapter_completions
    finally:
        engine.close()


def test_the_sync_probe_stops_the_run_when_a_push_did_not_land(tokenizer, chain_rows, tmp_path, monkeypatch):
    from grpokit.rollout.vllm import VLLMEngine

    policy = _lora_policy(tokenizer)
    engine = make_engine(ENGINE, policy, tokenizer)
    try:
        monkeypatch.setattr(VLLMEngine, "sync_weights", lambda self, model, state_dict=None: None)
        trainer = _trainer(policy, tokenizer, chain_rows, tmp_path, engine, max_steps=3)
        with pytest.raises(WeightSyncError, match=r"^step 1: the rollout engine did not receive the policy's weights "
                                                  r"\(the engine's log-probs differ .*\)\. Last good checkpoint: none"):
            trainer.train()
    finally:
        engine.close()


@pytest.mark.parametrize("policy", ["tiny", "directory"])
def test_lora_with_the_vllm_engine_trains_and_resumes_from_the_command_line(tmp_path, tokenizer, policy):
    """The whole path run_train takes: LoRA applied, the engine built from the PEFT policy (a tiny
    model saved for it, or model.name_or_path's files read in place)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if policy == "directory":
        base = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=64)
        base.save_pretrained(tmp_path / "base")
        tokenizer.save_pretrained(tmp_path / "base")
        model = [f"--model.name_or_path={tmp_path / 'base'}"]
    else:
        model = ["--model.tiny.hidden_size=64", "--model.tiny.num_layers=2", "--model.tiny.num_heads=2",
                 "--model.tiny.intermediate_size=64"]
    run = [sys.executable, "-m", "grpokit", "train", f"--output_dir={tmp_path / 'run'}", "--rollout.engine=vllm",
           "--model.lora.r=4", "--model.lora.alpha=8", *model, "--prompts_per_step=2",
           "--num_generations=4", "--max_completion_length=8", "--num_rl_questions=50", "--num_eval_questions=4",
           "--eval.k=2", "--eval.before=false", "--quiet"]
    first = subprocess.run([*run, "--grpo.max_steps=2"], capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    if policy == "directory":  # vLLM read the base model's own files, not a copy (its log names the model)
        assert f"'model': '{tmp_path / 'base'}'" in first.stdout + first.stderr
    resumed = subprocess.run([*run, "--grpo.max_steps=3", "--resume"], capture_output=True, text=True, timeout=600,
                             env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert (tmp_path / "run" / "checkpoints" / "step-3" / "adapter_model.safetensors").is_file()
