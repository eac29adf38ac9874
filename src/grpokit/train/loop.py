"""The one training loop (Algorithm 1's inner loop) that GRPO and PPO share.

Each step (Trainer.step, top to bottom): sample B prompts -> G completions each through the
rollout engine -> rewards (and a process reward model's step scores) -> the log-probs the update
holds fixed (pi_ref, pi_old) -> the algorithm's advantages -> mu epochs of optimizer steps on the
algorithm's loss -> the algorithm's own model (PPO's critic) -> sync the engine. The loop owns
the policy, its optimizer, forward, backward, the run directory and checkpoints; an algorithm
(train/algorithm.py) owns what differs, and never holds the trainer.

Device discipline: the engine may return tensors anywhere; the rollout and the rewards move
to the policy's device once, here, and every tensor a step creates lives there.

Several processes (torchrun): grpo.prompts_per_step stays the global batch B. Every process
draws the same prompt order from the same seed and takes its own contiguous B / W whole groups,
so advantages need no communication. The counts the loss divides by are summed over processes
before backward, gradients are summed by FSDP2 (models/sharding.py), and the metrics row is
reduced over processes; rank 0 alone writes metrics, trackers, progress bars and checkpoints.
"""

from __future__ import annotations

import copy
import random
import shutil
import sys
import time
from pathlib import Path

import torch

from grpokit import distributed
from grpokit.checkpoint import CheckpointManager, rank_state_file
from grpokit.config import GRPOConfig, RolloutConfig
from grpokit.loggers import MetricsLogger, NullLogger
from grpokit.math import groups_with_spread, loss_denominator
from grpokit.metrics import MetricsWriter, NullWriter, truncate_metrics
from grpokit.errors import ConfigError
from grpokit.micro_batches import RowLayout, packed_lengths
from grpokit.models.lora import AdapterDisabledReference, as_module, is_lora, merged_state_dict
from grpokit.models.precision import as_frozen
from grpokit.progress import progress
from grpokit.models.sharding import (full_state_dict, grad_norm_value, is_sharded, load_optimizer_state,
                                     local_tensors)
from grpokit.rewards import RewardResult, WeightedReward, score_completions
from grpokit.rewards.learned import ProcessRewardModel
from grpokit.rewards.process import is_process_reward
from grpokit.rewards.scoring import row_columns
from grpokit.rollout import (HFEngine, RolloutEngine, RolloutEngineError, SamplingParams, WeightSyncError,
                             request_seeds, token_logprobs)
from grpokit.rollout.remote import RemoteRollouts
from grpokit.rollout.schedule import batches_ready, sampling_version
from grpokit.rollout.wire import RolloutWorkerError, Task
from grpokit.signals import GracefulStop
from grpokit.train import state as train_state
from grpokit.train.algorithm import Algorithm, Batch
from grpokit.train.mode_metrics import MODES, mode_metrics
from grpokit.train.schedule import make_optimizer, warmup_constant
from grpokit.train.sft import TokenizedExamples, packing_matches_padding
from grpokit.types import Rollout


class RewardFailure(RuntimeError):
    """A reward function failed on every sample for too many consecutive steps."""


class NonFiniteTraining(FloatingPointError):
    """The loss or gradients were NaN/inf for too many consecutive steps."""


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    if is_sharded(model):
        raise ValueError("a sharded (FSDP2) policy cannot be copied into a reference: make the frozen copy "
                         "before sharding and pass it as ref_model, sharded the same way")
    ref = as_frozen(copy.deepcopy(model)).eval()  # held in the compute dtype: it is never updated
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def zero_std_fraction(rewards: torch.Tensor, valid: torch.Tensor, group_size: int) -> float:
    """Share of groups whose valid rewards are all equal: they get zero advantage."""
    r = torch.where(valid, rewards, torch.nan).view(-1, group_size)
    spread = torch.nan_to_num(r.nan_to_num(-torch.inf).amax(1) - r.nan_to_num(torch.inf).amin(1), nan=0.0)
    return float(((spread <= 0) | (valid.view(-1, group_size).sum(1) < 2)).float().mean())


# Steps in a row with no reward spread in any group before the run warns. A step like that happens by
# chance (a small batch of questions the policy always gets right); five in a row rarely does unless
# the reward cannot vary, and five steps are seconds to minutes, early enough to stop a doomed run.
NO_SIGNAL_STEPS = 5


def no_signal_warning(history: list[dict], steps: int = NO_SIGNAL_STEPS) -> str | None:
    """The warning for a run whose last `steps` metrics rows all had reward/zero_std_frac = 1 (in
    every group all completions got the same reward, so the reward gives nothing to learn from);
    None otherwise."""
    recent = history[-steps:]
    if len(recent) < steps or not all(row.get("reward/zero_std_frac", 0.0) >= 1.0 for row in recent):
        return None
    still = " and grad_norm = 0" if all(row.get("grad_norm") == 0.0 for row in recent) else ""
    return (f"grpokit: warning: reward/zero_std_frac = 1.0{still} in {steps} steps in a row (through step "
            f"{recent[-1].get('step')}): in every group all completions got the same reward, so the reward gives "
            "nothing to learn from. This usually means a reward that never varies, a model that is always right or "
            "always wrong on these questions, or a broken verifier; rewards/<name> in metrics.jsonl shows which")


# Metrics rows are means over processes, except these, which add up or take the maximum.
SUMMED_METRICS = ("rewards/failed", "rewards/timeouts", "perf/tokens_per_s")
# mode/*/samples are already the whole batch's (mode_metrics sums them): the max keeps them, as integers
MAXED_METRICS = tuple(f"mode/{mode}/samples" for mode in MODES) + ("completion/max_length", "skipped_updates", "perf/step_time_s", "perf/rollout_time_s",
                 "perf/scoring_time_s", "perf/logprob_time_s", "perf/update_time_s", "rollout/sync_time_s")




def sampling_params(config: GRPOConfig) -> SamplingParams:
    """How RL samples its completions (grpo.max_completion_length, temperature, top_p, generation_batch_size)."""
    return SamplingParams(max_new_tokens=config.max_completion_length, temperature=config.temperature,
                          top_p=config.top_p, batch_size=config.generation_batch_size)


# Rows of the first batch the packing check runs on: enough to share packed rows, three forwards' worth.
PACKING_CHECK_ROWS = 32


def packs_apart(model: torch.nn.Module, rollout: Rollout, pad_id: int, max_tokens: int, lockstep: bool) -> bool:
    """SFT's packing check (train/sft.py, packing_matches_padding) on up to PACKING_CHECK_ROWS of the
    rollout's samples as examples: their attended tokens, the prompt's unlabelled."""
    mask = rollout.attention_mask.bool().cpu()
    lengths = packed_lengths(mask, rollout.prompt_length)
    rows = lengths.nonzero().flatten().tolist()[:PACKING_CHECK_ROWS]
    if not rows:
        return True  # nothing to compute: nothing can leak
    ids = rollout.input_ids.cpu()
    examples = TokenizedExamples.of([(ids[i][mask[i]].tolist(), int(mask[i, : rollout.prompt_length].sum()))
                                     for i in rows])
    return packing_matches_padding(model, examples, list(range(len(rows))), pad_id, max_tokens, lockstep)


def same_attention(model: torch.nn.Module, policy: torch.nn.Module) -> bool:
    """Whether `model` (the reference, a critic) handles packed rows as the checked policy does: the
    policy itself, or a model of its type and attention implementation."""
    if model is policy:
        return True
    a, b = getattr(model, "config", None), getattr(policy, "config", None)
    return a is not None and b is not None and all(
        getattr(a, key, None) == getattr(b, key, None) is not None for key in ("model_type", "_attn_implementation"))


class Trainer:
    """Owns the policy, its optimizer, the rollout engine and the run directory."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        rewards: list[WeightedReward],
        dataset: list[dict],
        config: GRPOConfig,
        run_dir: str | Path,
        algorithm: Algorithm,
        seed: int = 0,
        ref_model: torch.nn.Module | None = None,
        progress: bool = True,
        engine: RolloutEngine | None = None,
        logger: MetricsLogger | None = None,
        rollout_config: RolloutConfig | None = None,
        save_merged: bool = False,
        process_reward: ProcessRewardModel | None = None,
        remote: RemoteRollouts | None = None,
    ):
        if not dataset:
            raise ValueError("GRPO needs a non-empty dataset of rows with a 'prompt' field")
        missing = [i for i, row in enumerate(dataset[:1000]) if "prompt" not in row]
        if missing:
            raise ValueError(f"dataset rows {missing[:5]} have no 'prompt' field")
        if not rewards and process_reward is None:
            raise ValueError("GRPO needs a reward: rule-based functions under `rewards`, a reward model, or both")
        self.model, self.tokenizer, self.rewards = model, tokenizer, rewards
        self.device = model_device(model)
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        if self.world_size > 1 and not is_sharded(model):
            raise ValueError(f"{self.world_size} processes train one policy only when it is sharded "
                             "(grpokit.models.sharding.shard_model), which sums their gradients")
        if config.prompts_per_step % self.world_size:
            raise ValueError(f"grpo.prompts_per_step={config.prompts_per_step} does not split into whole groups "
                             f"over {self.world_size} processes; make it a multiple of the world size")
        self.dataset, self.config = dataset, config
        self.progress = progress and distributed.is_main()
        self.run_dir = Path(run_dir)
        if ref_model is None and config.beta > 0:  # LoRA: the base model under the adapters, no copy
            ref_model = AdapterDisabledReference(model) if is_lora(model) else frozen_copy(model)
        self.ref_model = ref_model
        self.save_merged = save_merged and is_lora(model)  # checkpoints also hold merged/ (base + adapter)
        self._gathered: dict | None = None
        self._in_flight: list[dict] | None = None  # rollout workers' batches in flight, for the next checkpoint
        self.engine = engine if engine is not None else HFEngine(model, tokenizer)
        self.rollout_config = rollout_config or RolloutConfig()
        # experiment trackers (report_to); metrics.jsonl is always written, by rank 0
        self.logger = (logger or NullLogger()) if distributed.is_main() else NullLogger()
        self.optimizer = make_optimizer(model, config.learning_rate, config.weight_decay)
        self.scheduler = warmup_constant(self.optimizer, config.warmup_steps)
        self.rng = random.Random(seed)
        self.seed = seed
        self._order: list[int] = []
        self._failed_streak = {r.name: 0 for r in rewards}
        self._failed_rollout_streak = 0
        self._nonfinite_streak = 0
        self._warned_no_signal = False
        self._pack: bool | None = None  # grpo.pack_rows, decided on the first batch (packs_apart)
        self.layout = RowLayout()  # this step's: packed or padded rows, and the tokens its forwards computed
        self.global_step = 0
        self.interrupted = False  # set when a signal stopped train() early
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep_last=config.save_total_limit)
        self.sampling = sampling_params(config)
        self.process_reward = process_reward  # set: process supervision (eq. 6) from its step scores
        # rollout workers (rollout.workers > 0): batches are sampled there, on a fixed schedule of
        # policy versions (rollout/schedule.py), while this process learns
        self.remote = remote
        self.staleness = self.rollout_config.staleness
        self._again: dict[int, tuple[list, list]] = {}  # a resumed run's batches to queue again: rows, seeds
        self._version_floor = 0  # the oldest version the workers can sample: the one they started from
        self._dropped_stale = 0  # completions of a resumed run's batches too stale to use (counted once)
        self.algorithm = algorithm
        algorithm.setup(model, config, self.rollout_config)

    # ------------------------------------------------------------------ the loop

    def train(self, until: int | None = None, extra_metrics: dict | None = None) -> list[dict]:
        """Run to step `until` (default `max_steps`), one metrics.jsonl row a step (plus
        `extra_metrics`, e.g. the iteration); checkpoint every `save_steps` and at the end.
        SIGINT/SIGTERM finish the step, save, and return with `interrupted` set."""
        cfg = self.config
        until = cfg.max_steps if until is None else until
        history = []
        saved_at = None
        bar = progress(total=until, initial=self.global_step, desc=self.algorithm.name, unit="step",
                       enabled=self.progress and distributed.is_main())
        writer = MetricsWriter(self.run_dir / "metrics.jsonl") if distributed.is_main() else NullWriter()
        with GracefulStop(f"the current {self.algorithm.name.upper()} step") as stop, writer:
            while self.global_step < until:
                record = {**(extra_metrics or {}), **self._naming_worker_failures(self.step)}
                history.append(record)
                writer.write(record)
                self._warn_if_no_signal(history)
                self.logger.log(record, step=self.global_step)
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward/mean']:.3f}", kl=f"{record['kl']:.4f}")
                # A signal may reach the processes at different steps: all stop at the first one's.
                stopping = distributed.any_process(stop.requested)
                if (cfg.save_steps and self.global_step % cfg.save_steps == 0) or stopping:
                    saved_at = self._naming_worker_failures(self.save_checkpoint)
                if stopping:
                    self.interrupted = True
                    print(f"grpokit: stopped after step {self.global_step}; checkpoint {saved_at}\n"
                          f"resume with: grpokit train {self.run_dir / 'config.yaml'} --resume", file=sys.stderr)
                    break
        bar.close()
        if saved_at is None or saved_at.name != f"step-{self.global_step}":  # the final step, unless just saved
            self._naming_worker_failures(self.save_checkpoint)
        if self.remote is not None and self.engine.copies_weights:  # evaluation's engine gets the final policy
            self.push_weights(self.global_step)
        return history

    def _naming_worker_failures(self, call):
        """call(); a rollout worker's or the engine's failure stops the run saying where it can resume from."""
        try:
            return call()
        except (RolloutWorkerError, RolloutEngineError) as err:
            raise type(err)(
                f"step {self.global_step + 1}: {err}. Last checkpoint: {self.checkpoints.latest() or 'none yet'}; "
                f"resume with: grpokit train {self.run_dir / 'config.yaml'} --resume") from None

    def _warn_if_no_signal(self, history: list[dict]) -> None:
        """Say once per run when the reward has stopped varying (no_signal_warning); the run goes on."""
        message = None if self._warned_no_signal else no_signal_warning(history)
        if message:
            self._warned_no_signal = True
            if distributed.is_main():
                print(message, file=sys.stderr)

    def step(self) -> dict:
        cfg, g = self.config, self.config.num_generations
        start = time.perf_counter()
        timings = {"perf/rollout_time_s": 0.0, "perf/scoring_time_s": 0.0}
        rollout, result, sampling = self._sample_groups(timings)
        self._count_failed_steps(rollout)
        release = getattr(self.engine, "release_memory", None)
        if release is not None:  # the update may use the engine's memory; it gets new weights after
            release(weights_pushed_next=self.engine.copies_weights)
        t = time.perf_counter()
        self._score_steps(rollout, result)
        timings["perf/scoring_time_s"] += time.perf_counter() - t
        rollout, loss_mask = self.on_policy_device(rollout, result)

        t = time.perf_counter()  # the log-probs the update holds fixed, then the advantages
        self.layout = RowLayout.of(self.packs(rollout), rollout.attention_mask, rollout.prompt_length)
        ref_logp, old_logp = self.fixed_logprobs(rollout)
        batch = Batch(rollout, result, loss_mask, ref_logp, old_logp, self.tokenizer,
                      any(not is_process_reward(r.fn) for r in self.rewards), layout=self.layout)
        advantages, algorithm_stats = self.algorithm.advantages(batch)
        timings["perf/logprob_time_s"] = time.perf_counter() - t

        t = time.perf_counter()  # mu epochs of policy updates, then any model of the algorithm's own
        stats = self.update_policy(rollout, advantages, loss_mask, ref_logp, old_logp)
        stats.update(self.algorithm.update_own_model(batch, self.update))
        stats.update(algorithm_stats)
        timings["perf/update_time_s"] = time.perf_counter() - t

        t = time.perf_counter()
        if self.remote is not None:  # the workers stage the new version until a task asks for it
            self.remote.push(self.global_step + 1, self.model)
            timings["rollout/sync_time_s"] = time.perf_counter() - t
        elif self.engine.copies_weights:  # the next step samples from the updated policy
            self.push_weights(self.global_step + 1)
            timings["rollout/sync_time_s"] = time.perf_counter() - t
        else:  # it samples from the policy object itself: only re-point it
            self.engine.sync_weights(self.model)
        self.global_step += 1
        if self.remote is not None:
            self._queue_batches()
        self._nonfinite_streak = self._nonfinite_streak + 1 if stats["skipped_updates"] else 0
        if self._nonfinite_streak >= cfg.max_nonfinite_steps:
            last = self.checkpoints.latest()
            raise NonFiniteTraining(
                f"the loss or gradient norm was NaN/inf in {self._nonfinite_streak} consecutive steps "
                f"(through step {self.global_step}); every such update was skipped, so the weights are still "
                f"finite. Last good checkpoint: {last or 'none yet'}. Lower grpo.learning_rate or check the data."
            )

        seconds = time.perf_counter() - start
        lengths = rollout.completion_lengths.float()
        valid_total = result.total[result.valid]
        record = {
            "step": self.global_step,
            "reward/mean": float(valid_total.mean()) if valid_total.numel() else float("nan"),
            "reward/std": float(valid_total.std()) if valid_total.numel() > 1 else 0.0,
            "reward/zero_std_frac": zero_std_fraction(result.total, result.valid, g),
            **{f"rewards/{name}": mean for name, mean in result.function_means().items()},
            "rewards/failed": int((~result.valid).sum()),
            "rewards/timeouts": sum(result.timeouts.values()),
            **stats,
            **sampling,
            "completion/mean_length": float(lengths.mean()),
            "completion/max_length": int(lengths.max()),
            "completion/truncated_frac": float(rollout.truncated.float().mean()),
            **mode_metrics(rollout, result),
            "perf/tokens_per_s": float(lengths.sum()) / seconds,
            "perf/step_time_s": seconds,
            "perf/padding_frac": self.layout.computed.padding_frac,
            **timings,
            **({"perf/trainer_idle_frac": timings["perf/rollout_time_s"] / seconds} if self.remote else {}),
            "lr": self.scheduler.get_last_lr()[0],
        }
        return distributed.reduce_metrics(record, SUMMED_METRICS, MAXED_METRICS)

    def push_weights(self, step: int) -> None:
        """Load the policy into a separate engine (a sharded one parameter at a time, gathered on
        its device; every process calls this), then check with its probe (when it has one) that
        the engine now computes what the policy does; a mismatch stops the run at `step`."""
        self.engine.sync_weights(self.model)
        check = getattr(self.engine, "check_synced", None)
        if check is None:
            return
        try:
            check(self.model)
        except WeightSyncError as err:
            raise WeightSyncError(f"step {step}: the rollout engine did not receive the policy's weights ({err}). "
                                  f"Last good checkpoint: {self.checkpoints.latest() or 'none yet'}") from None

    def _queue_batches(self) -> None:
        """Queue to the workers every batch the newest version may sample (rollout/schedule.py) that is
        not queued yet: a resumed run's own rows again, else the next B prompts of the data order, with
        the seeds a synchronous run would give them."""
        cfg = self.config
        for batch in batches_ready(self.global_step, self.staleness, cfg.max_steps):
            if batch <= self.global_step or self.remote.queued(batch):
                continue
            if batch in self._again:
                rows, seeds = self._again.pop(batch)
            else:
                rows = self._next_rows(cfg.prompts_per_step)
                seeds = request_seeds(self.seed, batch - 1, list(range(len(rows))), cfg.num_generations)
            self.remote.submit(batch, max(sampling_version(batch, self.staleness), self._version_floor), rows, seeds)

    def _start_workers(self) -> None:
        """Give the workers the policy as it is now (a fresh run's or a checkpoint's), then their tasks."""
        self.remote.push(self.global_step, self.model)
        self._queue_batches()

    def _remote_groups(self, timings: dict) -> tuple[Rollout, RewardResult, dict]:
        """This step's batch from the rollout workers, scored; staleness = versions between the one
        that sampled it and the one it updates."""
        if self.remote.version < 0:
            self._start_workers()
        rollout, version, metrics, waited = self.remote.take(self.global_step + 1)
        timings["perf/rollout_time_s"] += waited
        t = time.perf_counter()
        result = self._score(rollout)
        timings["perf/scoring_time_s"] += time.perf_counter() - t
        staleness = self.global_step - version
        dropped, self._dropped_stale = self._dropped_stale, 0
        return rollout, result, {"rollout/staleness_mean": float(staleness), "rollout/staleness_max": staleness,
                                 "rollout/dropped_stale": dropped, "rollout/push_bytes": self.remote.pushed_bytes,
                                 **metrics}

    def _sample_groups(self, timings: dict) -> tuple[Rollout, RewardResult, dict]:
        """B groups of G completions, scored. With grpo.dynamic_sampling (DAPO), groups whose
        valid rewards are all equal (zero advantage) are dropped and fresh questions sampled, for
        at most grpo.max_generation_rounds rounds; the step then trains on what it has."""
        if self.remote is not None:
            return self._remote_groups(timings)
        cfg, g = self.config, self.config.num_generations
        kept, parts, rounds, sampled = 0, [], 0, 0
        while True:
            # The same global draw on every process; each samples its own contiguous whole groups.
            rows = self._next_rows(cfg.prompts_per_step - kept)
            local = len(rows) // self.world_size
            first = sampled + self.rank * local
            rows = rows[self.rank * local : (self.rank + 1) * local]
            t = time.perf_counter()
            seeds = request_seeds(self.seed, self.global_step, list(range(first, first + len(rows))), g)
            rollout = self.engine.generate([r["prompt"] for r in rows], g, self.sampling, rows, seeds)
            timings["perf/rollout_time_s"] += time.perf_counter() - t
            t = time.perf_counter()
            result = self._score(rollout)
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
            print(f"grpokit: step {self.global_step + 1}: no group with a reward spread in {rounds} rounds; "
                  f"training on the last round", file=sys.stderr)
        rollout = Rollout.cat([r.take(rows) for r, _, rows in parts], self.tokenizer.pad_token_id)
        result = RewardResult.cat([res.take(rows) for _, res, rows in parts])
        return rollout, result, {"sampling/groups_sampled": sampled, "sampling/groups_dropped": sampled - kept,
                                 "sampling/rounds": rounds, **self._engine_metrics()}

    def _engine_metrics(self) -> dict:
        """What the engine reports of its last batch (a ToolEngine's tool/* numbers), else nothing."""
        report = getattr(self.engine, "rollout_metrics", None)
        return report() if report is not None else {}

    def _score_steps(self, rollout: Rollout, result: RewardResult) -> None:
        """Process supervision: the process reward model scores each completion's steps into
        result.step_scores; with no rule-based reward, result.total becomes each completion's mean
        step score, for the log and progress bar only."""
        if self.process_reward is None:
            return
        result.step_scores = self.process_reward.score_steps(rollout.prompts, rollout.completions)
        if not self.rewards:
            result.total = torch.tensor([sum(s.rewards) / len(s.rewards) for s in result.step_scores],
                                        dtype=torch.float64)

    def packs(self, rollout: Rollout) -> bool:
        """Whether this run's forwards pack rows (grpo.pack_rows): off never; auto and on once the
        policy is seen to keep packed samples apart on the first batch (SFT's check, packs_apart);
        a policy that fails it pads under auto and is an error under on."""
        mode = self.config.pack_rows
        if self._pack is None and self.world_size > 1:
            # Packed passes under torchrun deadlocked (ranks made different collective calls in a run with
            # tool rollouts): until that is found, several processes pad, as before packing existed.
            if mode == "on":
                raise ConfigError("grpo.pack_rows=on is not supported with several processes (torchrun) yet: "
                                  "set grpo.pack_rows to auto (pads there) or off")
            self._pack = False
        if self._pack is None:
            lockstep = self.world_size > 1
            self._pack = mode != "off" and distributed.all_agree(
                packs_apart(self.model, rollout, self.tokenizer.pad_token_id, self.config.max_tokens_per_micro_batch,
                            lockstep))
            if not self._pack and mode == "on":
                raise ConfigError("grpo.pack_rows=on, but this policy's attention does not keep packed samples "
                                  "apart (packed log-probs differ from padded ones): set grpo.pack_rows to auto or off")
            if not self._pack and mode == "auto" and distributed.is_main():
                print("grpokit: this policy's attention does not keep packed samples apart; log-prob passes and "
                      "updates pad one sample per row instead (grpo.pack_rows=auto; slower, same result)",
                      file=sys.stderr)
        return self._pack

    def logprobs(self, model, rollout: Rollout) -> torch.Tensor:
        """[N, T] log-probs of the rollout's completions under `model` (no gradient), on the policy's
        device. `model` may be a LoRA policy's reference: the policy with its adapters disabled."""
        cfg = self.config
        with torch.no_grad(), as_module(model) as module:
            layout = self.layout if same_attention(module, self.model) else RowLayout(computed=self.layout.computed)
            logp, _ = token_logprobs(module, rollout.input_ids, rollout.attention_mask, rollout.prompt_length,
                                     cfg.temperature, cfg.micro_batch_size, max_tokens=cfg.max_tokens_per_micro_batch,
                                     budget_key="grpo.max_tokens_per_micro_batch", **layout.forward_options())
        return logp.to(self.device)

    def fixed_logprobs(self, rollout: Rollout) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(pi_ref's log-probs when the algorithm uses the reference, pi_old's when it asks for them),
        computed once per batch before the update."""
        ref_logp = self.logprobs(self.ref_model, rollout) if self.algorithm.wants_reference() else None
        old_logp = self.logprobs(self.model, rollout) if self.algorithm.wants_old_logprobs() else None
        return ref_logp, old_logp

    def policy_micro_loss(self, rollout: Rollout, advantages: torch.Tensor, loss_mask: torch.Tensor,
                          ref_logp: torch.Tensor | None, old_logp: torch.Tensor | None):
        """micro_loss(rows, epoch, total) for update(): the algorithm's loss of those rows over the
        minibatch's count `total`, and the tensors the log sums. Every tensor lives on the policy's device."""
        cfg = self.config
        with_ref = ref_logp is not None and self.algorithm.loss_beta > 0

        policy_mask = rollout.policy_mask  # [N, T], once for every micro-batch

        def micro_loss(micro: torch.Tensor, epoch: int, total: float | None = None):
            mask = loss_mask[micro]
            logp, entropy = token_logprobs(self.model, rollout.input_ids[micro], rollout.attention_mask[micro],
                                           rollout.prompt_length, cfg.temperature, len(micro), with_entropy=epoch == 0,
                                           **self.layout.forward_options())
            old = old_logp[micro] if old_logp is not None else logp.detach()
            sampling = rollout.sampling_logp[micro] if rollout.sampling_logp is not None else None
            loss, stats = self.algorithm.loss(logp, old, ref_logp[micro] if with_ref else None, advantages[micro],
                                              mask, total, sampling)
            tokens = stats["tokens"]
            sums = {key: stats[key] * tokens for key in ("kl", "clip_fraction", "ratio_mean", "policy_loss")}
            sums.update(loss=loss.detach(), tokens=tokens)
            if sampling is not None:  # how far the engine's log-probs are from the trainer's pi_old
                sums["rollout/logp_mismatch"] = ((old.to(sampling.dtype) - sampling).abs() * mask).sum()
            # the correction's own shares: tis is_capped_frac, icepop is_dropped_frac, ...
            sums.update({f"rollout/{k}": v * tokens for k, v in stats.items() if k.startswith("is_")})
            if entropy is not None:
                cm = policy_mask[micro].to(entropy.dtype)
                sums.update(entropy_sum=(entropy * cm).sum(), entropy_tokens=cm.sum())
            return loss, sums

        return micro_loss

    def update_policy(self, rollout: Rollout, advantages, loss_mask, ref_logp, old_logp) -> dict:
        """mu epochs of policy updates through update(); the step's policy metrics."""
        sums, skipped = self.update(self.model, self.optimizer, self.scheduler, loss_mask,
                                    self.policy_micro_loss(rollout, advantages, loss_mask, ref_logp, old_logp),
                                    row_lengths=self.layout.row_lengths(rollout.attention_mask, rollout.prompt_length))
        tokens = sums.get("tokens", 0.0)
        out = {k: sums[k] / tokens for k in ("kl", "clip_fraction", "ratio_mean", "policy_loss") if k in sums} \
            if tokens else {"kl": 0.0, "clip_fraction": 0.0, "ratio_mean": 1.0}
        out["loss"] = sums.get("loss", 0.0) / max(1.0, sums.get("optimizer_steps", 0.0))  # mean over optimizer steps
        out.update({k: v / tokens for k, v in sums.items() if k.startswith("rollout/") and tokens})
        out["entropy"] = sums["entropy_sum"] / sums["entropy_tokens"] if sums.get("entropy_tokens") else float("nan")
        out["grad_norm"] = sums["grad_norm_sum"] / sums["optimizer_steps"] if sums.get("optimizer_steps") else 0.0
        out["skipped_updates"] = skipped
        return out

    def on_policy_device(self, rollout: Rollout, result: RewardResult) -> tuple[Rollout, torch.Tensor]:
        """(the rollout moved to the policy's device, the loss mask there): the tokens the policy
        sampled (Rollout.policy_mask: tool output left out) of samples whose reward is valid,
        without truncated ones if grpo.mask_truncated_completions. Every count and term of the
        update reads this mask."""
        rollout = rollout.to(self.device)
        loss_mask = rollout.policy_mask * result.valid.to(self.device).unsqueeze(1)
        if self.config.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.truncated).unsqueeze(1)
        return rollout, loss_mask

    def update(self, model: torch.nn.Module, optimizer, scheduler, loss_mask: torch.Tensor, micro_loss,
               token_weighted: bool = False, row_lengths: torch.Tensor | None = None) -> tuple[dict, int]:
        """mu epochs of optimizer steps over minibatches of the batch's rows, each accumulated
        over micro-batches: the one update loop, for the policy and for PPO's critic. With
        `row_lengths` (each row's forward length in tokens), a minibatch's rows are split into
        micro-batches in order of length under grpo.max_tokens_per_micro_batch, so each
        micro-batch's forward, cut to its longest row, computes little padding.

        micro_loss(rows, epoch, total) -> (loss, sums): the micro-batch's share of the minibatch
        loss, i.e. its sum of terms divided by `total`, the count the whole minibatch averages
        over (tokens when token_weighted, else what grpo.loss_aggregation names; see
        math.loss_denominator), and tensors to add up for the log. Summed over micro-batches
        the losses are exactly the minibatch's loss. A non-finite loss or gradient skips the
        optimizer step: no NaN reaches the weights. Returns (summed log values, skipped steps).

        Several processes: `total` is the count over every process's rows of the minibatch
        (each process holds its own rows), so each back-propagates sum_local / global count and
        the summed gradients are the whole minibatch's. Skips are agreed by all processes, and
        the log sums come back summed over processes."""
        cfg = self.config
        aggregation = "token" if token_weighted else cfg.loss_aggregation
        totals: dict[str, float] = {}
        steps: dict[str, float] = {}
        skipped = 0
        lockstep = self.world_size > 1  # every process makes the same forward/backward calls
        model.train()
        for epoch in range(cfg.num_iterations):
            for minibatch in torch.randperm(loss_mask.shape[0]).chunk(cfg.num_minibatches):
                minibatch = minibatch.to(loss_mask.device)
                counts = distributed.all_reduce_sum(torch.tensor(
                    [loss_denominator(loss_mask[minibatch], aggregation), float(loss_mask[minibatch].sum())],
                    dtype=torch.float64))
                total, tokens = float(counts[0]), float(counts[1])
                if total == 0 or tokens == 0:
                    continue  # every sample of this minibatch failed its reward, on every process
                optimizer.zero_grad(set_to_none=True)
                finite = True
                for micro in self.micro_batches(minibatch, row_lengths, lockstep):
                    loss, sums = micro_loss(micro, epoch, total)
                    if not torch.isfinite(loss):
                        finite = False  # one bad micro-batch poisons the minibatch: skip it whole
                        if not lockstep:
                            break
                    loss.backward()  # in lockstep even a NaN loss: the others' backward waits for ours
                    for key, value in sums.items():
                        totals[key] = totals.get(key, 0.0) + float(value)
                finite = distributed.all_agree(finite)
                norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)) \
                    if finite else None
                if norm is None or not torch.isfinite(norm):
                    optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                    continue
                steps["grad_norm_sum"] = steps.get("grad_norm_sum", 0.0) + float(norm)
                steps["optimizer_steps"] = steps.get("optimizer_steps", 0.0) + 1
                optimizer.step()
                scheduler.step()
        model.eval()
        # grad norms and steps are already global (the same on every process); the rest adds up
        return {**distributed.sum_dict(totals), **steps}, skipped

    def micro_batches(self, rows: torch.Tensor, row_lengths: torch.Tensor | None, lockstep: bool) -> list:
        """`rows` cut into micro-batches: at most grpo.micro_batch_size rows each and, given each row's
        length in tokens, at most grpo.max_tokens_per_micro_batch tokens (rows x the longest), in
        order of length (micro_batches.split_by_tokens); packed (grpo.pack_rows), whole packed rows of
        this step's layout, at most grpo.micro_batch_size of them (RowLayout.micro_batches)."""
        if row_lengths is None:
            return list(rows.split(self.config.micro_batch_size))
        groups = self.layout.micro_batches(row_lengths.to(rows.device)[rows], self.config.max_tokens_per_micro_batch,
                                           self.config.micro_batch_size, "grpo.max_tokens_per_micro_batch", lockstep)
        return [rows[g.to(rows.device)] for g in groups]

    # ------------------------------------------------------------------ stages

    def _next_rows(self, n: int) -> list[dict]:
        while len(self._order) < n:  # epochs of shuffled prompts
            self._order += self.rng.sample(range(len(self.dataset)), len(self.dataset))
        picked, self._order = self._order[:n], self._order[n:]
        return [self.dataset[i] for i in picked]

    def _score(self, rollout: Rollout) -> RewardResult:
        if not self.rewards:  # process supervision alone: every sample is scored by the PRM
            n = rollout.num_samples
            result = RewardResult(torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.bool), {}, {})
            self._check_failed_rollouts(rollout, result)
            return result
        result = score_completions(self.rewards, rollout.prompts, rollout.completions, row_columns(rollout.rows))
        self._check_failed_rollouts(rollout, result)
        local_failures = set(result.all_failed())
        failed_everywhere = {r.name for r in self.rewards if distributed.all_agree(r.name in local_failures)}
        for name in self._failed_streak:
            self._failed_streak[name] = self._failed_streak[name] + 1 if name in failed_everywhere else 0
            if self._failed_streak[name] >= self.config.max_failed_steps:
                raise RewardFailure(
                    f"reward function {name!r} failed on every sample for {self._failed_streak[name]} "
                    f"consecutive steps (last error: {result.errors.get(name)}); fix it or remove it from `rewards`"
                )
        return result

    def _check_failed_rollouts(self, rollout: Rollout, result: RewardResult) -> None:
        """Samples whose rollout failed (Rollout.failed: a tool raised in the harness) get no reward,
        so no advantage and no place in the loss, and the run goes on."""
        if rollout.failed is not None and rollout.failed.any():
            failed = rollout.failed.cpu()
            result.valid = result.valid & ~failed
            result.total = torch.where(failed, torch.nan, result.total)

    def _count_failed_steps(self, rollout: Rollout) -> None:
        """After grpo.max_failed_steps steps in which every sample of the step (all generation
        rounds, every process) failed its rollout, stop, saying what failed."""
        everything = distributed.all_agree(rollout.failed is not None and bool(rollout.failed.all()))
        self._failed_rollout_streak = self._failed_rollout_streak + 1 if everything else 0
        if self._failed_rollout_streak >= self.config.max_failed_steps:
            describe = getattr(self.engine, "failure", None)
            what = (self.remote.last_failure if self.remote is not None else describe() if describe is not None
                    else "") or "the rollout engine failed every sample"
            raise RewardFailure(f"every rollout failed for {self._failed_rollout_streak} consecutive steps: {what}; "
                                "fix it, or run without rollout.tool")

    def reset_reference(self) -> None:
        """pi_ref <- pi_theta, as iterative GRPO does at the start of each iteration (Algorithm 1)."""
        if isinstance(self.ref_model, AdapterDisabledReference):
            raise ValueError("iterative GRPO resets pi_ref to pi_theta, which LoRA's reference (the base model "
                             "under the adapters) cannot follow; use a full fine-tune (model.lora.r=0)")
        if self.ref_model is not None:
            self.ref_model.load_state_dict(self.model.state_dict())

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """What an exact resume needs besides the weights: this process's part (optimizer shards,
        RNG streams); the data order and step are the same on every process."""
        return {
            "global_step": self.global_step,
            "world_size": self.world_size,
            "optimizer": local_tensors(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "sampler": {"rng": self.rng.getstate(), "order": torch.tensor(self._order, dtype=torch.int64)},
            "failed_streak": dict(self._failed_streak),
            "failed_rollout_streak": self._failed_rollout_streak,
            "nonfinite_streak": self._nonfinite_streak,
            **({"rollout_in_flight": self._in_flight,  # and a resumed run's batches not queued again yet
                "rollout_again": [Task(b, -1, -1, rows, seeds).to_dict() for b, (rows, seeds) in self._again.items()]}
               if self.remote is not None else {}),
            "rng": train_state.capture_rng(),
            **self.algorithm.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.global_step = int(state["global_step"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.rng.setstate(train_state.as_tuple(state["sampler"]["rng"]))
        self._order = state["sampler"]["order"].tolist()
        self._failed_streak.update(state["failed_streak"])
        self._failed_rollout_streak = int(state.get("failed_rollout_streak", 0))  # absent before tool rollouts
        self._nonfinite_streak = int(state["nonfinite_streak"])
        if self.remote is not None:  # the batches in flight at the checkpoint; the workers start from this version
            saved = state.get("rollout_in_flight", [])
            self._again, self._dropped_stale = self.remote.restore(saved, self.staleness)
            for entry in state.get("rollout_again", []):
                task = Task.from_dict(entry)
                self._again[task.batch] = (task.rows, task.seeds)
            self._version_floor = self.global_step
        self.algorithm.load_state_dict(state)
        train_state.restore_rng(state["rng"])

    def save_checkpoint(self) -> Path:
        """checkpoints/step-N: HF weights + trainer state + config, atomically; `latest` -> it.
        Every process calls it: rank 0 writes the gathered weights, each process its own state."""
        self.algorithm.before_save()  # gathers what the algorithm saves (collective under FSDP2)
        # the batches in flight, waiting for those a resumed run could not sample again
        self._in_flight = self.remote.in_flight(self.global_step) if self.remote is not None else None
        # the full weights, gathered once (collective under FSDP2; on rank 0)
        self._gathered = full_state_dict(self.model) if is_sharded(self.model) or self.save_merged else None
        try:
            return self.checkpoints.save(self.global_step, self.model, self.tokenizer, self._write_extra_files,
                                         rank_extra=self._write_rank_state, state_dict=self._gathered)
        finally:
            self._gathered = None

    def _write_extra_files(self, directory: Path) -> None:
        """Everything besides the policy that goes into a checkpoint (rank 0)."""
        self.algorithm.save_files(directory)
        if self.save_merged:  # the merged model, loadable with from_pretrained alone
            self.model.get_base_model().save_pretrained(directory / "merged", safe_serialization=True,
                                                        state_dict=merged_state_dict(self.model, self._gathered))
            self.tokenizer.save_pretrained(directory / "merged")
        if (self.run_dir / "config.yaml").is_file():
            shutil.copyfile(self.run_dir / "config.yaml", directory / "config.yaml")

    def _write_rank_state(self, directory: Path) -> None:
        """This process's trainer state: trainer_state.pt on rank 0, trainer_state.rank{r}.pt on rank r."""
        train_state.save_state(self.state_dict(), directory / rank_state_file(self.rank))

    def resume_from(self, checkpoint: str | Path) -> None:
        """Restore trainer state from `checkpoint` (the weights are loaded by the caller) and drop
        metrics rows logged after it, so the log continues exactly where the state does."""
        self.algorithm.load_files(Path(checkpoint))
        self.load_state_dict(train_state.load_state(Path(checkpoint) / rank_state_file(self.rank)))
        if distributed.is_main():
            truncate_metrics(self.run_dir / "metrics.jsonl", self.global_step)
        if self.engine.copies_weights:  # the engine was built from the base (LoRA): give it the resumed adapter
            self.push_weights(self.global_step)
