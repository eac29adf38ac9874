"""Packed RL rows (grpo.pack_rows): the layout by hand, log-probs, values and GRPO gradients equal to the
padded ones, a policy whose attention leaks across packed rows refused, and perf/padding_frac."""

from pathlib import Path

import pytest
import torch

from grpokit.config import ConfigError
from grpokit.math import loss_denominator
from grpokit.micro_batches import (ComputedTokens, RowLayout, packed_inputs, packed_lengths, packed_micro_batches,
                                   position_ids_for)
from grpokit.models.precision import set_compute_dtype
from grpokit.models.value import build_critic, token_values
from grpokit.rewards import WeightedReward
from grpokit.models.logprobs import token_logprobs
from grpokit.train.algorithm import Batch
from grpokit.train.grpo import GRPOTrainer
from grpokit.train.packing import packs_apart
from grpokit.train.update import split_minibatch as split_micro_batches
from grpokit.train.sft import PACKING_TOLERANCE
from grpokit.types import Rollout
from test_grpo_trainer import length_reward, small_config
from test_sft import AttentionThatIgnoresPositions

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"


def padded_rows(prompts: list[list[int]], completions: list[list[int]],
                pad: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask, P): prompts left-padded to P, completions right-padded, as rollouts hold them."""
    p, t = max(map(len, prompts)), max(map(len, completions))
    ids = torch.full((len(prompts), p + t), pad)
    mask = torch.zeros((len(prompts), p + t), dtype=torch.long)
    for i, (a, b) in enumerate(zip(prompts, completions)):
        ids[i, p - len(a) : p + len(b)] = torch.tensor(a + b)
        mask[i, p - len(a) : p + len(b)] = 1
    return ids, mask, p


def random_batch(vocab: int, n: int = 12, max_prompt: int = 7, max_completion: int = 24, seed: int = 0,
                 pad: int = 0, low: int = 3):
    """A long-tailed spread of completion lengths (some empty), prompts of 2..max_prompt tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for i in range(n):
        prompts.append(torch.randint(low, vocab, (int(torch.randint(2, max_prompt + 1, (1,), generator=g)),),
                                     generator=g).tolist())
        drawn = int(torch.empty(1).exponential_(generator=g) * max_completion / 4) + 1
        length = 0 if i == 3 else min(max_completion, drawn)
        completions.append(torch.randint(low, vocab, (length,), generator=g).tolist())
    completions[0] = completions[0] + [low] * (max_completion - len(completions[0]))  # one row of full width
    return padded_rows(prompts, completions, pad)


# ---------------------------------------------------------------- the layout, by hand

def test_packed_inputs_by_hand():
    # prompts [5, 6] and [7]; completions [8, 9, 10] and [11]: P = 2, T = 3
    ids, mask, p = padded_rows([[5, 6], [7]], [[8, 9, 10], [11]], pad=0)
    assert ids.tolist() == [[5, 6, 8, 9, 10], [0, 7, 11, 0, 0]]
    assert packed_lengths(mask, p).tolist() == [5, 2]
    packed = packed_inputs(ids, mask, p, [[0, 1]])
    assert packed.input_ids.tolist() == [[5, 6, 8, 9, 10, 7, 11]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]  # restarting at each sample
    # column c predicts column c + 1: 6 -> 8, 8 -> 9, 9 -> 10 (row 0, completion columns 0..2); 7 -> 11 (row 1, col 0)
    assert packed.select.tolist() == [[False, True, True, True, False, True]]
    assert packed.destination.tolist() == [[-1, 0, 1, 2, -1, 3]]  # row x T + completion column
    assert packed.targets.tolist() == [[6, 8, 9, 10, 7, 11]]
    assert packed.real_tokens == 7
    # a row's padding tail restarts its positions too, as SFT's packed rows do
    alone = packed_inputs(ids, mask, p, [[0], [1]])
    assert alone.input_ids.tolist() == [[5, 6, 8, 9, 10], [7, 11, 0, 0, 0]]
    assert alone.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]]
    assert alone.real_tokens == 7


def test_a_row_without_completion_tokens_is_not_computed():
    ids, mask, p = padded_rows([[5, 6], [7]], [[8], []], pad=0)
    assert packed_lengths(mask, p).tolist() == [3, 0]
    assert packed_micro_batches(packed_lengths(mask, p), None) == [[[0]]]


def test_packed_micro_batches_by_hand():
    # lengths 5, 3, 2, 4, 1 at width 5 pack first-fit decreasing into [0], [3, 4], [1, 2] (fills 5, 5, 5)
    lengths = torch.tensor([5, 3, 2, 4, 1])
    assert packed_micro_batches(lengths, None) == [[[0], [3, 4], [1, 2]]]
    assert packed_micro_batches(lengths, 10) == [[[0], [3, 4]], [[1, 2]]]  # two packed rows of 5 per 10 tokens
    assert packed_micro_batches(lengths, None, max_rows=1) == [[[0]], [[3, 4]], [[1, 2]]]
    with pytest.raises(ConfigError, match="grpo.max_tokens_per_micro_batch=4 is smaller than the longest row, 5"):
        packed_micro_batches(lengths, 4, key="grpo.max_tokens_per_micro_batch")


def test_padding_frac_by_hand(tiny_model):
    # rows of 5 and 2 real tokens: padded, one [2, 5] forward computes 10 tokens, 3 of them padding (0.3).
    # Packed rows are as wide as the longest row by default, so 5 + 2 do not share one: 10 again; packed
    # 7 wide, one [1, 7] row holds both, no padding (0.0)
    ids, mask, p = padded_rows([[5, 6], [7]], [[8, 9, 10], [11]], pad=0)
    padded, packed, wide = ComputedTokens(), ComputedTokens(), ComputedTokens()
    with torch.no_grad():
        token_logprobs(tiny_model, ids, mask, p, counter=padded)
        token_logprobs(tiny_model, ids, mask, p, pack=True, counter=packed)
        token_logprobs(tiny_model, ids, mask, p, pack=True, pack_width=7, counter=wide)
    assert (padded.computed, padded.real, packed.computed, wide.computed, wide.real) == (10, 7, 10, 7, 7)
    assert padded.padding_frac == pytest.approx(0.3) and wide.padding_frac == 0.0
    assert ComputedTokens().padding_frac == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_each_update_micro_batch_packs_again_into_one_forward_within_the_budget(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.empty(40).exponential_(generator=g) * 60).long().clamp(1, 300) + 30
    budget, rows_cap = 1200, 8
    layout = RowLayout(pack=True, width=int(lengths.max()))
    seen = []
    for group in layout.micro_batches(lengths, budget, rows_cap, "budget"):
        again = packed_micro_batches(lengths[group], budget, rows_cap, "budget", width=layout.width)
        assert len(again) == 1  # what the update's micro-batch forward does with these rows
        rows = again[0]
        assert len(rows) <= rows_cap and len(rows) * max(sum(int(lengths[group][i]) for i in r) for r in rows) <= budget
        seen += group.tolist()
    assert sorted(seen) == list(range(40))


# ---------------------------------------------------------------- packed == padded

@pytest.mark.parametrize("max_tokens", [None, 64])
def test_packed_logprobs_and_entropy_equal_padded(tiny_model, tokenizer, max_tokens):
    ids, mask, p = random_batch(len(tokenizer), pad=tokenizer.pad_token_id)
    padded_counter, packed_counter = ComputedTokens(), ComputedTokens()
    with torch.no_grad():
        a, ea = token_logprobs(tiny_model, ids, mask, p, 0.7, 4, with_entropy=True, max_tokens=max_tokens,
                               counter=padded_counter)
        b, eb = token_logprobs(tiny_model, ids, mask, p, 0.7, 4, with_entropy=True, max_tokens=max_tokens,
                               pack=True, counter=packed_counter)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    torch.testing.assert_close(eb, ea, rtol=0, atol=1e-5)
    assert (b[mask[:, p:] == 0] == 0).all()
    assert packed_counter.real == padded_counter.real == int(packed_lengths(mask, p).sum())
    assert packed_counter.padding_frac < padded_counter.padding_frac


def test_packed_logprobs_equal_padded_in_bf16(tiny_model, tokenizer):
    ids, mask, p = random_batch(len(tokenizer), pad=tokenizer.pad_token_id)
    model = set_compute_dtype(tiny_model, torch.bfloat16)  # fp32 master weights, bf16 products
    with torch.no_grad():
        a, _ = token_logprobs(model, ids, mask, p, 1.0, 4)
        b, _ = token_logprobs(model, ids, mask, p, 1.0, 4, pack=True)
    # bf16 keeps ~3 significant digits; the same products in other shapes round differently
    torch.testing.assert_close(b, a, rtol=0, atol=0.05)


def test_packed_critic_values_equal_padded(tiny_model, tokenizer):
    critic = build_critic(tiny_model)
    with torch.no_grad():
        critic.score.weight.normal_()  # a critic that does not read 0 everywhere
    ids, mask, p = random_batch(len(tokenizer), pad=tokenizer.pad_token_id)
    with torch.no_grad():
        a = token_values(critic, ids, mask, p, 4, max_tokens=64)
        b = token_values(critic, ids, mask, p, 4, max_tokens=64, pack=True)
    attended = mask[:, p:].bool()  # padded rows read values off padding too; every use masks them
    torch.testing.assert_close(b[attended], a[attended], rtol=0, atol=1e-5)
    assert (b[~attended] == 0).all()


def synthetic_rollout(ids, mask, p, group_size=4) -> Rollout:
    n = ids.shape[0]
    completion = mask[:, p:]
    return Rollout(prompts=[""] * n, completions=[""] * n, input_ids=ids, attention_mask=mask,
                   completion_mask=completion, truncated=torch.zeros(n, dtype=torch.bool), prompt_length=p,
                   group_size=group_size)


def update_gradients(trainer: GRPOTrainer, rollout: Rollout, pack: bool) -> list[torch.Tensor]:
    """The gradient of one optimizer step of the update, accumulated over the update's own micro-batches
    (Trainer.micro_batches) in the packed or padded layout, with pi_ref's and pi_old's log-probs fixed."""
    model = trainer.model
    trainer.layout = RowLayout.of(pack, rollout.attention_mask, rollout.prompt_length)
    loss_mask = rollout.completion_mask.float()
    g = torch.Generator().manual_seed(0)
    advantages = torch.randn(rollout.num_samples, generator=g)
    with torch.no_grad():
        base = token_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_length)[0]
    ref_logp = base + 0.1 * torch.randn(base.shape, generator=g)  # a reference away from the policy: KL terms
    old_logp = base + 0.05 * torch.randn(base.shape, generator=g)  # and ratios away from 1: clipping
    batch = Batch(rollout, None, loss_mask, ref_logp, old_logp, None, True, layout=trainer.layout)
    micro_loss = trainer.policy_micro_loss(batch, advantages)
    total = loss_denominator(loss_mask, trainer.config.loss_aggregation)
    model.zero_grad(set_to_none=True)
    lengths = trainer.layout.row_lengths(rollout.attention_mask, rollout.prompt_length)
    micro_batches = split_micro_batches(torch.arange(rollout.num_samples), lengths, trainer.config, trainer.layout,
                                        False)
    assert len(micro_batches) > 1  # the budget splits the update
    for micro in micro_batches:
        loss, _ = micro_loss(micro, 0, total)
        loss.backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def relative_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    difference = torch.cat([(x - y).flatten() for x, y in zip(a, b)]).norm()
    return float(difference / torch.cat([y.flatten() for y in b]).norm())


def grpo_trainer(model, tokenizer, tmp_path, **kw) -> GRPOTrainer:
    rows = [{"prompt": "1+1=", "answer": "2"}]
    return GRPOTrainer(model, tokenizer, [WeightedReward("length", length_reward)], rows,
                       small_config(**{"beta": 0.04, "max_tokens_per_micro_batch": 96, "micro_batch_size": 4, **kw}),
                       tmp_path, seed=0, progress=False)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grpo_gradients_packed_equal_padded(tiny_model, tokenizer, tmp_path, dtype, tolerance):
    # fp32: float rounding of the same sums in other shapes (~1e-7 relative). bf16 compute (fp32 master
    # weights, bf16 products): each product rounds to ~3 digits, differently in other shapes, ~1e-2 at most.
    model = set_compute_dtype(tiny_model, dtype) if dtype != torch.float32 else tiny_model
    trainer = grpo_trainer(model, tokenizer, tmp_path)
    rollout = synthetic_rollout(*random_batch(len(tokenizer), pad=tokenizer.pad_token_id))
    padded = update_gradients(trainer, rollout, pack=False)
    packed = update_gradients(trainer, rollout, pack=True)
    assert len(packed) == len(padded) > 0
    assert relative_difference(packed, padded) < tolerance
    if dtype == torch.float32:
        for x, y in zip(packed, padded):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------- leaks

def test_the_packing_check_passes_transformers_attention_and_refuses_a_leak(tiny_model, tokenizer):
    rollout = synthetic_rollout(*random_batch(len(tokenizer), pad=tokenizer.pad_token_id))
    assert packs_apart(tiny_model, rollout, tokenizer.pad_token_id, 4096, False)
    leaking = AttentionThatIgnoresPositions(tiny_model)
    assert not packs_apart(leaking, rollout, tokenizer.pad_token_id, 4096, False)
    # and the leak is real: packed log-probs of that model are not the padded ones
    with torch.no_grad():
        a, _ = token_logprobs(leaking, rollout.input_ids, rollout.attention_mask, rollout.prompt_length)
        b, _ = token_logprobs(leaking, rollout.input_ids, rollout.attention_mask, rollout.prompt_length, pack=True)
    assert (a - b).abs().max() > 1e-3


def test_pack_rows_on_refuses_a_leaking_policy_and_auto_pads_it(tiny_model, tokenizer, tmp_path, capsys):
    leaking = AttentionThatIgnoresPositions(tiny_model)
    leaking.config = tiny_model.config
    rollout = synthetic_rollout(*random_batch(len(tokenizer), pad=tokenizer.pad_token_id))
    trainer = grpo_trainer(leaking, tokenizer, tmp_path / "on", pack_rows="on")
    with pytest.raises(ConfigError, match="grpo.pack_rows=on, but this policy's attention does not keep packed"):
        trainer.packs(rollout)
    trainer = grpo_trainer(leaking, tokenizer, tmp_path / "auto", pack_rows="auto")
    assert not trainer.packs(rollout)
    assert "pad one sample per row instead" in capsys.readouterr().err
    assert grpo_trainer(tiny_model, tokenizer, tmp_path / "good", pack_rows="auto").packs(rollout)
    assert not grpo_trainer(tiny_model, tokenizer, tmp_path / "off", pack_rows="off").packs(rollout)


# ---------------------------------------------------------------- the loop

def test_a_packed_run_logs_less_padding_and_the_same_first_step(tokenizer, chain_rows, tmp_path):
    from grpokit.models import build_tiny_model

    def first_step(pack_rows):
        model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
        rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in chain_rows]
        trainer = GRPOTrainer(model, tokenizer, [WeightedReward("length", length_reward)], rows,
                              small_config(max_steps=1, max_completion_length=24, prompts_per_step=4,
                                           micro_batch_size=4, pack_rows=pack_rows, temperature=1.5),
                              tmp_path / pack_rows, seed=0, progress=False)
        return trainer.train()[0]

    packed, padded = first_step("on"), first_step("off")
    assert 0 <= packed["perf/padding_frac"] < padded["perf/padding_frac"] < 1
    for key in ("loss", "kl", "entropy", "grad_norm", "reward/mean"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key


# ---------------------------------------------------------------- the real checkpoint

@pytest.mark.real
# fp32: float rounding of the same sums in other shapes (measured 5e-6), with the kernels a run uses.
# bf16 is judged against the exact (fp32) gradient, not against the other bf16 layout. Measured on SmolLM2
# (AMD EPYC without native bf16, and the same digits on CI's Xeon), distance from the fp32 gradient:
#   sdpa's default CPU kernel (flash): padded 0.071, packed 0.122 -- its bf16 backward loses more in longer
#     rows, and packed rows are longer, so packed and padded differ by 0.19 with no leak at all;
#   the math kernel: padded 0.0320, packed 0.0320.
# So the bf16 layouts are compared under the math kernel, where packing must land as close to the exact
# gradient as padding does; under the default kernel only a sanity bound holds. A leak between packed
# samples moves the gradient by O(1), past every bound here.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_checkpoint_packed_gradients_equal_padded(tmp_path, dtype):
    if not SMOLLM2.is_dir():
        pytest.skip("models/smollm2-135m-instruct absent: run `make models` (downloads once, then offline)")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from grpokit.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(str(SMOLLM2), dtype="fp32", device="cpu")
    ids, mask, p = random_batch(2000, n=8, max_prompt=24, max_completion=48, pad=tokenizer.pad_token_id, low=100)
    rollout = synthetic_rollout(ids, mask, p)
    trainer = grpo_trainer(model, tokenizer, tmp_path, max_tokens_per_micro_batch=160)
    exact = update_gradients(trainer, rollout, pack=False)  # fp32, padded: the reference
    if dtype == torch.float32:
        assert relative_difference(update_gradients(trainer, rollout, pack=True), exact) < 1e-4
        return
    model = set_compute_dtype(model, dtype)
    assert packs_apart(model, rollout, tokenizer.pad_token_id, 4096, False)
    with torch.no_grad():
        a, _ = token_logprobs(model, ids, mask, p)
        b, _ = token_logprobs(model, ids, mask, p, pack=True)
    # SFT's packing tolerance of the dtype (relative and absolute): random tokens' log-probs lie near -15,
    # where bf16 rounding through 30 layers moves them by up to ~1.5%
    torch.testing.assert_close(b, a, rtol=PACKING_TOLERANCE[dtype], atol=PACKING_TOLERANCE[dtype])
    assert relative_difference(update_gradients(trainer, rollout, pack=True), exact) < 0.5
    with sdpa_kernel([SDPBackend.MATH]):
        padded_error = relative_difference(update_gradients(trainer, rollout, pack=False), exact)
        packed_error = relative_difference(update_gradients(trainer, rollout, pack=True), exact)
    assert padded_error < 0.1, f"bf16 compute itself is off: {padded_error:.3g} from the fp32 gradient"
    assert packed_error < 1.1 * padded_error + 1e-3, (packed_error, padded_error)


def test_position_ids_for_matches_the_packed_positions():
    # the positions a packed sample gets are those the padded row's attended columns get
    ids, mask, p = padded_rows([[5, 6], [7]], [[8, 9, 10], [11]], pad=0)
    padded_positions = position_ids_for(mask)
    assert padded_positions[1][mask[1].bool()].tolist() == [0, 1]
    assert padded_positions[0][mask[0].bool()].tolist() == [0, 1, 2, 3, 4]


class PositionsReadOneRowAtATime(torch.nn.Module):
    """transformers' flash-attention 2 path: packed position_ids mark sample boundaries only when the
    batch holds one row; with several rows the samples of a row attend to each other."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        if input_ids.shape[0] > 1:
            position_ids = None
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


def test_the_packing_check_runs_several_packed_rows_per_forward_even_on_a_tight_budget(tiny_model, tokenizer):
    """A budget of one packed row per forward used to let an attention that leaks only with several rows
    pass the check; RL's micro-batches hold several, so the check now does too."""
    rollout = synthetic_rollout(*random_batch(len(tokenizer), pad=tokenizer.pad_token_id))
    width = int(rollout.attention_mask.sum(1).max())
    assert packs_apart(tiny_model, rollout, tokenizer.pad_token_id, width, False)
    assert not packs_apart(PositionsReadOneRowAtATime(tiny_model), rollout, tokenizer.pad_token_id, width, False)


def test_flash_attention_pads_under_auto_and_is_refused_under_on(tiny_model, tokenizer, tmp_path, capsys):
    rollout = synthetic_rollout(*random_batch(len(tokenizer), pad=tokenizer.pad_token_id))
    saved = tiny_model.config._attn_implementation
    tiny_model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ConfigError, match=r"grpo.pack_rows=on with model.attn_implementation=flash_attention_2, "
                                              r"which keeps packed samples apart only one row at a time"):
            grpo_trainer(tiny_model, tokenizer, tmp_path / "on", pack_rows="on").packs(rollout)
        assert not grpo_trainer(tiny_model, tokenizer, tmp_path / "auto", pack_rows="auto").packs(rollout)
        assert "flash_attention_2 keeps packed samples apart only one row at a time" in capsys.readouterr().err
    finally:
        tiny_model.config._attn_implementation = saved
