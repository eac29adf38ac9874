"""Exact resume: a run killed with SIGKILL and resumed ends with the same weights and the same
metrics as a run that was never interrupted. Plus graceful signals, config checks and the lock.
Real subprocesses, real signals, the demo-size model."""

import json
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from grpokit.run.checkpoint import verify_checkpoint
from grpokit.run.metrics import read_metrics
from grpokit.run.lock import RunLock
from run_helpers import RUN, brief_sft, cli, start, wait_for_rows

def comparable(rows):
    """Metrics rows without the wall-clock timings (perf/*), which differ between any two runs."""
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
    return brief_sft(tmp_path_factory)


# Both in make test-slow, beside tests/test_random_kills.py's sync run (SIGKILLs at 8 moments, the same
# exactness): make test stays near 15 minutes
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_sigkill_then_resume_matches_an_uninterrupted_run(sft_checkpoint, tmp_path, dtype):
    """bf16: bf16 compute over fp32 master weights, which the checkpoint's master/ carries across the kill."""
    model = f"--model.name_or_path={sft_checkpoint}"
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run = [*RUN, f"--model.dtype={dtype}"]
    cli("train", model, f"--output_dir={straight}", "--grpo.max_steps=6", *run)

    proc = start("train", model, f"--output_dir={killed}", "--grpo.max_steps=6", *run)
    wait_for_rows(killed / "metrics.jsonl", 3, proc)  # step 3 done, checkpoint step-2 on disk
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "checkpoints" / "step-6").exists()

    resumed = cli("train", str(killed / "config.yaml"), "--resume")
    assert "resumed from" in resumed.stderr and "step-" in resumed.stderr

    weights = ["model.safetensors"] + (["master/model.safetensors"] if dtype == "bf16" else [])
    for file in weights:
        a = load_file(straight / "checkpoints" / "step-6" / file)
        b = load_file(killed / "checkpoints" / "step-6" / file)
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6)
    if dtype == "bf16":
        assert {t.dtype for t in a.values()} == {torch.float32}  # the master weights: fp32
    rows_a, rows_b = read_metrics(straight / "metrics.jsonl"), read_metrics(killed / "metrics.jsonl")
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4, 5, 6]  # the redone step 3 is logged once
    assert comparable(rows_b) == comparable(rows_a)
    assert any(r["reward/std"] > 0 for r in rows_a)  # non-trivial advantages: the weights really moved


def test_sigterm_finishes_the_step_saves_and_exits_cleanly(sft_checkpoint, tmp_path):
    run = tmp_path / "run"
    proc = start("train", f"--model.name_or_path={sft_checkpoint}", f"--output_dir={run}", "--grpo.max_steps=500",
                 *RUN)
    wait_for_rows(run / "metrics.jsonl", 1, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    rows = read_metrics(run / "metrics.jsonl")
    last = run / "checkpoints" / f"step-{rows[-1]['step']}"
    assert verify_checkpoint(last) == []
    assert (run / "checkpoints" / "latest").resolve() == last.resolve()
    assert f"checkpoint {last}" in err and "resume with: grpokit train" in err and "--resume" in err

    # It resumes from there (max_steps may change on resume: it does not change what a step computes).
    cli("train", str(run / "config.yaml"), "--resume", f"--grpo.max_steps={rows[-1]['step'] + 1}")
    assert read_metrics(run / "metrics.jsonl")[-1]["step"] == rows[-1]["step"] + 1


def test_a_second_signal_abandons_the_step_and_keeps_the_last_checkpoint(sft_checkpoint, tmp_path):
    run = tmp_path / "run"
    proc = start("train", f"--model.name_or_path={sft_checkpoint}", f"--output_dir={run}", "--grpo.max_steps=500",
                 *RUN)
    wait_for_rows(run / "metrics.jsonl", 3, proc)  # step-2 saved
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:  # the step (and its save) finished between the two signals
        assert "resume with" in err
    else:
        assert proc.returncode == 130 and "second SIGINT" in err, err[-2000:]
    for ckpt in (run / "checkpoints").glob("step-*"):
        assert verify_checkpoint(ckpt) == [], ckpt
    cli("train", str(run / "config.yaml"), "--resume", "--grpo.max_steps=4")  # the kept checkpoint resumes


def test_resume_with_a_changed_config_is_refused_unless_forced(sft_checkpoint, tmp_path):
    run = tmp_path / "run"
    cli("train", f"--model.name_or_path={sft_checkpoint}", f"--output_dir={run}", "--grpo.max_steps=2", *RUN)
    before = (run / "metrics.jsonl").read_text()
    proc = cli("train", str(run / "config.yaml"), "--resume", "--num_generations=8", "--grpo.beta=0.1",
               "--grpo.max_steps=3", check=False)
    assert proc.returncode == 2
    assert "grpo.num_generations: 4 -> 8" in proc.stderr and "grpo.beta: 0.04 -> 0.1" in proc.stderr
    assert "--force" in proc.stderr and "grpo.max_steps" not in proc.stderr
    assert (run / "metrics.jsonl").read_text() == before  # nothing was touched
    forced = cli("train", str(run / "config.yaml"), "--resume", "--grpo.beta=0.1", "--grpo.max_steps=3", "--force")
    assert "grpo.beta: 0.04 -> 0.1" in forced.stderr
    assert read_metrics(run / "metrics.jsonl")[-1]["step"] == 3


def test_resume_where_no_run_started_says_so(tmp_path):
    proc = cli("train", f"--output_dir={tmp_path}", "--resume", "--quiet", check=False)
    assert proc.returncode == 1 and "nothing to resume in" in proc.stderr and "start it without --resume" in proc.stderr
    (tmp_path / "notes.txt").write_text("mine")
    proc = cli("train", f"--output_dir={tmp_path}", "--resume", "--quiet", check=False)
    assert proc.returncode == 1 and "holds no grpokit run (notes.txt)" in proc.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.slow  # 15 s; make test keeps the refusals' wording (test_resume_where_no_run_started_says_so)
def test_a_run_killed_before_its_first_checkpoint_resumes_from_the_beginning(tmp_path):
    """The command each error names succeeds: the run directory holds a run, so a new start is refused
    and names --resume; --resume, with no checkpoint to continue, starts the run again with its saved
    config and says so in one line. (That it then ends as a run never interrupted: test_random_kills.py.)"""
    small = ["--model.tiny.hidden_size=16", "--model.tiny.num_layers=1", "--model.tiny.num_heads=2",
             "--model.tiny.intermediate_size=32", "--grpo.max_steps=1", "--prompts_per_step=2", "--num_generations=2",
             "--max_completion_length=4", "--num_rl_questions=16", "--num_eval_questions=2", "--eval.k=0",
             "--eval.tir=false", "--quiet"]
    killed = tmp_path / "killed"
    proc = start("train", f"--output_dir={killed}", *small)
    deadline = time.monotonic() + 120
    while not (killed / "config.yaml").is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert not (killed / "checkpoints").exists()  # killed before any checkpoint
    again = cli("train", str(killed / "config.yaml"), check=False)
    assert again.returncode == 1 and "continue it with --resume" in again.stderr
    changed = cli("train", str(killed / "config.yaml"), "--resume", "--grpo.beta=0.1", check=False)
    assert changed.returncode == 2 and "grpo.beta: 0.04 -> 0.1" in changed.stderr and "--force" in changed.stderr
    resumed = cli("train", str(killed / "config.yaml"), "--resume")
    said = [line for line in resumed.stderr.splitlines() if "has no checkpoint yet" in line]
    assert len(said) == 1 and "starting it from the beginning with its saved config" in said[0]
    assert [r["step"] for r in read_metrics(killed / "metrics.jsonl")] == [1]
    assert verify_checkpoint(killed / "checkpoints" / "step-1") == []


def test_a_second_trainer_on_the_same_run_directory_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with RunLock(run):
        proc = cli("train", f"--output_dir={run}", "--quiet", check=False)
    assert proc.returncode == 1
    assert f"run directory {run} is in use by another grpokit process (pid {os.getpid()})" in proc.stderr
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'  # the first run's data is untouched
    assert not (run / "config.yaml").exists()
    with RunLock(run):  # released: the next trainer may take it
        pass


@pytest.mark.slow  # 14 s: make test-slow (make test stays under 15 minutes)
def test_same_seed_and_config_give_the_same_metrics(sft_checkpoint, tmp_path):
    for name in ("a", "b"):
        cli("train", f"--model.name_or_path={sft_checkpoint}", f"--output_dir={tmp_path / name}",
            "--grpo.max_steps=2", *RUN)
    a, b = (comparable(read_metrics(tmp_path / n / "metrics.jsonl")) for n in ("a", "b"))
    assert a == b and len(a) == 2
    assert json.dumps(a)  # every value is plain JSON
