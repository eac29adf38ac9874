"""distributed.launcher: ray (pipeline/ray_cluster.py, rollout/transport.py): the rollout workers as Ray
actors whose `sample` calls carry the tasks and results, the weights over a gloo group of the trainer and the
actors. The numbers are the store transport's, bit for bit; a worker that dies ends the run in one line, and the resume equals the run never interrupted.
`make test-ray` runs these (marker ray); without Ray they are skipped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from grpokit.checks import load_config
from grpokit.config import ConfigError
from grpokit.pipeline.ray_cluster import check_placement, worker_bundles
from grpokit.rollout.transport import SECRET_ENV, StoreTransport, TransportError
from run_helpers import RUN, cli, start, wait_for_rows
# async_run: today's transport (the TCP store, a gloo weight group) on the same 6 async steps
from test_async_rollouts import async_run, comparable, rows, same_weights, sft_checkpoint, weights  # noqa: F401
from test_async_rollouts import assert_learns_what_one_rank_does

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

ASYNC = ["--grpo.max_steps=6", *RUN, "--rollout.mode=async", "--rollout.max_staleness=2", "--rollout.workers=1"]
ENV = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
# one_step_off with one worker, as the torchrun sharded test runs it (tests/test_async_rollouts.py)
ONE_STEP_OFF = ["--grpo.max_steps=4", *RUN, "--rollout.mode=one_step_off", "--rollout.workers=1", "--model.dtype=fp32"]
RANKS = ["--distributed.launcher=ray", "--distributed.ranks=2"]


@pytest.fixture(scope="module")
def ray_run(sft_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("ray") / "run"
    proc = cli("train", f"--output_dir={out}", f"--model.name_or_path={sft_checkpoint}", *ASYNC,
               "--distributed.launcher=ray", env=ENV)
    assert "rollout worker(s) ready at grpokit-" in proc.stdout
    return out


def test_ray_gives_the_store_transports_metrics_and_weights_bit_for_bit(async_run, ray_run):
    assert comparable(rows(ray_run)) == comparable(rows(async_run))
    assert same_weights(weights(ray_run, 6), weights(async_run, 6))
    assert [r["rollout/staleness_max"] for r in rows(ray_run)] == [0, 1, 2, 2, 2, 2]


def _actor_pids(timeout: float = 120.0) -> list[int]:
    """The pids of the rollout-worker actors' processes (Ray names them after the method they run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-f", "RolloutWorkerActor"], capture_output=True, text=True).stdout.split()
        if found:
            return [int(p) for p in found]
        time.sleep(0.2)
    raise AssertionError("no rollout-worker actor started")


def test_a_killed_worker_actor_is_one_line_and_the_resume_equals_the_run_never_interrupted(
        ray_run, sft_checkpoint, tmp_path):
    run = tmp_path / "killed"
    proc = start("train", f"--output_dir={run}", f"--model.name_or_path={sft_checkpoint}", *ASYNC,
                 "--distributed.launcher=ray", "--distributed.timeout_s=60")
    wait_for_rows(run / "metrics.jsonl", 3, proc)
    for pid in _actor_pids():
        os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if "rollout worker 0 (a Ray actor) died" in line]
    assert len(lines) == 1 and f"grpokit train {run / 'config.yaml'} --resume" in lines[0], err[-3000:]
    assert "Traceback" not in err
    cli("train", str(run / "config.yaml"), "--resume", "--quiet", env=ENV)
    assert comparable(rows(run)) == comparable(rows(ray_run))
    assert same_weights(weights(run, 6), weights(ray_run, 6))


def test_two_simulated_nodes_give_the_same_run(async_run, sft_checkpoint, tmp_path):
    """A head and a second node (ray.cluster_utils.Cluster) of 4 CPUs each: a simulated 8-CPU cluster, where
    default settings place the worker (its actor asking for exactly its bundle) on either node."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "object_store_memory": 200 << 20,
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=4, object_store_memory=200 << 20)
    try:
        cluster.wait_for_nodes()
        out = tmp_path / "run"
        cli("train", f"--output_dir={out}", f"--model.name_or_path={sft_checkpoint}", *ASYNC,
            "--distributed.launcher=ray", env=dict(ENV, RAY_ADDRESS=cluster.address))
        assert comparable(rows(out)) == comparable(rows(async_run))
        assert same_weights(weights(out, 6), weights(async_run, 6))
    finally:
        cluster.shutdown()


# ------------------------------------------------------------------------ actors, placement and deaths

def test_each_worker_actor_asks_for_exactly_its_bundle(monkeypatch):
    """An actor asking for more than its bundle holds is never placed: on 8 cores the trainer would give
    each of 2 workers 2 threads while their bundles hold 1 CPU each."""
    import types

    import torch

    from grpokit.pipeline.rollout_worker import RayWorkers

    asked = []

    class Actor:
        def __getattr__(self, method):
            return types.SimpleNamespace(remote=lambda *args, **kwargs: object())

    class ActorClass:
        def options(self, **options):
            asked.append(options)
            return types.SimpleNamespace(remote=lambda: Actor())

    monkeypatch.setattr(ray, "remote", lambda **kwargs: (lambda cls: ActorClass()))
    monkeypatch.setattr(ray, "put", lambda value: value)
    workers = RayWorkers(None, [{"CPU": 1.0}, {"CPU": 1.0}])
    workers.start(workers, 2, 2, torch.device("cpu"))
    assert [(o["num_cpus"], o["num_gpus"]) for o in asked] == [(1.0, 0), (1.0, 0)]


def test_a_dead_worker_a_lost_result_and_a_failed_call_are_one_line_each(monkeypatch):
    """What ray.get raises for a worker's call, as the trainer says it (then the step and the resume command)."""
    from grpokit.pipeline.rollout_worker import RayWorkers
    from grpokit.rollout.wire import RolloutWorkerError

    workers = RayWorkers(None, [{"CPU": 1.0}])
    workers.calls = [{}]
    workers.results = {(3, 0): "ref"}
    monkeypatch.setattr(ray, "wait", lambda refs, **kwargs: (refs, []))
    failures = {
        "died": ray.exceptions.ActorDiedError(),
        r"died, and its result with it \(OwnerDiedError\)": ray.exceptions.OwnerDiedError("ab" * 14, None, ""),
        "failed: ValueError: bad task": ray.exceptions.RayTaskError("sample", "Traceback ...\nValueError: bad task",
                                                                   ValueError("bad task")),
    }
    for expected, error in failures.items():
        monkeypatch.setattr(ray, "get", lambda ref, error=error: (_ for _ in ()).throw(error))
        with pytest.raises(RolloutWorkerError, match=rf"^rollout worker 0 \(a Ray actor\) {expected}") as raised:
            workers.result(3, 0, 0.0)
        assert "\n" not in str(raised.value)


# ------------------------------------------------------------------------ bad input, before any model

def test_a_placement_the_cluster_cannot_hold_names_what_was_asked_and_what_is_there():
    config = load_config(None, ["--rollout.workers=3", "--grpo.prompts_per_step=4", "--rollout.worker_threads=2",
                                "--distributed.launcher=ray"])
    assert worker_bundles(config) == [{"CPU": 2.0}] * 3
    with pytest.raises(ConfigError, match=r"^distributed.launcher=ray: the placement asks for 7 CPU \(the trainer 1 "
                                          r"\+ 3 rollout worker\(s\)\) but the cluster has 2: lower rollout.workers"):
        check_placement(worker_bundles(config), {"CPU": 2.0}, {"CPU": 1.0})
    check_placement(worker_bundles(config), {"CPU": 8.0}, {"CPU": 1.0})


def test_too_many_workers_for_this_machine_stop_before_any_model_loads(tmp_path):
    out = tmp_path / "run"
    proc = cli("train", f"--output_dir={out}", "--rollout.workers=8", "--rollout.mode=one_step_off",
               "--distributed.launcher=ray", "--rollout.worker_threads=4", expect=2, env=ENV, timeout=300)
    assert "the placement asks for" in proc.stderr and "but the cluster has" in proc.stderr
    assert not (out / "checkpoints").exists() and "parameters" not in proc.stdout


@pytest.mark.parametrize("overrides, match", [
    (["--distributed.launcher=ray"], "distributed.launcher=ray places rollout workers: set rollout.workers"),
    (["--distributed.launcher=ray", "--rollout.workers=1", "--rollout.worker_launch=external"],
     "starts the rollout workers itself"),
])
def test_ray_settings_that_cannot_work_are_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_without_ray_the_launcher_is_one_line_with_the_install_command(monkeypatch):
    from grpokit.pipeline import ray_cluster

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ConfigError, match=r"needs Ray, which is not installed: pip install 'grpokit\[ray\]'"):
        ray_cluster.import_ray()


def test_a_store_beyond_loopback_needs_a_shared_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(TransportError, match=rf"listens beyond this machine.*set {SECRET_ENV}"):
        StoreTransport.host("0.0.0.0:0", 10.0)


def test_a_killed_trainer_leaves_no_actor_and_the_resume_equals_the_run_never_interrupted(
        ray_run, sft_checkpoint, tmp_path):
    """The trainer is the Ray driver: SIGKILLed after step 3 (checkpoint step-2, batches 3 and 4 in flight),
    its cluster and actors go with it, and `--resume` ends where the uninterrupted run did, bit for bit."""
    run = tmp_path / "killed"
    proc = start("train", f"--output_dir={run}", f"--model.name_or_path={sft_checkpoint}", *ASYNC,
                 "--distributed.launcher=ray")
    _actor_pids()
    wait_for_rows(run / "metrics.jsonl", 3, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    wait_until_gone("RolloutWorkerActor", "a rollout-worker actor outlived its trainer")
    cli("train", str(run / "config.yaml"), "--resume", "--quiet", env=ENV)
    assert comparable(rows(run)) == comparable(rows(ray_run))
    assert same_weights(weights(run, 6), weights(ray_run, 6))


def wait_until_gone(process_name: str, failure: str, timeout: float = 60.0) -> None:
    """Block until no process's command line holds `process_name` (Ray names actors' processes after them)."""
    deadline = time.monotonic() + timeout
    while subprocess.run(["pgrep", "-f", process_name], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, failure
        time.sleep(0.5)


# ------------------------------------------------------------ the trainer's ranks as Ray actors

def test_torchruns_environment_for_each_rank_counts_local_ranks_per_machine():
    from grpokit.pipeline.ray_trainers import rank_environments

    envs = rank_environments(["a", "a", "b"], "10.0.0.1", 29500, gpu=False)
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "2"), ("1", "1", "2"), ("2", "0", "1")]
    assert {(e["WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"], e["TORCHELASTIC_USE_AGENT_STORE"]) for e in envs} == {
        ("3", "10.0.0.1", "29500", "True")}
    # on GPUs each actor sees only its own device
    assert [e["LOCAL_RANK"] for e in rank_environments(["a", "a"], "h", 1, gpu=True)] == ["0", "0"]


def test_ranks_without_the_ray_launcher_are_a_config_error_naming_torchrun():
    with pytest.raises(ConfigError, match=r"distributed.ranks=2 asks Ray to start the trainer's processes: set "
                                          r"distributed.launcher=ray, or .* torchrun --nproc_per_node=2"):
        load_config(None, ["--distributed.ranks=2"])


@pytest.fixture(scope="module")
def four_cpus():
    """A cluster of 4 logical CPUs on this machine: 2 trainer ranks and 1 rollout worker fit in it."""
    from ray.cluster_utils import Cluster

    # Token authentication, explicitly off on both sides: left unset, each side decides from whether an
    # earlier private cluster left a token file, and this process may already have decided otherwise.
    before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "object_store_memory": 200 << 20,
                                                            "include_dashboard": False})
    try:
        yield dict(ENV, RAY_ADDRESS=cluster.address, RAY_AUTH_MODE="disabled")
    finally:
        cluster.shutdown()
        if before is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = before


@pytest.fixture(scope="module")
def two_ranks_on_ray(sft_checkpoint, tmp_path_factory, four_cpus):
    out = tmp_path_factory.mktemp("ranks") / "run"
    proc = cli("train", f"--output_dir={out}", f"--model.name_or_path={sft_checkpoint}", *ONE_STEP_OFF, *RANKS,
               env=four_cpus)
    assert "2 trainer ranks started as Ray actors on 1 machine(s)" in proc.stderr
    return out


def test_two_trainer_ranks_as_ray_actors_learn_what_one_rank_does(two_ranks_on_ray, sft_checkpoint, tmp_path):
    """The torchrun sharded test's comparison, with Ray starting both FSDP2 ranks and the worker."""
    one = tmp_path / "one"
    cli("train", f"--output_dir={one}", f"--model.name_or_path={sft_checkpoint}", *ONE_STEP_OFF,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert_learns_what_one_rank_does(two_ranks_on_ray, one)


def test_a_killed_trainer_rank_actor_is_one_line_and_the_resume_equals_the_run_never_interrupted(
        two_ranks_on_ray, sft_checkpoint, tmp_path, four_cpus):
    run = tmp_path / "killed"
    proc = start("train", f"--output_dir={run}", f"--model.name_or_path={sft_checkpoint}", *ONE_STEP_OFF, *RANKS,
                 env=four_cpus)
    wait_for_rows(run / "metrics.jsonl", 2, proc)
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / "step-2").is_dir():  # renamed into place once whole (run/checkpoint.py)
        assert time.monotonic() < deadline and proc.poll() is None, "no step-2 checkpoint"
        time.sleep(0.05)
    ranks = subprocess.run(["pgrep", "-f", "TrainerRankActor"], capture_output=True, text=True).stdout.split()
    assert len(ranks) == 2, ranks
    os.kill(int(ranks[-1]), signal.SIGKILL)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if "(a Ray actor) died" in line]
    assert len(lines) == 1 and "trainer rank " in lines[0], err[-3000:]
    assert f"resume with: grpokit train {run / 'config.yaml'} --resume" in lines[0]
    wait_until_gone("TrainerRankActor", "a trainer rank's actor outlived the run")
    cli("train", str(run / "config.yaml"), "--resume", "--quiet", env=four_cpus)
    assert comparable(rows(run)) == comparable(rows(two_ranks_on_ray))
    assert same_weights(weights(run, 4), weights(two_ranks_on_ray, 4))


@pytest.mark.long  # two more Ray clusters' worth of a run; by hand with make test-long
def test_two_trainer_ranks_on_two_simulated_machines_train_as_on_one(two_ranks_on_ray, sft_checkpoint, tmp_path):
    """Three nodes of one CPU (ray.cluster_utils.Cluster): the trainer's two ranks cannot share a machine,
    so each is local rank 0 of its own and they meet at rank 0's store across nodes; the worker takes the
    third. The run is the one whose ranks shared a machine, bit for bit."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 200 << 20,
                                                            "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, object_store_memory=200 << 20)
        cluster.wait_for_nodes()
        out = tmp_path / "run"
        proc = cli("train", f"--output_dir={out}", f"--model.name_or_path={sft_checkpoint}", *ONE_STEP_OFF, *RANKS,
                   env=dict(ENV, RAY_ADDRESS=cluster.address, RAY_AUTH_MODE="disabled"))
        assert "2 trainer ranks started as Ray actors on 2 machine(s)" in proc.stderr, proc.stderr[-3000:]
        assert comparable(rows(out)) == comparable(rows(two_ranks_on_ray))
        assert same_weights(weights(out, 4), weights(two_ranks_on_ray, 4))
    finally:
        cluster.shutdown()


def test_the_ray_overhead_benchmark_adds_its_rounds_to_the_results_file(sft_checkpoint, tmp_path):
    """benchmarks/ray_overhead.py, the source of docs/results/async.md's overhead table: a short round keeps
    the file's earlier rows and adds its own, with the numbers the table shows and the command that made them."""
    import json
    from pathlib import Path

    results = tmp_path / "ray-overhead.json"
    results.write_text(json.dumps({"about": "earlier", "tables": {"overhead": {"columns": [], "rows": [{"code": "x"}]}}}))
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "ray_overhead.py"), "--model", str(sft_checkpoint),
                           "--steps", "3", "--warmup", "1", "--rounds", "1", "--workdir", str(tmp_path / "work"),
                           "--json", str(results), "--label", "smoke"], env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads(results.read_text())
    earlier, row = data["tables"]["overhead"]["rows"]
    assert earlier == {"code": "x"} and data["about"] == "earlier"
    assert row["code"] == "smoke" and row["round"] == 1 and row["store"] > 0 and row["ray"] > 0
    assert 0 <= row["idle"] <= 1
    assert abs(float(row["ratio"].rstrip("×")) - row["ray"] / row["store"]) < 0.02
    assert data["runs"][0]["label"] == "smoke" and "--rounds 1" in data["runs"][0]["command"]
    assert f"round 1: store {row['store']} s/step, ray {row['ray']} s/step" in done.stdout
