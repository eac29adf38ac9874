"""What goes between the trainer and its rollout workers besides the weights: tasks (which
prompts to sample, with which seeds, from which policy version) and the rollouts that come back,
as plain dicts of tensors, strings and numbers that torch.load(weights_only=True) reads, so a
message never runs code. Rows travel as JSON text."""

from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass

import torch

from grpokit.types import Rollout


class RolloutWorkerError(RuntimeError):
    """A rollout worker died, hung, failed, or returned a batch the trainer refuses."""


@dataclass(frozen=True)
class Task:
    """Sample batch `batch`'s prompts `rows` (each G times, seeds[i] for completion i) from policy `version`."""

    batch: int
    version: int
    worker: int
    rows: list[dict]
    seeds: list[int]

    def to_dict(self) -> dict:
        return {"batch": self.batch, "version": self.version, "worker": self.worker,
                "rows": json.dumps(self.rows), "seeds": torch.tensor(self.seeds, dtype=torch.int64)}

    @classmethod
    def from_dict(cls, d: dict) -> Task:
        return cls(int(d["batch"]), int(d["version"]), int(d["worker"]), json.loads(d["rows"]), d["seeds"].tolist())


def rollout_to_dict(rollout: Rollout) -> dict:
    out = {}
    for f in dataclasses.fields(rollout):
        value = getattr(rollout, f.name)
        out[f.name] = json.dumps(value) if f.name == "rows" else value
    return out


def rollout_from_dict(d: dict) -> Rollout:
    return Rollout(**{**d, "rows": json.loads(d["rows"])})


def encode(message: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(message, buffer)
    return buffer.getvalue()


def decode(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def checked_rollout(message: dict, task: Task, group_size: int) -> Rollout:
    """The rollout a worker returned for `task`, after checking it is that task's: its batch, the
    policy version the task named, one group of `group_size` completions per prompt of the task,
    in order, and finite sampling log-probs. Anything else is refused, naming the worker; nothing
    of it reaches the loss."""
    who = f"rollout worker {task.worker}"
    if int(message.get("batch", -1)) != task.batch or int(message.get("version", -1)) != task.version:
        raise RolloutWorkerError(
            f"{who} returned batch {message.get('batch')} sampled by policy version {message.get('version')}, but was "
            f"asked for batch {task.batch} from version {task.version}; its rollouts were refused")
    try:
        rollout = rollout_from_dict(message["rollout"])
    except (KeyError, TypeError, ValueError) as err:
        raise RolloutWorkerError(f"{who} returned batch {task.batch} in a form the trainer cannot read ({err}); "
                                 "its rollouts were refused") from None
    expected = len(task.rows) * group_size
    problems = []
    if rollout.group_size != group_size or rollout.num_samples != expected:
        problems.append(f"{rollout.num_samples} completions in groups of {rollout.group_size}, expected {expected} "
                        f"({len(task.rows)} prompts x {group_size})")
    elif rollout.prompts[::group_size] != [r["prompt"] for r in task.rows]:
        problems.append("prompts that are not the task's, in its order")
    if rollout.sampling_logp is not None and (rollout.sampling_logp.shape != rollout.completion_mask.shape
                                              or not torch.isfinite(rollout.sampling_logp).all()):
        problems.append("sampling log-probs that are not finite or not one per completion token")
    if problems:
        raise RolloutWorkerError(f"{who} returned batch {task.batch} with {'; '.join(problems)}; its rollouts were "
                                 "refused")
    return rollout
