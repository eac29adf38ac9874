"""DAPO's dynamic sampling end to end: groups with no reward spread are dropped and replaced by
fresh questions, so the step still trains on B groups (or says how many rounds it took)."""

import torch
from test_grpo_trainer import make_trainer

from grpokit.rewards import WeightedReward

SPREAD = 8  # of the 64 questions, only the first 8 give their completions different rewards


def reward_spread_on_few_questions(chain_rows):
    spread_prompts = {r["prompt"] for r in chain_rows[:SPREAD]}

    def reward(prompts, completions, **_):
        # the same score for every completion of most questions; a per-completion score for a few
        return [(hash(c) % 1000) / 1000 if p in spread_prompts else 0.5 for p, c in zip(prompts, completions)]

    return reward


def test_flat_groups_are_dropped_and_replaced_until_the_step_holds_b_groups(tiny_model, tokenizer, chain_rows,
                                                                           tmp_path):
    rewards = [WeightedReward("spread_on_few", reward_spread_on_few_questions(chain_rows))]
    trainer = make_trainer(tiny_model, tokenizer, chain_rows, tmp_path, rewards=rewards, prompts_per_step=4,
                           dynamic_sampling=True, max_generation_rounds=64, temperature=1.0)
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    record = trainer.step()
    assert record["sampling/groups_sampled"] - record["sampling/groups_dropped"] == 4  # B groups trained on
    assert record["sampling/groups_dropped"] > 0 and record["sampling/rounds"] > 1
    assert record["reward/zero_std_frac"] == 0.0  # every group trained on has a spread
    assert any(not torch.equal(before[k], v) for k, v in tiny_model.state_dict().items())


def test_when_the_rounds_run_out_the_step_trains_on_what_it_has(tiny_model, tokenizer, chain_rows, tmp_path):
    rewards = [WeightedReward("flat", lambda prompts, completions, **_: [0.5] * len(completions))]
    trainer = make_trainer(tiny_model, tokenizer, chain_rows, tmp_path, rewards=rewards, prompts_per_step=2,
                           dynamic_sampling=True, max_generation_rounds=3)
    record = trainer.step()
    assert record["sampling/rounds"] == 3 and record["sampling/groups_dropped"] == record["sampling/groups_sampled"]
    assert record["reward/zero_std_frac"] == 1.0  # nothing had a spread: the last round, advantages 0


def test_without_dynamic_sampling_flat_groups_stay(tiny_model, tokenizer, chain_rows, tmp_path):
    rewards = [WeightedReward("flat", lambda prompts, completions, **_: [0.5] * len(completions))]
    record = make_trainer(tiny_model, tokenizer, chain_rows, tmp_path, rewards=rewards).step()
    assert "sampling/rounds" not in record and record["reward/zero_std_frac"] == 1.0


def test_a_run_reports_to_tensorboard_beside_metrics_jsonl(tmp_path):
    """report_to reaches the trainer: every metrics.jsonl row is also in TensorBoard's event files."""
    import pytest

    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_reward_model_cli import TINY, grpokit

    from grpokit.run.metrics import read_metrics

    grpokit("train", "--output-dir", str(tmp_path), "--report_to=[tensorboard]", "--grpo.max_steps=2",
            "--eval.before=false", *TINY, "--quiet")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = [e.value for e in events.Scalars("reward/mean")]
    assert logged == pytest.approx([r["reward/mean"] for r in read_metrics(tmp_path / "metrics.jsonl")])
