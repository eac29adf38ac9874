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
from grpokit.rollout.transport import RayTransport, StoreTransport, Transport, TransportError
from grpokit.rollout.weight_channel import STOP
from grpokit.rollout.wire import Task, decode, encode, rollout_to_dict
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
    """Worker `index` of the run whose trainer `transport` reaches (rollout/transport.py)."""

    def __init__(self, transport: Transport, index: int, device: str = ""):
        self.index = index
        self.transport = transport
        setup = decode(self.transport.get("setup"))
        self.timeout_s = float(setup["timeout_s"])
        threading.Thread(target=_heartbeat, args=(transport, index), daemon=True).start()
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
        shapes = [(name, shape, str(state[name].dtype).removeprefix("torch.")) for name, shape, _ in setup["tensors"]]
        self.transport.set(f"dtypes/{index}", encode({"dtypes": [dtype for _, _, dtype in shapes]}))
        self.transport.set(f"ready/{index}", b"1")
        channel_device = self.device if setup["device"] == "cuda" else torch.device("cpu")
        if channel_device.type == "cuda":
            torch.cuda.set_device(channel_device)  # NCCL's rank lives on this GPU
        self.channel = self.transport.weights(index + 1, self.config.rollout.workers + 1, channel_device,
                                              RECEIVER_TIMEOUT_S)
        self.staged = StagedVersions(self.channel, shapes, channel_device)
        self.names = names
        self.version = -1

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

    def run(self) -> None:
        n = 0
        while True:
            key = f"task/{self.index}/{n}"
            while True:
                # one call: returns as soon as either is set, stop first (a stopped run needs no queued task)
                found = self.transport.wait_any(["stop", key], WAIT_S)
                if found == "stop":
                    return
                if found == key:
                    break
                if self.staged.error:
                    raise RuntimeError(self.staged.error)
            task = Task.from_dict(decode(self.transport.pop(key)))
            self.transport.set(f"result/{task.batch}/{self.index}", encode(self.sample(task)))
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
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        transport = StoreTransport.connect(args.connect, 300.0)
    except (TransportError, RuntimeError) as err:
        print(f"grpokit rollout-worker {args.index}: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    return _exit(serve(transport, args.index, args.device))


def serve(transport: Transport, index: int, device: str = "") -> int:
    """Be rollout worker `index` until the trainer stops; 0, or 1 after a failure, which goes to the
    trainer (error/<index>) and to stderr in one line."""
    worker = None
    try:
        worker = Worker(transport, index, device)
        worker.run()
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
    """The rollout workers as Ray actors (distributed.launcher=ray), one placement-group bundle each
    ({CPU: threads} or {GPU: 1}), never restarted (max_restarts=0): a worker that dies ends the run in
    one line naming it, and grpokit's exact resume takes it from the last checkpoint."""

    shares_cores = True  # threads as spawned workers get them: an equal share of this machine's cores on CPU

    def __init__(self, placement_group=None, first_bundle: int = 0, resume_hint: str = ""):
        self.placement_group, self.first_bundle, self.resume_hint = placement_group, first_bundle, resume_hint
        self.actors, self.runs = [], []

    def start(self, transport: Transport, workers: int, threads: int, device: torch.device) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = ray.remote(max_restarts=0, max_task_retries=0)(RolloutWorkerActor)
        for w in range(workers):
            options = {"num_cpus": max(1, threads), "num_gpus": 1 if device.type == "cuda" else 0}
            if self.placement_group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=self.first_bundle + w)
            actor = actor_class.options(**options).remote()
            self.actors.append(actor)
            self.runs.append(actor.serve.remote(transport.address, w, max(1, threads),
                                                "cuda" if device.type == "cuda" else ""))

    def describe(self, w: int) -> str:
        return f"rollout worker {w} (a Ray actor)"

    def ended(self, w: int) -> str | None:
        import ray

        if w >= len(self.runs):
            return None
        done, _ = ray.wait([self.runs[w]], timeout=0)
        if not done:
            return None
        try:
            code = ray.get(done[0])
        except ray.exceptions.RayActorError as err:
            why = "died" + (f" ({str(err).strip().splitlines()[0][:200]})" if str(err).strip() else "")
            return f"{why}{self.resume_hint}"
        except ray.exceptions.RayError as err:
            return f"failed ({type(err).__name__}){self.resume_hint}"
        return f"stopped (exit code {code}){self.resume_hint}"

    def stop(self, failed: bool) -> None:
        import ray

        if not failed and self.runs:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=30)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


class RolloutWorkerActor:
    """The body of a rollout worker's Ray actor: `serve` over the run's Ray transport."""

    def serve(self, mailbox: str, index: int, threads: int, device: str) -> int:
        torch.set_num_threads(threads)
        return serve(RayTransport.connect(mailbox), index, device)


def _exit(code: int) -> int:
    """End the process at once: the receiver and heartbeat threads may still sit in a collective or
    a store call, which the interpreter's teardown would abort on."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
