"""`chain_steps`: the chain task's step checker as a process reward (eq. 6 from a rule).

Each line of the completion is one step, split as a process reward model splits it (rewards/process.py,
line_steps). A step scores 1.0 when it and every step before it are right, else 0.0
(arithmetic.step_labels: a chain line must be the line above with its first operation carried out,
the answer line must state the reference answer, anything after the answer line is wrong).

    "Q: 7+5-3+9\\n", "12-3+9\\n9+8\\nA: 17"  ->  steps "12-3+9\\n", "9+8\\n", "A: 17"; scores [1, 0, 0]
"""

from __future__ import annotations

from grpokit.data import arithmetic
from grpokit.rewards.process import StepScores, line_steps, process_reward, step_char_ends


@process_reward
def chain_steps(prompts: list[str], completions: list[str], question: list[str], answer: list[str],
                **_) -> list[StepScores]:
    """One StepScores per completion: 1.0 for each step of the right prefix, 0.0 from the first wrong step on."""
    out = []
    for q, a, completion in zip(question, answer, completions):
        steps, has_delimiter = line_steps(completion)
        labels = arithmetic.step_labels(q, steps, a)
        out.append(StepScores([float(ok) for ok in labels], step_char_ends(steps), has_delimiter))
    return out
