"""The GRPO loop of SPEC.md (Algorithm 1), with outcome or process supervision.

Each step: sample B prompts -> G completions each from pi_old -> rewards -> group-relative
advantages (eq. 5, or eq. 6 from a process reward model's step scores) -> mu updates of the
clipped objective with k3 KL to a frozen pi_ref (eq. 3-4). pi_old is theta at sampling time.
"""

from __future__ import annotations

import copy
import random
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from grpokit.checkpoint import TRAINER_STATE, CheckpointManager
from grpokit.config import GRPOConfig
from grpokit.math import grpo_loss, masked_outcome_advantages, process_advantages
from grpokit.metrics import MetricsWriter, truncate_metrics
from grpokit.rewards import RewardResult, WeightedReward, score_completions
from grpokit.rewards.learned import ProcessRewardModel, policy_step_ends
from grpokit.rewards.scoring import row_columns
from grpokit.rollout import SamplingParams, sample_groups, token_logprobs
from grpokit.signals import GracefulStop
from grpokit.train import state as train_state
from grpokit.train.schedule import make_optimizer, warmup_constant
from grpokit.types import Rollout


class RewardFailure(RuntimeError):
    """A reward function failed on every sample for too many consecutive steps."""


class NonFiniteTraining(FloatingPointError):
    """The loss or gradients were NaN/inf for too many consecutive steps."""


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def zero_std_fraction(rewards: torch.Tensor, valid: torch.Tensor, group_size: int) -> float:
    """Share of groups whose valid rewards are all equal: they get zero advantage."""
    r = torch.where(valid, rewards, torch.nan).view(-1, group_size)
    spread = torch.nan_to_num(r.nan_to_num(-torch.inf).amax(1) - r.nan_to_num(torch.inf).amin(1), nan=0.0)
    return float(((spread <= 0) | (valid.view(-1, group_size).sum(1) < 2)).float().mean())


def step_advantages(tokenizer, completion_ids: torch.Tensor, lengths: torch.Tensor, step_scores: list,
                    group_size: int) -> torch.Tensor:
    """Process advantages (eq. 6) on the policy's sampled tokens: each StepScores' character step
    ends are mapped onto completion_ids [N, T] (see policy_step_ends), then normalised over the
    group's steps and summed over the steps at or after each token. Returns [N, T] float32."""
    lengths = [int(n) for n in lengths]
    ends = [policy_step_ends(tokenizer, completion_ids[i, :n].tolist(), s.char_ends) if n else []
            for i, (n, s) in enumerate(zip(lengths, step_scores))]
    rewards = [s.rewards if n else [] for n, s in zip(lengths, step_scores)]
    token_adv = process_advantages(rewards, ends, lengths, group_size).float()
    return torch.nn.functional.pad(token_adv, (0, completion_ids.shape[1] - token_adv.shape[1]))


class GRPOTrainer:
    """Owns the policy, the frozen reference, the optimizer and the run directory."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        rewards: list[WeightedReward],
        dataset: list[dict],
        config: GRPOConfig,
        run_dir: str | Path,
        seed: int = 0,
        ref_model: torch.nn.Module | None = None,
        progress: bool = True,
        process_reward: ProcessRewardModel | None = None,
    ):
        if not dataset:
            raise ValueError("GRPO needs a non-empty dataset of rows with a 'prompt' field")
        missing = [i for i, row in enumerate(dataset[:1000]) if "prompt" not in row]
        if missing:
            raise ValueError(f"dataset rows {missing[:5]} have no 'prompt' field")
        if not rewards and process_reward is None:
            raise ValueError("GRPO needs a reward: rule-based functions under `rewards`, a reward model, or both")
        self.model, self.tokenizer, self.rewards = model, tokenizer, rewards
        self.process_reward = process_reward  # set: process supervision (eq. 6) from its step scores
        self.dataset, self.config, self.progress = dataset, config, progress
        self.run_dir = Path(run_dir)
        self.ref_model = ref_model if ref_model is not None else (frozen_copy(model) if config.beta > 0 else None)
        self.optimizer = make_optimizer(model, config.learning_rate, config.weight_decay)
        self.scheduler = warmup_constant(self.optimizer, config.warmup_steps)
        self.rng = random.Random(seed)
        self._order: list[int] = []
        self._failed_streak = {r.name: 0 for r in rewards}
        self._nonfinite_streak = 0
        self.global_step = 0
        self.interrupted = False  # set when a signal stopped train() early
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep_last=config.save_total_limit)
        self.sampling = SamplingParams(
            max_new_tokens=config.max_completion_length,
            temperature=config.temperature,
            top_p=config.top_p,
            batch_size=config.generation_batch_size,
        )

    # ------------------------------------------------------------------ the loop

    def train(self, until: int | None = None, extra_metrics: dict | None = None) -> list[dict]:
        """Run to step `until` (default `max_steps`), one metrics.jsonl row a step (plus
        `extra_metrics`, e.g. the iteration); checkpoint every `save_steps` and at the end.
        SIGINT/SIGTERM finish the step, save, and return with `interrupted` set."""
        cfg = self.config
        until = cfg.max_steps if until is None else until
        history = []
        saved_at = None
        bar = tqdm(total=until, initial=self.global_step, desc="grpo", disable=not self.progress,
                   dynamic_ncols=True)
        with GracefulStop("the current GRPO step") as stop, MetricsWriter(self.run_dir / "metrics.jsonl") as writer:
            while self.global_step < until:
                record = {**(extra_metrics or {}), **self.step()}
                history.append(record)
                writer.write(record)
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward/mean']:.3f}", kl=f"{record['kl']:.4f}")
                if (cfg.save_steps and self.global_step % cfg.save_steps == 0) or stop.requested:
                    saved_at = self.save_checkpoint()
                if stop.requested:
                    self.interrupted = True
                    print(f"grpokit: stopped after step {self.global_step}; checkpoint {saved_at}\n"
                          f"resume with: grpokit train {self.run_dir / 'config.yaml'} --resume", file=sys.stderr)
                    break
        bar.close()
        if saved_at is None or saved_at.name != f"step-{self.global_step}":  # the final step, unless just saved
            self.save_checkpoint()
        return history

    def step(self) -> dict:
        cfg, g = self.config, self.config.num_generations
        start = time.perf_counter()
        rows = self._next_rows(cfg.prompts_per_step)
        rollout = sample_groups(self.model, self.tokenizer, [r["prompt"] for r in rows], g, self.sampling, rows)
        timings = {"perf/rollout_time_s": time.perf_counter() - start}

        t = time.perf_counter()
        result = self._score(rollout)
        if self.process_reward is not None:
            result.step_scores = self.process_reward.score_steps(rollout.prompts, rollout.completions)
            if not self.rewards:  # for the log and progress bar only: each completion's mean step score
                result.total = torch.tensor([sum(s.rewards) / len(s.rewards) for s in result.step_scores],
                                            dtype=torch.float64)
        timings["perf/scoring_time_s"] = time.perf_counter() - t
        loss_mask = rollout.completion_mask * result.valid.unsqueeze(1)
        if cfg.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.truncated).unsqueeze(1)
        stats = self.learn(rollout, result, loss_mask, timings)
        self.global_step += 1
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
            **self._process_metrics(result),
            **stats,
            "completion/mean_length": float(lengths.mean()),
            "completion/max_length": int(lengths.max()),
            "completion/truncated_frac": float(rollout.truncated.float().mean()),
            "perf/tokens_per_s": float(lengths.sum()) / seconds,
            "perf/step_time_s": seconds,
            **timings,
            "lr": self.scheduler.get_last_lr()[0],
        }
        return record

    def learn(self, rollout: Rollout, result: RewardResult, loss_mask: torch.Tensor, timings: dict) -> dict:
        """GRPO's part of the step: group-relative advantages (eq. 5), then mu clipped updates with
        the k3 KL in the loss (eq. 3-4). Fills timings' logprob and update seconds."""
        advantages = self._advantages(rollout, result)
        t = time.perf_counter()
        ref_logp, old_logp = self._fixed_logprobs(rollout)
        timings["perf/logprob_time_s"] = time.perf_counter() - t
        t = time.perf_counter()
        stats = self._update(rollout, advantages, loss_mask, ref_logp, old_logp)
        timings["perf/update_time_s"] = time.perf_counter() - t
        return stats

    def _advantages(self, rollout: Rollout, result: RewardResult) -> torch.Tensor:
        """[N] outcome advantages (eq. 5) of the summed rewards; with a process reward model,
        [N, T] process advantages (eq. 6) of its step scores, plus the outcome advantages of
        any rule-based rewards configured beside it."""
        cfg = self.config
        outcome = masked_outcome_advantages(result.total.float(), result.valid, cfg.num_generations,
                                            scale=cfg.scale_rewards)
        if self.process_reward is None:
            return outcome
        token_adv = step_advantages(self.tokenizer, rollout.completion_ids, rollout.completion_lengths,
                                    result.step_scores, cfg.num_generations)
        return token_adv + outcome.unsqueeze(1) if self.rewards else token_adv

    @staticmethod
    def _process_metrics(result: RewardResult) -> dict:
        if result.step_scores is None:
            return {}
        steps = [len(s.rewards) for s in result.step_scores]
        flat = [r for s in result.step_scores for r in s.rewards]
        return {
            "process/steps_mean": sum(steps) / max(1, len(steps)),
            "process/step_reward_mean": sum(flat) / max(1, len(flat)),
            "process/no_delimiter": sum(not s.has_delimiter for s in result.step_scores),
        }

    def reset_reference(self) -> None:
        """pi_ref <- pi_theta, as iterative GRPO does at the start of each iteration (Algorithm 1)."""
        if self.ref_model is not None:
            self.ref_model.load_state_dict(self.model.state_dict())

    # ------------------------------------------------------------------ stages

    def _next_rows(self, n: int) -> list[dict]:
        while len(self._order) < n:  # epochs of shuffled prompts
            self._order += self.rng.sample(range(len(self.dataset)), len(self.dataset))
        picked, self._order = self._order[:n], self._order[n:]
        return [self.dataset[i] for i in picked]

    def _score(self, rollout: Rollout) -> RewardResult:
        if not self.rewards:  # process supervision alone: every sample is scored by the PRM
            n = rollout.num_samples
            return RewardResult(torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.bool), {}, {})
        result = score_completions(self.rewards, rollout.prompts, rollout.completions, row_columns(rollout.rows))
        failed_everywhere = set(result.all_failed())
        for name in self._failed_streak:
            self._failed_streak[name] = self._failed_streak[name] + 1 if name in failed_everywhere else 0
            if self._failed_streak[name] >= self.config.max_failed_steps:
                raise RewardFailure(
                    f"reward function {name!r} failed on every sample for {self._failed_streak[name]} "
                    f"consecutive steps (last error: {result.errors.get(name)}); fix it or remove it from `rewards`"
                )
        return result

    @torch.no_grad()
    def _fixed_logprobs(self, rollout: Rollout, need_old: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Reference log-probs once per batch; pi_old log-probs only when samples are reused (or
        `need_old`, as PPO's reward needs them)."""
        cfg = self.config
        args = (rollout.input_ids, rollout.attention_mask, rollout.prompt_length, cfg.temperature, cfg.micro_batch_size)
        ref_logp = token_logprobs(self.ref_model, *args)[0] if cfg.beta > 0 else None
        # With one update on one minibatch, pi_old = pi_theta exactly: use logp.detach() instead.
        reuse = need_old or cfg.num_iterations > 1 or cfg.num_minibatches > 1
        old_logp = token_logprobs(self.model, *args)[0] if reuse else None
        return ref_logp, old_logp

    def _update(self, rollout, advantages, loss_mask, ref_logp, old_logp, beta: float | None = None) -> dict:
        """mu epochs of clipped policy updates over minibatches; beta=None takes grpo.beta
        (PPO passes 0: its KL lives in the reward)."""
        cfg = self.config
        beta = cfg.beta if beta is None else beta
        n = rollout.num_samples
        totals: dict[str, float] = {}
        counted = 0
        entropy_sum, entropy_tokens = 0.0, 0.0
        grad_norms = []
        skipped = 0
        self.model.train()
        for iteration in range(cfg.num_iterations):
            for minibatch in torch.randperm(n).chunk(cfg.num_minibatches):
                denominator = self._denominator(loss_mask[minibatch])
                if denominator == 0:
                    continue  # every sample of this minibatch failed its reward
                self.optimizer.zero_grad(set_to_none=True)
                finite = True
                for micro in minibatch.split(cfg.micro_batch_size):
                    mask = loss_mask[micro]
                    logp, entropy = token_logprobs(
                        self.model, rollout.input_ids[micro], rollout.attention_mask[micro],
                        rollout.prompt_length, cfg.temperature, len(micro), with_entropy=iteration == 0,
                    )
                    loss, stats = grpo_loss(
                        logp,
                        old_logp[micro] if old_logp is not None else logp.detach(),
                        ref_logp[micro] if ref_logp is not None else None,
                        advantages[micro],
                        mask,
                        clip_eps=cfg.epsilon,
                        beta=beta,
                        clip_eps_high=cfg.epsilon_high,
                        aggregation=cfg.loss_aggregation,
                    )
                    if not torch.isfinite(loss):
                        finite = False  # one bad micro-batch poisons the minibatch: skip it whole
                        break
                    # Micro-batch losses are means; reweight so their sum is the minibatch mean.
                    (loss * (self._denominator(mask) / denominator)).backward()
                    for key in ("kl", "clip_fraction", "ratio_mean"):
                        totals[key] = totals.get(key, 0.0) + float(stats[key]) * float(stats["tokens"])
                    totals["loss"] = totals.get("loss", 0.0) + float(loss.detach()) * float(stats["tokens"])
                    counted += float(stats["tokens"])
                    if entropy is not None:
                        cm = rollout.completion_mask[micro].float()
                        entropy_sum += float((entropy * cm).sum())
                        entropy_tokens += float(cm.sum())
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm) if finite else None
                if norm is None or not torch.isfinite(norm):
                    self.optimizer.zero_grad(set_to_none=True)  # never let a NaN/inf reach the weights
                    skipped += 1
                    continue
                grad_norms.append(float(norm))
                self.optimizer.step()
                self.scheduler.step()
        self.model.eval()
        out = {k: v / counted for k, v in totals.items()} if counted else {"kl": 0.0, "clip_fraction": 0.0,
                                                                          "ratio_mean": 1.0, "loss": 0.0}
        out["entropy"] = entropy_sum / entropy_tokens if entropy_tokens else float("nan")
        out["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
        out["skipped_updates"] = skipped
        return out

    def _denominator(self, mask: torch.Tensor) -> float:
        """What the loss averages over: non-empty rows (sequence) or tokens (token)."""
        if self.config.loss_aggregation == "sequence":
            return float((mask.sum(dim=1) > 0).sum())
        return float(mask.sum())

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """What an exact resume needs besides the weights."""
        return {
            "global_step": self.global_step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": {"rng": self.rng.getstate(), "order": torch.tensor(self._order, dtype=torch.int64)},
            "failed_streak": dict(self._failed_streak),
            "nonfinite_streak": self._nonfinite_streak,
            "rng": train_state.capture_rng(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.global_step = int(state["global_step"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.rng.setstate(train_state.as_tuple(state["sampler"]["rng"]))
        self._order = state["sampler"]["order"].tolist()
        self._failed_streak.update(state["failed_streak"])
        self._nonfinite_streak = int(state["nonfinite_streak"])
        train_state.restore_rng(state["rng"])

    def save_checkpoint(self) -> Path:
        """checkpoints/step-N: HF weights + trainer state + config, atomically; `latest` -> it."""

        return self.checkpoints.save(self.global_step, self.model, self.tokenizer, self._write_extra_files)

    def _write_extra_files(self, directory: Path) -> None:
        """Everything besides the policy that goes into a checkpoint (subclasses add models)."""
        train_state.save_state(self.state_dict(), directory / TRAINER_STATE)
        if (self.run_dir / "config.yaml").is_file():
            shutil.copyfile(self.run_dir / "config.yaml", directory / "config.yaml")

    def resume_from(self, checkpoint: str | Path) -> None:
        """Restore trainer state from `checkpoint` (the weights are loaded by the caller) and drop
        metrics rows logged after it, so the log continues exactly where the state does."""
        self.load_state_dict(train_state.load_state(Path(checkpoint) / TRAINER_STATE))
        truncate_metrics(self.run_dir / "metrics.jsonl", self.global_step)
