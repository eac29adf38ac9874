"""`grpokit eval` on a training run gives what the run's own held-out evaluation gave: the same
questions (the run's heldout.jsonl), prompts, completion length, batches and grading rule, so the
same greedy completions, the same verdicts and the same accuracy as the after-RL table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


def grpokit(*args, timeout=600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def evaluate_run(run: Path, out: Path) -> tuple[dict, list[dict]]:
    """`grpokit eval RUN` (no --data: the run's held-out questions): its CoT cell and records."""
    proc = grpokit("eval", run, "--mode", "cot", "--output-dir", out, "--quiet")
    assert "with the run's task (chain)" in proc.stderr
    cell = json.loads((out / "results.json").read_text())["results"]["heldout"]["cot"]
    return cell, read_jsonl(out / "completions-heldout-cot.jsonl")


def assert_same_as_the_run(run: Path, cell: dict, records: list[dict]) -> None:
    summary = json.loads((run / "summary.json").read_text())
    after = read_jsonl(run / "heldout-after.jsonl")
    assert [r["question"] for r in records] == [r["question"] for r in after]
    assert [r["completion"] for r in records] == [r["completion"] for r in after]
    assert [r["correct"] for r in records] == [r["correct"] for r in after]
    assert cell["total"] == len(after) and cell["accuracy"] == summary["grpo_accuracy"]


def test_grpokit_eval_of_a_run_repeats_its_held_out_evaluation(tmp_path):
    run = tmp_path / "run"
    grpokit("train", f"--output_dir={run}", "--grpo.max_steps=1", "--prompts_per_step=2", "--num_generations=2",
            "--max_completion_length=10", "--eval.k=1", "--eval.before=false", "--task.num_eval_questions=12",
            "--quiet")
    heldout = read_jsonl(run / "heldout.jsonl")
    assert len(heldout) == 12 and all({"question", "answer", "rendered_prompt"} <= set(r) for r in heldout)
    cell, records = evaluate_run(run, tmp_path / "eval")
    assert_same_as_the_run(run, cell, records)
    assert all(len(r["completion"]) > 0 for r in records)  # generated, the run's 10 tokens each at most


@pytest.mark.slow
def test_grpokit_eval_of_the_demo_gives_its_after_rl_accuracy(tmp_path, seed0_demo):
    cell, records = evaluate_run(seed0_demo, tmp_path / "eval")
    assert_same_as_the_run(seed0_demo, cell, records)
    assert cell["accuracy"] > 0.5  # a trained policy: the verdicts compared are not all the same
