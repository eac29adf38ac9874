"""Process rewards (rule-based step scores, eq. 6): chain_steps and gsm8k_steps step by step, each
token's advantage worked by hand, refused step ends, a user's own process reward from a file, and
`rewards: [{name: chain_steps}]` training the demo end to end."""

import json
import math
import re
import textwrap
from pathlib import Path

import pytest
import torch

from grpokit.checks import load_config
from grpokit.data.answers import gsm8k_reference
from grpokit.errors import ConfigError
from grpokit.math import process_advantages
from grpokit.math.registry import process_advantage
from grpokit.run.metrics import read_metrics
from grpokit.rewards import WeightedReward, score_completions
from grpokit.rewards.chain_steps import chain_steps
from grpokit.rewards.gsm8k_steps import annotation_is_exact, gsm8k_steps
from grpokit.rewards.learned import policy_step_ends
from grpokit.rewards.process import StepScores, is_process_reward, process_reward
from grpokit.rewards.registry import get_reward_function
from grpokit.train.grpo import process_metrics, step_advantages
from run_helpers import RUN, cli

FIXTURES = Path(__file__).parent / "fixtures"
EPS = 1e-4


# --------------------------------------------------------------------------- chain_steps, step by step

def chain(completions, question="7+5-3+9", answer="18"):
    n = len(completions)
    return chain_steps([f"Q: {question}\n"] * n, completions, question=[question] * n, answer=[answer] * n)


def test_chain_steps_scores_each_line_right_until_the_first_wrong_one():
    # 7+5-3+9: 12-3+9, 9+9, A: 18.
    right, slip, late_slip, direct, wrong_direct, after_answer = chain([
        "12-3+9\n9+9\nA: 18",  # every step right
        "12-3+9\n9+8\nA: 17",  # 9+8 copies 9 wrong: that step and every later one score 0
        "12-3+9\n9+9\nA: 17",  # only the answer line is wrong
        "A: 18",  # a direct answer: one step, no delimiter
        "A: 19",
        "12-3+9\n9+9\nA: 18\n5",  # a line after the answer is wrong
    ])
    assert right == StepScores([1.0, 1.0, 1.0], [7, 11, 16], True)
    assert slip == StepScores([1.0, 0.0, 0.0], [7, 11, 16], True)
    assert late_slip == StepScores([1.0, 1.0, 0.0], [7, 11, 16], True)
    assert direct == StepScores([1.0], [5], False)
    assert wrong_direct == StepScores([0.0], [5], False)
    assert after_answer == StepScores([1.0, 1.0, 1.0, 0.0], [7, 11, 17, 18], True)


def test_chain_steps_gives_an_empty_completion_one_wrong_step():
    assert chain([""]) == [StepScores([0.0], [0], False)]


# --------------------------------------------------------------------------- gsm8k_steps, step by step

NATALIA = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
           "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
           "#### 72")


def gsm(completions, answer="72"):
    return gsm8k_steps(["q"] * len(completions), completions, answer=[answer] * len(completions))


def test_gsm8k_steps_scores_each_line_by_its_annotations_and_the_answer():
    line1, line2 = NATALIA.split("\n")[:2]
    right, wrong_calc, wrong_answer, no_answer, text_line, one_line = gsm([
        NATALIA,
        NATALIA.replace("<<48+24=72>>", "<<48+24=73>>"),  # the second annotation is not exact
        NATALIA.replace("#### 72", "#### 73"),
        f"{line1}\n{line2}",  # no "####": the last step does not state the answer
        f"First, halve April's sales.\n{NATALIA}",  # a line without annotations is not checked
        "<<48+24=72>>72 #### 72",  # one step, both an annotation and the answer
    ])
    ends = [len(line1) + 1, len(line1) + len(line2) + 2, len(NATALIA)]
    assert right == StepScores([1.0, 1.0, 1.0], ends, True)
    assert wrong_calc == StepScores([1.0, 0.0, 0.0], ends, True)
    assert wrong_answer == StepScores([1.0, 1.0, 0.0], ends, True)
    assert no_answer == StepScores([1.0, 0.0], [ends[0], ends[1] - 1], True)  # no newline after line 2
    assert text_line.rewards == [1.0, 1.0, 1.0, 1.0]
    assert one_line == StepScores([1.0], [22], False)


def test_gsm8k_steps_reads_the_reference_answer_and_lines_after_it():
    # the reference as GSM8K's answer field, commas in the stated answer; a line after the answer is wrong
    assert gsm(["2*600=<<2*600=1200>>1200\n#### 1,200"], answer="x\n#### 1200")[0].rewards == [1.0, 1.0]
    assert gsm([f"{NATALIA}\nDone."])[0].rewards == [1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("annotation, exact", [
    ("48/2=24", True), ("9/2=4.5", True), ("50/100*266=133", True), ("(3+4)*2=14", True), ("-2+5=3", True),
    ("1,200-200=1000", True), (".5*4=2", True), ("10/3=3.33", False), ("48/2=25", False), ("5/0=1", False),
    ("2**3=8", False), ("x+1=2", False), ("48/2", False), ("__import__('os')=0", False),
])
def test_an_annotation_is_exact_only_when_its_arithmetic_equals_its_result(annotation, exact):
    assert annotation_is_exact(annotation) is exact


def test_real_gsm8k_solutions_score_right_on_every_step_and_a_slip_is_caught_where_it_is():
    rows = [json.loads(line) for name in ("gsm8k_train_sample.jsonl", "gsm8k_test_sample.jsonl")
            for line in (FIXTURES / name).open()]
    scores = gsm8k_steps(None, [r["answer"] for r in rows], answer=[gsm8k_reference(r["answer"]) for r in rows])
    assert all(s.rewards == [1.0] * len(s.rewards) for s in scores)
    assert all(s.char_ends[-1] == len(r["answer"]) for s, r in zip(scores, rows))
    # Daniel's games: the second line's annotation 346-80=266 made wrong by one
    first = rows[0]["answer"]
    slipped = first.replace("<<346-80=266>>", "<<346-80=267>>")
    assert gsm8k_steps(None, [slipped], answer=[gsm8k_reference(first)])[0].rewards[:3] == [1.0, 0.0, 0.0]


# --------------------------------------------------------------------------- eq. 6 on rule scores, by hand

def char_ids(tokenizer, completion):
    """The completion's tokens as the policy samples them: one per character, then EOS."""
    return tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def test_each_tokens_advantage_through_eq6_from_chain_steps(tokenizer):
    """G = 2 on "5+3-2" (steps 8-2, A: 6). o1 = "8-3\\nA: 5" slips at its first step: scores [0, 0],
    steps end at characters 4 and 8, so at tokens 3 and 8 (its EOS). o2 = "A: 6" answers directly:
    one step, score [1], ending at its EOS (token 4).
    R = {0, 0, 1}: mean 1/3, unbiased std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3).
    r~(0) = -(1/3) / (sqrt(1/3) + 1e-4),  r~(1) = (2/3) / (sqrt(1/3) + 1e-4).
    o1's tokens 0-3 carry both steps: 2 r~(0); tokens 4-8 the answer step: r~(0). o2's 5 tokens: r~(1)."""
    completions = ["8-3\nA: 5", "A: 6"]
    scores = chain_steps(["Q: 5+3-2\n"] * 2, completions, question=["5+3-2"] * 2, answer=["6"] * 2)
    assert scores == [StepScores([0.0, 0.0], [4, 8], True), StepScores([1.0], [4], False)]
    ids = [char_ids(tokenizer, c) for c in completions]
    ends = [policy_step_ends(tokenizer, i, s.char_ends) for i, s in zip(ids, scores)]
    assert ends == [[3, 8], [4]]
    rewards = [torch.tensor(s.rewards, dtype=torch.float64) for s in scores]
    adv = process_advantages(rewards, ends, [9, 5], group_size=2)
    std = math.sqrt(1 / 3)
    low, high = -(1 / 3) / (std + EPS), (2 / 3) / (std + EPS)
    expected = torch.tensor([[2 * low] * 4 + [low] * 5, [high] * 5 + [0.0] * 4], dtype=torch.float64)
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)
    assert low == pytest.approx(-0.577250, abs=1e-6) and high == pytest.approx(1.154500, abs=1e-6)

    # the trainer's path (float32): character ends mapped onto the sampled tokens, then eq. 6
    padded = torch.tensor([ids[0], ids[1] + [tokenizer.pad_token_id] * 4])
    token_adv = step_advantages(tokenizer, padded, torch.tensor([9, 5]), scores, 2)
    torch.testing.assert_close(token_adv, expected.float())
    assert process_metrics(type("R", (), {"step_scores": scores})())["process/no_delimiter"] == 1


def test_each_tokens_advantage_through_eq6_from_gsm8k_steps():
    """G = 2 GSM8K-style completions of 22 tokens each (21 characters, then EOS), two steps, the first ending
    at character 15 (token 14). o1 is right: [1, 1]; o2's annotation 2*3=7 is not exact: [0, 0].
    R = {1, 1, 0, 0}: mean 1/2, unbiased std sqrt(1/3); h = (1/2) / (sqrt(1/3) + 1e-4).
    o1: tokens 0-14 carry both steps, 2h; tokens 15-21 the answer step, h. o2: -2h and -h."""
    from grpokit.pipeline.build import ASCII_ALPHABET
    from grpokit.models import build_char_tokenizer

    tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    completions = ["2*3=<<2*3=6>>6\n#### 6", "2*3=<<2*3=7>>7\n#### 7"]
    scores = gsm8k_steps(["q"] * 2, completions, answer=["6"] * 2)
    assert scores == [StepScores([1.0, 1.0], [15, 21], True), StepScores([0.0, 0.0], [15, 21], True)]
    ids = torch.tensor([char_ids(tokenizer, c) for c in completions])
    h = 0.5 / (math.sqrt(1 / 3) + EPS)
    expected = torch.tensor([[2 * h] * 15 + [h] * 7, [-2 * h] * 15 + [-h] * 7], dtype=torch.float64)
    ends = [policy_step_ends(tokenizer, row.tolist(), s.char_ends) for row, s in zip(ids, scores)]
    assert ends == [[14, 21], [14, 21]]
    adv = process_advantages([torch.tensor(s.rewards, dtype=torch.float64) for s in scores], ends, [22, 22], 2)
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(step_advantages(tokenizer, ids, torch.tensor([22, 22]), scores, 2), expected.float())


# The variants on docs/algorithm.md's worked example: G = 2, 4 tokens, steps ending at tokens 1 and 3,
# step rewards [1, 1] and [1, 0]. R = {1, 1, 1, 0}: mean 0.75, unbiased std 0.5, so with c = 1 / (0.5 + 1e-4)
# a 1 normalises to 0.25 c (about +0.5) and the 0 to -0.75 c (about -1.5).
C = 1 / (0.5 + EPS)
ONE, ZERO = 0.25 * C, -0.75 * C
# process_outcome's outcome is the last step's reward, [1, 0]: eq. 5 with mean 0.5, std sqrt(0.5)
OUT = 0.5 / (math.sqrt(0.5) + EPS)
VARIANTS = {
    "grpo": [[2 * ONE, 2 * ONE, ONE, ONE], [ONE + ZERO, ONE + ZERO, ZERO, ZERO]],  # eq. 6: sum over later steps
    "step": [[ONE, ONE, ONE, ONE], [ONE, ONE, ZERO, ZERO]],  # the token's own step only
    "per_completion": [[ONE, ONE, ONE / 2, ONE / 2], [(ONE + ZERO) / 2, (ONE + ZERO) / 2, ZERO / 2, ZERO / 2]],
    "process_outcome": [[2 * ONE + OUT, 2 * ONE + OUT, ONE + OUT, ONE + OUT],
                        [ONE + ZERO - OUT, ONE + ZERO - OUT, ZERO - OUT, ZERO - OUT]],
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_process_advantage_variants_worked_by_hand(name):
    rewards = [torch.tensor([1.0, 1.0], dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64)]
    adv = process_advantage(name).function(rewards, [[1, 3], [1, 3]], [4, 4], 2)
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv, torch.tensor(VARIANTS[name], dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert VARIANTS["grpo"][0][0] == pytest.approx(1.0, abs=1e-3)  # the page's [1.0, 1.0, 0.5, 0.5]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_completion_without_steps_takes_no_part_and_gets_zero(name):
    """Its reward failed: the group's statistics are those of the others, as if it were not there."""
    rewards = [torch.tensor([1.0, 1.0], dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64),
               torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)]
    fn = process_advantage(name).function
    with_failed = fn(rewards, [[1, 3], [1, 3], [], []], [4, 4, 3, 4], 2)
    torch.testing.assert_close(with_failed[:2], fn(rewards[:2], [[1, 3], [1, 3]], [4, 4], 2))
    assert not with_failed[2:].any()


def test_step_variant_tokens_between_two_steps_ending_on_one_token():
    """Two steps mapped onto the same token: that token belongs to the first; the second has no tokens."""
    rewards = [torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64)]
    adv = process_advantage("step").function(rewards, [[1, 1, 2], [2]], [3, 3], 2)
    std = math.sqrt(1 / 3)  # R = {1, 0, 1, 0}: mean 0.5, unbiased std sqrt(1/3)
    hi, lo = 0.5 / (std + EPS), -0.5 / (std + EPS)
    torch.testing.assert_close(adv, torch.tensor([[hi, hi, hi], [lo, lo, lo]], dtype=torch.float64))


# --------------------------------------------------------------------------- refused step scores

def scripted(per_completion):
    @process_reward
    def steps(prompts, completions, **_):
        return per_completion
    return steps


@pytest.mark.parametrize("bad, why", [
    (StepScores([1.0, 0.0], [6, 3]), "must increase strictly"),  # not increasing
    (StepScores([1.0, 0.0], [3, 3]), "must increase strictly"),
    (StepScores([1.0], [99]), r"within \[1, 6\]"),  # past the completion
    (StepScores([1.0], [0]), r"within \[1, 6\]"),  # an empty first step
    (StepScores([1.0], [-1]), r"within \[1, 6\]"),
    (StepScores([1.0, 0.0], [6]), "2 step scores but 1 step ends"),
    (StepScores([], []), "no steps"),
    (StepScores([math.nan], [6]), "NaN"),
    (StepScores([1.0], [5.5]), "must be ints"),
    (0.5, "not StepScores"),
    (None, "returned None"),
])
def test_step_ends_out_of_order_or_outside_the_completion_fail_that_sample(bad, why):
    good = StepScores([1.0, 0.0], [3, 6])
    fn = scripted([good, bad])
    result = score_completions([WeightedReward("mine", fn), WeightedReward("len", lambda completions, **_: [1, 1])],
                               ["q", "q"], ["abc\ndf", "abc\ndf"], {})
    assert result.valid.tolist() == [True, False]
    assert result.step_scores[0] == good and result.step_scores[1] is None
    assert result.per_function["mine"][0] == 0.5 and math.isnan(result.per_function["mine"][1])
    assert result.total[0] == 1.0  # the outcome reward alone: step scores never enter the sum
    assert "refused 1 of 2 samples" in result.errors["mine"]
    assert re.search(why, result.errors["mine"])


def test_a_process_reward_alone_logs_its_mean_step_score_as_the_total():
    result = score_completions([WeightedReward("mine", scripted([StepScores([1.0, 0.0], [3, 6])]))], ["q"],
                               ["abc\ndf"], {})
    assert result.total.tolist() == [0.5] and result.valid.tolist() == [True]


def test_a_process_reward_that_raises_fails_every_sample():
    @process_reward
    def broken(prompts, completions, **_):
        raise RuntimeError("boom")

    with pytest.warns(UserWarning, match="boom"):
        result = score_completions([WeightedReward("broken", broken)], ["q"], ["a"], {})
    assert result.valid.tolist() == [False] and result.step_scores == [None]


def test_refused_samples_get_zero_advantage_in_the_trainer(tokenizer):
    scores = [StepScores([1.0], [2]), None, StepScores([0.0], [2]), StepScores([1.0], [2])]
    ids = torch.tensor([char_ids(tokenizer, "ab")] * 4)
    valid = torch.tensor([True, False, True, True])
    adv = step_advantages(tokenizer, ids, torch.tensor([3] * 4), scores, 2, valid)
    assert not adv[1].any()  # refused: no steps
    assert not adv[0].any()  # its group has one scored sample left: nothing to compare
    assert adv[2, 0] < 0 < adv[3, 0]


# --------------------------------------------------------------------------- config and a user's own

def test_a_process_reward_in_a_users_file_loads_by_module_and_function(tmp_path, monkeypatch):
    (tmp_path / "my_steps.py").write_text(textwrap.dedent('''
        from grpokit.rewards.process import StepScores, process_reward

        @process_reward
        def sentences(prompts, completions, **_):
            """One step per sentence; a step scores 1 when it ends with a full stop."""
            out = []
            for text in completions:
                ends = [i + 1 for i, ch in enumerate(text) if ch == "."] or [len(text)]
                if ends[-1] != len(text):
                    ends.append(len(text))
                pieces = [text[a:b] for a, b in zip([0] + ends, ends)]
                out.append(StepScores([float(p.endswith(".")) for p in pieces], ends, len(ends) > 1))
            return out
    '''))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(tmp_path)
    config = load_config([], ["--rewards=[{name: 'my_steps:sentences'}]"])
    fn = get_reward_function(config.rewards[0].name)
    assert is_process_reward(fn)
    result = score_completions([WeightedReward("mine", fn)], ["q"], ["One. Two. three"], {})
    assert result.step_scores == [StepScores([1.0, 1.0, 0.0], [4, 9, 15], True)]


@pytest.mark.parametrize("overrides, message", [
    (["--rewards=[{name: chain_steps}, {name: gsm8k_steps}]"], "are all process rewards"),
    (["--rewards=[{name: chain_steps}]", "--reward_model.kind=process"], "gives step scores too"),
    (["--rewards=[{name: chain_steps}]", "--algo=ppo"], "needs algo=grpo"),
    (["--rewards=[{name: chain_steps}]", "--grpo.scale_rewards=false"], "not defined for the process reward"),
    (["--grpo.process_advantage=per_step"], "unknown process advantage estimator 'per_step'"),
])
def test_process_rewards_that_cannot_work_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([], overrides)


def test_the_built_in_process_rewards_are_marked():
    assert is_process_reward(get_reward_function("chain_steps"))
    assert is_process_reward(get_reward_function("gsm8k_steps"))
    assert not is_process_reward(get_reward_function("chain_accuracy"))


# --------------------------------------------------------------------------- end to end

def test_chain_steps_alone_trains_the_demo_with_eq6(tmp_path):
    out = tmp_path / "run"
    cli("demo", "--output-dir", str(out), "--rewards=[{name: chain_steps}]", "--grpo.max_steps=2",
        "--sft.max_steps=5", "--sft.warmup_steps=1", "--num_sft_examples=40", *RUN)
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert {"process/steps_mean", "process/no_delimiter", "rewards/chain_steps"} <= set(row)
        assert 0.0 <= row["rewards/chain_steps"] <= 1.0 and row["process/steps_mean"] >= 1
    assert json.loads((out / "summary.json").read_text())["grpo_accuracy"] >= 0.0


def test_the_comparison_benchmark_reports_every_arm_and_the_target_per_seed():
    """benchmarks/process_rewards.py's table and target lines, from made-up summaries (no training)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("process_bench", Path(__file__).parents[1] / "benchmarks" /
                                                  "process_rewards.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    finals = {(0, "outcome"): 0.50, (0, "process"): 0.55, (1, "outcome"): 0.60, (1, "process"): 0.40}
    done = {(seed, arm): {"grpo_accuracy": finals.get((seed, arm), 0.5), "sft_accuracy": 0.3,
                          "grpo": {"k": 8, "maj_at_k": 0.6, "pass_at_k": 0.9},
                          "greedy_at": {q: (q * 37, 0.1 * q) for q in bench.QUARTERS}}
            for seed in (0, 1) for arm in bench.ARMS}
    lines = bench.table([0, 1], done, 150, list(bench.ARMS))
    assert lines[0].startswith("| seed | arm | SFT greedy | greedy 25% (step 37) | greedy 50% (step 74) |")
    assert len(lines) == 2 + 2 * len(bench.ARMS)
    assert "| 0 | process | 30.0% | 10.0% | 20.0% | 30.0% | 55.0% | 60.0% | 90.0% | +5.0 pt |" in lines
    targets = bench.target_lines([0, 1], done, list(bench.ARMS))
    assert targets[0] == "- process ≥ outcome (final greedy) on 1 of 2 seeds (0)"
    assert len(targets) == len(bench.ARMS) - 1
    # some arms only (--arms): their rows and targets, outcome first
    assert len(bench.table([0, 1], done, 150, ["outcome", "process"])) == 2 + 2 * 2
    assert bench.target_lines([0, 1], done, ["outcome", "process"]) == targets[:1]
    # an arm without a point at a quarter (finished before eval.every_steps, or too few steps): "-"
    done[(1, "process")]["greedy_at"][2] = (74, None)
    assert "| 1 | process | 30.0% | 10.0% | - | 30.0% | 40.0% | 60.0% | 90.0% | -20.0 pt |" in \
        bench.table([0, 1], done, 150, ["outcome", "process"])
