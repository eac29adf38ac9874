"""Process labels from rollouts: Math-Shepherd's automatic step labels (Wang et al., 2023), the
kind DeepSeekMath trains its process reward model on.

For step j of a sampled solution, a completer policy samples N continuations of the prefix
(prompt + steps 1..j); a verifier grades each completed solution against the reference answer.
With c of the N reaching it:

    hard label   1 if c >= 1 else 0     (the step can still lead to the right answer)
    soft label   c / N                  (how often it does)

Each step is labelled from its own rollouts, as the paper does: a 0 is not carried on to the
steps after it, and a 1 after a 0 is kept (the completer recovered from that prefix).

Nothing here runs a model. The caller passes two callables:

    complete_fn(prefix_texts: list[str], n: int) -> list[list[str | None] | None]
        n continuations of each prefix text; None for a continuation (or for a whole prefix)
        the completer failed to produce.
    grade_fn(rows: list[dict], completions: list[str]) -> list[bool | None]
        whether each completed solution (steps so far + continuation, without the prompt)
        states the reference answer of its row; None when the verifier could not say (a timeout).

A missing verdict never becomes a 0: a step with any missing verdict among its N has no label,
even when another of its rollouts reached the answer, so that hard and soft labels cover the
same steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from grpokit.data.reward_data import split_steps

Mode = Literal["hard", "soft"]
CompleteFn = Callable[[list[str], int], Sequence[Sequence[str | None] | None]]
GradeFn = Callable[[list[dict], list[str]], Sequence[bool | None]]

STAT_KEYS = ("questions", "solutions", "steps", "rollouts_sampled", "skipped_no_answer", "skipped_uniform",
             "unlabelled_steps", "no_delimiter", "records", "steps_written")


def _check_count_arg(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def step_labels_from_counts(correct_counts: Sequence[int | None], n: int, mode: Mode) -> list[float | None]:
    """Labels of steps whose N = `n` rollouts reached the answer `correct_counts[j]` times.

    hard: 1.0 when the count is at least 1, else 0.0; soft: count / n. A None count (the step's
    rollouts could not all be sampled or graded) gives a None label, never 0.
    """
    if mode not in ("hard", "soft"):
        raise ValueError(f"mode must be 'hard' or 'soft', got {mode!r}")
    _check_count_arg("n (rollouts per step)", n)
    labels: list[float | None] = []
    for j, count in enumerate(correct_counts):
        if count is None:
            labels.append(None)
            continue
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= n:
            raise ValueError(f"correct_counts[{j}] must be an integer in [0, n={n}] or None, got {count!r}")
        labels.append((1.0 if count >= 1 else 0.0) if mode == "hard" else count / n)
    return labels


def split_solution(completion: str, delimiter: str) -> tuple[list[str], bool]:
    """(steps, has_delimiter): the steps as the process reward model and `read_step_labels` split
    them (`split_steps`, each step keeping its trailing delimiter), and whether the delimiter
    occurs at all. A solution without it is one step: it needs no rollouts, and its only label
    is its own grade."""
    return split_steps(completion, delimiter) or [completion], delimiter in completion


def _has_answer(row: dict) -> bool:
    answer = row.get("answer")
    return answer is not None and not (isinstance(answer, str) and not answer.strip())


def _count(verdicts: Sequence[bool | None] | None) -> int | None:
    """Completions that reached the answer, or None if any verdict is missing."""
    if verdicts is None or any(v is None for v in verdicts):
        return None
    return sum(bool(v) for v in verdicts)


def _check_rows(rows: Sequence[dict], solutions: Sequence[Sequence[str]]) -> None:
    if len(rows) != len(solutions):
        raise ValueError(f"got {len(rows)} rows but {len(solutions)} solution lists; give one list of "
                         "sampled solutions per row")
    for i, (row, sampled) in enumerate(zip(rows, solutions)):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ValueError(f"rows[{i}] needs a non-empty text 'prompt', got {row!r:.80}")
        if isinstance(sampled, str) or not all(isinstance(s, str) for s in sampled):
            raise ValueError(f"solutions[{i}] must be a list of solution texts (str), got {sampled!r:.80}")


def _grade(grade_fn: GradeFn, rows: list[dict], completions: list[str]) -> list[bool | None]:
    verdicts = list(grade_fn(rows, completions))
    if len(verdicts) != len(completions):
        raise ValueError(f"grade_fn returned {len(verdicts)} verdicts for {len(completions)} completions; "
                         "it must return one per completion")
    for k, v in enumerate(verdicts):
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"grade_fn verdict {k} is {v!r}; give True, False or None (could not grade), "
                             "e.g. `score > 0.5` for a reward function's score")
    return verdicts


def _complete(complete_fn: CompleteFn, prefixes: list[str], n: int) -> list[list[str | None] | None]:
    samples = list(complete_fn(prefixes, n))
    if len(samples) != len(prefixes):
        raise ValueError(f"complete_fn returned {len(samples)} lists for {len(prefixes)} prefixes; "
                         "it must return one list of n continuations per prefix (or None)")
    for k, row in enumerate(samples):
        if row is None:
            continue
        if isinstance(row, str) or len(row) != n or not all(c is None or isinstance(c, str) for c in row):
            raise ValueError(f"complete_fn gave {row!r:.80} for prefix {k}; give a list of exactly n={n} "
                             "continuations (str, or None for one that failed), or None for the prefix")
    return [None if row is None else list(row) for row in samples]


def _rollout_counts(rows: Sequence[dict], prefixes: list[tuple[int, str]], complete_fn: CompleteFn,
                    grade_fn: GradeFn, n: int, batch_size: int) -> dict[tuple[int, str], int | None]:
    """For each (row, steps text so far): how many of n continuations reach the answer, or None.
    One complete_fn and one grade_fn call per chunk of `batch_size` prefixes."""
    counts: dict[tuple[int, str], int | None] = {}
    for start in range(0, len(prefixes), batch_size):
        chunk = prefixes[start:start + batch_size]
        samples = _complete(complete_fn, [rows[i]["prompt"] + done for i, done in chunk], n)
        flat_rows, flat_texts, where = [], [], []  # one graded completion per continuation sampled
        for k, ((i, done), continuations) in enumerate(zip(chunk, samples)):
            for slot, c in enumerate(continuations or []):
                if c is not None:
                    flat_rows.append(rows[i])
                    flat_texts.append(done + c)
                    where.append((k, slot))
        verdicts = _grade(grade_fn, flat_rows, flat_texts) if flat_texts else []
        # a failed continuation keeps its None verdict, and so does a failed prefix's whole list
        per_prefix = [None if continuations is None else [None] * n for continuations in samples]
        for (k, slot), verdict in zip(where, verdicts):
            per_prefix[k][slot] = verdict
        counts.update(zip(chunk, map(_count, per_prefix)))
    return counts


def label_steps(
    rows: Sequence[dict],
    solutions: Sequence[Sequence[str]],
    complete_fn: CompleteFn,
    grade_fn: GradeFn,
    n: int,
    delimiter: str = "\n",
    batch_size: int = 64,
    skip_uniform: bool = True,
) -> tuple[list[dict], dict[str, int]]:
    """Label every step of the sampled `solutions[i]` (a list of completion texts) to `rows[i]`
    (a dict with 'prompt' and the reference 'answer') from N = `n` rollouts per step prefix.

    Returns (records, stats). Each record is one solution in the format `read_step_labels` (and so
    `grpokit train-rm --process --data`) reads: {"prompt", "steps", "labels"} with hard labels as
    true/false, plus "soft_labels" (floats, one per step), which that reader ignores.

    - The last step needs no rollouts: its label is the solution's own grade (soft: 1.0 or 0.0).
    - Step prefixes of all questions are sampled in chunks of `batch_size`, each chunk one
      complete_fn call and one grade_fn call; solutions are graded in chunks of `batch_size`
      too. The same prefix twice in one question (two solutions with the same first steps) is
      sampled once, and both steps get its labels.
    - A row with no reference answer (missing, None or blank) is skipped and counted, never
      labelled 0.
    - With `skip_uniform`, a question with at least two solutions, all graded and all alike,
      gets no rollouts. All right: every step of every solution is labelled 1 (hard) and 1.0
      (soft). The hard label is exact, since the solution itself is a completion of each of its
      prefixes that reaches the answer; the soft label is an estimate from that one completion.
      All wrong: only the last steps are labelled (0); no rollout supports a label for the others.
    - Records hold the steps up to the first step with no label: `read_step_labels` takes no
      missing labels, and a causal reward model scores a step from the text up to its end, so
      a labelled prefix is a complete example. A solution whose first step has no label gives
      no record (of an all-wrong question, only the one-step solutions give one).

    stats: questions (rows given), skipped_no_answer, then over the rows with an answer:
    solutions, steps, no_delimiter (solutions without the delimiter: one step each),
    skipped_uniform (questions), rollouts_sampled (continuations asked for), unlabelled_steps,
    records and steps_written.
    """
    _check_count_arg("n (rollouts per step)", n)
    _check_count_arg("batch_size", batch_size)
    if not delimiter:
        raise ValueError("the step delimiter must not be empty, e.g. '\\n' or '\\n\\n'")
    _check_rows(rows, solutions)
    stats = dict.fromkeys(STAT_KEYS, 0)
    stats["questions"] = len(rows)

    kept = [i for i, row in enumerate(rows) if _has_answer(row)]
    stats["skipped_no_answer"] = len(rows) - len(kept)
    split, grades = _split_and_grade(rows, solutions, kept, grade_fn, delimiter, batch_size, stats)

    # questions whose solutions all share one grade skip their rollouts; the rest roll out every
    # distinct prefix that ends before a solution's last step
    uniform: dict[int, bool] = {}  # row -> the grade all its solutions share
    for i in kept:
        own = [grades[(i, s)] for s in range(len(solutions[i]))]
        if skip_uniform and len(own) >= 2 and None not in own and len(set(own)) == 1:
            uniform[i] = own[0]
    stats["skipped_uniform"] = len(uniform)
    prefixes = list(dict.fromkeys((i, "".join(steps[:j])) for (i, _), steps in split.items() if i not in uniform
                                  for j in range(1, len(steps))))
    counts = _rollout_counts(rows, prefixes, complete_fn, grade_fn, n, batch_size)
    stats["rollouts_sampled"] = n * len(prefixes)

    records = _records(rows, split, grades, uniform, counts, n, stats)
    stats["records"] = len(records)
    return records, stats


def _split_and_grade(rows, solutions, kept: list[int], grade_fn: GradeFn, delimiter: str, batch_size: int,
                     stats: dict) -> tuple[dict, dict]:
    """label_steps' first pass: every solution of the rows that have an answer split into steps
    ({(row, solution): steps}) and graded ({(row, solution): bool or None}), in chunks of batch_size;
    counts steps, no_delimiter and solutions into stats."""
    split: dict[tuple[int, int], list[str]] = {}  # (row, solution) -> steps
    for i in kept:
        for s, text in enumerate(solutions[i]):
            split[(i, s)], has_delimiter = split_solution(text, delimiter)
            stats["steps"] += len(split[(i, s)])
            stats["no_delimiter"] += not has_delimiter
    stats["solutions"] = len(split)
    keys = list(split)
    grades: dict[tuple[int, int], bool | None] = {}
    for start in range(0, len(keys), batch_size):
        chunk = keys[start:start + batch_size]
        grades.update(zip(chunk, _grade(grade_fn, [rows[i] for i, _ in chunk], [solutions[i][s] for i, s in chunk])))
    return split, grades


def _records(rows, split: dict, grades: dict, uniform: dict, counts: dict, n: int, stats: dict) -> list[dict]:
    """label_steps' records: each solution's steps up to its first unlabelled one, with hard and soft
    labels from the rollout counts (or its question's uniform grade); counts unlabelled_steps and
    steps_written into stats."""
    records = []
    for (i, s), steps in split.items():
        if i in uniform:
            step_counts = [n if uniform[i] else None] * (len(steps) - 1)
        else:
            step_counts = [counts[(i, "".join(steps[:j]))] for j in range(1, len(steps))]
        final = None if grades[(i, s)] is None else int(grades[(i, s)])
        hard = step_labels_from_counts(step_counts, n, "hard") + step_labels_from_counts([final], 1, "hard")
        soft = step_labels_from_counts(step_counts, n, "soft") + step_labels_from_counts([final], 1, "soft")
        stats["unlabelled_steps"] += hard.count(None)
        known = hard.index(None) if None in hard else len(hard)
        if known:
            records.append({"prompt": rows[i]["prompt"], "steps": steps[:known],
                            "labels": [label == 1.0 for label in hard[:known]], "soft_labels": soft[:known]})
            stats["steps_written"] += known
    return records
