"""`grpokit eval` on a training run gives what the run's own held-out evaluation gave: the same
questions (the run's heldout.jsonl), prompts, completion length, batches and grading rule, so the
same greedy completions, the same verdicts and the same accuracy as the after-RL table, with
chain-of-thought and with tools (TIR: the same multi-turn rollout as RL, token for token)."""

import json
from pathlib import Path

import pytest
from run_helpers import cli


grpokit = cli


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def evaluate_run(run: Path, out: Path, mode: str = "cot") -> tuple[dict, list[dict]]:
    """`grpokit eval RUN` (no --data: the run's held-out questions): its `mode` cell and records."""
    proc = grpokit("eval", run, "--mode", mode, "--output-dir", out, "--quiet")
    assert "with the run's task (chain)" in proc.stderr
    cell = json.loads((out / "results.json").read_text())["results"]["heldout"][mode]
    return cell, read_jsonl(out / f"completions-heldout-{mode}.jsonl")


def assert_same_as_the_run(run: Path, cell: dict, records: list[dict], mode: str = "cot") -> None:
    summary = json.loads((run / "summary.json").read_text())
    after = read_jsonl(run / ("heldout-after.jsonl" if mode == "cot" else "heldout-after-tir.jsonl"))
    assert [r["question"] for r in records] == [r["question"] for r in after]
    assert [r["completion"] for r in records] == [r["completion"] for r in after]
    assert [r["correct"] for r in records] == [r["correct"] for r in after]
    accuracy = summary["grpo_accuracy" if mode == "cot" else "grpo_tir_accuracy"]
    assert cell["total"] == len(after) and cell["accuracy"] == accuracy


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


@pytest.mark.slow  # 48 s with its TIR pi_SFT: make test-slow; the CoT twin above stays in make test
def test_grpokit_eval_of_a_run_repeats_its_tir_evaluation_token_for_token(tmp_path, tir_policy):
    """From a policy that writes programs (a short SFT on the task's TIR demonstrations), the
    run's greedy TIR completions and `grpokit eval RUN --mode tir`'s are the same text, with the
    same tool calls and verdicts."""
    run = tmp_path / "run"
    grpokit("train", f"--output_dir={run}", f"--model.name_or_path={tir_policy}", "--grpo.max_steps=1",
            "--prompts_per_step=2", "--num_generations=2", "--max_completion_length=64", "--eval.k=1",
            "--eval.before=false", "--task.num_eval_questions=12", "--quiet")
    cell, records = evaluate_run(run, tmp_path / "eval", "tir")
    assert_same_as_the_run(run, cell, records, "tir")
    assert sum("```output" in r["completion"] for r in records) >= 6  # programs were written and run


@pytest.fixture(scope="module")
def tir_policy(tmp_path_factory):
    """pi_SFT of a short SFT (about 20 s) on 64 of the chain task's TIR demonstrations: it writes a
    program, output block and answer for any question, if not always the right program."""
    run = tmp_path_factory.mktemp("sft") / "run"
    grpokit("sft", f"--output_dir={run}", "--sft.max_steps=150", "--task.num_sft_examples=0",
            "--task.num_sft_tir_examples=64", "--model.tiny.num_layers=2", "--quiet")
    return run / "checkpoints" / "sft"


@pytest.mark.slow
def test_grpokit_eval_of_the_demo_gives_its_after_rl_accuracy(tmp_path, seed0_demo):
    cell, records = evaluate_run(seed0_demo, tmp_path / "eval")
    assert_same_as_the_run(seed0_demo, cell, records)
    assert cell["accuracy"] > 0.5  # a trained policy: the verdicts compared are not all the same
