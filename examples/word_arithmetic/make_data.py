"""Arithmetic in words for a small real model (SmolLM2-135M-Instruct): sums, differences and products
of numbers up to 12, phrased several ways, with a held-out set that shares no fact with training.

Each question is a *fact* (an operation on its operands, e.g. 7 + 12) written through one of several
phrasings. Facts, not phrasings, are split: a fixed hash puts a quarter of all facts in the held-out
set, so no held-out question asks for a sum, difference or product that training ever asked for.

    python examples/word_arithmetic/make_data.py            # writes train.jsonl and test.jsonl here

Rows are {"question", "answer"} (the plain format of data.sources). The output is the same on every
run: the choice of fact and phrasing comes from a seeded generator."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
# (operation, phrasing); {a}, {b}: the operands
PHRASINGS = {
    "+": ["What is {a} + {b}?", "What is {a} plus {b}?", "Compute {a} + {b}.", "What is the sum of {a} and {b}?",
          "Add {a} and {b}."],
    "-": ["What is {a} - {b}?", "What is {a} minus {b}?", "Compute {a} - {b}.", "Subtract {b} from {a}.",
          "What is {b} less than {a}?"],
    "*": ["What is {a} times {b}?", "What is {a} * {b}?", "Compute {a} * {b}.", "Multiply {a} by {b}.",
          "What is the product of {a} and {b}?"],
}
TRAIN_QUESTIONS, TEST_QUESTIONS = 1200, 300
HELDOUT_SHARE = 0.25


def facts() -> list[tuple[str, int, int]]:
    """Every (op, a, b) of operands 1..12: sums, non-negative differences and products."""
    out = [("+", a, b) for a in range(1, 13) for b in range(1, 13)]
    out += [("-", a, b) for a in range(1, 13) for b in range(1, a + 1)]
    out += [("*", a, b) for a in range(1, 13) for b in range(1, 13)]
    return out


def is_heldout(fact: tuple[str, int, int]) -> bool:
    """A fixed hash of the fact (not of its phrasing) decides its side."""
    digest = hashlib.blake2b(repr(fact).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < HELDOUT_SHARE


def answer(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def questions(pool: list[tuple[str, int, int]], count: int, rng: random.Random) -> list[dict]:
    """`count` distinct questions on the facts of `pool`."""
    possible = sum(len(PHRASINGS[op]) for op, _, _ in pool)
    if count > possible:
        raise ValueError(f"{count} distinct questions asked of {len(pool)} facts, which can be written only {possible} ways")
    seen, rows = set(), []
    while len(rows) < count:
        op, a, b = rng.choice(pool)
        text = rng.choice(PHRASINGS[op]).format(a=a, b=b)
        if text not in seen:
            seen.add(text)
            rows.append({"question": text, "answer": str(answer(op, a, b))})
    return rows


def main() -> None:
    all_facts = facts()
    train_facts = [f for f in all_facts if not is_heldout(f)]
    test_facts = [f for f in all_facts if is_heldout(f)]
    rng = random.Random(0)
    for name, pool, count in (("train", train_facts, TRAIN_QUESTIONS), ("test", test_facts, TEST_QUESTIONS)):
        rows = questions(pool, count, rng)
        with open(HERE / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{name}: {len(rows)} questions on {len(pool)} facts -> {HERE / f'{name}.jsonl'}")


if __name__ == "__main__":
    main()
