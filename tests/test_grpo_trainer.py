"""The GRPO loop on a real tiny Llama: metrics, checkpoints, pi_old/pi_ref handling, failures."""

import copy
import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpokit.config import GRPOConfig
from grpokit.data import arithmetic
from grpokit.math import masked_outcome_advantages
from grpokit.rewards import WeightedReward
from grpokit.train.failures import RewardFailure
from grpokit.train.algorithm import Batch
from grpokit.train.grpo import GRPOTrainer
from grpokit.train.step_metrics import zero_std_fraction


def length_reward(prompts, completions, **_):
    return [len(c) / 10 for c in completions]  # varies within a group, so advantages are non-zero


def small_config(**kw) -> GRPOConfig:
    base = dict(num_generations=4, prompts_per_step=2, max_completion_length=8, max_steps=2,
                learning_rate=1e-3, micro_batch_size=64)
    base.update(kw)
    return GRPOConfig(**base)


def make_trainer(model, tokenizer, rows, tmp_path, rewards=None, **kw):
    rewards = rewards or [WeightedReward("chain_accuracy", arithmetic.chain_accuracy),
                          WeightedReward("length", length_reward, 0.1)]
    data = [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]
    return GRPOTrainer(model, tokenizer, rewards, data, small_config(**kw), tmp_path, seed=0, progress=False)


REQUIRED_METRICS = [
    "reward/mean", "reward/std", "reward/zero_std_frac", "rewards/chain_accuracy", "rewards/length",
    "rewards/failed", "kl", "clip_fraction", "ratio_mean", "entropy", "completion/mean_length",
    "completion/max_length", "completion/truncated_frac", "perf/tokens_per_s", "perf/step_time_s",
]


def test_train_writes_metrics_and_a_checkpoint_transformers_loads(tiny_model, tokenizer, chain_rows, tmp_path):
    trainer = make_trainer(tiny_model, tokenizer, chain_rows, tmp_path)
    before = copy.deepcopy(tiny_model.state_dict())
    history = trainer.train()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2] and len(history) == 2
    for key in REQUIRED_METRICS:
        assert key in lines[0], key
    assert lines[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # pi_theta == pi_ref before the first update
    assert lines[0]["ratio_mean"] == pytest.approx(1.0)
    assert any(not torch.equal(before[k], v) for k, v in tiny_model.state_dict().items())

    ckpt = tmp_path / "checkpoints" / "step-2"
    assert (ckpt / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    for k, v in tiny_model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)
    assert AutoTokenizer.from_pretrained(ckpt)("Q: 1+2\n")["input_ids"] == tokenizer("Q: 1+2\n")["input_ids"]


def test_reference_runs_once_per_batch_under_no_grad(tiny_model, tokenizer, chain_rows, tmp_path):
    trainer = make_trainer(tiny_model, tokenizer, chain_rows, tmp_path, micro_batch_size=3)
    calls = []
    trainer.ref_model.get_decoder().register_forward_hook(lambda *a: calls.append(torch.is_grad_enabled()))
    trainer.step()
    assert calls == [False] * 3  # 8 samples in micro-batches of 3, no gradient
    assert all(not p.requires_grad for p in trainer.ref_model.parameters())


def test_pi_old_needs_no_forward_pass_when_mu_is_one(tiny_model, tokenizer, chain_rows, tmp_path):
    trainer = make_trainer(tiny_model, tokenizer, chain_rows, tmp_path)
    from grpokit.rollout import sample_groups

    rows = trainer.prompts.next_rows(2)
    rollout = sample_groups(tiny_model, tokenizer, [r["prompt"] for r in rows], 4, trainer.sampling, rows)
    policy_calls = []
    hook = tiny_model.get_decoder().register_forward_hook(lambda *a: policy_calls.append(1))
    ref_logp, old_logp = trainer.fixed_logprobs(rollout)
    assert old_logp is None and ref_logp is not None and policy_calls == []
    trainer.config = trainer.algorithm.config = dataclasses.replace(trainer.config, num_iterations=2)
    _, old_logp = trainer.fixed_logprobs(rollout)
    assert old_logp is not None and len(policy_calls) == 1
    hook.remove()


def test_micro_batching_gives_the_same_gradient(tiny_model, tokenizer, chain_rows, tmp_path):
    """Micro-batch losses are reweighted so the update equals the full-batch update."""
    from grpokit.rollout import sample_groups

    results = []
    for aggregation in ("sequence", "token"):
        updated = []
        for micro in (64, 3):
            model = copy.deepcopy(tiny_model)
            trainer = make_trainer(model, tokenizer, chain_rows, tmp_path, micro_batch_size=micro,
                                   loss_aggregation=aggregation, max_grad_norm=1e9)
            trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
            trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: 1.0)
            torch.manual_seed(0)
            rows = chain_rows[:2]
            rollout = sample_groups(tiny_model, tokenizer, [r["prompt"] for r in rows], 4, trainer.sampling, rows)
            adv = torch.linspace(-1, 1, 8)
            mask = rollout.completion_mask.clone()
            mask[5] = 0  # a failed sample: empty row
            ref_logp, _ = trainer.fixed_logprobs(rollout)
            trainer.update_policy(Batch(rollout, None, mask, ref_logp, None, tokenizer, True, layout=trainer.layout),
                                  adv)
            updated.append(model.state_dict())
        for k in updated[0]:
            torch.testing.assert_close(updated[0][k], updated[1][k], atol=2e-6, rtol=1e-4)
        results.append(updated[0])
    assert any(not torch.allclose(results[0][k], results[1][k]) for k in results[0])


def test_failed_samples_are_masked_and_counted(tiny_model, tokenizer, chain_rows, tmp_path):
    def flaky(prompts, completions, **_):
        return [None if i % 4 == 0 else 1.0 for i in range(len(completions))]

    trainer = make_trainer(tiny_model, tokenizer, chain_rows, tmp_path,
                           rewards=[WeightedReward("flaky", flaky), WeightedReward("length", length_reward)])
    record = trainer.step()
    assert record["rewards/failed"] == 2
    assert record["rewards/flaky"] == 1.0


def test_a_reward_that_always_fails_stops_the_run_naming_it(tiny_model, tokenizer, chain_rows, tmp_path):
    def broken(prompts, completions, **_):
        raise KeyError("answer")

    trainer = make_trainer(tiny_model, tokenizer, chain_rows, tmp_path, max_failed_steps=2, max_steps=5,
                           rewards=[WeightedReward("broken_verifier", broken), WeightedReward("length", length_reward)])
    with pytest.warns(UserWarning):
        trainer.step()  # one all-failed step: the run goes on
        with pytest.raises(RewardFailure, match="'broken_verifier' failed on every sample for 2 consecutive steps"):
            trainer.step()


def test_sample_reuse_and_token_aggregation_run(tiny_model, tokenizer, chain_rows, tmp_path):
    trainer = make_trainer(tiny_model, tokenizer, chain_rows, tmp_path, num_iterations=2, num_minibatches=2,
                           loss_aggregation="token", epsilon_high=0.28, learning_rate=5e-3)
    record = trainer.step()
    assert record["ratio_mean"] != pytest.approx(1.0, abs=1e-9)  # later minibatches see updated theta
    assert 0.0 <= record["clip_fraction"] <= 1.0


def test_zero_std_fraction():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, float("nan")])
    valid = ~torch.isnan(rewards)
    assert zero_std_fraction(rewards, valid, 2) == pytest.approx(2 / 3)
    adv = masked_outcome_advantages(rewards, valid, 2)
    assert adv.tolist() == [0.0, 0.0, pytest.approx(-0.7070, abs=1e-3), pytest.approx(0.7070, abs=1e-3), 0.0, 0.0]


def test_empty_or_promptless_dataset_is_rejected(tiny_model, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="non-empty dataset"):
        GRPOTrainer(tiny_model, tokenizer, [], [], small_config(), tmp_path)
    with pytest.raises(ValueError, match="no 'prompt' field"):
        GRPOTrainer(tiny_model, tokenizer, [], [{"question": "x"}], small_config(), tmp_path)


def test_process_supervision_mixes_with_rule_based_rewards(tiny_model, tokenizer, chain_rows, tmp_path):
    """A PRM gives [N, T] process advantages (eq. 6); a rule-based reward beside it adds its outcome
    advantage (eq. 5) to every token of its completion."""
    from grpokit.rewards.learned import ProcessRewardModel, new_reward_model
    from grpokit.rollout import SamplingParams, sample_groups
    from grpokit.train.algorithm import Batch
    from grpokit.train.grpo import step_advantages

    prm_model = new_reward_model(copy.deepcopy(tiny_model), tokenizer, "process")
    with torch.no_grad():
        prm_model.score.weight.normal_()  # varied step scores
    prm = ProcessRewardModel(prm_model, tokenizer, "\n")
    trainer = make_trainer(tiny_model, tokenizer, chain_rows, tmp_path, max_completion_length=16)
    trainer.process_reward = prm
    record = trainer.step()
    assert {"process/steps_mean", "process/no_delimiter", "rewards/chain_accuracy"} <= set(record)

    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in chain_rows[:2]]
    rollout = sample_groups(tiny_model, tokenizer, [r["prompt"] for r in rows], 4, SamplingParams(16), rows)
    result = trainer._score(rollout)
    result.step_scores = prm.score_steps(rollout.prompts, rollout.completions)
    def advantages(rule_rewards: bool):
        batch = Batch(rollout, result, rollout.completion_mask, None, None, tokenizer, rule_rewards)
        return trainer.algorithm.advantages(batch)[0]

    mixed = advantages(rule_rewards=True)
    process = step_advantages(tokenizer, rollout.completion_ids, rollout.completion_lengths, result.step_scores, 4)
    outcome = masked_outcome_advantages(result.total.float(), result.valid, 4)
    assert mixed.shape == rollout.completion_mask.shape
    torch.testing.assert_close(mixed, process + outcome.unsqueeze(1))
    torch.testing.assert_close(advantages(rule_rewards=False), process)


def test_a_trainer_without_any_reward_is_refused(tiny_model, tokenizer, chain_rows, tmp_path):
    with pytest.raises(ValueError, match="needs a reward"):
        GRPOTrainer(tiny_model, tokenizer, [], chain_rows, small_config(), tmp_path)


def test_the_registry_is_looked_up_once_per_run_not_per_micro_batch(monkeypatch):
    """The run's loss (GRPOObjective) is made once when the algorithm is set up: its registered policy loss and
    importance-sampling correction are looked up then, and no micro-batch's loss looks them up again."""
    from grpokit.config import RolloutConfig
    from grpokit.math import losses
    from grpokit.train.grpo import GRPO

    lookups = []
    for name in ("registered_policy_loss", "registered_is_correction"):
        real = getattr(losses, name)
        monkeypatch.setattr(losses, name, lambda key, real=real, name=name: lookups.append(name) or real(key))
    algorithm = GRPO()
    algorithm.setup(None, GRPOConfig(beta=0.0, loss_aggregation="token"), RolloutConfig(is_correction="tis"))
    made = list(lookups)
    logp = torch.tensor([[-1.0, -0.5]], dtype=torch.float64, requires_grad=True)
    sampling = torch.tensor([[-1.1, -0.4]], dtype=torch.float64)
    for _ in range(3):  # three micro-batches
        algorithm.loss(logp, logp.detach(), None, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2), None,
                       sampling)
    assert made == ["registered_policy_loss"]
    assert lookups == made + ["registered_is_correction"]  # the correction once, on its first use
