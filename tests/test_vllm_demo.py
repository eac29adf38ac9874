"""The demo learns with vLLM sampling its rollouts: the full run, as `make test-vllm-slow` runs it in CI."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

# The full demo with vLLM takes about 5 minutes on two CPU cores; this bounds a hung run.
DEMO_TIMEOUT_S = 3600

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (CPU: `make .venv-vllm` then `make test-vllm`; GPU: pip install vllm)",
    ),
]


def _demo_gain(output_dir, *overrides: str) -> dict:
    """The summary of `grpokit demo --rollout.engine=vllm` at seed 0 with `overrides`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    command = [sys.executable, "-m", "grpokit.cli", "demo", "--rollout.engine=vllm", *overrides,
               "--seed", "0", "--quiet", "--output-dir", str(output_dir)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((output_dir / "summary.json").read_text())


@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_full_demo_with_the_vllm_engine_meets_its_target(vllm_demo):
    """rollout.engine=vllm: GRPO lifts held-out greedy accuracy over pi_SFT by >= 15 points at seed 0."""
    summary = json.loads((vllm_demo / "summary.json").read_text())
    assert summary["grpo_accuracy"] - summary["sft_accuracy"] >= 0.15, summary


@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_lora_demo_with_the_vllm_engine_meets_its_target(tmp_path, vllm_demo):
    """README's LoRA demo (rank 16, alpha 32, every linear layer, lr 1e-3) with rollout.engine=vllm, from
    the same pi_SFT: the engine holds the base and receives the merged weights every step; >= 15 points."""
    summary = _demo_gain(tmp_path, f"--sft.checkpoint={vllm_demo / 'checkpoints' / 'sft'}", "--model.lora.r=16",
                         "--model.lora.alpha=32", "--model.lora.target_modules=[all-linear]",
                         "--grpo.learning_rate=1e-3")
    assert summary["grpo_accuracy"] - summary["sft_accuracy"] >= 0.15, summary
