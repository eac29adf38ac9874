"""Token-budget micro-batches: how rows are cut, and that the cut never changes what is learned."""

import random

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from grpokit.bench.memory_probe import RandomTokens
from grpokit.checks import load_config
from grpokit.config import ConfigError, GRPOConfig, SFTConfig
from grpokit.micro_batches import split_by_tokens, split_until
from grpokit.models import build_tiny_model
from grpokit.rewards import WeightedReward
from grpokit.models.logprobs import token_logprobs
from grpokit.models.logprobs import labelled_logprobs
from grpokit.train.grpo import GRPOTrainer
from grpokit.train.ppo import PPOTrainer
from grpokit.train.sft import (
    IGNORE,
    TokenizedExamples,
    accumulate_gradients,
    collate,
    packed_batch,
    packing_matches_padding,
    padded_batch,
    tokenize_examples,
    train_on_examples,
)

# ------------------------------------------------------------------ splitting


def test_split_by_tokens_by_hand():
    # In order of length: 2, 3, 3, 5, 9. Budget 9: [2, 3, 3] is 3 x 3 = 9; 5 alone (2 x 5 > 9); 9 alone.
    groups = split_by_tokens(torch.tensor([5, 3, 9, 2, 3]), max_tokens=9)
    assert [g.tolist() for g in groups] == [[3, 1, 4], [0], [2]]
    # A cap on rows binds first where it is tighter.
    assert [g.tolist() for g in split_by_tokens(torch.tensor([5, 3, 9, 2, 3]), 100, max_rows=2)] == [[3, 1], [4, 0], [2]]
    # No budget: rows only, still in order of length.
    assert [g.tolist() for g in split_by_tokens(torch.tensor([5, 3, 9]), None, max_rows=2)] == [[1, 0], [2]]


@pytest.mark.parametrize("seed", range(30))
def test_split_by_tokens_stays_within_the_budget_and_uses_every_row_once(seed):
    rng = random.Random(seed)
    lengths = torch.tensor([rng.randint(1, 300) for _ in range(rng.randint(1, 80))])
    budget = rng.randint(int(lengths.max()), 3000)
    max_rows = rng.choice([None, 1, 3, 64])
    groups = split_by_tokens(lengths, budget, max_rows)
    assert sorted(i for g in groups for i in g.tolist()) == list(range(len(lengths)))
    for g in groups:
        assert len(g) * int(lengths[g].max()) <= budget
        assert max_rows is None or len(g) <= max_rows
    # Greedy in order of length: no micro-batch could have taken the next one's shortest row.
    for a, b in zip(groups, groups[1:]):
        fits_rows = max_rows is None or len(a) < max_rows
        assert not (fits_rows and (len(a) + 1) * int(lengths[b].min()) <= budget)


def test_a_row_longer_than_the_budget_is_an_error_naming_both_numbers():
    with pytest.raises(ConfigError, match=r"grpo.max_tokens_per_micro_batch=100 .* longest row, 130 tokens"):
        split_by_tokens(torch.tensor([40, 130, 90]), 100, key="grpo.max_tokens_per_micro_batch")


def test_split_until_halves_the_largest_group_in_order():
    groups = [torch.tensor([0, 1, 2, 3]), torch.tensor([4])]
    assert [g.tolist() for g in split_until(groups, 4)] == [[0], [1], [2, 3], [4]]
    with pytest.raises(RuntimeError, match="cannot split 2 rows into the 3"):
        split_until([torch.tensor([0]), torch.tensor([1])], 3)


def test_token_logprobs_under_a_budget_equal_one_forward_and_respect_it(tokenizer):
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    rollout = RandomTokens(tokenizer, len(tokenizer), 5, 12, min_length=1, seed=0).generate(["q"] * 3, 4, None)
    shapes = []
    hook = model.get_decoder().register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                                         with_kwargs=True)
    whole, _ = token_logprobs(model, rollout.input_ids, rollout.attention_mask, 5, 0.7, micro_batch_size=64)
    shapes.clear()
    budget = 40  # 17 tokens at most per row: 2 rows, or 3 short ones
    split, _ = token_logprobs(model, rollout.input_ids, rollout.attention_mask, 5, 0.7, micro_batch_size=64,
                              max_tokens=budget)
    hook.remove()
    assert len(shapes) > 4 and all(rows * width <= budget for rows, width in shapes)
    assert sum(rows for rows, _ in shapes) == 12
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-6)
    with pytest.raises(ConfigError, match=r"grpo.max_tokens_per_micro_batch=10 .* 17 tokens"):
        token_logprobs(model, rollout.input_ids, rollout.attention_mask, 5, max_tokens=10,
                       budget_key="grpo.max_tokens_per_micro_batch")


# ------------------------------------------------------------------ GRPO and PPO: the same update


def length_reward(prompts, completions, **_):
    return [len(c) / 16 for c in completions]


def first_update(tokenizer, trainer_class, **config):
    """Gradients (after clipping) of the first optimizer step of each model, and the step's metrics."""
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    engine = RandomTokens(tokenizer, len(tokenizer), 6, 12, min_length=1, seed=0)
    cfg = GRPOConfig(num_generations=4, prompts_per_step=2, max_completion_length=12, learning_rate=1e-3,
                     warmup_steps=0, num_iterations=2, **config)
    trainer = trainer_class(model, tokenizer, [WeightedReward("length", length_reward)],
                            [{"prompt": f"q{i}"} for i in range(2)], cfg, "/tmp/unused", seed=0, progress=False,
                            engine=engine)
    grads = {}
    optimizers = [trainer.optimizer] + ([trainer.algorithm.critic_optimizer] if trainer_class is PPOTrainer else [])
    for name, optimizer in zip(("policy", "critic"), optimizers):
        def keep(opt, args, kwargs, name=name):
            grads.setdefault(name, [p.grad.clone() for group in opt.param_groups for p in group["params"]
                                    if p.grad is not None])
        optimizer.register_step_pre_hook(keep)
    metrics = trainer.step()
    return grads, metrics


@pytest.mark.parametrize("trainer_class", [GRPOTrainer, PPOTrainer])
def test_two_token_budgets_give_the_same_update(tokenizer, trainer_class):
    torch.manual_seed(0)
    whole, whole_metrics = first_update(tokenizer, trainer_class)
    torch.manual_seed(0)
    # 18 tokens at most per row: one or two rows per micro-batch, or five short ones
    tight, tight_metrics = first_update(tokenizer, trainer_class, max_tokens_per_micro_batch=23, micro_batch_size=5)
    assert set(whole) == set(tight) == ({"policy", "critic"} if trainer_class is PPOTrainer else {"policy"})
    for name in whole:
        for a, b in zip(whole[name], tight[name]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    for key in ("loss", "kl", "entropy", "grad_norm"):
        assert tight_metrics[key] == pytest.approx(whole_metrics[key], rel=1e-5, abs=1e-8), key


# ------------------------------------------------------------------ SFT


@pytest.fixture(scope="module")
def sft_data(tokenizer):
    from grpokit.data import arithmetic

    rows = arithmetic.make_sft_rows(arithmetic.sample_questions(48, 0, arithmetic.ChainSpec(), "train"), 0.5, 0)
    return TokenizedExamples.of(tokenize_examples(tokenizer, [(r["prompt"], r["solution"]) for r in rows]))


def plain_cross_entropy(model, batch):
    """transformers' way: full [rows, L, vocab] logits upcast to float32, cross-entropy over labelled tokens."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                             ignore_index=IGNORE)


@pytest.mark.parametrize("layout", [padded_batch, packed_batch])
def test_tiled_sft_loss_equals_plain_cross_entropy(tokenizer, sft_data, layout):
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    batch = layout(sft_data, list(range(24)), tokenizer.pad_token_id)
    plain = plain_cross_entropy(model, batch)
    plain.backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    tiled = accumulate_gradients(model, batch, max_tokens=10**6)
    torch.testing.assert_close(tiled, plain.detach(), rtol=1e-6, atol=1e-6)
    for p, g in zip(model.parameters(), plain_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
    # bf16: the same logits rounded to bf16 in both, reduced in float32; tiles change the GEMM shapes.
    model.to(torch.bfloat16)
    with torch.no_grad():
        plain = plain_cross_entropy(model, batch)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        tiled = -labelled_logprobs(model, {**inputs, "use_cache": False}, batch["labels"], chunk_size=7).mean()
    torch.testing.assert_close(tiled, plain, rtol=1e-2, atol=1e-2)


def test_sft_token_budgets_give_the_same_update(tokenizer, sft_data):
    def run(budget):
        model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
        grads = []  # of every optimizer step, after clipping
        hook = register_optimizer_step_pre_hook(
            lambda opt, args, kwargs: grads.append([p.grad.clone() for p in model.parameters()]))
        try:
            losses = train_on_examples(model, sft_data, tokenizer.pad_token_id,
                                       SFTConfig(batch_size=12, max_steps=2, warmup_steps=0, learning_rate=1e-3,
                                                 max_tokens_per_micro_batch=budget), seed=1, progress=False)
        finally:
            hook.remove()
        return losses, grads

    longest = max(sft_data.lengths)
    whole_losses, whole_grads = run(10**6)
    tight_losses, tight_grads = run(2 * longest)  # two packed rows per micro-batch
    assert tight_losses == pytest.approx(whole_losses, rel=1e-6)
    # The first step's gradients (the second step starts from weights Adam moved by sign(g) steps,
    # where a gradient of ~1e-9 may flip with the summation order).
    for a, b in zip(whole_grads[0], tight_grads[0]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    # The SFT loss is the mean over every target token of the batch, not a mean of micro-batch means.
    batch = packed_batch(sft_data, list(range(16)), tokenizer.pad_token_id)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    labelled = (batch["labels"][:, 1:] != IGNORE).sum(1)
    assert labelled.unique().numel() > 1  # rows differ in target count, so the two means would differ
    torch.testing.assert_close(accumulate_gradients(model, batch, longest), plain_cross_entropy(model, batch).detach(),
                               rtol=1e-6, atol=1e-6)


def test_sft_budget_below_the_longest_example_is_an_error_before_training(tokenizer, sft_data):
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    longest = max(sft_data.lengths)
    with pytest.raises(ConfigError, match=rf"sft.max_tokens_per_micro_batch=20 .* longest example, {longest} tokens"):
        train_on_examples(model, sft_data, tokenizer.pad_token_id,
                          SFTConfig(max_tokens_per_micro_batch=20, max_steps=1), progress=False)


def test_packing_equals_padding_in_bf16(tokenizer, sft_data):
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                             seed=0).to(torch.bfloat16)
    indices = list(range(32))
    assert packing_matches_padding(model, sft_data, indices, tokenizer.pad_token_id)
    padded, packed = padded_batch(sft_data, indices, tokenizer.pad_token_id), packed_batch(sft_data, indices, 0)
    assert packed["input_ids"].numel() < 0.8 * padded["input_ids"].numel()
    padded_loss = accumulate_gradients(model, padded, 10**6)
    padded_grads = [p.grad.float().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    packed_loss = accumulate_gradients(model, packed, 10**6)
    # bf16 keeps 8 bits of mantissa: losses to ~0.5%, gradients to a few % of their scale.
    torch.testing.assert_close(packed_loss, padded_loss, rtol=5e-3, atol=5e-3)
    for p, g in zip(model.parameters(), padded_grads):
        scale = g.abs().max().item() + 1e-12
        assert (p.grad.float() - g).abs().max().item() <= 0.05 * scale


# ------------------------------------------------------------------ config


def test_token_budget_keys_and_their_checks():
    config = load_config(None, [])
    assert config.grpo.max_tokens_per_micro_batch == 16384 and config.sft.max_tokens_per_micro_batch == 16384
    with pytest.raises(ConfigError, match=r"grpo.max_tokens_per_micro_batch=40 is smaller than the longest row, 49"):
        load_config(None, ["--grpo.max_tokens_per_micro_batch=40", "--grpo.max_completion_length=48"])
    with pytest.raises(ConfigError, match=r"longest row, 196 tokens"):  # 100 + the 96 completion tokens
        load_config(None, ["--grpo.max_tokens_per_micro_batch=140", "--data.max_prompt_length=100"])
    with pytest.raises(ConfigError, match="sft.max_tokens_per_micro_batch must be >= 1"):
        load_config(None, ["--sft.max_tokens_per_micro_batch=0"])
