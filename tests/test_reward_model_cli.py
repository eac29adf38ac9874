"""Reward models through the command line, for real, on tiny budgets: the demo's variants
(--reward model, --supervision process, --iterative K), grpokit train-rm on files and on the
policy's own samples, GRPO with a reward model whose tokenizer differs, and iterative resume."""

from __future__ import annotations
import functools

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from grpokit.checks import load_config
from grpokit.rewards.learned import META_FILE
from run_helpers import cli

TINY = ["--model.tiny.hidden_size=32", "--model.tiny.num_layers=2", "--model.tiny.num_heads=2",
        "--model.tiny.intermediate_size=64", "--num_sft_examples=64", "--num_rl_questions=64",
        "--num_eval_questions=8", "--eval.k=2", "--sft.max_steps=5", "--sft.warmup_steps=1",
        "--prompts_per_step=2", "--num_generations=4", "--max_completion_length=16",
        "--task.validation_percent=0"]  # the draws these runs were calibrated on (tests/run_helpers.py's RUN)
TINY_RM_DATA = ["--reward_model.num_questions=8", "--reward_model.samples_per_question=4",
                "--reward_model.heldout_fraction=0.25"]
# the score head's optimizer; the likelihood head has none, and setting these is an error there
TINY_RM_TRAIN = ["--reward_model.max_steps=3", "--reward_model.train_batch_size=4", "--reward_model.warmup_steps=1"]
TINY_RM = TINY_RM_DATA + TINY_RM_TRAIN


grpokit = functools.partial(cli, timeout=300)


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    # Enough SFT that some sampled answers are right: outcome pairs need a right and a wrong one.
    grpokit("sft", f"--output_dir={out}", "--quiet", *TINY, "--sft.max_steps=300", "--sft.warmup_steps=10",
            "--num_sft_examples=512")
    return out / "checkpoints" / "sft"


@pytest.mark.parametrize(
    ("flags", "kind"),
    [(["--reward", "model"], "outcome"), (["--supervision", "process"], "process"),
     (["--supervision", "process", "--iterative", "2", "--beta", "0.05", "--reward_model.model.head=likelihood"],
      "process"),
     (["--supervision", "process", "--reward_model.hard_negatives=2", "--reward_model.balance_step_labels=true"],
      "process")],
    ids=["reward-model", "process", "iterative-likelihood", "process-hard-negatives-balanced"],
)
def test_demo_variant_runs_end_to_end(tmp_path, sft_checkpoint, flags, kind):
    out = tmp_path / "run"
    rm_flags = TINY_RM_DATA if "--reward_model.model.head=likelihood" in flags else TINY_RM
    proc = grpokit("demo", "--output-dir", str(out), "--quiet", *flags, *TINY, *rm_flags, "--grpo.max_steps=4",
                   f"--sft.checkpoint={sft_checkpoint}")
    assert f"{kind} reward model, held-out:" in proc.stdout and "greedy accuracy" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reward"] == "model" and summary["supervision"] == kind
    # The model-reward variants anchor the policy harder unless a beta is given.
    assert load_config(out / "config.yaml").grpo.beta == (0.05 if "--beta" in flags else 0.2)
    meta = json.loads((out / "reward_model" / META_FILE).read_text())
    assert meta["kind"] == kind
    if "--reward_model.model.head=likelihood" in flags:  # a causal LM and its fitted a, b
        assert meta["head"] == "likelihood" and math.isfinite(meta["weight"]) and math.isfinite(meta["bias"])
        assert AutoModelForCausalLM.from_pretrained(out / "reward_model").config.vocab_size > 0
    else:
        auto = AutoModelForTokenClassification if kind == "process" else AutoModelForSequenceClassification
        assert auto.from_pretrained(out / "reward_model").config.num_labels == 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    if kind == "process":
        assert all("process/steps_mean" in r and "process/no_delimiter" in r for r in rows)
    else:
        assert all("rewards/reward_model" in r for r in rows) and "rewards/chain_accuracy" not in rows[0]
    if "--iterative" in flags:
        assert [r["iteration"] for r in rows] == [1, 1, 2, 2]
        refreshes = summary["reward_model_refreshes"]
        assert len(refreshes) == 1 and refreshes[0]["replay_examples"] > 0
        # the drift the refresh answers: the old reward model on the same held-out samples of the new policy
        count = "pairs" if kind == "outcome" else "steps"
        assert refreshes[0]["before_refresh"][count] == refreshes[0][count]
        assert "before_refresh" not in summary["reward_model"]  # round 0 has nothing to refresh
        assert (out / "iterations" / "iter-1" / "state.json").is_file()
        assert (out / "replay_buffer.jsonl").is_file()


def test_train_rm_on_a_preference_file_and_its_errors(tmp_path):
    good = tmp_path / "pairs.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"Q: {i}+1\n", "chosen": f"A: {i + 1}", "rejected": f"A: {i + 2}"})
                            + "\n" for i in range(12)))
    out = tmp_path / "rm"
    proc = grpokit("train-rm", "--data", str(good), f"--output_dir={out}", "--quiet", *TINY, *TINY_RM)
    assert "pairwise_accuracy" in proc.stdout
    assert AutoModelForSequenceClassification.from_pretrained(out / "reward_model").config.num_labels == 1

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Q", "chosen": "A: 1", "rejected": "A: 2"}) + "\n"
                   + json.dumps({"prompt": "Q", "chosen": "A: 1", "rejected": "A: 1"}) + "\n")
    proc = grpokit("train-rm", "--data", str(bad), f"--output_dir={tmp_path / 'bad'}", "--quiet", *TINY, check=False)
    assert proc.returncode == 1 and f"{bad}:2" in proc.stderr and "rejected" in proc.stderr
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"prompt": "Q", "chosen": "A: 1"}) + "\n")
    proc = grpokit("train-rm", "--data", str(missing), f"--output_dir={tmp_path / 'm'}", "--quiet", *TINY, check=False)
    assert proc.returncode == 1 and f"{missing}:1" in proc.stderr and "rejected" in proc.stderr


def test_train_rm_says_so_when_graded_samples_make_no_pair(tmp_path):
    graded = tmp_path / "graded.jsonl"
    graded.write_text("".join(json.dumps({"prompt": "Q: 1+1\n", "completion": "A: 2", "correct": True})
                              + "\n" for i in range(4)))
    proc = grpokit("train-rm", "--data", str(graded), f"--output_dir={tmp_path / 'rm'}", "--quiet", *TINY, check=False)
    assert proc.returncode == 1 and "no reward-model training data" in proc.stderr and "Traceback" not in proc.stderr


def test_train_rm_process_on_the_policys_own_samples(tmp_path, sft_checkpoint):
    out = tmp_path / "prm"
    proc = grpokit("train-rm", "--process", f"--model.name_or_path={sft_checkpoint}", f"--output_dir={out}",
                   "--quiet", *TINY, *TINY_RM)
    assert "step_accuracy" in proc.stdout
    assert json.loads((out / "reward_model" / META_FILE).read_text()) == {"kind": "process", "step_delimiter": "\n"}
    data = [json.loads(line) for line in (out / "reward_model_data" / "round-0.jsonl").read_text().splitlines()]
    assert data and all(len(r["steps"]) == len(r["labels"]) for r in data)


def test_grpo_with_a_process_reward_model_of_another_tokenizer(tmp_path, sft_checkpoint):
    """The PRM's tokenizer (printable ASCII) differs from the policy's (the task's alphabet):
    completions are re-tokenized as text, and the run says so."""
    rm_dir = tmp_path / "prm"
    grpokit("train-rm", "--process", "--model.tiny.alphabet=ascii", f"--output_dir={rm_dir}", "--quiet", *TINY,
            *TINY_RM)
    out = tmp_path / "rl"
    proc = grpokit("train", f"--model.name_or_path={sft_checkpoint}", f"--output_dir={out}", "--quiet", *TINY,
                   "--grpo.max_steps=2", "--reward_model.kind=process",
                   f"--reward_model.path={rm_dir / 'reward_model'}", "--rewards=[]")
    assert "tokenizer differs from the policy's" in proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["process/steps_mean"] >= 1 for r in rows)


# inside iteration 1 (13 s) in make test-slow: make test stays under 15 minutes
@pytest.mark.parametrize("died_in", [pytest.param(1, marks=pytest.mark.slow), 2], ids=["inside-iteration-1", "in-iteration-2"])
def test_iterative_training_resumes_exactly(tmp_path, sft_checkpoint, died_in):
    """Killed in iteration 2, the run resumes at the iteration-1 boundary (policy, reward model,
    replay buffer); killed inside iteration 1, at its last step checkpoint with pi_ref still pi_SFT
    and the replay buffer kept. Either way it ends exactly where an uninterrupted run does."""
    common = ["train", f"--model.name_or_path={sft_checkpoint}", "--quiet", *TINY, *TINY_RM, "--grpo.max_steps=4",
              "--reward_model.kind=outcome", "--iterative.iterations=2", "--grpo.save_steps=1",
              "--grpo.save_total_limit=0"]
    full = tmp_path / "full"
    grpokit(*common, f"--output_dir={full}")
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    lost = ["step-3", "step-4", "latest"] + (["step-2"] if died_in == 1 else [])
    for name in lost:  # only what was written before the crash survives
        target = cut / "checkpoints" / name
        target.unlink() if target.is_symlink() or target.is_file() else shutil.rmtree(target, ignore_errors=True)
    if died_in == 1:
        shutil.rmtree(cut / "iterations")
        metrics = cut / "reward_model_metrics.jsonl"
        round0 = metrics.read_text().splitlines()[0]
        metrics.write_text(round0 + "\n")
        buffer = cut / "replay_buffer.jsonl"  # back to round 0's share: ceil(10%) of its training examples
        kept = math.ceil(0.1 * json.loads(round0)["new_examples"])
        buffer.write_text("".join(line + "\n" for line in buffer.read_text().splitlines()[:kept]))
    refresh = json.loads((full / "reward_model_metrics.jsonl").read_text().splitlines()[1])
    assert refresh["round"] == 1 and refresh["before_refresh"]["pairs"] == refresh["pairs"]  # the drift, measured
    proc = grpokit(*common, f"--output_dir={cut}", "--resume")
    assert ("iter-1" in proc.stderr and "at step 2" in proc.stderr) if died_in == 2 else "at step 1" in proc.stderr
    a = load_file(full / "checkpoints" / "step-4" / "model.safetensors")
    b = load_file(cut / "checkpoints" / "step-4" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0)
    strip = lambda path: [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}  # noqa: E731
                          for line in path.read_text().splitlines()]
    assert strip(cut / "metrics.jsonl") == strip(full / "metrics.jsonl")


@pytest.mark.slow
def test_grpo_on_a_learned_reward_model_beats_the_sft_model(tmp_path, seed0_demo):
    """The full-size `demo --reward model`: the outcome RM is trained on pi_SFT's graded samples and
    is GRPO's only reward; held-out greedy accuracy must still rise by >= 10 points."""
    grpokit("demo", "--reward", "model", f"--sft.checkpoint={seed0_demo / 'checkpoints' / 'sft'}",
            "--output-dir", str(tmp_path), "--seed", "0", "--quiet", timeout=900)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["reward"] == "model"
    assert summary["grpo_accuracy"] - summary["sft_accuracy"] >= 0.10, summary
