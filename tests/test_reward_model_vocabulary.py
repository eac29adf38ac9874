"""A likelihood PRM reloads what it trained: on a backbone whose embedding is padded past its tokenizer
(as Qwen's and DeepSeekMath's are), `load_reward_model` masks the extra rows as building the PRM did
(models/vocabulary.py), so the reloaded scorer's step log-prob sums and scores are the trained one's."""

from __future__ import annotations

import torch

from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.models.loading import load_model_and_tokenizer
from grpokit.pipeline.build import ASCII_ALPHABET
from grpokit.rewards.learned import load_reward_model, save_reward_model
from grpokit.rewards.likelihood_prm import LikelihoodProcessRewardModel
from grpokit.rewards.scorers import as_scorer, scorer_info

PADDED_ROWS = 7


def _padded_backbone(folder) -> str:
    """A tiny causal LM with PADDED_ROWS embedding rows past its tokenizer, those rows' logits large."""
    tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=3)
    model.resize_token_embeddings(len(tokenizer) + PADDED_ROWS, mean_resizing=False)
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight[len(tokenizer):] = weight[: len(tokenizer)].mean(0) * 4
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_a_likelihood_prm_on_a_padded_backbone_scores_the_same_after_save_and_load(tmp_path):
    model, tokenizer = load_model_and_tokenizer(_padded_backbone(tmp_path / "backbone"), dtype="fp32", device="cpu")
    assert model.get_output_embeddings().weight.shape[0] == len(tokenizer) + PADDED_ROWS
    scorer = LikelihoodProcessRewardModel(model.eval(), tokenizer, "\n")
    prompts = [f"Q: {a}+{b}\n" for a in range(4) for b in range(4)]
    steps = [[f"{a + b}\n", f"A: {a + b}"] if (a + b) % 3 else [f"{a * b}\n", "A: 0"] for a in range(4) for b in range(4)]
    labels = [[(a + b) % 3 != 0] * 2 for a in range(4) for b in range(4)]
    scorer.fit(prompts, steps, labels)  # trains its a and b
    save_reward_model(scorer.model, tokenizer, scorer_info(scorer, "\n"), tmp_path / "rm")
    again = as_scorer(*load_reward_model(tmp_path / "rm", device="cpu", dtype="fp32"))
    trained, reloaded = scorer.step_log_prob_sums(prompts, steps), again.step_log_prob_sums(prompts, steps)
    for a, b in zip(trained, reloaded, strict=True):  # before the fix the reload counted the padded rows' mass
        assert torch.allclose(a, b, atol=1e-5), f"reloaded step log-prob sums {b.tolist()} != trained {a.tolist()}"
    completions = ["".join(s) for s in steps]
    assert [s.rewards for s in again.score_steps(prompts, completions)] == \
        [s.rewards for s in scorer.score_steps(prompts, completions)]
