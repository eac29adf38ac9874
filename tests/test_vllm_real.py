"""The vLLM engine on the real SmolLM2-135M-Instruct checkpoint (`make models`), in fp32 on CPU:
greedy completions equal transformers' on held-out GSM8K questions through the math task's prompt
(chat template), the engine-vs-trainer log-prob mismatch, and seeded sampling at the size RL uses.

    HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -q -m vllm tests/test_vllm_real.py
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from grpokit.models.logprobs import token_logprobs
from grpokit.rollout import SamplingParams, request_seeds, sample_groups

REAL_MODEL = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"
QUESTIONS = Path(__file__).parent / "fixtures" / "gsm8k_test_sample.jsonl"  # GSM8K test rows: never trained on
# Each test is minutes of CPU; on 2 cores shared with other jobs (load ~11) one took over the default 900 s.
REAL_TIMEOUT_S = 3600

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.real,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (CPU: `make .venv-vllm` then `make test-vllm`)"),
    pytest.mark.skipif(not (REAL_MODEL / "model.safetensors").is_file(),
                       reason=f"{REAL_MODEL.name} is absent: run `make models`"),
]


@pytest.fixture(scope="module")
def real():
    """(policy, tokenizer, engine): the checkpoint in fp32, and a vLLM engine loading the same folder."""
    from grpokit.models.loading import load_model_and_tokenizer
    from grpokit.rollout.vllm import VLLMEngine

    model, tokenizer = load_model_and_tokenizer(str(REAL_MODEL), "fp32", "cpu")
    model.eval()
    engine = VLLMEngine(model, tokenizer, max_model_len=512, kv_cache_gb=0.5, weights_dir=str(REAL_MODEL))
    yield model, tokenizer, engine
    engine.close()


def _math_prompts(tokenizer, n: int) -> list[str]:
    """The first n questions in the math task's prompt (reason step by step, \\boxed{}), in the chat template."""
    from grpokit.eval.benchmark import render_prompt

    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines()][:n]
    assert len(rows) == n
    prompts = [render_prompt(row["question"], "cot", tokenizer) for row in rows]
    assert all(p.startswith("<|im_start|>") and p.endswith("<|im_start|>assistant\n") for p in prompts)
    return prompts


def _mismatch(model, rollout, temperature: float) -> tuple[float, float]:
    """Mean and max |trainer log-prob - engine log-prob| over the completion tokens: rollout/logp_mismatch
    as the trainer logs it (there pi_old against the engine's sampling_logp)."""
    with torch.no_grad():
        trainer, _ = token_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_length,
                                    temperature)
    mask = rollout.completion_mask.bool()
    difference = (trainer[mask].float() - rollout.sampling_logp[mask]).abs()
    return float(difference.mean()), float(difference.max())


@pytest.mark.timeout(REAL_TIMEOUT_S)
def test_greedy_completions_equal_transformers_on_held_out_questions(real, capsys):
    """20 GSM8K test questions, 96 new tokens: the engine's greedy completions are transformers'
    generate's token for token, and its log-probs of those tokens are the trainer's within fp32 rounding."""
    model, tokenizer, engine = real
    prompts = _math_prompts(tokenizer, 20)
    params = SamplingParams(max_new_tokens=96, temperature=0.0, batch_size=len(prompts))
    got = engine.generate(prompts, 1, params)
    with torch.no_grad():
        expected = sample_groups(model, tokenizer, prompts, 1, params)
    assert got.completions == expected.completions
    assert torch.equal(got.completion_mask, expected.completion_mask)
    mean, largest = _mismatch(model, got, 1.0)  # greedy rows hold temperature-1 log-probs
    with capsys.disabled():
        print(f"\nSmolLM2 fp32, 20 greedy completions, {int(got.completion_mask.sum())} tokens: engine-vs-trainer "
              f"|log-prob difference| mean {mean:.2e}, max {largest:.2e}")
    assert mean < 1e-4 and largest < 2e-3  # 2e-3: the engine's own fp32 sync tolerance (SYNC_TOLERANCE)


@pytest.mark.timeout(REAL_TIMEOUT_S)
def test_seeded_sampling_at_the_size_rl_uses(real, capsys):
    """40 prompts x 8 samples with per-request seeds, as the trainer samples (the size at which
    `grpokit eval --engine vllm --k 8` crashed with "CPU Generator does not use offset"): it runs, a
    group sampled alone gives the same completions, and the sampled tokens' log-probs are the trainer's."""
    model, tokenizer, engine = real
    prompts = _math_prompts(tokenizer, 20)
    prompts = prompts + [p.replace("<|im_start|>assistant\n", "<|im_start|>assistant\nLet's think.\n") for p in prompts]
    group, params = 8, SamplingParams(max_new_tokens=8, temperature=1.0)  # the crash came at the first step
    seeds = request_seeds(0, 0, list(range(len(prompts))), group)
    batch = engine.generate(prompts, group, params, seeds=seeds)
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert int(batch.attention_mask[:, : batch.prompt_length].sum()) > budget  # more than one step's prefill
    for p in (0, len(prompts) - 1):
        alone = engine.generate([prompts[p]], group, params, seeds=seeds[p * group : (p + 1) * group])
        assert alone.completions == batch.completions[p * group : (p + 1) * group]
    assert len(set(batch.completions)) > len(prompts)
    mean, largest = _mismatch(model, batch, 1.0)
    with capsys.disabled():
        print(f"\nSmolLM2 fp32, {len(prompts)} x {group} seeded samples at temperature 1, "
              f"{int(batch.completion_mask.sum())} tokens: engine-vs-trainer |log-prob difference| mean {mean:.2e}, "
              f"max {largest:.2e}")
    assert mean < 1e-4 and largest < 2e-3
