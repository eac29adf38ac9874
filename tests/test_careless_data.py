"""A careless user's data never ends in a traceback: a LaTeX box without braces is read as LaTeX
reads it, an unreadable reference, a file that is not UTF-8 text and a wrong column name each
give one line naming the place and the fix, and every question left out is counted. The commands
run for real, in subprocesses; the paper's example runs on the real GSM8K and MATH files."""

import functools
import gzip
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from grpokit.pipeline.build import ASCII_ALPHABET
from grpokit.run.checkpoint import save_checkpoint
from grpokit.config import DataSource
from grpokit.data.files import DatasetError
from grpokit.data.sources import load_source
from grpokit.run.metrics import read_metrics
from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.data.answers import math_reference, reference_boxes
from run_helpers import cli

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("GRPOKIT_DATA") or REPO.parent / "shared" / "data")
# A tiny one-step run: the tests look at what the data stage says, not at learning.
ONE_STEP = ["--grpo.max_steps=1", "--prompts_per_step=2", "--num_generations=2", "--max_completion_length=4",
            "--eval.k=1", "--quiet"]
PLAIN_PROMPTS = ["--data.template=none", "--data.chat_template=off"]  # a question of n characters is n+1 tokens
SKIP = "or set data.skip_malformed_lines=true to skip and count such rows"


grpokit = functools.partial(cli, check=False, timeout=300)  # each test checks how the command failed


def fails(proc: subprocess.CompletedProcess, message: str, code: int = 1) -> None:
    """The command stopped with `code` and one line holding `message`, without a traceback."""
    assert proc.returncode == code, proc.stderr[-3000:]
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def succeeds(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sources(key: str, *paths, **options) -> str:
    """--data.KEY=[...] naming each path, with the same extra options on each."""
    extra = "".join(f", {k}: {v}" for k, v in options.items())
    return f"--data.{key}=[" + ", ".join(f"{{path: '{p}'{extra}}}" for p in paths) + "]"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny random Llama with a printable-ASCII character tokenizer, saved in hub format."""
    tokenizer = build_char_tokenizer(ASCII_ALPHABET)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    return save_checkpoint(model, tokenizer, tmp_path_factory.mktemp("model") / "tiny")


# --------------------------------------------------------------------------- \boxed as LaTeX reads it

# LaTeX reads a macro's one argument thus: spaces are skipped, then a {group} gives its contents,
# and anything else gives the single next token: one character ("\boxed 2" boxes 2) or one control
# sequence ("\boxed\pi" boxes \pi). So "\boxed \frac12" boxes a bare \frac (LaTeX then fails on it)
# and "\boxed 12" boxes only the 1: neither is the answer its author meant, so neither is read.
READ_AS_LATEX_DOES = [
    (r"our answer is $\boxed 2$.", "2"),
    (r"$x = \boxed{2}$", "2"),
    (r"$\boxed{\frac{1}{2}}$", r"\frac{1}{2}"),
    (r"\boxed {7}", "7"),
    (r"\fbox{4}", "4"),
    (r"$\boxed\pi$", r"\pi"),
    (r"\[\boxed 7\]", "7"),
    (r"so it is \boxed 9. Done", "9"),
    (r"\boxed{a \} b}", r"a \} b"),
    (r"first \boxed{1}, at last \boxed 3", "3"),  # the last box is the answer
    (r"\boxed{\boxed{3}}", r"\boxed{3}"),  # only outermost boxes count
]
NOT_AN_ANSWER = [
    (r"$\boxed \frac12$", "cannot be read"),  # the box holds a bare \frac
    (r"$\boxed 12$", "cannot be read"),  # LaTeX boxes only the 1
    (r"$\boxed x+1$", "cannot be read"),
    (r"$\boxed$", "cannot be read"),  # a math shift cannot be boxed
    (r"\boxed }", "cannot be read"),
    (r"so \boxed", "cannot be read"),
    (r"\boxed{1", "cannot be read"),  # braces that never close
    (r"there are $\boxed{}$ primes", "is empty"),  # MATH train.jsonl:5342
    (r"$\boxed{ }$", "is empty"),
    ("no box at all", r"has no \boxed{...} answer"),
]


@pytest.mark.parametrize("solution, reference", READ_AS_LATEX_DOES)
def test_a_reference_box_is_read_as_latex_reads_it(solution, reference):
    assert math_reference(solution) == reference


@pytest.mark.parametrize("solution, problem", NOT_AN_ANSWER)
def test_a_box_that_is_not_the_authors_answer_is_refused_saying_why(solution, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        math_reference(solution)
    assert math_reference(solution, answer=" 12 ") == "12"  # an answer field always wins


def test_reference_boxes_lists_every_outermost_box_and_none_for_an_unreadable_one():
    assert reference_boxes(r"\boxed 1, \boxed{2}, \fbox{\boxed{3}}, \boxed 45") == ["1", "2", r"\boxed{3}", None]
    assert reference_boxes(r"\boxedx 3 \boxedtext{4}") == []  # other commands that start alike


# --------------------------------------------------------------------------- the paper's example, real files


@pytest.mark.skipif(not (DATA / "math" / "train.jsonl").is_file(),
                    reason=f"reference data not found at {DATA} (set GRPOKIT_DATA)")
def test_the_papers_example_runs_on_the_real_gsm8k_and_math_files(tmp_path, tiny):
    """examples/gsm8k_math_grpo.yaml as a user runs it, from a folder whose data/ holds the real
    files: every training row is read (MATH's train.jsonl writes \\boxed 2 on line 889 and \\boxed 9
    on line 1012, and boxes nothing on lines 5342 and 5344), only the budget is made tiny."""
    (tmp_path / "data").symlink_to(DATA.resolve())
    heldout = "[{path: data/gsm8k/test.jsonl, format: gsm8k, max_rows: 8}, " \
              "{path: data/math500/test.jsonl, format: math, max_rows: 8}]"
    proc = succeeds(grpokit(
        "train", REPO / "examples" / "gsm8k_math_grpo.yaml", f"--model.name_or_path={tiny}", "--model.dtype=fp32",
        "--model.device=cpu", f"--output_dir={tmp_path / 'run'}", f"--data.eval_sources={heldout}",
        "--grpo.max_steps=2", "--grpo.num_generations=2", "--grpo.prompts_per_step=2",
        "--grpo.max_completion_length=8", "--grpo.generation_batch_size=4", "--grpo.micro_batch_size=4",
        "--eval.k=2", "--quiet", "--data.validation_fraction=0",  # every row read trains
        cwd=tmp_path, timeout=600))
    assert proc.stderr.count("grpokit: skipped data/math/train.jsonl:") == 2
    assert "skipped data/math/train.jsonl:5342: the MATH solution's last box is empty" in proc.stderr
    assert "grpokit: skipped 2 malformed rows of data/math/train.jsonl" in proc.stderr
    # 7473 GSM8K + 7498 MATH questions read; the character tokenizer drops some over 512 tokens
    assert re.search(r"grpokit: \d+ of 14971 RL questions are over data.max_prompt_length=512", proc.stderr)
    assert re.search(r"\d+ RL questions, \d+ held-out questions", proc.stdout)
    assert "held-out greedy accuracy" in proc.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]


# --------------------------------------------------------------------------- references: train and eval


@pytest.fixture
def math_file(tmp_path) -> Path:
    """MATH rows: a braced box, a brace-less one (as MATH's train.jsonl:889), and an empty one."""
    return write_jsonl(tmp_path / "math.jsonl", [
        {"problem": "What is 1+1?", "solution": "It is $\\boxed{2}$."},
        {"problem": "What is 3*3?", "solution": "So $x = \\boxed 9$."},
        {"problem": "How many primes?", "solution": "There are $\\boxed{}$ primes."},
    ])


def test_train_names_the_line_of_an_unreadable_reference_before_any_model_loads(tmp_path, math_file):
    run = tmp_path / "run"
    proc = grpokit("train", sources("sources", math_file, format="math"), f"--output_dir={run}", *ONE_STEP)
    fails(proc, f"grpokit: error: {math_file}:3: the MATH solution's last box is empty ('There are $\\\\boxed{{}}$ "
                f"primes.'): write it as \\boxed{{<answer>}}, or give the row an 'answer' field; {SKIP}")
    assert not run.exists()


def test_train_skips_and_counts_an_unreadable_reference(tmp_path, math_file):
    run = tmp_path / "run"
    proc = succeeds(grpokit("train", sources("sources", math_file, format="math"), "--data.heldout_fraction=0",
                            "--data.skip_malformed_lines=true", f"--output_dir={run}", *ONE_STEP))
    assert f"grpokit: skipped 1 malformed rows of {math_file}" in proc.stderr
    assert "2 RL questions" in proc.stdout  # \boxed{2} and \boxed 9
    assert len(read_metrics(run / "metrics.jsonl")) == 1


def test_eval_reads_references_as_training_does(tmp_path, math_file):
    completions = write_jsonl(tmp_path / "completions.jsonl", [
        {"question": "What is 1+1?", "completion": "\\boxed{2}"},
        {"question": "What is 3*3?", "completion": "\\boxed{9}"},
    ])
    refused = grpokit("eval", "--completions", completions, "--data", math_file)
    fails(refused, f"grpokit: error: {math_file}:3: the MATH solution's last box is empty")
    assert "; or pass --skip-malformed-lines to skip and count such rows" in refused.stderr
    proc = succeeds(grpokit("eval", "--completions", completions, "--data", math_file, "--skip-malformed-lines"))
    assert f"grpokit: skipped 1 malformed rows of {math_file}" in proc.stderr
    assert "| 100.0 |" in proc.stdout  # the \boxed 9 row's reference is 9


# --------------------------------------------------------------------------- prompts over data.max_prompt_length


def questions(*lengths: int) -> list[dict]:
    """GSM8K rows whose questions have the given lengths in characters."""
    return [{"question": f"{i}?".rjust(n, "x"), "answer": f"It is {i}.\n#### {i}"} for i, n in enumerate(lengths)]


def test_held_out_questions_over_the_limit_are_dropped_and_counted_never_truncated(tmp_path, tiny):
    train = write_jsonl(tmp_path / "train.jsonl", questions(10, 10, 10, 10, 60))
    heldout = write_jsonl(tmp_path / "heldout.jsonl", questions(10, 60, 60, 60))
    proc = succeeds(grpokit("train", f"--model.name_or_path={tiny}", sources("sources", train),
                            sources("eval_sources", heldout), *PLAIN_PROMPTS, "--data.max_prompt_length=40",
                            "--data.long_prompts=truncate", f"--output_dir={tmp_path / 'run'}", *ONE_STEP))
    assert ("grpokit: 1 of 5 RL questions are over data.max_prompt_length=40 tokens and were cut to their last 40 "
            "tokens (data.long_prompts=truncate)") in proc.stderr
    assert ("grpokit: 3 of 4 held-out questions are over data.max_prompt_length=40 tokens and were dropped "
            "(evaluation never truncates a question); raise data.max_prompt_length to keep them") in proc.stderr
    assert "5 RL questions, 1 held-out questions" in proc.stdout
    assert "held-out questions: 1" in proc.stdout


def test_no_held_out_questions_says_the_true_reason(tmp_path, tiny):
    train = write_jsonl(tmp_path / "train.jsonl", questions(10, 10, 60))
    heldout = write_jsonl(tmp_path / "heldout.jsonl", questions(60, 60))
    proc = succeeds(grpokit("train", f"--model.name_or_path={tiny}", sources("sources", train),
                            sources("eval_sources", heldout), *PLAIN_PROMPTS, "--data.max_prompt_length=40",
                            f"--output_dir={tmp_path / 'run'}", *ONE_STEP))
    assert ("grpokit: 1 of 3 RL questions are over data.max_prompt_length=40 tokens and were dropped "
            "(data.long_prompts=skip); raise data.max_prompt_length to keep them") in proc.stderr
    assert ("grpokit: no held-out questions: all 2 are over data.max_prompt_length=40 tokens and were dropped "
            "(evaluation never truncates a question); raise data.max_prompt_length to evaluate them; training "
            "without evaluation") in proc.stderr
    assert "none configured" not in proc.stderr and "2 RL questions, 0 held-out questions" in proc.stdout


def test_sft_counts_the_demonstrations_over_the_limit(tmp_path, tiny):
    demos = write_jsonl(tmp_path / "demos.jsonl", questions(10, 10, 60))
    proc = succeeds(grpokit("sft", f"--model.name_or_path={tiny}", sources("sft_sources", demos), *PLAIN_PROMPTS,
                            "--data.max_prompt_length=40", "--sft.max_steps=1", "--sft.batch_size=2",
                            "--sft.warmup_steps=0", f"--output_dir={tmp_path / 'run'}", "--quiet"))
    assert ("grpokit: 1 of 3 SFT demonstrations are over data.max_prompt_length=40 tokens and were dropped "
            "(data.long_prompts=skip); raise data.max_prompt_length to keep them") in proc.stderr
    assert "(2 demonstrations" in proc.stdout


def test_eval_counts_the_questions_that_do_not_fit_the_context(tmp_path, tiny):
    data = write_jsonl(tmp_path / "qs.jsonl", questions(10, 400))
    out = tmp_path / "out"
    proc = succeeds(grpokit("eval", tiny, "--data", data, "--mode", "cot", "--max-model-len", "300",
                            "--grpo.max_completion_length", "8", "--output-dir", out, "--quiet"))
    assert ("grpokit: 1 of 2 qs CoT questions do not fit --max-model-len=300 with --grpo.max_completion_length=8: "
            "they get no completion and count as wrong (evaluation never truncates a question); raise --max-model-len or lower "
            "--grpo.max_completion_length") in proc.stderr
    cell = json.loads((out / "results.json").read_text())["results"]["qs"]["cot"]
    assert (cell["too_long"], cell["total"], cell["stop_reasons"].get("context_limit")) == (1, 2, 1)


# --------------------------------------------------------------------------- files that are not UTF-8 text


@pytest.fixture
def latin1_file(tmp_path) -> Path:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "Q?", "answer": "#### 1"}\n{"question": "Caf\xe9?", "answer": "#### 2"}\n')
    return path


NOT_UTF8 = "not UTF-8 text (byte 56 is 0xe9); convert it to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8 IN > OUT), " \
           "or pass a JSONL, JSON or Parquet file"


def test_train_and_sft_name_a_file_that_is_not_utf8_before_any_model_loads(tmp_path, latin1_file):
    for command, key in (("train", "sources"), ("sft", "sft_sources")):
        run = tmp_path / command
        fails(grpokit(command, sources(key, latin1_file), f"--output_dir={run}", "--quiet"),
              f"grpokit: error: {latin1_file}:2: {NOT_UTF8}")
        assert not run.exists()


def test_eval_names_a_file_that_is_not_utf8(tmp_path, latin1_file):
    proc = grpokit("eval", "no-such-model", "--data", latin1_file, "--output-dir", tmp_path / "out")
    fails(proc, f"grpokit: error: {latin1_file}:2: {NOT_UTF8}")


def test_binary_files_say_what_they_are(tmp_path):
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_bytes(b"PAR1\x15\x04\x15\x80\x80\x80\xff" * 4)
    with pytest.raises(DatasetError, match=r"renamed.jsonl:1: not UTF-8 text .*it is a Parquet file: give it the "
                                           r"\.parquet suffix"):
        load_source(DataSource(path=str(renamed)))
    zipped = tmp_path / "zipped.jsonl"
    zipped.write_bytes(gzip.compress(b'{"prompt": "Q", "answer": "1"}\n'))
    with pytest.raises(DatasetError, match=r"zipped.jsonl:1: not UTF-8 text .*it is gzip-compressed: gunzip it"):
        load_source(DataSource(path=str(zipped)))
    listed = tmp_path / "rows.json"
    listed.write_bytes(b'[{"prompt": "Q", "answer": "1"},\n {"prompt": "\xff", "answer": "2"}]')
    with pytest.raises(DatasetError, match=r"rows.json:2: not UTF-8 text \(byte 46 is 0xff\)"):
        load_source(DataSource(path=str(listed)))


def test_parquet_files_still_load_and_a_broken_one_is_named(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    path = tmp_path / "rows.parquet"
    pq.write_table(pyarrow.Table.from_pylist([{"question": "Q?", "answer": "It is 2.\n#### 2"}]), path)
    loaded, fmt = load_source(DataSource(path=str(path)))
    assert fmt == "gsm8k" and loaded.references == ["2"] and loaded.rows[0]["question"] == "Q?"
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b'{"question": "Q?"}\n')
    with pytest.raises(DatasetError, match=r"broken.parquet: not a readable Parquet file"):
        load_source(DataSource(path=str(broken)))


# --------------------------------------------------------------------------- column names


def test_a_missing_column_names_the_real_keys_and_the_fix_works(tmp_path, tiny):
    data = write_jsonl(tmp_path / "qa.jsonl", [{"q": f"What is {i}+1?", "a": str(i + 1)} for i in range(4)])
    proc = grpokit("train", f"--model.name_or_path={tiny}", sources("sources", data),
                   f"--output_dir={tmp_path / 'run'}", *ONE_STEP)
    fails(proc, f"grpokit: error: {data}:1: no column 'prompt' (the row has ['a', 'q']); set prompt_column / "
                "answer_column on that entry of data.sources (or data.eval_sources, data.sft_sources), e.g. "
                "--data.sources='[{path: train.jsonl, prompt_column: question, answer_column: answer}]'; " + SKIP)
    example = re.search(r"--data\.sources='(.*?)'", proc.stderr).group(1)  # the fix as printed, with our names
    fixed = example.replace("train.jsonl", f"'{data}'").replace("question", "q").replace("answer_column: answer",
                                                                                          "answer_column: a")
    proc = succeeds(grpokit("train", f"--model.name_or_path={tiny}", f"--data.sources={fixed}",
                            "--data.heldout_fraction=0", f"--output_dir={tmp_path / 'run'}", *ONE_STEP))
    assert "4 RL questions" in proc.stdout
