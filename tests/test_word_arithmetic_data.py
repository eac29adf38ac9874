"""examples/word_arithmetic: the committed files are what make_data.py writes, and no held-out question
asks for a fact (an operation on its operands) that a training question asks for."""

import importlib.util
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "examples" / "word_arithmetic"


def _make_data():
    spec = importlib.util.spec_from_file_location("make_data", HERE / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (HERE / f"{name}.jsonl").read_text().splitlines()]


def _fact(question: str) -> tuple[str, int, int]:
    """(op, a, b) read back from a question's words."""
    a, b = map(int, re.findall(r"\d+", question))
    if "Subtract" in question:
        return "-", b, a  # "Subtract b from a."
    if "less than" in question:
        return "-", b, a  # "What is b less than a?"
    op = "+" if re.search(r"\+|plus|sum|Add", question) else "-" if re.search(r" - |minus", question) else "*"
    return op, a, b


def test_the_committed_files_are_what_make_data_writes(tmp_path, monkeypatch):
    module = _make_data()
    monkeypatch.setattr(module, "HERE", tmp_path)
    module.main()
    for name in ("train", "test"):
        assert (tmp_path / f"{name}.jsonl").read_text() == (HERE / f"{name}.jsonl").read_text(), name


def test_heldout_facts_never_appear_in_training():
    train, test = _rows("train"), _rows("test")
    assert len(test) >= 300 and len({r["question"] for r in test}) == len(test)
    train_facts = {_fact(r["question"]) for r in train}
    test_facts = {_fact(r["question"]) for r in test}
    assert not train_facts & test_facts
    module = _make_data()
    for row in train + test:  # the facts read back give the stated answers
        assert str(module.answer(*_fact(row["question"]))) == row["answer"], row
