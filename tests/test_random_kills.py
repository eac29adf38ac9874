"""A killed run always comes back: seeded random SIGKILLs (inside SFT, before the first checkpoint,
inside sampling, inside the update, inside a checkpoint write, and at random moments) of a small
SFT-then-GRPO pipeline, sync and async with one rollout worker (the trainer or the worker killed).
After each kill the next command is the one the docs name (`grpokit train RUN/config.yaml --resume`;
SFT has no checkpoint: its own command again); when a command fails, the next is the first one its
error names. The pipeline must end with the weights and metrics of an uninterrupted one.
make test-slow: about 3 minutes each on 2 free cores."""

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from run_helpers import cli, start
from grpokit.run.metrics import read_metrics

SIZE = ["--model.tiny.hidden_size=32", "--model.tiny.num_layers=2", "--model.tiny.num_heads=2",
        "--model.tiny.intermediate_size=64", "--quiet"]
SFT = ["--sft.max_steps=20", "--num_sft_examples=200", "--sft.warmup_steps=5", *SIZE]
RL = ["--grpo.max_steps=6", "--grpo.save_steps=2", "--prompts_per_step=4", "--num_generations=4",
      "--max_completion_length=24", "--num_rl_questions=200", "--num_eval_questions=8", "--eval.k=0", "--eval.tir=false",
      "--grpo.learning_rate=3e-4", "--grpo.warmup_steps=2", *SIZE]
ASYNC = ["--rollout.mode=async", "--rollout.max_staleness=2", "--rollout.workers=1", "--distributed.timeout_s=60"]
# Where the kills aim, in order: each of these at least once, and random moments. An aim the run outruns
# (it ended first) is tried on the next command; the sampling, update and checkpoint kills send the run
# back to its last checkpoint, so the run outruns at most the last aims.
AIMS = ["sft", "config", "sampling", "random", "update", "checkpoint", "random", "sampling", "update", "checkpoint"]


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


def gone(pids: list[int], timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(map(_alive, pids)):
            return True
        time.sleep(0.1)
    return False


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith("perf/") and k != "rollout/sync_time_s"} for r in rows]


class Pipeline:
    """`grpokit sft` then `grpokit train` from its checkpoint, driven as a user would after each kill."""

    def __init__(self, root: Path, rl_extra: list[str]):
        self.root, self.rl_extra, self.sft_dirs = root, rl_extra, 0
        self.sft_dir = self._new_sft_dir()
        self.run = root / "run"

    def _new_sft_dir(self) -> Path:
        self.sft_dirs += 1
        return self.root / f"sft{self.sft_dirs}"

    def sft_command(self) -> list[str]:
        return ["sft", f"--output_dir={self.sft_dir}", *SFT]

    def train_command(self) -> list[str]:
        return ["train", f"--output_dir={self.run}", f"--model.name_or_path={self.sft_dir / 'checkpoints' / 'sft'}",
                *RL, *self.rl_extra]

    def follow_error(self, command: list[str], stderr: str) -> list[str]:
        """The first command the error names."""
        names = [(stderr.find(text), text) for text in ("continue it with --resume", "resume with: grpokit train",
                                                        "start it without --resume",
                                                        "start a new one with --output-dir NEW_DIR") if text in stderr]
        assert names, f"the error names no command: {stderr[-2000:]}"
        first = min(names)[1]
        if first in ("continue it with --resume", "resume with: grpokit train"):
            return [command[0], str(self.run / "config.yaml"), "--resume"]
        if first == "start it without --resume":
            return self.train_command()
        self.sft_dir = self._new_sft_dir()  # SFT's error names a new --output-dir first
        return self.sft_command()


def aim_trigger(aim: str, pipeline: Pipeline, proc, rng: random.Random, timings: dict):
    """Block until the moment `aim` names (or the process ends); True when it is still running then."""
    started = time.monotonic()
    metrics = pipeline.run / "metrics.jsonl"

    def running():
        return proc.poll() is None

    def wait_until(condition, timeout=300):
        deadline = time.monotonic() + timeout
        while running() and not condition() and time.monotonic() < deadline:
            time.sleep(0.002)

    if aim == "sft":
        time.sleep(rng.uniform(0.2, 0.8) * timings["sft"])
    elif aim == "config":
        wait_until(lambda: (pipeline.run / "config.yaml").is_file())
    elif aim == "checkpoint":
        checkpoints = pipeline.run / "checkpoints"
        before = set(checkpoints.glob(".step-*")) if checkpoints.is_dir() else set()  # an earlier kill's
        wait_until(lambda: checkpoints.is_dir() and bool(set(checkpoints.glob(".step-*")) - before))
    elif aim in ("sampling", "update"):
        latest = pipeline.run / "checkpoints" / "latest"
        resumed_at = int(os.readlink(latest).split("-")[1]) if latest.is_symlink() else 0
        wall_start = time.time() - (time.monotonic() - started)

        def fresh_row():  # a row this process wrote: past the checkpoint it resumed from
            return metrics.is_file() and metrics.stat().st_mtime > wall_start and \
                len(metrics.read_text().splitlines()) > resumed_at
        wait_until(fresh_row)  # a step just ended: the next one samples, then scores, then updates
        step = timings["rollout"] + timings["scoring"]
        time.sleep(rng.uniform(0.1, 0.9) * (timings["rollout"] if aim == "sampling" else timings["update"])
                   + (step if aim == "update" else 0.0))
    else:  # early enough that a resumed run has not finished yet
        time.sleep(rng.uniform(0.1, 0.6) * timings["total"])
    return running()


def drive(pipeline: Pipeline, seed: int, timings: dict, kill_worker: bool) -> list[str]:
    """Run the pipeline to its end through the AIMS' kills; the kills that landed, by aim."""
    rng = random.Random(seed)
    landed, aims = [], list(AIMS)
    command, stage = pipeline.sft_command(), "sft"
    while True:
        if aims and aims[0] == "sft" and stage != "sft":
            aims.pop(0)  # SFT ended before its kill: no second chance
        proc = start(*command)
        aim = aims[0] if aims and (aims[0] == "sft") == (stage == "sft") else None
        if aim is not None:
            if aim_trigger(aim, pipeline, proc, rng, timings):  # an aim the run outran is tried again
                aims.pop(0)
                workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "rollout-worker"],
                                                          capture_output=True, text=True).stdout.split()]
                victim = workers[0] if kill_worker and workers and aim in ("random", "update") else proc.pid
                os.kill(victim, signal.SIGKILL)
                landed.append(aim + ("(worker)" if victim != proc.pid else ""))
                if victim == proc.pid:  # a worker holds the trainer's pipes until it ends: do not read them
                    proc.wait(timeout=60)
                    proc.stdout.close()
                    proc.stderr.close()
                    assert gone(workers), f"rollout workers {workers} outlived their killed trainer"
                    command = ["train", str(pipeline.run / "config.yaml"), "--resume"] if stage == "train" else command
                    continue
        _, err = proc.communicate(timeout=600)
        if proc.returncode == -signal.SIGKILL:  # after a kill, the docs' command: --resume (SFT: its own again)
            if stage == "train":
                command = ["train", str(pipeline.run / "config.yaml"), "--resume"]
            continue
        if proc.returncode == 0 and stage == "sft":
            stage, command = "train", pipeline.train_command()
        elif proc.returncode == 0:
            return landed
        else:
            assert "Traceback" not in err, err[-3000:]
            command = pipeline.follow_error(command, err)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a ceiling for a loaded machine; minutes on 2 free cores
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_random_kills_end_as_the_uninterrupted_run(tmp_path, mode):
    extra = ASYNC if mode == "async" else []
    straight = Pipeline(tmp_path / "straight", extra)
    t = time.monotonic()
    cli(*straight.sft_command())
    sft_seconds = time.monotonic() - t
    t = time.monotonic()
    cli(*straight.train_command())
    rows = read_metrics(straight.run / "metrics.jsonl")
    timings = {"sft": sft_seconds, "total": time.monotonic() - t,
               "rollout": max(r["perf/rollout_time_s"] for r in rows), "scoring": max(r["perf/scoring_time_s"] for r in rows),
               "update": max(r["perf/update_time_s"] for r in rows)}
    killed = Pipeline(tmp_path / "killed", extra)
    landed = drive(killed, seed=51, timings=timings, kill_worker=mode == "async")
    assert len(landed) >= 8, landed
    assert {"sft", "config", "checkpoint"} <= {a.split("(")[0] for a in landed}, landed
    assert comparable(read_metrics(killed.run / "metrics.jsonl")) == comparable(rows)
    a = load_file(straight.run / "checkpoints" / "step-6" / "model.safetensors")
    b = load_file(killed.run / "checkpoints" / "step-6" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
