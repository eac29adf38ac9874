"""Evaluation metrics, the plot, and checkpoints."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpokit.run.checkpoint import save_checkpoint
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


# --- tool-integrated reasoning on the built-in task ---------------------------------------------


def test_evaluate_tir_runs_each_program_and_grades_the_answer_line(scripted_engine):
    from grpokit.config import Config
    from grpokit.eval.evaluate import evaluate_tir
    from grpokit.tools.python import OUTPUT_STOP
    from grpokit.models import build_char_tokenizer
    from grpokit.tasks.chain import ChainTask

    tokenizer = build_char_tokenizer(arithmetic.TIR_ALPHABET)
    task = ChainTask(Config())
    rows = task.tir_rows(arithmetic.make_rows(["7+5-3+9", "3-5", "9+9", "4+4"]), tokenizer)
    assert rows[0]["prompt"] == "Q: 7+5-3+9 (with python)\n" and rows[0]["answer"] == "18"

    def reply(context: str) -> str:
        question = context.split("Q: ", 1)[1].split(" (with", 1)[0]
        if context.endswith("```\n"):  # after the tool output: state it, wrongly for 9+9
            shown = context.rsplit("```output\n", 1)[1].split("\n", 1)[0]
            return f"A: {int(shown) + (question == '9+9')}"
        if question == "4+4":  # no program: answers directly, rightly
            return "A: 8"
        wrong = question.replace("3-5", "3-6")  # miscopies the question into its program
        return f"```python\nprint({wrong})\n```\n{OUTPUT_STOP}"

    engine = scripted_engine(tokenizer, reply)
    # max_new_tokens bounds the whole completion, tool output included (48 tokens for the first)
    result = evaluate_tir(engine, tokenizer, rows, task.tir_answer, max_new_tokens=64, max_model_len=2048)
    # 7+5-3+9 right (18); 3-5 run as 3-6 (-3, wrong); 9+9 stated 19 (wrong); 4+4 right with no program.
    assert result.greedy_accuracy == 0.5 and result.num_questions == 4
    assert result.programs == 3 and result.stop_reasons == {"answer": 4}
    assert result.completions[0] == "```python\nprint(7+5-3+9)\n```\n```output\n18\n```\nA: 18"
    assert all(params.stop == (OUTPUT_STOP,) and params.temperature == 0 for params in engine.params)
    assert result.seconds >= result.generate_seconds + result.tool_seconds > 0
    # Cut at its tool-call limit, a rollout's answer is the last program output.
    cut = evaluate_tir(engine, tokenizer, rows[:1], task.tir_answer, 64, 2048, max_tool_calls=1)
    assert cut.greedy_accuracy == 1.0 and cut.stop_reasons == {"tool_limit": 1}
    assert cut.completions[0].endswith("```output\n18\n```\n")


def test_tir_answer_prefers_the_answer_line_then_the_last_output(capsys):
    from grpokit.config import Config
    from grpokit.models import build_char_tokenizer
    from grpokit.tasks.chain import ChainTask

    task = ChainTask(Config())
    assert task.tir_answer("```python\nprint(1)\n```\n```output\n1\n```\nA: 2") == "2"
    assert task.tir_answer("```python\nprint(1)\n```\n```output\n1\n```\n") == "1"
    assert task.tir_answer("no answer") is None
    # A tokenizer that cannot write a program: no TIR rows, said once.
    plain = build_char_tokenizer(arithmetic.ALPHABET)
    rows = arithmetic.make_rows(["1+2"])
    assert task.tir_rows(rows, plain) is None and task.tir_rows(rows, plain) is None
    assert capsys.readouterr().err.count("no TIR evaluation") == 1


def test_chain_task_adds_tir_demonstrations_after_the_unchanged_cot_ones():
    from grpokit.config import Config
    from grpokit.tasks.chain import ChainTask

    config = Config()
    config.task.num_sft_examples, config.task.num_sft_tir_examples = 40, 10
    with_tir = ChainTask(config).data(sft=True).sft
    config.task.num_sft_tir_examples = 0
    without = ChainTask(config).data(sft=True).sft
    assert with_tir[:40] == without and len(with_tir) == 50
    assert all(r["prompt"].endswith("(with python)\n") and r["completion"].startswith("```python\n")
               for r in with_tir[40:])
    cot_questions = {r["prompt"].split()[1] for r in with_tir[:40]}
    assert not cot_questions & {r["prompt"].split()[1] for r in with_tir[40:]}  # other questions


def test_k_zero_evaluates_greedy_only():
    """eval.k = 0: one greedy pass, no samples drawn; pass@k and maj@k are NaN and the headline omits them."""
    import math

    from grpokit.eval.evaluate import evaluate

    class Engine:
        calls = []

        def generate(self, prompts, k, params):
            self.calls.append((len(prompts), k, params.temperature))
            return type("Out", (), {"completions": [p.upper() for p in prompts for _ in range(k)]})()

    engine = Engine()
    rows = [{"prompt": "a", "answer": "A"}, {"prompt": "b", "answer": "c"}]
    result = evaluate(None, None, rows, lambda c: c, 8, k=0, engine=engine)
    assert engine.calls == [(2, 1, 0.0)]  # the greedy pass alone
    assert result.greedy_accuracy == 0.5 and result.k == 0
    assert math.isnan(result.pass_at_k) and math.isnan(result.maj_at_k)
    assert result.headline() == "greedy accuracy 50.0%"
