"""LoRA through PEFT on a real tiny Llama: the reference is the base model under the adapters
(no second copy), checkpoints hold the adapter and, on request, the merged model, and a
target that names no linear module is an error listing them."""

import copy
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpokit.config import ConfigError, GRPOConfig, LoraConfig
from grpokit.models.lora import AdapterDisabledReference, apply_lora, load_lora, lora_merged_weights, merged_state_dict
from grpokit.rewards import WeightedReward
from grpokit.train.grpo import GRPOTrainer


def length_reward(prompts, completions, **_):
    return [len(c) / 10 for c in completions]


def lora_trainer(model, tokenizer, rows, run_dir, **kw):
    config = GRPOConfig(num_generations=4, prompts_per_step=2, max_completion_length=8, max_steps=2,
                        learning_rate=1e-2, warmup_steps=0)
    return GRPOTrainer(model, tokenizer, [WeightedReward("length", length_reward)], rows, config, run_dir,
                       progress=False, **kw)


def logits(model, tokenizer):
    ids = tokenizer(["Q: 3+4-2\n", "Q: 9-1\n"], return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**ids).logits


def test_target_modules_that_match_nothing_list_the_linear_modules(tiny_model):
    with pytest.raises(ConfigError) as err:
        apply_lora(tiny_model, LoraConfig(r=4, target_modules=["q_proj", "query_key_value"]))
    message = str(err.value)
    assert "['query_key_value']" in message
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in message


def test_the_reference_is_the_base_model_under_the_adapters(tiny_model, tokenizer, chain_rows, tmp_path):
    base = copy.deepcopy(tiny_model)
    policy = apply_lora(tiny_model, LoraConfig(r=4, alpha=8))
    trainer = lora_trainer(policy, tokenizer, chain_rows, tmp_path)
    assert isinstance(trainer.ref_model, AdapterDisabledReference) and trainer.ref_model.policy is policy
    assert not isinstance(trainer.ref_model, torch.nn.Module)  # it owns no weights: no second copy
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in base.parameters()) // 5

    trainer.train()
    torch.testing.assert_close(_disabled_logits(policy, tokenizer), logits(base, tokenizer))
    assert not torch.allclose(logits(policy, tokenizer), logits(base, tokenizer))  # the adapters learned

    rollout = trainer.engine.generate([r["prompt"] for r in chain_rows[:2]], 4, trainer.sampling, chain_rows[:2])
    ref_logp = trainer.logprobs(trainer.ref_model, rollout)
    base_logp = trainer.logprobs(base, rollout)
    torch.testing.assert_close(ref_logp, base_logp)
    assert not torch.allclose(trainer.logprobs(policy, rollout), base_logp)  # adapters on again after


def _disabled_logits(policy, tokenizer):
    with policy.disable_adapter():
        return logits(policy, tokenizer)


def test_checkpoints_hold_the_adapter_and_on_request_the_merged_model(tiny_model, tokenizer, chain_rows, tmp_path):
    base = copy.deepcopy(tiny_model)
    policy = apply_lora(tiny_model, LoraConfig(r=4, alpha=8, target_modules=["all-linear"]))
    trainer = lora_trainer(policy, tokenizer, chain_rows, tmp_path, save_merged=True)
    trainer.train()
    step = tmp_path / "checkpoints" / "step-2"
    assert (step / "adapter_model.safetensors").is_file() and (step / "adapter_config.json").is_file()
    assert not (step / "model.safetensors").exists()  # the adapter only: the base is model.name_or_path

    merged = AutoModelForCausalLM.from_pretrained(step / "merged")
    torch.testing.assert_close(logits(merged, tokenizer), logits(policy, tokenizer), atol=1e-5, rtol=1e-4)
    reloaded = load_lora(copy.deepcopy(base), step)
    torch.testing.assert_close(logits(reloaded, tokenizer), logits(policy, tokenizer))

    # A separate engine (vLLM) receives the merged weights under the base model's names, computed
    # without touching the policy's own weights.
    from grpokit.rollout.vllm import policy_weights  # what the engine pushes; vllm itself is not needed for it

    before = logits(policy, tokenizer)
    weights = {name: value() if callable(value) else value for name, value in policy_weights(policy).items()}
    assert weights.keys() == merged.state_dict().keys()
    for name, value in weights.items():
        torch.testing.assert_close(value.float(), merged.state_dict()[name].float())
    assert torch.equal(logits(policy, tokenizer), before)


def test_merging_is_w_plus_scaled_b_a(tiny_model):
    base_names = set(tiny_model.state_dict())
    policy = apply_lora(tiny_model, LoraConfig(r=1, alpha=4, target_modules=["q_proj"]))
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    stem = "base_model.model.model.layers.0.self_attn.q_proj"
    a = torch.zeros_like(state[f"{stem}.lora_A.default.weight"])
    b = torch.zeros_like(state[f"{stem}.lora_B.default.weight"])
    a[0, 0], b[1, 0] = 2.0, 3.0  # B A has one entry: 6 at [1, 0]; times alpha / r = 4 -> 24
    state[f"{stem}.lora_A.default.weight"], state[f"{stem}.lora_B.default.weight"] = a, b
    merged = merged_state_dict(policy, state)
    assert set(merged) == base_names  # the plain model's names
    change = merged["model.layers.0.self_attn.q_proj.weight"] - state[f"{stem}.base_layer.weight"]
    expected = torch.zeros_like(change)
    expected[1, 0] = 24.0
    torch.testing.assert_close(change, expected)
    untouched = "model.layers.1.self_attn.q_proj.weight"  # B = 0 there: W itself
    base_weight = f"base_model.model.{untouched.removesuffix('weight')}base_layer.weight"
    torch.testing.assert_close(merged[untouched], state[base_weight])


def test_lora_with_gradient_checkpointing_trains_and_resumes_from_the_command_line(tmp_path):
    run = [sys.executable, "-m", "grpokit", "train", f"--output_dir={tmp_path}", "--model.lora.r=4",
           "--model.lora.alpha=8", "--model.gradient_checkpointing=true", "--model.tiny.hidden_size=32",
           "--model.tiny.num_layers=2", "--model.tiny.num_heads=2", "--model.tiny.intermediate_size=64",
           "--prompts_per_step=2", "--num_generations=4", "--max_completion_length=8", "--num_rl_questions=50",
           "--num_eval_questions=4", "--eval.k=2", "--eval.before=false", "--quiet"]
    first = subprocess.run([*run, "--grpo.max_steps=2"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "step-2" / "adapter_model.safetensors").is_file()
    resumed = subprocess.run([*run, "--grpo.max_steps=3", "--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert (tmp_path / "checkpoints" / "step-3" / "adapter_model.safetensors").is_file()
