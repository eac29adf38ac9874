"""Step labels from rollouts (Math-Shepherd): the label rule by hand, then label_steps driven by
scripted completers on a hand-made task and on the built-in chain task."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpokit.data import arithmetic
from grpokit.data.reward_data import StepLabelledSample, read_step_labels, split_steps, write_jsonl
from grpokit.rewards.step_labels import label_steps, split_solution, step_labels_from_counts

# --- the label rule -----------------------------------------------------------------------------


def test_labels_from_counts_golden():
    # n = 4 rollouts per step: 3, 1, 0 of them reach the answer; the fourth step's could not be graded
    counts = [3, 1, 0, None, 4]
    assert step_labels_from_counts(counts, 4, "hard") == [1.0, 1.0, 0.0, None, 1.0]
    assert step_labels_from_counts(counts, 4, "soft") == [0.75, 0.25, 0.0, None, 1.0]
    # no carrying forward: a 1 after a 0 stays (the completer recovered from that prefix)
    assert step_labels_from_counts([0, 2], 2, "hard") == [0.0, 1.0]
    assert step_labels_from_counts([], 3, "soft") == []
    assert step_labels_from_counts([1], 1, "soft") == [1.0]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.lists(st.none() | st.integers(0, n)))))
def test_hard_is_soft_above_zero(n_counts):
    n, counts = n_counts
    hard = step_labels_from_counts(counts, n, "hard")
    soft = step_labels_from_counts(counts, n, "soft")
    for count, h, s in zip(counts, hard, soft):
        assert (h is None) == (s is None) == (count is None)
        if count is not None:
            assert h == float(s > 0) and s * n == pytest.approx(count, abs=1e-12)


@pytest.mark.parametrize("counts, n, mode, words", [
    ([5], 4, "hard", "correct_counts[0] must be an integer in [0, n=4]"),
    ([1, -1], 4, "soft", "correct_counts[1]"),
    ([True], 4, "hard", "correct_counts[0]"),
    ([0.5], 4, "soft", "correct_counts[0]"),
    ([1], 0, "hard", "n (rollouts per step) must be an integer >= 1, got 0"),
    ([1], 2.0, "hard", "got 2.0"),
    ([1], 4, "Hard", "mode must be 'hard' or 'soft', got 'Hard'"),
])
def test_labels_from_counts_errors(counts, n, mode, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        step_labels_from_counts(counts, n, mode)


def test_split_solution_flags_a_missing_delimiter():
    assert split_solution("a\nb", "\n") == (["a\n", "b"], True)
    assert split_solution("A: 18", "\n") == (["A: 18"], False)
    assert split_solution("", "\n") == ([""], False)  # an empty solution is one (empty) step
    assert split_solution("x<s>y", "<s>") == (split_steps("x<s>y", "<s>"), True)


# --- a hand-made task: answers are "A7" (right) or "A8" (wrong); "T" times the verifier out ---------

ROW = {"prompt": "P", "answer": "7"}


def table_completer(table, calls):
    def complete(prefixes, n):
        calls.append(list(prefixes))
        return [table[p] for p in prefixes]
    return complete


def letter_grader(calls):
    def grade(rows, completions):
        calls.append(list(completions))
        return [None if c.endswith("T") else c.endswith(f"A{r['answer']}") for r, c in zip(rows, completions)]
    return grade


def test_label_steps_golden():
    table = {"Ps1\n": ["A7", "A8", "A8", "A7"], "Ps1\ns2\n": ["A7"] * 4, "Ps1\nx\n": ["A8"] * 4}
    completer_calls, grader_calls = [], []
    records, stats = label_steps([ROW], [["s1\ns2\nA7", "s1\nx\nA8"]], table_completer(table, completer_calls),
                                 letter_grader(grader_calls), n=4)
    assert records == [
        {"prompt": "P", "steps": ["s1\n", "s2\n", "A7"], "labels": [True, True, True], "soft_labels": [0.5, 1.0, 1.0]},
        {"prompt": "P", "steps": ["s1\n", "x\n", "A8"], "labels": [True, False, False],
         "soft_labels": [0.5, 0.0, 0.0]},
    ]
    # the shared prefix "s1\n" is sampled once; last steps need no rollouts
    assert completer_calls == [["Ps1\n", "Ps1\ns2\n", "Ps1\nx\n"]]
    # one call grades the solutions, one the completed rollouts (steps so far + continuation, no prompt)
    assert grader_calls[0] == ["s1\ns2\nA7", "s1\nx\nA8"]
    assert grader_calls[1][:4] == ["s1\nA7", "s1\nA8", "s1\nA8", "s1\nA7"] and len(grader_calls[1]) == 12
    assert stats == {"questions": 1, "solutions": 2, "steps": 6, "rollouts_sampled": 12, "skipped_no_answer": 0,
                     "skipped_uniform": 0, "unlabelled_steps": 0, "no_delimiter": 0, "records": 2,
                     "steps_written": 6}


def test_missing_verdicts_leave_steps_unlabelled_never_zero():
    # step 2 of the first solution: one rollout timed out (three others reached the answer: still no label);
    # step 2 of the second: the completer failed on the prefix; a third solution's own grade timed out;
    # the fourth's first prefix lost one continuation
    table = {"Ps1\n": ["A7", "A8", "A8", "A8"], "Ps1\ns2\n": ["A7", "T", "A7", "A7"], "Ps1\nx\n": None,
             "Pq\n": ["A8", None, "A8", "A8"]}
    records, stats = label_steps([ROW], [["s1\ns2\nA7", "s1\nx\nA8", "s1\nT", "q\nA7"]],
                                 table_completer(table, []), letter_grader([]), n=4)
    assert records == [{"prompt": "P", "steps": ["s1\n"], "labels": [True], "soft_labels": [0.25]}] * 3
    assert stats["unlabelled_steps"] == 1 + 1 + 1 + 1 and stats["steps_written"] == 3
    assert stats["records"] == 3 and stats["steps"] == 10 and stats["rollouts_sampled"] == 4 * 4


def test_rows_without_an_answer_are_skipped_and_counted():
    rows = [{"prompt": "P"}, {"prompt": "P", "answer": None}, {"prompt": "P", "answer": "  "}, ROW,
            {"prompt": "P", "answer": 0}]  # 0 is an answer
    calls = []
    table = {"Ps1\n": ["A7", "A8"]}
    records, stats = label_steps(rows, [["s1\nA7", "s1\nA8"]] * 5, table_completer(table, calls), letter_grader([]),
                                 n=2, skip_uniform=False)
    assert stats["skipped_no_answer"] == 3 and stats["solutions"] == 4 and stats["steps"] == 8
    assert [r["labels"] for r in records] == [[True, True], [True, False], [False, False], [False, False]]
    assert calls == [["Ps1\n", "Ps1\n"]]  # one prefix per answered row; none from the skipped ones


def test_custom_delimiter_and_round_trip(tmp_path):
    table = {"P<s>x<s>": ["A7", "A8"]}
    rows = [{"prompt": "P<s>", "answer": "7"}]
    records, stats = label_steps(rows, [["x<s>A7", "A8"]], table_completer(table, []), letter_grader([]), n=2,
                                 delimiter="<s>")
    assert records == [{"prompt": "P<s>", "steps": ["x<s>", "A7"], "labels": [True, True], "soft_labels": [0.5, 1.0]},
                       {"prompt": "P<s>", "steps": ["A8"], "labels": [False], "soft_labels": [0.0]}]
    assert stats["no_delimiter"] == 1
    path = tmp_path / "labels.jsonl"
    write_jsonl(path, records)
    assert read_step_labels(path, delimiter="<s>") == [StepLabelledSample("P<s>", ("x<s>", "A7"), (True, True)),
                                                       StepLabelledSample("P<s>", ("A8",), (False,))]


@pytest.mark.parametrize("kwargs, words", [
    ({"n": 0}, "n (rollouts per step) must be an integer >= 1"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"delimiter": ""}, "the step delimiter must not be empty"),
    ({"rows": [ROW, ROW]}, "got 2 rows but 1 solution lists"),
    ({"rows": [{"answer": "7"}]}, "rows[0] needs a non-empty text 'prompt'"),
    ({"solutions": ["s1\nA7"]}, "solutions[0] must be a list of solution texts"),
    ({"complete_fn": lambda prefixes, n: [["A7"]] * len(prefixes)}, "give a list of exactly n=2 continuations"),
    ({"complete_fn": lambda prefixes, n: []}, "complete_fn returned 0 lists for 1 prefixes"),
    ({"grade_fn": lambda rows, completions: [1.0] * len(completions)}, "grade_fn verdict 0 is 1.0"),
    ({"grade_fn": lambda rows, completions: [True]}, "grade_fn returned 1 verdicts for 2 completions"),
])
def test_label_steps_errors(kwargs, words):
    args = {"rows": [ROW], "solutions": [["s1\nA7", "A8"]], "grade_fn": letter_grader([]), "n": 2,
            "complete_fn": lambda prefixes, n: [["A7"] * n] * len(prefixes)} | kwargs
    with pytest.raises(ValueError, match=re.escape(words)):
        label_steps(**args)


# --- the built-in chain task: hard labels match its rule labels -----------------------------------


def wrong_at(question: str, k: int) -> str:
    """A worked solution whose step k is off by one; later steps follow from it, so the answer is off too."""
    steps, _ = arithmetic.solve(question)
    head = re.match(r"-?\d+", steps[k])
    chain = str(int(head.group()) + 1) + steps[k][head.end():]
    lines = steps[:k] + [chain]
    while not chain.lstrip("-").isdigit():
        chain = arithmetic.reduce_once(chain)
        lines.append(chain)
    lines[-1] = f"A: {chain}"
    return "\n".join(lines)


def chain_completer(right_share: float = 1.0, calls: list | None = None):
    """From a prefix whose steps are all right, the first round(n * right_share) continuations finish
    the worked solution and the rest state a wrong answer; from any other prefix all are wrong."""
    def complete(prefixes, n):
        if calls is not None:
            calls.append(len(prefixes))
        out = []
        for text in prefixes:
            prompt_line, _, done = text.partition("\n")
            question = prompt_line.removeprefix("Q: ")
            steps = done.split("\n")[:-1]  # a prefix ends with its last step's delimiter
            worked, answer = arithmetic.solve(question)
            wrong = f"A: {answer + 1}"
            if all(arithmetic.step_labels(question, steps, str(answer))):
                right = "\n".join((worked + [f"A: {answer}"])[len(steps):])
                m = round(n * right_share)
                out.append([right] * m + [wrong] * (n - m))
            else:
                out.append([wrong] * n)
        return out
    return complete


def chain_grade(rows, completions):
    scores = arithmetic.chain_accuracy([r["prompt"] for r in rows], completions, [r["answer"] for r in rows])
    return [s > 0.5 for s in scores]


def chain_solutions(row):
    q = row["question"]
    return [row["solution"], wrong_at(q, 0), wrong_at(q, 1), arithmetic.format_direct_answer(q),
            f"A: {int(row['answer']) + 1}"]


def test_hard_labels_match_the_chain_rule_labels(chain_rows, tmp_path):
    rows = chain_rows[:8]
    solutions = [chain_solutions(row) for row in rows]
    records, stats = label_steps(rows, solutions, chain_completer(0.5), chain_grade, n=4)
    assert len(records) == 5 * len(rows)
    for k, record in enumerate(records):
        row, solution = rows[k // 5], solutions[k // 5][k % 5]
        assert record["prompt"] == row["prompt"] and record["steps"] == split_steps(solution, "\n")
        rule = arithmetic.step_labels(row["question"], record["steps"], row["answer"])
        assert record["labels"] == rule
        # a right prefix: 2 of 4 continuations finish right; the last step is the solution's own grade
        assert record["soft_labels"] == [0.5 if ok else 0.0 for ok in rule[:-1]] + [float(rule[-1])]
    # distinct prefixes per question: K-1 for the worked solution, K-1 for wrong_at(0) and K-2 new ones for
    # wrong_at(1), which shares its first step with the worked solution (K = lines of the worked solution)
    lines = [len(row["solution"].split("\n")) for row in rows]
    assert stats["rollouts_sampled"] == 4 * sum(3 * k - 4 for k in lines)
    assert stats["no_delimiter"] == 2 * len(rows) and stats["skipped_uniform"] == 0
    assert stats["steps"] == stats["steps_written"] == sum(3 * k + 2 for k in lines)
    path = tmp_path / "chain.jsonl"
    write_jsonl(path, records)
    assert read_step_labels(path) == [StepLabelledSample(r["prompt"], tuple(r["steps"]), tuple(r["labels"]))
                                      for r in records]


def test_the_last_step_is_labelled_by_the_outcome(chain_rows):
    """A wrong step followed by the right answer: the rule labels every step from the first error on
    wrong, rollouts label the last step by the solution's grade (the answer is right)."""
    row = chain_rows[0]
    lucky = wrong_at(row["question"], 0).rsplit("\n", 1)[0] + f"\nA: {row['answer']}"
    (record,), _ = label_steps([row], [[lucky]], chain_completer(), chain_grade, n=3)
    assert record["labels"] == [False] * (len(record["steps"]) - 1) + [True]
    assert arithmetic.step_labels(row["question"], record["steps"], row["answer"]) == [False] * len(record["steps"])


def test_batches_hold_at_most_batch_size_prefixes(chain_rows):
    rows = chain_rows[:6]
    solutions = [chain_solutions(row) for row in rows]
    calls, graded = [], []

    def counting_grade(rows, completions):
        graded.append(len(completions))
        return chain_grade(rows, completions)

    records, stats = label_steps(rows, solutions, chain_completer(0.75, calls), counting_grade, n=4, batch_size=3)
    assert max(calls) <= 3 and sum(calls) * 4 == stats["rollouts_sampled"] and len(calls) > 1
    assert max(graded) <= 3 * 4
    whole, whole_stats = label_steps(rows, solutions, chain_completer(0.75), chain_grade, n=4, batch_size=1000)
    assert records == whole and stats == whole_stats  # batching changes nothing but the calls


def test_uniform_questions_skip_their_rollouts(chain_rows):
    right, wrong, mixed = chain_rows[:3]
    calls = []
    solutions = [[right["solution"]] * 2, [wrong_at(wrong["question"], 0), f"A: {int(wrong['answer']) + 1}"],
                 [mixed["solution"]]]
    records, stats = label_steps([right, wrong, mixed], solutions, chain_completer(0.5, calls), chain_grade, n=2)
    k_right, k_wrong, k_mixed = (len(s.split("\n")) for s in (right["solution"], solutions[1][0], mixed["solution"]))
    # all right: every step 1 / 1.0 without rollouts; all wrong: only a one-step solution (its step is the
    # last, labelled by its grade) gives a record; one solution is never uniform
    assert records[:3] == [{"prompt": right["prompt"], "steps": split_steps(right["solution"], "\n"),
                            "labels": [True] * k_right, "soft_labels": [1.0] * k_right}] * 2 + [
        {"prompt": wrong["prompt"], "steps": [solutions[1][1]], "labels": [False], "soft_labels": [0.0]}]
    assert records[3]["prompt"] == mixed["prompt"] and records[3]["soft_labels"] == [0.5] * (k_mixed - 1) + [1.0]
    assert len(records) == 4 and stats["skipped_uniform"] == 2
    assert sum(calls) == k_mixed - 1 and stats["rollouts_sampled"] == 2 * (k_mixed - 1)
    assert stats["unlabelled_steps"] == k_wrong - 1  # the wrong solutions' last steps are labelled (0), not written
    # without the skip, the all-wrong question is rolled out and labelled like any other
    records, stats = label_steps([wrong], solutions[1:2], chain_completer(), chain_grade, n=2, skip_uniform=False)
    assert [r["labels"] for r in records] == [[False] * k_wrong, [False]] and stats["skipped_uniform"] == 0
