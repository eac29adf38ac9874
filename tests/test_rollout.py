"""Rollouts on a real tiny Llama: group layout, masks, truncation, log-prob consistency."""

import torch

from grpokit.rollout import (
    SamplingParams,
    position_ids_for,
    sample_groups,
    token_logprobs,
)
from grpokit.rollout.sampler import completion_mask_and_truncation


def test_completion_mask_through_first_eos_and_truncation():
    eos = 1
    ids = torch.tensor([[5, 6, 1, 0, 0], [5, 1, 1, 7, 0], [5, 6, 7, 8, 9]])
    mask, truncated = completion_mask_and_truncation(ids, [eos])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]


def test_groups_are_contiguous_and_prompts_left_padded(tiny_model, tokenizer):
    prompts = ["Q: 1+2\n", "Q: 10+20-3\n", "Q: 7-1\n"]
    g = 4
    torch.manual_seed(0)
    ro = sample_groups(tiny_model, tokenizer, prompts, g, SamplingParams(max_new_tokens=12), rows=[{"i": i} for i in range(3)])
    assert ro.num_samples == 12
    assert ro.prompts == [p for p in prompts for _ in range(g)]
    assert [r["i"] for r in ro.rows] == [0] * 4 + [1] * 4 + [2] * 4
    widths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    assert ro.prompt_length == max(widths)
    for row, w in enumerate(widths[i] for i in range(3) for _ in range(g)):
        pad = ro.prompt_length - w
        assert ro.attention_mask[row, :pad].sum() == 0 and ro.attention_mask[row, pad : ro.prompt_length].all()
        assert (ro.input_ids[row, :pad] == tokenizer.pad_token_id).all()
    # The completion mask is the attention mask's completion part; text decodes the masked tokens.
    assert torch.equal(ro.attention_mask[:, ro.prompt_length :], ro.completion_mask)
    for ids, m, text, trunc in zip(ro.completion_ids, ro.completion_mask, ro.completions, ro.truncated):
        kept = ids[m.bool()]
        assert tokenizer.decode(kept, skip_special_tokens=True) == text
        assert bool(trunc) == (tokenizer.eos_token_id not in kept.tolist())
        if trunc:
            assert int(m.sum()) == 12


def test_untrained_model_truncates_at_max_new_tokens(tiny_model, tokenizer):
    torch.manual_seed(1)
    ro = sample_groups(tiny_model, tokenizer, ["Q: 1+2\n"], 8, SamplingParams(max_new_tokens=5, temperature=1.0))
    assert ro.completion_ids.shape[1] <= 5
    assert ro.truncated.any()  # a random model rarely emits EOS within 5 tokens


def test_logprobs_match_generate_scores_with_left_padding(tiny_model, tokenizer):
    """Recomputed log-probs equal those `generate` sampled from, padding and all."""
    prompts = ["Q: 1+2\n", "Q: 12+30-4+5\n"]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    out = tiny_model.generate(**enc, do_sample=True, max_new_tokens=6, temperature=0.7, top_k=None, top_p=None,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=None)
    p = enc["input_ids"].shape[1]
    ids = out.sequences
    mask = torch.cat([enc["attention_mask"], torch.ones(2, ids.shape[1] - p, dtype=torch.long)], dim=1)
    logits = torch.stack(out.logits, dim=1) / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, p:, None]).squeeze(-1)
    got, _ = token_logprobs(tiny_model, ids, mask, p, temperature=0.7, micro_batch_size=1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_logprobs_do_not_depend_on_micro_batch_size(tiny_model, tokenizer):
    torch.manual_seed(0)
    ro = sample_groups(tiny_model, tokenizer, ["Q: 1+2\n", "Q: 3+4+5\n"], 3, SamplingParams(max_new_tokens=8))
    a, ea = token_logprobs(tiny_model, ro.input_ids, ro.attention_mask, ro.prompt_length, 1.0, 1, with_entropy=True)
    b, eb = token_logprobs(tiny_model, ro.input_ids, ro.attention_mask, ro.prompt_length, 1.0, 64, with_entropy=True)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ea, eb, atol=1e-5, rtol=1e-5)
    assert (ea >= 0).all() and (ea <= torch.log(torch.tensor(float(len(tokenizer))))).all()


def test_position_ids_ignore_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_for(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_greedy_is_deterministic(tiny_model, tokenizer):
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    a = sample_groups(tiny_model, tokenizer, ["Q: 5+5\n"], 2, params)
    b = sample_groups(tiny_model, tokenizer, ["Q: 5+5\n"], 2, params)
    assert a.completions[0] == a.completions[1] == b.completions[0]


def test_sampling_draws_from_the_whole_vocabulary():
    """The trainer's log-probs are over the whole vocabulary, so sampling must be too: transformers'
    generate would otherwise keep only its default top 50 tokens. A model with nearly equal (but
    distinct, so a top-50 cut has no ties to keep) logits over 99 tokens, 400 draws of one token:
    about 98 distinct ones, and at most 50 with the cut."""
    from grpokit.pipeline.build import ASCII_ALPHABET
    from grpokit.models import build_tiny_model
    from grpokit.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    model = build_tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, seed=0)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 1e-3)  # logits within about 0.01 of each other
    torch.manual_seed(0)
    ro = sample_groups(model, tokenizer, ["Q"], 400, SamplingParams(max_new_tokens=1, temperature=1.0, top_p=1.0))
    assert len(tokenizer) > 90
    assert len(set(ro.completion_ids[:, 0].tolist())) > 80
