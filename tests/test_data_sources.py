"""Dataset sources and prompt templates: formats, column mapping, the CoT instruction, chat templates."""

import json

import pytest

from grpokit.pipeline.build import ASCII_ALPHABET
from grpokit.config import DataConfig, DataSource
from grpokit.data.files import DatasetError
from grpokit.data.sources import build_rows, detect_format, load_source, worked_solution
from grpokit.data.templates import COT_INSTRUCTION, render_prompt
from grpokit.models import build_char_tokenizer

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def ascii_tokenizer():
    return build_char_tokenizer(ASCII_ALPHABET)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cot_template_is_deepseekmath_instruction_in_plain_text(ascii_tokenizer):
    text = render_prompt("What is 2+3?", ascii_tokenizer, "cot", "auto")
    assert text == "What is 2+3?\nPlease reason step by step, and put your final answer within \\boxed{}.\n"
    assert COT_INSTRUCTION.endswith("within \\boxed{}.")
    assert render_prompt("  Q  ", ascii_tokenizer, "none", "off") == "Q\n"
    assert render_prompt("x", ascii_tokenizer, "Problem: {question}\nSolution:", "off") == "Problem: x\nSolution:\n"
    with pytest.raises(ValueError, match="contain '\\{question\\}'"):
        render_prompt("x", ascii_tokenizer, "bogus", "off")


def test_the_tokenizers_chat_template_wraps_the_prompt(ascii_tokenizer):
    tok = build_char_tokenizer(ASCII_ALPHABET)
    tok.chat_template = CHAT
    text = render_prompt("What is 2+3?", tok, "cot", "auto", system_prompt="Be brief.")
    assert text == ("<|system|>Be brief.\n<|user|>What is 2+3?\n" + COT_INSTRUCTION + "\n<|assistant|>")
    assert render_prompt("Q", tok, "none", "off") == "Q\n"
    with pytest.raises(ValueError, match="has no chat template"):
        render_prompt("Q", ascii_tokenizer, "cot", "on")


def test_formats_are_detected_from_the_columns():
    assert detect_format({"question": "q", "answer": "x #### 5"}) == "gsm8k"
    assert detect_format({"problem": "p", "solution": "s"}) == "math"
    assert detect_format({"question": "q", "answer": "5"}) == "plain"


def test_gsm8k_solution_becomes_a_boxed_sft_target():
    row = {"answer": "He has 2*3=<<2*3=6>>6 apples.\n#### 6"}
    assert worked_solution(row, "gsm8k", "completion") == "He has 2*3=6 apples.\nThe final answer is $\\boxed{6}$."


def test_plain_source_with_column_mapping_builds_rl_rows(tmp_path, ascii_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "What is 1+1?", "ref": "2", "level": 1}])
    rows = build_rows([DataSource(path=str(path), prompt_column="q", answer_column="ref")], DataConfig(),
                      ascii_tokenizer)
    assert rows == [{"q": "What is 1+1?", "ref": "2", "level": 1, "question": "What is 1+1?",
                     "prompt": "What is 1+1?\n" + COT_INSTRUCTION + "\n", "answer": "2"}]


def test_a_bad_column_mapping_names_the_source_and_the_fix(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(DatasetError, match=r"d.jsonl:1: no column 'prompt' .*prompt_column / answer_column on that "
                                           r"entry of data.sources"):
        load_source(DataSource(path=str(path)))
    with pytest.raises(DatasetError, match="exactly one of path"):
        load_source(DataSource())
    with pytest.raises(DatasetError, match="does not exist"):
        load_source(DataSource(path=str(tmp_path / "missing.jsonl")))


def test_max_rows_limits_a_source(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": str(i)} for i in range(10)])
    loaded, fmt = load_source(DataSource(path=str(path), max_rows=3))
    assert fmt == "plain" and [r["answer"] for r in loaded.rows] == ["0", "1", "2"]


def test_a_datasets_name_without_the_extra_says_how_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(DatasetError, match=r"pip install 'grpokit\[datasets\]'"):
        load_source(DataSource(name="openai/gsm8k", subset="main"))


def test_a_math_reference_is_the_answer_field_or_the_last_boxed_answer_never_the_whole_solution(tmp_path):
    """MATH-500 rows carry an `answer` field; MATH rows only a solution ending in a boxed answer."""
    from grpokit.config import DataConfig, DataSource
    from grpokit.data.sources import build_rows
    from grpokit.models import build_char_tokenizer

    path = tmp_path / "math.jsonl"
    path.write_text(json.dumps({"problem": "1+1?", "solution": "So $\\boxed{2}$.", "answer": "2"}) + "\n"
                    + json.dumps({"problem": "2+2?", "solution": "It is $\\boxed{4}$."}) + "\n")
    tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    rows = build_rows([DataSource(path=str(path), format="math")], DataConfig(template="none"), tokenizer)
    assert [r["answer"] for r in rows] == ["2", "4"]
