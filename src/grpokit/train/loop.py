"""The one training loop (Algorithm 1's inner loop) that GRPO and PPO share.

Each step (Trainer.step, top to bottom): sample B prompts -> G completions each through the
rollout engine -> rewards (and a process reward model's step scores) -> the log-probs the update
holds fixed (pi_ref, pi_old) -> the algorithm's advantages -> mu epochs of optimizer steps on the
algorithm's loss -> the algorithm's own model (PPO's critic) -> sync the engine. The loop owns
the policy, its optimizer, forward, backward, the run directory and checkpoints; an algorithm
(train/algorithm.py) owns what differs, and never holds the trainer. The loop's parts each have
their own module: where completions come from (train/sampling.py: local or rollout workers, one
`sample()`), the update (train/update.py, shared with PPO's critic), when a run stops itself
(train/failures.py), packing (train/packing.py) and the metrics row (train/step_metrics.py).

Device discipline: the engine may return tensors anywhere; the rollout and the rewards move
to the policy's device once, here, and every tensor a step creates lives there.

Several processes (torchrun): grpo.prompts_per_step stays the global batch B. Every process
draws the same prompt order from the same seed and takes its own contiguous B / W whole groups,
so advantages need no communication. The counts the loss divides by are summed over processes
before backward, gradients are summed by FSDP2 (models/sharding.py), and the metrics row is
reduced over processes; rank 0 alone writes metrics, trackers, progress bars and checkpoints.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from grpokit import distributed
from grpokit.config import GRPOConfig, RolloutConfig
from grpokit.micro_batches import RowLayout
from grpokit.models.device import model_device
from grpokit.models.lora import AdapterDisabledReference, as_module, is_lora
from grpokit.models.reference import frozen_copy
from grpokit.models.wrapping import is_sharded
from grpokit.rewards import RewardResult, WeightedReward, score_completions
from grpokit.rewards.learned import ProcessRewardModel
from grpokit.rewards.process import is_process_reward
from grpokit.rewards.scoring import row_columns
from grpokit.models.logprobs import token_logprobs
from grpokit.rollout import HFEngine, RolloutEngine, RolloutEngineError
from grpokit.rollout.remote import RemoteRollouts
from grpokit.rollout.wire import RolloutWorkerError
from grpokit.run.checkpoint import CheckpointManager
from grpokit.run.loggers import MetricsLogger, NullLogger
from grpokit.run.metrics import MetricsWriter, NullWriter
from grpokit.run.progress import progress
from grpokit.run.signals import GracefulStop
from grpokit.train import update as updates
from grpokit.train.algorithm import Algorithm, Batch
from grpokit.train.checkpointing import Checkpointing
from grpokit.train.failures import FailureStreaks, drop_failed_rollouts
from grpokit.train.packing import decide_packing, same_attention
from grpokit.train.sampling import (LocalSampler, PromptOrder, RemoteSampler, SamplerContext, push_weights,
                                    sampling_params)
from grpokit.train.schedule import make_optimizer, warmup_constant
from grpokit.train.step_metrics import no_signal_warning, step_record
from grpokit.types import Rollout


@dataclass
class TrainerOptions:
    """How a Trainer runs besides its policy, tokenizer, rewards, prompts, config, run directory and
    algorithm: GRPOTrainer and PPOTrainer take each as a keyword argument."""

    seed: int = 0
    ref_model: torch.nn.Module | None = None  # pi_ref; None: a frozen copy (LoRA: the base under the adapters)
    progress: bool = True
    engine: RolloutEngine | None = None  # None: transformers' generate on the policy
    logger: MetricsLogger | None = None  # experiment trackers (report_to); metrics.jsonl is always written
    rollout_config: RolloutConfig | None = None
    save_merged: bool = False  # LoRA: checkpoints also hold merged/ (base + adapter)
    process_reward: ProcessRewardModel | None = None  # process supervision (eq. 6) from its step scores
    remote: RemoteRollouts | None = None  # rollout workers (rollout.workers > 0), on rank 0


class Trainer(Checkpointing):
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
        **options,
    ):
        """options: TrainerOptions' fields, by name."""
        o = TrainerOptions(**options)
        seed, ref_model, progress, engine, logger = o.seed, o.ref_model, o.progress, o.engine, o.logger
        rollout_config, save_merged, process_reward, remote = o.rollout_config, o.save_merged, o.process_reward, o.remote
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
        self.config = config
        self.progress = progress and distributed.is_main()
        self.run_dir = Path(run_dir)
        if ref_model is None and config.beta > 0:  # LoRA: the base model under the adapters, no copy
            ref_model = AdapterDisabledReference(model) if is_lora(model) else frozen_copy(model)
        self.ref_model = ref_model
        self.save_merged = save_merged and is_lora(model)  # checkpoints also hold merged/ (base + adapter)
        self._gathered: dict | None = None
        engine = engine if engine is not None else HFEngine(model, tokenizer)
        self.rollout_config = rollout_config or RolloutConfig()
        # experiment trackers (report_to); metrics.jsonl is always written, by rank 0
        self.logger = (logger or NullLogger()) if distributed.is_main() else NullLogger()
        self.optimizer = make_optimizer(model, config.learning_rate, config.weight_decay)
        self.scheduler = warmup_constant(self.optimizer, config.warmup_steps)
        self.failures = FailureStreaks([r.name for r in rewards], config.max_failed_steps, config.max_nonfinite_steps)
        self._warned_no_signal = False
        self._pack: bool | None = None  # grpo.pack_rows, decided on the first batch (decide_packing)
        self.layout = RowLayout()  # this step's: packed or padded rows, and the tokens its forwards computed
        self.global_step = 0
        self.interrupted = False  # set when a signal stopped train() early
        # set by the pipeline: (step) -> metrics that join the step's row (the periodic held-out evaluation)
        self.after_step: Callable[[int], dict] | None = None
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep_last=config.save_total_limit)
        self.sampling = sampling_params(config, self.rollout_config.shared_prefill)
        self.process_reward = process_reward  # set: process supervision (eq. 6) from its step scores
        # rollout workers (rollout.workers > 0) sample on a fixed schedule of policy versions while this
        # process learns; otherwise this process's engine samples each step's batch
        self.prompts = PromptOrder(dataset, seed)
        context = SamplerContext(model, engine, self.prompts, config, self._score, seed, self.checkpoints.latest,
                                 self.rank, self.world_size)
        self.sampler = (
            RemoteSampler(context, remote, self.rollout_config.staleness)
            if remote is not None or self.rollout_config.workers else
            LocalSampler(context, self.sampling, tokenizer.pad_token_id))
        self.algorithm = algorithm
        algorithm.setup(model, config, self.rollout_config)

    # The rollout engine and the prompts live in the sampler and its prompt order; these read and replace
    # them there (evaluation reads the engine; a test or a script may swap either between steps).
    @property
    def engine(self) -> RolloutEngine:
        return self.sampler.engine

    @engine.setter
    def engine(self, engine: RolloutEngine) -> None:
        self.sampler.engine = engine

    @property
    def dataset(self) -> list[dict]:
        return self.prompts.dataset

    @dataset.setter
    def dataset(self, dataset: list[dict]) -> None:
        self.prompts.dataset = dataset

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
                       enabled=self.progress)
        writer = MetricsWriter(self.run_dir / "metrics.jsonl") if distributed.is_main() else NullWriter()
        with GracefulStop(f"the current {self.algorithm.name.upper()} step") as stop, writer:
            while self.global_step < until:
                record = {**(extra_metrics or {}), **self._naming_worker_failures(self.step)}
                if self.after_step is not None:
                    record.update(self.after_step(self.global_step))
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
        self.sampler.ready_for_eval(self.global_step)  # the evaluation after RL
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
        start = time.perf_counter()
        timings = {"perf/rollout_time_s": 0.0, "perf/scoring_time_s": 0.0}
        rollout, result, sampling = self.sampler.sample(self.global_step, timings)
        self.failures.count_rollouts(rollout, self.sampler.failure)
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
        stats = self.update_policy(batch, advantages)
        stats.update(self.algorithm.update_own_model(batch, self.update))
        stats.update(algorithm_stats)
        timings["perf/update_time_s"] = time.perf_counter() - t

        timings.update(self.sampler.sync(self.global_step + 1))  # the next batch samples the updated policy
        self.global_step += 1
        self.failures.count_updates(stats["skipped_updates"], self.global_step, self.checkpoints.latest)
        seconds = time.perf_counter() - start
        perf = {"perf/padding_frac": self.layout.computed.padding_frac, **timings,
                **self.sampler.step_metrics(timings, seconds), "lr": self.scheduler.get_last_lr()[0]}
        return step_record(self.global_step, rollout, result, self.config.num_generations, seconds,
                           {"update": stats, "sampling": sampling, "perf": perf})

    def push_weights(self, step: int) -> None:
        """Load the policy into a separate engine and check it arrived (train/sampling.py, push_weights)."""
        push_weights(self.engine, self.model, step, self.checkpoints.latest)

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
        """Whether this run's forwards pack rows (grpo.pack_rows), decided on the first batch."""
        if self._pack is None:
            self._pack = decide_packing(self.config.pack_rows, self.model, rollout, self.tokenizer.pad_token_id,
                                        self.config.max_tokens_per_micro_batch, self.world_size)
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

    def policy_micro_loss(self, batch: Batch, advantages: torch.Tensor):
        """micro_loss(rows, epoch, total) for update() (train/update.py, policy_micro_loss)."""
        return updates.policy_micro_loss(self.model, self.algorithm, self.config, batch, advantages)

    def update_policy(self, batch: Batch, advantages: torch.Tensor) -> dict:
        """mu epochs of policy updates of the batch through update(); the step's policy metrics."""
        return updates.policy_metrics(*self.update(updates.Optimized(self.model, self.optimizer, self.scheduler),
                                                   batch, self.policy_micro_loss(batch, advantages)))

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

    def update(self, target: updates.Optimized, batch: Batch, micro_loss, token_weighted: bool = False
               ) -> tuple[dict, int]:
        """The one update loop (train/update.py, update) under this run's config: for the policy, and
        handed to the algorithm for a model of its own (PPO's critic)."""
        return updates.update(target, batch, micro_loss, self.config, token_weighted)

    # ------------------------------------------------------------------ rewards

    def _score(self, rollout: Rollout) -> RewardResult:
        if not self.rewards:  # process supervision alone: every sample is scored by the PRM
            n = rollout.num_samples
            result = RewardResult(torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.bool), {}, {})
            drop_failed_rollouts(rollout, result)
            return result
        ids = [row[mask.bool()].tolist() for row, mask in zip(rollout.completion_ids, rollout.completion_mask)]
        result = score_completions(self.rewards, rollout.prompts, rollout.completions, row_columns(rollout.rows), ids)
        drop_failed_rollouts(rollout, result)
        self.failures.count_rewards(result)
        return result

    def reset_reference(self) -> None:
        """pi_ref <- pi_theta, as iterative GRPO does at the start of each iteration (Algorithm 1)."""
        if isinstance(self.ref_model, AdapterDisabledReference):
            raise ValueError("iterative GRPO resets pi_ref to pi_theta, which LoRA's reference (the base model "
                             "under the adapters) cannot follow; use a full fine-tune (model.lora.r=0)")
        if self.ref_model is not None:
            self.ref_model.load_state_dict(self.model.state_dict())
