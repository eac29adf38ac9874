"""Evaluation metrics, the plot, and checkpoints."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpokit.checkpoint import save_checkpoint
from grpokit.data import arithmetic
from grpokit.eval import evaluate, pass_at_k
from grpokit.eval.evaluate import majority_answer
from grpokit.eval.plots import plot_reward_curve


@pytest.mark.parametrize("n, c, k, expected", [(8, 0, 8, 0.0), (8, 1, 8, 1.0), (8, 8, 1, 1.0),
                                                (4, 2, 1, 0.5), (4, 1, 2, 0.5), (5, 2, 2, 0.7)])
def test_pass_at_k_hand_values(n, c, k, expected):
    # (5, 2, 2): 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 2)


def test_majority_answer():
    assert majority_answer(["3", None, "4", "3"]) == "3"
    assert majority_answer(["4", "3"]) == "4"  # tie: first seen
    assert majority_answer([None, None]) is None


def test_evaluate_on_a_real_tiny_model(tiny_model, tokenizer, chain_rows):
    rows = chain_rows[:6]
    torch.manual_seed(0)
    result = evaluate(tiny_model, tokenizer, rows, arithmetic.extract_answer, max_new_tokens=8, k=3)
    assert result.num_questions == 6 and result.k == 3 and len(result.greedy_completions) == 6
    assert 0.0 <= result.greedy_accuracy <= 1.0 and 0.0 <= result.maj_at_k <= result.pass_at_k <= 1.0
    assert "greedy_completions" not in result.as_dict()
    # An oracle "model output" would be scored correct: check the scoring path with known answers.
    assert arithmetic.extract_answer(rows[0]["solution"]) == rows[0]["answer"]


def test_plot_writes_a_png(tmp_path):
    metrics = [{"step": i, "reward/mean": i / 10, "kl": i / 100, "completion/mean_length": 20 + i} for i in range(1, 11)]
    out = plot_reward_curve(metrics, tmp_path / "curve.png", baseline=0.3, final=0.8)
    assert out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no metrics"):
        plot_reward_curve([], tmp_path / "empty.png")


def test_checkpoint_overwrite_is_atomic_and_loadable(tiny_model, tokenizer, tmp_path):
    path = tmp_path / "ckpt"
    save_checkpoint(tiny_model, tokenizer, path)
    with torch.no_grad():
        next(tiny_model.parameters()).add_(1.0)
    save_checkpoint(tiny_model, tokenizer, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .tmp / .old left behind
    loaded = AutoModelForCausalLM.from_pretrained(path)
    torch.testing.assert_close(next(loaded.parameters()), next(tiny_model.parameters()))
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
