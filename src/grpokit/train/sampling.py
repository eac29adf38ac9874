"""Where a GRPO step's completions come from: one object with one `sample()`, so the training loop
never asks which kind it holds.

- LocalSampler: this process's rollout engine samples B groups of G, with DAPO's dynamic sampling;
- RemoteSampler: rollout workers (rollout.workers > 0) sample on a fixed schedule of policy
  versions (rollout/schedule.py) while the trainer learns, and this process only scores.

Both draw prompts from one PromptOrder (shuffled epochs from the run's seed; the same on every
process) and give every completion the seed a synchronous run would (rollout.engine.request_seeds),
so a run's batches do not depend on where they were sampled.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from grpokit.config import GRPOConfig
from grpokit.math import groups_with_spread
from grpokit.rewards import RewardResult
from grpokit.rollout import RolloutEngine, SamplingParams, WeightSyncError, request_seeds
from grpokit import distributed
from grpokit.rollout.remote import RemoteRollouts, gather_for_push
from grpokit.rollout.schedule import batches_ready, sampling_version
from grpokit.rollout.wire import Task
from grpokit.types import Rollout

# (rollout) -> its rewards: the trainer's scoring, which counts reward-failure streaks
Score = Callable[[Rollout], RewardResult]


@dataclass
class SamplerContext:
    """What a sampler reads from its trainer: the policy, this process's engine, the prompt order, the
    config, the trainer's scoring, the run's seed, where the last checkpoint is (for messages), and this
    process's place among the trainer's processes."""

    model: torch.nn.Module
    engine: RolloutEngine
    order: PromptOrder
    config: GRPOConfig
    score: Score
    seed: int
    last_checkpoint: Callable[[], Path | None]
    rank: int = 0
    world_size: int = 1


def sampling_params(config: GRPOConfig, shared_prefill: bool = False) -> SamplingParams:
    """How RL samples its completions (grpo.max_completion_length, temperature, top_p, generation_batch_size;
    rollout.shared_prefill)."""
    return SamplingParams(max_new_tokens=config.max_completion_length, temperature=config.temperature,
                          top_p=config.top_p, batch_size=config.generation_batch_size, shared_prefill=shared_prefill)


class PromptOrder:
    """The run's prompts in shuffled epochs, drawn from `seed`: every process draws the same."""

    def __init__(self, dataset: list[dict], seed: int):
        self.dataset, self.rng, self.order = dataset, random.Random(seed), []

    def next_rows(self, n: int) -> list[dict]:
        while len(self.order) < n:  # epochs of shuffled prompts
            self.order += self.rng.sample(range(len(self.dataset)), len(self.dataset))
        picked, self.order = self.order[:n], self.order[n:]
        return [self.dataset[i] for i in picked]

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "order": torch.tensor(self.order, dtype=torch.int64)}

    def load_state_dict(self, state: dict, as_tuple: Callable) -> None:
        self.rng.setstate(as_tuple(state["rng"]))
        self.order = state["order"].tolist()


def push_weights(engine: RolloutEngine, model: torch.nn.Module, step: int, last_checkpoint: Callable[[], Path | None]
                 ) -> None:
    """Load the policy into a separate engine (a sharded one parameter at a time, gathered on
    its device; every process calls this), then check with its probe (when it has one) that
    the engine now computes what the policy does; a mismatch stops the run at `step`."""
    engine.sync_weights(model)
    check = getattr(engine, "check_synced", None)
    if check is None:
        return
    try:
        check(model)
    except WeightSyncError as err:
        raise WeightSyncError(f"step {step}: the rollout engine did not receive the policy's weights ({err}). "
                              f"Last good checkpoint: {last_checkpoint() or 'none yet'}") from None


class LocalSampler:
    """B groups of G completions from this process's engine. Several processes (torchrun) draw the
    same prompts and each samples its own contiguous whole groups."""

    def __init__(self, context: SamplerContext, params: SamplingParams, pad_id: int):
        c = context
        self.model, self.engine, self.order, self.config, self.score, self.seed = (c.model, c.engine, c.order,
                                                                                   c.config, c.score, c.seed)
        self.params, self.rank, self.world_size, self.pad_id = params, c.rank, c.world_size, pad_id
        self.last_checkpoint = c.last_checkpoint

    def sample(self, step: int, timings: dict) -> tuple[Rollout, RewardResult, dict]:
        """Step `step`'s groups (0-based), scored. With grpo.dynamic_sampling (DAPO), groups whose
        valid rewards are all equal (zero advantage) are dropped and fresh questions sampled, for
        at most grpo.max_generation_rounds rounds; the step then trains on what it has."""
        cfg, g = self.config, self.config.num_generations
        kept, parts, rounds, sampled = 0, [], 0, 0
        while True:
            # The same global draw on every process; each samples its own contiguous whole groups.
            rows = self.order.next_rows(cfg.prompts_per_step - kept)
            local = len(rows) // self.world_size
            first = sampled + self.rank * local
            rows = rows[self.rank * local : (self.rank + 1) * local]
            t = time.perf_counter()
            seeds = request_seeds(self.seed, step, list(range(first, first + len(rows))), g)
            rollout = self.engine.generate([r["prompt"] for r in rows], g, self.params, rows, seeds)
            timings["perf/rollout_time_s"] += time.perf_counter() - t
            t = time.perf_counter()
            result = self.score(rollout)
            timings["perf/scoring_time_s"] += time.perf_counter() - t
            rounds, sampled = rounds + 1, sampled + len(rows) * self.world_size
            if not cfg.dynamic_sampling:
                return rollout, result, self._engine_metrics()
            spread = groups_with_spread(result.total, result.valid, g)
            parts.append((rollout, result, spread.repeat_interleave(g).nonzero().flatten()))
            kept += int(spread.sum())
            if kept >= cfg.prompts_per_step or rounds >= cfg.max_generation_rounds:
                break
        if kept == 0:  # nothing with a spread: the last round, whose zero advantages leave only the KL term
            parts = [(rollout, result, torch.arange(rollout.num_samples))]
            print(f"grpokit: step {step + 1}: no group with a reward spread in {rounds} rounds; "
                  f"training on the last round", file=sys.stderr)
        rollout = Rollout.cat([r.take(rows) for r, _, rows in parts], self.pad_id)
        result = RewardResult.cat([res.take(rows) for _, res, rows in parts])
        return rollout, result, {"sampling/groups_sampled": sampled, "sampling/groups_dropped": sampled - kept,
                                 "sampling/rounds": rounds, **self._engine_metrics()}

    def _engine_metrics(self) -> dict:
        """What the engine reports of its last batch (a ToolEngine's tool/* numbers), else nothing."""
        report = getattr(self.engine, "rollout_metrics", None)
        return report() if report is not None else {}

    def sync(self, version: int) -> dict:
        """After an update: the next step samples from the updated policy, `version`."""
        if not self.engine.copies_weights:  # it samples from the policy object itself: only re-point it
            self.engine.sync_weights(self.model)
            return {}
        t = time.perf_counter()
        push_weights(self.engine, self.model, version, self.last_checkpoint)
        return {"rollout/sync_time_s": time.perf_counter() - t}

    def ready_for_eval(self, version: int) -> None:
        """Before an evaluation (during training or after it): the engine already holds the policy."""

    def failure(self) -> str:
        """What failed the engine's last samples (a ToolEngine says), or ''."""
        describe = getattr(self.engine, "failure", None)
        return (describe() if describe is not None else "") or ""

    def step_metrics(self, timings: dict, seconds: float) -> dict:
        return {}

    def before_save(self, step: int) -> None:
        """Nothing in flight to record: each step samples its own batch."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, step: int) -> None:
        """Nothing beyond the prompt order, which the trainer restores."""


class RemoteSampler:
    """Batches from rollout workers, scored here. Batch b (1-based, the step it trains) is sampled by
    policy version sampling_version(b, staleness); staleness = versions between that one and the one
    the batch updates. `engine`: this process's own engine, which evaluation uses after training."""

    def __init__(self, context: SamplerContext, remote: RemoteRollouts | None, staleness: int):
        """remote: the workers, on trainer rank 0; None on the other ranks of a sharded (FSDP2) trainer,
        which take their share of each batch from rank 0 and their part in gathering each push."""
        c = context
        self.remote, self.model, self.engine, self.order = remote, c.model, c.engine, c.order
        self.rank, self.world_size = c.rank, c.world_size
        self.config, self.staleness = c.config, staleness
        self.score, self.seed, self.last_checkpoint = c.score, c.seed, c.last_checkpoint
        self._again: dict[int, tuple[list, list]] = {}  # a resumed run's batches to queue again: rows, seeds
        self._version_floor = 0  # the oldest version the workers can sample: the one they started from
        self._dropped_stale = 0  # completions of a resumed run's batches too stale to use (counted once)
        self._in_flight: list[dict] | None = None  # batches in flight, for the next checkpoint
        self._started = False  # the first push and tasks go out with the first sample

    def _start(self, version: int) -> None:
        """Give the workers the policy as it is now (a fresh run's or a checkpoint's), then their tasks."""
        self._push(version)
        self._queue(version)
        self._started = True

    def _push(self, version: int) -> None:
        """Rank 0 sends `version` to the workers; every trainer rank gathers each sharded tensor with it."""
        if self.remote is not None:
            self.remote.push(version, self.model)
        else:
            gather_for_push(self.model)

    def _queue(self, version: int) -> None:
        """Queue to the workers every batch the newest version may sample (rollout/schedule.py) that is
        not queued yet: a resumed run's own rows again, else the next B prompts of the data order, with
        the seeds a synchronous run would give them."""
        cfg = self.config
        if self.remote is None:  # rank 0 alone holds the schedule
            return
        for batch in batches_ready(version, self.staleness, cfg.max_steps):
            if batch <= version or self.remote.queued(batch):
                continue
            if batch in self._again:
                rows, seeds = self._again.pop(batch)
            else:
                rows = self.order.next_rows(cfg.prompts_per_step)
                seeds = request_seeds(self.seed, batch - 1, list(range(len(rows))), cfg.num_generations)
            self.remote.submit(batch, max(sampling_version(batch, self.staleness), self._version_floor), rows, seeds)

    def sample(self, step: int, timings: dict) -> tuple[Rollout, RewardResult, dict]:
        """Batch step + 1 from the workers, scored (the workers start on the first call)."""
        if not self._started:
            self._start(step)
        t = time.perf_counter()
        taken, waited = None, 0.0
        if self.remote is not None:  # rank 0: the batch, and the metrics every rank logs alike
            rollout, version, metrics, waited = self.remote.take(step + 1)
            dropped, self._dropped_stale = self._dropped_stale, 0
            taken = rollout, {"rollout/staleness_mean": float(step - version), "rollout/staleness_max": step - version,
                              "rollout/dropped_stale": dropped, "rollout/push_bytes": self.remote.pushed_bytes,
                              **metrics}
        if self.world_size > 1:  # the others take theirs from rank 0: its whole groups, contiguous, as LocalSampler's
            taken = distributed.broadcast_object(taken)
            waited = waited if self.remote is not None else time.perf_counter() - t
        rollout, metrics = taken
        timings["perf/rollout_time_s"] += waited
        if self.world_size > 1:
            local = rollout.num_samples // self.world_size
            rollout = rollout.take(torch.arange(self.rank * local, (self.rank + 1) * local))
        t = time.perf_counter()
        result = self.score(rollout)
        timings["perf/scoring_time_s"] += time.perf_counter() - t
        return rollout, result, metrics

    def sync(self, version: int) -> dict:
        """After an update: the workers stage `version` until a task asks for it; then queue what it may sample."""
        t = time.perf_counter()
        self._push(version)
        seconds = time.perf_counter() - t
        self._queue(version)
        return {"rollout/sync_time_s": seconds}

    def ready_for_eval(self, version: int) -> None:
        """Before an evaluation (during training or after it): evaluation's engine, if it holds its own
        weights, gets the policy; the workers, not it, received every push (every process calls this)."""
        if self.engine.copies_weights:
            push_weights(self.engine, self.model, version, self.last_checkpoint)

    def failure(self) -> str:
        return self.remote.last_failure if self.remote is not None else ""

    def step_metrics(self, timings: dict, seconds: float) -> dict:
        return {"perf/trainer_idle_frac": timings["perf/rollout_time_s"] / seconds}

    def before_save(self, step: int) -> None:
        """The batches in flight, waiting for those a resumed run could not sample again (rank 0's)."""
        self._in_flight = self.remote.in_flight(step) if self.remote is not None else None

    def state_dict(self) -> dict:
        return {"rollout_in_flight": self._in_flight,  # and a resumed run's batches not queued again yet
                "rollout_again": [Task(b, -1, -1, rows, seeds).to_dict() for b, (rows, seeds) in self._again.items()]}

    def load_state_dict(self, state: dict, step: int) -> None:
        """The batches in flight at the checkpoint; the workers start from version `step`."""
        self._version_floor = step
        if self.remote is None:
            return
        self._again, self._dropped_stale = self.remote.restore(state.get("rollout_in_flight", []), self.staleness)
        for entry in state.get("rollout_again", []):
            task = Task.from_dict(entry)
            self._again[task.batch] = (task.rows, task.seeds)
