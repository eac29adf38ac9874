"""The trainer's side of its rollout workers (rollout.workers; docs/async.md).

The trainer listens on a key store at rollout.worker_address, on that interface alone, every message
authenticated with the run's secret (rollout/transport.py, docs/guides/security.md). Each worker (pipeline/rollout_worker.py,
spawned here or started elsewhere with `grpokit rollout-worker --connect HOST:PORT --index I`)
reads the run's config from it, builds its own engine, and then, in a loop, takes the next task
the trainer queued for it (a batch's share of prompts, their seeds, the policy version to sample
from), waits until it holds that version, samples, and puts the rollouts back on the store.
Weights go over the workers' own process group (rollout/weight_channel.py) after each step.

Which version samples which batch is fixed by the schedule (rollout/schedule.py), and every
task carries its seeds, so a worker's output depends on the weights and the task alone: timing
can make the trainer wait, never change what it computes. That is also what makes a resume exact:
a checkpoint keeps the tasks in flight and the rollouts of those sampled by older weights
(`in_flight`), and the resumed run re-queues the rest (`restore`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch

from grpokit.rollout.schedule import worker_shares
from grpokit.rollout.transport import SECRET_ENV, StoreTransport, Transport, run_secret
from grpokit.rollout.wire import RolloutWorkerError, Task, checked_rollout, decode, encode
from grpokit.types import Rollout
from grpokit.models.device import model_device
from grpokit.models.lora import policy_weights

CHECK_WINDOW_S = 0.1  # the longest a wait for a key goes without looking at the workers and the clock
CHECK_S = 0.5  # how often a wait looks at the workers' health
DEATH_GRACE_S = 5.0  # how long a failed push looks for the worker whose death failed it


def _parent_death_signal():
    """preexec_fn for a spawned worker: SIGKILL when the trainer dies (Linux), whatever killed it.
    prctl is looked up here, in the parent: the child between fork and exec must not load libraries."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _weights(model: torch.nn.Module) -> Mapping:
    """What a worker's plain model receives: the state dict, or a LoRA policy's merged weights."""
    return policy_weights(model)


def _value(tensor_or_fn) -> torch.Tensor:
    """The whole tensor a worker receives: made on demand (a LoRA layer's merged weight), and gathered
    from every FSDP2 rank where it is sharded (a collective: every trainer rank calls it, in one order)."""
    from torch.distributed.tensor import DTensor

    value = tensor_or_fn() if callable(tensor_or_fn) else tensor_or_fn
    return value.full_tensor() if isinstance(value, DTensor) else value


def push_order(model: torch.nn.Module) -> list[str]:
    """The names a push sends, in the order every trainer rank gathers them."""
    return _distinct_tensors(_weights(model))


def gather_for_push(model: torch.nn.Module) -> None:
    """A trainer rank other than 0 during a push: its part of gathering each sharded tensor, in
    push_order, while rank 0 sends them (RemoteRollouts.push)."""
    weights = _weights(model)
    for name in push_order(model):
        _value(weights[name])


def _distinct_tensors(weights: Mapping) -> list[str]:
    """The names to push: one per storage (tied embeddings are one tensor under two names, and the
    worker's model ties them the same way, so loading one loads both)."""
    names, seen = [], set()
    for name, value in weights.items():
        key = None if callable(value) else _storage_key(value)
        if key is None or key not in seen:
            names.append(name)
            seen.add(key)
    return names


def _storage_key(value: torch.Tensor) -> tuple:
    """Where a tensor's values lie: tied tensors share it (an FSDP2 DTensor by its local shard's)."""
    local = getattr(value, "_local_tensor", value)
    return local.untyped_storage().data_ptr(), local.storage_offset(), tuple(value.shape)


class WorkerLink(Protocol):
    """How the trainer hands its workers the run, their tasks and the weights, and gets their results:
    keys on the run's store (StoreLink), or calls to Ray actors (pipeline/rollout_worker.py, RayWorkers)."""

    address: str

    def post_setup(self, data: bytes) -> None: ...
    def ready(self, w: int, timeout_s: float) -> bool: ...  # worker w has started (waits up to timeout_s)
    def dtypes(self) -> list[str]: ...  # the dtypes the workers hold each pushed tensor in
    def failure(self, w: int) -> str | None: ...  # the error worker w reported, if any
    def heartbeat(self, w: int) -> int | None: ...  # worker w's heart beats so far (None: not counted)
    def queue(self, task: Task, data: bytes) -> None: ...
    def result(self, batch: int, w: int, timeout_s: float) -> bytes | None: ...  # None: not yet
    def weights(self, size: int, device: torch.device, timeout_s: float): ...  # the trainer's end of the weight group
    def stop_tasks(self) -> None: ...  # no task comes any more
    def close(self) -> None: ...


class StoreLink:
    """WorkerLink over the run's key store: each worker reads its tasks as task/<w>/<n> and answers
    under result/<batch>/<w>, beats its heart under beat/<w> and reports a failure under error/<w>."""

    def __init__(self, transport: Transport):
        self.transport, self.address = transport, transport.address
        self.secret = getattr(transport, "secret", "")
        self.sent: dict[int, int] = {}  # tasks queued per worker: the key of the next

    def post_setup(self, data: bytes) -> None:
        self.transport.set("setup", data)

    def ready(self, w: int, timeout_s: float) -> bool:
        return self.transport.wait_any([f"ready/{w}"], timeout_s) is not None

    def dtypes(self) -> list[str]:
        return decode(self.transport.get("dtypes/0"))["dtypes"]

    def failure(self, w: int) -> str | None:
        return self.transport.get(f"error/{w}").decode() if self.transport.check(f"error/{w}") else None

    def heartbeat(self, w: int) -> int | None:
        return self.transport.add(f"beat/{w}", 0)

    def queue(self, task: Task, data: bytes) -> None:
        n = self.sent.get(task.worker, 0)
        self.transport.set(f"task/{task.worker}/{n}", data)
        self.sent[task.worker] = n + 1

    def result(self, batch: int, w: int, timeout_s: float) -> bytes | None:
        key = f"result/{batch}/{w}"
        return self.transport.pop(key) if self.transport.wait_any([key], timeout_s) else None

    def weights(self, size: int, device: torch.device, timeout_s: float):
        return self.transport.weights(0, size, device, timeout_s)

    def stop_tasks(self) -> None:
        self.transport.set("stop", b"1")

    def close(self) -> None:
        self.transport.close()


class WorkerLauncher(Protocol):
    """Starts the rollout workers and says how each one ended: processes on this machine
    (SubprocessWorkers), or Ray actors (pipeline/rollout_worker.py, RayWorkers)."""

    def start(self, link: WorkerLink, workers: int, threads: int, device: torch.device) -> None: ...
    def ended(self, w: int) -> str | None: ...  # "was killed by SIGKILL", "exited with code 1; ...", or None
    def describe(self, w: int) -> str: ...
    def stop(self, failed: bool) -> None: ...


class SubprocessWorkers:
    """`grpokit rollout-worker --connect ADDRESS --index I` processes on this machine: on CUDA worker w on GPU
    w + 1 (NCCL puts one rank on a GPU; the trainer has GPU 0), on CPU sharing the cores."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def start(self, link: WorkerLink, workers: int, threads: int, device: torch.device) -> None:
        gpus = torch.cuda.device_count() if device.type == "cuda" else 0
        if device.type == "cuda" and gpus < workers + 1:
            raise RolloutWorkerError(
                f"rollout.workers={workers} spawned beside the trainer need {workers + 1} GPUs (one each), "
                f"and this machine shows {gpus}: lower rollout.workers, or start workers on other machines "
                f"(rollout.worker_launch=external)")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
        if getattr(link, "secret", ""):
            env[SECRET_ENV] = link.secret  # the run's own, made for its spawned workers when none is set
        env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)  # not part of torchrun's world
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))).split(",")
        for w in range(workers):
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = visible[((device.index or 0) + w + 1) % gpus]
            self.logs.append(self.log_dir / f"rollout-worker-{w}.log")
            with open(self.logs[w], "wb") as log:
                command = [sys.executable, "-m", "grpokit", "rollout-worker", "--connect", link.address,
                           "--index", str(w)] + (["--threads", str(threads)] if threads else []) + \
                    (["--device", "cuda"] if gpus else [])  # the one GPU CUDA_VISIBLE_DEVICES leaves it
                # its own session: a Ctrl-C at the terminal reaches the trainer alone, which saves (waiting
                # for the batches in flight) and then stops its workers
                self.processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                       preexec_fn=_parent_death_signal(), start_new_session=True))

    def describe(self, w: int) -> str:
        if w >= len(self.processes):
            return f"rollout worker {w}"
        return f"rollout worker {w} (pid {self.processes[w].pid}, log {self.logs[w]})"

    def ended(self, w: int) -> str | None:
        if w >= len(self.processes) or self.processes[w].poll() is None:
            return None
        code = self.processes[w].returncode
        return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}{self._tail(w)}"

    def _tail(self, w: int) -> str:
        if not self.logs[w].is_file():
            return ""
        lines = [line for line in self.logs[w].read_text(errors="replace").splitlines() if line.strip()]
        return f"; its log ends: {lines[-1].strip()[:300]}" if lines else ""

    def stop(self, failed: bool) -> None:
        for process in self.processes:
            try:
                process.wait(timeout=0 if failed else 30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class ExternalWorkers:
    """Workers someone else starts (rollout.worker_launch=external): the trainer only waits for them."""

    def start(self, link: WorkerLink, workers: int, threads: int, device: torch.device) -> None:
        print(f"grpokit: waiting for {workers} rollout worker(s): on each machine run `grpokit "
              f"rollout-worker --connect {link.address} --index I` with I = 0..{workers - 1}",
              file=sys.stderr)

    def describe(self, w: int) -> str:
        return f"rollout worker {w}"

    def ended(self, w: int) -> str | None:
        return None

    def stop(self, failed: bool) -> None:
        """They stop when the trainer's store says so."""


class RemoteRollouts:
    """Starts or awaits the workers, queues their tasks, pushes weights, collects and checks rollouts."""

    def __init__(self, rollout_config, run_config: dict, model: torch.nn.Module, sampling: dict, group_size: int,
                 model_len: int, timeout_s: float, log_dir: Path, pad_id: int,
                 transport: Transport | WorkerLink | None = None, launcher: WorkerLauncher | None = None):
        """transport: how trainer and workers reach each other (default: the key store at
        rollout.worker_address; a Transport is used as that store, a WorkerLink as it is); launcher: who
        starts the workers (default: by rollout.worker_launch)."""
        self.workers, self.group_size, self.pad_id = rollout_config.workers, group_size, pad_id
        self.timeout_s, self.log_dir = timeout_s, Path(log_dir)
        # start-up (imports, model load) may take longer than a hung worker is given later
        self.start_timeout_s = rollout_config.worker_start_timeout_s
        self.started = False
        self.device = model_device(model)
        if transport is None:
            transport = StoreTransport.host(rollout_config.worker_address, timeout_s,
                                            run_secret(spawned=rollout_config.worker_launch == "spawn"))
        self.link: WorkerLink = transport if hasattr(transport, "queue") else StoreLink(transport)
        self.address = self.link.address
        self.launcher = launcher or (SubprocessWorkers(self.log_dir) if rollout_config.worker_launch == "spawn"
                                     else ExternalWorkers())
        weights = _weights(model)
        self.names = _distinct_tensors(weights)
        # shapes and dtypes as declared (a DTensor's are the whole tensor's): nothing is gathered here, on
        # rank 0 alone of a sharded trainer
        shapes = [(name, list(weights[name].shape), str(weights[name].dtype).removeprefix("torch."))
                  for name in self.names]
        self.link.post_setup(encode({"config": run_config, "tensors": shapes, "sampling": sampling,
                                     "group_size": group_size, "model_len": model_len, "timeout_s": timeout_s,
                                     "device": self.device.type}))
        self.channel = None
        self.tasks: dict[int, list[Task]] = {}  # batch -> its task per worker, until the batch is taken
        self.received: dict[int, dict[int, dict]] = {}  # batch -> worker -> the message it returned
        self.version = -1  # the newest version pushed
        self.pushed_bytes = 0
        self.received_bytes: dict[int, int] = {}  # batch -> rollout bytes read from the transport
        self.last_failure = ""  # what the workers' tool engines say failed their last samples
        self._beats = [(-1, time.monotonic())] * self.workers
        self._checked = 0.0
        self.threads = ""  # how spawned workers and the trainer share this machine's cores, said at start
        try:
            spawned = isinstance(self.launcher, SubprocessWorkers) or getattr(self.launcher, "shares_cores", False)
            threads = self._share_cores(rollout_config.worker_threads) if spawned else rollout_config.worker_threads
            self.launcher.start(self.link, self.workers, threads, self.device)
            self._await_ready()
            self.started = True
            self._beats = [(-1, time.monotonic())] * self.workers  # their hearts are timed from here on
            # the dtypes the workers hold each tensor in: pushes are cast to them (same config, same dtypes)
            self.dtypes = [getattr(torch, d) for d in self.link.dtypes()]
            self.channel = self.link.weights(self.workers + 1, self.device, timeout_s)
        except BaseException:
            self.close(failed=True)
            raise

    def _share_cores(self, threads: int) -> int:
        """Torch threads per spawned worker: rollout.worker_threads, or on CPU (0) an equal share of the
        cores this process may use, the trainer keeping the rest; more threads than cores in all would
        make every process wait on the others."""
        if threads or self.device.type != "cpu":
            return threads
        cores = len(os.sched_getaffinity(0))
        threads = max(1, cores // (self.workers + 1))
        torch.set_num_threads(max(1, cores - threads * self.workers))
        self.threads = f"; {threads} thread(s) per worker, {torch.get_num_threads()} for the trainer"
        return threads

    # ------------------------------------------------------------------ health

    def check_workers(self) -> None:
        """Raise RolloutWorkerError naming the first worker that reported a failure, exited, or has
        not beaten its heart for distributed.timeout_s since the workers started."""
        now = time.monotonic()
        for w in range(self.workers):
            failure = self.link.failure(w)
            if failure is not None:
                raise RolloutWorkerError(f"{self.launcher.describe(w)} failed: {failure}")
            ended = self.launcher.ended(w)
            if ended is not None:
                raise RolloutWorkerError(f"{self.launcher.describe(w)} {ended}")
            beat = self.link.heartbeat(w)
            if beat is None:  # not counted (Ray: a dead actor fails its calls)
                continue
            if beat != self._beats[w][0]:
                self._beats[w] = (beat, now)
            elif self.started and now - self._beats[w][1] > self.timeout_s:
                raise RolloutWorkerError(f"{self.launcher.describe(w)} has not answered for "
                                         f"{now - self._beats[w][1]:.0f}s (distributed.timeout_s={self.timeout_s:g})")

    def _checked_now(self) -> None:
        """check_workers at most every CHECK_S (it asks each worker's launcher and transport)."""
        if time.monotonic() - self._checked > CHECK_S:
            self._checked = time.monotonic()
            self.check_workers()

    def _await_ready(self) -> None:
        """Wait until every worker has started, checking their health meanwhile; the start must end
        within rollout.worker_start_timeout_s."""
        started = time.monotonic()
        for w in range(self.workers):
            # each wait returns as soon as the worker is ready, at the latest after CHECK_WINDOW_S
            while not self.link.ready(w, CHECK_WINDOW_S):
                self._checked_now()
                if time.monotonic() - started > self.start_timeout_s:
                    raise RolloutWorkerError(f"only some of the {self.workers} rollout worker(s) started within "
                                             f"rollout.worker_start_timeout_s={self.start_timeout_s:g}s (missing: "
                                             f"ready/{w})")

    # ------------------------------------------------------------------ weights

    def push(self, version: int, model: torch.nn.Module) -> None:
        """Send the policy as `version` to every worker (each stages it until a task asks for it)."""
        weights = _weights(model)
        try:
            self.pushed_bytes = self.channel.push(version, (_value(weights[n]) for n in self.names), self.dtypes,
                                                  len(self.names))
        except RuntimeError as err:  # a peer died or hung inside the collective
            # a dead peer resets the group's sockets at once, but its launcher (Ray) may learn of the death
            # a moment later: look for it a few seconds before blaming the push itself
            deadline = time.monotonic() + DEATH_GRACE_S
            while True:
                try:
                    self.check_workers()
                except RolloutWorkerError as named:
                    raise named from None
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            raise RolloutWorkerError(f"pushing policy version {version} to the rollout workers failed within "
                                     f"distributed.timeout_s={self.timeout_s:g}s: {str(err).splitlines()[0][:300]}") \
                from None
        self.version = version

    # ------------------------------------------------------------------ tasks and rollouts

    def submit(self, batch: int, version: int, rows: list[dict], seeds: list[int]) -> None:
        """Queue batch `batch` (its prompts and one seed per completion) to be sampled by `version`,
        each worker taking its contiguous share of whole groups."""
        g, tasks = self.group_size, []
        for w, share in enumerate(worker_shares(len(rows), self.workers)):
            tasks.append(Task(batch, version, w, rows[share.start:share.stop], seeds[share.start * g:share.stop * g]))
        self.tasks[batch] = tasks
        for task in tasks:
            self._queue(task)

    def _queue(self, task: Task) -> None:
        self.link.queue(task, encode(task.to_dict()))

    def _receive(self, batch: int) -> float:
        """Wait for every worker's share of `batch`; the seconds waited."""
        waited = 0.0
        for task in self.tasks[batch]:
            if task.worker in self.received.setdefault(batch, {}):
                continue
            started = time.monotonic()
            while (data := self.link.result(batch, task.worker, CHECK_WINDOW_S)) is None:
                self._checked_now()
            waited += time.monotonic() - started
            self.received_bytes[batch] = self.received_bytes.get(batch, 0) + len(data)
            self.received[batch][task.worker] = decode(data)
        return waited

    def take(self, batch: int) -> tuple[Rollout, int, dict, float]:
        """(batch `batch`'s rollout, the version that sampled it, the workers' engine metrics, seconds
        waited for it), each worker's share checked (wire.checked_rollout) first. The engine metrics
        (a tool engine's tool/*) are means weighted by each share's prompts, except wall times and
        rounds, which the slowest worker sets: their maximum. `rollout/received_bytes` is the batch's size
        on the wire."""
        if batch not in self.tasks:
            raise RolloutWorkerError(f"batch {batch} was never queued to the rollout workers")
        waited = self._receive(batch)
        tasks, messages = self.tasks.pop(batch), self.received.pop(batch)
        parts = [checked_rollout(messages[t.worker], t, self.group_size) for t in tasks]
        self.last_failure = next((m.get("failure", "") for m in messages.values() if m.get("failure")), "")
        metrics: dict[str, float] = {"rollout/received_bytes": self.received_bytes.pop(batch, 0)}
        prompts = sum(len(t.rows) for t in tasks)
        for t in tasks:
            for key, value in messages[t.worker].get("metrics", {}).items():
                if key.endswith(("wall_s", "rounds")):
                    metrics[key] = max(metrics.get(key, 0.0), float(value))
                else:
                    metrics[key] = metrics.get(key, 0.0) + float(value) * len(t.rows) / prompts
        return Rollout.cat(parts, self.pad_id), tasks[0].version, metrics, waited

    # ------------------------------------------------------------------ checkpoints

    def in_flight(self, version: int) -> list[dict]:
        """What a checkpoint at policy `version` keeps of the queued batches: every task, and the
        rollouts of those sampled by an older version, which a resumed run cannot sample again
        (it waits for them here). Batches that `version` samples are sampled again after resume."""
        saved = []
        for batch in sorted(self.tasks):
            tasks = self.tasks[batch]
            entry = {"tasks": [t.to_dict() for t in tasks]}
            if tasks[0].version < version:
                self._receive(batch)
                entry["results"] = [self.received[batch][t.worker] for t in tasks]
                entry["received_bytes"] = self.received_bytes.get(batch, 0)  # logged when the batch is learnt
            saved.append(entry)
        return saved

    def restore(self, saved: list[dict], staleness: int) -> tuple[dict[int, tuple[list, list]], int]:
        """Take back a checkpoint's in-flight batches (before the first push). Kept rollouts are used
        as they are, unless they are now staler than `staleness` allows (rollout.max_staleness lowered
        since): those are dropped. Returns ({batch: (rows, seeds)} of the batches to queue again,
        the completions dropped)."""
        again, dropped = {}, 0
        for entry in saved:
            tasks = [Task.from_dict(t) for t in entry["tasks"]]
            batch, results = tasks[0].batch, entry.get("results")
            if results is not None and batch - 1 - tasks[0].version <= staleness and len(results) == len(tasks):
                self.tasks[batch] = tasks
                self.received[batch] = {t.worker: r for t, r in zip(tasks, results)}
                self.received_bytes[batch] = int(entry.get("received_bytes", 0))
                continue
            if results is not None:
                dropped += sum(len(t.rows) for t in tasks) * self.group_size
            again[batch] = ([r for t in tasks for r in t.rows], [x for t in tasks for x in t.seeds])
        return again, dropped

    def queued(self, batch: int) -> bool:
        return batch in self.tasks

    # ------------------------------------------------------------------ shutdown

    def close(self, failed: bool = False) -> None:
        """Tell the workers to stop, wait a little for them, then end any that remain. After a
        failure (`failed`) a worker may be hung: the spawned ones are ended at once."""
        try:
            self.link.stop_tasks()
            if self.channel is not None:
                self.channel.abort() if failed else self.channel.stop()
        except RuntimeError:
            pass  # a worker is already gone: ended below
        self.launcher.stop(failed)
        self.link.close()
