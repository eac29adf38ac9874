"""TRL's own reward functions (trl.rewards, tested with trl 1.16), imported from TRL and given to grpokit.train
unwrapped on conversational rows: they get completions as lists of messages, completion_ids, and log_extra,
whose columns land in metrics.jsonl. The bench tier: it skips without TRL (pip install -e '.[bench]')."""

import pytest

import grpokit
from test_trl_formats import TINY, conversational_rows

trl_rewards = pytest.importorskip("trl.rewards", reason="TRL is not installed here: pip install -e '.[bench]'")


def test_trls_own_rewards_run_unwrapped(tmp_path):
    rewards = [trl_rewards.accuracy_reward, trl_rewards.reasoning_accuracy_reward, trl_rewards.think_format_reward,
               trl_rewards.get_cosine_scaled_reward(max_len=16),
               trl_rewards.get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0),
               trl_rewards.get_soft_overlong_punishment(max_completion_len=16, soft_punish_cache=4)]
    run = grpokit.train("tiny", rewards=rewards, dataset=conversational_rows(), output_dir=tmp_path / "run",
                        progress=False, config={**TINY, "grpo.max_steps": 2, "grpo.num_generations": 2,
                                                "grpo.max_completion_length": 16})
    assert [r["step"] for r in run.metrics] == [1, 2]
    names = [r.name for r in run.config.rewards]
    row = run.metrics[0]
    assert all(f"rewards/{name}" in row for name in names)
    assert row["rewards/failed"] == 0  # every function scored every sample (conversational completions, ids)
    accuracy = names[0]
    assert len(row[f"rewards/{accuracy}/gold_parsed"]) == 2 * TINY["grpo.prompts_per_step"]  # log_extra's column
