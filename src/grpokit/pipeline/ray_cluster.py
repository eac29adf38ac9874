"""distributed.launcher: ray: Ray places the run's rollout workers and carries their traffic.

`grpokit train --launcher ray` joins the Ray cluster this machine belongs to (RAY_ADDRESS, or the one
`ray start --head` started here), or starts a private one for the run when there is none or when
RAY_ADDRESS=local. Before any model loads it checks that the cluster can hold the placement: one bundle
per rollout worker ({CPU: rollout.worker_threads or 1}, or {GPU: 1} on CUDA), kept apart from the
trainer's own resources. The trainer stays this process; its workers are Ray actors in those bundles
(pipeline/rollout_worker.py, RayWorkers), each asking for exactly its bundle: a task is a call to a
worker's `sample`, its result an ObjectRef the trainer waits on in worker order, and the weights go over a
gloo/NCCL group of the trainer and its workers, never through the object store. The schedule, seeds and
worker-order joins are the store transport's: the numbers do not change (tests/test_ray_launcher.py).
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

from grpokit import distributed
from grpokit.errors import ConfigError
from grpokit.pipeline.rollout_worker import RayWorkers

# The object store of a Ray this run starts itself: Ray's default takes 30% of memory
OBJECT_STORE_BYTES = 1 << 30
INSTALL = "pip install 'grpokit[ray]'"


def import_ray():
    """Ray, or a ConfigError with the install command."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"distributed.launcher=ray needs Ray, which is not installed: {INSTALL}") from None
    return ray


def worker_bundles(config) -> list[dict]:
    """One placement bundle per rollout worker."""
    r = config.rollout
    gpu = config.model.device.startswith("cuda")
    return [{"GPU": 1.0, "CPU": 1.0} if gpu else {"CPU": float(max(1, r.worker_threads))}
            for _ in range(r.workers)]


def trainer_bundle(config) -> dict:
    """The share of the cluster one trainer process holds."""
    return {"GPU": 1.0, "CPU": 1.0} if config.model.device.startswith("cuda") else {"CPU": 1.0}


def check_placement(bundles: list[dict], available: dict, trainer: dict) -> None:
    """The bundles, beside the trainer's own share, fit what the cluster has: else a ConfigError naming
    what was asked and what is there (before any model loads)."""
    asked = dict(trainer)
    for bundle in bundles:
        for key, amount in bundle.items():
            asked[key] = asked.get(key, 0.0) + amount
    short = {key: (amount, float(available.get(key, 0.0))) for key, amount in asked.items()
             if amount > available.get(key, 0.0) + 1e-9}
    if short:
        what = ", ".join(f"{amount:g} {key} (the trainer {trainer.get(key, 0):g} + {len(bundles)} rollout worker(s)) "
                         f"but the cluster has {have:g}" for key, (amount, have) in short.items())
        raise ConfigError(f"distributed.launcher=ray: the placement asks for {what}: lower rollout.workers or "
                          f"rollout.worker_threads, or add machines to the cluster (`ray start --address=...`)")


def connect(config, log_to_driver: bool = False) -> None:
    """Join the cluster this machine belongs to, or start a private one sized to this machine (always
    with RAY_ADDRESS=local, Ray's own word for it: a benchmark's run must not join a cluster left running).
    log_to_driver: actors' output is printed here (the trainer's ranks run in actors)."""
    ray = import_ray()
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # a worker's failed call is the trainer's to report, in one line; the calls still queued behind it
    # (batches in flight) would otherwise print Ray's traceback for each when they are dropped
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    quiet = dict(logging_level="ERROR", log_to_driver=log_to_driver)
    address = os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address, **quiet)
        return
    if address != "local" and _running_cluster():
        try:
            ray.init(address="auto", **quiet)
            return
        except ConnectionError:  # the address file of a cluster that is gone: start one of our own
            pass
    ray.init(num_cpus=os.cpu_count(), object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False, **quiet)


def _running_cluster() -> bool:
    """Whether `ray start` left a cluster on this machine (its address file)."""
    return Path("/tmp/ray/ray_current_cluster").is_file()


class RayLaunch:
    """The run's placement group and its workers (launcher and link at once); `close` frees the group
    (not the cluster)."""

    def __init__(self, config):
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group

        connect(config)
        self._remove = remove_placement_group
        bundles = worker_bundles(config)
        # the trainer's ranks as actors (pipeline/ray_trainers.py) hold their own placement already
        check_placement(bundles, ray.available_resources(), {} if distributed.started_by_ray() else trainer_bundle(config))
        self.group = placement_group(bundles, strategy="PACK")
        if not self.group.wait(timeout_seconds=config.rollout.worker_start_timeout_s):
            remove_placement_group(self.group)
            raise ConfigError(f"distributed.launcher=ray: the cluster did not grant the rollout workers' {len(bundles)} "
                              f"bundle(s) {bundles[0]} within rollout.worker_start_timeout_s="
                              f"{config.rollout.worker_start_timeout_s:g}s")
        # the trainer names the step and the resume command
        self.launcher = self.transport = RayWorkers(self.group, bundles, f"grpokit-{uuid.uuid4().hex[:12]}")

    def close(self) -> None:
        import ray

        try:
            self._remove(self.group)
        except Exception as err:  # noqa: BLE001 - a cluster already gone frees them itself
            print(f"grpokit: freeing the Ray placement: {type(err).__name__}", file=sys.stderr)
