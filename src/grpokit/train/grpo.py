"""The GRPO loop of SPEC.md (Algorithm 1), outcome supervision.

Each step: sample B prompts -> G completions each from pi_old -> rewards -> group-relative
advantages (eq. 5) -> mu updates of the clipped objective with k3 KL to a frozen pi_ref
(eq. 3-4). pi_old is theta at sampling time.
"""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from grpokit.checkpoint import save_checkpoint
from grpokit.config import GRPOConfig
from grpokit.math import grpo_loss, masked_outcome_advantages
from grpokit.metrics import MetricsWriter
from grpokit.rewards import RewardResult, WeightedReward, score_completions
from grpokit.rollout import SamplingParams, sample_groups, token_logprobs
from grpokit.train.schedule import make_optimizer, warmup_constant
from grpokit.types import Rollout


class RewardFailure(RuntimeError):
    """A reward function failed on every sample for too many consecutive steps."""


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
    ):
        if not dataset:
            raise ValueError("GRPO needs a non-empty dataset of rows with a 'prompt' field")
        missing = [i for i, row in enumerate(dataset[:1000]) if "prompt" not in row]
        if missing:
            raise ValueError(f"dataset rows {missing[:5]} have no 'prompt' field")
        self.model, self.tokenizer, self.rewards = model, tokenizer, rewards
        self.dataset, self.config, self.progress = dataset, config, progress
        self.run_dir = Path(run_dir)
        self.ref_model = ref_model if ref_model is not None else (frozen_copy(model) if config.beta > 0 else None)
        self.optimizer = make_optimizer(model, config.learning_rate, config.weight_decay)
        self.scheduler = warmup_constant(self.optimizer, config.warmup_steps)
        self.rng = random.Random(seed)
        self._order: list[int] = []
        self._failed_streak = {r.name: 0 for r in rewards}
        self.global_step = 0
        self.sampling = SamplingParams(
            max_new_tokens=config.max_completion_length,
            temperature=config.temperature,
            top_p=config.top_p,
            batch_size=config.generation_batch_size,
        )

    # ------------------------------------------------------------------ the loop

    def train(self, eval_callback=None) -> list[dict]:
        """Run `max_steps` steps, logging each to metrics.jsonl; save the final checkpoint."""
        writer = MetricsWriter(self.run_dir / "metrics.jsonl")
        history = []
        bar = tqdm(range(self.config.max_steps), desc="grpo", disable=not self.progress, dynamic_ncols=True)
        try:
            for _ in bar:
                record = self.step()
                history.append(record)
                writer.write(record)
                bar.set_postfix(reward=f"{record['reward/mean']:.3f}", kl=f"{record['kl']:.4f}")
                if self.config.save_steps and self.global_step % self.config.save_steps == 0:
                    self.save(self.run_dir / "checkpoints" / f"step-{self.global_step}")
        finally:
            writer.close()
        saved_in_loop = self.config.save_steps and self.global_step % self.config.save_steps == 0
        if not saved_in_loop or self.global_step == 0:
            self.save(self.run_dir / "checkpoints" / f"step-{self.global_step}")
        return history

    def step(self) -> dict:
        cfg, g = self.config, self.config.num_generations
        start = time.perf_counter()
        rows = self._next_rows(cfg.prompts_per_step)
        rollout = sample_groups(self.model, self.tokenizer, [r["prompt"] for r in rows], g, self.sampling, rows)
        rollout_seconds = time.perf_counter() - start

        result = self._score(rollout)
        advantages = masked_outcome_advantages(result.total.float(), result.valid, g, scale=cfg.scale_rewards)
        loss_mask = rollout.completion_mask * result.valid.unsqueeze(1)
        if cfg.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.truncated).unsqueeze(1)

        ref_logp, old_logp = self._fixed_logprobs(rollout)
        stats = self._update(rollout, advantages, loss_mask, ref_logp, old_logp)
        self.global_step += 1

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
            **stats,
            "completion/mean_length": float(lengths.mean()),
            "completion/max_length": int(lengths.max()),
            "completion/truncated_frac": float(rollout.truncated.float().mean()),
            "perf/tokens_per_s": float(lengths.sum()) / seconds,
            "perf/step_time_s": seconds,
            "perf/rollout_time_s": rollout_seconds,
            "lr": self.scheduler.get_last_lr()[0],
        }
        return record

    # ------------------------------------------------------------------ stages

    def _next_rows(self, n: int) -> list[dict]:
        while len(self._order) < n:  # epochs of shuffled prompts
            self._order += self.rng.sample(range(len(self.dataset)), len(self.dataset))
        picked, self._order = self._order[:n], self._order[n:]
        return [self.dataset[i] for i in picked]

    def _score(self, rollout: Rollout) -> RewardResult:
        keys = [k for k in rollout.rows[0] if k != "prompt"] if rollout.rows else []
        columns = {k: [row.get(k) for row in rollout.rows] for k in keys}
        result = score_completions(self.rewards, rollout.prompts, rollout.completions, columns)
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
    def _fixed_logprobs(self, rollout: Rollout) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Reference log-probs once per batch; pi_old log-probs only when samples are reused."""
        cfg = self.config
        args = (rollout.input_ids, rollout.attention_mask, rollout.prompt_length, cfg.temperature, cfg.micro_batch_size)
        ref_logp = token_logprobs(self.ref_model, *args)[0] if cfg.beta > 0 else None
        # With one update on one minibatch, pi_old = pi_theta exactly: use logp.detach() instead.
        reuse = cfg.num_iterations > 1 or cfg.num_minibatches > 1
        old_logp = token_logprobs(self.model, *args)[0] if reuse else None
        return ref_logp, old_logp

    def _update(self, rollout, advantages, loss_mask, ref_logp, old_logp) -> dict:
        cfg = self.config
        n = rollout.num_samples
        totals: dict[str, float] = {}
        counted = 0
        entropy_sum, entropy_tokens = 0.0, 0.0
        grad_norms = []
        self.model.train()
        for iteration in range(cfg.num_iterations):
            for minibatch in torch.randperm(n).chunk(cfg.num_minibatches):
                denominator = self._denominator(loss_mask[minibatch])
                if denominator == 0:
                    continue  # every sample of this minibatch failed its reward
                self.optimizer.zero_grad(set_to_none=True)
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
                        beta=cfg.beta,
                        clip_eps_high=cfg.epsilon_high,
                        aggregation=cfg.loss_aggregation,
                    )
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
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                if not torch.isfinite(norm):
                    raise FloatingPointError(
                        f"GRPO gradient norm is {float(norm)} at step {self.global_step}; lower grpo.learning_rate"
                    )
                grad_norms.append(float(norm))
                self.optimizer.step()
                self.scheduler.step()
        self.model.eval()
        out = {k: v / counted for k, v in totals.items()} if counted else {"kl": 0.0, "clip_fraction": 0.0,
                                                                          "ratio_mean": 1.0, "loss": 0.0}
        out["entropy"] = entropy_sum / entropy_tokens if entropy_tokens else float("nan")
        out["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
        return out

    def _denominator(self, mask: torch.Tensor) -> float:
        """What the loss averages over: non-empty rows (sequence) or tokens (token)."""
        if self.config.loss_aggregation == "sequence":
            return float((mask.sum(dim=1) > 0).sum())
        return float(mask.sum())

    def save(self, path: str | Path) -> Path:
        return save_checkpoint(self.model, self.tokenizer, path)
