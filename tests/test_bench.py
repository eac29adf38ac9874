"""`grpokit bench memory` (analytic) and `grpokit bench cost` (measured, in real subprocesses)."""

import json
import subprocess
import sys

import pytest

from grpokit.bench.memory import model_bytes, rl_memory


def test_memory_estimate_golden():
    """7B under bf16 mixed precision: trained = 16 B/param, frozen = 2 B/param."""
    assert model_bytes(7e9, trained=True)["total"] == 16 * 7e9
    assert model_bytes(7e9, trained=False)["total"] == 2 * 7e9
    r = rl_memory(7e9)
    assert r["grpo_bytes"] == 18 * 7e9 and r["ppo_bytes"] == 34 * 7e9  # PPO adds a trained critic
    assert r["saved_bytes"] == 16 * 7e9 and r["ratio"] == pytest.approx(18 / 34)
    with_rm = rl_memory(7e9, reward_model_params=7e9)
    assert with_rm["grpo_bytes"] == 20 * 7e9 and with_rm["ppo_bytes"] == 36 * 7e9


def test_bench_memory_cli_prints_the_three_sizes():
    out = subprocess.run([sys.executable, "-m", "grpokit.cli", "bench", "memory"], capture_output=True, text=True,
                         check=True).stdout
    for size in ("| 1.5B |", "| 7B |", "| 70B |"):
        assert size in out
    assert "0.53" in out


@pytest.mark.slow  # 12 s: make test-slow (make test stays under 15 minutes)
def test_bench_cost_measures_both_algorithms(tmp_path):
    path = tmp_path / "cost.json"
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "bench", "cost", "--hidden-size=32", "--layers=1",
                           "--heads=2", "--intermediate-size=64", "--steps=1", "--max-new-tokens=4",
                           f"--json={path}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| step time (median) |" in proc.stdout and "GRPO / PPO" in proc.stdout
    data = json.loads(path.read_text())
    for algo in ("grpo", "ppo"):
        assert data[algo]["peak_mem_bytes"] > 0 and data[algo]["step_seconds"] > 0
        assert set(data[algo]["stage_seconds"]) == {"generation", "scoring", "ref/old log-probs", "update"}
    assert data["ratios"]["peak_mem"] == pytest.approx(data["grpo"]["peak_mem_bytes"] / data["ppo"]["peak_mem_bytes"])


@pytest.mark.slow  # four fresh processes: about a minute on 2 CPU cores
def test_bench_memory_measures_long_steps_at_a_batch_and_twice_it(tmp_path):
    """The --table lengths plumbing, on a model small enough for seconds (the real one: BENCHMARKS.md)."""
    path = tmp_path / "lengths.json"
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "bench", "memory", "--measure", "--table", "lengths",
                           "--hidden-size=32", "--num-layers=1", "--num-heads=2", "--length-intermediate-size=64",
                           "--vocab-size=500", "--completion-length=48", "--prompt-length=8", "--max-tokens=120",
                           f"--json={path}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| GRPO | prompts_per_step=2 | 8 x 56 |" in proc.stdout and "| SFT | batch_size=4 | 4 x 56 |" in proc.stdout
    rows = json.loads(path.read_text())
    assert [(r["workload"], r["batch"]) for r in rows] == [("grpo", 1), ("grpo", 2), ("sft", 2), ("sft", 4)]
    assert all(r["peak_bytes"] > 0 and r["max_tokens"] == 120 for r in rows)
