"""A run is never overwritten by accident: used run directories, --overwrite, default directories,
--resume on a finished run, unwritable directories; and what a run leaves (SFT's metrics, the
`latest` link, progress in logs). Real commands in subprocesses."""

import functools
import io
import json
import os
import shutil
import sys

import pytest
from transformers import AutoModelForCausalLM

from grpokit.run.checkpoint import CheckpointManager
from grpokit.run.progress import LogLines, progress
from grpokit.run.directory import default_run_dir, latest_default_run_dir
from run_helpers import cli

TINY = ["--model.tiny.hidden_size=32", "--model.tiny.num_layers=2", "--model.tiny.num_heads=2",
        "--model.tiny.intermediate_size=64", "--num_sft_examples=32", "--num_rl_questions=16",
        "--num_eval_questions=4", "--num_sft_tir_examples=8", "--eval.k=2", "--sft.max_steps=3",
        "--sft.warmup_steps=1", "--grpo.max_steps=2", "--prompts_per_step=2", "--num_generations=2",
        "--max_completion_length=8", "--eval.tir=false"]


grpokit = functools.partial(cli, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=300)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A two-step GRPO run that finished (summary.json written)."""
    run = tmp_path_factory.mktemp("runs") / "x"
    grpokit("train", "--output-dir", str(run), "--quiet", *TINY)
    assert (run / "summary.json").is_file()
    return run


def test_a_new_run_into_a_used_directory_is_refused_and_the_old_run_kept(finished_run):
    before = (finished_run / "metrics.jsonl").read_text()
    proc = grpokit("train", "--output-dir", str(finished_run), "--quiet", *TINY, "--grpo.max_steps=1", expect=1)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{finished_run} already holds a run (" in err
    assert "metrics.jsonl (2 steps)" in err and "checkpoints/ (step-2)" in err and "config.yaml" in err
    assert "continue it with --resume, start a new one with --output-dir NEW_DIR, or pass --overwrite" in err
    assert (finished_run / "metrics.jsonl").read_text() == before  # nothing touched
    assert os.readlink(finished_run / "checkpoints" / "latest") == "step-2"


def test_sft_into_a_used_directory_is_refused_without_mentioning_resume(finished_run):
    err = grpokit("sft", "--output-dir", str(finished_run), "--quiet", *TINY, expect=1).stderr
    assert "already holds a run" in err and "--resume" not in err and "--overwrite" in err


def test_resume_on_a_finished_run_says_it_is_complete(finished_run):
    err = grpokit("train", "--output-dir", str(finished_run), "--resume", "--quiet", *TINY, expect=1).stderr
    final = finished_run / "checkpoints" / "step-2"
    assert err.strip() == (
        f"grpokit: error: {finished_run} is complete: it trained all 2 steps and its final checkpoint is {final} "
        f"(results in {finished_run / 'summary.json'}); nothing to resume. To train longer, resume with a larger "
        f"--grpo.max_steps, or start a new run from it: --model.name_or_path={final} --output-dir NEW_DIR")


def test_latest_is_a_link_that_from_pretrained_loads(finished_run):
    model = AutoModelForCausalLM.from_pretrained(finished_run / "checkpoints" / "latest")
    assert model.config.num_hidden_layers == 2


def test_overwrite_removes_the_earlier_run_first(finished_run, tmp_path):
    run = tmp_path / "x"
    shutil.copytree(finished_run, run, symlinks=True)
    out = grpokit("train", "--output-dir", str(run), "--overwrite", "--quiet", *TINY, "--grpo.max_steps=1").stdout
    assert f"--overwrite: removed the earlier run in {run}" in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-1"]  # no stale step-2


def test_overwrite_never_deletes_a_directory_grpokit_did_not_write(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    err = grpokit("train", "--output-dir", str(tmp_path), "--overwrite", "--quiet", *TINY, expect=1).stderr
    assert f"{tmp_path} is not empty and holds no grpokit run (notes.txt)" in err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_overwrite_and_resume_together_are_refused(tmp_path):
    err = grpokit("train", "--output-dir", str(tmp_path / "r"), "--overwrite", "--resume", *TINY, expect=2).stderr
    assert "--overwrite starts afresh and --resume continues: pass one of them" in err


def test_each_command_has_its_own_default_directory_and_never_reuses_one(tmp_path):
    first = grpokit("sft", "--quiet", *TINY, cwd=tmp_path)
    assert "grpokit: run directory runs/sft (--output-dir picks another)" in first.stderr
    second = grpokit("sft", "--quiet", *TINY, cwd=tmp_path)
    assert "grpokit: run directory runs/sft-2 (--output-dir picks another)" in second.stderr
    for name in ("sft", "sft-2"):
        run = tmp_path / "runs" / name
        assert (run / "checkpoints" / "sft" / "config.json").is_file()
        # SFT's own log and curve, as train writes metrics.jsonl and its reward curve
        rows = [json.loads(line) for line in (run / "sft_metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert all(r["loss"] > 0 and r["grad_norm"] > 0 and r["tokens"] > 0 and r["lr"] >= 0 for r in rows)
        assert (run / "sft_loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "loss per step in runs/sft-2/sft_metrics.jsonl" in second.stdout


def test_unwritable_output_directory_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    for command in ("train", "sft"):
        err = grpokit(command, "--output-dir", str(blocker / "run"), "--quiet", *TINY, expect=1).stderr
        assert err.strip().splitlines()[-1] == (
            f"grpokit: error: cannot write to the run directory {blocker / 'run'}: Not a directory; "
            "pick a writable --output-dir")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through read-only permissions")
def test_read_only_output_directory_is_one_line(tmp_path):
    tmp_path.chmod(0o555)
    try:
        err = grpokit("sft", "--output-dir", str(tmp_path / "run"), "--quiet", *TINY, expect=1).stderr
    finally:
        tmp_path.chmod(0o755)
    assert f"cannot write to the run directory {tmp_path / 'run'}: Permission denied" in err


def test_default_directories_count_up_and_resume_takes_the_newest(tmp_path):
    assert default_run_dir("train", tmp_path) == tmp_path / "train"
    for name in ("train", "train-2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "train-3").mkdir()  # empty: free to use
    assert default_run_dir("train", tmp_path) == tmp_path / "train-3"
    assert latest_default_run_dir("train", tmp_path) == tmp_path / "train-2"
    assert latest_default_run_dir("sft", tmp_path) == tmp_path / "sft"


def test_latest_written_as_text_by_older_runs_still_resolves(tmp_path, tiny_model, tokenizer):
    manager = CheckpointManager(tmp_path)
    manager.save(1, tiny_model, tokenizer)
    manager.save(2, tiny_model, tokenizer)
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").write_text("step-1\n")
    assert manager.latest() == tmp_path / "step-1"


def test_progress_in_a_log_is_a_line_per_tenth_not_a_redrawn_bar():
    stream = io.StringIO()
    bar = progress(range(20), desc="sft", unit="step", stream=stream)
    assert isinstance(bar, LogLines)  # StringIO is not a terminal
    for _ in bar:
        bar.set_postfix(loss="0.500")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10 and "\r" not in stream.getvalue()
    assert lines[0].startswith("sft: 2/20 steps (10%), ") and lines[0].endswith("left, loss=0.500")
    assert lines[-1].startswith("sft: 20/20 steps (100%), ") and "left" not in lines[-1]


def test_progress_disabled_prints_nothing_and_close_adds_the_last_line():
    quiet = io.StringIO()
    with progress(total=5, desc="eval", enabled=False, stream=quiet) as bar:
        bar.update(5)
    assert quiet.getvalue() == ""
    log = io.StringIO()
    with progress(total=100, desc="eval", unit="question", stream=log) as bar:
        bar.update(3)  # under a tenth: no line until close
        assert log.getvalue() == ""
    assert log.getvalue().startswith("eval: 3/100 questions (3%), ")


def test_eval_into_an_unwritable_directory_fails_before_the_model_loads(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    err = grpokit("eval", str(tmp_path / "no-such-model"), "--data", str(data), "--output-dir",
                  str(blocker / "out"), expect=1).stderr
    assert err.strip() == (f"grpokit: error: cannot write to the output directory {blocker / 'out'}: Not a directory; "
                           "pick a writable --output-dir")
