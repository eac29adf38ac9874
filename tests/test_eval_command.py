"""`grpokit eval`: stop strings in generation, the command end to end on a real tiny model
(CoT and TIR, resume, --compare, scoring mode), the TIR glue, scoring agreement with the
GSM8K authors' labels, and the errors bad inputs get."""

import json
import os
from pathlib import Path

import pytest
import torch

from grpokit import cli
from grpokit.pipeline.build import ASCII_ALPHABET
from grpokit.run.checkpoint import CheckpointManager
from grpokit.data.files import DatasetError
from grpokit.eval.benchmark import (
    EvalSettings,
    Timings,
    evaluate_chunk,
    grade_completion_file,
    prompt_format,
    render_prompt,
    resolve_model,
)
from grpokit.eval.questions import dataset_name, load_benchmark
from grpokit.eval.report import compare_markdown, metrics
from grpokit.eval.tir import COT_INSTRUCTION, prompt_seeds
from grpokit.tools.python import OUTPUT_STOP
from grpokit.tasks.math import extract_answer
from grpokit.tasks.math import grade_answers as grade
from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.rollout import SamplingParams, sample_groups
from grpokit.rollout.sampler import stop_string_cut

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).with_name("fixtures")
GSM8K = FIXTURES / "gsm8k_test_sample.jsonl"
MATH500 = FIXTURES / "math500_sample.jsonl"
SOLUTIONS = FIXTURES / "gsm8k_solutions_sample.jsonl"
DATA = Path(os.environ.get("GRPOKIT_DATA") or REPO.parent / "shared" / "data")
SOLUTION_MODELS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


@pytest.fixture(scope="module")
def ascii_tokenizer():
    return build_char_tokenizer(ASCII_ALPHABET)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, ascii_tokenizer):
    """A tiny random Llama with a printable-ASCII tokenizer, saved so it loads as MODEL."""
    path = tmp_path_factory.mktemp("model") / "tiny"
    model = build_tiny_model(ascii_tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    model.save_pretrained(path)
    ascii_tokenizer.save_pretrained(path)
    return path


def run_cli(*args) -> int:
    return cli.main(["eval", *map(str, args)])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- stop strings in generation ------------------------------------------------------------


def test_stop_string_cut_golden(tokenizer):
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert stop_string_cut(tokenizer, ids("12"), ids("3+4"), ("+4",)) == 3
    assert stop_string_cut(tokenizer, ids("12"), ids("3+4"), ("3",)) == 1
    assert stop_string_cut(tokenizer, ids("12"), ids("3+4"), ("23",)) == 1  # begun in the prompt, as transformers
    assert stop_string_cut(tokenizer, ids("12"), ids("3+4"), ("12",)) is None  # wholly in the prompt: never
    assert stop_string_cut(tokenizer, ids("12"), ids("3+4"), ("5", "+")) == 2  # the first of several
    assert stop_string_cut(tokenizer, [], ids("3+4"), ("9",)) is None
    assert stop_string_cut(tokenizer, ids("1"), [], ("1",)) is None


def test_sampling_params_stop():
    assert SamplingParams(8).stop == ()
    assert SamplingParams(8, stop=OUTPUT_STOP).stop == (OUTPUT_STOP,)
    assert SamplingParams(8, stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(8, stop=("",))


def test_generation_stops_after_the_stop_string(ascii_tokenizer):
    """Same seed with and without a stop string: the same tokens up to the stop, then the
    completion ends there, the stop string in its text, the mask ending on its last token."""
    tokenizer = ascii_tokenizer
    tiny_model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    prompts = ["Q: 1+2\n", "Q: 30-4+5\n", "Q: 7\n"]
    torch.manual_seed(3)
    free = sample_groups(tiny_model, tokenizer, prompts, 1, SamplingParams(max_new_tokens=24))
    # the stop string: two characters of the longest completion (an early EOS may leave others short)
    source = max(range(len(prompts)), key=lambda row: len(free.completions[row]))
    text = free.completions[source]
    assert len(text) >= 12, free.completions
    stop = text[10:12]
    torch.manual_seed(3)
    stopped = sample_groups(tiny_model, tokenizer, prompts, 1, SamplingParams(max_new_tokens=24, stop=(stop,)))
    for row, (prompt, full) in enumerate(zip(prompts, free.completions)):
        # transformers stops where the stop string first ends inside the completion; it may
        # begin in the prompt's last characters (one character per token with this tokenizer).
        tail = prompt[len(prompt) - (len(stop) - 1) :]
        at = (tail + full).find(stop)
        got, mask = stopped.completions[row], stopped.completion_mask[row]
        if at < 0:
            assert got == full and torch.equal(mask, free.completion_mask[row])
            continue
        end = at + len(stop) - len(tail)
        assert got == full[:end]
        assert int(mask.sum()) == end and mask[:end].all() and not mask[end:].any()
        assert not stopped.truncated[row]
        assert torch.equal(stopped.completion_ids[row, :end], free.completion_ids[row, :end])
        assert (stopped.completion_ids[row, end:] == tokenizer.pad_token_id).all()
    assert stopped.completions[source].endswith(stop)


def test_stop_strings_need_a_vocabulary_transformers_can_read(tiny_model, tokenizer):
    # The demo's arithmetic vocabulary has no letters; transformers' stop_strings cannot use it.
    with pytest.raises(ValueError, match="stop_strings cannot use this tokenizer"):
        sample_groups(tiny_model, tokenizer, ["Q: 1+2\n"], 1, SamplingParams(4, stop=("+",)))


# --- answers and data ----------------------------------------------------------------------


def test_extract_answer():
    assert extract_answer("so \\boxed{1} or rather \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert extract_answer("```python\nprint(7)\n```\n```output\n7\n```\n") == "7"
    assert extract_answer("We get 5.\nA: 5") == "5"
    assert extract_answer("#### 12") == "12"
    assert extract_answer("no answer here") is None


def test_grade_uses_math_verify():
    assert grade(["\\frac{1}{2}", "0.5", "1,000", "$18", None, "3"], ["0.5", "\\frac12", "1000", "18", "1", "4"]) == [
        True, True, True, True, False, False]


def test_load_benchmark_formats(tmp_path):
    gsm8k = load_benchmark(str(GSM8K), max_rows=2)
    assert gsm8k.format == "gsm8k" and gsm8k.references == ["18", "3"] and len(gsm8k) == 2
    assert gsm8k.questions[0].startswith("Janet")
    math500 = load_benchmark(str(MATH500), max_rows=1)
    assert math500.format == "math" and math500.references == ["p - q"]  # its answer field
    math = load_benchmark(str(FIXTURES / "math_test_sample.jsonl"), max_rows=1)
    assert math.format == "math" and math.references == ["52"]  # the solution's last box
    plain = load_benchmark(str(SOLUTIONS), max_rows=1)  # question + ground_truth ending in "A: 64"
    assert (plain.question_column, plain.answer_column, plain.references) == ("question", "ground_truth", ["64"])
    named = load_benchmark(f"mine={GSM8K}", max_rows=1)
    assert named.name == "mine"
    assert dataset_name("data/gsm8k/test.jsonl") == "gsm8k"
    assert dataset_name(str(MATH500)) == "math500_sample"


def test_prompts(ascii_tokenizer):
    assert render_prompt(" What is 1+1? ", "cot", ascii_tokenizer) == (
        "User: What is 1+1?\nPlease reason step by step, and put your final answer within \\boxed{}.\n\nAssistant:")
    assert "integrate natural language reasoning with programs" in render_prompt("Q", "tir", ascii_tokenizer)
    assert prompt_format(ascii_tokenizer) == "plain"
    chat = build_char_tokenizer(ASCII_ALPHABET)
    chat.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert prompt_format(chat) == "chat template"
    assert render_prompt("Q", "cot", chat) == f"<user>Q\n{COT_INSTRUCTION}<assistant>"


# --- the TIR glue on a scripted engine -----------------------------------------------------


def _plain_file(tmp_path, rows):
    path = tmp_path / "plain.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_tir_glue_runs_the_program_and_appends_its_output(tmp_path, ascii_tokenizer, scripted_engine):
    bench = load_benchmark(str(_plain_file(tmp_path, [{"question": "What is 6 times 7?", "answer": "42"}])))
    call = "Compute it.\n```python\nx = 6 * 7\nprint(x)\n```\n" + OUTPUT_STOP
    engine = scripted_engine(ascii_tokenizer, {"Assistant:": call, "```output\n42\n```\n": "So \\boxed{42}."})
    timings = Timings()
    # max_new_tokens bounds the whole completion, tool output included (74 characters here)
    [record] = evaluate_chunk(bench, [0], "tir", engine, ascii_tokenizer, EvalSettings(max_new_tokens=80), timings)
    assert record["completion"] == call + "\n42\n```\nSo \\boxed{42}."
    assert (record["tool_calls"], record["extracted_answer"], record["correct"]) == (1, "42", True)
    assert record["stop_reason"] == "answer" and record["reference"] == "42"
    assert [p.stop for p in engine.params] == [(OUTPUT_STOP,), (OUTPUT_STOP,)] and engine.params[0].temperature == 0
    assert timings.programs == 1 and timings.generate_calls == 2 and timings.tools > 0
    # CoT: one generation, no stop string, the program never runs.
    engine = scripted_engine(ascii_tokenizer, {"Assistant:": call})
    [cot] = evaluate_chunk(bench, [0], "cot", engine, ascii_tokenizer, EvalSettings(max_new_tokens=64), Timings())
    assert cot["completion"] == call and cot["tool_calls"] == 0 and not cot["correct"]
    assert [p.stop for p in engine.params] == [()]


def test_tir_glue_tool_limit_samples_and_context_limit(tmp_path, ascii_tokenizer, scripted_engine):
    bench = load_benchmark(str(_plain_file(tmp_path, [{"question": "Loop?", "answer": "3"}])))
    call = "```python\nprint(3)\n```\n" + OUTPUT_STOP
    engine = scripted_engine(ascii_tokenizer, {"Assistant:": call, "```\n": call})
    settings = EvalSettings(max_new_tokens=80, max_tool_calls=2, k=3, temperature=0.7)  # 2 x (32 + 7) tokens
    [record] = evaluate_chunk(bench, [0], "tir", engine, ascii_tokenizer, settings, Timings())
    # Two rounds, each running the program; the last output is the answer (tool_limit).
    assert record["tool_calls"] == 2 and record["stop_reason"] == "tool_limit" and record["correct"]
    assert len(record["samples"]) == 3 and all(s["correct"] and s["tool_calls"] == 2 for s in record["samples"])
    summary = metrics([record], 3)
    assert (summary["maj@3"], summary["pass@3"], summary["accuracy"]) == (1.0, 1.0, 1.0)
    # A context with no room for max_new_tokens more tokens ends without a generation.
    short = EvalSettings(max_new_tokens=16, max_model_len=20)
    [limited] = evaluate_chunk(bench, [0], "tir", engine, ascii_tokenizer, short, Timings())
    assert limited["completion"] == "" and limited["stop_reason"] == "context_limit"


def test_sampling_seeds_depend_on_the_prompt_and_repeat_only():
    a = prompt_seeds(1, ["x", "y", "x"])
    assert a[0] != a[2] and len(set(a)) == 3
    assert prompt_seeds(1, ["y", "x", "x"]) == [a[1], a[0], a[2]]  # not the batch's order
    assert prompt_seeds(2, ["x"]) != a[:1]


# --- the command end to end ----------------------------------------------------------------


TINY_RUN = ["--grpo.max_completion_length", "8", "--max-tool-calls", "2", "--quiet"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, saved_model):
    out = tmp_path_factory.mktemp("eval") / "before"
    assert run_cli(saved_model, "--data", GSM8K, MATH500, "--mode", "cot,tir", "--max-rows", "3",
                   "--output-dir", out, *TINY_RUN) == 0
    return out


def test_command_writes_results_report_and_completions(run_dir, saved_model, capsys):
    results = json.loads((run_dir / "results.json").read_text())
    assert results["model"] == str(saved_model) and results["engine"] == "hf"
    assert results["prompt_format"] == "plain" and results["prompt_layout"] == "User: {prompt}\n\nAssistant:"
    assert isinstance(results["sandbox_isolated"], bool)
    assert set(results["results"]) == {"gsm8k_test_sample", "math500_sample"}
    for dataset, modes in results["results"].items():
        assert set(modes) == {"cot", "tir"}
        for mode, cell in modes.items():
            assert cell["total"] == 3 and 0 <= cell["correct"] <= 3 and cell["accuracy"] == cell["correct"] / 3
            assert cell["seconds"] >= cell["generate_seconds"] > 0 and cell["resumed"] == 0
            records = read_jsonl(run_dir / f"completions-{dataset}-{mode}.jsonl")
            assert [r["index"] for r in records] == [0, 1, 2]
            for r in records:
                assert r["prompt"].startswith("User: ") and r["prompt"].endswith("\n\nAssistant:")
                assert ("programs" in r["prompt"]) == (mode == "tir")
                assert {"completion", "extracted_answer", "correct", "tool_calls", "stop_reason"} <= set(r)
    report = (run_dir / "report.md").read_text()
    header = "| model | gsm8k_test_sample CoT | gsm8k_test_sample TIR | math500_sample CoT | math500_sample TIR |"
    assert header in report


def test_command_resumes_and_refuses_other_settings(tmp_path, saved_model, capsys):
    out = tmp_path / "run"
    assert run_cli(saved_model, "--data", GSM8K, "--mode", "cot", "--max-rows", "2", "--output-dir", out,
                   *TINY_RUN) == 0
    assert "prompts use the layout" in capsys.readouterr().err
    path = out / "completions-gsm8k_test_sample-cot.jsonl"
    first = path.read_text()
    with path.open("a") as f:
        f.write('{"index": 2, "quest')  # a write cut short by a crash
    assert run_cli(saved_model, "--data", GSM8K, "--mode", "cot", "--max-rows", "4", "--output-dir", out,
                   *TINY_RUN) == 0
    assert "dropping the incomplete last line" in capsys.readouterr().err
    assert path.read_text().startswith(first)  # the done rows were kept, not regenerated
    assert [r["index"] for r in read_jsonl(path)] == [0, 1, 2, 3]
    cell = json.loads((out / "results.json").read_text())["results"]["gsm8k_test_sample"]["cot"]
    assert cell["resumed"] == 2 and cell["total"] == 4
    # Nothing left to do: a rerun generates nothing.
    assert run_cli(saved_model, "--data", GSM8K, "--mode", "cot", "--max-rows", "4", "--output-dir", out,
                   *TINY_RUN) == 0
    assert len(read_jsonl(path)) == 4
    assert json.loads((out / "results.json").read_text())["results"]["gsm8k_test_sample"]["cot"]["resumed"] == 4
    # Fewer rows: the rest stay in the file, out of the results.
    assert run_cli(saved_model, "--data", GSM8K, "--mode", "cot", "--max-rows", "3", "--output-dir", out,
                   *TINY_RUN) == 0
    assert len(read_jsonl(path)) == 4
    assert json.loads((out / "results.json").read_text())["results"]["gsm8k_test_sample"]["cot"]["total"] == 3
    capsys.readouterr()
    assert run_cli(saved_model, "--data", GSM8K, "--mode", "cot", "--max-rows", "4", "--output-dir", out,
                   "--grpo.max_completion_length", "9", "--quiet") == 1
    assert "max_new_tokens 8 -> 9" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "old"), [
    (["--eval.k", "4", "--grpo.max_completion_length", "32"], []),
    (["--k", "4", "--max-new-tokens", "32"], ["--k", "--max-new-tokens"]),
    (["--k=4", "--grpo.max_completion_length=32"], ["--k"]),
])
def test_eval_takes_the_dotted_keys_and_for_now_the_old_flags(argv, old, capsys):
    """--eval.k and --grpo.max_completion_length, as every other command spells them; --k and
    --max-new-tokens still work for one release, each with a one-line deprecation warning."""
    from grpokit.eval.command import _parser

    args = _parser().parse_args(["model", "--data", "x.jsonl", *argv])
    assert (args.k, args.max_new_tokens) == (4, 32)
    warned = capsys.readouterr().err.splitlines()
    new = {"--k": "--eval.k", "--max-new-tokens": "--grpo.max_completion_length"}
    assert warned == [f"grpokit: warning: {flag} is deprecated: use {new[flag]} (the old flag goes in the next "
                      "release)" for flag in old]
    assert "--k " not in _parser().format_help() and "--eval.k K" in _parser().format_help()


def test_a_bad_value_names_the_dotted_option(saved_model, tmp_path, capsys):
    assert run_cli(saved_model, "--data", GSM8K, "--output-dir", tmp_path, "--eval.k", "-1") == 1
    assert run_cli(saved_model, "--data", GSM8K, "--output-dir", tmp_path, "--max-new-tokens", "0") == 1
    err = capsys.readouterr().err
    assert "--eval.k must be 0 or more, got -1" in err
    assert "--grpo.max_completion_length must be at least 1, got 0" in err


def test_command_with_k_samples_reports_maj_and_pass(tmp_path, saved_model, capsys):
    out = tmp_path / "k"
    assert run_cli(saved_model, "--data", MATH500, "--mode", "cot", "--max-rows", "2", "--eval.k", "2",
                   "--temperature", "1.0", "--output-dir", out, *TINY_RUN) == 0
    cell = json.loads((out / "results.json").read_text())["results"]["math500_sample"]["cot"]
    assert 0.0 <= cell["maj@2"] <= cell["pass@2"] <= 1.0
    assert all(len(r["samples"]) == 2 for r in read_jsonl(out / "completions-math500_sample-cot.jsonl"))
    assert "| maj@2 |" in capsys.readouterr().out


def test_run_directory_resolves_to_its_newest_checkpoint(tmp_path, saved_model, ascii_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved_model)
    manager = CheckpointManager(tmp_path / "run" / "checkpoints")
    for step in (1, 2):
        manager.save(step, model, ascii_tokenizer)
    assert resolve_model(str(tmp_path / "run")) == str(tmp_path / "run" / "checkpoints" / "step-2")
    assert resolve_model(str(saved_model)) == str(saved_model)
    assert resolve_model("someone/some-model") == "someone/some-model"


# --- --compare -----------------------------------------------------------------------------


def _results(model, cells):
    return {"model": model,
            "results": {d: {m: {"accuracy": a} for m, a in modes.items()} for d, modes in cells.items()}}


def test_compare_table_golden():
    before = _results("base", {"gsm8k": {"cot": 0.25, "tir": 0.5}, "math": {"cot": 0.1}})
    after = _results("rl", {"gsm8k": {"cot": 0.5, "tir": 0.5}, "math": {"cot": 0.125, "tir": 0.2}})
    assert compare_markdown(before, after, "base", "rl").splitlines()[2:] == [
        "| model | gsm8k CoT | gsm8k TIR | math CoT | math TIR |",
        "|---|---|---|---|---|",
        "| base | 25.0 | 50.0 | 10.0 | - |",
        "| rl | 50.0 | 50.0 | 12.5 | 20.0 |",
        "| change | +25.0 | +0.0 | +2.5 | - |",
    ]


def test_compare_table_with_paired_intervals_golden():
    from grpokit.eval.paired import paired_change

    before = _results("base", {"gsm8k": {"cot": 0.25, "tir": 0.5}})
    after = _results("rl", {"gsm8k": {"cot": 0.75, "tir": 0.5}})
    # d = [1, 1, 0, 0]: +50 pt, s = sqrt(1/3), half-width 1.96 * sqrt(1/3) / 2 = 0.566
    intervals = {("gsm8k", "cot"): paired_change([False, False, True, False], [True, True, True, False])}
    lines = compare_markdown(before, after, "base", "rl", intervals).splitlines()
    assert lines[-2:] == ["| change | +50.0 | +0.0 |", "| 95% interval | [-6.6, +106.6] | - |"]
    assert "paired" in lines[0]


def test_compare_pairs_the_questions_both_evaluations_graded(tmp_path):
    from grpokit.eval.records import completions_path
    from grpokit.eval.report import paired_intervals

    def write(directory, verdicts, total):
        directory.mkdir()
        path = completions_path(directory, "gsm8k", "cot")
        path.write_text("".join(json.dumps({"index": i, "question": f"q{i}", "correct": ok}) + "\n"
                                for i, ok in verdicts.items()))
        (directory / "results.json").write_text(json.dumps(
            {"results": {"gsm8k": {"cot": {"accuracy": 0.5, "total": total}}, "math": {"cot": {"total": 1}}}}))

    # question 3 is not graded after; question 4 is in the file from an earlier, larger --max-rows run,
    # but not in the results the table shows: both left out
    write(tmp_path / "a", {0: False, 1: False, 2: True, 3: True, 4: False}, total=4)
    write(tmp_path / "b", {0: True, 1: False, 2: True, 4: True}, total=4)
    [(column, change)] = paired_intervals(tmp_path / "a", tmp_path / "b", [("gsm8k", "cot"), ("math", "cot")]).items()
    assert column == ("gsm8k", "cot") and (change.n, change.gained, change.lost) == (3, 1, 0)


def test_compare_command(run_dir, tmp_path, capsys):
    after = tmp_path / "after"
    after.mkdir()
    results = json.loads((run_dir / "results.json").read_text())
    results["model"] = "after-model"
    results["results"]["gsm8k_test_sample"]["cot"]["accuracy"] += 1 / 3
    (after / "results.json").write_text(json.dumps(results))
    capsys.readouterr()
    assert run_cli("--compare", run_dir, after) == 0
    printed = capsys.readouterr().out
    table = (after / "compare.md").read_text()
    assert table in printed and "| after-model |" in table and "| change | +33.3 | +0.0 | +0.0 | +0.0 |" in table
    assert run_cli("--compare", run_dir, after, "--output-dir", tmp_path / "elsewhere") == 0
    assert (tmp_path / "elsewhere" / "compare.md").read_text() == table


# --- scoring mode --------------------------------------------------------------------------


def _agreement(path: Path, tmp_path: Path) -> tuple[int, int]:
    labels = read_jsonl(path)
    agree = total = 0
    for name in SOLUTION_MODELS:
        out = tmp_path / name
        assert run_cli("--completions", path, "--data", path, "--completion-column", f"{name}.solution",
                       "--output-dir", out) == 0
        [scored] = list(out.glob("completions-*-cot.jsonl"))
        records = read_jsonl(scored)
        assert len(records) == len(labels)
        for r in records:
            total += 1
            agree += r["correct"] == labels[r["index"]][name]["is_correct"]
    return agree, total


def test_scoring_agrees_with_the_gsm8k_labels(tmp_path):
    agree, total = _agreement(SOLUTIONS, tmp_path)
    assert total == 120 and agree / total >= 0.999


@pytest.mark.skipif(not (DATA / "gsm8k" / "example_model_solutions.jsonl").is_file(),
                    reason=f"GSM8K example_model_solutions.jsonl not found under {DATA} (set GRPOKIT_DATA)")
def test_scoring_agrees_with_all_gsm8k_labels(tmp_path):
    agree, total = _agreement(DATA / "gsm8k" / "example_model_solutions.jsonl", tmp_path)
    assert total == 4 * 1319 and agree / total >= 0.999


def test_scoring_by_order_and_by_key(tmp_path):
    data = _plain_file(tmp_path, [{"question": "A?", "answer": "1"}, {"question": "B?", "answer": "2"}])
    by_order = tmp_path / "order.jsonl"
    by_order.write_text('{"completion": "\\\\boxed{1}"}\n{"completion": "\\\\boxed{3}"}\n')
    cell = grade_completion_file(str(by_order), str(data))["results"]["plain"]["cot"]
    assert (cell["correct"], cell["total"], cell["accuracy"]) == (1, 2, 0.5)
    by_key = tmp_path / "key.jsonl"
    by_key.write_text('{"q": "B?", "text": "\\\\boxed{2}"}\n{"q": " A? ", "text": "A: 1"}\n')
    cell = grade_completion_file(str(by_key), str(data), "text", key="q", mode="tir",
                             out_dir=str(tmp_path / "out"))["results"]["plain"]["tir"]
    assert (cell["correct"], cell["total"]) == (2, 2)
    assert [r["index"] for r in read_jsonl(tmp_path / "out" / "completions-plain-tir.jsonl")] == [1, 0]


# --- bad inputs ----------------------------------------------------------------------------


def test_errors_name_the_problem(tmp_path, saved_model, capsys):
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"text": "What?", "label": "1"}\n')
    with pytest.raises(DatasetError, match=r"odd.jsonl: no question column .*\['label', 'text'\]"):
        load_benchmark(str(odd))
    half = tmp_path / "half.jsonl"
    half.write_text('{"question": "What?", "label": "1"}\n')
    with pytest.raises(DatasetError, match=r"half.jsonl: no answer column .*\['label', 'question'\]"):
        load_benchmark(str(half))
    assert load_benchmark(str(half), answer_column="label").references == ["1"]

    def fails(*args, match):
        assert run_cli(*args) == 1
        assert match in capsys.readouterr().err

    out = tmp_path / "out"
    fails(saved_model, "--data", odd, "--output-dir", out, match="columns ['label', 'text']")
    fails(saved_model, "--data", tmp_path / "missing.jsonl", "--output-dir", out, match="missing.jsonl' does not exist")
    fails(saved_model, "--data", GSM8K, "--mode", "pot", "--output-dir", out, match="--mode takes cot, tir")
    fails(saved_model, "--data", GSM8K, match="usage: grpokit eval MODEL")
    fails(saved_model, "--data", f"a={GSM8K}", f"a={MATH500}", "--output-dir", out, match="named 'a'")
    fails(tmp_path, "--data", GSM8K, "--output-dir", out, match="neither a model directory")
    fails(saved_model, "--data", GSM8K, "--eval.k", "2", "--temperature", "0", "--output-dir", out,
          match="--temperature > 0")
    fails("--compare", tmp_path, out, match="results.json does not exist")
    fails("--completions", SOLUTIONS, "--data", GSM8K, "--max-rows", "1", "--completion-column",
          "6b_finetuning.solution", match="its question matches no question")
    by_order = tmp_path / "order.jsonl"
    by_order.write_text('{"completion": "1"}\n')
    fails("--completions", by_order, "--data", GSM8K, match="1 completions for 30 rows")
    assert run_cli("--completions", by_order, "--data", GSM8K, "--max-rows", "1") == 0  # both cut to one
    fails("--completions", by_order, "--data", GSM8K, "--completion-column", "text", "--max-rows", "1",
          match="no text in column 'text'")
    fails("--compare", tmp_path, out, "--data", GSM8K, match="--compare takes two evaluation directories")
