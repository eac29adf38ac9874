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


@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_full_demo_with_the_vllm_engine_meets_its_target(tmp_path):
    """rollout.engine=vllm: GRPO lifts held-out greedy accuracy over pi_SFT by >= 15 points at seed 0."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    command = [sys.executable, "-m", "grpokit.cli", "demo", "--rollout.engine=vllm",
               "--seed", "0", "--quiet", "--output-dir", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["grpo_accuracy"] - summary["sft_accuracy"] >= 0.15, summary
