"""`grpokit label-steps` end to end: rollout step labels -> a process reward model trained on
them -> GRPO with process supervision from that model, on the tiny built-in model."""

import json

import pytest

from test_reward_model_cli import TINY, TINY_RM, grpokit

from grpokit.data.reward_data import read_step_labels
from grpokit.run.metrics import read_metrics

LABELS = ["--reward_model.label_rollouts=2", "--reward_model.samples_per_question=2", "--quiet"]


@pytest.mark.slow  # 15 s: make test-slow (make test stays under 15 minutes)
def test_label_steps_then_train_rm_then_grpo_with_process_supervision(tmp_path):
    steps = tmp_path / "steps.jsonl"
    proc = grpokit("label-steps", "--output-dir", str(tmp_path / "label"), "--out", str(steps), *TINY, *TINY_RM,
                   *LABELS)
    stats = json.loads((tmp_path / "label" / "label_steps_stats.json").read_text())
    assert stats["questions"] == 8 and stats["solutions"] == 16 and stats["records"] >= 1
    assert 0.0 <= stats["agreement_with_rule_labels"] <= 1.0  # the built-in task checks steps by rule too
    examples = read_step_labels(str(steps), "\n", False)
    assert examples and all(len(x.steps) == len(x.labels) for x in examples)
    assert "wrote" in proc.stdout

    grpokit("train-rm", "--process", "--data", str(steps), "--output-dir", str(tmp_path / "rm"), *TINY, *TINY_RM,
            "--quiet")
    run = tmp_path / "grpo"
    grpokit("train", "--output-dir", str(run), "--reward_model.kind=process",
            f"--reward_model.path={tmp_path / 'rm' / 'reward_model'}", "--rewards=[]", "--grpo.max_steps=2",
            "--eval.before=false", *TINY, "--quiet")
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["process/steps_mean"] >= 1 for r in rows)


def test_the_demo_prm_can_take_its_labels_from_rollouts(tmp_path):
    out = tmp_path / "run"
    grpokit("demo", "--supervision", "process", "--reward_model.label=rollouts", "--output-dir", str(out),
            "--grpo.max_steps=2", *TINY, *TINY_RM, *LABELS)
    round0 = [json.loads(line) for line in (out / "reward_model_data" / "round-0.jsonl").read_text().splitlines()]
    assert round0 and all(len(r["steps"]) == len(r["labels"]) for r in round0)


def test_label_skip_uniform_false_rolls_out_every_question(tmp_path):
    """reward_model.label_skip_uniform=false: no question skips its rollouts, so all-wrong
    questions get every step labelled (the untrained tiny model gets every question wrong)."""
    runs = {}
    for skip in ("true", "false"):
        grpokit("label-steps", "--output-dir", str(tmp_path / skip), "--out", str(tmp_path / f"{skip}.jsonl"), *TINY,
                *TINY_RM, *LABELS, f"--reward_model.label_skip_uniform={skip}")
        runs[skip] = json.loads((tmp_path / skip / "label_steps_stats.json").read_text())
    assert runs["true"]["skipped_uniform"] > 0 and runs["false"]["skipped_uniform"] == 0
    assert runs["false"]["rollouts_sampled"] > runs["true"]["rollouts_sampled"]
    assert runs["false"]["unlabelled_steps"] < runs["true"]["unlabelled_steps"]
