"""The vLLM engine at the sizes RL uses, on CPU: seeded sampling whose prompt tokens pass vLLM's
per-step token budget, and a failure inside vLLM in the middle of a run.

Before the engine turned chunked prefill off on CPU, a batch whose prompt tokens passed
max_num_batched_tokens (4096 on CPU) split one request's prefill across two steps, and vLLM's CPU
build raised "CPU Generator does not use offset" rewinding that request's generator
(docs/guides/rollout-engines.md). Its own module: engines built and closed here take vLLM's
process-wide state with them.
"""

import copy
import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from grpokit.rollout import SamplingParams, request_seeds
from test_vllm_engine import _policy

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (CPU: `make .venv-vllm` then `make test-vllm`)"),
]

PROMPT_CHARS = 100  # the char tokenizer: one token a character, 104 with "Q: " and the newline
PROMPTS_PER_STEP, GROUP = 8, 8  # 64 requests, 6,656 prompt tokens: more than one step's 4,096


def _long_prompts(n: int) -> list[str]:
    rng = random.Random(0)
    return ["Q: " + "".join(rng.choice("0123456789+-= ") for _ in range(PROMPT_CHARS)) + "\n" for _ in range(n)]


def _kept(rollout, row) -> list[int]:
    return rollout.completion_ids[row][rollout.completion_mask[row].bool()].tolist()


def test_seeded_sampling_past_one_steps_token_budget_equals_each_group_alone(tokenizer):
    """8 prompts x 8 samples of 104-token prompts, every completion with its own seed (as the trainer
    samples): vLLM cannot prefill them all in one step. Each completion equals the one its seed gives
    with its group sampled alone (832 prompt tokens, one step), and a second call repeats the first."""
    from grpokit.rollout.vllm import VLLMEngine

    prompts = _long_prompts(PROMPTS_PER_STEP)
    engine = VLLMEngine(copy.deepcopy(_policy(tokenizer)), tokenizer, max_model_len=128, kv_cache_gb=0.0625, seed=0)
    try:
        budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        prompt_tokens = sum(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts) * GROUP
        assert prompt_tokens > budget == 4096  # the size that failed: more than one step's prefill
        params = SamplingParams(max_new_tokens=8, temperature=1.0)
        seeds = request_seeds(0, 0, list(range(PROMPTS_PER_STEP)), GROUP)
        batch = engine.generate(prompts, GROUP, params, seeds=seeds)
        assert engine.generate(prompts, GROUP, params, seeds=seeds).completions == batch.completions
        for p, prompt in enumerate(prompts):
            alone = engine.generate([prompt], GROUP, params, seeds=seeds[p * GROUP : (p + 1) * GROUP])
            for k in range(GROUP):
                row = p * GROUP + k
                assert _kept(alone, k) == _kept(batch, row), (p, k)
                torch.testing.assert_close(alone.sampling_logp[k][alone.completion_mask[k].bool()],
                                           batch.sampling_logp[row][batch.completion_mask[row].bool()])
        assert len(set(batch.completions)) > PROMPTS_PER_STEP  # the seeds do vary the samples of a prompt
    finally:
        engine.close()


# Run `grpokit train` with vLLM's model runner raising, as the CPU build did, in step 2's rollouts:
# the first time a batch of the trainer's 16 seeded requests appears after step 1's.
FAILING_RUN = """
import sys
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from grpokit.cli import main

real, seen = GPUModelRunner._bookkeeping_sync, set()

def failing(self, *args, **kwargs):
    if len(self.input_batch.generators) == 16:
        ids = set(self.input_batch.req_ids)
        if seen and not ids & seen:
            raise RuntimeError("CPU Generator does not use offset")
        seen.update(ids)
    return real(self, *args, **kwargs)

GPUModelRunner._bookkeeping_sync = failing
sys.exit(main(sys.argv[1:]))
"""
RUN = ["--grpo.max_steps=2", "--grpo.save_steps=1", "--rollout.engine=vllm", "--rollout.kv_cache_gb=0.0625",
       "--prompts_per_step=4", "--num_generations=4", "--max_completion_length=16", "--num_rl_questions=40",
       "--num_eval_questions=4", "--eval.k=1", "--quiet"]


@pytest.mark.timeout(600)
def test_a_vllm_failure_mid_run_ends_in_one_line_naming_the_checkpoint_and_the_resume_command(tmp_path):
    """vLLM raises inside generate at step 2: `grpokit train` exits 1 with one line that names the
    engine, its error, the last checkpoint and the resume command, and no traceback; that command
    then finishes the run."""
    run = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", FAILING_RUN, "train", f"--output_dir={run}", *RUN],
                          capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "grpokit: error: step 2: the vLLM engine failed while sampling 16 requests (RuntimeError: CPU Generator "
        f"does not use offset). Last checkpoint: {run / 'checkpoints' / 'step-1'}; resume with: grpokit train "
        f"{run / 'config.yaml'} --resume")

    resumed = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(run / "config.yaml"), "--resume"],
                             capture_output=True, text=True, timeout=540, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


# Run `grpokit eval` with vLLM raising in its third generate call: the second chunk's greedy answers.
FAILING_EVAL = """
import sys
import vllm
from grpokit.cli import main

real, calls = vllm.LLM.generate, []

def failing(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
        raise RuntimeError("CPU Generator does not use offset")
    return real(self, *args, **kwargs)

vllm.LLM.generate = failing
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(600)
def test_a_vllm_failure_in_grpokit_eval_names_the_completions_kept_and_how_to_continue(tmp_path, tokenizer):
    """`grpokit eval --engine vllm` (2 questions a chunk, greedy and k=2 samples each): vLLM raises in the
    second chunk; one line names the engine, its error, how many answers are kept where, and that a rerun
    continues; the rerun answers only the other two."""
    from grpokit.pipeline.build import ASCII_ALPHABET
    from grpokit.models import build_char_tokenizer

    ascii_tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    model_dir = tmp_path / "tiny"
    _policy(ascii_tokenizer).save_pretrained(model_dir)
    ascii_tokenizer.save_pretrained(model_dir)
    out = tmp_path / "eval"
    data = os.path.join(os.path.dirname(__file__), "fixtures", "gsm8k_test_sample.jsonl")
    args = ["eval", str(model_dir), "--data", data, "--mode", "cot", "--max-rows", "4", "--batch-size", "2",
            "--eval.k", "2", "--temperature", "1.0", "--grpo.max_completion_length", "8", "--engine", "vllm", "--kv-cache-gb",
            "0.0625", "--max-model-len", "1024", "--output-dir", str(out), "--quiet"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", FAILING_EVAL, *args], capture_output=True, text=True, timeout=540,
                          env=env)
    completions = out / "completions-gsm8k_test_sample-cot.jsonl"
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "grpokit: error: the vLLM engine failed while sampling 2 requests (RuntimeError: CPU Generator does not "
        f"use offset). 2 of 4 gsm8k_test_sample questions (cot) are answered in {completions}: rerun the same "
        "command to continue from there")

    rerun = subprocess.run([sys.executable, "-m", "grpokit.cli", *args], capture_output=True, text=True, timeout=540,
                           env=env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    cell = json.loads((out / "results.json").read_text())["results"]["gsm8k_test_sample"]["cot"]
    assert cell["resumed"] == 2 and cell["total"] == 4
