"""Rollout workers and asynchronous rollouts (docs/async.md): the version schedule, decoupled
PPO's correction worked by hand, the checks on what a worker returns, config errors, and real
runs with worker processes: reproducible, resumed exactly after SIGKILL, stopped with a message
when a worker dies or a weight push hangs, and workers started by hand over loopback."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpokit.checks import load_config
from grpokit.config import ConfigError, GRPOConfig, RolloutConfig, check_world_size
from grpokit.rollout.registry import ENGINES, register_engine
from grpokit.rollout.schedule import batches_ready, sampling_version, worker_shares
from grpokit.rollout.wire import RolloutWorkerError, Task, checked_rollout, decode, encode, rollout_to_dict
from grpokit.train.grpo import GRPO
from grpokit.types import Rollout
from run_helpers import RUN, brief_sft, cli, rank_failure, start, wait_for_rows

# ---------------------------------------------------------------------------- the schedule


def test_which_version_samples_which_batch_by_hand():
    # batch s (1-based) is learnt by step s and sampled by version max(0, s - 1 - k)
    assert [sampling_version(s, 0) for s in range(1, 6)] == [0, 1, 2, 3, 4]  # sync: the weights it updates
    assert [sampling_version(s, 1) for s in range(1, 6)] == [0, 0, 1, 2, 3]  # one_step_off
    assert [sampling_version(s, 2) for s in range(1, 6)] == [0, 0, 0, 1, 2]  # async, k = 2
    # after version v exists the trainer may queue every batch up to v + 1 + k
    assert list(batches_ready(0, 1, 10)) == [1, 2]
    assert list(batches_ready(3, 2, 10)) == [1, 2, 3, 4, 5, 6]
    assert list(batches_ready(9, 2, 10)) == list(range(1, 11))  # never past the last step


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_staleness_never_exceeds_k_and_each_batch_waits_only_for_older_versions(k):
    for s in range(1, 40):
        v = sampling_version(s, k)
        assert 0 <= (s - 1) - v <= k  # versions between the sampler and the update that learns the batch
        assert v <= s - 1  # it exists before step s starts
        assert s in batches_ready(v, k, 100)


def test_worker_shares_are_contiguous_whole_groups():
    assert worker_shares(5, 2) == [range(0, 3), range(3, 5)]
    assert worker_shares(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="lower rollout.workers"):
        worker_shares(2, 3)


# ---------------------------------------------------------------------------- decoupled PPO, by hand


def _loss(mode: str, is_correction: str = "none"):
    algorithm = GRPO()
    algorithm.setup(None, GRPOConfig(beta=0.0, epsilon=0.2, loss_aggregation="token"),
                    RolloutConfig(mode=mode, workers=1 if mode != "sync" else 0, is_correction=is_correction))
    logp = torch.tensor([[-1.0, -0.5]], dtype=torch.float64, requires_grad=True)
    prox = torch.tensor([[-1.2, -0.5]], dtype=torch.float64)  # pi_prox: the trainer's weights before the update
    behav = torch.tensor([[-2.0, -0.1]], dtype=torch.float64)  # pi_behav: the version that sampled the batch
    mask = torch.ones(1, 2, dtype=torch.float64)
    loss, stats = algorithm.loss(logp, prox, None, torch.tensor([1.0], dtype=torch.float64), mask, None, behav)
    return loss, stats, logp


def test_off_policy_batches_get_the_decoupled_ppo_weight_worked_by_hand():
    # rho = exp(logp - prox) = (e^0.2, 1); clipped surrogate with A = +1: min(rho, clip(rho, 0.8, 1.2)) = (1.2, 1)
    # w = min(exp(prox - behav), 2) = (min(e^0.8, 2), e^-0.4) = (2, 0.67032); term = w * surrogate
    loss, stats, logp = _loss("one_step_off")
    expected = -(2.0 * 1.2 + math.exp(-0.4) * 1.0) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert float(stats["is_capped_frac"]) == pytest.approx(0.5)
    loss.backward()
    # token 1 is clipped (no gradient); token 2: d(-w rho / 2)/dlogp = -w rho / 2 with rho = 1
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-math.exp(-0.4) / 2, abs=1e-12)


def test_a_sync_run_applies_no_correction_unless_asked_and_async_can_name_icepop():
    loss, _, _ = _loss("sync")
    assert loss.item() == pytest.approx(-(1.2 + 1.0) / 2, abs=1e-12)
    loss, stats, _ = _loss("async", is_correction="icepop")  # w = (e^0.8 > 2: dropped, e^-0.4 in [0.5, 2])
    assert loss.item() == pytest.approx(-(math.exp(-0.4) * 1.0) / 2, abs=1e-12)
    assert float(stats["is_dropped_frac"]) == pytest.approx(0.5)


# ---------------------------------------------------------------------------- what a worker returns


def _rollout(prompts: list[str], g: int = 2, logp_value: float = -0.5) -> Rollout:
    n = len(prompts) * g
    return Rollout(prompts=[p for p in prompts for _ in range(g)], completions=["1"] * n,
                   input_ids=torch.ones(n, 4, dtype=torch.long), attention_mask=torch.ones(n, 4, dtype=torch.long),
                   completion_mask=torch.ones(n, 2, dtype=torch.long), truncated=torch.zeros(n, dtype=torch.bool),
                   prompt_length=2, group_size=g, rows=[{"prompt": p} for p in prompts for _ in range(g)],
                   sampling_logp=torch.full((n, 2), logp_value))


def _message(task: Task, rollout: Rollout, batch=None, version=None) -> dict:
    return decode(encode({"batch": task.batch if batch is None else batch,
                          "version": task.version if version is None else version,
                          "rollout": rollout_to_dict(rollout)}))


def test_a_returned_batch_round_trips_and_is_accepted():
    task = Task(3, 1, 0, [{"prompt": "a"}, {"prompt": "b"}], [1, 2, 3, 4])
    rollout = checked_rollout(_message(task, _rollout(["a", "b"])), task, group_size=2)
    assert rollout.prompts == ["a", "a", "b", "b"] and rollout.rows[2] == {"prompt": "b"}
    assert Task.from_dict(decode(encode(task.to_dict()))) == task


@pytest.mark.parametrize("case, match", [
    ("version", "sampled by policy version 0, but was asked for batch 3 from version 1"),
    ("batch", "returned batch 4"),
    ("shape", "3 completions in groups of 1, expected 4"),
    ("prompts", "prompts that are not the task's"),
    ("nan", "not finite"),
])
def test_a_wrong_batch_is_refused_naming_the_worker(case, match):
    task = Task(3, 1, 7, [{"prompt": "a"}, {"prompt": "b"}], [1, 2, 3, 4])
    rollout = {"shape": _rollout(["a", "b", "c"], g=1), "prompts": _rollout(["b", "a"]),
               "nan": _rollout(["a", "b"], logp_value=float("nan"))}.get(case, _rollout(["a", "b"]))
    message = _message(task, rollout, version=0 if case == "version" else None, batch=4 if case == "batch" else None)
    with pytest.raises(RolloutWorkerError, match="rollout worker 7") as err:
        checked_rollout(message, task, group_size=2)
    assert match in str(err.value) and "refused" in str(err.value)


# ---------------------------------------------------------------------------- config errors


@pytest.mark.parametrize("overrides, match", [
    (["--rollout.mode=async", "--rollout.workers=1", "--rollout.max_staleness=-1"],
     "rollout.max_staleness must be >= 0"),
    (["--rollout.mode=one_step_off"], "set rollout.workers to 1 or more"),
    (["--rollout.workers=9", "--grpo.prompts_per_step=8"], "lower rollout.workers to at most 8"),
    (["--rollout.workers=1", "--grpo.dynamic_sampling=true"], "grpo.dynamic_sampling"),
    (["--rollout.workers=1", "--rollout.worker_address=localhost"], "is not HOST:PORT"),
    (["--rollout.worker_launch=external"], "set rollout.workers to how many you start"),
])
def test_settings_that_cannot_work_are_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_an_engine_that_cannot_run_in_a_worker_is_refused():
    register_engine("colocated_only", copies_weights=False)(lambda *args: None)
    try:
        with pytest.raises(ConfigError,
                           match="cannot run in a rollout worker.*rollout.engine=hf or hf_static or vllm"):
            load_config(None, ["--rollout.engine=colocated_only", "--rollout.workers=1"])
    finally:
        del ENGINES["colocated_only"]


def test_workers_beside_a_sharded_trainer_keep_its_own_rules():
    """Rollout workers now go with a trainer of several FSDP2 ranks; the batch must still split into whole
    groups over the ranks."""
    check_world_size(load_config(None, ["--rollout.workers=1", "--grpo.prompts_per_step=8"]), 2)
    with pytest.raises(ConfigError, match="grpo.prompts_per_step=7 does not split into whole groups over 2"):
        check_world_size(load_config(None, ["--rollout.workers=1", "--grpo.prompts_per_step=7"]), 2)


class RecordingTransport:
    """A transport that keeps what the trainer sets: the tasks it queues."""

    address = "recording"

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_any_number_of_workers_is_given_the_same_prompts_and_seeds_in_order(workers):
    """What a step samples does not depend on how many workers share it: the tasks, joined in worker order,
    are the batch's prompts and per-completion seeds, each worker's share whole groups."""
    from grpokit.rollout.remote import RemoteRollouts, StoreLink

    remote = object.__new__(RemoteRollouts)  # the queueing alone: no workers, no store
    remote.workers, remote.group_size, remote.tasks = workers, 4, {}
    remote.link = StoreLink(RecordingTransport())
    rows = [{"prompt": f"q{i}"} for i in range(6)]
    seeds = list(range(100, 124))
    remote.submit(3, 1, rows, seeds)
    tasks = [Task.from_dict(decode(remote.link.transport.values[f"task/{w}/0"])) for w in range(workers)]
    assert [t.worker for t in tasks] == list(range(workers)) and {t.batch for t in tasks} == {3}
    assert [r for t in tasks for r in t.rows] == rows and [x for t in tasks for x in t.seeds] == seeds
    assert all(len(t.seeds) == 4 * len(t.rows) for t in tasks)


@pytest.mark.slow  # 44 s, two torchrun ranks and a worker: make test-slow (make test stays under 15 minutes)
def test_a_sharded_trainer_of_two_ranks_learns_what_one_rank_does_from_one_worker(tmp_path, sft_checkpoint):
    """one_step_off with one worker: a trainer of 2 FSDP2 ranks (torchrun) against 1 process. Rank 0 holds
    the schedule and takes each batch, every rank trains on its whole groups, and every rank gathers each
    sharded tensor while rank 0 pushes it: the same metrics, and final weights within the sync torchrun
    test's fp32 tolerance (tests/test_distributed.py)."""
    common = [f"--model.name_or_path={sft_checkpoint}", "--grpo.max_steps=4", *RUN, "--rollout.mode=one_step_off",
              "--rollout.workers=1", "--model.dtype=fp32"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cli("train", f"--output_dir={tmp_path / 'one'}", *common, env=env)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                           str(port), "-m", "grpokit", "train", f"--output_dir={tmp_path / 'two'}", *common],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, rank_failure(proc.stderr)
    assert_learns_what_one_rank_does(tmp_path / "two", tmp_path / "one")


def assert_learns_what_one_rank_does(sharded_run, one_rank_run, steps: int = 4) -> None:
    """The metrics of a run of several trainer ranks, and its final weights, against one rank's run of the
    same config: within the sync torchrun test's fp32 tolerance (tests/test_distributed.py)."""
    keys = ("reward/mean", "loss", "kl", "rollout/staleness_max", "rollout/push_bytes")
    for a, b in zip(rows(one_rank_run), rows(sharded_run), strict=True):
        assert {k: a[k] for k in keys} == pytest.approx({k: b[k] for k in keys}, rel=1e-5, abs=1e-7)
    first, last = weights(one_rank_run, steps // 2), weights(one_rank_run, steps)
    # the last half of the steps moved the weights 20 times the tolerance or more: the comparison means something
    assert max(float((last[k] - first[k]).abs().max()) for k in last) > 20 * 1e-5
    sharded = weights(sharded_run, steps)
    for k in last:
        torch.testing.assert_close(sharded[k], last[k], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------- real runs


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def comparable(metrics_rows):
    """Metrics without wall-clock numbers: timings can make a run wait, never change what it computes."""
    return [{k: v for k, v in r.items() if not k.startswith("perf/") and k != "rollout/sync_time_s"}
            for r in metrics_rows]


def weights(run_dir, step):
    return load_file(run_dir / "checkpoints" / f"step-{step}" / "model.safetensors")


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def worker_pids(trainer: subprocess.Popen, timeout: float = 60) -> list[int]:
    """The pids of the rollout workers `trainer` spawned (its children), once they are up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-P", str(trainer.pid), "-f", "rollout-worker"], capture_output=True,
                               text=True).stdout.split()
        if found:
            return [int(p) for p in found]
        assert trainer.poll() is None, trainer.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError("no rollout worker started")


def gone(pids: list[int], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
    return brief_sft(tmp_path_factory)


@pytest.fixture(scope="module")
def async_run(sft_checkpoint, tmp_path_factory):
    """An uninterrupted async (k = 2) run of 6 steps with one spawned worker."""
    out = tmp_path_factory.mktemp("async") / "run"
    trainer = start("train", f"--output_dir={out}", f"--model.name_or_path={sft_checkpoint}", "--grpo.max_steps=6",
                    *RUN, "--rollout.mode=async", "--rollout.max_staleness=2", "--rollout.workers=1")
    pids = worker_pids(trainer)
    _, err = trainer.communicate(timeout=600)
    assert trainer.returncode == 0, err[-3000:]
    assert gone(pids)  # the run ended its worker
    return out


def test_an_async_run_is_off_policy_as_scheduled_and_corrected(async_run):
    metrics = rows(async_run)
    assert [r["rollout/staleness_max"] for r in metrics] == [0, 1, 2, 2, 2, 2]
    assert all(r["rollout/staleness_mean"] == r["rollout/staleness_max"] for r in metrics)
    # same weights sample and learn batch 1: the worker's log-probs are the trainer's
    assert metrics[0]["rollout/logp_mismatch"] < 1e-5
    assert all(r["rollout/logp_mismatch"] > 1e-3 for r in metrics[2:])  # older weights: the TIS weight moves
    assert all("rollout/is_capped_frac" in r and 0 <= r["perf/trainer_idle_frac"] <= 1 for r in metrics)
    assert metrics[-1]["rollout/push_bytes"] > 4_000_000  # 1.05M float32 parameters, every step


def test_two_runs_with_the_same_seed_are_identical(async_run, tmp_path, sft_checkpoint):
    again = tmp_path / "again"
    cli("train", f"--output_dir={again}", f"--model.name_or_path={sft_checkpoint}", "--grpo.max_steps=6", *RUN,
        "--rollout.mode=async", "--rollout.max_staleness=2", "--rollout.workers=1")
    assert comparable(rows(again)) == comparable(rows(async_run))
    assert same_weights(weights(again, 6), weights(async_run, 6))


@pytest.mark.slow  # 20 s: make test-slow (make test stays under 15 minutes)
def test_sigkill_and_resume_end_as_the_uninterrupted_run(async_run, tmp_path, sft_checkpoint):
    run = tmp_path / "killed"
    proc = start("train", f"--output_dir={run}", f"--model.name_or_path={sft_checkpoint}", "--grpo.max_steps=6",
                 *RUN, "--rollout.mode=async", "--rollout.max_staleness=2", "--rollout.workers=1")
    pids = worker_pids(proc)
    wait_for_rows(run / "metrics.jsonl", 3, proc)  # step-2 holds batches 3 and 4, sampled by versions 0 and 1
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert gone(pids)  # the worker dies with its trainer
    cli("train", str(run / "config.yaml"), "--resume", "--quiet")
    assert comparable(rows(run)) == comparable(rows(async_run))
    assert same_weights(weights(run, 6), weights(async_run, 6))


def test_a_resume_with_a_lower_max_staleness_drops_and_counts_the_batches_now_too_stale(async_run, tmp_path):
    """step-4 of the k = 2 run holds batches 5 and 6, sampled by versions 2 and 3. Resumed with k = 0
    they are 2 versions too old: both are dropped (2 x 4 prompts x 4 completions, counted at step 5)
    and sampled again, from versions 4 and 5, with the same prompts."""
    run = tmp_path / "run"
    shutil.copytree(async_run, run, symlinks=True)
    cli("train", str(run / "config.yaml"), f"--output_dir={run}", "--resume", str(run / "checkpoints" / "step-4"),
        "--force", "--rollout.max_staleness=0", "--quiet")
    resumed, straight = rows(run), rows(async_run)
    assert [r["rollout/dropped_stale"] for r in resumed[4:]] == [32, 0]
    assert [r["rollout/staleness_max"] for r in resumed[4:]] == [0, 0]
    assert comparable(resumed[:4]) == comparable(straight[:4])
    assert resumed[4]["rollout/logp_mismatch"] < 1e-5  # sampled by the weights that learn from it


# ppo and tool (23 s) in make test-slow: make test stays under 15 minutes
@pytest.mark.parametrize("extra", [
    ["--model.lora.r=4"],  # the workers get the merged weights W + (alpha/r) B A
    pytest.param(["--algo=ppo"], marks=pytest.mark.slow),  # PPO's critic stays in the trainer
    pytest.param(["--rollout.tool=python", "--model.tiny.alphabet=arithmetic-tir",
                  "--task.prompt_modes={cot: 0.5, tir: 0.5}", "--max_completion_length=64"],
                 marks=pytest.mark.slow),  # the sandbox runs in the worker
], ids=["lora", "ppo", "tool"])
def test_lora_ppo_and_tool_rollouts_run_with_a_worker(tmp_path, sft_checkpoint, extra):
    model = [] if "--rollout.tool=python" in extra else [f"--model.name_or_path={sft_checkpoint}"]
    cli("train", f"--output_dir={tmp_path / 'run'}", *model, "--grpo.max_steps=3", *RUN, "--rollout.mode=one_step_off",
        "--rollout.workers=1", *extra)
    metrics = rows(tmp_path / "run")
    assert [r["rollout/staleness_max"] for r in metrics] == [0, 1, 1]
    assert all(r["rollout/push_bytes"] > 0 for r in metrics)
    if "--rollout.tool=python" in extra:  # the worker's tool metrics reach the trainer's log
        assert all(r["mode/tir/samples"] + r["mode/cot/samples"] == 16 and "tool/rounds" in r for r in metrics)


def test_a_worker_that_dies_stops_the_run_naming_it_and_how_to_resume(tmp_path, sft_checkpoint):
    run = tmp_path / "run"
    proc = start("train", f"--output_dir={run}", f"--model.name_or_path={sft_checkpoint}", "--grpo.max_steps=200",
                 *RUN, "--rollout.mode=one_step_off", "--rollout.workers=1", "--distributed.timeout_s=30")
    pids = worker_pids(proc)
    wait_for_rows(run / "metrics.jsonl", 3, proc)
    killed_at = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - killed_at < 30  # within distributed.timeout_s
    assert proc.returncode == 1
    assert "rollout worker 0 (pid" in err and "was killed by SIGKILL" in err
    assert "Last checkpoint:" in err and f"grpokit train {run / 'config.yaml'} --resume" in err
    assert "Traceback" not in err


@pytest.mark.slow  # 15 s, most of it the timeout: make test-slow
def test_a_hung_weight_push_stops_the_run_within_the_timeout(tmp_path, sft_checkpoint):
    run = tmp_path / "run"
    proc = start("train", f"--output_dir={run}", f"--model.name_or_path={sft_checkpoint}", "--grpo.max_steps=200",
                 *RUN, "--rollout.mode=one_step_off", "--rollout.workers=1", "--distributed.timeout_s=5")
    pids = worker_pids(proc)
    wait_for_rows(run / "metrics.jsonl", 2, proc)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)  # alive, holding its sockets, answering nothing
    stopped_at = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert time.monotonic() - stopped_at < 20  # the timeout is 5 s; a push or a wait notices it
    assert proc.returncode == 1
    assert "rollout worker 0" in err or "pushing policy version" in err, err[-2000:]
    assert "--resume" in err and "Traceback" not in err


def test_workers_that_do_not_start_in_time_end_the_run_naming_the_key(tmp_path, sft_checkpoint):
    """No worker ever connects: the start-up bound, not distributed.timeout_s, ends the wait."""
    proc = start("train", f"--output_dir={tmp_path / 'run'}", f"--model.name_or_path={sft_checkpoint}", *RUN,
                 "--rollout.mode=one_step_off", "--rollout.workers=1", "--rollout.worker_launch=external",
                 "--rollout.worker_start_timeout_s=3", "--distributed.timeout_s=600")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "started within rollout.worker_start_timeout_s=3s (missing: ready/0)" in err, err[-2000:]
    assert "Traceback" not in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_workers_started_by_hand_over_loopback(tmp_path, sft_checkpoint, async_run):
    """Two workers started as another machine's would be (rollout.worker_launch=external), each taking
    its share of every batch; the trainer prints the command, and the workers exit cleanly after it."""
    port = _free_port()
    run = tmp_path / "run"
    trainer = start("train", f"--output_dir={run}", f"--model.name_or_path={sft_checkpoint}", "--grpo.max_steps=4",
                    *RUN, "--rollout.mode=one_step_off", "--rollout.workers=2", "--rollout.worker_launch=external",
                    f"--rollout.worker_address=127.0.0.1:{port}")
    workers = [start("rollout-worker", "--connect", f"127.0.0.1:{port}", "--index", str(i)) for i in range(2)]
    _, err = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, err[-3000:]
    assert f"--connect 127.0.0.1:{port} --index I` with I = 0..1" in err
    for w in workers:
        assert w.wait(timeout=30) == 0
    metrics = rows(run)
    assert [r["rollout/staleness_max"] for r in metrics] == [0, 1, 1, 1]
    assert all(r["completion/mean_length"] > 0 for r in metrics)


# ---------------------------------------------------------------------------- with vLLM (make test-vllm)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (CPU: make test-vllm)")
def test_vllm_workers_in_the_three_modes_and_sync_samples_what_colocated_vllm_does(sft_checkpoint, tmp_path):
    """vLLM's per-request seeds make a batch the same wherever it is sampled: sync with a worker gives
    exactly the metrics of colocated sync. one_step_off and async run to the end on their schedules."""
    args = [f"--model.name_or_path={sft_checkpoint}", "--grpo.max_steps=4", *RUN, "--rollout.engine=vllm"]
    cli("train", f"--output_dir={tmp_path / 'colocated'}", *args)
    staleness = {}
    for mode in ("sync", "one_step_off", "async"):
        cli("train", f"--output_dir={tmp_path / mode}", *args, f"--rollout.mode={mode}", "--rollout.workers=1",
            "--rollout.max_staleness=2")
        staleness[mode] = [r["rollout/staleness_max"] for r in rows(tmp_path / mode)]
    assert staleness == {"sync": [0, 0, 0, 0], "one_step_off": [0, 1, 1, 1], "async": [0, 1, 2, 2]}

    def learning(metrics_rows):
        return [{k: v for k, v in r.items() if not k.startswith(("perf/", "rollout/"))} for r in metrics_rows]

    assert learning(rows(tmp_path / "sync")) == learning(rows(tmp_path / "colocated"))
    assert same_weights(weights(tmp_path / "sync", 4), weights(tmp_path / "colocated", 4))


# ---------------------------------------------------------------------------- the demo's RL stage (make test-slow)


def sigkill_after(args: list[str], metrics, rows_before_kill: int) -> None:
    proc = start(*args)
    pids = worker_pids(proc)
    wait_for_rows(metrics, rows_before_kill, proc, timeout=900)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert gone(pids)


ONE_STEP_OFF_DEMO = ["--grpo.save_steps=50", "--quiet", "--rollout.mode=one_step_off", "--rollout.workers=1"]


@pytest.fixture(scope="module")
def one_step_off_demo(seed0_demo, tmp_path_factory):
    """The demo's RL stage from the seed-0 demo's pi_SFT with rollout.mode=one_step_off and one worker."""
    first = tmp_path_factory.mktemp("one-step-off") / "first"
    cli("train", f"--model.name_or_path={seed0_demo / 'checkpoints' / 'sft'}", *ONE_STEP_OFF_DEMO,
        f"--output_dir={first}", timeout=1800)
    return first


@pytest.mark.slow
def test_one_step_off_on_the_demo_learns(one_step_off_demo):
    """+15 points or more on the held-out questions."""
    summary = json.loads((one_step_off_demo / "summary.json").read_text())
    print(f"one_step_off: held-out greedy {summary['sft_accuracy']:.1%} -> {summary['grpo_accuracy']:.1%} "
          f"in {summary['wall_seconds']:.0f}s")
    assert summary["grpo_accuracy"] - summary["sft_accuracy"] >= 0.15, summary


@pytest.mark.slow
@pytest.mark.long  # two more demo RL stages; make test's short SIGKILL-and-resume test checks the same in CI
def test_one_step_off_on_the_demo_repeats_exactly_and_resumes_exactly_after_sigkill(one_step_off_demo, seed0_demo,
                                                                                    tmp_path):
    """A second run with the same seed, SIGKILLed after step 70 (checkpoint step-50) and resumed, writes
    the same metrics rows (timings aside) and weights: its steps 1-70 repeat the first run's from
    scratch, and the resumed steps 51-150 continue them exactly."""
    killed = tmp_path / "killed"
    args = ["train", f"--model.name_or_path={seed0_demo / 'checkpoints' / 'sft'}", *ONE_STEP_OFF_DEMO]
    sigkill_after([*args, f"--output_dir={killed}"], killed / "metrics.jsonl", 70)
    assert (killed / "checkpoints" / "step-50").is_dir() and not (killed / "checkpoints" / "step-150").exists()
    resumed = cli("train", str(killed / "config.yaml"), "--resume", "--quiet", timeout=1800)
    assert "resumed from" in resumed.stderr and "step-50" in resumed.stderr
    assert comparable(rows(killed)) == comparable(rows(one_step_off_demo))
    assert same_weights(weights(killed, 150), weights(one_step_off_demo, 150))


@pytest.mark.slow
@pytest.mark.long  # a demo RL stage; CI keeps one_step_off's, and make test checks async's staleness schedule
def test_async_with_staleness_2_on_the_demo_learns(tmp_path, seed0_demo):
    run = tmp_path / "async"
    cli("train", f"--model.name_or_path={seed0_demo / 'checkpoints' / 'sft'}", "--quiet", "--rollout.mode=async",
        "--rollout.max_staleness=2", "--rollout.workers=1", f"--output_dir={run}", timeout=1800)
    summary = json.loads((run / "summary.json").read_text())
    print(f"async k=2: held-out greedy {summary['sft_accuracy']:.1%} -> {summary['grpo_accuracy']:.1%}")
    assert summary["grpo_accuracy"] - summary["sft_accuracy"] >= 0.15, summary
    assert max(r["rollout/staleness_max"] for r in rows(run)) == 2


# ---------------------------------------------------------------------------- waiting for a key (both transports)


def wait_any_wakes_when_a_key_is_set(trainer, worker):
    """wait_any: None after its timeout while none of its keys is set; the key as soon as another client sets
    one, long before the timeout; with several set, the first in the order asked. pop: the value, and the
    key is gone."""
    started = time.monotonic()
    assert worker.wait_any(["task/0/0", "stop"], 0.3) is None
    assert 0.25 <= time.monotonic() - started < 5
    threading.Timer(0.2, trainer.set, args=("stop", b"1")).start()
    started = time.monotonic()
    assert worker.wait_any(["task/0/0", "stop"], 30.0) == "stop"
    assert time.monotonic() - started < 10
    assert worker.wait_any(["stop"], 0.0) == "stop"  # set already: no wait
    trainer.set("task/0/0", b"task")
    assert worker.wait_any(["stop", "task/0/0"], 0.0) == "stop"
    assert worker.wait_any(["task/0/0", "stop"], 0.0) == "task/0/0"
    big = bytes(range(256)) * 1024  # 256 KiB: the Ray mailbox keeps it in the object store
    trainer.set("result/0/0", big)
    assert worker.pop("result/0/0") == big
    assert not worker.check("result/0/0") and not trainer.check("result/0/0")
    assert worker.pop("task/0/0") == b"task"
    assert worker.wait_any(["task/0/0"], 0.0) is None


def test_the_store_transports_wait_any_wakes_when_a_key_is_set(monkeypatch):
    from grpokit.rollout.transport import SECRET_ENV, StoreTransport

    monkeypatch.delenv(SECRET_ENV, raising=False)
    trainer = StoreTransport.host("127.0.0.1:0", 10.0)
    trainer.set("setup", b"x")  # what a worker's connect waits for
    wait_any_wakes_when_a_key_is_set(trainer, StoreTransport.connect(trainer.address, 10.0))

