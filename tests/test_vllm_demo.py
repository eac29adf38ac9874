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
@pytest.mark.long  # a demo RL stage; CI keeps the full vLLM demo, test_vllm_lora's pushes and the hf LoRA demo
def test_lora_demo_with_the_vllm_engine_meets_its_target(tmp_path, vllm_demo):
    """README's LoRA demo (rank 16, alpha 32, every linear layer, lr 1e-3) with rollout.engine=vllm, from
    the same pi_SFT: the engine holds the base and receives the merged weights every step; >= 15 points."""
    summary = _demo_gain(tmp_path, f"--sft.checkpoint={vllm_demo / 'checkpoints' / 'sft'}", "--model.lora.r=16",
                         "--model.lora.alpha=32", "--model.lora.target_modules=[all-linear]",
                         "--grpo.learning_rate=1e-3")
    assert summary["grpo_accuracy"] - summary["sft_accuracy"] >= 0.15, summary


@pytest.mark.timeout(600)
def test_greedy_tir_rollouts_of_hf_and_vllm_are_the_same_tokens(tmp_path, vllm_demo):
    """The demo's pi_SFT, its 500 held-out questions with tools: `grpokit eval --mode tir` with the
    hf engine and with vllm (each continuing from token ids, rollout/multi_turn.py) writes the same
    completions, tool calls and verdicts, and both equal the run's own held-out TIR evaluation."""
    sft = vllm_demo / "checkpoints" / "sft"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    records = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / engine
        proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "eval", str(sft), "--data",
                               str(vllm_demo / "heldout.jsonl"), "--mode", "tir", "--engine", engine,
                               "--output-dir", str(out), "--quiet"], capture_output=True, text=True, timeout=600,
                              env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        records[engine] = [json.loads(line) for line in (out / "completions-heldout-tir.jsonl").read_text().splitlines()]
    run = [json.loads(line) for line in (vllm_demo / "heldout-before-tir.jsonl").read_text().splitlines()]
    assert len(records["hf"]) == len(records["vllm"]) == len(run) == 500
    for key in ("completion", "tool_calls", "correct"):
        assert [r[key] for r in records["hf"]] == [r[key] for r in records["vllm"]], key
    assert [r["completion"] for r in records["hf"]] == [r["completion"] for r in run]
    assert sum(r["tool_calls"] > 0 for r in records["hf"]) > 400  # pi_SFT writes programs: the rounds are exercised
