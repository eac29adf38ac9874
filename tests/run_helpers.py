"""Running grpokit as a user does, in subprocesses: the command line, a run stopped mid-way, and
the brief pi_SFT that the resume and rollout-worker tests start RL from; and the sampling tests' bound."""

import socket
import subprocess
import sys
import time

import torch

# The demo's model (hidden 128, 4 layers); a small batch keeps each step short.
RUN = ["--grpo.save_steps=2", "--prompts_per_step=4", "--num_generations=4", "--max_completion_length=24",
       "--num_rl_questions=200", "--num_eval_questions=8", "--eval.k=2", "--grpo.warmup_steps=2",
       "--grpo.learning_rate=3e-4", "--quiet",
       # the draws these runs were calibrated on (before the validation split): with 5% of the questions
       # kept for validation, async's first update can see only equal rewards and leave the weights as they were
       "--task.validation_percent=0"]


def cli(*args, check=True, expect=0, cwd=None, env=None, timeout=600) -> subprocess.CompletedProcess:
    """`grpokit ARGS` in a subprocess, as a user types it. check: the exit status must be `expect`, and
    a failure (expect != 0) must end in a message, never a traceback."""
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)
    if check:
        assert proc.returncode == expect, proc.stderr[-3000:]
        if expect:
            assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_then_leave(rank, worker, *args) -> None:
    from grpokit import distributed

    worker(rank, *args)
    distributed.leave(0)


def spawn_ranks(worker, world: int, *args) -> None:
    """worker(rank, world, port, *args) in `world` spawned processes on a free loopback port. Each ends
    as a launched grpokit process does (distributed.leave), not through the interpreter's finalization,
    where a gloo thread can drop a tensor after the interpreter is gone and abort a finished process
    ("terminate called without an active exception")."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_then_leave, args=(worker, world, free_port(), *args), nprocs=world, join=True)


def start(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "grpokit.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def wait_for_rows(metrics, n, proc, timeout=300):
    """Block until metrics.jsonl holds n rows (the run finished step n)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    raise AssertionError(f"{metrics} did not reach {n} rows in {timeout}s")


def brief_sft(tmp_path_factory):
    """pi_SFT of the demo-size model, briefly trained, so rewards (and advantages) vary."""
    out = tmp_path_factory.mktemp("sft")
    cli("sft", f"--output_dir={out}", "--sft.max_steps=60", "--num_sft_examples=800", "--sft.warmup_steps=5",
        "--quiet", "--task.validation_percent=0")  # the demonstrations the tests were calibrated on (see RUN)
    return out / "checkpoints" / "sft"


def bucketed_tv(freq: torch.Tensor, p: torch.Tensor, n: int) -> tuple[float, float]:
    """(total variation between sampled frequencies and p over buckets, the bound it may reach): every id
    with p >= 1/n is its own bucket and the rest share one, so a thin tail is compared as one mass. The
    bound is 4x the expected TV of n honest draws, 0.5 * sum sqrt(p_b (1 - p_b) / n)."""
    big = p >= 1.0 / n
    pb = torch.cat([p[big], p[~big].sum().view(1)]).double()
    fb = torch.cat([freq[big], freq[~big].sum().view(1)]).double()
    tv = 0.5 * (fb - pb).abs().sum().item()
    bound = 4 * 0.5 * (pb * (1 - pb) / n).sqrt().sum().item()
    return tv, bound


def rank_failure(stderr: str) -> str:
    """What a failed torchrun run's ranks said: from the first Python stack a rank printed (a traceback,
    or the fault handler's on a signal) for 4,000 characters, then the launcher's summary at the end."""
    starts = [i for i in (stderr.find("Traceback"), stderr.find("Fatal Python error")) if i >= 0]
    first = min(starts, default=max(0, len(stderr) - 3000))
    return stderr[first:first + 4000] + "\n...\n" + stderr[-1500:]
