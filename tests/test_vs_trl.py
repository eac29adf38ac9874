"""benchmarks/vs_trl.py's pieces for a real checkpoint against TRL: the questions and their answers,
the reward as TRL calls it on conversations, the reference-log-prob timer, and the step-time table.
No model and no TRL: the benchmark itself runs by hand (BENCHMARKS.md)."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


vs_trl = _load("vs_trl", REPO / "benchmarks" / "vs_trl.py")


def test_arithmetic_questions_carry_their_answers():
    rows = vs_trl.arithmetic_questions(200, seed=3)
    assert rows == vs_trl.arithmetic_questions(200, seed=3)  # seeded
    assert {r["question"].split()[3] for r in rows} == {"+", "-"}
    for row in rows:
        a, op, b = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", row["question"]).groups()
        assert 2 <= int(a) <= 60 and 2 <= int(b) <= 60
        assert row["answer"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))


def test_reward_sees_the_assistant_text_of_trls_conversations():
    seen = []

    def exact(prompts, completions, answer, **_):
        seen.append(completions)
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    wrapped = vs_trl.on_completion_text(exact)
    conversations = [[{"role": "assistant", "content": "7"}], [{"role": "assistant", "content": "8"}]]
    assert wrapped(["q", "q"], conversations, answer=["7", "9"]) == [1.0, 0.0]
    assert seen == [["7", "8"]]
    assert wrapped(["q"], ["9"], answer=["9"]) == [1.0]  # plain-text completions pass through
    assert wrapped.__name__ == "exact"  # TRL logs rewards/<name>


def test_conversations_hold_the_instruction_grpokit_renders():
    rows = [{"question": "What is 2 + 3?", "answer": "5", "prompt": "rendered"}]
    (row,) = vs_trl.as_conversations(rows)
    assert row["answer"] == "5"
    assert row["prompt"] == [{"role": "user", "content": "What is 2 + 3?\nPlease reason step by step, and put your "
                                                         "final answer within \\boxed{}."}]


def test_only_calls_without_gradients_count_as_reference_log_probs():
    timer = vs_trl.Timer()
    calls = []
    timed = timer.wrap("ref_logp", lambda x: calls.append(x), only_without_grad=True)
    timed(1)  # with gradients: the policy's forward in the loss
    assert timer.seconds == {}
    with torch.no_grad():
        timed(2)
    assert calls == [1, 2] and set(timer.seconds) == {"ref_logp"}


def test_a_checkpoint_config_needs_no_sft_steps():
    assert vs_trl.parse_sft_steps("tiny=200", ["tiny", "smollm2"]) == {"tiny": 200}
    with pytest.raises(SystemExit, match="small"):
        vs_trl.parse_sft_steps("tiny=200", ["tiny", "small"])


def test_the_table_splits_out_the_reference_log_probs():
    def trainer(step, ref):
        return {"median_step_s": step, "median_generate_s": 4.0, "median_score_ref_s": 3.0,
                "median_ref_logp_s": ref, "median_update_s": step - 7.0, "mean_completion_length": 60.0,
                "max_completion_length": 64.0, "reward_last20": 0.25, "ratio": step / 20.0,
                "ratio_per_pair": [step / 20.0]}

    result = {"config": "smollm2", "parameters": 134_515_008, "prompts": 4, "generations": 4, "max_new_tokens": 64,
              "frameworks": ["trl", "grpokit"], "trl": trainer(20.0, 2.5), "grpokit": trainer(16.0, 2.0)}
    text = vs_trl.table([result])
    assert "| smollm2 | 134.52M | 4 x 4, 64 | grpokit+hf | 16.000 | **0.80** (0.80) | 0.250 |" in text
    # step 16 s: generate 4 (25%), score+ref 3 (19%), of which ref 2 (12%), update 9 (56%)
    assert ("| smollm2 | grpokit+hf | 16.000 | 4.000 (25%) | 3.000 (19%) | 2.000 (12%) | 9.000 (56%) | 60.0, 64 |"
            in text)
