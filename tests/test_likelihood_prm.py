"""reward_model.model.head: likelihood: step logits a * running sum of the frozen LM's step
log-probabilities + b, worked by hand from one forward pass; the fit of a and b; save and load."""

from __future__ import annotations

import pytest
import torch

from grpokit.checks import load_config
from grpokit.config import ConfigError
from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.pipeline.build import ASCII_ALPHABET
from grpokit.rewards.learned import load_reward_model, save_reward_model
from grpokit.rewards.scorers import as_scorer, scorer_info
from grpokit.rewards.likelihood_prm import LikelihoodProcessRewardModel


@pytest.fixture
def lm():
    tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=3)
    return model.eval(), tokenizer


def test_step_logits_are_a_times_the_running_sum_of_step_log_probs_plus_b(lm):
    model, tokenizer = lm
    scorer = LikelihoodProcessRewardModel(model, tokenizer, "\n", weight=2.0, bias=-1.0)
    prompt, steps = "Q: 1+2\n", ["3\n", "A: 3"]  # one character a token
    ids = tokenizer(prompt + "".join(steps), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    token = [float(log_probs[k - 1, ids[k]]) for k in range(len(ids))]  # token k is predicted at k - 1
    p = len(prompt)  # 7 prompt tokens; step 1 is tokens 7-8 ("3\n"), step 2 tokens 9-12 ("A: 3")
    step1, step2 = sum(token[p : p + 2]), sum(token[p + 2 : p + 6])
    sums = scorer.step_log_prob_sums([prompt], [steps])[0]
    assert torch.allclose(sums, torch.tensor([step1, step1 + step2]), atol=1e-5)
    logits = scorer.step_logits([prompt], [steps])[0]
    assert torch.allclose(logits, torch.tensor([2 * step1 - 1, 2 * (step1 + step2) - 1]), atol=1e-5)
    scores = scorer.score_steps([prompt], ["3\nA: 3"])[0]
    assert scores.char_ends == [2, 6] and scores.has_delimiter
    assert scores.rewards == pytest.approx(torch.sigmoid(logits).tolist(), abs=1e-6)


def test_the_fit_moves_only_a_and_b_and_separates_what_the_sums_separate(lm):
    model, tokenizer = lm
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scorer = LikelihoodProcessRewardModel(model, tokenizer, "\n")
    prompts = [f"Q: {a}+{b}\n" for a in range(6) for b in range(6)]
    steps = [[f"{(a * 7 + b) % 10}\n", "A: 1"] for a in range(6) for b in range(6)]
    sums = [s.tolist() for s in scorer.step_log_prob_sums(prompts, steps)]
    cut = sorted(v for row in sums for v in row)[len(prompts)]  # labels: a running sum above this cut is right
    labels = [[v > cut for v in row] for row in sums]
    loss = scorer.fit(prompts, steps, labels)
    assert loss < 0.25 and scorer.weight > 0  # a higher likelihood means right
    predicted = [[float(v) > 0 for v in row] for row in scorer.step_logits(prompts, steps)]
    agree = sum(p == y for pr, yr in zip(predicted, labels) for p, y in zip(pr, yr)) / (2 * len(prompts))
    assert agree >= 0.95
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the LM stays frozen


def test_it_saves_and_loads_with_its_a_and_b(lm, tmp_path):
    model, tokenizer = lm
    scorer = LikelihoodProcessRewardModel(model, tokenizer, "\n\n", weight=0.5, bias=1.5)
    save_reward_model(scorer.model, tokenizer, scorer_info(scorer, "\n\n"), tmp_path / "rm")
    loaded, loaded_tokenizer, info = load_reward_model(tmp_path / "rm", device="cpu", dtype="fp32")
    assert (info.kind, info.head, info.step_delimiter, info.weight, info.bias) == ("process", "likelihood", "\n\n",
                                                                                 0.5, 1.5)
    again = as_scorer(loaded, loaded_tokenizer, info)
    assert isinstance(again, LikelihoodProcessRewardModel)
    a = scorer.step_logits(["Q: 9-4\n"], [["5\n\n", "A: 5"]])[0]
    b = again.step_logits(["Q: 9-4\n"], [["5\n\n", "A: 5"]])[0]
    assert torch.allclose(a, b, atol=1e-6)


def test_a_likelihood_head_needs_a_process_reward_model():
    with pytest.raises(ConfigError, match="head=likelihood scores steps: it needs reward_model.kind=process"):
        load_config(overrides=["--reward_model.kind=outcome", "--reward_model.model.head=likelihood"])
    load_config(overrides=["--reward_model.kind=process", "--reward_model.model.head=likelihood"])


def test_a_lora_policys_verifier_saves_and_reloads_as_a_whole_model(lm, tmp_path):
    """With model.lora.r > 0 the frozen LM is pi_SFT with its adapters merged: a full causal LM on disk
    (config.json and every weight), whose reloaded step sums equal the adapted policy's."""
    from grpokit.config.schema import LoraConfig
    from grpokit.models.lora import apply_lora, merged_copy

    model, tokenizer = lm
    policy = apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)  # adapters that change the function
    verifier = merged_copy(policy)
    assert not hasattr(verifier, "peft_config") and hasattr(policy, "peft_config")
    scorer = LikelihoodProcessRewardModel(verifier, tokenizer, "\n", weight=1.5, bias=0.5)
    prompts, steps = ["Q: 1+2\n"], [["3\n", "A: 3"]]
    adapted = LikelihoodProcessRewardModel(policy, tokenizer, "\n").step_log_prob_sums(prompts, steps)[0]
    assert torch.allclose(scorer.step_log_prob_sums(prompts, steps)[0], adapted, atol=1e-5)
    save_reward_model(verifier, tokenizer, scorer_info(scorer, "\n"), tmp_path / "rm")
    assert (tmp_path / "rm" / "config.json").is_file() and not (tmp_path / "rm" / "adapter_config.json").exists()
    loaded = as_scorer(*load_reward_model(tmp_path / "rm", device="cpu", dtype="fp32"))
    assert (loaded.weight, loaded.bias) == (1.5, 0.5)
    assert torch.allclose(loaded.step_log_prob_sums(prompts, steps)[0], adapted, atol=1e-5)


def test_a_fit_on_one_step_is_refused_in_one_line_and_labels_all_alike_fit_finitely(lm):
    import math

    from grpokit.rewards.likelihood_prm import LikelihoodFitError

    model, tokenizer = lm
    scorer = LikelihoodProcessRewardModel(model, tokenizer, "\n")
    with pytest.raises(LikelihoodFitError, match=r"cannot be fit on 1 labelled step\(s\).*sample more reward-model "
                                                 r"data \(reward_model.data.num_questions\)"):
        scorer.fit(["Q: 1+2\n"], [["3"]], [[True]])  # one step: a NaN a and b before
    assert (scorer.weight, scorer.bias) == (1.0, 0.0)
    scorer.fit(["Q: 1+2\n", "Q: 2+2\n"], [["3\n", "A: 3"], ["5\n", "A: 5"]], [[False, False], [False, False]])
    assert math.isfinite(scorer.weight) and math.isfinite(scorer.bias) and scorer.bias < 0


@pytest.mark.parametrize("overrides, message", [
    (["--reward_model.model.init=tiny"], r"init=tiny would leave random and frozen: set reward_model.model.init to "
                                         r"policy or checkpoint"),
    (["--reward_model.train.max_steps=10"], r"reward_model.train.max_steps=10 is not used by "
                                            r"reward_model.model.head=likelihood"),
    (["--reward_model.train.balance_step_labels=true"], r"reward_model.train.balance_step_labels=True is not used"),
    (["--reward_model.train.learning_rate=1e-3"], r"reward_model.train.learning_rate=0.001 is not used"),
])
def test_a_likelihood_head_refuses_what_it_would_ignore(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=["--reward_model.kind=process", "--reward_model.model.head=likelihood", *overrides])
