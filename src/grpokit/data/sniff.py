"""Reward-model training examples from a file, read as the kind of rows the file holds: preference
pairs, graded samples (made into pairs) or, for a process reward model, step-labelled samples."""

from __future__ import annotations

from grpokit.data.files import read_file_records
from grpokit.data.reward_data import (
    pairs_from_graded,
    read_graded_samples,
    read_preference_pairs,
    read_step_labels,
)


def reward_model_examples(path: str, kind: str, delimiter: str, skip_malformed: bool, seed: int,
                          max_pairs_per_prompt: int = 8) -> list:
    """Training examples from a file: preference pairs (prompt, chosen, rejected), graded samples
    (prompt, completion, correct) made into pairs, or step-labelled samples for a process RM."""
    if kind == "process":
        return read_step_labels(path, delimiter, skip_malformed)
    records, _ = read_file_records(path, skip_malformed=True)
    first = records[0][1] if records and isinstance(records[0][1], dict) else {}
    if "chosen" in first or "rejected" in first:
        return read_preference_pairs(path, skip_malformed)
    return pairs_from_graded(read_graded_samples(path, skip_malformed), seed=seed,
                             max_pairs_per_prompt=max_pairs_per_prompt)
