"""Shared prefill (rollout/sampler.py): a group's G rows prefill their prompt once and copy its KV
cache. It must draw from the distribution the expanded batch draws from, give the same greedy
completions with left-padded prompts of different lengths, and keep hf_static's reported log-probs."""

import pytest
import torch

from grpokit.models.logprobs import token_logprobs
from grpokit.rollout import SamplingParams, sample_groups
from grpokit.rollout import sampler
from grpokit.rollout.hf_static import StaticCacheDecoder, StaticCacheEngine
from run_helpers import bucketed_tv

PROMPTS = ["Q: 1+2\n", "Q: 12+30-4+5-7\n"]  # different lengths: the first is left-padded


@pytest.fixture
def peaked_model(tiny_model):
    """The tiny Llama with every linear layer's weights scaled up: a random model at its initial scale
    attends almost uniformly and its next token barely depends on the prompt (0.001 in total variation
    between PROMPTS), so a cache copied to the wrong rows, or prefilled at shifted positions, would go
    unseen. Scaled, the two prompts' next tokens are 0.3 apart and a one-position shift moves them 0.25."""
    with torch.no_grad():
        for module in tiny_model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(8.0)
        tiny_model.lm_head.weight.mul_(2.0)
    return tiny_model


@pytest.fixture
def shared_calls(monkeypatch):
    """How many `generate` calls continued from a shared prefix cache (a list, appended to)."""
    calls, real = [], sampler.shared_prefix_cache

    def spy(model, ids, mask):
        out = real(model, ids, mask)
        if out:
            calls.append(ids.shape[0])
        return out

    monkeypatch.setattr(sampler, "shared_prefix_cache", spy)
    return calls


def _next_token_probs(model, tokenizer, prompt: str, temperature: float) -> torch.Tensor:
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return torch.softmax(model(ids).logits[0, -1].float() / temperature, -1)


def test_first_tokens_drawn_with_shared_prefill_follow_the_expanded_batchs_distribution(peaked_model, tokenizer,
                                                                                         shared_calls):
    """2,000 draws per prompt, both prompts in one left-padded batch: the frequencies of the first token
    match the next-token distribution of each prompt alone, which the expanded batch samples from."""
    draws, temperature = 2000, 0.9
    torch.manual_seed(0)
    ro = sample_groups(peaked_model, tokenizer, PROMPTS, draws,
                       SamplingParams(max_new_tokens=1, temperature=temperature, batch_size=4000,
                                      shared_prefill=True))
    assert shared_calls == [2 * draws]
    for i, prompt in enumerate(PROMPTS):
        p = _next_token_probs(peaked_model, tokenizer, prompt, temperature)
        drawn = ro.input_ids[i * draws : (i + 1) * draws, ro.prompt_length]
        freq = torch.bincount(drawn, minlength=p.numel()).float() / draws
        tv, bound = bucketed_tv(freq, p, draws)
        assert tv <= bound, f"prompt {i}: first tokens are {tv:.3f} in total variation from its distribution " \
                            f"(honest sampling stays under {bound:.3f})"


def test_greedy_completions_equal_the_expanded_batchs_with_left_padding(peaked_model, tokenizer, shared_calls):
    prompts = PROMPTS + ["Q: 7-1\n"]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, shared_prefill=True)
    shared = sample_groups(peaked_model, tokenizer, prompts, 3, params)
    assert shared_calls == [9]
    expanded = sample_groups(peaked_model, tokenizer, prompts, 3, SamplingParams(16, 0.0, shared_prefill=False))
    assert shared_calls == [9]  # switched off: no shared cache
    assert torch.equal(shared.input_ids, expanded.input_ids)
    assert torch.equal(shared.completion_mask, expanded.completion_mask)


def test_groups_split_across_generate_calls_still_share_within_each(peaked_model, tokenizer, shared_calls):
    """batch_size 5 with G 3: calls of 5 and 4 rows, a group across the boundary; rows are matched by content."""
    params = SamplingParams(max_new_tokens=8, temperature=0.0, batch_size=5, shared_prefill=True)
    shared = sample_groups(peaked_model, tokenizer, PROMPTS + ["Q: 7-1\n"], 3, params)
    assert shared_calls == [5, 4]
    expanded = sample_groups(peaked_model, tokenizer, PROMPTS + ["Q: 7-1\n"], 3,
                             SamplingParams(8, 0.0, batch_size=5, shared_prefill=False))
    assert torch.equal(shared.input_ids, expanded.input_ids)


def test_hf_static_reports_the_log_probs_of_the_tokens_drawn_with_shared_prefill(peaked_model, tokenizer,
                                                                                  shared_calls):
    engine = StaticCacheEngine(peaked_model, tokenizer, StaticCacheDecoder(static=False))
    torch.manual_seed(0)
    ro = engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=10, temperature=0.7, shared_prefill=True))
    assert shared_calls == [8]
    with torch.no_grad():
        logp, _ = token_logprobs(peaked_model, ro.input_ids, ro.attention_mask, ro.prompt_length, temperature=0.7)
    mask = ro.completion_mask.bool()
    assert torch.allclose(ro.sampling_logp[mask], logp.float()[mask], atol=1e-4, rtol=0)


def test_distinct_prompts_run_plain_generate(peaked_model, tokenizer, shared_calls):
    sample_groups(peaked_model, tokenizer, PROMPTS, 1, SamplingParams(max_new_tokens=4, temperature=0.0, shared_prefill=True))
    assert shared_calls == []
