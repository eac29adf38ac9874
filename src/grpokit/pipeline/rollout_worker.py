"""A rollout worker: a process of its own that samples the trainer's batches with its own engine
(`grpokit rollout-worker --connect HOST:PORT --index I`; rollout/remote.py is the trainer's side
and docs/async.md the whole picture).

It reads the run's config from the trainer's store and builds the policy and engine the trainer
would (model.name_or_path must be readable here too), joins the weight group, and then:
- a receiver thread takes every weight push as it comes and stages it, so the trainer never
  waits on a worker that is busy sampling;
- the main loop takes its next task, loads the staged version the task names (dropping older
  ones), samples the task's prompts with the task's seeds, adds the behaviour policy's log-probs
  when the engine does not report them, and puts the rollout on the store;
- a heartbeat thread tells the trainer it is alive.
Any failure is written to the store for the trainer to report, and the process exits.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import dataclasses
import sys
import threading
import time
import traceback

import torch

from grpokit.pipeline.build import load_policy
from grpokit.config import Config
from grpokit.config.loading import from_dict
from grpokit.models.logprobs import token_logprobs
from grpokit.rollout import SamplingParams, ToolEngine, make_engine
from grpokit.config.validation import secret_length_problem
from grpokit.rollout.transport import SECRET_ENV, StoreTransport, Transport, TransportError
from grpokit.rollout.weight_channel import STOP
from grpokit.rollout.wire import RolloutWorkerError, Task, decode, encode, rollout_to_dict
from grpokit.tools import make_tool
from grpokit.models.device import model_device

WAIT_S = 0.1  # the longest a worker waits for its next task before it looks at its weight stager again
BEAT_S = 1.0
# A collective's timeout is each process's own. The receiver waits for the next push as long as the
# trainer takes to learn, evaluate or save, so it waits long; the trainer's side of a push keeps
# distributed.timeout_s, and a trainer that dies closes the sockets, which ends the wait at once.
RECEIVER_TIMEOUT_S = 7 * 24 * 3600.0


class StagedVersions:
    """Weight pushes received but not yet loaded, by version; the receiver thread fills it."""

    def __init__(self, channel, shapes: list[tuple], device: torch.device):
        """shapes: (name, shape, dtype) of each tensor a push holds, in order."""
        self.channel, self.shapes, self.device = channel, shapes, device
        # on CUDA the receiver works on a stream of its own: a collective waiting for the next push
        # must not hold up the sampling queued on the default stream
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.versions: dict[int, list[torch.Tensor]] = {}
        self.error: str | None = None
        self.stopped = False
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._receive, name="weight-receiver", daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                self._receive_pushes()
        except Exception as err:  # noqa: BLE001 - reported to the trainer by the main loop
            self.error = f"receiving weights: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
        with self.changed:
            self.stopped = True
            self.changed.notify_all()

    def _receive_pushes(self) -> None:
        while True:
            version, count = self.channel.receive_header()
            if version == STOP:
                return
            if count != len(self.shapes):
                raise RuntimeError(f"the trainer pushed {count} tensors, this worker expects {len(self.shapes)}")
            buffers = [torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
                       for _, shape, dtype in self.shapes]
            self.channel.receive_into(buffers)
            if self.stream is not None:
                self.stream.synchronize()  # the version is whole before the sampler may read it
            with self.changed:
                self.versions[version] = buffers
                self.changed.notify_all()

    def take(self, version: int) -> list[torch.Tensor]:
        """Version `version`'s tensors, once received; older staged versions are dropped."""
        with self.changed:
            while version not in self.versions:
                if self.error or self.stopped:
                    raise RuntimeError(self.error or f"the trainer stopped before pushing policy version {version}")
                self.changed.wait(timeout=1.0)
            tensors = self.versions[version]
            for old in [v for v in self.versions if v <= version]:
                del self.versions[old]
            return tensors


def _heartbeat(transport: Transport, index: int) -> None:
    transport = transport.reconnect()  # a connection of this thread's own
    while True:
        transport.add(f"beat/{index}", 1)
        time.sleep(BEAT_S)


class Worker:
    """Worker `index` of the run whose setup (config, tensors, sampling) the trainer sent: its policy and
    engine; `join` gives it the weight group, `sample` samples a task."""

    def __init__(self, setup: dict, index: int, device: str = ""):
        self.index = index
        self.timeout_s = float(setup["timeout_s"])
        self.config: Config = from_dict(Config, setup["config"])
        if device:  # this machine's GPU for this worker (--device), whatever the trainer's config says
            self.config.model.device = device
        if not 0 <= index < self.config.rollout.workers:
            raise ValueError(f"--index {index} is not one of this run's rollout workers, "
                             f"0..{self.config.rollout.workers - 1}")
        self.group_size = int(setup["group_size"])
        self.params = SamplingParams(**setup["sampling"])
        self.model, self.tokenizer = load_policy(self.config, trainable=False)
        self.device = model_device(self.model)
        rollout = self.config.rollout
        self.engine = make_engine(rollout, self.model, self.tokenizer, self.config.seed, int(setup["model_len"]))
        if rollout.tool:
            self.engine = ToolEngine(self.engine, self.tokenizer, make_tool(rollout.tool, **rollout.tool_args),
                                     rollout.max_tool_calls)
        state = self.model.state_dict()
        names = [name for name, _, _ in setup["tensors"]]
        missing = [name for name in names if name not in state]
        if missing:
            raise ValueError(f"this worker's model has no {missing[:3]}: it is not the trainer's architecture")
        # pushes arrive in the dtypes this worker holds, so they are staged and sent at that size
        self.shapes = [(name, shape, str(state[name].dtype).removeprefix("torch."))
                       for name, shape, _ in setup["tensors"]]
        self.dtypes = [dtype for _, _, dtype in self.shapes]
        self.channel_device = self.device if setup["device"] == "cuda" else torch.device("cpu")
        if self.channel_device.type == "cuda":
            torch.cuda.set_device(self.channel_device)  # NCCL's rank lives on this GPU
        self.names = names
        self.version = -1
        self.staged: StagedVersions | None = None

    def join(self, channel) -> None:
        """Receive the weights over `channel` (this worker's end of the weight group), staged as they come."""
        self.staged = StagedVersions(channel, self.shapes, self.channel_device)

    def load(self, version: int) -> None:
        """Make the engine sample from policy `version`."""
        if version == self.version:
            return
        tensors = self.staged.take(version)
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in zip(self.names, tensors):
                state[name].copy_(tensor)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # copied before the staged buffers go
        if self.engine.copies_weights:
            self.engine.sync_weights(self.model)
        self.version = version

    def sample(self, task: Task) -> dict:
        self.load(task.version)
        # the hf engine draws from torch's generator: seeded by the task, its output is the task's alone
        torch.manual_seed(task.seeds[0])
        rollout = self.engine.generate([r["prompt"] for r in task.rows], self.group_size, self.params, task.rows,
                                       task.seeds)
        if rollout.sampling_logp is None:  # the behaviour policy's log-probs, for the off-policy correction
            grpo = self.config.grpo
            with torch.no_grad():
                logp, _ = token_logprobs(self.model, rollout.input_ids.to(self.device),
                                         rollout.attention_mask.to(self.device), rollout.prompt_length,
                                         grpo.temperature, grpo.micro_batch_size,
                                         max_tokens=grpo.max_tokens_per_micro_batch,
                                         budget_key="grpo.max_tokens_per_micro_batch")
            rollout = dataclasses.replace(rollout, sampling_logp=logp.float().cpu() * rollout.completion_mask)
        report = getattr(self.engine, "rollout_metrics", None)
        describe = getattr(self.engine, "failure", None)
        return {"batch": task.batch, "version": task.version, "rollout": rollout_to_dict(rollout.to("cpu")),
                "metrics": report() if report else {}, "failure": describe() if describe else ""}



def _take_tasks(worker: Worker, transport: Transport) -> None:
    """The store's loop: take task/<index>/<n> in turn, answer under result/<batch>/<index>, until stop."""
    n = 0
    while True:
        key = f"task/{worker.index}/{n}"
        while True:
            # one call: returns as soon as either is set, stop first (a stopped run needs no queued task)
            found = transport.wait_any(["stop", key], WAIT_S)
            if found == "stop":
                return
            if found == key:
                break
            if worker.staged.error:
                raise RuntimeError(worker.staged.error)
        task = Task.from_dict(decode(transport.pop(key)))
        transport.set(f"result/{task.batch}/{worker.index}", encode(worker.sample(task)))
        n += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpokit rollout-worker",
                                     description="Sample rollouts for a trainer started with rollout.workers and "
                                                 "rollout.worker_launch=external (docs/async.md)")
    parser.add_argument("--connect", required=True, metavar="HOST:PORT", help="the trainer's rollout.worker_address "
                        "(it prints the port it picked)")
    parser.add_argument("--index", required=True, type=int, metavar="I", help="this worker's index, 0..workers-1")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--device", default="", help="where this worker's model lives, e.g. cuda:1 (default: the "
                        "trainer's model.device); on a machine with several workers give each its own GPU")
    args = parser.parse_args(argv)
    host, _, port = args.connect.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--connect {args.connect!r} is not HOST:PORT")
    problem = secret_length_problem(os.environ.get(SECRET_ENV, ""))
    if problem:
        print(f"grpokit rollout-worker {args.index}: {problem}", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        transport = StoreTransport.connect(args.connect, 300.0)
    except (TransportError, RuntimeError) as err:
        print(f"grpokit rollout-worker {args.index}: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    # the index is this worker's alone: a second worker given it would take the first one's tasks
    if transport.add(f"claim/{args.index}", 1) != 1:
        print(f"grpokit rollout-worker {args.index}: index {args.index} is already taken by another worker of the "
              f"run at {args.connect}: give each worker its own --index, 0..rollout.workers-1", file=sys.stderr)
        transport.close()
        return 1
    return _exit(serve(transport, args.index, args.device))


def serve(transport: Transport, index: int, device: str = "") -> int:
    """Be rollout worker `index` until the trainer stops; 0, or 1 after a failure, which goes to the
    trainer (error/<index>) and to stderr in one line."""
    try:
        setup = decode(transport.get("setup"))
        threading.Thread(target=_heartbeat, args=(transport, index), daemon=True).start()
        worker = Worker(setup, index, device)
        transport.set(f"dtypes/{index}", encode({"dtypes": worker.dtypes}))
        transport.set(f"ready/{index}", b"1")
        worker.join(transport.weights(index + 1, worker.config.rollout.workers + 1, worker.channel_device,
                                      RECEIVER_TIMEOUT_S))
        _take_tasks(worker, transport)
        worker.staged.thread.join(timeout=worker.timeout_s)  # the trainer's stop reaches the receiver too
    except Exception as err:  # noqa: BLE001 - the trainer names this worker and says why
        message = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"
        traceback.print_exc()
        try:
            transport.set(f"error/{index}", message.encode())
        except Exception:  # noqa: BLE001 - the trainer is gone too
            pass
        print(f"grpokit rollout-worker {index}: {message}", file=sys.stderr)
        return 1
    return 0


class RayWorkers:
    """The rollout workers as Ray actors (distributed.launcher=ray), both the launcher and the link of the
    trainer's RemoteRollouts. Each actor sits in a placement-group bundle and asks for exactly what the
    bundle holds. A task is a call to its `sample`, whose result the trainer waits on as an ObjectRef, in
    worker order. The weights go over a gloo/NCCL group of the trainer and the actors (as the store's
    do), whose peers meet through a key store the trainer hosts only while the group forms, reached with
    a secret that Ray hands the actors. Actors are never restarted (max_restarts=0): one that dies, or
    whose result is lost with it, ends the run in one line naming it, and grpokit's exact resume takes it
    from the last checkpoint."""

    shares_cores = True  # threads as spawned workers get them: an equal share of this machine's cores on CPU

    def __init__(self, placement_group=None, bundles: list[dict] | None = None, name: str = "grpokit-ray",
                 resume_hint: str = ""):
        self.placement_group, self.bundles, self.resume_hint = placement_group, bundles, resume_hint
        self.address = name
        self.actors: list = []
        self.calls: list[dict] = []  # per worker: ObjectRef -> what it is, for the calls not yet answered
        self.results: dict[tuple[int, int], object] = {}  # (batch, worker) -> the ObjectRef of its rollout
        self.setup = b""
        self._dtypes: list[list[str] | None] = []
        self.rendezvous = None

    # ---------------------------------------------------------------- launcher
    def start(self, link, workers: int, threads: int, device: torch.device) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = ray.remote(max_restarts=0, max_task_retries=0)(RolloutWorkerActor)
        setup = ray.put(self.setup)
        for w in range(workers):
            bundle = self.bundles[w] if self.bundles else {"CPU": 1.0}
            options = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}  # the bundle, exactly
            if self.placement_group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=w)
            actor = actor_class.options(**options).remote()
            self.actors.append(actor)
            ready = actor.start.remote(setup, w, max(1, threads), "cuda" if device.type == "cuda" else "")
            self.calls.append({ready: "start"})
            self._dtypes.append(None)

    def describe(self, w: int) -> str:
        return f"rollout worker {w} (a Ray actor)"

    def ended(self, w: int) -> str | None:
        """What ended worker w, seen in any of its calls not yet answered (a dead actor fails them all)."""
        import ray

        if w >= len(self.calls) or not self.calls[w]:
            return None
        done, _ = ray.wait(list(self.calls[w]), num_returns=len(self.calls[w]), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                return self._why(err)
        return None

    def _why(self, err) -> str:
        import ray

        if isinstance(err, ray.exceptions.RayTaskError):  # the method raised: its own error, in one line
            cause = getattr(err, "cause", None) or err
            text = str(cause).strip().splitlines()
            return f"failed: {type(cause).__name__}: {text[-1][:300] if text else ''}{self.resume_hint}"
        if isinstance(err, ray.exceptions.RayActorError):
            text = str(err).strip().splitlines()
            return "died" + (f" ({text[0][:200]})" if text else "") + self.resume_hint
        # OwnerDiedError, ObjectLostError: the result went with the process that held it
        return f"died, and its result with it ({type(err).__name__}){self.resume_hint}"

    def _get(self, w: int, ref):
        import ray

        try:
            value = ray.get(ref)
        except ray.exceptions.RayError as err:
            raise RolloutWorkerError(f"{self.describe(w)} {self._why(err)}") from None
        self.calls[w].pop(ref, None)
        return value

    def stop(self, failed: bool) -> None:
        import ray

        if not failed and self.actors:  # the stop broadcast reaches each receiver; let them end
            ray.wait([actor.finish.remote() for actor in self.actors], num_returns=len(self.actors), timeout=30)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)

    # ---------------------------------------------------------------- link (rollout/remote.py, WorkerLink)
    def post_setup(self, data: bytes) -> None:
        self.setup = data

    def ready(self, w: int, timeout_s: float) -> bool:
        import ray

        if self._dtypes[w] is not None:
            return True
        ref = next(ref for ref, what in self.calls[w].items() if what == "start")
        if not ray.wait([ref], timeout=timeout_s)[0]:
            return False
        self._dtypes[w] = self._get(w, ref)
        return True

    def dtypes(self) -> list[str]:
        return self._dtypes[0]

    def failure(self, w: int) -> str | None:
        return None  # a method that raises fails its call: ended() and result() report it

    def heartbeat(self, w: int) -> int | None:
        return None

    def queue(self, task: Task, data: bytes) -> None:
        ref = self.actors[task.worker].sample.remote(data)
        self.calls[task.worker][ref] = "sample"
        self.results[(task.batch, task.worker)] = ref

    def result(self, batch: int, w: int, timeout_s: float) -> bytes | None:
        import ray

        ref = self.results[(batch, w)]
        if not ray.wait([ref], timeout=timeout_s)[0]:
            return None
        value = self._get(w, ref)
        del self.results[(batch, w)]
        return value

    def weights(self, size: int, device: torch.device, timeout_s: float):
        """The trainer's end of the weight group, formed with every actor's; the key store its peers met
        through closes once it has formed."""
        import secrets

        import ray

        nodes = set(ray.get([actor.node.remote() for actor in self.actors]))
        here = ray.get_runtime_context().get_node_id()
        host = "127.0.0.1" if nodes == {here} else ray.util.get_node_ip_address()
        secret = secrets.token_hex(16)
        self.rendezvous = StoreTransport.host(f"{host}:0", timeout_s, secret)
        self.rendezvous.set("setup", b"")  # what a connecting peer waits for
        joins = [actor.join.remote(self.rendezvous.address, secret, size, timeout_s) for actor in self.actors]
        for w, ref in enumerate(joins):
            self.calls[w][ref] = "join"
        try:
            channel = self.rendezvous.weights(0, size, device, timeout_s)
            for w, ref in enumerate(joins):  # each peer may still be reading the store when the group has formed
                self._get(w, ref)
        finally:
            self.rendezvous.close()
        return channel

    def stop_tasks(self) -> None:
        """Nothing to tell the actors: the stop goes over the weight group."""

    def close(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.close()


class RolloutWorkerActor:
    """The body of a rollout worker's Ray actor: its Worker, the weight group's end, and `sample`."""

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def start(self, setup: bytes, index: int, threads: int, device: str) -> list[str]:
        """Build the worker; the dtypes it holds each pushed tensor in."""
        torch.set_num_threads(threads)
        self.worker = Worker(decode(setup), index, device)
        return self.worker.dtypes

    def join(self, address: str, secret: str, size: int, timeout_s: float) -> None:
        transport = StoreTransport.connect(address, timeout_s, secret)
        self.worker.join(transport.weights(self.worker.index + 1, size, self.worker.channel_device,
                                           RECEIVER_TIMEOUT_S))
        transport.close()

    def sample(self, task: bytes) -> bytes:
        staged = self.worker.staged
        if staged.error:
            raise RuntimeError(staged.error)
        try:
            return encode(self.worker.sample(Task.from_dict(decode(task))))
        except RuntimeError:
            if staged.stopped and not staged.error:  # the run ended before this task's version: nobody waits
                return b""
            raise

    def finish(self) -> None:
        self.worker.staged.thread.join(timeout=self.worker.timeout_s)


def _exit(code: int) -> int:
    """End the process at once: the receiver and heartbeat threads may still sit in a collective or
    a store call, which the interpreter's teardown would abort on."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
