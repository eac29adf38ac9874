"""distributed.ranks > 1 with launcher=ray: Ray starts the trainer's processes, torchrun's way.

`grpokit train --distributed.launcher=ray --distributed.ranks=N` makes this process a driver: it places N
trainer ranks in one placement group (packed onto as few machines as hold them), gives each the
environment torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
and runs the unchanged command in each: the same FSDP2 loop as under torchrun, whose rank 0 holds the
schedule and places the rollout workers (pipeline/ray_cluster.py). Rank 0's actor hosts the rendezvous
store on a port it binds itself, on loopback when every rank shares its machine, else on that machine's
Ray address alone (never every interface); every rank joins it as torchrun's ranks join their agent's.

An actor that dies ends the run in one line naming its rank and the resume command; the other ranks are
stopped at once, not at their next collective's timeout. Recovery is grpokit's exact resume.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections import Counter
from collections.abc import Callable

from grpokit.distributed import RAY_TRAINER_RANK_ENV
from grpokit.errors import ConfigError
from grpokit.pipeline.ray_cluster import check_placement, connect, import_ray, trainer_bundle, worker_bundles


def rank_environments(nodes: list[str], master_addr: str, master_port: int, gpu: bool) -> list[dict[str, str]]:
    """torchrun's environment for each rank, given the machine (node id) each rank's actor landed on:
    local ranks count up per machine in rank order. On GPUs Ray shows each actor only its own GPU, so
    every rank's device is cuda:0 of what it sees."""
    per_node, seen = Counter(nodes), Counter()
    envs = []
    for rank, node in enumerate(nodes):
        envs.append({"RANK": str(rank), "WORLD_SIZE": str(len(nodes)), "GROUP_RANK": "0",
                     "LOCAL_RANK": "0" if gpu else str(seen[node]), "LOCAL_WORLD_SIZE": str(per_node[node]),
                     "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
                     # join the store rank 0's actor already hosts, as torchrun's ranks join their agent's
                     "TORCHELASTIC_USE_AGENT_STORE": "True", RAY_TRAINER_RANK_ENV: "1"})
        seen[node] += 1
    return envs


class TrainerRankActor:
    """The body of one trainer rank's Ray actor."""

    def where(self) -> tuple[str, str]:
        """(node id, node address) of this actor's machine."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def host_store(self, host: str, world_size: int, timeout_s: float) -> int:
        """Host the ranks' rendezvous store at `host` alone, on a port the system picks; its port. TCPStore
        binds every interface unless handed a socket already bound."""
        import socket

        from torch.distributed import TCPStore

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(128)
        self._store = TCPStore(host, self._listener.getsockname()[1], world_size, is_master=True,
                               wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s),
                               master_listen_fd=self._listener.fileno())
        return self._store.port

    def run(self, command: Callable[[], int], env: dict[str, str]) -> int:
        """`command` as this rank: its exit code."""
        os.environ.update(env)
        return command()


def run(config, command: Callable[[], int]) -> int:
    """Start the trainer's ranks as Ray actors, run `command` (the run of `config`, as the command line
    runs it; an exit code) in each, and wait: 0 when every rank finished, else the first failure's code
    after one line naming the rank."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ranks, gpu = config.distributed.ranks, config.model.device.startswith("cuda")
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # no color codes in a log file
    connect(config, log_to_driver=True)  # rank 0's output, and every rank's errors, print here
    bundle = trainer_bundle(config)
    check_placement(worker_bundles(config), ray.available_resources(),
                    {key: amount * ranks for key, amount in bundle.items()})
    group = placement_group([bundle] * ranks, strategy="PACK")
    actors = []
    try:
        if not group.wait(timeout_seconds=config.rollout.worker_start_timeout_s):
            raise ConfigError(f"distributed.launcher=ray: the cluster did not grant the trainer's {ranks} bundle(s) "
                              f"{bundle} within rollout.worker_start_timeout_s={config.rollout.worker_start_timeout_s:g}s")
        actor_class = ray.remote(max_restarts=0, max_task_retries=0)(TrainerRankActor)
        for rank in range(ranks):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
            actors.append(actor_class.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                              scheduling_strategy=strategy).remote())
        places = ray.get([actor.where.remote() for actor in actors])
        # one machine: loopback; several: rank 0's machine's address in the cluster, which its peers reach
        host = "127.0.0.1" if len({node for node, _ in places}) == 1 else places[0][1]
        port = ray.get(actors[0].host_store.remote(host, ranks, config.distributed.timeout_s))
        envs = rank_environments([node for node, _ in places], host, port, gpu)
        runs = {actor.run.remote(command, env): rank for rank, (actor, env) in enumerate(zip(actors, envs))}
        print(f"grpokit: {ranks} trainer ranks started as Ray actors on {len(set(places))} machine(s)",
              file=sys.stderr)
        return _wait(ray, runs, _resume_hint(config))
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(group)


def _resume_hint(config) -> str:
    return f"; resume with: grpokit train {os.path.join(config.output_dir, 'config.yaml')} --resume"


def _wait(ray, runs: dict, resume_hint: str) -> int:
    """Wait for every rank's run: 0 when all finished. At the first that ends otherwise, one line naming the
    rank that died (a rank that outlives a dead peer fails too, at its next collective: the death is the
    cause, so it is the one named), and the run's exit code."""
    pending = list(runs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        code, failure = _outcome(ray, done[0])
        if failure is None and code == 0:
            continue
        # the others' ends within a few seconds: a peer's death shows there if it caused this failure
        ended, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_GRACE_S) if pending else ([], [])
        outcomes = {runs[ref]: _outcome(ray, ref) for ref in [done[0], *ended]}
        deaths = sorted(rank for rank, (_, why) in outcomes.items() if why and why.startswith("died"))
        rank = deaths[0] if deaths else runs[done[0]]
        code, failure = outcomes[rank]
        if failure is None:  # the rank said why on its own stderr, printed here
            return code
        print(f"grpokit: trainer rank {rank} (a Ray actor) {failure}; the run stops{resume_hint}", file=sys.stderr)
        return 1
    return 0


DEATH_GRACE_S = 5.0


def _outcome(ray, ref) -> tuple[int, str | None]:
    """(exit code, None) of a rank's run that returned, or (1, what happened) when its actor died or its
    run raised."""
    try:
        return ray.get(ref), None
    except ray.exceptions.RayActorError as err:
        why = (str(err).strip().splitlines() or [""])[0][:200]
        return 1, "died" + (f" ({why})" if why else "")
    except ray.exceptions.RayError as err:
        return 1, f"failed ({type(err).__name__})"
